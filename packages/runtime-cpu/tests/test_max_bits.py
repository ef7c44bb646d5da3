"""A float32 MAX reduction with vector accumulators runs on the values' bits (kiln.codegen.lowering.max_bits: a signed max, an
unsigned max of the complements, an unsigned max, made a float once after the fold). It must give IEEE-754 maximum's
bits exactly as the reference does, for every mix of signed zeros, infinities, denormals and NaNs of either sign (a NaN
with its sign bit set is the one case the signed max cannot see), at every vector width, in the scalar tail, with rows
interleaved, and for a maximum per output lane (a column max under a vectorised output axis)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.registry import get_runtime
from kiln.ir import AxisType, Ops, UOp, dtypes, kernels, reference

RT = get_runtime("CPU")
F32 = dtypes.float32
# bit patterns: +-0, +-inf, quiet and signalling NaNs of both signs, least denormals, +-FLT_MAX, +-1, a negative near zero
SPECIAL = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0xFFFFFFFF,
                    0x00000001, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000, 0x80800000], np.uint32)


def rows_of_specials(rows: int, n: int, seed: int) -> np.ndarray:
  """Rows mixing the special patterns with normals: some all-negative, some all zeros, NaNs of each sign alone."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
  bits = x.view(np.uint32)
  for r in range(rows):
    kind = r % 8
    if kind == 0: bits[r] = rng.choice(SPECIAL, n)  # anything at all
    elif kind == 1: bits[r] |= 0x80000000  # all negative (the max is the one nearest zero)
    elif kind == 2: bits[r] = rng.choice(np.array([0, 0x80000000], np.uint32), n)  # signed zeros only
    elif kind == 3: bits[r] = 0x80000000; bits[r, rng.integers(n)] = 0  # one +0 among -0s
    elif kind == 4: bits[r, rng.integers(n)] = 0xFFC00000  # one negative NaN among positives and negatives
    elif kind == 5: bits[r] |= 0x80000000; bits[r, rng.integers(n)] = 0xFF800001  # a negative NaN among negatives
    elif kind == 6: bits[r] = 0xFF800000  # all -inf
  return x


def check(ast: UOp, bufs: list[np.ndarray], opts: list[Opt] | None) -> str:
  spec = RT.renderer.render(ast, opts=opts)
  got = bufs[0].copy()
  RT.load(RT.compiler.compile(spec))([got.ctypes.data, *(b.ctypes.data for b in bufs[1:])], [])
  want = reference.run(ast, *bufs)[0]
  gn, wn = np.isnan(got), np.isnan(want)
  assert (gn == wn).all(), np.flatnonzero(gn != wn)[:8]
  bad = np.flatnonzero(got.view(np.uint32)[~gn] != want.view(np.uint32)[~wn])
  assert not bad.size, (got[~gn][bad[:8]], want[~wn][bad[:8]])
  return spec.src


def row_max(rows: int, n: int) -> UOp:
  return kernels.reduce_max((rows, n), F32, 1, keepdims=True)


def col_max(rows: int, n: int) -> UOp:
  """out[j] = max_i x[i, j]: the accumulator is a vector of the output's lanes, one maximum per lane."""
  out, x = UOp.define_global(0, F32.ptr(n)), UOp.define_global(1, F32.ptr(rows * n))
  j, i = UOp.range(n, 0), UOp.range(rows, 1, AxisType.REDUCE)
  return UOp.sink(out.index(j).store(x.index(i * n + j).load().reduce(Ops.MAX, i)), name="col_max")


# (row length, UPCAST of the row: None for the heuristic's); widths at most the row
WIDTHS = [(n, w) for n in (16, 64, 100, 128, 1000, 7) for w in (None, 8, 16, 64) if w is None or w <= n]


@pytest.mark.parametrize("n, width", WIDTHS)
def test_row_max_bits_match_the_reference(n: int, width: int | None) -> None:
  rows = 64
  x = rows_of_specials(rows, n, n + (width or 0))
  ast = row_max(rows, n)
  opts = None if width is None else [Opt(OptOps.UPCAST, 1, width)]
  src = check(ast, [np.zeros(rows, np.float32), x.ravel()], opts)
  if width is not None or n >= 16: assert "llvm.umax" in src and "llvm.smax" in src, "the bits path was not taken"


@pytest.mark.parametrize("shape", [(64, 128), (32, 64), (16, 100), (8, 7)])
def test_softmax_with_specials_matches_the_reference(shape: tuple[int, int]) -> None:
  """The softmax's row max (interleaved rows, KEEP) on the same mixtures: NaN rows stay NaN, the rest match bit for bit
  where the reference is exact, and the maxima feed the exps exactly."""
  x = rows_of_specials(*shape, shape[1])
  x[~np.isfinite(x)] = 0.0  # the softmax's exps of infinities are NaN either way; keep the zeros and denormals
  ast = kernels.softmax(shape, F32)
  spec = RT.renderer.render(ast)
  got = np.zeros(x.size, np.float32)
  RT.load(RT.compiler.compile(spec))([got.ctypes.data, x.ctypes.data], [])
  e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
  np.testing.assert_allclose(got.reshape(shape), e / e.sum(1, keepdims=True), rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_column_max_per_lane(rows: int) -> None:
  n = 64
  x = rows_of_specials(n, rows, rows).T.copy()  # each column a mixture
  ast = col_max(rows, n)
  src = check(ast, [np.zeros(n, np.float32), x.ravel()], [Opt(OptOps.UPCAST, 0, 16)])
  assert "llvm.umax" in src


def test_threaded_full_max_keeps_ieee_maximum() -> None:
  """A full reduction split over threads folds float partials: it keeps llvm.maximum (max_bits does not apply), exact too."""
  n = 1 << 17
  x = rows_of_specials(1, n, 3).ravel()
  ast = kernels.reduce_max((n,), F32, 0)
  spec = RT.renderer.render(ast, opts=[Opt(OptOps.UPCAST, 0, 64), Opt(OptOps.THREAD, 0, 4)])
  assert "llvm.maximum" in spec.src
  check(ast, [np.zeros(1, np.float32), x], [Opt(OptOps.UPCAST, 0, 64), Opt(OptOps.THREAD, 0, 4)])
