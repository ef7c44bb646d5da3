"""--isa avx2: the whole run held to AVX2, kiln and its peers alike, so an AVX-512 host can measure what an AVX2 user gets
and compare like with like. Each library reads its setting when it loads, so benchmarks/run.py applies them and starts the process
again before anything is imported. onnxruntime (MLAS) and tinygrad (clang -march=native) have no such setting: they run
the host's ISA, and the report says so."""
from __future__ import annotations

import os
import sys

MARK = "KILN_BENCH_ISA"  # set once the settings are applied (the restarted process must not restart again)
# per ISA: (environment, what the report prints for the peers held to it, what it prints for the peers that are not)
SETTINGS: dict[str, tuple[dict[str, str], str, str]] = {
  "avx2": ({"KILN_CPU": "x86-64-v3", "OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "NUMBA_CPU_NAME": "haswell"},
           "kiln KILN_CPU=x86-64-v3; numpy OPENBLAS_CORETYPE=Haswell; torch ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, "
           "ONEDNN_MAX_CPU_ISA=AVX2; numba NUMBA_CPU_NAME=haswell",
           "onnxruntime and tinygrad have no setting: they run the host's ISA"),
}


def requested(argv: list[str]) -> str | None:
  """The --isa value in argv (--isa X or --isa=X), or None."""
  for i, a in enumerate(argv):
    if a == "--isa" and i + 1 < len(argv): return argv[i + 1]
    if a.startswith("--isa="): return a.split("=", 1)[1]
  return None


def apply_and_restart(argv: list[str]) -> None:
  """Before any import of numpy, torch or kiln: with --isa, set its environment and exec this process again (once)."""
  isa = requested(argv)
  if isa is None or os.environ.get(MARK) == isa: return
  if isa not in SETTINGS: sys.exit(f"kiln bench-suite: --isa must be one of {', '.join(SETTINGS)}, got {isa!r}")
  os.environ.update(SETTINGS[isa][0], **{MARK: isa})
  os.execv(sys.executable, [sys.executable, *sys.argv])


def describe() -> str | None:
  """The report's line for a run held to an ISA, or None."""
  isa = os.environ.get(MARK)
  if isa not in SETTINGS: return None
  env, held, free = SETTINGS[isa]
  changed = [k for k, v in env.items() if os.environ.get(k) != v]
  return f"--isa {isa}: {held}; {free}" + (f"; WARNING: changed since the start: {', '.join(changed)}" if changed else "")
