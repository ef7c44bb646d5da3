"""The ONNX edge cases' runner: out-of-range Gather indices (gather_cases.py), constants in external data, valid and
hostile (extdata_cases.py), and reductions over element counts at 2**31 and 2**32 (boundary_cases.py), each kind drawn by
hypothesis (seeded like kfuzz's kernels) and run under guard pages. kfuzz.py's main and scripts/fuzz call it
(--gather G --extdata E --boundary B); test_fuzz.py runs a few of each in CI.

A failing gather or extdata case is shrunk and the run stops there, as kfuzz's do. Boundary cases take seconds each,
so they are not shrunk (a case is a handful of numbers already) and every one runs: all the failures come back. A case
is a JSON-able dict; a failure is written as {"kind", "case", "error"} and replays with scripts/fuzz --replay FILE."""
from __future__ import annotations

import hashlib
import importlib
import json
import time
import traceback
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

KINDS = {"gather": "gather_cases", "extdata": "extdata_cases", "boundary": "boundary_cases"}
COUNTS = {k: 0 for k in KINDS}


def module(kind: str) -> Any:
  name = KINDS[kind]  # beside this module: in the tests.fuzz package (pytest), or on the path of the script scripts/fuzz runs
  return importlib.import_module(f"{__package__}.{name}" if __package__ else name)


def check(kind: str, case: dict[str, Any], guard: bool = True) -> str | None:
  """What went wrong with one case (None: nothing); an exception out of the check is a failure too, with its traceback."""
  try: return module(kind).check(case, guard)  # type: ignore[no-any-return]
  except Exception as e: return f"{type(e).__name__}: {str(e)[:500]}\n{traceback.format_exc(limit=-4)}"


def fuzz(kind: str, n: int, seed_: int | None = None, guard: bool = True, inflight: Path | None = None,
         progress: bool = False) -> list[tuple[dict[str, Any], str]]:
  """n cases of one kind; the failures as (case, what went wrong): at most one, shrunk, except for boundary cases, which
  print a line each with progress=True (they take seconds)."""
  fails: list[tuple[dict[str, Any], str]] = []
  if n <= 0: return fails
  keep_going = kind == "boundary"

  def body(case: dict[str, Any]) -> None:
    COUNTS[kind] += 1
    if inflight is not None:  # a guard fault kills the process: the case stays here for --replay
      inflight.parent.mkdir(parents=True, exist_ok=True)
      inflight.write_text(json.dumps({"kind": kind, "case": case, "error": "the process died running this case (a guard page fault?)"}))
    t0 = time.perf_counter()
    msg = check(kind, case, guard)
    if progress and keep_going:
      what = "ok" if msg is None else "FAIL " + msg[:160]
      print(f"  {kind} {COUNTS[kind]}: {time.perf_counter() - t0:5.1f} s {json.dumps(case)}: {what}", flush=True)
    if msg:
      fails.append((case, msg))
      if not keep_going: raise AssertionError(msg)

  phases = [Phase.explicit, Phase.generate] + ([] if keep_going else [Phase.shrink])
  test = settings(max_examples=n, deadline=None, database=None, derandomize=seed_ is None, phases=phases, print_blob=False,
                  suppress_health_check=list(HealthCheck))(given(module(kind).cases())(body))
  if seed_ is not None: test = seed(seed_)(test)
  try: test()
  except Exception:
    if not fails: raise
  return fails if keep_going else fails[-1:]  # hypothesis runs the shrunk case last


def write_failure(kind: str, case: dict[str, Any], msg: str, out_dir: Path) -> Path:
  out_dir.mkdir(parents=True, exist_ok=True)
  d = {"kind": kind, "case": case, "error": msg}
  p = out_dir / f"fuzz-{kind}-{hashlib.sha256(json.dumps(case, sort_keys=True).encode()).hexdigest()[:12]}.json"
  p.write_text(json.dumps(d, indent=1))
  return p


def replay(d: dict[str, Any], guard: bool = True) -> int:
  msg = check(d["kind"], d["case"], guard)
  print(f"  {d['kind']}: {'ok' if msg is None else 'FAIL ' + msg}")
  return 0 if msg is None else 1


def add_args(ap: Any) -> None:
  ap.add_argument("--gather", type=int, default=None, help="ONNX Gather/embedding cases with indices at and past the axis's ends (default n // 4)")
  ap.add_argument("--extdata", type=int, default=None, help="ONNX models with constants in external data, valid and hostile (default n // 4)")
  ap.add_argument("--boundary", type=int, default=None,
                  help="reductions over 2**31-1 .. 2**32+k broadcast elements, seconds to a minute each (default n // 100)")


def run(a: Any, guard: bool, inflight: Path | None) -> int:
  """The three kinds at the counts of the parsed arguments `a` (needs onnxruntime); 1 if any case failed."""
  import importlib.util
  counts = {"gather": a.gather, "extdata": a.extdata, "boundary": a.boundary}
  defaults = {"gather": a.n // 4, "extdata": a.n // 4, "boundary": a.n // 100}
  counts = {k: defaults[k] if v is None else v for k, v in counts.items()}
  if any(counts.values()) and importlib.util.find_spec("onnxruntime") is None:
    print("kiln fuzz: onnxruntime is not installed: ONNX edge cases skipped")
    return 0
  rc = 0
  for kind, count in counts.items():
    for case, msg in fuzz(kind, count, a.seed, guard, inflight, progress=True):
      p = write_failure(kind, case, msg, Path(a.out))
      print(f"FAIL ({kind}): {msg}\n  case: {p}\n  replay: scripts/fuzz --replay {p}")
      rc = 1
  return rc
