"""ONNX models on kiln: `load(path_or_model, device="CPU", dims=None) -> Model`.

The model is checked with onnx.checker first (a model is untrusted input: anything malformed is an ONNXError, never a
crash). Initializers, Constant and every node whose inputs are all constants (Shape of a static shape, the shape
arithmetic feeding Reshape/Expand/Slice, ConstantOfShape, Range) are folded with numpy at load time; every other node
becomes Tensor ops, and the outputs compile into one fused ExecutionPlan. An operator or attribute kiln does not
support is refused at load time with the node, the op and the attribute named. Needs the `onnx` extra
(`pip install "kiln-graph[onnx]"`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kiln.graph.lazy import GraphError, ONNXError
from kiln.graph.schedule import Compiled
from kiln.graph.tensor import Tensor, compile

Value = Tensor | np.ndarray


def _onnx() -> Any:
  try:
    import onnx
  except ImportError as e:
    raise ONNXError('loading ONNX models needs the onnx package: pip install "kiln-graph[onnx]"') from e
  return onnx


class _Node:
  """One ONNX node while it is converted: its inputs (None for an omitted optional one), attributes, and opset."""
  def __init__(self, proto: Any, env: dict[str, Value], opset: int, onnx: Any):
    self.proto, self.op, self.name, self.opset = proto, proto.op_type, proto.name or f"<{proto.op_type}>", opset
    self.ins: list[Value | None] = []
    for n in proto.input:
      if n == "": self.ins.append(None)
      elif n not in env: raise ONNXError(f"node {self.name} ({self.op}): input {n!r} is not produced by any earlier node, input or initializer")
      else: self.ins.append(env[n])
    self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proto.attribute}
    self.used_attrs: set[str] = set()

  def attr(self, name: str, default: Any = None) -> Any:
    self.used_attrs.add(name)
    v = self.attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v

  def const(self, i: int, what: str) -> np.ndarray:
    v = self.ins[i] if i < len(self.ins) else None
    if v is None: raise self.error(f"input {i} ({what}) is missing")
    if isinstance(v, Tensor): raise self.error(f"input {i} ({what}) must be a constant known at load time (kiln has no data-dependent shapes)")
    return v

  def opt_const(self, i: int, what: str) -> np.ndarray | None:
    return None if i >= len(self.ins) or self.ins[i] is None else self.const(i, what)

  def t(self, i: int) -> Tensor:
    v = self.ins[i] if i < len(self.ins) else None
    if v is None: raise self.error(f"input {i} is missing")
    return v if isinstance(v, Tensor) else Tensor(np.asarray(v))

  def error(self, msg: str) -> ONNXError: return ONNXError(f"node {self.name} ({self.op}, opset {self.opset}): {msg}")


def _axes_of(n: _Node, attr_until: int, input_index: int = 1) -> list[int] | None:
  """axes as an attribute (opsets before attr_until) or as an input (from it on)."""
  if n.opset < attr_until: return n.attr("axes")
  a = n.opt_const(input_index, "axes")
  return None if a is None else [int(x) for x in a.reshape(-1)]


def _norm(a: int, nd: int, n: _Node) -> int:
  if not -nd <= a < nd: raise n.error(f"axis {a} is out of range for rank {nd}")
  return a % nd


# ---- numpy folding of all-constant nodes (shape arithmetic) ----
_NP_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
  "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Equal": np.equal, "Less": np.less, "Greater": np.greater,
  "And": np.logical_and, "Or": np.logical_or, "Max": np.maximum, "Min": np.minimum, "LessOrEqual": np.less_equal, "GreaterOrEqual": np.greater_equal,
}


def _np_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  if a.dtype.kind in "iu": return np.trunc(a / b).astype(a.dtype)  # ONNX integer Div truncates
  return (a / b).astype(a.dtype)


# ---- the operators ----
def _binary(f: Callable[[Any, Any], Any]) -> Callable[[_Node], Value]:
  def run(n: _Node) -> Value:
    a, b = n.ins[0], n.ins[1]
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return np.asarray(f(a, b))
    ta, tb = n.t(0), n.t(1)
    if ta.dtype != tb.dtype: raise n.error(f"operands have different dtypes {ta.dtype.name} and {tb.dtype.name}")
    return f(ta, tb)
  return run


def _div(n: _Node) -> Value:
  a, b = n.ins[0], n.ins[1]
  if isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return _np_div(a, b)
  ta = n.t(0)
  if not ta.dtype.is_float: raise n.error(f"integer Div on data computed at run time is not supported ({ta.dtype.name})")
  return ta / n.t(1)


def _pow(n: _Node) -> Value:
  a, b = n.ins[0], n.ins[1]
  if isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return np.power(a, b).astype(a.dtype)
  if isinstance(b, np.ndarray) and b.size == 1: return n.t(0).pow(float(b.reshape(-1)[0]))
  return n.t(0).pow(n.t(1).cast(n.t(0).dtype))


def _unary(name: str) -> Callable[[_Node], Value]:
  return lambda n: getattr(n.t(0), name)()


def _gelu(n: _Node) -> Value:
  x = n.t(0)
  approx = n.attr("approximate", "none")
  if approx == "none": return x.gelu()
  if approx == "tanh": return x * 0.5 * (((x + x * x * x * 0.044715) * 0.7978845608028654).tanh() + 1.0)
  raise n.error(f"attribute approximate={approx!r} is not supported (none, tanh)")


def _softmax(log: bool) -> Callable[[_Node], Value]:
  def run(n: _Node) -> Value:
    x = n.t(0)
    if n.opset >= 13:
      a = _norm(n.attr("axis", -1), x.ndim, n)
      return x.log_softmax(a) if log else x.softmax(a)
    a = _norm(n.attr("axis", 1), x.ndim, n)  # opset < 13: over the input coerced to 2-d at axis
    flat = x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), -1)
    return (flat.log_softmax(-1) if log else flat.softmax(-1)).reshape(x.shape)
  return run


def _layernorm(n: _Node) -> Value:
  if len(n.proto.output) > 1 and any(n.proto.output[1:]): raise n.error("the Mean and InvStdDev outputs are not supported")
  n.attr("stash_type")
  x = n.t(0)
  a = _norm(n.attr("axis", -1), x.ndim, n)
  w = n.t(1) if len(n.ins) > 1 and n.ins[1] is not None else None
  b = n.t(2) if len(n.ins) > 2 and n.ins[2] is not None else None
  return x.layernorm(w, b, tuple(range(a, x.ndim)), n.attr("epsilon", 1e-5))


def _reduce(kind: str, attr_until: int) -> Callable[[_Node], Value]:
  def run(n: _Node) -> Value:
    x = n.t(0)
    axes = _axes_of(n, attr_until)
    keep = bool(n.attr("keepdims", 1))
    if not axes:
      if n.attr("noop_with_empty_axes", 0): return x
      axes = list(range(x.ndim))
    ax = tuple(_norm(a, x.ndim, n) for a in axes)
    return getattr(x, kind)(ax, keep)
  return run


def _gemm(n: _Node) -> Value:
  a, b = n.t(0), n.t(1)
  if n.attr("transA", 0): a = a.T
  if n.attr("transB", 0): b = b.T
  y = a @ b
  if (alpha := float(n.attr("alpha", 1.0))) != 1.0: y = y * alpha
  if len(n.ins) > 2 and n.ins[2] is not None:
    c = n.t(2)
    y = y + (c * float(n.attr("beta", 1.0)) if float(n.attr("beta", 1.0)) != 1.0 else c)
  return y


def _reshape_shape(n: _Node, in_shape: tuple[int, ...]) -> tuple[int, ...]:
  shape = [int(s) for s in n.const(1, "shape").reshape(-1)]
  if n.attr("allowzero", 0) and 0 in shape: raise n.error("allowzero=1 with a 0 in the shape (an empty tensor) is not supported")
  out = [in_shape[i] if s == 0 and i < len(in_shape) else s for i, s in enumerate(shape)]
  if out.count(-1) == 1:
    rest = int(np.prod([s for s in out if s != -1], dtype=np.int64))
    out[out.index(-1)] = int(np.prod(in_shape, dtype=np.int64)) // max(rest, 1)
  return tuple(out)


def _reshape(n: _Node) -> Value:
  x = n.ins[0]
  if isinstance(x, np.ndarray): return x.reshape(_reshape_shape(n, x.shape))
  return n.t(0).reshape(_reshape_shape(n, n.t(0).shape))


def _transpose(n: _Node) -> Value:
  x = n.ins[0]
  nd = x.ndim if x is not None else 0
  perm = n.attr("perm") or list(reversed(range(nd)))
  return np.transpose(x, perm) if isinstance(x, np.ndarray) else n.t(0).permute(perm)


def _unsqueeze(n: _Node) -> Value:
  axes = _axes_of(n, 13)
  if axes is None: raise n.error("axes are required")
  x = n.ins[0]
  nd = (x.ndim if x is not None else 0) + len(axes)
  ax = sorted(_norm(a, nd, n) for a in axes)
  if isinstance(x, np.ndarray): return np.expand_dims(x, tuple(ax))
  t = n.t(0)
  for a in ax: t = t.unsqueeze(a)
  return t


def _squeeze(n: _Node) -> Value:
  axes = _axes_of(n, 13)
  x = n.ins[0]
  if isinstance(x, np.ndarray): return np.squeeze(x, tuple(axes) if axes else None)
  return n.t(0).squeeze(tuple(axes) if axes else None)


def _concat(n: _Node) -> Value:
  a = n.attr("axis")
  if a is None: raise n.error("attribute axis is required")
  vals = [v for v in n.ins if v is not None]
  if all(isinstance(v, np.ndarray) for v in vals): return np.concatenate([np.asarray(v) for v in vals], a)
  return Tensor.cat([v if isinstance(v, Tensor) else Tensor(v) for v in vals], a)


def _slice(n: _Node) -> Value:
  if n.opset < 10: starts, ends, axes, steps = n.attr("starts"), n.attr("ends"), n.attr("axes"), None
  else:
    starts, ends = [int(v) for v in n.const(1, "starts")], [int(v) for v in n.const(2, "ends")]
    a, s = n.opt_const(3, "axes"), n.opt_const(4, "steps")
    axes, steps = (None if a is None else [int(v) for v in a]), (None if s is None else [int(v) for v in s])
  x = n.ins[0]
  nd = x.ndim if x is not None else 0
  axes = list(range(len(starts))) if axes is None else [_norm(a, nd, n) for a in axes]
  steps = steps or [1] * len(axes)
  if isinstance(x, np.ndarray):
    sl = [slice(None)] * nd
    for a, b, e, st in zip(axes, starts, ends, steps): sl[a] = slice(b, e, st)
    return x[tuple(sl)]
  return n.t(0).slice(starts, ends, axes, steps)


def _split(n: _Node) -> list[Value]:
  x = n.t(0)
  a = _norm(n.attr("axis", 0), x.ndim, n)
  raw = n.opt_const(1, "split") if n.opset >= 13 else n.attr("split")
  sizes: list[int] | None = None if raw is None else [int(v) for v in raw]
  nout = len(n.proto.output)
  if n.opset >= 18: n.attr("num_outputs")
  if sizes is None or len(sizes) == 0:
    d = x.shape[a]
    k = -(-d // nout)
    sizes = [k] * (d // k) + ([d % k] if d % k else [])
    if len(sizes) != nout: raise n.error(f"cannot split axis {a} of {x.shape} into {nout} outputs")
  return list(x.split([int(s) for s in sizes], a))


def _cast(n: _Node, onnx: Any) -> Value:
  to = onnx.helper.tensor_dtype_to_np_dtype(n.attr("to"))
  x = n.ins[0]
  if isinstance(x, np.ndarray): return x.astype(to)
  return n.t(0).cast(to)


def _where(n: _Node) -> Value:
  c, a, b = n.ins[:3]
  if isinstance(c, np.ndarray) and isinstance(a, np.ndarray) and isinstance(b, np.ndarray): return np.where(c, a, b)
  return n.t(0).where(n.t(1), n.t(2))


def _not(n: _Node) -> Value:
  x = n.ins[0]
  return np.logical_not(x) if isinstance(x, np.ndarray) else n.t(0).logical_not()


def _expand(n: _Node) -> Value:
  shape = tuple(int(s) for s in n.const(1, "shape").reshape(-1))
  x = n.ins[0]
  xs = x.shape if x is not None else ()
  nd = max(len(xs), len(shape))
  full = (1,) * (nd - len(xs)) + tuple(xs)
  shp = (1,) * (nd - len(shape)) + shape
  out = tuple(a if b == 1 else b for a, b in zip(full, shp))
  if isinstance(x, np.ndarray): return np.broadcast_to(x, out).copy()
  return n.t(0).reshape(full).expand(out)


def _gather(n: _Node) -> Value:
  x, i = n.ins[0], n.ins[1]
  nd = x.ndim if x is not None else 0
  a = _norm(n.attr("axis", 0), nd, n)
  if isinstance(x, np.ndarray) and isinstance(i, np.ndarray): return np.take(x, i, a)
  return n.t(0).gather(n.t(1), a)


def _flatten(n: _Node) -> Value:
  x = n.t(0) if not isinstance(n.ins[0], np.ndarray) else n.ins[0]
  a = n.attr("axis", 1)
  if not -x.ndim <= a <= x.ndim: raise n.error(f"axis {a} is out of range for rank {x.ndim}")
  a = a % (x.ndim + 1) if a < 0 else a
  return x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), int(np.prod(x.shape[a:], dtype=np.int64)))


def _constant(n: _Node, onnx: Any) -> Value:
  for k in ("value", "value_float", "value_floats", "value_int", "value_ints"):
    if k in n.attrs:
      v = n.attr(k)
      if k == "value": return onnx.numpy_helper.to_array(v).copy()
      return np.asarray(v, np.float32 if "float" in k else np.int64)
  raise n.error(f"attribute {sorted(n.attrs)[0] if n.attrs else '(none)'} is not supported (value, value_float(s), value_int(s))")


def _constant_of_shape(n: _Node, onnx: Any) -> Value:
  shape = tuple(int(s) for s in n.const(0, "shape").reshape(-1))
  v = n.attr("value")
  val = onnx.numpy_helper.to_array(v).reshape(-1) if v is not None else np.zeros(1, np.float32)
  return np.full(shape, val[0], val.dtype)


def _range(n: _Node) -> Value:
  s, e, d = (n.const(i, w) for i, w in enumerate(("start", "limit", "delta")))
  return np.arange(s.item(), e.item(), d.item()).astype(s.dtype)


def _dropout(n: _Node) -> Value:
  if len(n.proto.output) > 1 and n.proto.output[1]: raise n.error("the mask output is not supported (inference only)")
  n.attr("seed")
  return n.ins[0]  # type: ignore[return-value]


def _minmax(kind: str) -> Callable[[_Node], Value]:
  def run(n: _Node) -> Value:
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


def _spatial(n: _Node, x: Tensor, kernel: list[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
  """strides, dilations and (before, after) pads of a conv or pool node, auto_pad resolved."""
  d = len(kernel)
  st, dl = list(n.attr("strides") or [1] * d), list(n.attr("dilations") or [1] * d)
  if n.attr("ceil_mode", 0): raise n.error("attribute ceil_mode=1 is not supported")
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


def _conv(n: _Node) -> Value:
  x, w = n.t(0), n.t(1)
  kernel = list(n.attr("kernel_shape") or w.shape[2:])
  if tuple(kernel) != w.shape[2:]: raise n.error(f"kernel_shape {kernel} differs from the weight's {w.shape[2:]}")
  st, dl, pads = _spatial(n, x, kernel)
  b = n.t(2) if len(n.ins) > 2 and n.ins[2] is not None else None
  return x.conv2d(w, b, st, pads, dl, int(n.attr("group", 1)))


def _pool(kind: str) -> Callable[[_Node], Value]:
  def run(n: _Node) -> Value:
    if len(n.proto.output) > 1 and n.proto.output[1]: raise n.error("the Indices output is not supported")
    x = n.t(0)
    kernel = list(n.attr("kernel_shape") or [])
    if not kernel: raise n.error("attribute kernel_shape is required")
    if n.attr("storage_order", 0): raise n.error("attribute storage_order=1 is not supported")
    st, dl, pads = _spatial(n, x, kernel)
    if kind == "max": return x.max_pool(kernel, st, pads, dl)
    return x.avg_pool(kernel, st, pads, bool(n.attr("count_include_pad", 0)), dl)
  return run


def _global_pool(kind: str) -> Callable[[_Node], Value]:
  def run(n: _Node) -> Value:
    x = n.t(0)
    return getattr(x, kind)(tuple(range(2, x.ndim)), True)
  return run


def _batchnorm(n: _Node) -> Value:
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
_OPS: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {}


def _op(names: str, fn: Callable[..., Any], attrs: str = "") -> None:
  for name in names.split(): _OPS[name] = (fn, frozenset(attrs.split()))


_op("Add", _binary(lambda a, b: a + b)); _op("Sub", _binary(lambda a, b: a - b)); _op("Mul", _binary(lambda a, b: a * b))
_op("Div", _div); _op("Pow", _pow)
_op("Equal", _binary(lambda a, b: np.equal(a, b) if isinstance(a, np.ndarray) else a.eq(b)))
_op("Less", _binary(lambda a, b: a < b)); _op("Greater", _binary(lambda a, b: a > b))
_op("LessOrEqual", _binary(lambda a, b: a <= b)); _op("GreaterOrEqual", _binary(lambda a, b: a >= b))
_op("And", _binary(lambda a, b: np.logical_and(a, b) if isinstance(a, np.ndarray) else a & b))
_op("Or", _binary(lambda a, b: np.logical_or(a, b) if isinstance(a, np.ndarray) else a | b))
_op("Not", _not); _op("Where", _where); _op("Max", _minmax("maximum")); _op("Min", _minmax("minimum"))
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
_op("Split", _split, "axis split num_outputs"); _op("Cast", _cast, "to saturate"); _op("Expand", _expand)
_op("Gather", _gather, "axis"); _op("Flatten", _flatten, "axis"); _op("Identity", lambda n: n.ins[0])
_op("Dropout", _dropout, "seed"); _op("Constant", _constant, "value value_float value_floats value_int value_ints")
_op("ConstantOfShape", _constant_of_shape, "value"); _op("Range", _range)
_op("Shape", lambda n: np.asarray(n.ins[0].shape if n.ins[0] is not None else (), np.int64)[n.attr("start", 0):n.attr("end")], "start end")
_op("Conv", _conv, "auto_pad dilations group kernel_shape pads strides")
_op("MaxPool", _pool("max"), "auto_pad ceil_mode dilations kernel_shape pads storage_order strides")
_op("AveragePool", _pool("avg"), "auto_pad ceil_mode count_include_pad dilations kernel_shape pads strides")
_op("GlobalAveragePool", _global_pool("mean")); _op("GlobalMaxPool", _global_pool("max"))
_op("BatchNormalization", _batchnorm, "epsilon momentum training_mode")
_WITH_ONNX = {"Cast", "Constant", "ConstantOfShape"}


# ---- initializers stored as external data: mapped, never read in ----
_EXTERNAL_KEYS = {"location", "offset", "length", "checksum", "basepath"}


def _external(init: Any, base: str | None, onnx: Any) -> np.ndarray:
  """An initializer whose bytes live in a file beside the model, as a read-only numpy.memmap of exactly its region (no
  read until a kernel touches a page). The model is untrusted: the location must stay inside the model's directory, and
  offset and length must be integers that fit the file and match the tensor's dims and dtype."""
  where = f"initializer {init.name!r} (external data)"
  if base is None: raise ONNXError(f"{where}: external data needs the model's path (load it from a file, not bytes or a ModelProto)")
  info: dict[str, str] = {}
  for e in init.external_data:
    if e.key not in _EXTERNAL_KEYS: raise ONNXError(f"{where}: unknown external_data key {e.key!r}")
    info[e.key] = e.value
  loc = info.get("location", "")
  if not loc or os.path.isabs(loc) or ".." in loc.replace("\\", "/").split("/"):
    raise ONNXError(f"{where}: location {loc!r} must be a relative path inside the model's directory")
  path = os.path.realpath(os.path.join(base, loc))
  if os.path.commonpath([path, os.path.realpath(base)]) != os.path.realpath(base):
    raise ONNXError(f"{where}: location {loc!r} leaves the model's directory")
  if not os.path.isfile(path): raise ONNXError(f"{where}: data file {loc!r} does not exist")
  try: dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
  except Exception as e: raise ONNXError(f"{where}: element type {init.data_type} is not supported") from e
  if dt.kind not in "biuf" or init.data_type == onnx.TensorProto.BFLOAT16: raise ONNXError(f"{where}: element type {dt} is not supported")
  dims = [int(d) for d in init.dims]
  if any(d < 0 for d in dims): raise ONNXError(f"{where}: negative dim in {dims}")
  need = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
  def field(key: str, default: int | None) -> int | None:
    if key not in info: return default
    try: v = int(info[key])
    except ValueError: raise ONNXError(f"{where}: {key} {info[key]!r} is not an integer") from None
    if v < 0: raise ONNXError(f"{where}: {key} {v} is negative")
    return v
  offset, length = field("offset", 0), field("length", None)
  assert offset is not None
  if length is not None and length != need:
    raise ONNXError(f"{where}: length {length} bytes, but dims {dims} of {dt} take {need}")
  size = os.path.getsize(path)
  if offset + need > size:
    raise ONNXError(f"{where}: bytes {offset}..{offset + need} of {loc!r} are needed, the file has {size} (truncated or a bad offset)")
  if need == 0: return np.zeros(dims, dt)
  return np.memmap(path, dtype=dt.newbyteorder("<"), mode="r", offset=offset, shape=tuple(dims))


class Model:
  """A loaded ONNX model: `run(feeds) -> {output name: array}`, `plan` (its ExecutionPlan, None when every output is a
  constant), `summary()`."""

  def __init__(self, inputs: list[tuple[str, tuple[int, ...], np.dtype]], outputs: list[tuple[str, Value]], compiled: Compiled | None,
               nodes: int, opset: int):
    self.inputs, self.output_names, self.compiled, self.nodes, self.opset = inputs, [n for n, _ in outputs], compiled, nodes, opset
    self._consts = {n: v for n, v in outputs if isinstance(v, np.ndarray)}
    self._computed = [n for n, v in outputs if isinstance(v, Tensor)]

  @property
  def plan(self) -> Any: return None if self.compiled is None else self.compiled.plan

  def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return self._run(feeds, False)[0]

  def run_profiled(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
    """run, kernel by kernel with each kernel timed: (outputs, the plan's Profile; None when no kernel runs)."""
    return self._run(feeds, True)

  def _run(self, feeds: Mapping[str, np.ndarray], profile: bool) -> tuple[dict[str, np.ndarray], Any]:
    for name, shape, dt in self.inputs:
      if name not in feeds: raise ONNXError(f"model input {name!r} (shape {shape}, {dt}) was not fed")
    prof = None
    try:
      got: list[np.ndarray] = []
      if self.compiled is None: pass
      elif profile: got, prof = self.compiled.run_profiled(feeds)
      else: got = self.compiled.run(feeds)
    except GraphError as e: raise ONNXError(str(e)) from e
    out = dict(zip(self._computed, got))
    return {n: out[n] if n in out else self._consts[n].copy() for n in self.output_names}, prof

  def summary(self) -> str:
    lines = [f"ONNX model: opset {self.opset}, {self.nodes} nodes; inputs " +
             ", ".join(f"{n} {s} {dt}" for n, s, dt in self.inputs) + "; outputs " + ", ".join(self.output_names)]
    p = self.plan
    if p is None: lines.append("  every output is a constant: no kernels")
    else:
      lines.append(f"  {len(p.kernels)} kernels, {len(p.buffers)} buffers, peak buffer memory {p.memory_bytes / 1e6:.3f} MB "
                   f"({p.memory_bytes_without_reuse / 1e6:.3f} MB without reuse)")
      for k in p.kernels: lines.append(f"    {k.name}")
    return "\n".join(lines)

  __str__ = summary


def _check(onnx: Any, m: Any) -> None:
  """onnx.checker on the model, its external initializers' file entries hidden meanwhile: the checker would resolve them
  against the working directory; _external checks them against the model's own directory instead."""
  hidden = []
  for init in m.graph.initializer:
    if init.data_location == onnx.TensorProto.EXTERNAL:
      hidden.append((init, [(e.key, e.value) for e in init.external_data], list(init.dims)))
      del init.external_data[:], init.dims[:]
      init.data_location = onnx.TensorProto.DEFAULT
      init.raw_data = b"\0" * 16  # a scalar stands in (the checker wants a value field of the declared size; no copy of the file)
  try: onnx.checker.check_model(m)
  finally:
    for init, entries, dims in hidden:
      init.data_location = onnx.TensorProto.EXTERNAL
      init.ClearField("raw_data")
      init.dims.extend(dims)
      for k, v in entries: init.external_data.add(key=k, value=v)


def load(model: Any, device: str = "CPU", dims: Mapping[str, int] | None = None) -> Model:
  """Load an ONNX model (a path, bytes or a ModelProto), check it, convert it to a Tensor graph and compile it.

  dims gives the value of every named (symbolic) input dim, e.g. {"batch": 8, "seq": 128}: kiln compiles for those sizes."""
  onnx = _onnx()
  base: str | None = None
  try:
    if isinstance(model, (str, os.PathLike)):  # external data is mapped below, never read in here
      m = onnx.load(os.fspath(model), load_external_data=False)
      base = os.path.dirname(os.path.abspath(os.fspath(model)))
    elif isinstance(model, (bytes, bytearray)): m = onnx.load_from_string(bytes(model))
    elif isinstance(model, onnx.ModelProto): m = model
    else: raise ONNXError(f"load takes a path, bytes or an onnx.ModelProto, got {type(model).__name__}")
    _check(onnx, m)
  except ONNXError: raise
  except Exception as e:  # a model is untrusted input: protobuf decode errors, checker failures, missing files
    raise ONNXError(f"not a valid ONNX model: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
  opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
  g = m.graph
  env: dict[str, Value] = {}
  for init in g.initializer:
    if init.data_location == onnx.TensorProto.EXTERNAL:
      env[init.name] = _external(init, base, onnx)
      continue
    try: env[init.name] = onnx.numpy_helper.to_array(init).copy()
    except Exception as e: raise ONNXError(f"initializer {init.name!r} cannot be read: {e}") from e
  inputs = []
  for vi in g.input:
    if vi.name in env: continue
    tt = vi.type.tensor_type
    try: dt = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
    except Exception as e: raise ONNXError(f"input {vi.name!r} has an unsupported element type {tt.elem_type}") from e
    shape = []
    for i, d in enumerate(tt.shape.dim):
      if d.HasField("dim_value"): shape.append(int(d.dim_value))
      elif d.dim_param and dims and d.dim_param in dims: shape.append(int(dims[d.dim_param]))
      else: raise ONNXError(f"input {vi.name!r} dim {i} is symbolic ({d.dim_param or '?'}): give its size with dims={{{d.dim_param or 'name'!r}: n}}")
    try: env[vi.name] = Tensor.input(vi.name, tuple(shape), dt)
    except GraphError as e: raise ONNXError(f"input {vi.name!r}: {e}") from e
    inputs.append((vi.name, tuple(shape), np.dtype(dt)))
  for proto in g.node:
    label = f"node {proto.name or '<' + proto.op_type + '>'} ({proto.op_type})"
    if proto.domain not in ("", "ai.onnx"): raise ONNXError(f"{label}: domain {proto.domain!r} is not supported")
    if proto.op_type not in _OPS: raise ONNXError(f"{label}: operator {proto.op_type} is not supported")
    fn, allowed = _OPS[proto.op_type]
    n = _Node(proto, env, opset, onnx)
    for a in n.attrs:
      if a not in allowed: raise n.error(f"attribute {a} is not supported")
    try: out = fn(n, onnx) if proto.op_type in _WITH_ONNX else fn(n)
    except ONNXError: raise
    except (GraphError, ValueError, TypeError, IndexError) as e: raise n.error(f"{type(e).__name__}: {e}") from e
    outs = [np.asarray(o) if isinstance(o, np.generic) else o for o in (out if isinstance(out, list) else [out])]  # numpy scalars fold too
    names = [o for o in proto.output if o]
    if len(outs) < len(names): raise n.error(f"produces {len(outs)} outputs, the model uses {len(names)}")
    for name, v in zip(proto.output, outs):
      if name: env[name] = v
  outputs = []
  for vo in g.output:
    if vo.name not in env: raise ONNXError(f"graph output {vo.name!r} is produced by no node")
    outputs.append((vo.name, env[vo.name]))
  tensors = [v for _, v in outputs if isinstance(v, Tensor)]
  try: compiled = compile(tensors, device) if tensors else None
  except GraphError as e: raise ONNXError(f"compiling the model failed: {e}") from e
  return Model(inputs, outputs, compiled, len(g.node), opset)
