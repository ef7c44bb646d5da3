"""kiln's benchmark, kept beside the executor's source and out of its wheel: run it with scripts/bench (or
`python packages/executor/benchmarks/run.py`, or `kiln bench` from a checkout). harness.py times and checks, peers.py
loads numba, tinygrad, torch and onnxruntime, limits.py measures the machine, rows.py measures each work against its target,
models.py adds the model rows (softmax, layernorm, exp, GELU, a transformer encoder layer), report.py prints the table and
sets the exit code."""
