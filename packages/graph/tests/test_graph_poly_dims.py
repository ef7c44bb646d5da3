"""Symbolic dims that are sums (kiln.graph.dims' polynomial dims): a KV cache's past + seq from a concat, a pad of a
symbolic axis, a slice's seq - 1, and variables whose lower bound is 0 (an empty past). One compile for every size."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.executor import cache_stats
from kiln.graph import GraphError, dims
from kiln.graph.tensor import Tensor, compile

RNG = np.random.default_rng(35)
D = {"past": (0, 16), "seq": (1, 4)}


def f32(*shape: int) -> np.ndarray: return RNG.standard_normal(shape).astype(np.float32)


def test_polynomial_dims_are_canonical() -> None:
  p, s, b = dims.variable("past", 0, 16), dims.variable("seq", 1, 4), dims.variable("batch", 1, 8)
  ps = dims.add(p, s)
  assert ps is dims.add(s, p) and dims.fmt(ps) == "past + seq" and dims.bounds(ps) == (1, 20)  # one UOp: shapes compare by identity
  assert dims.fmt(dims.sub(s, 1)) == "seq - 1" and dims.bounds(dims.sub(s, 1)) == (0, 3) and dims.sub(ps, p) is s
  assert dims.mul(ps, b, 2) is dims.add(dims.mul(2, p, b), dims.mul(b, s, 2)) and dims.fmt(dims.mul(ps, b, 2)) == "batch*past*2 + batch*seq*2"
  assert dims.div(dims.mul(ps, b, 2), ps) is dims.mul(b, 2) and dims.div(ps, s) is None
  assert dims.evaluate(dims.mul(ps, b), {"past": 3, "seq": 2, "batch": 4}) == 20
  assert dims.mul(b, 128) is dims.mul(128, b) and dims.mono(dims.mul(b, 128)) == (128, (b,))  # a monomial keeps its form
  with pytest.raises(GraphError, match="past \\+ seq is a sum, not a product"): dims.mono(ps)
  assert dims.reshape_groups((1, ps, 16), (ps, 16)) == (((0, 1), (0,)), ((2,), (1,)))  # a sum is a dim of its own (1s may join it)
  with pytest.raises(GraphError, match="a sum of dims: only with 1s"): dims.reshape_groups((dims.mul(ps, 16),), (ps, 16))
  with pytest.raises(GraphError, match="0 <= lo <= hi, hi >= 1"): dims.variable("n", 0, 0)


def test_kv_cache_concat_one_compile_from_an_empty_past() -> None:
  """past (lo 0) + new along the sequence axis, attention over it, the new part sliced back out, each size one run."""
  past, new = Tensor.input("past", (2, "past", 8), dims=D), Tensor.input("new", (2, "seq", 8), dims=D)
  kv = Tensor.cat([past, new * 2.0], 1)  # (2, past + seq, 8)
  assert dims.fmt(kv.shape[1]) == "past + seq"
  att = (new @ kv.transpose(1, 2)).softmax(-1) @ kv  # (2, seq, 8), a softmax and a matmul over past + seq
  back = kv[:, past.shape[1]:]  # [past:] of past + seq: seq long
  assert back.shape[1] is new.shape[1]
  c = compile([kv, att, back, kv.sum(1)])
  compiles = cache_stats()["compiles"]
  for n, s in ((0, 3), (1, 1), (7, 4), (16, 2)):
    a, x = f32(2, n, 8), f32(2, s, 8)
    got = c.run({"past": a, "new": x})
    want = np.concatenate([a, x * 2], 1)
    sc = x @ want.transpose(0, 2, 1)
    e = np.exp(sc - sc.max(-1, keepdims=True))
    assert got[0].shape == (2, n + s, 8)
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_allclose(got[1], e / e.sum(-1, keepdims=True) @ want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[2], x * 2)
    np.testing.assert_allclose(got[3], want.sum(1), rtol=1e-5, atol=1e-6)
  assert cache_stats()["compiles"] == compiles  # no kernel compiled again between sizes


def test_pad_and_slices_of_a_symbolic_axis() -> None:
  x = Tensor.input("x", ("seq", 3), dims={"seq": (1, 9)})
  p = x.pad(((2, 1), (0, 0)), 7.0)
  assert dims.fmt(p.shape[0]) == "seq + 3" and dims.fmt(x[1:].shape[0]) == "seq - 1" and dims.fmt(x[:-2].shape[0]) == "seq - 2"
  c = compile([p, x[1:] + x[:-1], Tensor.cat([x[1:], x[:1]], 0)])  # mobilebert's shift, BART's [0:-1], a rotation
  for n in (1, 2, 9):
    a = f32(n, 3)
    got = c.run({"x": a})
    np.testing.assert_array_equal(got[0], np.pad(a, ((2, 1), (0, 0)), constant_values=7.0))
    np.testing.assert_array_equal(got[1], a[1:] + a[:-1])
    np.testing.assert_array_equal(got[2], np.concatenate([a[1:], a[:1]], 0))
  with pytest.raises(GraphError, match=r"the length would be min\(5, seq\)"): _ = x[2:5]
  with pytest.raises(GraphError, match=r"the start seq - 3 is below 0"): _ = x[-3:]


def test_a_length_the_bounds_cannot_prove_is_checked_at_run_time() -> None:
  """[1:] of an axis that may be empty: seq - 1 is checked before the plan runs (Python would give an empty slice)."""
  x = Tensor.input("x", (2, "past"), dims=D)
  c = compile([x[:, 1:] * 3.0, x.sum(1), x.max(1)])
  assert [dims.fmt(d) for d in c.sizes] == ["past - 1"]
  with pytest.raises(GraphError, match=r"the dim past - 1 is -1 for past = 0"): c.run({"x": np.zeros((2, 0), np.float32)})
  a = f32(2, 5)
  got = c.run({"x": a})  # the refused run changed nothing
  np.testing.assert_array_equal(got[0], a[:, 1:] * 3)
  empty = compile([x.sum(1), x.max(1), x * 2.0]).run({"x": np.zeros((2, 0), np.float32)})  # reductions over nothing: their identity
  np.testing.assert_array_equal(empty[0], [0, 0])
  np.testing.assert_array_equal(empty[1], [-np.inf, -np.inf])
  assert empty[2].shape == (2, 0)


def test_onnx_kv_concat_slice_and_pad_against_onnxruntime() -> None:
  """The ONNX ops that make sums: Concat of a past (from 0) and a new part, Slice [1:] of it (INT64_MAX end), and a
  constant Pad of the sequence axis (mobilebert's shifted embeddings), one load for every size."""
  pytest.importorskip("onnx")
  pytest.importorskip("onnxruntime")
  from onnx import TensorProto
  from onnx_case import N, dyn_model, ort

  from kiln.graph import onnx as konnx
  i64 = lambda *v: np.asarray(v, np.int64)  # noqa: E731
  nodes = [N("Concat", ["past", "x"], ["kv"], axis=1), N("Slice", ["kv", "one", "end", "one"], ["tail"]),
           N("Pad", ["x", "pads"], ["padded"], mode="constant"), N("ReduceSum", ["kv", "one"], ["tot"], keepdims=0)]
  F = TensorProto.FLOAT
  m = dyn_model(nodes, {"past": (F, (2, "past", 3)), "x": (F, (2, "seq", 3))}, {"kv": F, "tail": F, "padded": F, "tot": F},
                {"one": i64(1), "end": i64(2**63 - 1), "pads": i64(0, 1, 0, 0, 2, 0)}, opset=13)
  km = konnx.load(m, dims={"past": (0, 8), "seq": (1, 4)})
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for p, s in ((0, 2), (1, 1), (8, 4)):
    feeds = {"past": f32(2, p, 3), "x": f32(2, s, 3)}
    for w, g in zip(sess.run(None, feeds), km.run(feeds).values()):
      assert g.shape == w.shape
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_program_with_a_run_time_branch_feeds_and_reads_empty_tensors() -> None:
  """A model with an If on a fed condition (a Program of segments): an empty past is fed and an empty output read back,
  and a segment checks a length its bounds cannot prove >= 0 before it runs."""
  pytest.importorskip("onnx")
  pytest.importorskip("onnxruntime")
  from onnx import TensorProto, helper
  from onnx_case import N, dyn_model, ort

  from kiln.graph import onnx as konnx
  F = TensorProto.FLOAT
  br = {k: helper.make_graph([N(op, ["kv"], [k])], k, [], [helper.make_tensor_value_info(k, F, None)]) for k, op in (("t", "Neg"), ("e", "Exp"))}
  nodes = [N("Concat", ["past", "x"], ["kv"], axis=1), N("If", ["c"], ["y"], then_branch=br["t"], else_branch=br["e"]),
           N("Slice", ["y", "one", "end", "one"], ["tail"])]
  m = dyn_model(nodes, {"past": (F, (2, "past")), "x": (F, (2, "seq")), "c": (TensorProto.BOOL, ())}, {"y": F, "tail": F},
                {"one": np.asarray([1], np.int64), "end": np.asarray([2**63 - 1], np.int64)}, opset=13)
  km = konnx.load(m, dims={"past": (0, 8), "seq": (0, 4)})
  assert km.program is not None
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for p, s, c in ((0, 1, True), (0, 3, False), (5, 0, True), (8, 4, False)):
    feeds = {"past": f32(2, p), "x": f32(2, s), "c": np.array(c)}
    for w, g in zip(sess.run(None, feeds), km.run(feeds).values()):
      assert g.shape == w.shape
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  with pytest.raises(GraphError, match=r"the dim past \+ seq - 1 is -1 for past = 0, seq = 0"):
    km.run({"past": f32(2, 0), "x": f32(2, 0), "c": np.array(True)})
