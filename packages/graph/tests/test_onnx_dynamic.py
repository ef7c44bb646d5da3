"""ONNX models with symbolic dims (a dynamic batch and sequence, as torch.onnx.export's dynamic_axes writes them) through the
operators that build masks and positions from a Shape: ConstantOfShape and Range of a symbolic size, Trilu and CumSum over
a symbolic axis, and Einsum, Resize and Pad beside a symbolic batch. One load serves every size; each size is checked
against onnxruntime. Also Tensor.arange, which these rest on (an index the kernel's loop supplies, nothing stored)."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402
from onnx_case import N, dyn_model, named_dims, ort  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402
from kiln.graph.tensor import Tensor, compile  # noqa: E402

RNG = np.random.default_rng(11)
DIMS = {"batch": (1, 6), "seq": (1, 12)}


def check_sizes(m: onnx.ModelProto, feeds_list: list[dict[str, np.ndarray]], tol: float = 1e-5) -> konnx.Model:
  km = konnx.load(m, dims=named_dims(m, DIMS))
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for feeds in feeds_list:
    for name, w, g in zip([o.name for o in m.graph.output], sess.run(None, feeds), km.run(feeds).values()):
      assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
      np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
  return km


def test_arange_static_and_symbolic() -> None:
  np.testing.assert_array_equal(compile([Tensor.arange(5)]).run()[0], np.arange(5))
  x = Tensor.input("x", ("seq", 3), dims={"seq": (1, 9)})
  y = Tensor.arange(x.shape[0], "float32").reshape(-1, 1) * 2.0 + x
  c = compile([y])
  for s in (1, 4, 9):
    xs = RNG.standard_normal((s, 3)).astype(np.float32)
    np.testing.assert_allclose(c.run({"x": xs})[0], np.arange(s, dtype=np.float32)[:, None] * 2 + xs)


def _causal_nodes(upper: int) -> list:
  # torch's causal mask for a dynamic T: ones(T, T) from Shape, Trilu, then Where on the scores
  return [N("Shape", ["s"], ["sh"]), N("Gather", ["sh", "i2"], ["t"], axis=0), N("Unsqueeze", ["t", "ax0"], ["t1"]),
          N("Concat", ["t1", "t1"], ["tt"], axis=0),
          N("ConstantOfShape", ["tt"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
          N("Trilu", ["ones"], ["tri"], upper=upper), N("Cast", ["tri"], ["m"], to=TensorProto.BOOL), N("Where", ["m", "s", "ninf"], ["masked"]),
          N("Softmax", ["masked"], ["y"], axis=-1)]


@pytest.mark.parametrize("upper", [0, 1])
def test_causal_mask_from_a_dynamic_sequence(upper: int) -> None:
  inits = {"i2": np.asarray(2, np.int64), "ax0": np.asarray([0], np.int64), "ninf": np.asarray(-1e9, np.float32)}
  m = dyn_model(_causal_nodes(upper), {"s": (TensorProto.FLOAT, ("batch", 2, "seq", "seq"))}, {"y": TensorProto.FLOAT}, inits, opset=14)
  check_sizes(m, [{"s": RNG.standard_normal((b, 2, t, t)).astype(np.float32)} for b, t in ((2, 5), (1, 12), (3, 1))])


def test_range_of_a_dynamic_length_and_cumsum_positions() -> None:
  # positions = Range(0, T, 1) + CumSum(mask) over a dynamic sequence
  nodes = [N("Shape", ["mask"], ["sh"]), N("Gather", ["sh", "i1"], ["t"], axis=0), N("Range", ["zero", "t", "one"], ["r"]),
           N("CumSum", ["mask", "ax"], ["c"]), N("Add", ["c", "r"], ["y"])]
  inits = {"i1": np.asarray(1, np.int64), "zero": np.asarray(0, np.int64), "one": np.asarray(1, np.int64), "ax": np.asarray(-1, np.int64)}
  m = dyn_model(nodes, {"mask": (TensorProto.INT64, ("batch", "seq"))}, {"y": TensorProto.INT64}, inits)
  check_sizes(m, [{"mask": RNG.integers(0, 2, (b, t)).astype(np.int64)} for b, t in ((2, 7), (5, 12), (1, 1))])


def test_einsum_resize_pad_beside_a_dynamic_batch() -> None:
  nodes = [N("Einsum", ["x", "w"], ["e"], equation="bchw,cd->bdhw"),
           N("Resize", ["e", "", "sc"], ["r"], mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
           N("Pad", ["r", "p"], ["y"], mode="reflect")]
  inits = {"w": RNG.standard_normal((3, 4)).astype(np.float32), "sc": np.asarray([1, 1, 2, 2], np.float32),
           "p": np.asarray([0, 0, 1, 2, 0, 0, 2, 1], np.int64)}
  m = dyn_model(nodes, {"x": (TensorProto.FLOAT, ("batch", 3, 4, 5))}, {"y": TensorProto.FLOAT}, inits, opset=13)
  check_sizes(m, [{"x": RNG.standard_normal((b, 3, 4, 5)).astype(np.float32)} for b in (1, 4, 6)], tol=1e-5)


def test_symbolic_refusals_are_typed() -> None:
  # a Range of a symbolic length with a step other than 1, and Resize's sizes on a symbolic axis
  nodes = [N("Shape", ["x"], ["sh"]), N("Gather", ["sh", "i0"], ["t"], axis=0), N("Range", ["zero", "t", "two"], ["y"])]
  inits = {"i0": np.asarray(0, np.int64), "zero": np.asarray(0, np.int64), "two": np.asarray(2, np.int64)}
  with pytest.raises(ONNXError, match=r"Range.*delta 1"):
    konnx.load(dyn_model(nodes, {"x": (TensorProto.FLOAT, ("batch", 3))}, {"y": TensorProto.INT64}, inits), dims={"batch": DIMS["batch"]})
  m = dyn_model([N("Resize", ["x", "", "", "sz"], ["y"], mode="nearest")], {"x": (TensorProto.FLOAT, ("batch", 3))}, {"y": TensorProto.FLOAT},
                {"sz": np.asarray([4, 6], np.int64)}, opset=13)
  with pytest.raises(ONNXError, match=r"Resize.*symbolic"): konnx.load(m, dims={"batch": DIMS["batch"]})
