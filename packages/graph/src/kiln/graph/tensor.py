"""`Tensor`: a lazy n-d array whose operations record a graph (lazy.py); `.numpy()` or `compile()` schedules it into fused
kernels (schedule.py) and runs them as one ExecutionPlan."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.graph import conv, few_rows
from kiln.graph import dims as sym
from kiln.graph.index_check import gather_node
from kiln.graph.kernelize import compute_dtype
from kiln.graph.lazy import GraphError, Node, Source, prod
from kiln.graph.schedule import Compiled, compile_nodes
from kiln.ir.dtype import DType, DTypeLike, dtypes, f32_to_bf16_bits, least_upper_dtype, to_dtype, truncate_value
from kiln.ir.errors import IRTypeError
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

Scalar = int | float | bool
PyFloat = float  # Tensor.float() shadows the builtin inside the class


def _dtype(dt: DTypeLike) -> DType:
  """kiln.ir's to_dtype, its IRTypeError for a dtype kiln lacks (int4, float8) the graph layer's GraphError, as every bad
  operand of a Tensor is (the ONNX loader names the input or node)."""
  try: return to_dtype(dt)
  except IRTypeError as e: raise GraphError(str(e)) from e


def _norm_axis(a: int, nd: int, op: str, shape: tuple[Dim, ...]) -> int:
  if not isinstance(a, int) or not -nd <= a < max(nd, 1): raise GraphError(f"{op}: axis {a!r} is out of range for shape {shape}")
  return a % nd if nd else 0


def _norm_axes(axes: int | Sequence[int] | None, shape: tuple[Dim, ...], op: str) -> tuple[int, ...]:
  nd = len(shape)
  if axes is None: return tuple(range(nd))
  ax = (axes,) if isinstance(axes, int) else tuple(axes)
  out = tuple(sorted({_norm_axis(a, nd, op, shape) for a in ax}))
  if len(out) != len(ax): raise GraphError(f"{op}: repeated axis in {ax} for shape {shape}")
  return out


def broadcast_shapes(*shapes: tuple[Dim, ...], op: str = "broadcast") -> tuple[Dim, ...]:
  nd = max(len(s) for s in shapes)
  out = []
  for i in range(nd):
    ds = {s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0} - {1}
    if len(ds) > 1: raise GraphError(f"{op}: shapes {', '.join(str(s) for s in shapes)} do not broadcast (dim {i})")
    out.append(ds.pop() if ds else 1)
  return tuple(out)


class Tensor:
  """A lazy tensor. `Tensor(np_array)` holds data; `Tensor.input(name, shape, dtype)` is a placeholder fed at run time."""
  __slots__ = ("node",)
  node: Node

  def __init__(self, data: Any, dtype: DTypeLike | None = None):
    if isinstance(data, Node):
      self.node = data
      return
    a = np.asarray(data)
    bf16 = dtype is not None and _dtype(dtype) == dtypes.bfloat16  # numpy has no bfloat16: its bits, in uint16
    if bf16: a = a.view(np.uint16) if a.dtype.name == "bfloat16" else f32_to_bf16_bits(a.astype(np.float32))
    elif dtype is not None: a = a.astype(_dtype(dtype).np)
    elif a.dtype == np.float64 and not isinstance(data, np.ndarray): a = a.astype(np.float32)  # Python floats: float32, as torch
    if 0 in a.shape: raise GraphError(f"Tensor: empty arrays are not supported (shape {a.shape})")
    dt = dtypes.bfloat16 if bf16 else _dtype(a.dtype)
    self.node = Node("BUFFER", (), Source(data=np.ascontiguousarray(a)), tuple(int(d) for d in a.shape), dt)

  @staticmethod
  def from_numpy(a: np.ndarray) -> Tensor: return Tensor(np.asarray(a))

  @staticmethod
  def input(name: str, shape: Sequence[int | str], dtype: DTypeLike = dtypes.float32, dims: Mapping[str, tuple[int, int]] | None = None) -> Tensor:
    """A placeholder fed at run time. A dim may be a name given bounds in dims, e.g. ("batch", 128) with
    dims={"batch": (1, 64)}: a symbolic dim, one runtime variable for every tensor that names it with those bounds."""
    if not isinstance(name, str) or not name: raise GraphError(f"Tensor.input: a name is a non-empty string, got {name!r}")
    shp: list[Dim] = []
    for d in shape:
      if isinstance(d, str):
        if not dims or d not in dims: raise GraphError(f"Tensor.input {name!r}: dim {d!r} has no bounds: pass dims={{{d!r}: (lo, hi)}}")
        b = dims[d]
        if not isinstance(b, tuple | list) or len(b) != 2: raise GraphError(f"Tensor.input {name!r}: bounds of dim {d!r} are (lo, hi), got {b!r}")
        shp.append(sym.variable(d, b[0], b[1]))
      elif isinstance(d, int) and not isinstance(d, bool) and d >= 1: shp.append(d)
      else: raise GraphError(f"Tensor.input {name!r}: dims must be ints >= 1 or names, got {tuple(shape)}")
    return Tensor(Node("BUFFER", (), Source(name=name), tuple(shp), _dtype(dtype)))

  def write_rows(self, value: Tensor, at: Dim) -> Tensor:
    """`value` written into this input's buffer from row `at` of its first axis, in place, by a kernel of the plan (a KV
    cache appended to without a round trip through the host). `self` is a named input of static shape that compile binds
    (bind=) and `at` a dim (an int, or a symbolic dim such as a bound cache's past length); value's other dims are self's,
    and its rows must fit from `at` at every value `at` may take. The result is value (in self's dtype) as written: kernels
    that use it read it back from the target, so the write is the only kernel that computes it. Give it to
    compile(..., writes=[...]) so that every run writes it, whether or not an output reads it. The plan orders kernels that
    touch the buffer as the graph lists them (a write waits for earlier readers of any row, later readers wait for it)."""
    t = self.node
    if t.op != "BUFFER" or t.arg.name is None or not sym.is_static(t.shape) or not t.shape:
      raise GraphError(f"write_rows: the target is a named input of static shape (a buffer bound at compile), got {t}")
    if value.shape[1:] != t.shape[1:] or not value.shape or not sym.is_static(value.shape[:1]):
      raise GraphError(f"write_rows: rows of shape {sym.fmt_shape(value.shape)} into {t.arg.name!r} of shape {sym.fmt_shape(t.shape)}: "
                       "a fixed number of rows whose other dims are the target's")
    n, total = sym.static_dim("write_rows", value.shape, 0), sym.static_dim("write_rows", t.shape, 0)
    if sym.dmin(at) < 0 or sym.dmax(at) + n > total:
      raise GraphError(f"write_rows: {n} rows from row {at} (up to {sym.dmax(at)}) do not fit in the {total} rows of {t.arg.name!r}")
    return Tensor(Node("WRITE", (t, value.cast(t.dtype).node), at, value.shape, t.dtype))

  @staticmethod
  def arange(n: Dim, dtype: DTypeLike = dtypes.int64) -> Tensor:
    """0, 1, ..., n-1 (n a symbolic dim too: the values are the loop's own index, nothing is stored)."""
    return Tensor(Node("IOTA", (), None, (n,), _dtype(dtype)))

  @staticmethod
  def dim_value(d: Dim, dtype: DTypeLike = dtypes.float32) -> Tensor:
    """A scalar holding a dim's size: a symbolic dim's value at run time (mean over a symbolic axis divides by it)."""
    dt = _dtype(dtype)
    return Tensor(Node("CONST", (), d, (), dt)) if isinstance(d, UOp) else Tensor.full((), d, dt)

  @staticmethod
  def full(shape: Sequence[Dim], value: Scalar, dtype: DTypeLike | None = None) -> Tensor:
    dt = _dtype(dtype) if dtype is not None else dtypes.from_py(value)
    v = truncate_value(dt, value) if dt == dtypes.bfloat16 else dt.np.type(value).item()  # bfloat16's numpy type holds bits, not values
    return Tensor(Node("CONST", (), v, (), dt)).reshape((1,) * len(shape)).expand(tuple(shape))

  # ---- properties ----
  @property
  def shape(self) -> tuple[Dim, ...]: return self.node.shape
  @property
  def dtype(self) -> DType: return self.node.dtype
  @property
  def ndim(self) -> int: return len(self.node.shape)
  @property
  def numel(self) -> Dim: return sym.symbolic_numel(self.node.shape)
  def __repr__(self) -> str: return f"<Tensor {self.node.op} {self.shape} {self.dtype.name}>"

  # ---- realizing ----
  def numpy(self, feeds: Mapping[str, np.ndarray] | None = None, device: str = "CPU") -> np.ndarray:
    if (data := self.node.data) is not None: return data.copy()
    return compile([self], device).run(feeds)[0]

  # ---- elementwise ----
  def _alu(self, op: Ops, *others: Tensor, dtype: DType | None = None) -> Tensor:
    shape = broadcast_shapes(self.shape, *(o.shape for o in others), op=op.name.lower())
    srcs = tuple(t.expand(shape).node for t in (self, *others))
    out_dt = dtype or (dtypes.bool if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else srcs[-1].dtype)
    return Tensor(Node("ALU", srcs, op, shape, out_dt))

  def _coerce(self, other: Tensor | Scalar | np.ndarray) -> tuple[Tensor, Tensor]:
    if isinstance(other, Tensor):
      if other.dtype == self.dtype: return self, other
      dt = least_upper_dtype(self.dtype, other.dtype)
      return self.cast(dt), other.cast(dt)
    if isinstance(other, np.ndarray): return self._coerce(Tensor(other))
    if not isinstance(other, int | float | bool): raise GraphError(f"cannot combine a Tensor with {type(other).__name__}")
    dt = self.dtype
    if isinstance(other, float) and not dt.is_float: dt = dtypes.float32
    elif isinstance(other, int) and not isinstance(other, bool) and dt.is_bool: dt = dtypes.int32
    return self.cast(dt), Tensor.full((), other, dt)

  def _bin(self, op: Ops, other: Tensor | Scalar | np.ndarray, reverse: bool = False) -> Tensor:
    a, b = self._coerce(other)
    return b._alu(op, a) if reverse else a._alu(op, b)

  def __add__(self, x: Any) -> Tensor: return self._bin(Ops.ADD, x)
  def __radd__(self, x: Any) -> Tensor: return self._bin(Ops.ADD, x, True)
  def __sub__(self, x: Any) -> Tensor: return self._bin(Ops.SUB, x)
  def __rsub__(self, x: Any) -> Tensor: return self._bin(Ops.SUB, x, True)
  def __mul__(self, x: Any) -> Tensor: return self._bin(Ops.MUL, x)
  def __rmul__(self, x: Any) -> Tensor: return self._bin(Ops.MUL, x, True)
  def __truediv__(self, x: Any) -> Tensor: return self.float()._bin(Ops.FDIV, x)
  def __rtruediv__(self, x: Any) -> Tensor: return self.float()._bin(Ops.FDIV, x, True)
  def __neg__(self) -> Tensor:
    if self.dtype.is_bool: raise GraphError(f"neg: cannot negate a bool tensor {self.shape}; use logical_not")
    return self._alu(Ops.NEG)
  def __matmul__(self, x: Tensor) -> Tensor: return self.matmul(x)
  def __rmatmul__(self, x: Tensor) -> Tensor: return Tensor(x).matmul(self) if not isinstance(x, Tensor) else x.matmul(self)
  def __lt__(self, x: Any) -> Tensor: return self._bin(Ops.CMPLT, x)
  def __gt__(self, x: Any) -> Tensor: return self._bin(Ops.CMPLT, x, True)
  def __le__(self, x: Any) -> Tensor: return (self > x).logical_not() if not self.dtype.is_float else (self < x) | self.eq(x)
  def __ge__(self, x: Any) -> Tensor: return (self < x).logical_not() if not self.dtype.is_float else (self > x) | self.eq(x)
  def eq(self, x: Any) -> Tensor: return self._bin(Ops.CMPEQ, x)
  def ne(self, x: Any) -> Tensor: return self._bin(Ops.CMPNE, x)
  def __and__(self, x: Any) -> Tensor: return self._bin(Ops.AND, x)
  def __or__(self, x: Any) -> Tensor: return self._bin(Ops.OR, x)
  def __xor__(self, x: Any) -> Tensor: return self._bin(Ops.XOR, x)
  __hash__ = object.__hash__

  def logical_not(self) -> Tensor:
    if not self.dtype.is_bool: raise GraphError(f"logical_not needs a bool tensor, got {self.dtype.name} {self.shape}")
    return self ^ True

  def cast(self, dtype: DTypeLike) -> Tensor:
    dt = _dtype(dtype)
    return self if dt == self.dtype else Tensor(Node("ALU", (self.node,), Ops.CAST, self.shape, dt))
  def float(self) -> Tensor: return self if self.dtype.is_float else self.cast(dtypes.float32)

  def _unary(self, op: Ops) -> Tensor: return self.float()._alu(op)
  def exp2(self) -> Tensor: return self._unary(Ops.EXP2)
  def log2(self) -> Tensor: return self._unary(Ops.LOG2)
  def _exact(self, c: PyFloat) -> Tensor:
    """A composite's constant (1/ln 2, 1/sqrt 2) beside a float tensor, unrounded: a kernel computes a 16-bit tensor in
    float32 (kernelize.compute_dtype) and takes the constant there as it is (bfloat16's 1/ln 2 would be 0.2% off)."""
    return Tensor(Node("CONST", (), float(c), (), self.dtype)) if compute_dtype(self.dtype) != self.dtype else Tensor.full((), c, self.dtype)
  def exp(self) -> Tensor:
    x = self.float()
    return (x * x._exact(1 / math.log(2))).exp2()
  def log(self) -> Tensor:
    x = self.log2()
    return x * x._exact(math.log(2))
  def sqrt(self) -> Tensor: return self._unary(Ops.SQRT)
  def rsqrt(self) -> Tensor: return self.sqrt().reciprocal()
  def reciprocal(self) -> Tensor: return self._unary(Ops.RECIPROCAL)
  def erf(self) -> Tensor: return self._unary(Ops.ERF)
  def tanh(self) -> Tensor: return self._unary(Ops.TANH)
  def sin(self) -> Tensor: return self._unary(Ops.SIN)
  def relu(self) -> Tensor: return self.maximum(0)
  def sigmoid(self) -> Tensor: return (1.0 + (-self.float()).exp()).reciprocal()
  def silu(self) -> Tensor: return self * self.sigmoid()
  def gelu(self) -> Tensor:
    """Exact GELU: 0.5 x (1 + erf(x / sqrt 2))."""
    x = self.float()
    return x * 0.5 * ((x * x._exact(1 / math.sqrt(2))).erf() + 1.0)
  def abs(self) -> Tensor: return self.maximum(-self)
  def maximum(self, x: Any) -> Tensor: return self._bin(Ops.MAX, x)
  def minimum(self, x: Any) -> Tensor:
    a, b = self._coerce(x)
    return -((-a).maximum(-b)) if a.dtype.is_float else (a < b).where(a, b)
  def where(self, x: Any, y: Any) -> Tensor:
    """self ? x : y, self a bool tensor (numpy.where(self, x, y))."""
    if not self.dtype.is_bool: raise GraphError(f"where: the condition must be bool, got {self.dtype.name} {self.shape}")
    if isinstance(x, Tensor): a, b = x._coerce(y)
    elif isinstance(y, Tensor): b, a = y._coerce(x)
    else:
      dt = least_upper_dtype(dtypes.from_py(x), dtypes.from_py(y))
      a, b = Tensor.full((), x, dt), Tensor.full((), y, dt)
    return self._alu(Ops.WHERE, a, b, dtype=a.dtype)

  def pow(self, p: Any) -> Tensor:
    """self ** p as numpy computes it (kiln.graph.power): an integer to an integer power stays an integer, exact; with a
    float on either side the result is float; a negative base to an integer power keeps its sign."""
    from kiln.graph.power import power
    if not isinstance(p, Tensor | int | float) or isinstance(p, bool): raise GraphError(f"pow: exponent must be a number or a Tensor, got {p!r}")
    floating = isinstance(p, float) or (isinstance(p, Tensor) and p.dtype.is_float)
    return power(self.float() if floating else self, p)
  def __pow__(self, p: Any) -> Tensor: return self.pow(p)

  # ---- reductions ----
  def _reduce(self, op: Ops, axis: int | Sequence[int] | None, keepdims: bool, name: str) -> Tensor:
    axes = _norm_axes(axis, self.shape, name)
    x = self.cast(dtypes.int32) if self.dtype.is_bool and op is Ops.ADD else self
    kshape = tuple(1 if i in axes else d for i, d in enumerate(self.shape))
    out = Tensor(Node("REDUCE", (x.node,), (op, axes), kshape, x.dtype))
    return out if keepdims else out.reshape(tuple(d for i, d in enumerate(self.shape) if i not in axes))
  def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor: return self._reduce(Ops.ADD, axis, keepdims, "sum")
  def prod(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor: return self._reduce(Ops.MUL, axis, keepdims, "prod")
  def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor: return self._reduce(Ops.MAX, axis, keepdims, "max")
  def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    if self.dtype.is_bool: return self.logical_not().max(axis, keepdims).logical_not()
    return -((-self).max(axis, keepdims))
  def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    n = sym.mul(*(self.shape[a] for a in _norm_axes(axis, self.shape, "mean")))
    if isinstance(n, UOp): return self.float().sum(axis, keepdims) / Tensor.dim_value(n)
    return self.float().sum(axis, keepdims) * (1 / n)
  def var(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    d = self - self.mean(axis, keepdims=True)
    return (d * d).mean(axis, keepdims)

  # ---- movement (index arithmetic, no copies) ----
  def _view(self, kind: str, p: Any, shape: tuple[Dim, ...]) -> Tensor: return Tensor(Node("VIEW", (self.node,), (kind, p), shape, self.dtype))

  def reshape(self, *shape: Any) -> Tensor:
    shp = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else list(shape)
    if any(isinstance(d, bool) or not isinstance(d, int | np.integer | UOp) for d in shp):
      raise GraphError(f"reshape: dims must be ints, got {tuple(shp)}")
    if shp.count(-1) > 1: raise GraphError(f"reshape: at most one -1 in {tuple(shp)}")
    if not sym.is_static(self.shape) or not sym.is_static(shp): return self._reshape_symbolic(shp)
    numel = prod(self.shape)
    if -1 in shp:
      rest = prod(d for d in shp if d != -1)
      if rest == 0 or numel % rest: raise GraphError(f"reshape: cannot reshape {self.shape} to {tuple(shp)}")
      shp[shp.index(-1)] = numel // rest
    new = tuple(int(d) for d in shp)
    if any(d < 1 for d in new) or prod(new) != numel: raise GraphError(f"reshape: cannot reshape {self.shape} ({numel} elements) to {new}")
    return self if new == self.shape else self._view("reshape", new, new)

  def _reshape_symbolic(self, shp: list[Any]) -> Tensor:
    for d in shp:
      if not isinstance(d, UOp) and not (isinstance(d, int) and not isinstance(d, bool) and (d >= 1 or d == -1)):
        raise GraphError(f"reshape: dims are ints >= 1, -1 or symbolic dims, got {shp}")
    if -1 in shp:
      rest = sym.mul(*(d for d in shp if isinstance(d, UOp) or d != -1))
      if (q := sym.div(self.numel, rest)) is None:
        raise GraphError(f"reshape: cannot reshape {sym.fmt_shape(self.shape)} to {sym.fmt_shape(shp)}: -1 is no whole number of elements")
      shp[shp.index(-1)] = q
    new = tuple(sym.mul(d) for d in shp)  # canonical form, so equal dims are the same UOp
    if not sym.same(sym.symbolic_numel(new), self.numel):
      raise GraphError(f"reshape: cannot reshape {sym.fmt_shape(self.shape)} to {sym.fmt_shape(new)} (different numbers of elements)")
    sym.reshape_groups(new, self.shape)  # a GraphError unless every symbolic dim keeps a group of its own
    return self if new == self.shape else self._view("reshape", new, new)

  def permute(self, *order: Any) -> Tensor:
    o = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list, np.ndarray)) else tuple(order)
    o = tuple(int(a) if isinstance(a, np.integer) else a for a in o)  # numpy's ints (a permutation from rng) are axes too
    if sorted(a % max(self.ndim, 1) if isinstance(a, int) and -self.ndim <= a < self.ndim else -99 for a in o) != list(range(self.ndim)):
      raise GraphError(f"permute: {o} is not a permutation of the {self.ndim} axes of {self.shape}")
    o = tuple(a % self.ndim for a in o)
    return self if o == tuple(range(self.ndim)) else self._view("permute", o, tuple(self.shape[a] for a in o))

  def transpose(self, a: int = -2, b: int = -1) -> Tensor:
    a, b = _norm_axis(a, self.ndim, "transpose", self.shape), _norm_axis(b, self.ndim, "transpose", self.shape)
    o = list(range(self.ndim))
    o[a], o[b] = o[b], o[a]
    return self.permute(o)
  @property
  def T(self) -> Tensor: return self.permute(tuple(reversed(range(self.ndim))))

  def expand(self, *shape: Any) -> Tensor:
    shp = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    if len(shp) < self.ndim: raise GraphError(f"expand: cannot expand {self.shape} to fewer dims {shp}")
    x = self.reshape((1,) * (len(shp) - self.ndim) + self.shape) if len(shp) > self.ndim else self
    new = tuple(s if s != -1 else d for s, d in zip(shp, x.shape))
    for s, d in zip(new, x.shape):
      if d != 1 and s != d: raise GraphError(f"expand: cannot expand {self.shape} to {shp}")
    return x if new == x.shape else x._view("expand", new, new)

  def unsqueeze(self, axis: int) -> Tensor:
    a = _norm_axis(axis, self.ndim + 1, "unsqueeze", self.shape)
    return self.reshape(self.shape[:a] + (1,) + self.shape[a:])

  def squeeze(self, axis: int | Sequence[int] | None = None) -> Tensor:
    if axis is None: return self.reshape(tuple(d for d in self.shape if d != 1))
    axes = _norm_axes(axis, self.shape, "squeeze")
    for a in axes:
      if self.shape[a] != 1: raise GraphError(f"squeeze: axis {a} of {self.shape} has size {self.shape[a]}, not 1")
    return self.reshape(tuple(d for i, d in enumerate(self.shape) if i not in axes))

  def flatten(self, start: int = 0, end: int = -1) -> Tensor:
    if self.ndim == 0: return self.reshape(1)
    s, e = _norm_axis(start, self.ndim, "flatten", self.shape), _norm_axis(end, self.ndim, "flatten", self.shape)
    return self.reshape(self.shape[:s] + (sym.mul(*self.shape[s:e + 1]),) + self.shape[e + 1:])

  def slice(self, starts: Sequence[int], ends: Sequence[int], axes: Sequence[int] | None = None, steps: Sequence[int] | None = None) -> Tensor:
    """x[start:end:step] on each of axes, with Python's rules for negative and out-of-range bounds."""
    ax = list(axes) if axes is not None else list(range(len(starts)))
    st = list(steps) if steps is not None else [1] * len(ax)
    sl: list[Any] = [slice(None)] * self.ndim
    for a, b, e, s in zip(ax, starts, ends, st):
      a = _norm_axis(a, self.ndim, "slice", self.shape)
      if s == 0: raise GraphError(f"slice: step 0 on axis {a} of {self.shape}")
      sl[a] = slice(b, e, s)
    return self[tuple(sl)]

  def __getitem__(self, key: Any) -> Tensor:
    keys = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in keys) > 1: raise GraphError("index: at most one ...")
    n_real = sum(1 for k in keys if k is not None and k is not Ellipsis)
    if n_real > self.ndim: raise GraphError(f"index: too many indices {key!r} for shape {self.shape}")
    if Ellipsis in keys:
      i = keys.index(Ellipsis)
      keys = keys[:i] + (slice(None),) * (self.ndim - n_real) + keys[i + 1:]
    keys = keys + (slice(None),) * (self.ndim - sum(1 for k in keys if k is not None))
    spec: list[tuple[Dim, int]] = []
    shape: list[Dim] = []
    drop: list[int] = []
    newaxes: list[int] = []
    d = 0
    for k in keys:
      if k is None:
        newaxes.append(len(shape) - len(drop) + len(newaxes))
        continue
      n = self.shape[d]
      bounded = isinstance(k, slice) and (isinstance(k.start, UOp) or isinstance(k.stop, UOp))  # a fixed axis cut to a symbolic length
      if isinstance(n, UOp) or bounded:  # a slice of step 1: its start and length are dims (seq - 1 for [1:]), as dims.span works them out
        if not (isinstance(k, slice) and k.step in (None, 1)):
          raise GraphError(f"index: {k!r} on the symbolic axis {d} of {sym.fmt_shape(self.shape)} (only slices of step 1 are supported)")
        if bounded and k.step not in (None, 1): raise GraphError(f"index: {k!r} of axis {d}: a symbolic bound takes step 1 only")
        b0, m0 = sym.span(n, k.start, k.stop, f"index: slice {k} of axis {d} of {sym.fmt_shape(self.shape)}")
        spec.append((b0, 1)); shape.append(m0); d += 1
        continue
      if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
        kk = int(k)
        if not -n <= kk < n: raise GraphError(f"index: {kk} is out of range for axis {d} of {self.shape}")
        spec.append((kk % n, 1)); shape.append(1); drop.append(d)
      elif isinstance(k, slice):
        b, e, s = k.indices(n)
        m = len(range(b, e, s))
        if m == 0: raise GraphError(f"index: slice {k} of axis {d} of {self.shape} is empty (empty tensors are not supported)")
        spec.append((b, s)); shape.append(m)
      else: raise GraphError(f"index: unsupported key {k!r} (ints, slices, None and ... only; use gather for tensors)")
      d += 1
    x = self
    if any(s != (0, 1) for s in spec) or tuple(shape) != self.shape: x = x._view("shrink", tuple(spec), tuple(shape))
    final = [sz for i, sz in enumerate(shape) if i not in drop]
    for a in newaxes: final.insert(a, 1)
    return x.reshape(tuple(final))

  def pad(self, pads: Sequence[tuple[int, Dim]], value: Scalar = 0) -> Tensor:
    """Pad each axis by (before, after) >= 0 elements of value. An after may be a dim (a symbolic axis padded to a fixed
    size: n + (16 - n) is 16) that is >= 0 for every value in its bounds."""
    if len(pads) != self.ndim or any(not isinstance(b, int) or b < 0 or sym.dmin(a) < 0 for b, a in pads):
      raise GraphError(f"pad: {list(pads)} does not fit {self.shape} (one (before, after) >= 0 per axis)")
    shape = tuple(sym.add(d, b, a) for d, (b, a) in zip(self.shape, pads))  # a symbolic axis: a sum (seq + 2)
    return self if shape == self.shape else self._view("pad", (tuple(b for b, _ in pads), value), shape)

  def contiguous(self) -> Tensor:
    """The same values with a buffer of their own: the scheduler never inlines it into the kernels that read it."""
    if self.node.op == "BUFFER" or self.node.realize: return self
    return Tensor(Node("VIEW", (self.node,), ("reshape", self.shape), self.shape, self.dtype, realize=True))

  # ---- windows: convolution and pooling ----
  def windows(self, kernel: Sequence[int], stride: Sequence[int] | None = None, dilation: Sequence[int] | None = None) -> Tensor:
    """(*lead, *spatial) -> (*lead, *out, *kernel): every window of the trailing len(kernel) axes, as index arithmetic."""
    d = len(kernel)
    st, dl = list(stride or [1] * d), list(dilation or [1] * d)
    if d > self.ndim or len(st) != d or len(dl) != d or min([*kernel, *st, *dl], default=1) < 1:
      raise GraphError(f"windows: kernel {list(kernel)}, stride {st}, dilation {dl} do not fit {self.shape}")
    sym.require_static("windows (conv, pool)", self.shape, range(self.ndim - d, self.ndim))
    sp = self.shape[self.ndim - d:]
    out = tuple((n - (k - 1) * q - 1) // s + 1 for n, k, s, q in zip(sp, kernel, st, dl))
    if min(out, default=1) < 1: raise GraphError(f"windows: kernel {list(kernel)} (dilation {dl}) is larger than the input {self.shape}")
    shape = self.shape[:self.ndim - d] + out + tuple(kernel)
    return self._view("window", tuple(zip(st, dl)), shape)

  def conv2d(self, weight: Tensor, bias: Tensor | None = None, stride: Sequence[int] | int = 1, padding: Sequence[tuple[int, int]] | int = 0,
             dilation: Sequence[int] | int = 1, groups: int = 1) -> Tensor:
    """N-d convolution (torch's conv2d for 2 spatial dims): x (N, C, *sp), weight (O, C/groups, *k), padding (before, after)
    per dim; built from the graph's primitives by conv.py (a matrix product per group, Winograd, or a depthwise window sum)."""
    return conv.conv(self, weight, bias, stride, padding, dilation, groups)

  def max_pool(self, kernel: Sequence[int], stride: Sequence[int] | None = None, padding: Sequence[tuple[int, int]] | None = None,
               dilation: Sequence[int] | None = None) -> Tensor:
    d = len(kernel)
    pads = list(padding or [(0, 0)] * d)
    x = self.pad(((0, 0),) * (self.ndim - d) + tuple(pads), -math.inf if self.dtype.is_float else self.dtype.min)
    return conv.pooled(self, x.windows(kernel, stride or kernel, dilation).max(tuple(range(self.ndim, self.ndim + d))))

  def avg_pool(self, kernel: Sequence[int], stride: Sequence[int] | None = None, padding: Sequence[tuple[int, int]] | None = None,
               count_include_pad: bool = True, dilation: Sequence[int] | None = None) -> Tensor:
    d = len(kernel)
    pads = list(padding or [(0, 0)] * d)
    st, dl = list(stride or kernel), list(dilation or [1] * d)
    x = self.float().pad(((0, 0),) * (self.ndim - d) + tuple(pads)).windows(kernel, st, dl)
    s = x.sum(tuple(range(self.ndim, self.ndim + d)))
    if count_include_pad or not any(b or a for b, a in pads): return conv.pooled(self, s * (1 / prod(kernel)))
    counts = np.ones((), np.float32)  # valid elements per window, an outer product over the spatial dims
    for n, k, (b, _), o, step, q in zip(self.shape[self.ndim - d:], kernel, pads, s.shape[self.ndim - d:], st, dl):
      pos = np.arange(o)[:, None] * step + np.arange(k)[None, :] * q - b
      counts = np.multiply.outer(counts, ((pos >= 0) & (pos < n)).sum(1).astype(np.float32))
    return s / Tensor(counts.astype(np.float32))

  @staticmethod
  def cat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    ts = list(tensors)
    if not ts: raise GraphError("cat: no tensors")
    if len(ts) == 1: return ts[0]
    a = _norm_axis(axis, ts[0].ndim, "cat", ts[0].shape)
    dt = least_upper_dtype(*(t.dtype for t in ts))
    for t in ts:
      if t.ndim != ts[0].ndim or any(x != y for i, (x, y) in enumerate(zip(t.shape, ts[0].shape)) if i != a):
        raise GraphError(f"cat: shapes {[t.shape for t in ts]} differ outside axis {a}")
    shape = tuple(sym.add(*(t.shape[a] for t in ts)) if i == a else d for i, d in enumerate(ts[0].shape))  # past + seq: a KV cache's
    return Tensor(Node("CAT", tuple(t.cast(dt).node for t in ts), a, shape, dt))

  @staticmethod
  def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    return Tensor.cat([t.unsqueeze(axis) for t in tensors], axis)

  def split(self, sizes: Sequence[int], axis: int = 0) -> list[Tensor]:
    a = _norm_axis(axis, self.ndim, "split", self.shape)
    sym.require_static("split", self.shape, [a], "as the split axis")
    if sum(sizes) != self.shape[a] or any(s < 1 for s in sizes):
      raise GraphError(f"split: sizes {list(sizes)} do not add up to axis {a} of {self.shape}")
    out, o = [], 0
    for s in sizes:
      out.append(self.slice([o], [o + s], [a]))
      o += s
    return out

  # ---- indexing by data ----
  def gather(self, indices: Tensor, axis: int = 0, name: str | None = None, in_range: bool = False) -> Tensor:
    """numpy.take(self, indices, axis): negative indices count from the end; an index outside [-n, n) is an
    IndexOutOfRangeError naming the gather (`name`) and the index: at once for constant indices, else after the run.
    in_range: the caller made every index in [0, n) by construction (kiln's own tables, never a user's data): no run-time
    check; the kernel clamps all the same, so it never reads outside the table."""
    if not indices.dtype.is_int: raise GraphError(f"gather: indices must be integers, got {indices.dtype.name} {indices.shape}")
    a = _norm_axis(axis, self.ndim, "gather", self.shape)  # a symbolic axis: clamped and checked against its run-time size
    return Tensor(gather_node(self.node, indices.node, a, self.shape[:a] + indices.shape + self.shape[a + 1:], name, in_range))
  def embedding(self, ids: Tensor) -> Tensor: return self.gather(ids, 0)

  # ---- linear algebra ----
  def matmul(self, w: Tensor) -> Tensor:
    """numpy.matmul: batch dims broadcast; 1-d operands are promoted and the added axis dropped."""
    a, b = self, w
    if a.ndim == 0 or b.ndim == 0: raise GraphError(f"matmul: scalars have no matmul ({a.shape} @ {b.shape})")
    va, vb = a.ndim == 1, b.ndim == 1
    if va: a = a.reshape(1, a.shape[0])
    if vb: b = b.reshape(b.shape[0], 1)
    if a.shape[-1] != b.shape[-2]: raise GraphError(f"matmul: inner dims differ: {self.shape} @ {w.shape}")
    a, b = a._coerce(b)
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], op="matmul")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if (out := few_rows.product(a, b)) is None:  # a weight array read by few rows: in blocks of columns
      out = (a.expand(batch + (m, k)).unsqueeze(-1) * b.expand(batch + (k, n)).unsqueeze(-3)).sum(-2)  # (*batch, m, k, n) summed over k
    if va: out = out.squeeze(-2)
    if vb: out = out.squeeze(-1)
    return out

  def linear(self, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, weight (out, in) as torch.nn.Linear stores it."""
    y = self.matmul(weight.T)
    return y if bias is None else y + bias

  # ---- composites ----
  def softmax(self, axis: int = -1) -> Tensor:
    x = self.float()
    e = (x - x.max(axis, keepdims=True)).exp()
    return e / e.sum(axis, keepdims=True)

  def log_softmax(self, axis: int = -1) -> Tensor:
    x = self.float()
    s = x - x.max(axis, keepdims=True)
    return s - s.exp().sum(axis, keepdims=True).log()

  def layernorm(self, weight: Tensor | None = None, bias: Tensor | None = None, axis: int | Sequence[int] = -1, eps: PyFloat = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over axis, the variance taken around the mean (one kernel)."""
    x = self.float()
    d = x - x.mean(axis, keepdims=True)
    y = d * ((d * d).mean(axis, keepdims=True) + eps).rsqrt()
    if weight is not None: y = y * weight
    return y if bias is None else y + bias

  def rms_norm(self, weight: Tensor | None = None, axis: int = -1, eps: PyFloat = 1e-6) -> Tensor:
    x = self.float()
    y = x * ((x * x).mean(axis, keepdims=True) + eps).rsqrt()
    return y if weight is None else y * weight


def compile(outputs: Sequence[Tensor], device: str = "CPU", fuse: bool = True, bind: Mapping[str, Any] | None = None,  # noqa: A001
            writes: Sequence[Tensor] = (), cache: str | None = None) -> Compiled:
  """Schedule the graphs of outputs into fused kernels and build one ExecutionPlan; `.run(feeds)` returns the outputs.
  `bind` maps input names to kiln.executor Buffers the caller owns, read in place by every run (schedule.compile_nodes);
  `writes` are Tensor.write_rows effects into bound inputs, done by every run and returned by none. `cache`: a key the
  caller vouches names the contents of every constant array in the graph (a checkpoint file's sha256): the compiled
  graph is kept in the plan cache and rebuilt from there when the same graph is compiled again (compile_cache.py)."""
  if not outputs: raise GraphError("compile: no outputs")
  for t in outputs:
    if not isinstance(t, Tensor): raise GraphError(f"compile: outputs must be Tensors, got {type(t).__name__}")
  for t in writes:
    if not isinstance(t, Tensor) or t.node.op != "WRITE": raise GraphError(f"compile: writes are Tensor.write_rows results, got {t!r}")
  if cache is not None and not isinstance(cache, str): raise GraphError(f"compile: cache takes a str key, got {type(cache).__name__}")
  nodes, effects = [t.node for t in outputs], [t.node for t in writes]
  if cache is None: return compile_nodes(nodes, device, fuse, bind, effects)
  from kiln.graph.compile_cache import compile_kept
  return compile_kept(cache, nodes, device, fuse, bind or {}, effects)
