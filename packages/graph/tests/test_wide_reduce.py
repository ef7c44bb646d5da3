"""Reductions over 2**31 elements and more through kiln.graph (issue 41 item 2): a ReduceSum over a Tile of 2**31 ones gave
0.0 and a ReduceMax -inf, "in 0.00 s" (the kernel's range end wrapped to -2**31 in int32). The values are broadcasts or an
iota, never materialised, and every answer is exact (float64 and int64 sums of these sizes are), so the sums prove every
element was visited and the max of an iota that the last one was. onnxruntime is not asked: a Tile of 2**31 doubles is
16 GB there."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import Tensor

SIZES = [2**31, 2**31 + 3]


@pytest.mark.parametrize("n", SIZES)
def test_sum_and_max_of_a_broadcast(n):
  x = Tensor.from_numpy(np.full((1,), 2.0)).expand((n,))
  assert float(x.sum().numpy()) == 2.0 * n and float(x.max().numpy()) == 2.0


@pytest.mark.parametrize("n", SIZES)
def test_iota_sum_and_max(n):
  t = Tensor.arange(n)  # int64
  assert int(t.max().numpy()) == n - 1 and int(t.sum().numpy()) == n * (n - 1) // 2


def test_a_split_shape_past_int32():
  """(2, 2**30 + 1) flattened and read back as rows: each axis fits int32, the flat index does not (the reshape's // and %
  run on a 64-bit index). Row 1 holds ones, row 0 zeros: the sum counts row 1's elements."""
  m = 2**30 + 1
  x = Tensor.from_numpy(np.arange(2, dtype=np.float64).reshape(2, 1)).expand((2, m)).reshape((2 * m,))
  assert float(x.sum().numpy()) == m


onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import onnx as konnx  # noqa: E402


def tile_reduce(op: str, n: int, value: float) -> onnx.ModelProto:
  inits = [numpy_helper.from_array(np.full((1,), value), "v"), numpy_helper.from_array(np.array([n], np.int64), "reps")]
  nodes = [helper.make_node("Tile", ["v", "reps"], ["t"]), helper.make_node(op, ["t"], ["y"], keepdims=0)]
  g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [])], inits)
  return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("n", SIZES)
def test_onnx_reduce_over_a_tile(n):
  assert float(konnx.load(tile_reduce("ReduceSum", n, 1.0)).run({})["y"]) == n
  assert float(konnx.load(tile_reduce("ReduceMax", n, -3.0)).run({})["y"]) == -3.0
