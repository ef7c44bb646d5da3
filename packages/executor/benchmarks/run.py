"""Runs kiln's benchmark from a checkout: python packages/executor/benchmarks/run.py [--quick] [--only PATTERN] [--json PATH] [--no-fail]
(scripts/bench runs it in the hatch `bench` env, with numba, tinygrad, threadpoolctl, torch and onnxruntime installed)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kiln_bench lives here, not in an installed package
from kiln_bench.report import main

if __name__ == "__main__": sys.exit(main())
