#!/usr/bin/env bash
# kiln's CUDA runtime over the REAL pycuda (its C++ context stack, its abort at exit, its out-of-thread rules) and a fake
# libcuda.so.1 (fake_libcuda.c: host memory, a per-thread context stack, sticky faults), on a machine without a GPU.
#   PY312=/path/to/python3.12 SITE=/dir/with/pycuda+numpy+pydantic [CUDA_PYTHON_PY=python CUDA_PYTHON_SITE=dir] bash check_real_pycuda.sh
# SITE: e.g. `pip install --target SITE numpy` and `pip install --no-index --no-deps --target SITE ../shared/gpu/wheels/*.whl`.
# Each scenario of real_pycuda_probe.py runs in its own process and must exit 0, with nothing from "PyCUDA" and no "could not
# be cleaned up" on stderr, and with as many frees as allocations in the fake driver.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); ROOT=$(cd "$HERE/../../.." && pwd)
PY312=${PY312:?set PY312 to a CPython 3.12}; SITE=${SITE:?set SITE to a directory holding pycuda, numpy and pydantic}
CUDA=${CUDA:-/usr/local/cuda}; W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
gcc -c -fPIC -O1 -Wall -I"$CUDA/include" -o "$W/main.o" "$HERE/fake_libcuda.c"
# every other cu* symbol pycuda's _driver links: CUDA_ERROR_NOT_SUPPORTED (801)
nm -D --undefined-only "$SITE"/pycuda/_driver*.so | awk '{print $2}' | grep -E '^cu' | sort -u > "$W/need"
nm --defined-only "$W/main.o" | awk '$2 == "T" {print $3}' | sort -u > "$W/have"
comm -23 "$W/need" "$W/have" | sed 's/.*/int &(void) { return 801; }/' > "$W/rest.c"
mkdir -p "$W/lib" && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$W/lib/libcuda.so.1" "$W/main.o" "$W/rest.c" -lpthread -ldl
SRC=""; for s in "$ROOT"/packages/*/src; do SRC="$SRC:$s"; done
fail=0
run() {  # run DRIVER PYTHON SITE: every scenario over that binding
  for scenario in main_thread worker_threads two_devices foreign_wrapper fault; do
    set +e
    KILN_CUDA_DRIVER="$1" LD_LIBRARY_PATH="$W/lib" PYTHONPATH="$3$SRC" FAKE_CUDA_REPORT=1 "$2" "$HERE/real_pycuda_probe.py" "$scenario" \
      > "$W/out" 2> "$W/err"
    rc=$?; set -e
    leaked=$(sed -nE 's/^fake libcuda: ([0-9]+) allocs, ([0-9]+) frees.*/\1 \2/p' "$W/err" | awk '$1 != $2 {print "leaked " $1 - $2}')
    if [ $rc -ne 0 ] || grep -qE "PyCUDA|could not be cleaned up" "$W/err" || [ -n "$leaked" ]; then
      echo "FAIL $1 $scenario (exit status $rc) $leaked"; cat "$W/out" "$W/err"; fail=1
    else echo "PASS $1 $scenario: $(cat "$W/out") ($(grep 'fake libcuda' "$W/err"))"; fi
  done
}
run pycuda "$PY312" "$SITE"
# optionally the same over NVIDIA's cuda-python: CUDA_PYTHON_PY (any CPython kiln runs on) and CUDA_PYTHON_SITE (cuda-bindings,
# numpy and pydantic for it; empty when that Python has them)
if [ -n "${CUDA_PYTHON_PY:-}" ]; then run cuda-python "$CUDA_PYTHON_PY" "${CUDA_PYTHON_SITE:-}"; fi
exit $fail
