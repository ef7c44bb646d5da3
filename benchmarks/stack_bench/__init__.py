"""kiln's benchmark rows that span layers, kept at the repository's root and out of every wheel: graph_rows (whole ONNX
models through kiln.graph), load_rows (a safetensors file larger than the LLC, mapped through kiln.graph.weights) and
ray_rows (kiln-distributed replicas and a pipeline on a local Ray cluster). main.py runs them after and between the
executor's own rows (packages/executor/benchmarks/kiln_bench: the harness, the table, and the kernel, model and
neighbour rows) as one table: scripts/bench, python benchmarks/run.py, or `kiln bench-suite` from a checkout.

Rows here import kiln_bench (the harness they are timed by); kiln_bench never imports them."""
import sys
from pathlib import Path

# kiln_bench lives beside the executor's src/, not in an installed package: put it on the path for these rows
EXECUTOR_BENCH = str(Path(__file__).resolve().parents[2] / "packages" / "executor" / "benchmarks")
if EXECUTOR_BENCH not in sys.path: sys.path.insert(0, EXECUTOR_BENCH)
