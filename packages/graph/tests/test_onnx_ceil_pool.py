"""Pools with ceil_mode=1 (GoogLeNet, SqueezeNet, ResNet-D: issue 35) against onnxruntime: the output rounds up, a last
window that would start in the end padding is dropped, and a mean counts what its window reads (and, with
count_include_pad, the explicit pads, never the ceil extension)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from kiln.graph import onnx as konnx  # noqa: E402

CASES = [(op, k, s, p, size, inc) for op, k, s, p, size, inc in itertools.product(["MaxPool", "AveragePool"], [2, 3], [2, 3], [0, 1],
                                                                                   [5, 8, 13], [0, 1])
         if p < k and not (op == "MaxPool" and inc)]


@pytest.mark.parametrize("op,k,s,p,size,inc", CASES)
def test_ceil_mode_matches_onnxruntime(op: str, k: int, s: int, p: int, size: int, inc: int) -> None:
  attrs = {"kernel_shape": [k, k], "strides": [s, s], "pads": [p, p, p, p], "ceil_mode": 1}
  if op == "AveragePool": attrs["count_include_pad"] = inc
  x = np.random.default_rng(size).standard_normal((1, 2, size, size + 1)).astype(np.float32)
  m = helper.make_model(helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "g",
                                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
                        opset_imports=[helper.make_opsetid("", 19)])
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, list(want.shape)))
  got = konnx.load(m).run({"x": x})["y"]
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_ceil_mode_with_max_pool_dilations() -> None:
  x = np.random.default_rng(0).standard_normal((1, 1, 9, 10)).astype(np.float32)
  attrs = {"kernel_shape": [2, 3], "strides": [2, 2], "dilations": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1}
  m = helper.make_model(helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], **attrs)], "g",
                                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
                        opset_imports=[helper.make_opsetid("", 19)])
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, list(want.shape)))
  np.testing.assert_allclose(konnx.load(m).run({"x": x})["y"], want)
