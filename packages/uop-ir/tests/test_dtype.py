"""dtypes: vec/ptr, itemsize, min/max, numpy mapping, promotion, parsing."""
import numpy as np
import pytest

from kiln.ir import IRTypeError, dtypes, least_upper_dtype, parse_dtype
from kiln.ir.dtype import ALL_DTYPES, truncate_value


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_itemsize_min_max_numpy(dt):
  assert dt.itemsize == dt.np.itemsize
  if dt.is_int: assert (dt.min, dt.max) == (int(np.iinfo(dt.np).min), int(np.iinfo(dt.np).max))
  if dt.is_float: assert (dt.min, dt.max) == (-np.inf, np.inf)
  if dt.is_bool: assert (dt.min, dt.max) == (False, True)
  if dt != dtypes.bfloat16: assert dtypes.from_numpy(dt.np) is dt or dtypes.from_numpy(dt.np) == dt
  assert parse_dtype(str(dt)) == dt


def test_bfloat16_storage_is_uint16():
  assert dtypes.bfloat16.np == np.dtype(np.uint16) and dtypes.bfloat16.itemsize == 2


def test_vec_and_ptr():
  v = dtypes.float32.vec(4)
  assert (v.count, v.itemsize, v.nbytes, v.scalar()) == (4, 4, 16, dtypes.float32)
  assert dtypes.int32.vec(1) is dtypes.int32
  assert str(v) == "float32x4" and parse_dtype("float32x4") == v
  p, u = dtypes.float16.ptr(100), dtypes.int8.ptr()
  assert (p.base, p.size, p.nbytes, p.itemsize) == (dtypes.float16, 100, 200, 2)
  assert u.size == -1 and parse_dtype(str(u)) == u and parse_dtype(str(p)) == p
  with pytest.raises(IRTypeError, match="unknown size"): _ = u.nbytes
  for bad in (lambda: v.vec(2), lambda: dtypes.void.vec(2), lambda: dtypes.int32.vec(0), lambda: dtypes.int32.ptr(0), lambda: dtypes.void.ptr(4)):
    with pytest.raises(IRTypeError): bad()
  with pytest.raises(IRTypeError, match="unknown dtype 'float33'"): parse_dtype("float33")


@pytest.mark.parametrize("a,b,out", [
  (dtypes.int8, dtypes.int32, dtypes.int32), (dtypes.uint8, dtypes.int8, dtypes.int16), (dtypes.uint32, dtypes.int32, dtypes.int64),
  (dtypes.uint64, dtypes.int64, dtypes.float64), (dtypes.int64, dtypes.float16, dtypes.float16), (dtypes.float16, dtypes.bfloat16, dtypes.float32),
  (dtypes.float32, dtypes.float64, dtypes.float64), (dtypes.bool, dtypes.uint8, dtypes.uint8), (dtypes.int16, dtypes.uint8, dtypes.int16),
  (dtypes.uint16, dtypes.uint64, dtypes.uint64)])
def test_promotion(a, b, out):
  assert least_upper_dtype(a, b) == out and least_upper_dtype(b, a) == out


def test_promotion_matches_numpy_for_ints():
  ints = [d for d in ALL_DTYPES if d.is_int or d.is_bool]
  for a in ints:
    for b in ints:
      assert least_upper_dtype(a, b).np == np.promote_types(a.np, b.np), (a, b)


def test_promotion_of_vectors_is_an_error():
  with pytest.raises(IRTypeError, match="vector"): least_upper_dtype(dtypes.float32.vec(2), dtypes.float16.vec(2))


def test_truncate_value():
  assert truncate_value(dtypes.int8, 200) == -56 and truncate_value(dtypes.uint8, -1) == 255
  assert truncate_value(dtypes.int32, 1e20) == 2**31 - 1 and truncate_value(dtypes.int32, float("nan")) == 0  # saturating, NaN -> 0
  assert truncate_value(dtypes.float16, 70000.0) == float("inf") and truncate_value(dtypes.bfloat16, 1.00390625) == 1.0
  assert truncate_value(dtypes.bool, 3) is True


def test_eps_is_the_spacing_of_one():
  """DType.eps: one home for the unit that float tolerances scale by (the fuzzer's and the tuner's)."""
  assert dtypes.float32.eps == float(np.finfo(np.float32).eps) and dtypes.float64.eps == float(np.finfo(np.float64).eps)
  assert dtypes.float16.eps == float(np.finfo(np.float16).eps) and dtypes.bfloat16.eps == 2.0 ** -7
  assert dtypes.float32.vec(8).eps == dtypes.float32.eps and dtypes.int32.eps == 0.0 and dtypes.bool.eps == 0.0


def test_to_dtype_takes_kiln_and_numpy_names():
  """to_dtype: the one conversion a Buffer's and a Tensor's dtype argument go through."""
  from kiln.ir.dtype import to_dtype
  for dt in ALL_DTYPES: assert to_dtype(dt) is dt and to_dtype(dt.name) is dt
  assert to_dtype(np.float32) is dtypes.float32 and to_dtype(np.dtype("int8")) is dtypes.int8 and to_dtype("f4") is dtypes.float32
  assert to_dtype(bool) is dtypes.bool and to_dtype(dtypes.float32.vec(4)) == dtypes.float32.vec(4)  # a DType as it is
  for bad in ("float33", "float32x4", 3.5):
    with pytest.raises(IRTypeError, match="unknown dtype"): to_dtype(bad)
  for bad in ("void", np.complex64):
    with pytest.raises(IRTypeError, match="has no kiln dtype"): to_dtype(bad)
