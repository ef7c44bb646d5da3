# Sourced by the scripts in this folder: go to the repo root, find hatch (or bootstrap it),
# and create the hatch environment when it is missing. Needs only Python 3.11+ with pip and venv.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
HATCH_MIN="1.16"   # workspace.members

say() { echo "[kiln] $*" >&2; }

# true when $1 is a working hatch of at least $HATCH_MIN
hatch_ok() {
  local v
  v="$("$1" --version 2>/dev/null)" || return 1
  v="${v##* }"
  [[ "$(printf '%s\n%s\n' "$HATCH_MIN" "$v" | sort -V | head -n1)" == "$HATCH_MIN" ]]
}

find_hatch() {
  if [[ -n "${HATCH:-}" ]] && hatch_ok "$HATCH"; then return; fi
  if command -v hatch >/dev/null 2>&1 && hatch_ok hatch; then HATCH=hatch; return; fi
  HATCH="$ROOT/.bootstrap/bin/hatch"
  if hatch_ok "$HATCH"; then return; fi
  command -v "$PYTHON" >/dev/null 2>&1 || { say "no '$PYTHON' on PATH: install Python 3.11+ or set PYTHON=/path/to/python3"; exit 1; }
  [[ "$("$PYTHON" -c 'import sys; print(sys.version_info >= (3, 11))' 2>/dev/null)" == True ]] || { say "$PYTHON is $("$PYTHON" --version 2>&1); kiln needs Python 3.11+ (set PYTHON=...)"; exit 1; }
  say "hatch not found: installing hatch>=$HATCH_MIN into .bootstrap/ with $PYTHON"
  rm -rf .bootstrap
  "$PYTHON" -m venv .bootstrap
  .bootstrap/bin/python -m pip install --quiet "hatch>=$HATCH_MIN"
  hatch_ok "$HATCH" || { say "bootstrap failed: $HATCH does not run"; exit 1; }
}

find_hatch
export HATCH
if ! "$HATCH" env find default >/dev/null 2>&1 || [[ ! -d "$("$HATCH" env find default)" ]]; then
  say "creating the hatch environment (six packages editable + dev tools); this takes a minute once"
  "$HATCH" env create default
fi
