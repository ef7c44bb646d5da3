"""Gathers whose table has symbolic dims: Tensor.gather along a symbolic axis (transformers' script exports gather rows of
a flattened (batch*seq, hidden); timm's as_strided gathers from batch*C), and GatherND / GatherElements on data of symbolic
shape (transformers 5's attention_mask[batch_idx, kv_idx]). The index is clamped to, wrapped by and checked against the
run-time size: one compile serves every size, and an index outside [-n, n) of this run is an IndexOutOfRangeError."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402
from onnx_case import N, check_exact, dyn_model, named_dims  # noqa: E402

from kiln.graph import IndexOutOfRangeError, ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402
from kiln.graph.tensor import Tensor, compile  # noqa: E402

RNG = np.random.default_rng(7)
DIMS = {"batch": (1, 6), "seq": (1, 12), "k": (1, 8)}


def f32(*shape: int) -> np.ndarray: return RNG.standard_normal(shape).astype(np.float32)


def test_gather_along_a_symbolic_axis_at_two_sizes_with_one_compile() -> None:
  x = Tensor.input("x", ("batch", "seq", 4), dims=DIMS)
  ids = Tensor.input("ids", (5,), np.int64)
  c = compile([x.reshape(-1, 4).gather(ids, 0, name="rows")])  # the rows of a flattened (batch*seq, 4)
  for (b, s), i in (((2, 3), [0, 5, -1, -6, 3]), ((6, 12), [71, -72, 40, -1, 0])):  # -1: the last row of this run
    xs = f32(b, s, 4)
    np.testing.assert_array_equal(c.run({"x": xs, "ids": np.array(i)})[0], np.take(xs.reshape(-1, 4), i, 0))
  with pytest.raises(IndexOutOfRangeError, match=r"rows \(axis 0 of \(batch\*seq, 4\)\): index 6 is out of range \[-batch\*seq, batch\*seq\)") as e:
    c.run({"x": f32(2, 3, 4), "ids": np.array([0, 6, 0, 0, 0])})  # in range for a larger run, not for this one
  assert e.value.value == 6
  with pytest.raises(IndexOutOfRangeError, match="index -7 is"): c.run({"x": f32(2, 3, 4), "ids": np.array([0, -7, 0, 0, 0])})
  xs = f32(1, 7, 4)
  np.testing.assert_array_equal(c.run({"x": xs, "ids": np.array([6, -7, 0, 1, 2])})[0], np.take(xs.reshape(-1, 4), [6, -7, 0, 1, 2], 0))


def test_narrow_indices_are_checked_against_a_larger_runtime_size() -> None:
  # int8 indices, a size up to 300: the check compares in int64 (300 - 1 wraps in int8)
  x = Tensor.input("x", ("n",), dims={"n": (1, 300)})
  c = compile([x.gather(Tensor.input("i", (3,), np.int8), 0)])
  xs = f32(300)
  np.testing.assert_array_equal(c.run({"x": xs, "i": np.array([127, -128, 5], np.int8)})[0], xs[[127, -128, 5]])
  with pytest.raises(IndexOutOfRangeError, match="index -101 is"): c.run({"x": f32(100), "i": np.array([0, -101, 1], np.int8)})
  with pytest.raises(IndexOutOfRangeError, match="index 100 is"): c.run({"x": f32(100), "i": np.array([0, 100, 1], np.int8)})


def test_constant_indices_against_a_symbolic_size() -> None:
  x = Tensor.input("x", ("batch", 2), dims={"batch": (2, 8)})
  assert compile([x.gather(Tensor(np.array([1, -2, 0])), 0)]).kernel_count == 1  # in range for every batch: no check
  c = compile([x.gather(Tensor(np.array([0, 5, -3])), 0)])  # in range for batch >= 6 (5) and >= 3 (-3): checked each run
  xs = f32(6, 2)
  np.testing.assert_array_equal(c.run({"x": xs})[0], np.take(xs, [0, 5, -3], 0))
  with pytest.raises(IndexOutOfRangeError, match="index 5 is"): c.run({"x": f32(3, 2)})
  with pytest.raises(IndexOutOfRangeError, match=r"index 8 is out of range \[-batch, batch\) for every batch up to 8"):
    x.gather(Tensor(np.array([0, 8])), 0)


def test_gathernd_on_batch_seq_data() -> None:
  # mask[batch_idx, kv_idx] as transformers 5 builds its padding mask, the index pairs fed (with negatives)
  m = dyn_model([N("GatherND", ["mask", "idx"], ["y"])], {"mask": (TensorProto.FLOAT, ("batch", "seq")), "idx": (TensorProto.INT64, ("k", 2))},
                {"y": TensorProto.FLOAT})
  def feeds(b: int, s: int, k: int) -> dict[str, np.ndarray]:
    return {"mask": f32(b, s), "idx": np.stack([RNG.integers(-b, b, k), RNG.integers(-s, s, k)], -1)}
  km = check_exact(m, DIMS, [feeds(2, 5, 7), feeds(6, 12, 3)])
  with pytest.raises(IndexOutOfRangeError, match=r"indices\[\.\.\., 1\] on axis 1 of data \(batch, seq\): index 5 is out of range \[-seq, seq\)"):
    km.run({"mask": f32(2, 5), "idx": np.array([[0, 5]])})


def test_gathernd_with_batch_dims_on_symbolic_data() -> None:
  # batch_dims=1: each batch row picks its own seq positions of (batch, seq, 3)
  m = dyn_model([N("GatherND", ["x", "idx"], ["y"], batch_dims=1)], {"x": (TensorProto.FLOAT, ("batch", "seq", 3)),
                "idx": (TensorProto.INT64, ("batch", 4, 1))}, {"y": TensorProto.FLOAT})
  check_exact(m, named_dims(m, DIMS), [{"x": f32(b, s, 3), "idx": RNG.integers(-s, s, (b, 4, 1))} for b, s in ((3, 2), (1, 9))])


def test_gather_elements_on_symbolic_data() -> None:
  # RoBERTa's token type ids: data (batch, seq), indices along the sequence; and constant indices into symbolic data
  m = dyn_model([N("GatherElements", ["x", "idx"], ["y"], axis=1), N("GatherElements", ["x", "c"], ["z"], axis=0)],
                {"x": (TensorProto.FLOAT, ("batch", "seq")), "idx": (TensorProto.INT64, ("batch", 3))},
                {"y": TensorProto.FLOAT, "z": TensorProto.FLOAT}, {"c": np.array([[-1]], np.int64)})
  check_exact(m, named_dims(m, DIMS), [{"x": f32(b, s), "idx": RNG.integers(-s, s, (b, 3))} for b, s in ((2, 4), (5, 2))])
  bigger = dyn_model([N("GatherElements", ["x", "idx"], ["y"], axis=1)], {"x": (TensorProto.FLOAT, ("batch", 4)),
                     "idx": (TensorProto.INT64, ("seq", 2))}, {"y": TensorProto.FLOAT})
  with pytest.raises(ONNXError, match=r"indices \(seq, 2\) can be larger than data \(batch, 4\) on axis 0"):
    konnx.load(bigger, dims=named_dims(bigger, DIMS))
