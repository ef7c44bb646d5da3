"""Sum and Mean of many inputs, and inference Dropout in every opset (issue 35's classic-CNN blockers), against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
import onnx.reference  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

RNG = np.random.default_rng(3)


def _compare(m: onnx.ModelProto, feeds: dict, reference: bool = False) -> None:
  """Against onnxruntime, or against onnx's own reference evaluator (the spec's meaning) where onnxruntime departs from it."""
  if reference: want = onnx.reference.ReferenceEvaluator(m).run(None, feeds)
  else: want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
  got = konnx.load(m).run(feeds)
  for vo, w in zip(m.graph.output, want):
    assert got[vo.name].dtype == w.dtype
    np.testing.assert_allclose(got[vo.name], w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["Sum", "Mean"])
@pytest.mark.parametrize("constants", [0, 1, 3])
def test_sum_and_mean_broadcast_many_inputs(op: str, constants: int) -> None:
  shapes = [(2, 3, 4), (3, 1), (4,)]
  arrays = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
  names = [f"a{i}" for i in range(3)]
  inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)][constants:]
  inits = [numpy_helper.from_array(a, n) for n, a in zip(names, arrays)][:constants]
  y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])
  m = helper.make_model(helper.make_graph([helper.make_node(op, names, ["y"])], "g", inputs, [y], inits),
                        opset_imports=[helper.make_opsetid("", 13)])
  _compare(m, dict(zip(names[constants:], arrays[constants:])))


@pytest.mark.parametrize("opset,attrs,mask", [(7, {"ratio": 0.3}, False), (10, {"ratio": 0.5}, True), (13, {}, True), (13, {"seed": 3}, False)])
def test_inference_dropout_is_the_identity_with_a_true_mask(opset: int, attrs: dict, mask: bool) -> None:
  x = RNG.standard_normal((2, 5)).astype(np.float32)
  outs = ["y", "m"] if mask else ["y"]
  vis = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])]
  if mask: vis.append(helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 5]))
  m = helper.make_model(helper.make_graph([helper.make_node("Dropout", ["x"], outs, **attrs)], "g",
                                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])], vis),
                        opset_imports=[helper.make_opsetid("", opset)])
  _compare(m, {"x": x}, reference=mask and opset < 12)  # onnxruntime's Dropout-10 returns an all-False mask; the spec's is all True
  if mask and opset < 12: np.testing.assert_array_equal(konnx.load(m).run({"x": x})["y"], x)


def test_training_dropout_is_refused_not_run_as_the_identity() -> None:
  x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "xy")
  ratio = numpy_helper.from_array(np.array(0.5, np.float32), "r")
  on = numpy_helper.from_array(np.array(True), "t")
  m = helper.make_model(helper.make_graph([helper.make_node("Dropout", ["x", "r", "t"], ["y"])], "g", [x], [y], [ratio, on]),
                        opset_imports=[helper.make_opsetid("", 13)])
  with pytest.raises(ONNXError, match="training_mode is true"): konnx.load(m)
  t = helper.make_tensor_value_info("t", TensorProto.BOOL, [])
  m = helper.make_model(helper.make_graph([helper.make_node("Dropout", ["x", "r", "t"], ["y"])], "g", [x, t], [y], [ratio]),
                        opset_imports=[helper.make_opsetid("", 13)])
  km = konnx.load(m)  # fed: read back by each run (specialise.py), refused when true
  np.testing.assert_array_equal(km.run({"x": np.arange(4, dtype=np.float32), "t": np.array(False)})["y"], np.arange(4, dtype=np.float32))
  with pytest.raises(ONNXError, match="training_mode is true"): km.run({"x": np.zeros(4, np.float32), "t": np.array(True)})
