"""Vector lanes that load every 2nd, 3rd or 4th element (a 2x2 pool's rows): one masked load of the span, every c-th lane
on, then the lanes picked out; never a read past the last lane's element (the inputs end at a guard page), on this host
and as AVX2 code. A stride of 5 still gathers."""
from __future__ import annotations

import numpy as np
from cpu_check import check_as_avx2, needs_avx2, run_kernel

from kiln.ir import AxisType, Ops, UOp, dtypes
from kiln.runtime.cpu.guard import guarded_array, guarded_copy


def strided_copy(n: int, c: int, off: int, dt=dtypes.float32) -> UOp:
  """out[i] = x[c*i + off]; x holds exactly c*(n-1) + off + 1 elements."""
  out, x = UOp.define_global(0, dt.ptr(n)), UOp.define_global(1, dt.ptr(c * (n - 1) + off + 1))
  i = UOp.range(n, 0)
  return UOp.sink(out.index(i).store(x.index(i * c + off).load()), name=f"strided_{c}")


def max_pool(n: int, h: int, w: int) -> UOp:
  """out[b, y, x] = max over 2x2 of x[b, 2y + i, 2x + j], x of shape (n, 2h, 2w)."""
  out, x = UOp.define_global(0, dtypes.float32.ptr(n * h * w)), UOp.define_global(1, dtypes.float32.ptr(n * 4 * h * w))
  b, y, xx = UOp.range(n, 0), UOp.range(h, 1), UOp.range(w, 2)
  i, j = UOp.range(2, 3, AxisType.REDUCE), UOp.range(2, 4, AxisType.REDUCE)
  v = x.index(b * (4 * h * w) + (y * 2 + i) * (2 * w) + xx * 2 + j).load().reduce(Ops.MAX, i, j)
  return UOp.sink(out.index(b * (h * w) + y * w + xx).store(v), name="pool2")


def check_all() -> None:
  rng = np.random.default_rng(3)
  for c in (2, 3, 4, 5):
    for n, off, dt, npdt in ((64, 0, dtypes.float32, np.float32), (48, 1, dtypes.float32, np.float32), (16, 2, dtypes.int8, np.int8)):
      x = guarded_copy(rng.integers(-100, 100, c * (n - 1) + off + 1).astype(npdt))  # its last element is the guard page's neighbour
      out = guarded_array(n, npdt)
      src = run_kernel(strided_copy(n, c, off, dt), out, x)
      np.testing.assert_array_equal(out, x[off::c][:n])
      assert ("@llvm.masked.load" in src) == (c != 5), (c, n, off, dt)
  x = rng.standard_normal((4, 32, 32)).astype(np.float32)
  x[1, 3, 5] = np.nan  # max propagates a NaN, as numpy's
  xg = guarded_copy(x.reshape(-1))
  out = guarded_array(4 * 16 * 16, np.float32)
  src = run_kernel(max_pool(4, 16, 16), out, xg)
  assert "@llvm.masked.load" in src
  np.testing.assert_array_equal(out.reshape(4, 16, 16), x.reshape(4, 16, 2, 16, 2).max((2, 4)))


def test_strided_lanes_load_as_one_masked_span() -> None:
  check_all()


@needs_avx2
def test_strided_lanes_on_avx2() -> None:
  check_as_avx2("test_strided_loads", "check_all")
