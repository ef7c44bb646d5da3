"""The ONNX operators kiln converts: one handler per op (its inputs as Tensors or, where constant, numpy arrays, which fold at
load), registered in OPS with the attributes it understands; any other attribute is refused by the loader (onnx.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import shape_values as sv
from kiln.graph.index_check import bad_index, out_of_range
from kiln.graph.lazy import ONNXError
from kiln.graph.onnx_empty import SymbolicEmpty, empty_slice
from kiln.graph.onnx_external import Tensors
from kiln.graph.onnx_limits import LoadBudget
from kiln.graph.onnx_window import is_window, slice_window
from kiln.graph.power import np_power, power
from kiln.graph.specialise import Host, Length, RuntimeValue
from kiln.graph.tensor import Tensor
from kiln.ir.alu import exec_alu
from kiln.ir.dtype import dtypes
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

Value = Tensor | np.ndarray


class OnnxNode:
  """One ONNX node while it is converted: its inputs (None for an omitted optional one), attributes, and opset."""
  def __init__(self, proto: Any, env: dict[str, Value], opset: int, onnx: Any, stored: Tensors | None = None,
               budget: LoadBudget | None = None):
    self.proto, self.op, self.name, self.opset = proto, proto.op_type, proto.name or f"<{proto.op_type}>", opset
    self.stored = stored or Tensors(onnx, None)
    self.budget = budget or LoadBudget()  # what the whole model's load may make: shared by all its nodes
    self.env = env  # a value OnnxNode.read_back found at run time is under its key there once the rest is converted for it
    self.ins: list[Value | None] = []
    for n in proto.input:
      if n == "": self.ins.append(None)
      elif n not in env: raise ONNXError(f"node {self.name} ({self.op}): input {n!r} is not produced by any earlier node, input or initializer")
      else: self.ins.append(env[n])
    self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proto.attribute}
    self.used_attrs: set[str] = set()
    self.from_shape: dict[int, str] = {}  # inputs that held a Shape's symbolic dims, now data (shape_values.check_shape_value)

  def attr(self, name: str, default: Any = None) -> Any:
    self.used_attrs.add(name)
    v = self.attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v

  def strs(self, name: str) -> list[str]:
    """A list-of-strings attribute (onnx gives its items as bytes) as str; empty where it is not given."""
    return [v.decode() if isinstance(v, bytes) else str(v) for v in self.attr(name, None) or []]

  def const(self, i: int, what: str) -> np.ndarray:
    v = self.ins[i] if i < len(self.ins) else None
    if v is None: raise self.error(f"input {i} ({what}) is missing")
    if isinstance(v, Tensor):
      if i in self.from_shape:  # a symbolic dim's value: specialising on it would compile once per size (a runtime variable's job)
        raise self.error(f"input {i} ({what}) must be a constant known at load time: it holds the symbolic dims of a Shape "
                         f"({self.from_shape[i]}), known only at run time")
      text = f"input {i} ({what}) is computed at run time"
      raise RuntimeValue(str(self.error(f"{text}: kiln specialises the rest of a model on such a value only in its main graph (or a branch "
                                        "of an If known at load), not inside a Loop or Scan body or a run-time If's branch")),
                         self, i, text)  # the converter cuts there (specialise.py)
    return v

  def read_back(self, what: str, reads: list[Tensor], host: Host | None = None, length: Length | None = None) -> Any:
    """A value this node's output shape depends on, computed at run time: the one array `reads` compute (NonZero's count),
    or what `host` computes from theirs (a host step: NonMaxSuppression). The first time, RuntimeValue: the converter cuts
    before the node, and the rest is converted when this returns the value: a number, a host step's array (a Tensor each
    run fills, or an empty array), or, for a `length` (a count, a host step's rows, with a bound), a runtime variable in
    [0, bound] (a Dim; a host step's Tensor of that many rows) that each run binds (specialise.py)."""
    key = f"<{what} of node {self.name}>"
    if (v := self.env.get(key)) is not None: return v
    text = f"{what} is computed at run time"
    raise RuntimeValue(str(self.error(f"{text}: kiln converts the rest of a model for such a value only in its main graph (or a branch "
                                      "of an If known at load), not inside a Loop or Scan body or a run-time If's branch")),
                       self, -1, text, reads, key, host, length)

  def opt_const(self, i: int, what: str) -> np.ndarray | None:
    return None if i >= len(self.ins) or self.ins[i] is None else self.const(i, what)

  def t(self, i: int) -> Tensor:
    v = self.ins[i] if i < len(self.ins) else None
    if v is None: raise self.error(f"input {i} is missing")
    return v if isinstance(v, Tensor) else Tensor(np.asarray(v))

  def tensor(self, name: str) -> np.ndarray:
    """A tensor attribute's value, read as every stored tensor is (onnx_external: external data stays in the model's directory)."""
    return self.stored.array(self.attr(name), f"node {self.name} ({self.op}): attribute {name!r}")

  def error(self, msg: str) -> ONNXError: return ONNXError(f"node {self.name} ({self.op}, opset {self.opset}): {msg}")


def _axes_of(n: OnnxNode, attr_until: int, input_index: int = 1) -> list[int] | None:
  """axes as an attribute (opsets before attr_until) or as an input (from it on)."""
  if n.opset < attr_until: return n.attr("axes")
  a = n.opt_const(input_index, "axes")
  return None if a is None else [int(x) for x in a.reshape(-1)]


def _norm(a: int, nd: int, n: OnnxNode) -> int:
  if not -nd <= a < nd: raise n.error(f"axis {a} is out of range for rank {nd}")
  return a % nd


# ---- numpy folding of all-constant nodes (shape arithmetic) ----
_NP_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
  "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Equal": np.equal, "Less": np.less, "Greater": np.greater,
  "And": np.logical_and, "Or": np.logical_or, "Max": np.maximum, "Min": np.minimum, "LessOrEqual": np.less_equal, "GreaterOrEqual": np.greater_equal,
}


def _np_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  if a.dtype.kind in "iu":  # ONNX integer Div truncates: the IR's IDIV, in integers (a float quotient rounds past 2**53)
    a, b = np.broadcast_arrays(a, b.astype(a.dtype))
    return exec_alu(Ops.IDIV, dtypes.from_numpy(a.dtype), a, b).astype(a.dtype)
  return (a / b).astype(a.dtype)


# ---- the operators ----
def _binary(f: Callable[[Any, Any], Any]) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    a, b = n.ins[0], n.ins[1]
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return np.asarray(f(a, b))
    ta, tb = n.t(0), n.t(1)
    if ta.dtype != tb.dtype: raise n.error(f"operands have different dtypes {ta.dtype.name} and {tb.dtype.name}")
    return f(ta, tb)
  return run


def _div(n: OnnxNode) -> Value:
  a, b = n.ins[0], n.ins[1]
  if isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return _np_div(a, b)
  ta, tb = n.t(0), n.t(1)
  if ta.dtype != tb.dtype: raise n.error(f"operands have different dtypes {ta.dtype.name} and {tb.dtype.name}")
  if not ta.dtype.is_float: return ta._bin(Ops.IDIV, tb)  # the IR's IDIV truncates as ONNX does (a zero divisor, undefined in ONNX, gives a)
  return ta / tb


def _pow(n: OnnxNode) -> Value:
  a, b = n.ins[0], n.ins[1]
  if isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return np_power(a, b)
  if isinstance(b, np.ndarray) and b.size == 1 and b.dtype.kind in "iuf": return power(n.t(0), b.reshape(-1)[0].item())
  return power(n.t(0), n.t(1))  # in the base's dtype, as ONNX's Pow (Tensor.pow promotes as numpy does)


def _unary(name: str) -> Callable[[OnnxNode], Value]:
  return lambda n: getattr(n.t(0), name)()


def _gelu(n: OnnxNode) -> Value:
  x = n.t(0)
  approx = n.attr("approximate", "none")
  if approx == "none": return x.gelu()
  if approx == "tanh": return x * 0.5 * (((x + x * x * x * 0.044715) * 0.7978845608028654).tanh() + 1.0)
  raise n.error(f"attribute approximate={approx!r} is not supported (none, tanh)")


def _softmax(log: bool) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    x = n.t(0)
    if n.opset >= 13:
      a = _norm(n.attr("axis", -1), x.ndim, n)
      return x.log_softmax(a) if log else x.softmax(a)
    a = _norm(n.attr("axis", 1), x.ndim, n)  # opset < 13: over the input coerced to 2-d at axis
    flat = x.reshape(sym.mul(*x.shape[:a]), -1)
    return (flat.log_softmax(-1) if log else flat.softmax(-1)).reshape(x.shape)
  return run


def _layernorm(n: OnnxNode) -> Value | list[Value]:
  if n.attr("stash_type", 1) != 1: raise n.error(f"stash_type={n.attr('stash_type')} is not supported (float32 statistics only)")
  x = n.t(0)
  a = _norm(n.attr("axis", -1), x.ndim, n)
  w = n.t(1) if len(n.ins) > 1 and n.ins[1] is not None else None
  b = n.t(2) if len(n.ins) > 2 and n.ins[2] is not None else None
  axes, eps = tuple(range(a, x.ndim)), float(n.attr("epsilon", 1e-5))
  if not any(n.proto.output[1:]): return x.layernorm(w, b, axes, eps)
  xf = x.cast(dtypes.float32)  # the Mean and InvStdDev outputs: float32 statistics over axis.., kept as dims of 1
  mean = xf.mean(axes, keepdims=True)
  d = xf - mean
  inv = ((d * d).mean(axes, keepdims=True) + eps).rsqrt()
  y = d * inv
  if w is not None: y = y * w.cast(dtypes.float32)
  if b is not None: y = y + b.cast(dtypes.float32)
  return [y.cast(x.dtype), mean, inv]


def _reduce(kind: str, attr_until: int) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    x = n.t(0)
    axes = _axes_of(n, attr_until)
    keep = bool(n.attr("keepdims", 1))
    if not axes:
      if n.attr("noop_with_empty_axes", 0): return x
      axes = list(range(x.ndim))
    ax = tuple(_norm(a, x.ndim, n) for a in axes)
    return getattr(x, kind)(ax, keep)
  return run


def _gemm(n: OnnxNode) -> Value:
  a, b = n.t(0), n.t(1)
  if n.attr("transA", 0): a = a.T
  if n.attr("transB", 0): b = b.T
  y = a @ b
  if (alpha := float(n.attr("alpha", 1.0))) != 1.0: y = y * alpha
  if len(n.ins) > 2 and n.ins[2] is not None:
    c = n.t(2)
    y = y + (c * float(n.attr("beta", 1.0)) if float(n.attr("beta", 1.0)) != 1.0 else c)
  return y


def _reshape_shape(n: OnnxNode, in_shape: tuple[Dim, ...]) -> tuple[Dim, ...]:
  shape: list[Dim] = [s if isinstance(s, UOp) else int(s) for s in n.const(1, "shape").reshape(-1)]  # UOps: symbolic dims of a Shape
  if n.attr("allowzero", 0) and 0 in shape: raise n.error("allowzero=1 with a 0 in the shape (an empty tensor) is not supported")
  out = [in_shape[i] if s == 0 and i < len(in_shape) else s for i, s in enumerate(shape)]
  if not sym.is_static(in_shape) or not sym.is_static(out): return tuple(out)  # Tensor.reshape resolves a -1 against the symbolic dims
  ints = [d for d in out if isinstance(d, int)]  # all of them, with a static input
  if ints.count(-1) == 1:
    rest = int(np.prod([s for s in ints if s != -1], dtype=np.int64))
    ints[ints.index(-1)] = int(np.prod(sym.static_shape("Reshape", in_shape), dtype=np.int64)) // max(rest, 1)
  return tuple(ints)


def _shape(n: OnnxNode) -> Value:
  """Shape folds to a constant at load time. With a symbolic dim it is a *shape value*: an object array of Dims, which
  shape_values.RULES take as such (torch's Shape -> Gather -> Unsqueeze -> Concat -> Reshape, arithmetic that stays a
  dim); any other consumer reads the dims' run-time values as data."""
  shape = n.ins[0].shape if n.ins[0] is not None else ()
  if sym.is_static(shape): return np.asarray(shape, np.int64)[n.attr("start", 0):n.attr("end")]
  out = np.empty(len(shape), object)
  out[:] = list(shape)
  return out[n.attr("start", 0):n.attr("end")]


check_shape_value = sv.check_shape_value  # the loader's check of each node's inputs (onnx.py)


def _reshape(n: OnnxNode) -> Value:
  x = n.ins[0]
  if isinstance(x, np.ndarray): return x.reshape(sym.static_shape("Reshape", _reshape_shape(n, x.shape)))
  return n.t(0).reshape(_reshape_shape(n, n.t(0).shape))


def _transpose(n: OnnxNode) -> Value:
  x = n.ins[0]
  nd = x.ndim if x is not None else 0
  perm = n.attr("perm") or list(reversed(range(nd)))
  return np.transpose(x, perm) if isinstance(x, np.ndarray) else n.t(0).permute(perm)


def _unsqueeze(n: OnnxNode) -> Value:
  axes = _axes_of(n, 13)
  if axes is None: raise n.error("axes are required")
  x = n.ins[0]
  nd = (x.ndim if x is not None else 0) + len(axes)
  ax = sorted(_norm(a, nd, n) for a in axes)
  if isinstance(x, np.ndarray): return np.expand_dims(x, tuple(ax))
  t = n.t(0)
  for a in ax: t = t.unsqueeze(a)
  return t


def _squeeze(n: OnnxNode) -> Value:
  axes = _axes_of(n, 13)
  x = n.ins[0]
  if isinstance(x, np.ndarray): return np.squeeze(x, tuple(axes) if axes else None)
  return n.t(0).squeeze(tuple(axes) if axes else None)


def _concat(n: OnnxNode) -> Value:
  a = n.attr("axis")
  if a is None: raise n.error("attribute axis is required")
  vals = [v for v in n.ins if v is not None]
  if all(isinstance(v, np.ndarray) for v in vals): return np.concatenate([np.asarray(v) for v in vals], a)
  return Tensor.cat([v if isinstance(v, Tensor) else Tensor(v) for v in vals], a)


def _slice(n: OnnxNode) -> Value | SymbolicEmpty:
  if is_window(n): return slice_window(n)  # starts or ends computed from data: one compile (onnx_window.py)
  if n.opset < 10: starts, ends, axes, steps = n.attr("starts"), n.attr("ends"), n.attr("axes"), None
  else:
    starts, ends = [sv.dim(v) for v in n.const(1, "starts")], [sv.dim(v) for v in n.const(2, "ends")]  # UOps: a Shape's symbolic dims
    a, s = n.opt_const(3, "axes"), n.opt_const(4, "steps")
    axes, steps = (None if a is None else [int(v) for v in a]), (None if s is None else [int(v) for v in s])
  x = n.ins[0]
  nd = x.ndim if x is not None else 0
  axes = list(range(len(starts))) if axes is None else [_norm(a, nd, n) for a in axes]
  steps = steps or [1] * len(axes)
  if isinstance(x, np.ndarray) and sym.is_static(starts) and sym.is_static(ends):
    sl = [slice(None)] * nd
    for a, b, e, st in zip(axes, starts, ends, steps): sl[a] = slice(b, e, st)
    return x[tuple(sl)]
  if sv.is_shape_value(x): raise n.error("a Slice of a Shape's dims with symbolic bounds is not supported")
  t = n.t(0)
  if (empty := empty_slice(n, t, axes, starts, ends, steps)) is not None: return empty  # nothing selected: known at load
  if not sym.is_static(starts) or not sym.is_static(ends) or not sym.is_static([t.shape[a] for a in axes]):
    return sv.slice_dims(n, t, axes, starts, ends, steps)
  return t.slice(starts, ends, axes, steps)  # type: ignore[arg-type]  # static, as checked


def _split(n: OnnxNode) -> list[Value]:
  x = n.t(0)
  a = _norm(n.attr("axis", 0), x.ndim, n)
  raw = n.opt_const(1, "split") if n.opset >= 13 else n.attr("split")
  sizes: list[int] | None = None if raw is None else [int(v) for v in raw]
  nout = len(n.proto.output)
  if n.opset >= 18: n.attr("num_outputs")
  if sizes is None or len(sizes) == 0:
    d = sym.static_dim("Split", x.shape, a)
    k = -(-d // nout)
    sizes = [k] * (d // k) + ([d % k] if d % k else [])
    if len(sizes) != nout: raise n.error(f"cannot split axis {a} of {x.shape} into {nout} outputs")
  return list(x.split([int(s) for s in sizes], a))


def _cast(n: OnnxNode, onnx: Any) -> Value:
  code = n.attr("to")
  try: to = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code))
  except (KeyError, TypeError, ValueError): raise n.error(f"attribute to={code!r} names no element type") from None
  x = n.ins[0]
  if isinstance(x, np.ndarray): return x.astype(to)
  return n.t(0).cast(to)


def _cast_like(n: OnnxNode) -> Value:
  x, like = n.ins[0], n.ins[1] if len(n.ins) > 1 else None
  if like is None: raise n.error("input 1 (target_type) is missing")
  if isinstance(like, Tensor):
    if isinstance(x, np.ndarray) and x.size == 0: return np.zeros(x.shape, like.dtype.np)  # an empty value stays an array
    return n.t(0).cast(like.dtype)  # kiln's dtype: a bfloat16's numpy form is its uint16 bits
  return x.astype(like.dtype) if isinstance(x, np.ndarray) else n.t(0).cast(like.dtype)


def _where(n: OnnxNode) -> Value:
  c, a, b = n.ins[:3]
  if isinstance(c, np.ndarray) and isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return np.where(c, a, b)
  return n.t(0).where(n.t(1), n.t(2))


def _not(n: OnnxNode) -> Value:
  x = n.ins[0]
  return np.logical_not(x) if isinstance(x, np.ndarray) else n.t(0).logical_not()


def _expand(n: OnnxNode) -> Value:
  shape = tuple(int(s) for s in n.const(1, "shape").reshape(-1))
  x = n.ins[0]
  xs = x.shape if x is not None else ()
  nd = max(len(xs), len(shape))
  full = (1,) * (nd - len(xs)) + tuple(xs)
  shp = (1,) * (nd - len(shape)) + shape
  out = tuple(a if b == 1 else b for a, b in zip(full, shp))
  if isinstance(x, np.ndarray): return np.broadcast_to(x, out).copy()
  return n.t(0).reshape(full).expand(out)


def _gather(n: OnnxNode) -> Value:
  x, i = n.ins[0], n.ins[1]
  nd = x.ndim if x is not None else 0
  a = _norm(n.attr("axis", 0), nd, n)
  if x is not None and isinstance(i, np.ndarray) and isinstance(size := x.shape[a], int) and (bad := bad_index(i, size)) is not None:
    raise n.error(f"index {bad} {out_of_range(size)} (axis {a} of data {tuple(x.shape)})")  # as onnxruntime refuses it
  if isinstance(x, np.ndarray) and isinstance(i, np.ndarray):
    r = np.take(x, i, a)
    if isinstance(r, UOp):  # one symbolic element of a shape value: numpy hands back the UOp itself
      r0 = np.empty((), object)
      r0[()] = r
      return r0
    return np.asarray(r)  # a plain number (numpy's scalar for one element) stays a number array
  return n.t(0).gather(n.t(1), a, name=f"node {n.name} ({n.op})")


def _flatten(n: OnnxNode) -> Value:
  x = n.t(0) if not isinstance(n.ins[0], np.ndarray) else n.ins[0]
  a = n.attr("axis", 1)
  if not -x.ndim <= a <= x.ndim: raise n.error(f"axis {a} is out of range for rank {x.ndim}")
  a = a + x.ndim if a < 0 else a  # ONNX: a negative axis counts from the rank (-1: all but the last dim in the first)
  if isinstance(x, Tensor): return x.reshape(sym.mul(*x.shape[:a]), sym.mul(*x.shape[a:]))
  return x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), int(np.prod(x.shape[a:], dtype=np.int64)))


def _constant(n: OnnxNode, onnx: Any) -> Value:
  for k in ("value", "value_float", "value_floats", "value_int", "value_ints"):
    if k in n.attrs:
      v = n.attr(k)
      if k == "value": return n.tensor(k)
      return np.asarray(v, np.float32 if "float" in k else np.int64)
  raise n.error(f"attribute {sorted(n.attrs)[0] if n.attrs else '(none)'} is not supported (value, value_float(s), value_int(s))")


def _constant_of_shape(n: OnnxNode, onnx: Any) -> Value:
  raw = n.const(0, "shape").reshape(-1)
  val = n.tensor("value").reshape(-1) if "value" in n.attrs else np.zeros(1, np.float32)
  if raw.dtype == object:  # a shape with symbolic dims (torch.ones(T, T) for a dynamic T): a broadcast constant, nothing stored
    return Tensor.full(tuple(d if isinstance(d, UOp) else int(d) for d in raw), val[0].item(), val.dtype)
  return np.full(tuple(int(s) for s in raw), val[0], val.dtype)


def _range(n: OnnxNode) -> Value:
  s, e, d = (n.const(i, w) for i, w in enumerate(("start", "limit", "delta")))
  if e.dtype == object:  # a symbolic limit (torch.arange(T) for a dynamic T): the loop's own index, step 1 only
    lim = e.reshape(-1)[0]
    if d.item() != 1 or s.dtype.kind not in "iu": raise n.error("a symbolic limit needs an integer start and delta 1")
    return Tensor.arange(lim - int(s.item()), s.dtype) + int(s.item()) if s.item() else Tensor.arange(lim, s.dtype)
  return np.arange(s.item(), e.item(), d.item()).astype(s.dtype)


def _dropout(n: OnnxNode) -> Value | list[Value]:
  """Inference: the input itself, and (when asked for) a mask of all True. Training mode (is_test=0 before opset 7, a
  training_mode input from opset 12) would drop at random: refused, never run as the identity, unless its ratio is 0. A
  training_mode computed at run time is read back (specialise.py: a run with true is refused then)."""
  n.attr("seed"), n.attr("ratio")
  if n.opset < 7 and not n.attr("is_test", 0): raise n.error("is_test=0 (training mode) is not supported: kiln runs inference only")
  if len(n.ins) > 2 and n.ins[2] is not None:
    mode = n.const(2, "training_mode")
    if mode.size and bool(mode.reshape(-1)[0]):  # training: only a ratio of 0 (dropping nothing) is the identity
      ratio = n.opt_const(1, "ratio")
      if ratio is None or not ratio.size or float(ratio.reshape(-1)[0]) != 0:
        raise n.error("training_mode is true: kiln runs inference only (but for a ratio of 0, which drops nothing)")
  x = n.ins[0]
  if len(n.proto.output) < 2 or not n.proto.output[1]: return x  # type: ignore[return-value]
  if x is None: raise n.error("input 0 is missing")
  mask: Value = np.ones(x.shape, np.bool_) if isinstance(x, np.ndarray) else Tensor.full(x.shape, True, "bool")
  return [x, mask]  # type: ignore[list-item]


def _sum_mean(mean: bool) -> Callable[[OnnxNode], Value]:
  """Sum and Mean of any number of inputs, broadcast together (Mean: the sum over the count)."""
  def run(n: OnnxNode) -> Value:
    vals = [v for v in n.ins if v is not None]
    if not vals: raise n.error("needs at least one input")
    if all(isinstance(v, np.ndarray) for v in vals):
      arrs = [np.asarray(v) for v in vals]
      out = arrs[0]
      for v in arrs[1:]: out = out + v
      return (out / len(arrs)).astype(arrs[0].dtype) if mean else out.astype(arrs[0].dtype)
    ts = [n.t(i) for i, v in enumerate(n.ins) if v is not None]
    if any(t.dtype != ts[0].dtype for t in ts): raise n.error(f"inputs have different dtypes {sorted({t.dtype.name for t in ts})}")
    acc = ts[0]
    for t in ts[1:]: acc = acc + t
    return acc * (1.0 / len(ts)) if mean else acc
  return run


def _minmax(kind: str) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    vals = [v for v in n.ins if v is not None]
    arrs = [v for v in vals if isinstance(v, np.ndarray)]
    if len(arrs) == len(vals):
      out = arrs[0]
      for v in arrs[1:]: out = (np.maximum if kind == "maximum" else np.minimum)(out, v)
      return out
    t = n.t(0)
    for i in range(1, len(vals)): t = getattr(t, kind)(n.t(i))
    return t
  return run


def _spatial(n: OnnxNode, x: Tensor, kernel: list[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
  """strides, dilations and (before, after) pads of a conv or pool node, auto_pad resolved."""
  d = len(kernel)
  st, dl = list(n.attr("strides") or [1] * d), list(n.attr("dilations") or [1] * d)
  auto = n.attr("auto_pad", "NOTSET")
  if auto in ("NOTSET", "VALID"):
    p = list(n.attr("pads") or [0] * (2 * d)) if auto == "NOTSET" else [0] * (2 * d)
    return st, dl, list(zip(p[:d], p[d:]))
  if auto not in ("SAME_UPPER", "SAME_LOWER"): raise n.error(f"attribute auto_pad={auto!r} is not supported")
  pads = []
  for size, k, s_, q in zip(x.shape[2:], kernel, st, dl):
    total = max((-(-size // s_) - 1) * s_ + (k - 1) * q + 1 - size, 0)
    small = total // 2
    pads.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
  return st, dl, pads


def _conv(n: OnnxNode) -> Value:
  x, w = n.t(0), n.t(1)
  kernel = list(n.attr("kernel_shape") or w.shape[2:])
  if tuple(kernel) != w.shape[2:]: raise n.error(f"kernel_shape {kernel} differs from the weight's {w.shape[2:]}")
  st, dl, pads = _spatial(n, x, kernel)
  b = n.t(2) if len(n.ins) > 2 and n.ins[2] is not None else None
  return x.conv2d(w, b, st, pads, dl, int(n.attr("group", 1)))


def _pool(kind: str) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    if len(n.proto.output) > 1 and n.proto.output[1]: raise n.error("the Indices output is not supported")
    x = n.t(0)
    kernel = list(n.attr("kernel_shape") or [])
    if not kernel: raise n.error("attribute kernel_shape is required")
    n.attr("storage_order")  # it orders only the Indices output (onnx_ops_misc.py)
    st, dl, pads = _spatial(n, x, kernel)
    if any(p >= k for k, pair in zip(kernel, pads) for p in pair):  # a window of nothing but padding: no max, a mean of 0/0
      raise n.error(f"pads {[p for pair in zip(*pads) for p in pair]} must each be smaller than the kernel {kernel} (as onnxruntime requires)")
    include = bool(n.attr("count_include_pad", 0))
    if n.attr("ceil_mode", 0):
      if n.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"): raise n.error("ceil_mode=1 with auto_pad SAME_* is not supported")
      return _ceil_pool(n, x, kind, kernel, st, dl, pads, include)
    if kind == "max": return x.max_pool(kernel, st, pads, dl)
    return x.avg_pool(kernel, st, pads, include, dl)
  return run


def _ceil_pool(n: OnnxNode, x: Tensor, kind: str, kernel: list[int], st: list[int], dl: list[int], pads: list[tuple[int, int]],
               include: bool) -> Tensor:
  """ceil_mode=1 as onnxruntime computes it: the output rounds up, but a last window that would start in the end padding is
  dropped; the windows past the padded input read nothing (max: -inf; a mean counts only what it reads, or with
  count_include_pad the explicit pads too, never the extension)."""
  spatial = sym.static_shape("pool with ceil_mode", x.shape[2:])
  extra, counts = [], np.ones((), np.float64)
  for size, k, s_, q, (b, a) in zip(spatial, kernel, st, dl, pads):
    eff, span = (k - 1) * q + 1, size + b + a
    out = -(-(span - eff) // s_) + 1
    if (out - 1) * s_ >= size + b: out -= 1
    extra.append(max((out - 1) * s_ + eff - span, 0))
    pos = np.arange(out)[:, None] * s_ + np.arange(k)[None, :] * q - b  # each window's elements, in input coordinates
    counts = np.multiply.outer(counts, ((pos >= -b) & (pos < size + a)).sum(1))
  wide = [(b, a + e) for (b, a), e in zip(pads, extra)]
  if kind == "max": return x.max_pool(kernel, st, wide, dl)
  if not include: return x.avg_pool(kernel, st, wide, False, dl)
  total = x.avg_pool(kernel, st, wide, True, dl) * float(np.prod(kernel))  # the window sums
  return total / Tensor(counts.astype(np.float32))


def _global_pool(kind: str) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    x = n.t(0)
    if x.ndim < 4 or not sym.is_static(x.shape[2:]): return getattr(x, kind)(tuple(range(2, x.ndim)), True)
    # the spatial dims as one reduce axis: a map's rows are contiguous, so the codegen can vectorise the whole map
    # (a 8x8 map: one loop of 64 elements, not 8 loops of 8)
    flat = x.reshape(*x.shape[:2], -1)
    return getattr(flat, kind)(2, True).reshape(*x.shape[:2], *[1] * (x.ndim - 2))
  return run


def _batchnorm(n: OnnxNode) -> Value:
  if n.attr("training_mode", 0): raise n.error("attribute training_mode=1 is not supported (inference only)")
  if len(n.proto.output) > 1 and any(n.proto.output[1:]): raise n.error("the running mean/var outputs are not supported (inference only)")
  n.attr("momentum")
  x, eps = n.t(0), float(n.attr("epsilon", 1e-5))
  shape = (1, -1) + (1,) * (x.ndim - 2)
  vals = n.ins[1:5]
  if all(isinstance(v, np.ndarray) for v in vals):  # constant statistics fold into one multiply-add per channel
    sc, b, mu, var = (np.asarray(v, np.float64) for v in vals)  # type: ignore[arg-type]
    a = sc / np.sqrt(var + eps)
    return x * Tensor(a.astype(np.float32).reshape(shape)) + Tensor((b - mu * a).astype(np.float32).reshape(shape))
  sc_t, b_t, mu_t, var_t = (n.t(i).reshape(shape) for i in range(1, 5))
  return (x - mu_t) * (var_t + eps).rsqrt() * sc_t + b_t


# op -> (handler, its attributes); a handler taking `onnx` gets the module too
OPS: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {}


def _op(names: str, fn: Callable[..., Any], attrs: str = "") -> None:
  for name in names.split(): OPS[name] = (fn, frozenset(attrs.split()))


_op("Add", _binary(lambda a, b: a + b)); _op("Sub", _binary(lambda a, b: a - b)); _op("Mul", _binary(lambda a, b: a * b))
_op("Div", _div); _op("Pow", _pow)
_op("Equal", _binary(lambda a, b: np.equal(a, b) if isinstance(a, np.ndarray) else a.eq(b)))
_op("Less", _binary(lambda a, b: a < b)); _op("Greater", _binary(lambda a, b: a > b))
_op("LessOrEqual", _binary(lambda a, b: a <= b)); _op("GreaterOrEqual", _binary(lambda a, b: a >= b))
_op("And", _binary(lambda a, b: np.logical_and(a, b) if isinstance(a, np.ndarray) else a & b))
_op("Or", _binary(lambda a, b: np.logical_or(a, b) if isinstance(a, np.ndarray) else a | b))
_op("Not", _not); _op("Where", _where); _op("Max", _minmax("maximum")); _op("Min", _minmax("minimum"))
_op("Sum", _sum_mean(False)); _op("Mean", _sum_mean(True))
for _name, _meth in (("Sqrt", "sqrt"), ("Reciprocal", "reciprocal"), ("Exp", "exp"), ("Log", "log"), ("Erf", "erf"), ("Tanh", "tanh"),
                     ("Relu", "relu"), ("Sigmoid", "sigmoid"), ("Neg", "__neg__"), ("Abs", "abs")):
  _op(_name, _unary(_meth))
_op("Gelu", _gelu, "approximate")
_op("Softmax", _softmax(False), "axis"); _op("LogSoftmax", _softmax(True), "axis")
_op("LayerNormalization", _layernorm, "axis epsilon stash_type")
_op("ReduceMean", _reduce("mean", 18), "axes keepdims noop_with_empty_axes")
_op("ReduceMax", _reduce("max", 18), "axes keepdims noop_with_empty_axes")
_op("ReduceMin", _reduce("min", 18), "axes keepdims noop_with_empty_axes")
_op("ReduceProd", _reduce("prod", 18), "axes keepdims noop_with_empty_axes")
_op("ReduceSum", _reduce("sum", 13), "axes keepdims noop_with_empty_axes")
_op("MatMul", lambda n: n.t(0) @ n.t(1)); _op("Gemm", _gemm, "alpha beta transA transB")
_op("Reshape", _reshape, "allowzero"); _op("Transpose", _transpose, "perm"); _op("Unsqueeze", _unsqueeze, "axes")
_op("Squeeze", _squeeze, "axes"); _op("Concat", _concat, "axis"); _op("Slice", _slice, "starts ends axes")
_op("Split", _split, "axis split num_outputs"); _op("Cast", _cast, "to saturate"); _op("CastLike", _cast_like, "saturate"); _op("Expand", _expand)
_op("Gather", _gather, "axis"); _op("Flatten", _flatten, "axis"); _op("Identity", lambda n: n.ins[0])
_op("Dropout", _dropout, "seed ratio is_test"); _op("Constant", _constant, "value value_float value_floats value_int value_ints")
_op("ConstantOfShape", _constant_of_shape, "value"); _op("Range", _range)
_op("Shape", _shape, "start end")
_op("Conv", _conv, "auto_pad dilations group kernel_shape pads strides")
_op("MaxPool", _pool("max"), "auto_pad ceil_mode dilations kernel_shape pads storage_order strides")
_op("AveragePool", _pool("avg"), "auto_pad ceil_mode count_include_pad dilations kernel_shape pads strides")
_op("GlobalAveragePool", _global_pool("mean")); _op("GlobalMaxPool", _global_pool("max"))
_op("BatchNormalization", _batchnorm, "epsilon momentum training_mode")
WITH_ONNX = {"Cast", "Constant", "ConstantOfShape"}
for _name, _rule in sv.RULES.items():  # an op with a shape-value rule runs it when an input holds a Shape's symbolic dims
  if _rule.run is not None and _name in OPS: OPS[_name] = ((lambda fn: lambda n, *a: sv.run_rule(n, fn, *a))(OPS[_name][0]), OPS[_name][1])
