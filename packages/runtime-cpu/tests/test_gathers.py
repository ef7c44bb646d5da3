"""Vector lanes whose indices follow no contiguous, strided or block pattern (a Winograd input transform's windows: tiles
4 apart that cross tile rows, read under the padding's gate) load as one llvm.masked.gather of the vectorised index, not a
scalar load per lane. A lane whose gate is off is never read, even where its index points outside the buffer (the inputs
sit between guard pages); checked against numpy on this host and as AVX2 code, with expand.VECTOR_GATHERS off as well
(the scalar loads), and bool and bfloat16 loads, which have memory forms of their own, keep the scalar loads."""
from __future__ import annotations

import numpy as np
from cpu_check import check_as_avx2, needs_avx2, run_kernel

from kiln.codegen.lowering import expand
from kiln.ir import UOp, dtypes
from kiln.runtime.cpu.guard import guarded_array, guarded_copy

TH, TW, W = 5, 7, 28  # a 5 x 7 grid of tiles 4 apart over rows of W elements (past the map's last row and column: padding)


def tile_corners(dt=dtypes.float32) -> UOp:
  """out[t] = x[4 * ty + 4, 4 * tx + 3] for tile t = ty * TW + tx of the grid, 0 where that is the padding (the last tile
  row or column): the last row's gated-off lanes index past the buffer's end, the guard page."""
  n = TH * TW
  out, x = UOp.define_global(0, dt.ptr(n)), UOp.define_global(1, dt.ptr(4 * TH * W))
  t = UOp.range(n, 0)
  ty, tx = t // TW, t % TW
  v = x.index(ty * (4 * W) + tx * 4 + 4 * W + 3, (ty < TH - 1) & (tx < TW - 1)).load()
  return UOp.sink(out.index(t).store(v), name="tile_corners")


def tile_rows(dt=dtypes.float32) -> UOp:
  """out[t] = x[4 * ty, 4 * tx + 1]: ungated, the same tiles' lanes 4 apart that jump at every tile row."""
  n = TH * TW
  out, x = UOp.define_global(0, dt.ptr(n)), UOp.define_global(1, dt.ptr(4 * TH * W))
  t = UOp.range(n, 0)
  return UOp.sink(out.index(t).store(x.index((t // TW) * (4 * W) + (t % TW) * 4 + 1).load()), name="tile_rows")


def _want(x: np.ndarray, gated: bool) -> np.ndarray:
  m = x.reshape(4 * TH, W)
  ty, tx = np.divmod(np.arange(TH * TW), TW)
  if not gated: return m[4 * ty, 4 * tx + 1]
  on = (ty < TH - 1) & (tx < TW - 1)
  return np.where(on, m[np.minimum(4 * ty + 4, 4 * TH - 1), 4 * tx + 3], 0).astype(x.dtype)


def check_all() -> None:
  rng = np.random.default_rng(5)
  for gathers in (True, False):
    expand.VECTOR_GATHERS = gathers
    try:
      for dt, npdt, gatherable in ((dtypes.float32, np.float32, True), (dtypes.float64, np.float64, True),
                                   (dtypes.int32, np.int32, True), (dtypes.bool, np.bool_, False)):
        for build, gated in ((tile_corners, True), (tile_rows, False)):
          x = guarded_copy(rng.integers(-100, 100, 4 * TH * W).astype(npdt))  # its last element is the guard page's neighbour
          out = guarded_array(TH * TW, npdt)
          src = run_kernel(build(dt), out, x)
          np.testing.assert_array_equal(out, _want(x, gated), err_msg=f"{build.__name__} {dt} gathers={gathers}")
          assert ("@llvm.masked.gather" in src) == (gathers and gatherable), (build.__name__, dt, gathers)
    finally: expand.VECTOR_GATHERS = True


def test_unpatterned_lanes_load_as_one_gather() -> None:
  check_all()


@needs_avx2
def test_gathers_on_avx2() -> None:
  check_as_avx2("test_gathers", "check_all")
