"""Named symbolic dims: one compile serves every size within the bounds (kiln issue 15)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kiln.executor import cache_stats
from kiln.graph import GraphError, ONNXError, dims
from kiln.graph.tensor import Tensor, compile

RNG = np.random.default_rng(15)
B = {"batch": (1, 64)}


def f32(*shape: int) -> np.ndarray: return RNG.standard_normal(shape).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _layernorm(x: np.ndarray) -> np.ndarray:
  d = x - x.mean(-1, keepdims=True)
  return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)


def test_mlp_one_compile_every_batch() -> None:
  w1, b1, w2 = f32(32, 24), f32(32), f32(10, 32)
  x = Tensor.input("x", ("batch", 16, 24), dims=B)
  h = x.reshape(-1, 24).linear(Tensor(w1), Tensor(b1)).relu()  # (batch*16, 24): M is symbolic
  y = h.linear(Tensor(w2)).reshape(x.shape[0], 16, 10).softmax(-1)
  s, m = x.sum(0), x.mean((0, 2))  # over the symbolic axis (mean divides by the batch's run-time value)
  c = compile([y, s, m])
  compiles = cache_stats()["compiles"]
  for n in (1, 7, 64, 3):
    a = f32(n, 16, 24)
    got_y, got_s, got_m = c.run({"x": a})
    want = _softmax((np.maximum(a.reshape(-1, 24) @ w1.T + b1, 0) @ w2.T).reshape(n, 16, 10))
    assert got_y.shape == (n, 16, 10) and got_s.shape == (16, 24) and got_m.shape == (16,)
    np.testing.assert_allclose(got_y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_s, a.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_m, a.mean((0, 2)), rtol=1e-5, atol=1e-6)
  assert cache_stats()["compiles"] == compiles  # no kernel compiled again between sizes


def test_attention_symbolic_batch_and_sequence() -> None:
  d = {"batch": (1, 8), "seq": (1, 32)}
  wq, wk, wv = f32(16, 16) * 0.3, f32(16, 16) * 0.3, f32(16, 16) * 0.3
  x = Tensor.input("x", ("batch", "seq", 16), dims=d)
  mask = Tensor.input("mask", ("batch", 1, "seq"), dims=d)  # the same variables: one per name
  q, k, v = (x.reshape(-1, 16).linear(Tensor(w)).reshape(x.shape) for w in (wq, wk, wv))  # (batch*seq) and back
  att = (q @ k.transpose(-1, -2) * 0.25 + mask).softmax(-1)  # softmax over the symbolic seq axis
  out = (att @ v + x).layernorm()  # a matmul whose reduction runs over seq
  c = compile([out])
  compiles = cache_stats()["compiles"]
  for b, s in ((1, 1), (3, 7), (8, 32), (2, 5)):
    a, mk = f32(b, s, 16), np.where(RNG.random((b, 1, s)) < 0.2, -1e4, 0).astype(np.float32)
    (got,) = c.run({"x": a, "mask": mk})
    qq, kk, vv = a @ wq.T, a @ wk.T, a @ wv.T
    want = _layernorm(_softmax(qq @ kk.transpose(0, 2, 1) * 0.25 + mk) @ vv + a)
    assert got.shape == (b, s, 16)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert cache_stats()["compiles"] == compiles


def test_permute_slice_pad_concat_on_static_axes() -> None:
  x = Tensor.input("x", ("batch", 6, 4), dims=B)
  y = Tensor.cat([x[:, 1:5, :].pad(((0, 0), (1, 0), (0, 2)), 9.0), x.permute(0, 2, 1)[:, :, :5].permute(0, 2, 1).pad(((0, 0), (0, 0), (0, 2)))], 1)
  c = compile([y, x.max(1), x.flatten(1)])
  for n in (2, 5):
    a = f32(n, 6, 4)
    got, mx, fl = c.run({"x": a})
    want = np.concatenate([np.pad(a[:, 1:5], ((0, 0), (1, 0), (0, 2)), constant_values=9.0), np.pad(a[:, :5], ((0, 0), (0, 0), (0, 2)))], 1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(mx, a.max(1))
    np.testing.assert_array_equal(fl, a.reshape(n, 24))


def test_reshape_regroups_static_and_symbolic_dims() -> None:
  x = Tensor.input("x", ("batch", 4), dims=B)
  y = x.reshape(4, -1)  # (4, batch): the same flat order, one group of (batch*4) on each side
  assert y.shape[0] == 4 and y.shape[1] is x.shape[0]
  c = compile([y * 1.0, x.reshape(2, -1, 2).sum(1)])
  for n in (1, 6):
    a = f32(n, 4)
    got, s = c.run({"x": a})
    np.testing.assert_array_equal(got, a.reshape(4, -1))
    np.testing.assert_allclose(s, a.reshape(2, -1, 2).sum(1), rtol=1e-6, atol=1e-6)


def _perm(t, *order: int):  # noqa: ANN001, ANN202 (a Tensor or a numpy array)
  return t.permute(order) if isinstance(t, Tensor) else t.transpose(order)


VIEW_CHAINS = {  # each is applied to a (batch, seq, 4) array and to the Tensor; bs and sq are the symbolic dims or their sizes
  "merge_lead": lambda t, bs, sq: t.reshape(-1, 4),
  "merge_all": lambda t, bs, sq: t.reshape(-1),
  "transpose_merge": lambda t, bs, sq: _perm(t, 1, 0, 2).reshape(sq, -1),  # (seq, batch*4): a symbolic stride
  "permute_merge_split": lambda t, bs, sq: _perm(_perm(t, 2, 0, 1).reshape(4, -1).reshape(4, bs, sq), 1, 2, 0),
  "split_static": lambda t, bs, sq: _perm(t.reshape(bs, sq, 2, 2), 0, 1, 3, 2).reshape(bs, -1),
}


@pytest.mark.parametrize("chain", sorted(VIEW_CHAINS))
@pytest.mark.parametrize("fuse", [True, False])
def test_view_chains(chain: str, fuse: bool) -> None:
  d = {"batch": (1, 6), "seq": (1, 5)}
  x = Tensor.input("x", ("batch", "seq", 4), dims=d)
  y = VIEW_CHAINS[chain](x, x.shape[0], x.shape[1])
  c = compile([y + 0.5, y.sum(0)], fuse=fuse)
  for b, s in ((1, 1), (6, 5), (4, 3)):
    a = f32(b, s, 4)
    want = VIEW_CHAINS[chain](a, b, s) + 0.5
    got, sm = c.run({"x": a})
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(sm, (want - 0.5).sum(0), rtol=1e-5, atol=1e-5)


def _random_views(seed: int, t, vals: dict[str, int]):  # noqa: ANN001, ANN202 (a Tensor or a numpy array)
  """8 random permutes, merges of neighbours, splits (a factor 2 off a dim, or b*s back into b, s) and scalings; the same
  seed makes the same chain on a Tensor and on the numpy array of its values."""
  rnd = random.Random(seed)
  shape: list = [dims.variable("b", 1, 5), dims.variable("s", 1, 4), 4]
  for _ in range(8):
    k, nd = rnd.randrange(4), len(shape)
    if k == 0 and nd > 1:
      o = list(range(nd))
      rnd.shuffle(o)
      t, shape = _perm(t, *o), [shape[i] for i in o]
    elif k in (1, 2):
      i = rnd.randrange(nd - 1 if k == 1 and nd > 1 else nd)
      if k == 1 and nd > 1: new = shape[:i] + [dims.mul(shape[i], shape[i + 1])] + shape[i + 2:]
      else:
        c, vs = dims.mono(shape[i])
        if c % 2 == 0: f = [2, dims.from_mono(c // 2, vs)] if rnd.random() < 0.5 else [dims.from_mono(c // 2, vs), 2]
        elif len(vs) == 2 and c == 1: f = list(vs)
        else: continue
        new = shape[:i] + f + shape[i + 1:]
      t = t.reshape(new if isinstance(t, Tensor) else tuple(dims.evaluate(d, vals) for d in new))
      shape = new
    elif k == 3: t = t * 1.5
  return t


@pytest.mark.parametrize("seed", range(12))
def test_random_view_chains(seed: int) -> None:
  x = Tensor.input("x", ("b", "s", 4), dims={"b": (1, 5), "s": (1, 4)})
  y = _random_views(seed, x, {})
  c = compile([y + 0.0, y.sum(-1)])
  for b, s in ((1, 1), (5, 4), (3, 2)):
    a = f32(b, s, 4)
    want = _random_views(seed, a, {"b": b, "s": s})
    got, sm = c.run({"x": a})
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(sm, want.sum(-1), rtol=1e-5, atol=1e-5)


def test_profiled_numpy_and_unfed_variable() -> None:
  x = Tensor.input("x", ("batch", 8), dims={"batch": (1, 16)})
  c = compile([(x.softmax(-1) * 2).sum(0)])
  a = f32(5, 8)
  (got,), prof = c.run_profiled({"x": a})
  e = np.exp(a - a.max(-1, keepdims=True))
  np.testing.assert_allclose(got, (2 * e / e.sum(-1, keepdims=True)).sum(0), rtol=1e-5, atol=1e-6)
  assert prof is not None
  np.testing.assert_array_equal((x + 1).numpy({"x": a}), a + 1)
  with pytest.raises(GraphError, match=r"symbolic dims \['batch'\] are not a dim of any input"): compile([Tensor.full(x.shape, 1.0)])


def test_run_checks_bounds_and_consistency() -> None:
  x = Tensor.input("x", ("batch", 4), dims=B)
  y = Tensor.input("y", ("batch", 4), dims=B)
  c = compile([x + y])
  with pytest.raises(GraphError, match=r"input 'x' dim 0 \(batch\) is 65, outside the bounds \[1, 64\]"): c.run({"x": f32(65, 4), "y": f32(65, 4)})
  with pytest.raises(GraphError, match=r"input 'y' dim 0 \(batch\) is 3, but input 'x' dim 0 gave batch = 2"): c.run({"x": f32(2, 4), "y": f32(3, 4)})
  with pytest.raises(GraphError, match=r"input 'x' has shape \(2, 5\), the graph takes \(batch, 4\) \(dim 1\)"):
    c.run({"x": f32(2, 5), "y": f32(2, 5)})
  with pytest.raises(GraphError, match="rank 2"): c.run({"x": f32(2), "y": f32(2, 4)})
  a, b = f32(2, 4), f32(2, 4)
  np.testing.assert_array_equal(c.run({"x": a, "y": b})[0], a + b)  # a refused run changed nothing


def test_refusals_name_op_and_dim() -> None:
  x = Tensor.input("x", ("batch", 4), dims=B)
  s = Tensor.input("s", ("seq", 4), dims={"seq": (1, 8)})
  with pytest.raises(GraphError, match="do not broadcast"): _ = x + s
  with pytest.raises(GraphError, match="do not broadcast"): _ = x + Tensor(f32(3, 4))
  with pytest.raises(GraphError, match=r"cannot reshape \(batch\*2 \+ 1, 4\) to \(batch\*8 \+ 4,\).*a sum of dims: only with 1s"):
    Tensor.cat([x, x.pad(((1, 0), (0, 0)))], 0).reshape(-1)  # (batch*2 + 1, 4): a sum stays a dim of its own
  with pytest.raises(GraphError, match="only slices of step 1"): _ = x[::2]
  with pytest.raises(GraphError, match=r"the length would be min\(5, batch\)"): _ = x[2:5]
  with pytest.raises(GraphError, match=r"index 64 is out of range \[-batch, batch\) for every batch up to 64"): x.gather(Tensor(np.array([0, 64])), 0)
  xs = Tensor.input("xs", ("batch", "seq"), dims={**B, "seq": (1, 8)})
  with pytest.raises(GraphError, match=r"cannot reshape \(batch, seq\) to \(seq, batch\)"): xs.reshape(xs.shape[1], xs.shape[0])
  with pytest.raises(GraphError, match="conv: symbolic dim"): Tensor.input("im", (1, 3, "h", 8), dims={"h": (4, 8)}).conv2d(Tensor(f32(2, 3, 3, 3)))
  with pytest.raises(GraphError, match="has no bounds"): Tensor.input("z", ("batch", 4))
  with pytest.raises(GraphError, match="bounds must be ints 0 <= lo <= hi, hi >= 1"): Tensor.input("z", ("batch", 4), dims={"batch": (0, 0)})
  big = Tensor.input("big", ("n", 1 << 16), dims={"n": (1, 1 << 16)})
  with pytest.raises(GraphError, match=r"\(n, 65536\) has 4294967296 elements at the dims' upper bounds, more than a int32 index"): compile([big * 2])
  other = Tensor.input("o", ("batch", 4), dims={"batch": (1, 32)})
  with pytest.raises(GraphError, match="two sets of bounds"): compile([other * 2, x * 2])
  assert x.reshape(-1).shape[0] is x.reshape(-1, 2).reshape(-1).shape[0]  # one canonical form: batch*4 is one dim


# ---- ONNX ----
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import onnx as konnx  # noqa: E402

N = helper.make_node


def _model(nodes: list, inputs: dict[str, list], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in inputs.items()],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                        [numpy_helper.from_array(v, k) for k, v in inits.items()])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  m.graph.output[0].type.tensor_type.shape.SetInParent()  # the checker wants an output shape: an unknown one
  return m


def _against_ort(m: onnx.ModelProto, dims: dict, sizes: list[dict[str, tuple[int, ...]]], tol: float) -> None:
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  km = konnx.load(m, dims=dims)
  compiles = cache_stats()["compiles"]
  for shapes in sizes:
    feeds = {k: f32(*s) for k, s in shapes.items()}
    want = sess.run(None, feeds)[0]
    got = km.run(feeds)["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  assert cache_stats()["compiles"] == compiles


def test_onnx_mlp_symbolic_batch() -> None:
  inits = {"w1": f32(32, 64) * 0.2, "b1": f32(64), "w2": f32(64, 10) * 0.2, "b2": f32(10)}
  nodes = [N("Gemm", ["x", "w1", "b1"], ["h"]), N("Relu", ["h"], ["r"]), N("Gemm", ["r", "w2", "b2"], ["z"]), N("Softmax", ["z"], ["y"], axis=-1)]
  _against_ort(_model(nodes, {"x": ["batch", 32]}, inits), {"batch": (1, 64)}, [{"x": (n, 32)} for n in (1, 7, 64)], 1e-5)


def test_onnx_attention_symbolic_batch_and_sequence() -> None:
  h = 16
  inits = {"wq": f32(h, h) * 0.3, "wk": f32(h, h) * 0.3, "wv": f32(h, h) * 0.3, "wo": f32(h, h) * 0.3, "scale": np.array(0.25, np.float32),
           "g": f32(h), "b": f32(h)}
  nodes = [N("MatMul", ["x", "wq"], ["q"]), N("MatMul", ["x", "wk"], ["k"]), N("MatMul", ["x", "wv"], ["v"]),
           N("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), N("MatMul", ["q", "kt"], ["s0"]), N("Mul", ["s0", "scale"], ["s1"]),
           N("Softmax", ["s1"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["c"]), N("MatMul", ["c", "wo"], ["o"]), N("Add", ["o", "x"], ["r"]),
           N("LayerNormalization", ["r", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
  m = _model(nodes, {"x": ["batch", "seq", h]}, inits)
  _against_ort(m, {"batch": (1, 8), "seq": (1, 24)}, [{"x": (b, s, h)} for b, s in ((1, 1), (2, 9), (8, 24), (3, 4))], 1e-4)
  _against_ort(m, {"batch": (1, 8), "seq": 6}, [{"x": (b, 6, h)} for b in (1, 5)], 1e-4)  # an int keeps a fixed size


def test_onnx_reshape_with_constant_shape() -> None:
  inits = {"w": f32(8, 4), "flat": np.array([-1, 8], np.int64), "back": np.array([-1, 3, 4], np.int64)}
  nodes = [N("Reshape", ["x", "flat"], ["f"]), N("MatMul", ["f", "w"], ["z"]), N("Reshape", ["z", "back"], ["y"])]  # (batch*3, 8) and back
  _against_ort(_model(nodes, {"x": ["batch", 3, 8]}, inits), {"batch": (1, 16)}, [{"x": (n, 3, 8)} for n in (1, 16)], 1e-5)


def test_onnx_shape_gather_concat_reshape() -> None:
  """torch's export of a head split: the batch and sequence sizes read off Shape at run time."""
  h, heads = 16, 4
  inits = {"wq": f32(h, h) * 0.3, "wk": f32(h, h) * 0.3, "wv": f32(h, h) * 0.3, "i0": np.array(0, np.int64), "i1": np.array(1, np.int64),
           "ax0": np.array([0], np.int64), "hd": np.array([heads, h // heads], np.int64), "hid": np.array([h], np.int64),
           "scale": np.array(0.5, np.float32)}
  nodes = [N("Shape", ["x"], ["sh"]), N("Gather", ["sh", "i0"], ["b"], axis=0), N("Gather", ["sh", "i1"], ["s"], axis=0),
           N("Unsqueeze", ["b", "ax0"], ["b1"]), N("Unsqueeze", ["s", "ax0"], ["s1"]), N("Concat", ["b1", "s1", "hd"], ["heads_shape"], axis=0),
           N("Concat", ["b1", "s1", "hid"], ["ctx_shape"], axis=0)]
  for t in ("q", "k", "v"):
    nodes += [N("MatMul", ["x", "w" + t], [t]), N("Reshape", [t, "heads_shape"], [t + "r"]),
              N("Transpose", [t + "r"], [t + "t"], perm=[0, 2, 3, 1] if t == "k" else [0, 2, 1, 3])]
  nodes += [N("MatMul", ["qt", "kt"], ["s0"]), N("Mul", ["s0", "scale"], ["s2"]), N("Softmax", ["s2"], ["p"], axis=-1),
            N("MatMul", ["p", "vt"], ["c"]),
            N("Transpose", ["c"], ["ct"], perm=[0, 2, 1, 3]), N("Reshape", ["ct", "ctx_shape"], ["y"])]
  m = _model(nodes, {"x": ["batch", "seq", h]}, inits)
  _against_ort(m, {"batch": (1, 4), "seq": (1, 16)}, [{"x": (b, s, h)} for b, s in ((1, 1), (3, 5), (4, 16))], 1e-4)
  _against_ort(m, {"batch": 2, "seq": 5}, [{"x": (2, 5, h)}], 1e-4)  # fixed sizes: Shape folds to int64 as before


def test_onnx_symbolic_refusals() -> None:
  inits = {"two": np.array([2], np.int64)}
  nodes = [N("Shape", ["x"], ["sh"]), N("Add", ["sh", "two"], ["dbl"], name="doubling"), N("Reshape", ["x", "dbl"], ["y"])]
  m = _model(nodes, {"x": ["batch", 4]}, inits)
  with pytest.raises(ONNXError, match=r"Reshape.*cannot reshape \(batch, 4\) to \(batch \+ 2, 6\)"): konnx.load(m, dims={"batch": (1, 16)})
  with pytest.raises(ONNXError, match=r"dim 0 is symbolic \(batch\).*\(lo, hi\)"): konnx.load(m)
  with pytest.raises(ONNXError, match=r"a size or \(lo, hi\) bounds"): konnx.load(m, dims={"batch": (1, 2, 3)})
  pad = _model([N("Pad", ["x", "pads"], ["y"], name="the_pad", mode="edge")], {"x": ["batch", 4]}, {"pads": np.array([1, 0, 0, 0], np.int64)})
  with pytest.raises(ONNXError, match=r"the_pad.*axis 0 .* is symbolic \(batch\): Pad needs a fixed size"): konnx.load(pad, dims={"batch": (1, 16)})
