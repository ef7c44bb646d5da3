"""Zero-size tensors in ONNX models (onnx_empty.py): inputs with a dim of 0, reductions over nothing, empty Concat pieces,
and nodes computed at load when all their inputs are known (onnx_const.py), each against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_case import N, check, f32, konnx, model

from kiln.graph.lazy import ONNXError


@pytest.mark.parametrize("op,fill", [("ReduceSum", 0.0), ("ReduceProd", 1.0), ("ReduceMax", -np.inf)])
def test_reduction_over_an_empty_input(op, fill):
  x = np.zeros((2, 0, 4), np.float32)
  km = check(model([N(op, ["x", "axes"], ["y"], keepdims=1)], {"x": x}, {"y": np.float32}, inits={"axes": np.array([1], np.int64)}, opset=18),
             {"x": x})
  assert np.all(km.run({"x": x})["y"] == fill)


def test_empty_input_meets_computed_values():
  x, e = f32(2, 3), np.zeros((2, 0), np.float32)
  m = model([N("Concat", ["x", "e"], ["c"], axis=1), N("Relu", ["c"], ["y"]), N("Mul", ["e", "e"], ["z"])], {"x": x, "e": e},
            {"y": np.float32, "z": np.float32})
  km = check(m, {"x": x, "e": e})
  with pytest.raises(ONNXError, match="'e'"): km.run({"x": x, "e": np.zeros((2, 1), np.float32)})


def test_cast_like_with_an_empty_like():
  x, like = f32(3, 2), np.zeros((0,), np.int32)
  check(model([N("CastLike", ["x", "like"], ["y"])], {"x": x, "like": like}, {"y": np.int32}, opset=19), {"x": x, "like": like})


def test_cast_like_of_an_empty_value_to_a_computed_like():
  """An empty input cast like a computed value (a causal conv's empty state, as the ONNX causal conv case): an empty array
  of the like's dtype, not a Tensor of no elements."""
  x, e = f32(2, 3), np.zeros((2, 0), np.float32)
  m = model([N("Relu", ["x"], ["r"]), N("Cast", ["r"], ["h"], to=10), N("CastLike", ["e", "h"], ["y"]), N("Concat", ["y", "h"], ["z"], axis=1)],
            {"x": x, "e": e}, {"z": np.float16})
  check(m, {"x": x, "e": e})


def test_empty_beside_computed_values():
  x, e = f32(1, 3), np.zeros((0, 3), np.float32)
  check(model([N("Expand", ["e", "s"], ["y"]), N("Add", ["y", "x"], ["z"])], {"x": x, "e": e}, {"z": np.float32},
              inits={"s": np.array([1, 3], np.int64)}), {"x": x, "e": e})
  pads = np.array([1, 0, 1, 0], np.int64)  # a non-empty result from an empty input and a fed one: computed once the run reads it
  check(model([N("Pad", ["e", "p"], ["y"])], {"e": e, "p": pads}, {"y": np.float32}), {"e": e, "p": pads})
  big = np.zeros(65, np.float32)  # beside more than a few numbers computed at run time: refused, named
  with pytest.raises(ONNXError, match="empty"):
    konnx.load(model([N("Pad", ["e", "p", "v"], ["y"])], {"e": e, "p": pads, "v": big}, {"y": np.float32}, opset=11))


def test_a_node_of_known_inputs_is_computed_at_load():
  # Trilu on a constant: no handler folds it with numpy; computed at load it leaves one kernel (the Add), not two
  x, c = f32(4, 4), f32(4, 4)
  km = check(model([N("Trilu", ["c"], ["t"]), N("Add", ["x", "t"], ["y"])], {"x": x}, {"y": np.float32}, inits={"c": c}), {"x": x})
  assert km.plan is not None and len(km.plan.kernels) == 1, km.summary()


def test_a_declared_dim_of_minus_one_is_unknown():
  """A PaddlePaddle export declares unknown dims as -1 (onnxruntime reads them so): an output's is ignored (kiln works shapes
  out itself); an input's is a dim with no name, given with dims={"input:axis": ...}."""
  from onnx import TensorProto, helper
  x = f32(2, 3)
  m = model([N("Relu", ["x"], ["y"])], {"x": x}, {"y": np.float32})
  m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 3]))
  check(m, {"x": x})
  m.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3]))
  with pytest.raises(ONNXError, match=r"dims=\{'x:0'"): konnx.load(m)
  km = konnx.load(m, dims={"x:0": (1, 8)})
  np.testing.assert_array_equal(km.run({"x": f32(5, 3) - 5})["y"], 0)
