"""Scalar, vector and pointer dtypes, their numpy mapping and promotion rules."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Final

import numpy as np

from kiln.ir.errors import IRTypeError

_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}  # stored fraction bits


@dataclass(frozen=True, eq=True)
class DType:
  """A scalar (count == 1) or vector (count > 1) value type, or (the subclass PtrDType, kind 'p') a pointer. Immutable; equal dtypes
  compare equal."""
  name: str
  itemsize: int  # bytes of one scalar lane
  kind: str  # 'v' void, 'b' bool, 'i' signed int, 'u' unsigned int, 'f' float, 'p' pointer (a PtrDType)
  priority: int
  count: int = 1

  def vec(self, n: int) -> DType:
    if self.count != 1: raise IRTypeError(f"cannot make a vector of the vector dtype {self}")
    if self.kind == "v": raise IRTypeError("cannot make a vector of void")
    if not isinstance(n, int) or n < 1: raise IRTypeError(f"vector width must be a positive int, got {n!r}")
    return self if n == 1 else DType(self.name, self.itemsize, self.kind, self.priority, n)

  def ptr(self, size: int = -1) -> PtrDType:
    """A pointer to `size` elements of this dtype; -1 means the size is not known."""
    if self.kind == "v": raise IRTypeError("cannot point to void")
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise IRTypeError(f"pointer size must be a positive int or -1 (unknown), got {size!r}")
    return PtrDType(self, size)

  def scalar(self) -> DType: return self if self.count == 1 else DType(self.name, self.itemsize, self.kind, self.priority)
  @property
  def nbytes(self) -> int: return self.itemsize * self.count
  @property
  def is_float(self) -> bool: return self.kind == "f"
  @property
  def is_int(self) -> bool: return self.kind in "iu"
  @property
  def is_unsigned(self) -> bool: return self.kind == "u"
  @property
  def is_bool(self) -> bool: return self.kind == "b"
  @property
  def bits(self) -> int: return self.itemsize * 8
  @property
  def eps(self) -> float:
    """The spacing of 1.0 in this float type (2 ** -mantissa bits), the unit tolerances scale by; 0.0 for exact types."""
    return 2.0 ** -_MANTISSA_BITS[self.name] if self.kind == "f" else 0.0

  @property
  def min(self) -> int | float | bool:
    if self.kind == "b": return False
    if self.kind == "u": return 0
    if self.kind == "i": return -(1 << (self.bits - 1))
    if self.kind == "f": return -math.inf
    raise IRTypeError(f"{self} has no min")

  @property
  def max(self) -> int | float | bool:
    if self.kind == "b": return True
    if self.kind == "u": return (1 << self.bits) - 1
    if self.kind == "i": return (1 << (self.bits - 1)) - 1
    if self.kind == "f": return math.inf
    raise IRTypeError(f"{self} has no max")

  @property
  def np(self) -> np.dtype:
    """The numpy dtype that stores one scalar (bfloat16 is stored as its uint16 bit pattern)."""
    if self.kind == "v": raise IRTypeError("void has no numpy dtype")
    return np.dtype(_NP_STORAGE[self.name])

  def __repr__(self) -> str: return f"dtypes.{self.name}" + (f".vec({self.count})" if self.count > 1 else "")
  def __str__(self) -> str: return self.name + (f"x{self.count}" if self.count > 1 else "")


# init=False: the DType fields follow from (base, size); kw_only only lets base and size follow count's default
@dataclass(frozen=True, eq=True, init=False, repr=False, kw_only=True)
class PtrDType(DType):
  """A pointer to a buffer of `size` elements of `base` (-1: unknown size). A DType, so UOp.dtype needs no union, but never a
  value type: kind is 'p' (test `dt.kind == "p"` or isinstance(dt, PtrDType) to tell a pointer), name is its printed form
  ('float32*1024', equal to no value dtype's name), itemsize is the base's, count 1; vec, ptr, np, min and max raise."""
  base: DType
  size: int

  def __init__(self, base: DType, size: int = -1):
    super().__init__(f"{base}*" + ("" if size < 0 else str(size)), base.itemsize, "p", -1)
    object.__setattr__(self, "base", base)
    object.__setattr__(self, "size", size)

  def vec(self, n: int) -> DType: raise IRTypeError(f"cannot make a vector of the pointer dtype {self}")
  def ptr(self, size: int = -1) -> PtrDType: raise IRTypeError(f"cannot point to the pointer dtype {self}")
  def scalar(self) -> PtrDType: return self
  @property
  def nbytes(self) -> int:
    if self.size < 0: raise IRTypeError(f"{self!r} has an unknown size")
    return self.size * self.base.nbytes
  @property
  def np(self) -> np.dtype: raise IRTypeError(f"the pointer dtype {self} has no numpy dtype")
  def __repr__(self) -> str: return f"{self.base!r}.ptr({self.size})"
  def __str__(self) -> str: return self.name


ConstLike = int | float | bool  # a constant's Python value (a CONST's arg)

_NP_STORAGE: Final[dict[str, str]] = {
  "bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
  "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
  "float16": "float16", "bfloat16": "uint16", "float32": "float32", "float64": "float64",
}


class dtypes:
  """The dtype namespace, as in tinygrad: dtypes.float32, dtypes.int32.vec(4), ..."""
  void: Final = DType("void", 0, "v", -1)
  bool: Final = DType("bool", 1, "b", 0)
  int8: Final = DType("int8", 1, "i", 1)
  uint8: Final = DType("uint8", 1, "u", 2)
  int16: Final = DType("int16", 2, "i", 3)
  uint16: Final = DType("uint16", 2, "u", 4)
  int32: Final = DType("int32", 4, "i", 5)
  uint32: Final = DType("uint32", 4, "u", 6)
  int64: Final = DType("int64", 8, "i", 7)
  uint64: Final = DType("uint64", 8, "u", 8)
  float16: Final = DType("float16", 2, "f", 9)
  bfloat16: Final = DType("bfloat16", 2, "f", 10)
  float32: Final = DType("float32", 4, "f", 11)
  float64: Final = DType("float64", 8, "f", 12)
  # aliases
  half = float16
  float = float32
  double = float64
  int = int32
  index = int32  # the dtype of ranges and index arithmetic while every value fits (index_dtype: int64 past it)
  index64 = int64  # ranges and index arithmetic that can pass int32 (a 2**31-element reduction)

  @staticmethod
  def all() -> tuple[DType, ...]: return ALL_DTYPES
  @staticmethod
  def from_name(name: str) -> DType: return parse_dtype(name)
  @staticmethod
  def from_numpy(dt: np.dtype | type) -> DType:
    d = np.dtype(dt)
    for t in ALL_DTYPES:
      if t.name == d.name: return t
    raise IRTypeError(f"numpy dtype {d} has no kiln dtype")
  @staticmethod
  def from_py(x: object) -> DType:
    """The dtype a bare Python number takes when it stands alone."""
    if isinstance(x, bool): return dtypes.bool
    if isinstance(x, int): return dtypes.int32
    if isinstance(x, float): return dtypes.float32
    raise IRTypeError(f"cannot make a kiln constant from {type(x).__name__} {x!r}")


def index_dtype(lo: int, hi: int) -> DType:
  """The dtype for index values in [lo, hi]: dtypes.index (int32) when they fit it, so small kernels keep 32-bit index
  arithmetic, else dtypes.index64."""
  return dtypes.index if dtypes.index.min <= lo and hi <= dtypes.index.max else dtypes.index64


ALL_DTYPES: Final[tuple[DType, ...]] = (dtypes.bool, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.uint8,
  dtypes.uint16, dtypes.uint32, dtypes.uint64, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)
INT_DTYPES: Final = tuple(d for d in ALL_DTYPES if d.is_int)
FLOAT_DTYPES: Final = tuple(d for d in ALL_DTYPES if d.is_float)
_BY_NAME: Final[dict[str, DType]] = {d.name: d for d in (*ALL_DTYPES, dtypes.void)}
_VALUE_NAMES: Final[dict[str, DType]] = {d.name: d for d in ALL_DTYPES}


DTypeLike = DType | str | np.dtype | type  # what to_dtype takes


def to_dtype(dt: DTypeLike) -> DType:
  """A dtype from a DType (as it is), a kiln value dtype's name ('float32', 'bfloat16') or what numpy takes for one
  (np.float32, 'f4'): the one conversion the layers above share (a Buffer's dtype, a Tensor's). An unknown one is an
  IRTypeError naming it."""
  if isinstance(dt, DType): return dt
  if isinstance(dt, str) and dt in _VALUE_NAMES: return _VALUE_NAMES[dt]
  try: nd = np.dtype(dt)
  except (TypeError, ValueError): raise IRTypeError(f"unknown dtype {dt!r}") from None
  return dtypes.from_numpy(nd)


def parse_dtype(s: str) -> DType:
  """Inverse of str(dtype): 'float32', 'float32x4', 'float32*1024', 'int8*' (unknown size)."""
  try:
    if "*" in s:
      base, size = s.split("*", 1)
      return parse_dtype(base).ptr(int(size) if size else -1)
    if "x" in s and s.rsplit("x", 1)[1].isdigit():
      base, n = s.rsplit("x", 1)
      return _BY_NAME[base].vec(int(n))
    return _BY_NAME[s]
  except (KeyError, ValueError, AssertionError):
    raise IRTypeError(f"unknown dtype {s!r}") from None


def least_upper_dtype(*dts: DType) -> DType:
  """The dtype two operands of different dtypes are promoted to (numpy-like; a float beats any int, as in torch)."""
  out = dts[0]
  for d in dts[1:]: out = _promote2(out, d)
  return out


def _promote2(a: DType, b: DType) -> DType:
  if a == b: return a
  if "p" in (a.kind, b.kind): raise IRTypeError(f"no promotion with a pointer dtype ({a}, {b})")  # the kind rules below would pick one silently
  if a.count != 1 or b.count != 1: raise IRTypeError(f"no promotion between vector dtypes {a} and {b}")
  if a.is_bool: return b
  if b.is_bool: return a
  if a.is_float and b.is_float:
    if {a.name, b.name} == {"float16", "bfloat16"}: return dtypes.float32
    return a if a.itemsize > b.itemsize else b
  if a.is_float: return a
  if b.is_float: return b
  if a.kind == b.kind: return a if a.itemsize > b.itemsize else b
  s, u = (a, b) if a.kind == "i" else (b, a)
  if s.itemsize > u.itemsize: return s
  if u.itemsize == 8: return dtypes.float64  # as numpy: no int holds both int64 and uint64
  return {1: dtypes.int16, 2: dtypes.int32, 4: dtypes.int64}[u.itemsize]


# ---- value rounding into a dtype, the C way ----

def bf16_round(x: float) -> float:
  """Round a float to the nearest bfloat16 (round to nearest even), keeping NaN and inf."""
  if math.isnan(x): return math.nan
  b = struct.unpack("<I", struct.pack("<f", x))[0] if abs(x) < 3.5e38 or math.isinf(x) else (0x7F800000 | (0x80000000 if x < 0 else 0))
  b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
  return float(struct.unpack("<f", struct.pack("<I", b))[0])


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
  """float32 array to bfloat16 bit patterns (uint16), round to nearest even, NaN kept quiet."""
  u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
  r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
  return np.where(np.isnan(a), np.uint16(0x7FC0), r).astype(np.uint16).reshape(np.shape(a))  # a 0-d value stays 0-d


def bf16_bits_to_f32(a: np.ndarray) -> np.ndarray:
  """bfloat16 bit patterns (uint16) to float32, exactly."""
  return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def truncate_value(dt: DType, x: object) -> ConstLike:
  """Coerce a Python number into what `dt` can hold: ints wrap, floats round to the dtype's precision."""
  s = dt.scalar()
  if s.is_bool: return bool(x)
  if s.is_int:
    if isinstance(x, float):
      if math.isnan(x): return 0
      x = max(min(math.trunc(x), s.max), s.min) if math.isfinite(x) else (s.max if x > 0 else s.min)  # saturating, like fptosi.sat
    v = int(x)  # type: ignore[call-overload]
    v &= (1 << s.bits) - 1
    return v - (1 << s.bits) if s.kind == "i" and v >= 1 << (s.bits - 1) else v
  if s.is_float:
    f = float(x)  # type: ignore[arg-type]
    if s.name == "float64": return f
    with np.errstate(over="ignore"):
      if s.name == "float32": return float(np.float32(f))
      if s.name == "float16": return float(np.float16(f))
    return bf16_round(f)
  raise IRTypeError(f"no value of dtype {dt}")
