"""Row reduces under a vectorised output axis (softmax, layernorm, RMS norm, masked mean pooling as one kernel each),
compiled for this CPU with the heuristic's options: each row reduce accumulates vectors of its own lanes (issue 14), and
the results match kiln.ir.reference within the fuzzer's tolerance for a reordered float sum (tests/fuzz/kfuzz.py
`tolerances`: EPS * (16 + 4 * n) of the output's scale), bit for bit for MAX (NaN, -0/+0) and integer reductions."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.registry import get_runtime
from kiln.ir import AxisType, Ops, UOp, dtypes, kernels, reference
from kiln.ir.dtype import DType

RT = get_runtime("CPU")
EPS32 = 2.0 ** -23


def run_cpu(ast: UOp, bufs: list[np.ndarray], opts: list[Opt] | None = None) -> tuple[list[np.ndarray], list[str]]:
  spec = RT.renderer.render(ast, opts=opts)
  prog = RT.load(RT.compiler.compile(spec))
  out = [b.copy() for b in bufs]
  prog([b.ctypes.data for b in out], [])
  return out, spec.applied_opts


def close(got: np.ndarray, want: np.ndarray, n: int) -> None:
  """The fuzzer's check for a reordered float sum of n terms: |got - want| <= EPS * (16 + 4n) * (|want| + max|want|)."""
  scale = float(np.max(np.abs(want)))
  bad = np.abs(got.astype(np.float64) - want) > EPS32 * (16 + 4 * n) * (np.abs(want) + scale)
  where = np.flatnonzero(bad)[:4]
  assert not bad.any(), f"{bad.sum()} of {bad.size} differ, e.g. at {where}: {got.ravel()[where]} vs {want.ravel()[where]}"


def vector_reduces(applied: list[str], axes: list[int]) -> None:
  # the output's UPCAST (axis 1) and one per row reduce
  for a in [1, *axes]: assert any(s.startswith(f"UPCAST(axis={a},") for s in applied), applied


# ---- kernels built by hand ----
def layernorm(rows: int, n: int, eps: float = 1e-5) -> UOp:
  """out[i, j] = (x[i, j] - mean) / sqrt(var + eps) * g[j] + b[j]; mean and the variance around it are row reduces.
  Slots: 0 out, 1 x, 2 g, 3 b."""
  out, x = UOp.define_global(0, dtypes.float32.ptr(rows * n)), UOp.define_global(1, dtypes.float32.ptr(rows * n))
  g, b = UOp.define_global(2, dtypes.float32.ptr(n)), UOp.define_global(3, dtypes.float32.ptr(n))
  i, j = UOp.range(rows, 0), UOp.range(n, 1)
  k1, k2 = UOp.range(n, 2, AxisType.REDUCE), UOp.range(n, 3, AxisType.REDUCE)
  mean = x.index(i * n + k1).load().reduce(Ops.ADD, k1) * (1.0 / n)
  d = x.index(i * n + k2).load() - mean
  var = (d * d).reduce(Ops.ADD, k2) * (1.0 / n)
  val = (x.index(i * n + j).load() - mean) * (var + eps).sqrt().reciprocal() * g.index(j).load() + b.index(j).load()
  return UOp.sink(out.index(i * n + j).store(val), name="layernorm")


def rmsnorm(rows: int, n: int, eps: float = 1e-6) -> UOp:
  """out[i, j] = x[i, j] / sqrt(mean(x[i, :]^2) + eps) * w[j]. Slots: 0 out, 1 x, 2 w."""
  out, x = UOp.define_global(0, dtypes.float32.ptr(rows * n)), UOp.define_global(1, dtypes.float32.ptr(rows * n))
  w = UOp.define_global(2, dtypes.float32.ptr(n))
  i, j, k = UOp.range(rows, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE)
  xk = x.index(i * n + k).load()
  ms = (xk * xk).reduce(Ops.ADD, k) * (1.0 / n)
  return UOp.sink(out.index(i * n + j).store(x.index(i * n + j).load() * (ms + eps).sqrt().reciprocal() * w.index(j).load()), name="rmsnorm")


def masked_mean(batch: int, seq: int, dim: int) -> UOp:
  """out[b, d] = sum_s x[b, s, d] * m[b, s] / max(sum_s m[b, s], 1): the numerator varies along d (a vector already), the
  count does not (it gets its own UPCAST). Slots: 0 out, 1 x, 2 m."""
  out = UOp.define_global(0, dtypes.float32.ptr(batch * dim))
  x, m = UOp.define_global(1, dtypes.float32.ptr(batch * seq * dim)), UOp.define_global(2, dtypes.float32.ptr(batch * seq))
  b, d = UOp.range(batch, 0), UOp.range(dim, 1)
  s1, s2 = UOp.range(seq, 2, AxisType.REDUCE), UOp.range(seq, 3, AxisType.REDUCE)
  num = (x.index((b * seq + s1) * dim + d).load() * m.index(b * seq + s1).load()).reduce(Ops.ADD, s1)
  cnt = m.index(b * seq + s2).load().reduce(Ops.ADD, s2)
  return UOp.sink(out.index(b * dim + d).store(num / cnt.maximum(1.0)), name="masked_mean")


def row_op(rows: int, n: int, dt: DType, op: Ops) -> UOp:
  """out[i, j] = y[i, j] - reduce_k x[i, k] (MAX) or y[i, j] + reduce_k x[i, k] (ADD, MUL): exact, so bits can be compared.
  Slots: 0 out, 1 x, 2 y."""
  out, x, y = (UOp.define_global(s, dt.ptr(rows * n)) for s in range(3))
  i, j, k = UOp.range(rows, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE)
  r = x.index(i * n + k).load().reduce(op, k)
  yv = y.index(i * n + j).load()
  return UOp.sink(out.index(i * n + j).store(yv - r if op is Ops.MAX else yv + r), name=f"row_{op.name.lower()}")


# ---- tests ----
@pytest.mark.parametrize("n", [128, 1024, 100, 7])
def test_softmax(n: int):
  rows = 33
  x = np.random.default_rng(n).standard_normal((rows, n)).astype(np.float32) * 4
  ast = kernels.softmax((rows, n), dtypes.float32)
  (got, _), applied = run_cpu(ast, [np.zeros(rows * n, np.float32), x.ravel()])
  if n >= 8: vector_reduces(applied, [2, 3])
  want = reference.run(ast, np.zeros(rows * n, np.float32), x)[0]
  close(got, want, n)
  e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
  np.testing.assert_allclose(got.reshape(rows, n), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [384, 100])
def test_layernorm(n: int):
  rows = 17
  rng = np.random.default_rng(n)
  x, g, b = (rng.standard_normal(s).astype(np.float32) for s in ((rows, n), n, n))
  x += 3  # a mean away from zero: the variance is taken around it
  ast = layernorm(rows, n)
  bufs = [np.zeros(rows * n, np.float32), x.ravel(), g, b]
  (got, *_), applied = run_cpu(ast, bufs)
  vector_reduces(applied, [2, 3])
  close(got, reference.run(ast, *bufs)[0], n)
  x64 = x.astype(np.float64)
  want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5) * g + b
  np.testing.assert_allclose(got.reshape(rows, n), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [256, 100])
def test_rmsnorm(n: int):
  rows = 9
  rng = np.random.default_rng(n)
  x, w = rng.standard_normal((rows, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
  ast = rmsnorm(rows, n)
  bufs = [np.zeros(rows * n, np.float32), x.ravel(), w]
  (got, *_), applied = run_cpu(ast, bufs)
  vector_reduces(applied, [2])
  close(got, reference.run(ast, *bufs)[0], n)
  x64 = x.astype(np.float64)
  np.testing.assert_allclose(got.reshape(rows, n), x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + 1e-6) * w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seq", [128, 100])
def test_masked_mean_pooling(seq: int):
  batch, dim = 5, 64
  rng = np.random.default_rng(seq)
  x = rng.standard_normal((batch, seq, dim)).astype(np.float32)
  m = (rng.random((batch, seq)) < 0.6).astype(np.float32)
  m[3] = 0  # an all-masked row divides by max(0, 1)
  ast = masked_mean(batch, seq, dim)
  bufs = [np.zeros(batch * dim, np.float32), x.ravel(), m.ravel()]
  (got, *_), applied = run_cpu(ast, bufs)
  assert any(s.startswith("UPCAST(axis=3,") for s in applied) and not any(s.startswith("UPCAST(axis=2,") for s in applied), applied
  close(got, reference.run(ast, *bufs)[0], seq)
  want = (x * m[:, :, None]).sum(1, dtype=np.float64) / np.maximum(m.sum(1, keepdims=True), 1)
  np.testing.assert_allclose(got.reshape(batch, dim), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [128, 100, 37])
def test_max_is_exact(n: int):
  """NaN anywhere in a row (the vector part or the scalar tail) gives NaN; +0 beats -0 in either order (y = -0 tells
  -0 - +0 = -0 from -0 - -0 = +0); infinities."""
  rows = 8
  rng = np.random.default_rng(n)
  x = rng.standard_normal((rows, n)).astype(np.float32)
  x[0, 3] = np.nan
  x[1, n - 1] = np.nan  # in the tail when the width does not divide n
  x[2] = -0.0; x[2, n // 2] = 0.0
  x[3] = 0.0; x[3, 5] = -0.0
  x[4] = -np.inf
  x[5, n - 2] = np.inf
  x[6] = -0.0
  y = np.full((rows, n), -0.0, np.float32)
  ast = row_op(rows, n, dtypes.float32, Ops.MAX)
  bufs = [np.zeros(rows * n, np.float32), x.ravel(), y.ravel()]
  (got, *_), applied = run_cpu(ast, bufs)
  vector_reduces(applied, [2])
  want = reference.run(ast, *bufs)[0]
  gn, wn = np.isnan(got), np.isnan(want)
  assert (gn == wn).all() and (got.view(np.uint32)[~gn] == want.view(np.uint32)[~wn]).all()
  assert gn.reshape(rows, n)[:2].all() and np.signbit(got.reshape(rows, n)[2:4]).all() and not np.signbit(got.reshape(rows, n)[6]).any()


@pytest.mark.parametrize("dt, op", [(dtypes.int32, Ops.ADD), (dtypes.int32, Ops.MUL), (dtypes.int64, Ops.ADD), (dtypes.int8, Ops.ADD),
                                    (dtypes.uint16, Ops.MAX), (dtypes.int32, Ops.MAX)])
@pytest.mark.parametrize("n", [128, 100])
def test_integer_reduces_are_exact(dt: DType, op: Ops, n: int):
  rows = 6
  rng = np.random.default_rng(n)
  info = np.iinfo(dt.np)
  x = rng.integers(info.min, info.max, (rows, n), dtype=dt.np, endpoint=True)  # sums wrap around
  y = rng.integers(info.min, info.max, (rows, n), dtype=dt.np, endpoint=True)
  ast = row_op(rows, n, dt, op)
  bufs = [np.zeros(rows * n, dt.np), x.ravel(), y.ravel()]
  (got, *_), applied = run_cpu(ast, bufs)
  vector_reduces(applied, [2])
  np.testing.assert_array_equal(got, reference.run(ast, *bufs)[0])


def test_explicit_reduce_upcast_that_does_not_divide():
  """An explicit width that leaves a tail of more than one vector, with the output axis unrolled instead of vectorised."""
  rows, n = 8, 77
  x = np.random.default_rng(0).standard_normal((rows, n)).astype(np.float32)
  ast = kernels.softmax((rows, n), dtypes.float32)
  opts = [Opt(OptOps.UNROLL, 1, 7), Opt(OptOps.UPCAST, 2, 16), Opt(OptOps.UPCAST, 3, 24)]
  (got, _), _ = run_cpu(ast, [np.zeros(rows * n, np.float32), x.ravel()], opts)
  close(got, reference.run(ast, np.zeros(rows * n, np.float32), x)[0], n)
