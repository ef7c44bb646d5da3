"""kiln's benchmark harness and the executor's own rows, kept beside the executor's source and out of its wheel; the whole
table (these rows and the ones spanning layers, in the repository's benchmarks/) runs with scripts/bench (or
`python benchmarks/run.py`, or `kiln bench-suite` from a checkout). harness.py times and checks, peers.py loads numba, tinygrad,
torch and onnxruntime, limits.py measures the machine, table.py holds a row, its verdict and the table, bench.py runs and
times rows, report.py is the command line (prints the table, sets the exit code). The executor's rows: rows.py (add, sum,
matmul, dispatch, compiling, the MLP pass), models.py (softmax, layernorm, exp, GELU, a transformer encoder layer),
neighbour_rows.py (plans as a real process meets them: in turn with numpy's A @ B, after an idle pause, from two Python
threads, CPU burnt after they return). Nothing here imports a layer above the executor."""
