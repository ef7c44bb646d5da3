"""UOp: the immutable, hash-consed node of every kiln graph, with its builders and Python operators.

Equal (op, dtype, src, arg) is the same object, on any thread, so `is` and `==` are structural equality and UOps
live in sets and dicts. Comparisons that build graph nodes are `<`, `>`, `<=`, `>=`, `.eq()` and `.ne()`.
ConstLike, defined in dtype.py, stays importable from here.
"""
from __future__ import annotations

import hashlib
import math
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from kiln.ir.alu import cast as alu_cast
from kiln.ir.bounds import compute_bounds
from kiln.ir.dtype import ConstLike, DType, PtrDType, dtypes, index_dtype, least_upper_dtype, truncate_value
from kiln.ir.errors import IRError, IRTypeError
from kiln.ir.fold import fold_alu
from kiln.ir.ops import AxisType, GroupOp, Ops


def _argkey(arg: Any) -> Any:
  """A dict key for an arg by its bits: NaN equal to the same NaN (a BITCAST tells NaNs of other sign or payload apart),
  -0.0 apart from 0.0 and 1 apart from True."""
  if isinstance(arg, float): return ("f", struct.pack("<d", arg))
  if isinstance(arg, bool): return ("b", arg)
  if isinstance(arg, tuple): return tuple(_argkey(a) for a in arg)
  return arg


_QNAN = 0x7FF8000000000000  # the NaN Python writes (float("nan")): plain "nan" in text


def nan_text(a: float) -> str:
  """'nan' for the quiet NaN Python writes; any other NaN (a negative one, as x86 makes 0*inf) keeps its bits: 'nan:<hex>'."""
  bits = struct.unpack("<Q", struct.pack("<d", a))[0]
  return "nan" if bits == _QNAN else f"nan:{bits:016x}"


def arg_repr(arg: Any) -> str:
  """Canonical text of an arg, the same in every process (used by `key` and the JSON form)."""
  if isinstance(arg, float): return nan_text(arg) if math.isnan(arg) else float.hex(arg)
  if isinstance(arg, bool | int | str | type(None)): return repr(arg)
  if isinstance(arg, Ops): return f"Ops.{arg.name}"
  if isinstance(arg, AxisType): return f"AxisType.{arg.name}"
  if isinstance(arg, tuple): return "(" + ",".join(arg_repr(a) for a in arg) + ")"
  raise IRError(f"unsupported UOp arg {arg!r} of type {type(arg).__name__}")


class UOpMetaClass(type):
  _cache: ClassVar[dict[tuple, weakref.ReferenceType]] = {}
  _lock: ClassVar[threading.RLock] = threading.RLock()

  def __call__(cls, op: Ops, dtype: DType = dtypes.void, src: tuple[UOp, ...] = (), arg: Any = None) -> UOp:  # type: ignore[override]
    k = (op, dtype, src, _argkey(arg))
    with UOpMetaClass._lock:
      if (ref := UOpMetaClass._cache.get(k)) is not None and (hit := ref()) is not None: return hit
      ret: UOp = super().__call__(op, dtype, src, arg)
      UOpMetaClass._cache[k] = weakref.ref(ret, _make_evict(k))
      return ret


def _make_evict(k: tuple) -> Callable[[weakref.ReferenceType], None]:
  # bind the cache and lock now: at interpreter exit module globals may already be None when the last nodes die
  def evict(r: weakref.ReferenceType, cache: dict = UOpMetaClass._cache, lock: threading.RLock = UOpMetaClass._lock) -> None:
    with lock:
      if cache.get(k) is r: del cache[k]
  return evict


# integer-valued constants by (dtype, value), kept alive: building a kernel's index arithmetic asks for the same few (a
# stride, 0, 1) hundreds of thousands of times, each a truncation and an interning lookup under a lock otherwise. Only
# Python ints: a float key would make 0.0 and -0.0 one entry (they compare equal)
_INT_CONSTS: dict[tuple[DType, int], UOp] = {}
_INT_CONSTS_MAX = 1 << 14


class UOp(metaclass=UOpMetaClass):
  __slots__ = ("op", "dtype", "src", "arg", "_key", "_bounds", "__weakref__")
  op: Ops
  dtype: DType
  src: tuple[UOp, ...]
  arg: Any
  _key: str | None
  _bounds: tuple[ConstLike, ConstLike] | None

  def __init__(self, op: Ops, dtype: DType = dtypes.void, src: tuple[UOp, ...] = (), arg: Any = None):
    object.__setattr__(self, "op", op)
    object.__setattr__(self, "dtype", dtype)
    object.__setattr__(self, "src", src)
    object.__setattr__(self, "arg", arg)
    object.__setattr__(self, "_key", None)
    object.__setattr__(self, "_bounds", None)

  def __setattr__(self, name: str, value: Any) -> None: raise AttributeError(f"UOp is immutable (tried to set {name})")
  def __reduce__(self) -> tuple: return (UOp, (self.op, self.dtype, self.src, self.arg))
  def __copy__(self) -> UOp: return self
  def __deepcopy__(self, memo: dict) -> UOp: return self
  def __bool__(self) -> bool:
    if self.op is Ops.CONST: return bool(self.arg)
    raise IRError(f"the truth value of a symbolic {self.op} is unknown; build a comparison and use where()")

  def __repr__(self) -> str:
    if self.op is Ops.CONST: return f"UOp.const({self.dtype!r}, {self.arg!r})"
    if self.op is Ops.DEFINE_VAR: return f"UOp.variable({self.arg[0]!r}, {self.arg[1]}, {self.arg[2]})"
    if self.op is Ops.DEFINE_GLOBAL: return f"UOp.define_global({self.arg}, {self.dtype!r})"
    return f"UOp({self.op}, {self.dtype!r}, arg={self.arg!r}, src=<{len(self.src)}>)"

  # ---- traversal (never recursive, so 100k-deep chains are fine) ----
  def toposort(self, gate: Callable[[UOp], bool] | None = None) -> list[UOp]:
    """Every node reachable from self, each after all its sources. A node failing gate is left out and not entered."""
    out: list[UOp] = []
    seen: set[int] = set()
    stack: list[tuple[UOp, bool]] = [(self, False)]
    while stack:
      u, expanded = stack.pop()
      if expanded:
        out.append(u)
        continue
      if id(u) in seen or (gate is not None and not gate(u)): continue
      seen.add(id(u))
      stack.append((u, True))
      for s in reversed(u.src):
        if id(s) not in seen: stack.append((s, False))
    return out

  @property
  def key(self) -> str:
    """Content hash, the same in every process: sha256 over op, dtype, arg and the sources' keys."""
    if self._key is None:
      for u in self.toposort(lambda x: x._key is None):  # stop at nodes already hashed: a rebuilt root costs O(new nodes)
        h = hashlib.sha256(f"{u.op.name}|{u.dtype}|{arg_repr(u.arg)}|".encode())
        for s in u.src: h.update(s._key.encode())  # type: ignore[union-attr]  # sources come first in toposort
        object.__setattr__(u, "_key", h.hexdigest())
    assert self._key is not None
    return self._key

  # ---- bounds ----
  @property
  def vmin(self) -> ConstLike: return self._vbounds()[0]
  @property
  def vmax(self) -> ConstLike: return self._vbounds()[1]
  def _vbounds(self) -> tuple[ConstLike, ConstLike]:
    if self._bounds is None: compute_bounds(self)
    assert self._bounds is not None
    return self._bounds

  # ---- constructors ----
  @staticmethod
  def const(dtype: DType, value: ConstLike) -> UOp:
    if type(value) is int and (hit := _INT_CONSTS.get((dtype, value))) is not None: return hit
    if isinstance(dtype, PtrDType) or dtype.kind == "v": raise IRTypeError(f"a constant cannot have dtype {dtype}")
    if not isinstance(value, int | float | bool): raise IRTypeError(f"constant value must be a Python number, got {type(value).__name__}")
    if dtype.count > 1: out = UOp(Ops.VECTORIZE, dtype, (UOp.const(dtype.scalar(), value),) * dtype.count)
    else: out = UOp(Ops.CONST, dtype, (), truncate_value(dtype, value))
    if type(value) is int and len(_INT_CONSTS) < _INT_CONSTS_MAX: _INT_CONSTS[(dtype, value)] = out
    return out

  def const_like(self, value: ConstLike) -> UOp:
    if isinstance(self.dtype, PtrDType): raise IRTypeError(f"no constant of pointer dtype {self.dtype}")
    return UOp.const(self.dtype, value)

  @staticmethod
  def define_global(slot: int, dtype: PtrDType) -> UOp:
    if not isinstance(dtype, PtrDType): raise IRTypeError(f"define_global needs a pointer dtype (dtypes.float32.ptr(n)), got {dtype!r}")
    if not isinstance(slot, int) or slot < 0: raise IRError(f"define_global slot must be an int >= 0, got {slot!r}")
    return UOp(Ops.DEFINE_GLOBAL, dtype, (), slot)

  @staticmethod
  def variable(name: str, min_val: int, max_val: int, dtype: DType = dtypes.int32) -> UOp:
    if not isinstance(name, str) or not name.isidentifier(): raise IRError(f"variable name must be an identifier, got {name!r}")
    if not dtype.is_int: raise IRTypeError(f"variable {name} must have an integer dtype, got {dtype}")
    if not (isinstance(min_val, int) and isinstance(max_val, int)) or min_val > max_val:
      raise IRError(f"variable {name} needs int bounds with min <= max, got [{min_val}, {max_val}]")
    if min_val < dtype.min or max_val > dtype.max: raise IRError(f"variable {name} bounds [{min_val}, {max_val}] do not fit {dtype}")
    return UOp(Ops.DEFINE_VAR, dtype, (), (name, min_val, max_val))

  @staticmethod
  def range(end: UOp | int, axis_id: int, axis_type: AxisType = AxisType.LOOP, dtype: DType | None = None) -> UOp:
    """A loop over [0, end): of dtypes.index while end fits int32, else dtypes.index64 (index_dtype, from end's bounds), or
    of `dtype` (a range standing in for another keeps its dtype)."""
    e = _index_value(end, dtype, "range end")
    if not isinstance(axis_type, AxisType): raise IRError(f"axis_type must be an AxisType, got {axis_type!r}")
    return UOp(Ops.RANGE, e.dtype, (e,), (axis_id, axis_type))

  @staticmethod
  def special(name: str, size: UOp | int, dtype: DType | None = None) -> UOp:
    s = _index_value(size, dtype, "special size")
    return UOp(Ops.SPECIAL, s.dtype, (s,), name)

  @staticmethod
  def sink(*srcs: UOp, name: str | None = None) -> UOp: return UOp(Ops.SINK, dtypes.void, tuple(srcs), name)

  def bind(self, value: int) -> UOp:
    if self.op is not Ops.DEFINE_VAR: raise IRError(f"only a variable can be bound, not {self.op}")
    name, lo, hi = self.arg
    if not isinstance(value, int) or not lo <= value <= hi: raise IRError(f"variable {name}={value} is outside bounds [{lo}, {hi}]")
    return UOp(Ops.BIND, self.dtype, (self, UOp.const(self.dtype, value)))

  # ---- memory ----
  def index(self, idx: UOp | int, gate: UOp | None = None) -> UOp:
    if not isinstance(self.dtype, PtrDType): raise IRTypeError(f"index() needs a buffer (pointer dtype), got {self.dtype}")
    if isinstance(idx, UOp) and (not idx.dtype.is_int or idx.dtype.count != 1): raise IRTypeError(f"index must be a scalar integer, got {idx.dtype}")
    i = _index_value(idx, None, "index")
    if gate is None: return UOp(Ops.INDEX, self.dtype, (self, i))
    if gate.dtype != dtypes.bool: raise IRTypeError(f"index gate must be bool, got {gate.dtype}")
    return UOp(Ops.INDEX, self.dtype, (self, i, gate))

  def load(self) -> UOp:
    if self.op is not Ops.INDEX: raise IRError(f"load() needs an INDEX (buf.index(i)), got {self.op}")
    return UOp(Ops.LOAD, self.dtype.base, (self,))  # type: ignore[attr-defined]

  def store(self, value: UOp | ConstLike) -> UOp:
    if self.op is not Ops.INDEX: raise IRError(f"store() needs an INDEX (buf.index(i)), got {self.op}")
    base = self.dtype.base  # type: ignore[attr-defined]
    v = value if isinstance(value, UOp) else UOp.const(base, value)
    if v.dtype != base: raise IRTypeError(f"store of {v.dtype} into a {base} buffer (slot {self.src[0].arg}); cast it first")
    return UOp(Ops.STORE, dtypes.void, (self, v))

  def reduce(self, op: Ops, *ranges: UOp) -> UOp:
    if op not in GroupOp.ReduceOps: raise IRError(f"reduce op must be ADD, MUL or MAX, got {op!r}")
    for r in ranges:
      if not isinstance(r, UOp) or r.op is not Ops.RANGE: raise IRError(f"reduce() closes RANGEs, got {r!r}")
    if not ranges: return self
    return UOp(Ops.REDUCE, self.dtype, (self, *ranges), op)

  # ---- ALU ----
  def alu(self, op: Ops, *srcs: UOp) -> UOp:
    allsrc = (self, *srcs)
    out_dt = dtypes.bool if op in GroupOp.Comparison else (allsrc[1].dtype if op is Ops.WHERE else self.dtype)
    if (folded := fold_alu(op, out_dt, allsrc)) is not None: return folded
    return UOp(op, out_dt, allsrc)

  def _binop(self, op: Ops, other: UOp | ConstLike, reverse: bool = False) -> UOp:
    a, b = self._promote(other)
    return b.alu(op, a) if reverse else a.alu(op, b)

  def _promote(self, other: UOp | ConstLike) -> tuple[UOp, UOp]:
    """Bring self and other to one dtype: a Python number takes the UOp's dtype unless it needs a float."""
    if isinstance(self.dtype, PtrDType): raise IRTypeError(f"arithmetic on a pointer ({self.dtype}) is not allowed; use index()")
    if isinstance(other, UOp):
      if isinstance(other.dtype, PtrDType): raise IRTypeError(f"arithmetic on a pointer ({other.dtype}) is not allowed")
      if other.dtype == self.dtype: return self, other
      dt = least_upper_dtype(self.dtype, other.dtype)
      return self.cast(dt), other.cast(dt)
    if isinstance(other, float) and not self.dtype.is_float:
      return self.cast(dtypes.float32), UOp.const(dtypes.float32, other)
    if not isinstance(other, int | float | bool): raise IRTypeError(f"cannot combine a UOp with {type(other).__name__}")
    return self, self.const_like(other)

  def __add__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.ADD, x)
  def __radd__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.ADD, x, True)
  def __sub__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.SUB, x)
  def __rsub__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.SUB, x, True)
  def __mul__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.MUL, x)
  def __rmul__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.MUL, x, True)
  def __truediv__(self, x: UOp | ConstLike) -> UOp: return self._div(x, False)
  def __rtruediv__(self, x: UOp | ConstLike) -> UOp: return self._div(x, True)
  def __floordiv__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.IDIV, x)
  def __rfloordiv__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.IDIV, x, True)
  def __mod__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.MOD, x)
  def __rmod__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.MOD, x, True)
  def __and__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.AND, x)
  def __rand__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.AND, x, True)
  def __or__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.OR, x)
  def __ror__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.OR, x, True)
  def __xor__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.XOR, x)
  def __rxor__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.XOR, x, True)
  def __lshift__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.SHL, x)
  def __rlshift__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.SHL, x, True)
  def __rshift__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.SHR, x)
  def __rrshift__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.SHR, x, True)
  def __neg__(self) -> UOp:
    if self.dtype == dtypes.bool: raise IRTypeError("cannot negate a bool; use .logical_not()")
    return self.alu(Ops.NEG)
  def __lt__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.CMPLT, x)
  def __gt__(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.CMPLT, x, True)
  def __le__(self, x: UOp | ConstLike) -> UOp:
    a, b = self._promote(x)
    return (a < b) | a.eq(b) if a.dtype.is_float else (b < a).logical_not()
  def __ge__(self, x: UOp | ConstLike) -> UOp:
    a, b = self._promote(x)
    return (b < a) | a.eq(b) if a.dtype.is_float else (a < b).logical_not()
  __hash__ = object.__hash__

  def _div(self, x: UOp | ConstLike, reverse: bool) -> UOp:
    a, b = self._promote(x)
    if not a.dtype.is_float:
      raise IRTypeError(f"'/' is true division and needs floats, got {a.dtype}; use // for C integer division or cast first")
    return b.alu(Ops.FDIV, a) if reverse else a.alu(Ops.FDIV, b)

  def eq(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.CMPEQ, x)
  def ne(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.CMPNE, x)
  def logical_not(self) -> UOp:
    if self.dtype != dtypes.bool: raise IRTypeError(f"logical_not needs a bool, got {self.dtype}")
    return self.alu(Ops.XOR, UOp.const(dtypes.bool, True))
  def maximum(self, x: UOp | ConstLike) -> UOp: return self._binop(Ops.MAX, x)
  def minimum(self, x: UOp | ConstLike) -> UOp:
    a, b = self._promote(x)
    if a.dtype.is_float: return -((-a).maximum(-b))
    return (a < b).where(a, b)
  def where(self, x: UOp | ConstLike, y: UOp | ConstLike) -> UOp:
    if self.dtype != dtypes.bool: raise IRTypeError(f"where() condition must be bool, got {self.dtype}")
    if isinstance(x, UOp): a, b = x._promote(y)
    elif isinstance(y, UOp): b, a = y._promote(x)
    else: a, b = UOp.const(dt := least_upper_dtype(dtypes.from_py(x), dtypes.from_py(y)), x), UOp.const(dt, y)  # where(c, 1, 2.5) is float
    return self.alu(Ops.WHERE, a, b)
  def _float_unary(self, op: Ops) -> UOp:
    if not self.dtype.is_float: raise IRTypeError(f"{op.name.lower()} needs a float, got {self.dtype}")
    return self.alu(op)
  def exp2(self) -> UOp: return self._float_unary(Ops.EXP2)
  def log2(self) -> UOp: return self._float_unary(Ops.LOG2)
  def sin(self) -> UOp: return self._float_unary(Ops.SIN)
  def erf(self) -> UOp: return self._float_unary(Ops.ERF)
  def tanh(self) -> UOp: return self._float_unary(Ops.TANH)
  def sqrt(self) -> UOp: return self._float_unary(Ops.SQRT)
  def reciprocal(self) -> UOp: return self._float_unary(Ops.RECIPROCAL)
  def trunc(self) -> UOp: return self if self.dtype.is_int else self._float_unary(Ops.TRUNC)
  def exp(self) -> UOp: return (self * (1 / math.log(2))).exp2()
  def log(self) -> UOp: return self.log2() * math.log(2)
  def relu(self) -> UOp: return self.maximum(0)

  def cast(self, dtype: DType) -> UOp:
    if not isinstance(dtype, DType) or dtype.kind in "vp": raise IRTypeError(f"cannot cast to {dtype!r}")
    if isinstance(self.dtype, PtrDType): raise IRTypeError(f"cannot cast a pointer ({self.dtype})")
    if self.dtype == dtype: return self
    if self.dtype.count != dtype.count: raise IRTypeError(f"cast from {self.dtype} to {dtype} changes the vector width")
    if self.op is Ops.CONST: return UOp.const(dtype, _cast_const(self.arg, self.dtype, dtype))
    return UOp(Ops.CAST, dtype, (self,))

  def bitcast(self, dtype: DType) -> UOp:
    if isinstance(self.dtype, PtrDType) or not isinstance(dtype, DType) or dtype.kind in "vp" or self.dtype.nbytes != dtype.nbytes:
      raise IRTypeError(f"bitcast needs dtypes of equal size, got {self.dtype} -> {dtype!r}")
    if self.dtype == dtype: return self
    return UOp(Ops.BITCAST, dtype, (self,))

  # ---- helpers for passes ----
  def replace(self, **kw: Any) -> UOp:
    return UOp(kw.get("op", self.op), kw.get("dtype", self.dtype), kw.get("src", self.src), kw.get("arg", self.arg))
  def substitute(self, mapping: dict[UOp, UOp]) -> UOp:
    from kiln.ir.rewrite import substitute  # lazy: rewrite.py imports uop.py at module level
    return substitute(self, mapping)
  def simplify(self) -> UOp:
    from kiln.ir.symbolic import simplify  # lazy: symbolic.py imports uop.py at module level
    return simplify(self)
  @property
  def is_const(self) -> bool: return self.op is Ops.CONST
  def ranges(self) -> list[UOp]:
    """The RANGEs this graph uses, by axis id."""
    return sorted((u for u in self.toposort() if u.op is Ops.RANGE), key=lambda r: r.arg[0])
  def variables(self) -> list[UOp]:
    return sorted((u for u in self.toposort() if u.op is Ops.DEFINE_VAR), key=lambda v: v.arg[0])


def _index_value(x: UOp | int, dtype: DType | None, what: str) -> UOp:
  """x as an index value, never wrapped: in `dtype`, else in index_dtype of its bounds (int32 while they fit, so a small
  kernel's indices stay 32-bit; int64 past it, where a cast to int32 would wrap)."""
  if isinstance(x, UOp):
    if not x.dtype.is_int: raise IRTypeError(f"{what} must be an integer, got {x.dtype}")
    dt = dtype or index_dtype(int(x.vmin), int(x.vmax))
    return x if x.dtype == dt else x.cast(dt)
  if isinstance(x, bool) or not isinstance(x, int): raise IRTypeError(f"{what} must be an int or an integer UOp, got {x!r}")
  dt = dtype or index_dtype(x, x)
  if not dt.min <= x <= dt.max: raise IRError(f"{what} {x} does not fit {dt}")
  return UOp.const(dt, x)


def _cast_const(v: ConstLike, src: DType, dst: DType) -> ConstLike:
  out = alu_cast(np.asarray(v, dtype=np.float64 if isinstance(v, float) else None), src, dst)
  return out.item() if dst.is_float else int(out) if dst.is_int else bool(out)
