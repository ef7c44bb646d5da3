"""Runs kiln's benchmark from a checkout: python benchmarks/run.py [--quick] [--only PATTERN] [--json PATH] [--no-fail]
[--isa avx2] (scripts/bench runs it in the hatch `bench` env, with numba, tinygrad, threadpoolctl, torch and onnxruntime installed)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_bench lives here, not in an installed package
import stack_bench  # noqa: E402, F401  (puts the executor's kiln_bench on the path)
from kiln_bench.isa import apply_and_restart  # noqa: E402

apply_and_restart(sys.argv[1:])  # --isa: its settings must be in the environment before numpy, torch or kiln load
from stack_bench.main import main  # noqa: E402

if __name__ == "__main__": sys.exit(main())
