"""GPU reductions (render/cuda_c.py's kiln_warp_/kiln_block_/kiln_grid_ helpers, opt._gpu_opts's row and full reduction cuts) under the
CPU emulation harness, against the reference evaluator, and a model of the fixed tree in numpy that the results must match bit
for bit. Also: the emulator's shuffles on a hand-written kernel, and nvcc compiles for sm_90. Nothing here ran on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.render import CUDARenderer
from kiln.ir import kernels
from kiln.ir.alu import round_to, to_storage
from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import AxisType, Ops
from kiln.ir.reference import evaluate
from kiln.ir.uop import UOp

from .conftest import requires_cxx, requires_nvcc

emulate = pytest.importorskip("kiln.runtime.cuda.emulate")
pytestmark = requires_cxx


def run(ast, bufs, opts=None, workers=None):
  """Render for CUDA, run under emulation; returns (spec, what the kernel wrote, what the reference wrote)."""
  spec = CUDARenderer().render(ast, opts)
  want = [b.copy() for b in bufs]
  evaluate(ast, want, {})
  got = [b.copy() for b in bufs]
  prog = emulate.EmulatedProgram(spec)
  prog.kernel(got, [], *prog.sizes([]), workers=workers)
  return spec, got, want


def storage(dt: DType, a: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(to_storage(dt, round_to(dt, a.astype(np.float32))) if dt.is_float else a.astype(dt.np))


def as_f64(dt: DType, a: np.ndarray) -> np.ndarray:
  return (a.view(np.float16) if dt == dtypes.float16 else a).astype(np.float64)


def assert_sums_close(dt: DType, got, want, x_abs_rows, eps):
  """A sum folded in another order than the reference's: within eps of the sum of magnitudes of its row, NaN where NaN."""
  g, w = as_f64(dt, got), as_f64(dt, want)
  assert np.array_equal(np.isnan(g), np.isnan(w))
  ok = ~np.isnan(w)
  assert np.all(np.abs(g - w)[ok] <= eps * np.maximum(x_abs_rows[ok], 1e-30)), (g[ok][:8], w[ok][:8])


# ---- row reductions: one block (a warp for short rows) per row ----

@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 4096])
def test_row_sums(n):
  rows = 6
  x = np.random.default_rng(n).standard_normal((rows, n)).astype(np.float32)
  spec, got, want = run(kernels.reduce_sum((rows, n), dtypes.float32, axes=1), [np.zeros(rows, np.float32), x.ravel()])
  if n >= 32:  # a block per row, the row over its threads
    assert spec.applied_opts[0].startswith("GROUP(axis=1") and spec.global_size == (rows, 1, 1)
    # a warp for short rows, then as many threads as give each 4 elements at least, up to 256
    assert spec.local_size[0] == {32: 32, 33: 32, 1000: 128, 4096: 256}[n] and "kiln_block_sum_float32" in spec.src and "__shfl_xor_sync" in spec.src
  else: assert not any(o.startswith("GROUP") for o in spec.applied_opts)
  assert_sums_close(dtypes.float32, got[0], want[0], np.abs(x).sum(1), 1e-6)


def tree_model(parts: np.ndarray, op) -> np.ndarray:
  """kiln_block_*: the butterfly over each warp, one value per warp, the butterfly over the warps; returns every lane's value."""
  v, n = parts.copy(), len(parts)
  def fly(v, span):
    o = span // 2
    while o:
      v = op(v, v[np.arange(len(v)) ^ o])
      o //= 2
    return v
  v = np.concatenate([fly(v[w:w + 32], min(n, 32)) for w in range(0, n, 32)])
  if n <= 32: return v
  nw = n // 32
  return fly(np.array([v[32 * (lane % nw)] for lane in range(32)], v.dtype), nw)


@pytest.mark.parametrize("rows", [32, 37, 1000])
@pytest.mark.parametrize("kind", ["sum", "max", "softmax"])
def test_short_rows_stack_in_a_block(rows, kind):
  """Rows of one warp each: a block stacks local_size / 32 of them on threadIdx.y (an SM holds at most 32 blocks, so a block of
  one warp would leave half its threads idle), the last block's extra rows gated off, each warp's tree its own shuffles."""
  cols = 100
  x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
  ast = {"sum": kernels.reduce_sum((rows, cols), dtypes.float32, axes=1), "max": kernels.reduce_max((rows, cols), dtypes.float32, axes=1),
         "softmax": kernels.softmax((rows, cols), dtypes.float32)}[kind]
  out = np.full(rows * (cols if kind == "softmax" else 1), np.nan, np.float32)
  spec, got, want = run(ast, [out, x.ravel()])
  assert "LOCAL(axis=0, 8)" in spec.applied_opts and spec.local_size == (32, 8, 1) and spec.global_size == (-(-rows // 8), 1, 1)
  if kind == "max": assert np.array_equal(got[0], want[0])  # max is exact whatever the order
  elif kind == "sum": assert_sums_close(dtypes.float32, got[0], want[0], np.abs(x).sum(1), 1e-6)
  else: assert np.allclose(got[0], want[0], rtol=1e-5, atol=1e-7) and not np.isnan(got[0]).any()


@pytest.mark.parametrize("shape", [(100,), (1, 100)])
def test_one_short_row_with_its_columns(shape):
  """One row of a warp's length and its columns shared by the same threads (a decode step's softmax or norm): no row axis
  to stack on a block (the heuristic indexed the grid's first row axis, which such a kernel has none of: IndexError)."""
  x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
  spec, got, want = run(kernels.softmax(shape, dtypes.float32), [np.full(100, np.nan, np.float32), x])
  assert spec.local_size == (32, 1, 1) and spec.global_size == (1, 1, 1)
  assert np.allclose(got[0], want[0], rtol=1e-5, atol=1e-7) and not np.isnan(got[0]).any()


def test_a_group_stacks_rows_only_as_one_warp_per_row():
  from kiln.ir.errors import CodegenError
  r = CUDARenderer()
  rows = kernels.reduce_sum((64, 300), dtypes.float32, axes=1)
  with pytest.raises(CodegenError, match="one warp per row"): r.render(rows, [Opt(OptOps.GROUP, 1, 64), Opt(OptOps.LOCAL, 0, 4)])
  assert r.render(rows, [Opt(OptOps.GROUP, 1, 32), Opt(OptOps.LOCAL, 0, 4)]).local_size == (32, 4, 1)


def test_row_sum_is_the_fixed_tree_bit_for_bit():
  # the GROUP's order: thread t folds t, t + g, ... in order, then the tree; modelled in float32 it gives the same bits
  rows, n, g = 3, 1000, 128
  x = np.random.default_rng(1).standard_normal((rows, n)).astype(np.float32) * np.float32(1e3)
  spec, got, _ = run(kernels.reduce_sum((rows, n), dtypes.float32, axes=1), [np.zeros(rows, np.float32), x.ravel()],
                     opts=[Opt(OptOps.GROUP, 1, g)])
  for r in range(rows):
    parts = np.zeros(g, np.float32)
    for i in range(0, n, g):
      chunk = x[r, i:i + g]
      parts[:len(chunk)] += chunk
    assert got[0][r] == tree_model(parts, np.add)[0]


@pytest.mark.parametrize("n", [7, 128, 1024])
@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float16])
def test_softmax_rows(n, dt):
  rows = 5
  x = storage(dt, np.random.default_rng(n).standard_normal((rows, n)) * 3)
  spec, got, want = run(kernels.softmax((rows, n), dt), [storage(dt, np.zeros(rows * n)), x.ravel()])
  if n >= 32:  # the row's max and sum from two block trees, every thread then stores its columns
    assert spec.applied_opts[-1].startswith("SPREAD(axis=1") and spec.global_size == (rows, 1, 1)
    assert "kiln_block_max" in spec.src and "kiln_block_sum" in spec.src
  g, w = as_f64(dt, got[0]), as_f64(dt, want[0])
  xf = as_f64(dt, x).reshape(rows, n)
  e = np.exp(xf - xf.max(1, keepdims=True))
  truth = (e / e.sum(1, keepdims=True)).ravel()
  if dt == dtypes.float32: assert np.allclose(g, w, rtol=1e-5, atol=1e-9)  # exp2f's ulps and the sum's order
  else:  # half: the reference sums in order, rounding to half each step; the tree's rounding errors add up over log2 levels
    assert np.allclose(g, truth, rtol=1e-2, atol=1e-6) and np.allclose(g, w, rtol=3e-2, atol=1e-6)
  assert np.allclose(g.reshape(rows, n).sum(1), 1.0, rtol=1e-2)


def test_layernorm_like_rows():
  # mean and mean of squares over the row (two GROUPs, the second holds the first), the columns SPREAD
  rows, n = 4, 768
  x = np.random.default_rng(2).standard_normal((rows, n)).astype(np.float32)
  buf_x = kernels.buffer(1, dtypes.float32, (rows, n))
  i, j = (UOp.range(rows, 0), UOp.range(n, 1))
  r1, r2 = UOp.range(n, 2, AxisType.REDUCE), UOp.range(n, 3, AxisType.REDUCE)
  mean = buf_x.index(i * n + r1).load().reduce(Ops.ADD, r1) * (1.0 / n)
  d = buf_x.index(i * n + r2).load() - mean
  var = (d * d).reduce(Ops.ADD, r2) * (1.0 / n)
  out = kernels.buffer(0, dtypes.float32, (rows, n)).index(i * n + j).store((buf_x.index(i * n + j).load() - mean) * (var + 1e-5).sqrt().reciprocal())
  ast = UOp.sink(out, name="layernorm")
  spec, got, want = run(ast, [np.zeros(rows * n, np.float32), x.ravel()])
  assert spec.applied_opts == ["GROUP(axis=2, 128)", "GROUP(axis=3, 128)", "SPREAD(axis=1, 128)"]  # 6 elements a thread
  assert np.allclose(got[0], want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["rows", "cols", "both", "full"])
def test_symbolic_sizes(case):
  # a symbolic row count (the grid's x), row length (the trees' loops and SPREAD's, gated) or both; a symbolic full max stays
  # one block (BLOCKS needs a constant size)
  n, m = UOp.variable("n", 1, 4096), UOp.variable("m", 1, 5000)
  ast, vals, shape = {"rows": (kernels.softmax((n, 1000), dtypes.float32), {"n": 5}, (5, 1000)),
                      "cols": (kernels.softmax((7, m), dtypes.float32), {"m": 333}, (7, 333)),
                      "both": (kernels.reduce_sum((n, m), dtypes.float32, axes=1), {"n": 3, "m": 3001}, (3, 3001)),
                      "full": (kernels.reduce_max((m,), dtypes.float32), {"m": 4999}, (4999,))}[case]
  spec = CUDARenderer().render(ast)
  assert any(o.startswith("GROUP") for o in spec.applied_opts) and not any(o.startswith("BLOCKS") for o in spec.applied_opts)
  x = np.random.default_rng(12).standard_normal(shape).astype(np.float32).ravel()
  out = np.zeros(x.size if case in ("rows", "cols") else shape[0] if case == "both" else 1, np.float32)
  want = [out.copy(), x.copy()]
  evaluate(ast, want, vals)
  got = [out.copy(), x.copy()]
  prog = emulate.EmulatedProgram(spec)
  v = [vals[k] for k in spec.var_names]
  prog(got, v)  # (a kernel that reads its variables from memory takes them as an array: EmulatedProgram)
  assert np.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


# ---- full reductions: two stages across blocks ----

def test_full_sum_of_a_million_in_two_stages():
  n = 10**6
  x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
  spec, got, want = run(kernels.reduce_sum((n,), dtypes.float32), [np.zeros(1, np.float32), x])
  assert spec.applied_opts == ["GROUP(axis=0, 256)", "BLOCKS(axis=0, 244)"] and spec.global_size == (244, 1, 1)
  assert "atomicAdd" in spec.src and "__threadfence" in spec.src
  assert_sums_close(dtypes.float32, got[0], want[0], np.array([np.abs(x).sum()]), 1e-6)
  # the same bits whichever block finishes last: other worker counts (other interleavings of the blocks), and a numpy model
  for w in (1, 3, 7):
    assert run(kernels.reduce_sum((n,), dtypes.float32), [np.zeros(1, np.float32), x], workers=w)[1][0][0] == got[0][0]
  nb, g = 244, 256
  blocks = np.zeros(nb, np.float32)
  for b in range(nb):
    parts = np.zeros(g, np.float32)
    for step in range(-(-n // (g * nb))):
      lo = (step * nb + b) * g
      chunk = x[lo:lo + g]
      parts[:len(chunk)] += chunk
    blocks[b] = tree_model(parts, np.add)[0]
  parts = np.zeros(g, np.float32)
  for i in range(0, nb, g): parts[:len(blocks[i:i + g])] += blocks[i:i + g]
  assert got[0][0] == tree_model(parts, np.add)[0]


def test_full_reduction_runs_again():
  # the done count goes back to 0 after each launch: a second launch of the same loaded kernel folds again
  n = 1 << 16
  ast = kernels.reduce_sum((n,), dtypes.int32)
  spec = CUDARenderer().render(ast)
  assert any(o.startswith("BLOCKS") for o in spec.applied_opts)
  prog = emulate.EmulatedProgram(spec)
  for k in range(3):
    x, out = np.full(n, k + 1, np.int32), np.zeros(1, np.int32)
    prog.kernel([out, x], [], *prog.sizes([]))
    assert out[0] == n * (k + 1)


def test_few_long_rows_are_cut_over_blocks_per_row():
  # 3 rows of 10^6: 244 blocks per row on the grid's x, the rows on y; each row its own slots and done count
  rows, n = 3, 10**6
  x = np.random.default_rng(9).standard_normal((rows, n)).astype(np.float32)
  spec, got, want = run(kernels.reduce_sum((rows, n), dtypes.float32, axes=1), [np.zeros(rows, np.float32), x.ravel()])
  assert spec.applied_opts == ["GROUP(axis=1, 256)", "BLOCKS(axis=1, 244)"] and spec.global_size == (244, rows, 1)
  assert_sums_close(dtypes.float32, got[0], want[0], np.abs(x).sum(1), 1e-6)
  # explicit options: 2 x 3 rows on y and z, 5 blocks each
  x6 = np.random.default_rng(10).integers(-1000, 1000, (2, 3, 7000)).astype(np.int32)
  ast = kernels.reduce_sum((2, 3, 7000), dtypes.int32, axes=2)
  spec, got, want = run(ast, [np.zeros(6, np.int32), x6.ravel()], opts=[Opt(OptOps.GROUP, 2, 128), Opt(OptOps.BLOCKS, 2, 5)])
  assert spec.global_size == (5, 3, 2) and np.array_equal(got[0], want[0])


def test_full_variance_two_trees_in_one_block():
  # the mean and the sum of squares about it: two GROUPs of one block (BLOCKS takes one REDUCE only)
  n = 100000
  x = np.random.default_rng(11).standard_normal(n).astype(np.float32) + 3
  bx = kernels.buffer(1, dtypes.float32, (n,))
  r1, r2 = UOp.range(n, 0, AxisType.REDUCE), UOp.range(n, 1, AxisType.REDUCE)
  mean = bx.index(r1).load().reduce(Ops.ADD, r1) * (1.0 / n)
  d = bx.index(r2).load() - mean
  ast = UOp.sink(kernels.buffer(0, dtypes.float32, (1,)).index(0).store((d * d).reduce(Ops.ADD, r2) * (1.0 / n)), name="variance")
  spec, got, want = run(ast, [np.zeros(1, np.float32), x])
  assert spec.applied_opts == ["GROUP(axis=0, 256)", "GROUP(axis=1, 256)"]
  assert abs(got[0][0] - x.astype(np.float64).var()) <= 1e-5 and abs(got[0][0] - want[0][0]) <= 1e-4


@pytest.mark.parametrize("n", [1, 63, 64, 5000])
def test_small_full_sums(n):
  x = np.arange(n, dtype=np.float32)
  spec, got, want = run(kernels.reduce_sum((n,), dtypes.float32), [np.full(1, 7, np.float32), x])
  assert got[0][0] == want[0][0]  # integers in float32: exact in any order


def test_empty_full_sum():
  # a reduce axis of constant size 0 (kernels.reduce wants dims >= 1): the identity is stored, with or without the tree
  r = UOp.range(0, 0, AxisType.REDUCE)
  v = kernels.buffer(1, dtypes.float32, (1,)).index(r).load().reduce(Ops.ADD, r)
  ast = UOp.sink(kernels.buffer(0, dtypes.float32, (1,)).index(0).store(v), name="empty_sum")
  spec, got, want = run(ast, [np.full(1, 7, np.float32), np.zeros(1, np.float32)])
  assert got[0][0] == want[0][0] == 0.0


# ---- max (and min as the max of the negation) with NaN and -inf; integers; float16 ----

@pytest.mark.parametrize("shape", [(4, 1000), (300000,)])
def test_max_and_min_with_nan_and_minus_inf(shape):
  rng = np.random.default_rng(4)
  x = rng.standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1, shape[-1])
  flat[0, 17] = np.nan  # row 0: NaN propagates
  flat[-1, :] = -np.inf  # the last row: all -inf
  if flat.shape[0] > 2: flat[1, 3] = np.inf
  for fn in (None, lambda v: -v):  # max, and min(x) = -max(-x)
    ast = kernels.reduce(Ops.MAX, shape, dtypes.float32, axes=len(shape) - 1, fn=fn)
    spec, got, want = run(ast, [np.zeros(max(1, flat.shape[0] if len(shape) > 1 else 1), np.float32), x.ravel()])
    assert any(o.startswith("GROUP") for o in spec.applied_opts)
    assert np.array_equal(got[0], want[0], equal_nan=True)  # max is exact in any order


@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.int64, dtypes.uint8, dtypes.int16])
def test_integer_reductions_exact(dt):
  rng = np.random.default_rng(5)
  x = rng.integers(int(dt.min), int(dt.max), size=(3, 4000), endpoint=True).astype(dt.np)
  for op in (Ops.ADD, Ops.MAX):  # sums wrap
    for shape, axes in (((3, 4000), 1), ((12000,), 0)):
      ast = kernels.reduce(op, shape, dt, axes=axes)
      spec, got, want = run(ast, [np.zeros(3 if axes else 1, dt.np), x.ravel()])
      assert any(o.startswith("GROUP") for o in spec.applied_opts)
      assert np.array_equal(got[0], want[0]), (op, shape)


def test_bool_reductions():
  # bool ADD is OR and MAX is OR too: a row with one True somewhere, a row with none, a full reduction over both
  x = np.zeros((3, 4000), np.bool_)
  x[0, 3999] = x[2, 1] = True
  for op in (Ops.ADD, Ops.MAX):
    for shape, axes, n_out in (((3, 4000), 1, 3), ((12000,), 0, 1)):
      spec, got, want = run(kernels.reduce(op, shape, dtypes.bool, axes=axes), [np.zeros(n_out, np.bool_), x.ravel()])
      assert any(o.startswith("GROUP") for o in spec.applied_opts) and np.array_equal(got[0], want[0])
  assert list(want[0]) == [True]


def test_float16_sums():
  # the reference adds in order, rounding to half every step: past 1024 each add of a value under 1 loses most of it. The tree
  # rounds as often (kiln_rh after each op) but adds values of like size, so it lands nearer the true sum than the reference
  dt = dtypes.float16
  x = storage(dt, np.random.default_rng(6).random((4, 2048)))
  spec, got, want = run(kernels.reduce_sum((4, 2048), dt, axes=1), [storage(dt, np.zeros(4)), x.ravel()])
  assert "kiln_rh" in spec.src and any(o.startswith("GROUP") for o in spec.applied_opts)
  truth = as_f64(dt, x).reshape(4, -1).sum(1)
  g, w = as_f64(dt, got[0]), as_f64(dt, want[0])
  assert np.all(np.abs(g - truth) <= 2e-3 * truth) and np.all(np.abs(g - truth) <= np.abs(w - truth) + 1), (g, w, truth)
  xs = storage(dt, np.random.default_rng(7).random(1 << 17) * 0.01)
  spec, got, want = run(kernels.reduce_sum((1 << 17,), dt), [storage(dt, np.zeros(1)), xs])
  assert any(o.startswith("BLOCKS") for o in spec.applied_opts)
  assert abs(as_f64(dt, got[0])[0] - as_f64(dt, xs).sum()) <= 2e-3 * as_f64(dt, xs).sum()


# ---- the heuristic's limits and the options' checks ----

def test_heuristic_keeps_one_thread_per_output_where_a_tree_does_not_pay():
  r = CUDARenderer()
  assert r.render(kernels.reduce_sum((64, 1000), dtypes.float32, axes=0)).applied_opts[0].startswith("LOCAL")  # a column sum: coalesced
  assert r.render(kernels.matmul(64, 64, 64)).applied_opts[0].startswith("TILED_MATMUL")  # a matmul: its own tiled kernel
  assert r.render(kernels.matmul(8, 64, 64)).applied_opts[0].startswith("LOCAL")  # too few rows to tile: not a row reduction
  assert r.render(kernels.reduce_sum((64, 16), dtypes.float32, axes=1)).applied_opts[0].startswith("LOCAL")  # rows under a warp


def test_option_checks():
  from kiln.ir.errors import CodegenError
  r = CUDARenderer()
  sm = kernels.softmax((4, 256), dtypes.float32)
  with pytest.raises(CodegenError, match="share its block"):
    r.render(sm, [Opt(OptOps.GROUP, 2, 64), Opt(OptOps.GROUP, 3, 128), Opt(OptOps.SPREAD, 1, 64)])
  with pytest.raises(CodegenError, match="SPREAD"): r.render(sm, [Opt(OptOps.GROUP, 2, 64), Opt(OptOps.GROUP, 3, 64), Opt(OptOps.SPREAD, 1, 32)])
  with pytest.raises(CodegenError, match="varies along SPREAD"):  # a matmul's k tree would run inside its columns' gate
    r.render(kernels.matmul(8, 100, 64), [Opt(OptOps.GROUP, 2, 64), Opt(OptOps.SPREAD, 1, 64)])
  with pytest.raises(CodegenError, match="BLOCKS"): r.render(kernels.reduce_sum((4096,), dtypes.float32), [Opt(OptOps.BLOCKS, 0, 4)])
  two = UOp.sink(*(kernels.reduce_sum((8192,), dtypes.float32).src[0].replace(src=(kernels.buffer(k, dtypes.float32, (1,)).index(0),
                  kernels.reduce_sum((8192,), dtypes.float32).src[0].src[1])) for k in (0, 2)), name="two")
  with pytest.raises(CodegenError, match="one store"): r.render(two, [Opt(OptOps.GROUP, 0, 64), Opt(OptOps.BLOCKS, 0, 4)])
  with pytest.raises(CodegenError, match="BLOCKS cannot be combined with SPREAD"):
    r.render(sm, [Opt(OptOps.GROUP, 2, 64), Opt(OptOps.GROUP, 3, 64), Opt(OptOps.SPREAD, 1, 64), Opt(OptOps.BLOCKS, 3, 2)])
  with pytest.raises(CodegenError, match="GROUP needs every output axis on the grid"):  # rows on y and z: constant sizes only
    r.render(kernels.reduce_sum((UOp.variable("m", 1, 8), 4096), dtypes.float32, axes=1), [Opt(OptOps.GROUP, 1, 64), Opt(OptOps.BLOCKS, 1, 4)])


# ---- the emulator's shuffles ----

SHFL = """extern "C" __global__ void __launch_bounds__(64) shfl(int* __restrict__ data0) {
  int t = threadIdx.x, lane = t & 31;
  data0[t] = __shfl_xor_sync(0xffffffffu, t * 10, 5);
  data0[64 + t] = __shfl_down_sync(0xffffffffu, t * 10, 3);
  data0[128 + t] = __shfl_sync(0xffffffffu, t * 10, (lane + 7) & 31);
  data0[192 + t] = __shfl_up_sync(0xffffffffu, t * 10, 2, 16);
}"""


@pytest.mark.parametrize("mode", emulate.MODES)
def test_emulated_shuffles_follow_cuda(mode):
  out = np.zeros(256, np.int32)
  emulate.emulate(SHFL, "shfl", [out], [], (1, 1, 1), (64, 1, 1), mode=mode)
  t = np.arange(64)
  lane, base = t & 31, t & ~31
  assert np.array_equal(out[:64], (base + (lane ^ 5)) * 10)
  assert np.array_equal(out[64:128], np.where(lane + 3 < 32, t + 3, t) * 10)  # past the warp: its own value
  assert np.array_equal(out[128:192], (base + ((lane + 7) & 31)) * 10)
  assert np.array_equal(out[192:], np.where((lane & 15) >= 2, t - 2, t) * 10)  # within segments of 16


@pytest.mark.parametrize("mode", emulate.MODES)
def test_block_tree_in_both_emulation_modes(mode):
  x = np.random.default_rng(8).standard_normal((3, 3000)).astype(np.float32)
  spec = CUDARenderer().render(kernels.reduce_sum((3, 3000), dtypes.float32, axes=1))
  outs = []
  for _ in range(2):
    out = np.zeros(3, np.float32)
    emulate.emulate(spec.src, spec.name, [out, x.ravel()], [], spec.global_size, spec.local_size, mode=mode)
    outs.append(out)
  assert np.array_equal(outs[0], outs[1]) and np.allclose(outs[0], x.sum(1, dtype=np.float64), rtol=1e-5)
  # and the grid stage: blocks in turn (threads) or spread over host threads (fibers) give the same bits
  xs = x.ravel()[:9000].copy()
  spec = CUDARenderer().render(kernels.reduce_sum((9000,), dtypes.float32))
  assert any(o.startswith("BLOCKS") for o in spec.applied_opts)
  full = []
  for m in emulate.MODES:
    out = np.zeros(1, np.float32)
    emulate.emulate(spec.src, spec.name, [out, xs], [], spec.global_size, spec.local_size, mode=m)
    full.append(out[0])
  assert full[0] == full[1] and abs(full[0] - xs.sum(dtype=np.float64)) <= 1e-5 * np.abs(xs).sum()


# ---- nvcc ----

@requires_nvcc
@pytest.mark.parametrize("ast", [kernels.reduce_sum((10**6,), dtypes.float32), kernels.softmax((64, 1024), dtypes.float16),
                                 kernels.reduce_max((64, 1000), dtypes.int32, axes=1), kernels.reduce_sum((1 << 20,), dtypes.bfloat16),
                                 kernels.reduce_max((1 << 20,), dtypes.float64), kernels.reduce_sum((8, 100), dtypes.int64, axes=1)],
                         ids=["sum_1e6", "softmax_f16", "rowmax_i32", "sum_bf16", "max_f64", "rowsum_i64"])
def test_nvcc_compiles_for_sm90(ast, nvcc_compiler):
  spec = CUDARenderer().render(ast)
  assert any(o.startswith("GROUP") for o in spec.applied_opts)
  ptx, _ = nvcc_compiler.compile_src(spec.src, spec.name)
  assert "shfl.sync.bfly" in ptx and ("bar.sync" in ptx) == (spec.local_size[0] > 32)  # one warp: shuffles only
