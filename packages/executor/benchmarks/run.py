"""Runs kiln's benchmark from a checkout: python packages/executor/benchmarks/run.py [--quick] [--only PATTERN] [--json PATH] [--no-fail]
[--isa avx2] (scripts/bench runs it in the hatch `bench` env, with numba, tinygrad, threadpoolctl, torch and onnxruntime installed)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kiln_bench lives here, not in an installed package
from kiln_bench.isa import apply_and_restart

apply_and_restart(sys.argv[1:])  # --isa: its settings must be in the environment before numpy, torch or kiln load
from kiln_bench.report import main  # noqa: E402

if __name__ == "__main__": sys.exit(main())
