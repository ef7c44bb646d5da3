"""Elementwise kernels that read a channels-last buffer back along NCHW rows (a residual add, a copy to NCHW): the vector's
lanes are a whole number of vectors apart, so the heuristic unrolls the channels by the lanes and each copy's gather
becomes its row of a transpose of aligned blocks, loaded once for all the copies (expand._block_rows). Exact against
numpy, never a read past a buffer's end (the inputs end at a guard page), on this host and as AVX2 code; a buffer that
is no whole number of blocks still gathers."""
from __future__ import annotations

import numpy as np
from cpu_check import check_as_avx2, needs_avx2, run_kernel

from kiln.codegen.choose import OptOps, heuristic_opts
from kiln.codegen.lowering.prepare import prepare
from kiln.codegen.registry import get_runtime
from kiln.ir import AxisType, Ops, UOp, dtypes
from kiln.runtime.cpu.guard import guarded_array, guarded_copy


def nhwc_add(n: int, c: int, h: int, w: int, extra: int = 0, block: int = 0) -> UOp:
  """out[b, ch, y, x] = X[b, y, x, ch] + Y[b, ch, y, x]; X channels-last, or with block > 0 stored (C/block, N*H*W, block)
  (a blocked channels-last product); X holds `extra` elements past its last."""
  size = n * c * h * w
  out, y = UOp.define_global(0, dtypes.float32.ptr(size)), UOp.define_global(2, dtypes.float32.ptr(size))
  x = UOp.define_global(1, dtypes.float32.ptr(size + extra))
  b, ch, yy, xx = UOp.range(n, 0), UOp.range(c, 1), UOp.range(h, 2), UOp.range(w, 3)
  pos = (b * h + yy) * w + xx
  xi = (ch // block) * (n * h * w * block) + pos * block + ch % block if block else pos * c + ch
  nchw = ((b * c + ch) * h + yy) * w + xx
  return UOp.sink(out.index(nchw).store(x.index(xi).load() + y.index(nchw).load()), name="nhwc_add")


def blocked_product(m: int, k: int, n: int) -> UOp:
  """out[i, j] = sum_c W[i, c] * X[c // 16, j, c % 16]: a 1x1 conv's NCHW product over a blocked channels-last input (a
  mobile net's projection after a blocked depthwise conv). Its packed panel's lanes (positions j) are 16 apart."""
  out, w = UOp.define_global(0, dtypes.float32.ptr(m * n)), UOp.define_global(1, dtypes.float32.ptr(m * k))
  x = UOp.define_global(2, dtypes.float32.ptr(k * n))
  i, j, c = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  v = (w.index(i * k + c).load() * x.index((c // 16) * (n * 16) + j * 16 + c % 16).load()).reduce(Ops.ADD, c)
  return UOp.sink(out.index(i * n + j).store(v), name="blocked_product")


def check_all() -> None:
  rng = np.random.default_rng(5)
  target = get_runtime("CPU").target
  lanes = target.vector_bytes // 4
  # (N, C, H, W, elements past X's end, block): whole blocks; a blocked buffer of 32 channels a block; X one element
  # longer (no whole number of blocks: gathers, still exact)
  for n, c, h, w, extra, block, transposed in ((2, 64, 3, 48, 0, 0, True), (1, 96, 2, 32, 0, 32, True), (1, 64, 2, 32, 1, 0, False)):
    ast = nhwc_add(n, c, h, w, extra, block)
    opts = heuristic_opts(prepare(ast)[0], target)
    assert any(o.op is OptOps.UNROLL and o.axis == 1 and o.amount == lanes for o in opts), opts
    xs = rng.standard_normal(n * c * h * w + extra).astype(np.float32)
    ys = rng.standard_normal((n, c, h, w)).astype(np.float32)
    out = guarded_array(n * c * h * w, np.float32)
    src = run_kernel(ast, out, guarded_copy(xs), ys)
    body = xs[:n * c * h * w]
    if block: x = body.reshape(c // block, n, h, w, block).transpose(1, 0, 4, 2, 3).reshape(n, c, h, w)
    else: x = body.reshape(n, h, w, c).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(out.reshape(n, c, h, w), x + ys)
    shuffles = src.count("shufflevector")
    assert (shuffles >= lanes * (lanes.bit_length() - 1)) == transposed, (n, c, h, w, extra, block, shuffles)
  # the packed panel of a product over such an input: each step of its copy takes 16 channels (pack.unroll_rows), whose
  # rows are the transpose of 16-channel blocks, a panel of 32 lanes (AVX-512's two vectors) as two 16 x 16 transposes
  m, k, n = 24, 96, 160
  wt, xs = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k // 16, n, 16)).astype(np.float32)
  out = guarded_array(m * n, np.float32)
  src = run_kernel(blocked_product(m, k, n), out, wt, guarded_copy(xs.reshape(-1)))
  x = xs.transpose(0, 2, 1).reshape(k, n)
  np.testing.assert_allclose(out.reshape(m, n), wt.astype(np.float64) @ x, rtol=1e-4, atol=1e-4)
  assert src.count("shufflevector") >= 16 * 4, src.count("shufflevector")


def test_channels_last_reads_transpose_blocks_in_registers() -> None:
  check_all()


@needs_avx2
def test_channels_last_reads_transpose_blocks_on_avx2() -> None:
  check_as_avx2("test_transposed_loads", "check_all")
