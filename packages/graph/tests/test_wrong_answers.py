"""Operators that returned wrong answers with no error (issue 35's two, fixed under issue 41's rule that a wrong answer
comes first): Flatten with a negative axis and Pow (integer types, negative bases), each against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import Tensor  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402


def _both(nodes, inputs, feeds, inits=(), out_type: int = TensorProto.FLOAT):
  """onnxruntime's answer (the output's shape undeclared) and kiln's (declared as onnxruntime's)."""
  outs = [helper.make_tensor_value_info(nodes[-1].output[0], out_type, None)]
  m = helper.make_model(helper.make_graph(nodes, "g", inputs, outs, list(inits)), opset_imports=[helper.make_opsetid("", 17)])
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
  got_shape = want.shape
  m.graph.output[0].CopyFrom(helper.make_tensor_value_info(nodes[-1].output[0], helper.np_dtype_to_tensor_dtype(want.dtype), list(got_shape)))
  return want, konnx.load(m).run(feeds)[nodes[-1].output[0]]


@pytest.mark.parametrize("axis", [-4, -3, -2, -1, 0, 1, 2, 3, 4])
def test_flatten_every_axis_matches_onnxruntime(axis: int) -> None:
  """axis -1 of (1, 3, 4, 10) is (12, 10); kiln gave (120, 1) (a negative axis taken modulo rank + 1)."""
  x = np.arange(120, dtype=np.float32).reshape(1, 3, 4, 10)
  want, got = _both([helper.make_node("Flatten", ["x"], ["y"], axis=axis)], [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                    {"x": x})
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)


_INT = {np.int32: TensorProto.INT32, np.int64: TensorProto.INT64}
_ALL = {**_INT, np.float32: TensorProto.FLOAT}


@pytest.mark.parametrize("base", list(_ALL), ids=lambda t: t.__name__)
@pytest.mark.parametrize("expo", list(_ALL), ids=lambda t: t.__name__)
@pytest.mark.parametrize("where", ["fed", "constant_exponent", "folded"])
def test_pow_matches_onnxruntime(base: type, expo: type, where: str) -> None:
  """Integer powers of integers are exact in the base's type (kiln gave float32 with 729.00006 for 3**6); a negative base
  to an integer power keeps its sign (kiln gave NaN for (-2)**3)."""
  x = np.array([1, 2, 3, -2, 7, 0, -1, 5, -3, 2], base)
  e = np.array([4, 5, 6, 3, 0, 2, 7, 1, 2, 10], expo)
  if where == "constant_exponent": e = e[:1]
  if base in _INT and expo is np.float32: x, e = x[x >= 0], e[:1] if where == "constant_exponent" else e[x >= 0]
  ins = [helper.make_tensor_value_info("x", _ALL[base], x.shape), helper.make_tensor_value_info("e", _ALL[expo], e.shape)]
  feeds, inits = {"x": x, "e": e}, []
  if where != "fed": ins, feeds, inits = ins[:1], {"x": x}, [numpy_helper.from_array(e, "e")]
  if where == "folded": ins, feeds, inits = [], {}, inits + [numpy_helper.from_array(x, "x")]
  want, got = _both([helper.make_node("Pow", ["x", "e"], ["y"])], ins, feeds, inits, _ALL[base])
  assert got.dtype == want.dtype
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_pow_float_rules_match_numpy() -> None:
  """The sign rule, x ** 0 = 1, 1 ** NaN = 1, non-integer powers of negatives NaN, against numpy's float power."""
  x = np.array([-2.0, -2.0, -2.0, 0.0, 0.0, np.nan, 1.0, -1.5, 4.0, 2.0, -0.5, 3.0], np.float32)
  p = np.array([3.0, 2.0, 0.5, 0.0, -1.0, 0.0, np.nan, -3.0, 0.5, 100.0, -7.0, 2.5], np.float32)
  got = Tensor(x).pow(Tensor(p)).numpy()
  with np.errstate(all="ignore"): want = np.power(x, p)
  np.testing.assert_allclose(got, want, rtol=2e-6)


def test_int_pow_by_a_tensor_is_exact_and_wraps_like_multiplication() -> None:
  x = np.array([3, -3, 2, 7, -1, -1, 1, 2, 0], np.int64)
  e = np.array([39, 39, 62, 20, -5, -4, -9, -1, 0], np.int64)
  got = Tensor(x).pow(Tensor(e)).numpy()
  want = np.array([3**39, (-3)**39, 2**62, 7**20, -1, 1, 1, 0, 1], np.int64)
  np.testing.assert_array_equal(got, want)


def test_tensor_pow_promotes_as_numpy_does() -> None:
  """Tensor.pow follows numpy: an int to a float power is float (ONNX's Pow keeps the base's type instead)."""
  x = np.array([4, 9, 2], np.int32)
  got = Tensor(x).pow(0.5).numpy()
  assert got.dtype.kind == "f"
  np.testing.assert_allclose(got, [2.0, 3.0, np.sqrt(2.0)], rtol=1e-6)
  assert Tensor(x).pow(3).numpy().dtype == np.int32


def test_permute_takes_numpy_ints() -> None:
  x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  order = np.random.default_rng(0).permutation(3)  # numpy int64 axes
  np.testing.assert_array_equal(Tensor(x).permute(order).numpy(), x.transpose(order))
  np.testing.assert_array_equal(Tensor(x).permute(*order).numpy(), x.transpose(order))
