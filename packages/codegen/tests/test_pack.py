"""The panel copy (PACK): how many panel rows one step takes (unroll_rows), the runs of contiguous lanes (runs), and a
padded conv's operand under its bounds test packed with masked loads."""
from __future__ import annotations

from kiln.codegen.choose import Opt, OptOps, Target, heuristic_opts
from kiln.codegen.choose.heuristic import matmul_rows, operand_load
from kiln.codegen.lowering.pack import runs, unroll_rows
from kiln.codegen.pipeline import lower
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import AxisType, Ops, UOp, dtypes

F32 = dtypes.float32
CPU = Target(device="CPU", vector_bytes=64, threads=2, min_work_per_thread=1 << 12)


def conv(c: int, hw: int, o: int, pad: int) -> UOp:
  """A 3x3 conv of one image as kiln-graph's product: out[f, p] = sum_k W[f, k] * X[ci, y, x], k = (ci, ky, kx); with pad, X
  is read under the bounds test (a gated load under WHERE), else it is the padded input, read plainly."""
  ow, hx = hw, hw + (0 if pad else 2)
  out, wt, x = UOp.define_global(0, F32.ptr(o * ow * ow)), UOp.define_global(1, F32.ptr(o * c * 9)), UOp.define_global(2, F32.ptr(c * hx * hx))
  f, p, k = UOp.range(o, 0), UOp.range(ow * ow, 1), UOp.range(c * 9, 2, AxisType.REDUCE)
  y, xx = p // ow + (k // 3) % 3, p % ow + k % 3
  if pad:
    y, xx = y - pad, xx - pad
    ok = (y >= 0) & (y < hw) & (xx >= 0) & (xx < hw)
    v = ok.where(x.index((k // 9) * (hw * hw) + y * hw + xx, ok).load(), 0.0)
  else: v = x.index((k // 9) * (hx * hx) + y * hx + xx).load()
  return UOp.sink(out.index(f * (ow * ow) + p).store((wt.index(f * (c * 9) + k).load() * v).reduce(Ops.ADD, k)), name="conv")


def test_a_load_under_a_bounds_test_is_a_matmul_operand() -> None:
  ast = conv(16, 16, 32, 1)
  v = next(u for u in ast.toposort() if u.op is Ops.REDUCE).src[0]
  assert all(operand_load(s) is not None for s in v.src) and matmul_rows(ast.src[0]) is not None
  opts = heuristic_opts(ast, CPU)
  assert Opt(OptOps.PACK, 2, 1) in opts and Opt(OptOps.UNROLL, 0, 8) in opts
  lk = lower(ast, CPU)
  masked = [u for u in lk.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and len(u.src[0].src) == 3 and u.src[0].src[2].dtype.count > 1]
  assert masked and all(u.dtype == F32.vec(32) for u in masked)  # the panel rows: masked loads of 32 contiguous lanes
  assert not [u for u in lk.uops if u.op is Ops.LOAD and u.dtype == F32 and u.src[0].src[0].arg == 2]  # no scalar gather of x


def test_unroll_rows_folds_a_conv_window_and_leaves_a_matmul() -> None:
  ast = conv(16, 16, 32, 1)
  red = next(u for u in ast.toposort() if u.op is Ops.REDUCE)
  k = red.src[1]
  ld = next(s for s in red.src[0].src if s.op is Ops.WHERE)
  assert unroll_rows(ld, k, 16 * 9) == 9  # one channel a step: (k // 3) % 3 and k % 3 become constants
  wt = next(s for s in red.src[0].src if s.op is Ops.LOAD)
  assert unroll_rows(wt, k, 16 * 9) == 1  # no // or % of k: one row a step, as before
  q = UOp.range(7 * 11, 5, AxisType.REDUCE)
  x = UOp.define_global(3, F32.ptr(1 << 12))
  assert unroll_rows(x.index((q * 5) // 7).load(), q, 77) == 7  # k = 7q' + c: (35q' + 5c) // 7 = 5q' + (5c) // 7


def test_runs_split_a_window_row_over_output_rows() -> None:
  lane = UOp(Ops.DEFINE_VAR, dtypes.index, (), ("vec.1", 0, 31))
  t = UOp.range(4, 0)
  x = UOp.define_global(0, F32.ptr(1 << 12))
  p = t * 32 + lane
  padded_row = x.index((p // 16) * 18 + p % 16).load()  # 32 lanes over two rows of 16 of an 18-wide padded image
  rs = runs(padded_row, lane, 32)
  assert [(at, n) for _, at, (_, n) in rs] == [(0, 16), (16, 16)]
  contiguous = x.index(p).load()
  assert [(at, n) for _, at, (_, n) in runs(contiguous, lane, 32)] == [(0, 32)]
  strided = x.index(p * 2).load()  # not contiguous in any run: all lanes, gathered
  assert [(at, n) for _, at, (_, n) in runs(strided, lane, 32)] == [(0, 32)]


def test_a_panel_one_row_tile_reads_is_not_packed() -> None:
  """PACK only where at least two row tiles read the panel: with one (an RNN step's 8 rows of H @ R^T) each element is
  read once either way, and the copy is all cost."""
  from kiln.ir import kernels
  def packs(m: int) -> bool: return any(o.op is OptOps.PACK for o in heuristic_opts(kernels.matmul(m, 512, 128), CPU))
  assert not packs(8) and packs(16) and packs(1024)


def test_a_panel_stored_as_its_copy_is_read_in_place() -> None:
  """A weight stored in blocks of the register tile's 32 columns, (N/32, K, 32) (conv._product_blocked), is each column
  tile's panel laid out as the copy would lay it: PACK is chosen but copies nothing (no scratch), and the tile reads the
  weight with whole-vector loads. Stored (K, N) it is copied, one K x 32 panel per thread."""
  m, n, k = 96, 128, 64
  def blocked(stride: bool) -> UOp:
    c, a, b = UOp.define_global(0, F32.ptr(m * n)), UOp.define_global(1, F32.ptr(m * k)), UOp.define_global(2, F32.ptr(k * n))
    jb, i, lane, r = UOp.range(n // 32, 0), UOp.range(m, 1), UOp.range(32, 2), UOp.range(k, 3, AxisType.REDUCE)
    w = b.index(r * n + jb * 32 + lane) if stride else b.index(jb * (k * 32) + r * 32 + lane)
    return UOp.sink(c.index(jb * (m * 32) + i * 32 + lane).store((a.index(i * k + r).load() * w.load()).reduce(Ops.ADD, r)), name="blocked")
  assert any(o.op is OptOps.PACK for o in heuristic_opts(blocked(False), CPU))
  assert LLVMRenderer(CPU).render(blocked(False)).scratch_bytes == 0
  assert LLVMRenderer(CPU).render(blocked(True)).scratch_bytes > 0
  lk = lower(blocked(False), CPU)
  w_loads = [u for u in lk.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0].arg == 2]
  assert w_loads and all(u.dtype.count > 1 for u in w_loads)
