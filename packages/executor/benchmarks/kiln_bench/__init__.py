"""kiln's benchmark, kept beside the executor's source and out of its wheel: run it with scripts/bench (or
`python packages/executor/benchmarks/run.py`, or `kiln bench` from a checkout). harness.py times and checks, peers.py
loads numba, tinygrad, torch and onnxruntime, limits.py measures the machine, rows.py measures each work against its target,
models.py adds the model rows (softmax, layernorm, exp, GELU, a transformer encoder layer), graph_rows.py and load_rows.py
whole ONNX models and weight loading, neighbour_rows.py plans as a real process meets them (in turn with numpy's A @ B,
after an idle pause, from two Python threads, CPU burnt after they return), report.py prints the table and sets the
exit code."""
