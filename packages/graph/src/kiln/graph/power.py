"""x ** p with the rules numpy and onnxruntime (C's pow) follow, for Tensors and for numpy folding at load: one home.

The result has the base's dtype (ONNX's Pow: T is the base's type).
- A float base: |x| ** p as exp2(p * log2|x|), then the sign rule of real powers: a negative base to an odd integer power
  is negative, to an even one positive, to a non-integer one NaN; x ** 0 = 1 and 1 ** p = 1 (even for NaN). A constant
  integer exponent is a chain of multiplies (exact, as x*x*x is).
- An integer base to an integer exponent: exact, by squaring and multiplying over the exponent's bits (wrapping on
  overflow as integer multiplication does); a negative exponent gives 0, except 1 ** e = 1 and (-1) ** e = +-1 (C's pow
  truncated to an integer). To a float exponent: computed in float64 and truncated to the base's type.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kiln.ir.dtype import dtypes
from kiln.ir.ops import Ops

if TYPE_CHECKING:
  from kiln.graph.tensor import Tensor


def _trunc(t: Tensor) -> Tensor: return t._alu(Ops.TRUNC)


SMALL_BITS = 7  # a whole exponent below 2**7 in magnitude is multiplied out (exact where x*x*x is), not exp2(p log2 x)


def _float_power(x: Tensor, p: Tensor) -> Tensor:
  """x ** p for a float x, p cast to x's dtype."""
  p = p.cast(x.dtype)
  m = (x.abs().log2() * p).exp2()
  whole = _trunc(p).eq(p)
  odd = whole & _trunc(p * 0.5).ne(p * 0.5)
  neg = x < 0
  r = (neg & odd).where(-m, m)
  r = (neg & whole.logical_not()).where(math.nan, r)
  small = whole & (p.abs() < (1 << SMALL_BITS))
  e = small.where(p.abs(), 0).cast(dtypes.int32)
  by_bits = _bits_power(x, e, SMALL_BITS)
  r = small.where((p < 0).where(by_bits.reciprocal(), by_bits), r)
  return (p.eq(0) | x.eq(1)).where(1.0, r)


def _bits_power(x: Tensor, e: Tensor, bits: int) -> Tensor:
  """x ** e for e >= 0 below 2**bits: square and multiply over e's bits."""
  r, b = x * 0 + 1, x
  for k in range(bits):
    r = (e & (1 << k)).ne(0).where(r * b, r)
    if k < bits - 1: b = b * b
  return r


def _int_power(x: Tensor, e: Tensor) -> Tensor:
  """x ** e for integer x and e, exact: square and multiply over e's bits."""
  bits = 8 * e.dtype.itemsize - (0 if e.dtype.name.startswith("uint") else 1)
  r = _bits_power(x, e, bits)
  if e.dtype.name.startswith("uint"): return r
  one = x * 0 + 1
  odd = (e & 1).ne(0)
  small = x.eq(1).where(one, x.eq(-1).where(odd.where(-one, one), one * 0))  # C's pow(x, e < 0) truncated
  return (e < 0).where(small, r)


def _constant_power(x: Tensor, p: int | float) -> Tensor:
  if p == 0: return x * 0 + 1  # 1, NaN ** 0 included
  if float(p).is_integer() and abs(p) <= 64:  # exact: multiplies
    n, r, b = int(abs(p)), None, x
    while n:
      if n & 1: r = b if r is None else r * b
      n >>= 1
      if n: b = b * b
    assert r is not None
    if p > 0: return r
    if x.dtype.is_float: return r.reciprocal()
  if p == 0.5 and x.dtype.is_float: return x.sqrt()
  if p == -0.5 and x.dtype.is_float: return x.rsqrt()
  return power(x, type(x).full((), p, dtypes.float64 if not x.dtype.is_float or isinstance(p, float) else dtypes.int64))


def power(x: Tensor, p: Tensor | int | float) -> Tensor:
  """x ** p, the result in x's dtype (see the module's rules)."""
  if isinstance(p, int | float): return _constant_power(x, p)
  if x.dtype.is_bool: x = x.cast(dtypes.int32)
  if x.dtype.is_float: return _float_power(x, p)
  if p.dtype.is_float:  # a whole exponent exactly, as an integer one; any other in float64, truncated
    p64 = p.cast(dtypes.float64)
    whole = _trunc(p64).eq(p64)
    exact = _int_power(x, whole.where(p64, 0).cast(dtypes.int64))
    return whole.where(exact, _float_power(x.cast(dtypes.float64), p64).cast(x.dtype))
  return _int_power(x, p if not p.dtype.is_bool else p.cast(dtypes.int32))


def np_power(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """The same rules on numpy arrays (a Pow of constants folded at load)."""
  if a.dtype.kind == "f": return np.power(a, b.astype(a.dtype)).astype(a.dtype)
  if b.dtype.kind == "f": return np.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)
  a, b = np.broadcast_arrays(a, b)
  with np.errstate(over="ignore"):
    r = np.power(a, np.maximum(b, 0)).astype(a.dtype)
  small = np.where(a == 1, 1, np.where(a == -1, np.where(b % 2 != 0, -1, 1), 0)).astype(a.dtype)
  return np.where(b < 0, small, r)
