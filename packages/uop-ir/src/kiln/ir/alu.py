"""C semantics of every ALU op on numpy arrays: the one definition that constant folding and the reference evaluator share.

Values are numpy arrays of the dtype's compute type: bfloat16 is held as float32 rounded to bfloat16 after every op.
Defined where C leaves things undefined, so compiled code can match exactly:
  x // 0 == x and x % 0 == 0;  MIN // -1 == MIN and MIN % -1 == 0 (wraparound);
  shift amounts are taken modulo the bit width;  float -> int casts saturate, NaN -> 0;
  MAX is IEEE-754-2019 maximum (NaN propagates, +0 > -0).
  bool ALU is C's `(bool)(a op b)`: ADD and MAX are OR, MUL is AND, SUB is XOR (so a REDUCE ADD over bools is "any").
  MULACC is unfused: round(round(a*b) + c) in the result dtype.
  DOT4 (int32 only) is c + sum over k < 4 of byte k of a, unsigned, times byte k of b, signed; the sum wraps as ADD does.
  Every conversion to bfloat16 rounds once, to nearest even, from the exact source value (no float32 double rounding).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.ir.dtype import DType, bf16_bits_to_f32, dtypes, f32_to_bf16_bits
from kiln.ir.errors import IRTypeError
from kiln.ir.ops import Ops


def compute_np(dt: DType) -> np.dtype:
  """numpy dtype that holds values of `dt` during evaluation."""
  return np.dtype(np.float32) if dt.scalar() == dtypes.bfloat16 else dt.scalar().np


def round_to(dt: DType, x: np.ndarray) -> np.ndarray:
  """Round/wrap an array into the compute representation of dt (for bf16: float32 rounded to bf16)."""
  if dt.scalar() == dtypes.bfloat16: return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, np.float32)))
  return np.asarray(x).astype(compute_np(dt), copy=False)


def to_storage(dt: DType, x: np.ndarray) -> np.ndarray:
  return f32_to_bf16_bits(x) if dt.scalar() == dtypes.bfloat16 else np.asarray(x, dtype=dt.scalar().np)


def from_storage(dt: DType, x: np.ndarray) -> np.ndarray:
  return bf16_bits_to_f32(x) if dt.scalar() == dtypes.bfloat16 else np.asarray(x)


def _odd_f32(x: np.ndarray) -> np.ndarray:
  """float64 -> float32 rounded to odd: a later round-to-nearest-even to bfloat16 then equals a direct one."""
  x = np.asarray(x, np.float64)
  with np.errstate(over="ignore", invalid="ignore"):
    f = x.astype(np.float32)
    f = np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f).astype(np.float32)  # truncate
    inexact = (f.astype(np.float64) != x) & ~np.isnan(x)
  return np.where(inexact, (f.view(np.uint32) | np.uint32(1)).view(np.float32), f)


def _odd_f64_from_int(x: np.ndarray) -> np.ndarray:
  """64-bit int -> float64 rounded to odd (hi*2^32 + lo with Fast2Sum for the rounding error)."""
  x = np.asarray(x)
  hi = (x >> np.asarray(32, x.dtype)).astype(np.float64) * 4294967296.0
  lo = (x & np.asarray(0xFFFFFFFF, x.dtype)).astype(np.float64)
  s = hi + lo
  err = lo - (s - hi)
  even = (s.view(np.uint64) & np.uint64(1)) == 0
  return np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)


def _to_bf16(x: np.ndarray, src: DType) -> np.ndarray:
  """Any source value to bfloat16 (held as float32), rounded once to nearest even."""
  x = np.asarray(x)
  if src.is_float and src.itemsize <= 4 or src.is_bool: return round_to(dtypes.bfloat16, x.astype(np.float32))
  if src.is_int and src.itemsize == 8: x = _odd_f64_from_int(x)
  return round_to(dtypes.bfloat16, _odd_f32(x.astype(np.float64)))


def _idiv_mod(a: np.ndarray, b: np.ndarray, dt: DType) -> tuple[np.ndarray, np.ndarray]:
  if dt.is_unsigned:
    bs = np.where(b == 0, np.ones_like(b), b)
    q = a // bs
    return q, (a - q * bs).astype(a.dtype)
  bad = (b == 0) | (b == -1)
  bs = np.where(bad, np.ones_like(b), b)
  q = a // bs  # floor division: move toward zero when signs differ and there is a remainder
  r = a - q * bs
  fix = (r != 0) & ((a < 0) != (bs < 0))
  q = np.where(fix, q + 1, q)
  r = np.where(fix, r - bs, r)
  q = np.where(b == -1, (np.zeros_like(a) - a), q)  # MIN // -1 wraps to MIN
  return q.astype(a.dtype), r.astype(a.dtype)


def _fmax(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  m = np.maximum(a, b)
  both_zero = (a == 0) & (b == 0)
  if np.any(both_zero): m = np.where(both_zero, np.where(np.signbit(a) & np.signbit(b), -0.0, 0.0).astype(m.dtype), m)
  return m


def cast(x: np.ndarray, src: DType, dst: DType) -> np.ndarray:
  """C-like cast with kiln's defined edges: float -> int saturates with NaN -> 0, int -> int wraps, -> bool is != 0."""
  if dst.is_bool: return np.asarray(x != 0)
  if dst.is_int and src.is_float:
    xf = np.asarray(x, np.float64)
    lo, hi = float(dst.min), float(dst.max)
    out = np.trunc(np.nan_to_num(xf, nan=0.0, posinf=hi, neginf=lo))
    res = np.where(out >= hi, 0, np.clip(out, lo, hi)).astype(dst.np)  # float(hi) may round up past max: handle apart
    return np.where(out >= hi, np.array(dst.max, dtype=dst.np), res)
  if dst.is_int: return np.asarray(x).astype(dst.np)  # int/bool -> int: two's complement wrap
  if dst == dtypes.bfloat16: return _to_bf16(x, src)
  with np.errstate(over="ignore"): return np.asarray(x).astype(compute_np(dst))  # overflow to inf is the IEEE result


def bitcast(x: np.ndarray, src: DType, dst: DType) -> np.ndarray:
  if src.itemsize != dst.itemsize: raise IRTypeError(f"bitcast needs equal sizes, {src} is {src.itemsize} bytes and {dst} is {dst.itemsize}")
  shape = np.shape(x)
  raw = np.ascontiguousarray(to_storage(src, x)).reshape(shape)  # ascontiguousarray makes a 0-d value 1-d: keep the shape
  if dst.is_bool: return raw.view(np.uint8) != 0  # a byte other than 0/1 is not a valid numpy bool: normalise like C's != 0
  return from_storage(dst, raw.view(dst.np)).reshape(shape)


def _erf(x: np.ndarray) -> np.ndarray:
  """erf in x's float type: numpy has none, so libm's double erf per element (within 1 ulp), rounded to x's type."""
  return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(x.dtype)


def _tanh(x: np.ndarray) -> np.ndarray:  # in double, rounded to x's type: numpy's float32 tanh is itself 1 ulp off
  return np.tanh(x.astype(np.float64)).astype(x.dtype)


# op -> f(sources, result dtype); an op missing from a table does not take that kind of operand
OpFn = Callable[[list[np.ndarray], DType], np.ndarray]


def _un(f: Callable[[np.ndarray], np.ndarray]) -> OpFn: return lambda s, dt: f(s[0])
def _bin(f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> OpFn: return lambda s, dt: f(s[0], s[1])
def _shift(f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> OpFn:  # the amount is taken modulo the bit width
  return lambda s, dt: f(s[0], (s[1] & np.asarray(dt.bits - 1).astype(s[1].dtype)).astype(s[0].dtype))


_CMP_OPS: dict[Ops, Callable[[np.ndarray, np.ndarray], Any]] = {Ops.CMPLT: operator.lt, Ops.CMPEQ: operator.eq, Ops.CMPNE: operator.ne}

_FLOAT_OPS: dict[Ops, OpFn] = {
  Ops.ADD: _bin(operator.add), Ops.SUB: _bin(operator.sub), Ops.MUL: _bin(operator.mul), Ops.FDIV: _bin(operator.truediv),
  Ops.MULACC: lambda s, dt: round_to(dt, s[0] * s[1]) + s[2],  # unfused, as MUL then ADD
  Ops.MAX: _bin(_fmax), Ops.NEG: _un(operator.neg), Ops.EXP2: _un(np.exp2), Ops.LOG2: _un(np.log2), Ops.SIN: _un(np.sin),
  Ops.SQRT: _un(np.sqrt), Ops.RECIPROCAL: _un(lambda x: np.asarray(1, x.dtype) / x), Ops.TRUNC: _un(np.trunc),
  Ops.ERF: _un(_erf), Ops.TANH: _un(_tanh),
}

# bool ALU is C's (bool)(a op b): + and max are |, * is &, - is ^
_BOOL_OPS: dict[Ops, OpFn] = {
  **dict.fromkeys((Ops.AND, Ops.MUL), _bin(operator.and_)), **dict.fromkeys((Ops.OR, Ops.MAX, Ops.ADD), _bin(operator.or_)),
  **dict.fromkeys((Ops.XOR, Ops.SUB, Ops.CMPNE), _bin(operator.xor)),
}


def _dot4(s: list[np.ndarray], dt: DType) -> np.ndarray:
  a, b, c = (x.astype(np.int64) for x in s)
  total = c
  for k in range(4):
    ua = (a >> (8 * k)) & 0xFF
    sb = ((b >> (8 * k)) & 0xFF) ^ 0x80
    total = total + ua * (sb - 0x80)  # the byte as two's complement: 0x80..0xFF are -128..-1
  return total


_INT_OPS: dict[Ops, OpFn] = {
  Ops.ADD: _bin(operator.add), Ops.SUB: _bin(operator.sub), Ops.MUL: _bin(operator.mul), Ops.MULACC: lambda s, dt: s[0] * s[1] + s[2],
  Ops.IDIV: lambda s, dt: _idiv_mod(s[0], s[1], dt)[0], Ops.MOD: lambda s, dt: _idiv_mod(s[0], s[1], dt)[1],
  Ops.MAX: _bin(np.maximum), Ops.NEG: _un(lambda x: np.zeros_like(x) - x),
  Ops.AND: _bin(operator.and_), Ops.OR: _bin(operator.or_), Ops.XOR: _bin(operator.xor),
  Ops.SHL: _shift(operator.lshift), Ops.SHR: _shift(operator.rshift), Ops.TRUNC: lambda s, dt: s[0], Ops.DOT4: _dot4,
}


def exec_alu(op: Ops, dt: DType, *srcs: Any) -> np.ndarray:
  """Evaluate one ALU op whose result has dtype dt. Sources are compute-type arrays (or scalars)."""
  with np.errstate(all="ignore"):
    s = [np.asarray(x) for x in srcs]
    if (cmp := _CMP_OPS.get(op)) is not None:
      a, b = s
      return np.asarray(cmp(a, b))
    if op is Ops.WHERE: return round_to(dt, np.where(s[0], s[1], s[2]))
    if dt.is_float: return round_to(dt, _float_op(op, dt, s))
    return _int_op(op, dt, s).astype(compute_np(dt))


def _float_op(op: Ops, dt: DType, s: list[np.ndarray]) -> np.ndarray:
  # half ops compute in float32 and round once: exact for + - * / sqrt (float32 has > 2p+2 bits)
  if dt.scalar() in (dtypes.float16, dtypes.bfloat16): s = [x.astype(np.float32) for x in s]
  if (fn := _FLOAT_OPS.get(op)) is None: raise IRTypeError(f"{op} does not take float operands ({dt})")
  return fn(s, dt)


def _int_op(op: Ops, dt: DType, s: list[np.ndarray]) -> np.ndarray:
  if dt.is_bool:
    if (fn := _BOOL_OPS.get(op)) is None: raise IRTypeError(f"{op} does not take bool operands")
  elif (fn := _INT_OPS.get(op)) is None: raise IRTypeError(f"{op} does not take integer operands ({dt})")
  return fn(s, dt)
