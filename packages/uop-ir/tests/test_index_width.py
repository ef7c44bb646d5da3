"""Index values never wrap at build time: a range, special or index whose bounds pass int32 is int64 (dtypes.index64),
one that fits stays dtypes.index (int32), and flat_index widens from the first product or sum that passes int32. Before,
UOp.range(2**31) made the int32 constant -2**31 (a loop that never ran: a sum over 2**31 elements returned 0.0)."""
import numpy as np
import pytest

from kiln.ir import IRError, IRTypeError, Ops, UOp, dtypes
from kiln.ir.analysis import sym_int_eval
from kiln.ir.dtype import index_dtype
from kiln.ir.kernels import flat_index
from kiln.ir.reference import run
from kiln.ir.verify import verify

I32, I64 = dtypes.int32, dtypes.int64
EDGE = 2**31 - 1  # the last int32 value


def test_index_dtype_boundary():
  assert dtypes.index is I32 and dtypes.index64 is I64
  assert index_dtype(0, EDGE) is I32 and index_dtype(-2**31, 0) is I32
  assert index_dtype(0, EDGE + 1) is I64 and index_dtype(-2**31 - 1, 0) is I64


@pytest.mark.parametrize("end,dt", [(EDGE, I32), (EDGE + 1, I64), (2**32 + 1, I64), (0, I32)])
def test_range_end_picks_its_dtype(end, dt):
  r = UOp.range(end, 0)
  assert r.dtype == dt and r.src[0].dtype == dt and r.src[0].arg == end  # never the wrapped -2**31
  assert (r.vmin, r.vmax) == (0, max(end - 1, 0))


def test_range_of_a_uop_end_keeps_what_its_bounds_need():
  n = UOp.variable("n", 1, 1 << 20)
  assert UOp.range(n, 0).src[0] is n  # int32, fits: unchanged
  wide = n.cast(I64) * 4096  # up to 2**32
  assert UOp.range(wide, 0).dtype == I64 and UOp.range(wide, 0).src[0] is wide
  small = n.cast(I64) * 2  # an int64 end whose bounds fit: cast down as before
  assert UOp.range(small, 0).dtype == I32 and UOp.range(small, 0).src[0].op is Ops.CAST
  assert UOp.range(7, 0, dtype=I64).src[0] == UOp.const(I64, 7)  # a stand-in keeps the dtype of the range it replaces
  with pytest.raises(IRError, match="does not fit"): UOp.range(2**63, 0)
  with pytest.raises(IRTypeError, match="must be an integer"): UOp.range(UOp.const(dtypes.float32, 2.0), 0)


def test_special_size_picks_its_dtype():
  assert UOp.special("gidx0", 1024).dtype == I32
  assert UOp.special("gidx0", 2**31).dtype == I64


def test_index_keeps_a_wide_offset():
  g = UOp.define_global(0, dtypes.float32.ptr(2**33))
  assert g.index(2**31).src[1] == UOp.const(I64, 2**31)  # was the int32 -2**31
  assert g.index(5).src[1] == UOp.const(I32, 5)
  r = UOp.range(2**33, 0)
  assert g.index(r).src[1] is r
  n = UOp.variable("n", 0, 100)
  assert g.index(n.cast(I64)).src[1].dtype == I32  # an int64 offset whose bounds fit is int32, as before


@pytest.mark.parametrize("shape,dt", [((2, 2**30), I32), ((3, 2**30), I64), ((2**31,), I64), ((2**16, 2**15 - 1), I32),
                                      ((2**16, 2**15 + 1), I64)])
def test_flat_index_widens_at_the_boundary(shape, dt):
  idx = tuple(UOp.range(d, a) for a, d in enumerate(shape))
  f = flat_index(idx, shape)
  assert f.dtype == dt
  assert (f.vmin, f.vmax) == (0, int(np.prod(shape)) - 1)  # no wrap: the last element is the last index
  last = sym_int_eval(f.substitute({r: UOp.const(r.dtype, int(d) - 1) for r, d in zip(idx, shape)}), {})
  assert last == int(np.prod(shape)) - 1


def test_flat_index_of_a_wide_tail_and_a_narrow_head():
  """A stride past 2**31 on a size-2 axis: the product passes int32, so that term and the sum are int64."""
  i, j = UOp.range(3, 0), UOp.range(2**31 + 5, 1)
  f = flat_index((i, j), (3, 2**31 + 5))
  assert f.dtype == I64 and f.vmax == 3 * (2**31 + 5) - 1


def test_reference_runs_an_int64_range():
  """The evaluator takes int64 ranges and indices as it takes int32 ones (the oracle for wide kernels)."""
  r = UOp.range(UOp.const(I64, 6), 0)
  out, src = UOp.define_global(0, dtypes.int64.ptr(6)), UOp.define_global(1, dtypes.int64.ptr(6))
  ast = UOp.sink(out.index(r).store(src.index(r * 1).load() + r), name="wide")
  verify(ast)
  assert ast.src[0].src[0].src[1].dtype == I32  # index() narrows an offset whose bounds fit
  assert run(ast, np.zeros(6, np.int64), np.arange(6, dtype=np.int64) * 10)[0].tolist() == [0, 11, 22, 33, 44, 55]
