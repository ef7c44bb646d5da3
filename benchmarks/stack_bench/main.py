"""The whole benchmark as one table: each row module's run(bench), in the order the rows print."""
from __future__ import annotations

from kiln_bench import models, neighbour_rows, rows
from kiln_bench.report import main as report
from stack_bench import graph_rows, load_rows, ray_rows

GROUPS = (
  rows.run,  # add, sum, matmul, dispatch, compile and the MLP pass
  models.run,  # softmax, layernorm, exp, GELU, the encoder layer (plain and tuned)
  graph_rows.run,  # whole ONNX models through kiln.graph (imported inside its rows only)
  load_rows.run,  # a safetensors file > the LLC, mapped: load time, bytes mapped and resident
  neighbour_rows.run,  # issue 21: plans beside numpy's A @ B, after idle, from two threads; CPU burnt after a call
  ray_rows.run,  # issue 18: replicas on a local Ray cluster (where kiln-distributed is installed)
)


def main(argv: list[str] | None = None) -> int: return report(argv, GROUPS)
