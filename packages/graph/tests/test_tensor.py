"""kiln.graph.Tensor against numpy: every op, fused and unfused, and the kernel counts the scheduler promises."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.graph import GraphError, Tensor, compile

RNG = np.random.default_rng(7)
ERF = np.vectorize(math.erf, otypes=[np.float64])


def rand(*shape: int, lo: float = -2, hi: float = 2) -> np.ndarray: return RNG.uniform(lo, hi, shape).astype(np.float32)


def run(t: Tensor, fuse: bool = True, feeds: dict | None = None) -> np.ndarray: return compile([t], fuse=fuse).run(feeds)[0]


def close(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)


A, B, C = rand(3, 4), rand(4), rand(3, 1)
POS = rand(3, 4, lo=0.1, hi=3)
UNARY = [
  ("neg", lambda t: -t, lambda a: -a), ("exp", lambda t: t.exp(), np.exp), ("log", lambda t: t.log(), np.log),
  ("sqrt", lambda t: t.sqrt(), np.sqrt), ("reciprocal", lambda t: t.reciprocal(), lambda a: 1 / a), ("erf", lambda t: t.erf(), ERF),
  ("tanh", lambda t: t.tanh(), np.tanh), ("relu", lambda t: t.relu(), lambda a: np.maximum(a, 0)),
  ("sigmoid", lambda t: t.sigmoid(), lambda a: 1 / (1 + np.exp(-a))), ("gelu", lambda t: t.gelu(), lambda a: 0.5 * a * (1 + ERF(a / math.sqrt(2)))),
  ("pow2", lambda t: t ** 2, lambda a: a ** 2), ("pow0.5", lambda t: t ** 0.5, np.sqrt), ("pow1.5", lambda t: t ** 1.5, lambda a: a ** 1.5),
  ("pow-1", lambda t: t ** -1, lambda a: 1 / a), ("abs", lambda t: t.abs(), np.abs),
]


@pytest.mark.parametrize("name,f,ref", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name: str, f, ref) -> None:
  x = POS if name in ("log", "sqrt", "pow0.5", "pow1.5") else A
  close(run(f(Tensor(x))), ref(x.astype(np.float64)), 2e-5)


BINARY = [
  ("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b), ("div", lambda a, b: a / b),
  ("maximum", lambda a, b: a.maximum(b) if isinstance(a, Tensor) else np.maximum(a, b)),
  ("minimum", lambda a, b: a.minimum(b) if isinstance(a, Tensor) else np.minimum(a, b)),
]


@pytest.mark.parametrize("name,f", BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize("shapes", [((3, 4), (4,)), ((3, 1), (1, 4)), ((2, 3, 4), (3, 1))])
def test_binary_broadcast(name: str, f, shapes) -> None:
  a, b = rand(*shapes[0]), rand(*shapes[1], lo=0.5, hi=2)
  close(run(f(Tensor(a), Tensor(b))), f(a.astype(np.float64), b.astype(np.float64)), 2e-6)
  close(run(f(Tensor(a), 1.5)), f(a.astype(np.float64), 1.5), 2e-6)


def test_comparisons_where_cast() -> None:
  a, b = Tensor(A), Tensor(B)
  for got, want in [(a < b, A < B), (a > b, A > B), (a <= b, A <= B), (a >= b, A >= B), (a.eq(b), A == B), (a.ne(b), A != B)]:
    assert got.dtype.name == "bool"
    np.testing.assert_array_equal(run(got), want)
  close(run((a < 0).where(a, b)), np.where(A < 0, A, B))
  close(run((a < 0).where(a, 7.0)), np.where(A < 0, A, 7.0))
  np.testing.assert_array_equal(run((a * 10).cast("int32")), (A * 10).astype(np.int32))
  np.testing.assert_array_equal(run(((a < 0) & (b > 0)).logical_not()), ~((A < 0) & (B > 0)))


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(axis, keepdims) -> None:
  x = rand(3, 4, 5)
  t = Tensor(x)
  for name in ("sum", "mean", "max", "min", "prod"):
    got = run(getattr(t, name)(axis, keepdims))
    close(got, getattr(np, name)(x.astype(np.float64), axis=axis, keepdims=keepdims), 1e-5)


@pytest.mark.parametrize("sa,sb", [((5, 7), (7, 3)), ((2, 5, 7), (7, 3)), ((2, 1, 5, 7), (3, 7, 4)), ((7,), (7, 3)), ((5, 7), (7,))])
def test_matmul(sa, sb) -> None:
  a, b = rand(*sa), rand(*sb)
  close(run(Tensor(a) @ Tensor(b)), a.astype(np.float64) @ b.astype(np.float64), 1e-5)


def test_movement() -> None:
  x = rand(2, 3, 4)
  t = Tensor(x)
  cases = [
    (t.reshape(6, 4), x.reshape(6, 4)), (t.reshape(4, -1), x.reshape(4, -1)), (t.permute(2, 0, 1), x.transpose(2, 0, 1)),
    (t.transpose(0, 2), x.swapaxes(0, 2)), (t.T, x.T), (t[:, 1:3, ::2], x[:, 1:3, ::2]), (t[1, ::-1, -1], x[1, ::-1, -1]),
    (t[..., None, 2], x[..., None, 2]), (t.unsqueeze(1), x[:, None]), (t[:, :1].squeeze(1), x[:, 0]),
    (t.flatten(1), x.reshape(2, 12)), (t.reshape(2, 1, 3, 4).expand(2, 5, 3, 4), np.broadcast_to(x.reshape(2, 1, 3, 4), (2, 5, 3, 4))),
    (Tensor.cat([t, t[:, :2] * 2], 1), np.concatenate([x, x[:, :2] * 2], 1)), (Tensor.stack([t, t + 1], 0), np.stack([x, x + 1])),
    (t.pad(((0, 0), (1, 2), (0, 1)), -1.0), np.pad(x, ((0, 0), (1, 2), (0, 1)), constant_values=-1.0)),
    (t.permute(1, 0, 2).reshape(3, 8)[::2].reshape(-1), x.transpose(1, 0, 2).reshape(3, 8)[::2].reshape(-1)),
    (t.slice([1], [-1], [2]), x[:, :, 1:-1]),
  ]
  for got, want in cases: close(run(got), want)
  for part, want in zip(t.split([1, 3], 2), np.split(x, [1], 2)): close(run(part), want)


def test_gather_embedding() -> None:
  table = rand(10, 6)
  ids = np.array([[1, 9, -1], [0, 3, 3]], np.int64)
  close(run(Tensor(table).embedding(Tensor(ids))), table[ids])
  x = rand(3, 5, 2)
  close(run(Tensor(x).gather(Tensor(np.array([4, 0], np.int32)), 1)), np.take(x, [4, 0], 1))


def np_layernorm(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
  x = x.astype(np.float64)
  return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def test_composites_and_kernel_counts() -> None:
  x, w, b = rand(8, 16), rand(24, 16), rand(24)
  x64 = x.astype(np.float64)
  t = Tensor(x)
  lin = t.linear(Tensor(w), Tensor(b)).gelu()
  c = compile([lin])
  assert c.kernel_count == 1
  y = x64 @ w.T + b
  close(c.run()[0], 0.5 * y * (1 + ERF(y / math.sqrt(2))), 1e-5)
  e = np.exp(x64 - x64.max(-1, keepdims=True))
  for got, want in [(t.softmax(), e / e.sum(-1, keepdims=True)), (t.log_softmax(), np.log(e / e.sum(-1, keepdims=True))),
                    (t.layernorm(), np_layernorm(x)), (t.rms_norm(), x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6))]:
    c = compile([got])
    assert c.kernel_count == 1, c.plan.describe()
    close(c.run()[0], want, 1e-5)
  # a reduction of a reduction over another axis, and a matmul feeding a matmul, each start a new kernel
  c = compile([t.sum(1).sum(0)])
  assert c.kernel_count == 2
  close(c.run()[0], x64.sum(), 1e-5)
  c = compile([(t.exp().sum(1, keepdims=True) * t).sum(0)])
  close(c.run()[0], (np.exp(x64).sum(1, keepdims=True) * x64).sum(0), 1e-5)
  c = compile([(t @ Tensor(w.T)) @ Tensor(w)])
  assert c.kernel_count == 2
  close(c.run()[0], (x64 @ w.T) @ w, 1e-4)
  c = compile([t.sum(0, keepdims=True) * t.sum(1, keepdims=True)])  # a column sum read in a row loop is realized
  close(c.run()[0], x64.sum(0, keepdims=True) * x64.sum(1, keepdims=True), 1e-4)


def test_inputs_and_errors() -> None:
  x = Tensor.input("x", (2, 3))
  c = compile([(x * 2).sum(1), x + 1])
  a = rand(2, 3)
  s, p = c.run({"x": a})
  close(s, (a * 2).sum(1)); close(p, a + 1)
  with pytest.raises(GraphError, match="not fed"): c.run({})
  with pytest.raises(GraphError, match=r"shape \(3, 2\)"): c.run({"x": rand(3, 2)})
  with pytest.raises(GraphError, match=r"add.*\(2, 3\).*\(4,\)"): x + Tensor(rand(4))
  with pytest.raises(GraphError, match=r"matmul.*\(2, 3\) @ \(2, 3\)"): x @ x
  with pytest.raises(GraphError, match="reshape"): x.reshape(4, 2)
  with pytest.raises(GraphError, match="axis 2"): x.sum(2)
  with pytest.raises(GraphError, match="gather"): Tensor(rand(3)).gather(Tensor(rand(2)))
  assert np.array_equal(Tensor(a).numpy(), a)


# ---- random programs: fused and unfused plans agree with numpy ----
hyp = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = ["add", "mul", "sub_row", "exp", "tanh", "relu", "sum_keep", "max_keep", "mean_keep", "transpose", "matmul_self", "softmax",
       "slice", "reshape_flat", "cat"]


def _apply(op: str, x, np_mode: bool):
  if op == "add": return x + 0.5
  if op == "mul": return x * x
  if op == "sub_row": return x - (x.mean(-1, keepdims=True) if np_mode else x.mean(-1, keepdims=True))
  if op == "exp": return np.exp(np.clip(x, -5, 5)) if np_mode else x.maximum(-5.0).minimum(5.0).exp()
  if op == "tanh": return np.tanh(x) if np_mode else x.tanh()
  if op == "relu": return np.maximum(x, 0) if np_mode else x.relu()
  if op == "sum_keep": return x.sum(0, keepdims=True) + x if np_mode else x.sum(0, keepdims=True) + x
  if op == "max_keep": return x - x.max(-1, keepdims=True)
  if op == "mean_keep": return x.mean(0, keepdims=True) * x
  if op == "transpose": return x.T
  if op == "matmul_self": return (x @ x.T) * 0.1
  if op == "softmax":
    if not np_mode: return x.softmax(-1)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  if op == "slice": return x[::-1, 1:] if x.shape[1] > 3 else x[::-1]
  if op == "reshape_flat": return x.reshape(x.shape[1], x.shape[0])
  if op == "cat": return np.concatenate([x, x * 2], 0) if np_mode else Tensor.cat([x, x * 2], 0)
  raise AssertionError(op)


def test_matmul_k2() -> None:  # was a codegen bug: the packed panel read before it was packed (K unrolled whole)
  x, w = rand(3, 2), rand(2, 3)
  close(run(Tensor(x) @ Tensor(w)), x.astype(np.float64) @ w)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(OPS), min_size=1, max_size=6), st.integers(3, 5), st.integers(3, 6))
def test_random_programs(ops: list[str], m: int, n: int) -> None:
  x = RNG.uniform(-1, 1, (m, n))
  ref, t = x.copy(), Tensor(x.astype(np.float32))
  for op in ops:
    ref, t = _apply(op, ref, True), _apply(op, t, False)
  scale = max(1.0, float(np.abs(ref).max()))
  fused, unfused = compile([t]), compile([t], fuse=False)
  assert fused.kernel_count <= unfused.kernel_count
  a, b = fused.run()[0], unfused.run()[0]
  np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4 * scale)
  np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale)


def test_a_graph_too_deep_to_render_is_a_typed_error() -> None:
  """The renderer recurses along a fused elementwise chain: thousands of ops in one chain are a GraphError saying how to cut
  it, not a RecursionError escaping compile (a realized intermediate splits the chain)."""
  t = Tensor(np.ones(4, np.float32))
  for _ in range(3000): t = (t * 1.0001).relu()
  with pytest.raises(GraphError, match="too deep to render"): compile([t])
  t = Tensor(np.ones(4, np.float32))
  for i in range(400):
    t = (t * 1.0001).relu()
    if i % 100 == 99: t = t.contiguous()
  close(run(t), np.full(4, 1.0001 ** 400))


def test_repeated_layers_compile_once(monkeypatch) -> None:
  """Kernel names say what a kernel does and over what shape (not its place in the plan), so layers of the same shape with
  other weights render the same AST and the kernel cache compiles each kernel once: three layers compile what one does."""
  from kiln.executor import cache_stats
  from kiln.executor.cache import clear_memory_cache
  monkeypatch.setenv("KILN_CACHE", "0")  # no disk cache: every kernel not in memory is compiled here
  rng = np.random.default_rng(8)
  def layers(n: int) -> tuple[Tensor, int]:
    x = Tensor.input("x", (16, 24))
    for _ in range(n):
      w, b = (Tensor(rng.standard_normal(s).astype(np.float32)) for s in ((24, 24), (24,)))
      x = (x @ w + b).gelu().layernorm()
    c = compile([x])
    return x, c.kernel_count
  clear_memory_cache()
  before = cache_stats()["compiles"]
  _, one = layers(1)
  first = cache_stats()["compiles"] - before
  clear_memory_cache()
  before = cache_stats()["compiles"]
  _, three = layers(3)
  assert three == 3 * one and cache_stats()["compiles"] - before == first, (one, three, first)
