"""Shape values: what ONNX Shape gives for a tensor with a symbolic dim, an object numpy array of dims (ints and the
polynomial UOps of kiln.graph.dims). torch's exports do arithmetic on them (batch * heads, past + seq, the -1 tests of a
legacy `expand(batch, -1, -1)`, a mask of (batch, 1, 1, seq)); this module is where that arithmetic lives.

| a symbolic shape value reaching                     | becomes                                                           |
|-----------------------------------------------------|-------------------------------------------------------------------|
| an op of RULES, at an input it names, when `keeps`  | a shape value again (its handler's, or the rule's `run`), exactly |
| an elementwise op whose result is no dim / no known bool | a refusal naming the op and the dims (a truncated quotient, an undecided comparison) |
| any other op or input (Cast to float, Add into data) | data: a Tensor of the dims' run-time values (`as_data`)           |

ReduceProd and ReduceSum over a shape value with known axes fold by the same rules (ReduceProd of a NonZero's Shape is its
element count, a dim: the Reshape to it stays one compile).

Add, Sub and Mul give polynomials in the dims (past + seq, seq - 1), Div an exact quotient, or a truncated one that is
still a polynomial for every value ((2*batch + 1) / 2 is batch: torch.chunk's split size). A comparison is decided from
the variables' bounds (a symbolic dim is >= its lower bound, so `seq == -1` is False), never with UOp's operators (which
build UOps); where the bounds cannot decide, it is refused by name. A Slice on a symbolic axis or to a symbolic bound is
a view whose start and length are dims (`slice_dims`, dims.span); one whose length Python's clamping would make depend
on the size (min(5, seq)) is refused.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.lazy import GraphError
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes
from kiln.ir.kernels import Dim
from kiln.ir.uop import UOp

if TYPE_CHECKING:
  from kiln.graph.onnx_ops import OnnxNode, Value


class Refused(ValueError):
  """A shape-value operation whose result kiln cannot hold exactly (a ValueError: the converter names the node whatever catches it)."""


def is_shape_value(v: Any) -> bool: return isinstance(v, np.ndarray) and v.dtype == object
def symbolic(v: Any) -> bool: return is_shape_value(v) and any(isinstance(d, UOp) for d in v.reshape(-1))
def fmt_value(v: np.ndarray) -> str: return ", ".join(sym.fmt(d) for d in v.reshape(-1))


def dim(x: Any) -> Dim:
  """An element of a shape value as a Dim (numpy's ints as Python ints)."""
  if isinstance(x, UOp): return x
  if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)): return int(x)
  raise Refused(f"{x!r} is not an integer dim")


def pack(out: np.ndarray) -> np.ndarray:
  """A shape value whose dims all turned out fixed is a plain int64 array (it folds as any constant)."""
  return out if any(isinstance(d, UOp) for d in out.reshape(-1)) else out.astype(np.int64)


def bounds(d: Dim) -> tuple[int, int]:
  """The smallest and largest value d takes (from the variables' bounds, dims.bounds)."""
  return sym.bounds(d)


def fixed(d: Dim, k: int) -> bool:
  """Whether d is the fixed size k (a symbolic dim never is; no UOp == is evaluated)."""
  return isinstance(d, int) and d == k


def same(a: Dim, b: Dim) -> bool:
  """Whether a and b are the same dim for every value of the variables (as polynomials, never UOp's ==)."""
  return sym.same(a, b)


# ---- the elementwise rules on two dims: a dim, a bool, or Refused ----
def _mul(a: Dim, b: Dim) -> Dim:
  if (isinstance(a, int) and a < 0) or (isinstance(b, int) and b < 0):
    raise Refused(f"{sym.fmt(a)} * {sym.fmt(b)} is a negative multiple of a symbolic dim, not a dim")
  return sym.mul(a, b)


def _div(a: Dim, b: Dim) -> Dim:
  if isinstance(a, int) and isinstance(b, int):
    if b == 0: raise Refused(f"{a} / 0 divides by zero")
    q = abs(a) // abs(b)  # ONNX's integer Div truncates toward zero
    return q if (a < 0) == (b < 0) else -q
  if isinstance(b, int) and b <= 0: raise Refused(f"{sym.fmt(a)} / {b} is not a dim (a divisor of a symbolic dim must be >= 1)")
  if (exact := sym.div(a, b)) is not None: return exact
  if isinstance(b, int) and sym.dmin(a) >= 0 and (floor := _floor_div(a, b)) is not None: return floor  # a >= 0: truncation is floor
  raise Refused(f"{sym.fmt(a)} / {sym.fmt(b)} is not a whole number for every value of the dims (a truncated quotient is no dim)")


def _floor_div(a: Dim, b: int) -> Dim | None:
  """a // b for an int b >= 1 that divides every coefficient of a but the constant k: (Q*b + k) // b is Q + k // b for every
  value of the dims (torch.chunk's (2*batch + 1) // 2, RAFT's two images split off one batch), else None."""
  t = sym.terms(a)
  if any(c % b for vs, c in t.items() if vs): return None
  return sym.from_terms({vs: c // b for vs, c in t.items() if c // b})


def _sum(a: Dim, b: Dim, sign: int) -> Dim:
  """a + b or a - b: a polynomial in the dims (past + seq), kept canonical by dims.add/sub."""
  return sym.add(a, b) if sign > 0 else sym.sub(a, b)


def _compare(name: str, a: Dim, b: Dim) -> bool:
  """a (name) b, decided for every value of the variables from their bounds."""
  (alo, ahi), (blo, bhi) = bounds(a), bounds(b)
  if name == "Equal":
    if same(a, b): return True
    if ahi < blo or bhi < alo: return False
  elif name in ("Less", "GreaterOrEqual"):
    if ahi < blo: return name == "Less"
    if alo >= bhi: return name != "Less"
  elif ahi <= blo: return name == "LessOrEqual"  # LessOrEqual, Greater
  elif alo > bhi: return name != "LessOrEqual"
  if name != "Equal" and same(a, b): return name in ("LessOrEqual", "GreaterOrEqual")
  raise Refused(f"{name}({sym.fmt(a)}, {sym.fmt(b)}) depends on the sizes fed (bounds [{alo}, {ahi}] and [{blo}, {bhi}]): kiln must know it at load")


def _extreme(name: str, a: Dim, b: Dim) -> Dim:
  (alo, ahi), (blo, bhi) = bounds(a), bounds(b)
  if same(a, b): return a
  if alo >= bhi: return a if name == "Max" else b
  if blo >= ahi: return b if name == "Max" else a
  raise Refused(f"{name}({sym.fmt(a)}, {sym.fmt(b)}) depends on the sizes fed (bounds [{alo}, {ahi}] and [{blo}, {bhi}]): kiln must know it at load")


BINARY: dict[str, Callable[[Dim, Dim], Dim | bool]] = {
  "Mul": _mul, "Div": _div, "Add": lambda a, b: _sum(a, b, 1), "Sub": lambda a, b: _sum(a, b, -1),
  "Max": partial(_extreme, "Max"), "Min": partial(_extreme, "Min"),
  **{k: partial(_compare, k) for k in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")},
}
COMPARES = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"})


def _ints(v: Any) -> bool: return isinstance(v, np.ndarray) and (v.dtype == object or v.dtype.kind in "iu")


def _elementwise(n: OnnxNode) -> Value:
  vals = [v for v in n.ins if isinstance(v, np.ndarray)]  # all of them (RULES' _all_ints)
  f = BINARY[n.op]
  out = vals[0]
  for v in vals[1:]:  # Max and Min take any number of inputs, the others two
    a, b = np.broadcast_arrays(np.asarray(out, object), np.asarray(v, object))
    res = np.empty(a.shape, bool if n.op in COMPARES else object)
    for i in np.ndindex(a.shape): res[i] = f(dim(a[i]), dim(b[i]))
    out = res
  return out if n.op in COMPARES else pack(out)


# TensorProto codes of the integer types (and bool) a Cast keeps a shape value in
_INT_CODES = {2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 12: np.uint32, 13: np.uint64, 9: np.bool_}


def _cast(n: OnnxNode, *_: Any) -> Value:
  to, v = np.dtype(_INT_CODES[n.attr("to")]), n.ins[0]
  assert isinstance(v, np.ndarray)
  if to == np.bool_: return np.asarray([_nonzero(dim(d)) for d in v.reshape(-1)], bool).reshape(v.shape)
  info, out = np.iinfo(to.type), np.empty(v.shape, object)  # type: ignore[type-var]  # an integer type here
  for i in np.ndindex(v.shape):
    d = dim(v[i])
    if isinstance(d, int): out[i] = int(np.asarray(d).astype(to))  # a fixed size converts as numpy (and onnxruntime) do
    elif (b := bounds(d))[0] < info.min or b[1] > info.max: raise Refused(f"Cast of {sym.fmt(d)} (up to {b[1]}) to {to.name} would wrap")
    else: out[i] = d
  return pack(out)


def _nonzero(d: Dim) -> bool:
  """d != 0 for every value of the variables (a dim whose bounds hold 0 and another value: refused)."""
  lo, hi = bounds(d)
  if lo > 0 or hi < 0: return True
  if lo == hi == 0: return False
  raise Refused(f"Cast of {sym.fmt(d)} (bounds [{lo}, {hi}]) to bool depends on the sizes fed: kiln must know it at load")


def _where(n: OnnxNode) -> Value:
  c, a, b = n.ins[:3]
  return pack(np.where(c, np.asarray(a, object), np.asarray(b, object)))  # type: ignore[arg-type]


# a reduction over shape values: the binary rule it folds with, its value over no element, the opset from which its axes
# are an input. Only those whose result is always a dim (a product, a sum): max(batch, 3) is none, and stays data
_REDUCES: dict[str, tuple[str, int, int]] = {"ReduceProd": ("Mul", 1, 18), "ReduceSum": ("Add", 0, 13)}


def _reduce_axes(n: OnnxNode) -> list[int] | None:
  """A reduction's axes where known at load (an attribute, or an input of ints), None where computed at run time."""
  if n.opset < _REDUCES[n.op][2]: return list(n.attr("axes") or [])
  a = n.ins[1] if len(n.ins) > 1 else None
  if a is None: return []
  return [int(x) for x in a.reshape(-1)] if isinstance(a, np.ndarray) and a.dtype != object else None


def _reduce(n: OnnxNode) -> Value:
  """ReduceProd or ReduceSum over a shape value (the element count of a NonZero's positions: ReduceProd of its Shape) by
  the dims' rules, so a Reshape to it stays symbolic."""
  v, axes = n.ins[0], _reduce_axes(n)
  assert isinstance(v, np.ndarray) and axes is not None
  if not axes:
    if n.attr("noop_with_empty_axes", 0): return v
    axes = list(range(v.ndim))
  if any(not -v.ndim <= a < v.ndim for a in axes): raise Refused(f"axes {axes} are out of range for rank {v.ndim}")
  op, empty, _ = _REDUCES[n.op]
  f = BINARY[op]
  out = np.asarray(v, object)
  for a in sorted({a % v.ndim for a in axes}, reverse=True):
    moved = np.moveaxis(out, a, -1)
    res = np.empty(moved.shape[:-1], object)
    for i in np.ndindex(res.shape):
      row = [dim(x) for x in moved[i]]
      acc = row[0] if row else empty
      for x in row[1:]: acc = f(acc, x)
      res[i] = acc
    out = np.expand_dims(res, a) if n.attr("keepdims", 1) else res
  return pack(out)


def _expand(n: OnnxNode) -> Value:
  """Expand to a shape holding symbolic dims: a 1 keeps the input's dim, a dim of 1 takes the target's (a lazy broadcast)."""
  x, tgt = n.ins[0], [dim(d) for d in np.asarray(n.ins[1]).reshape(-1)]
  if x is None: raise Refused("input 0 is missing")
  if is_shape_value(x): raise Refused("an Expand of a Shape's dims to a symbolic shape is not supported")
  xs = tuple(x.shape)
  nd = max(len(xs), len(tgt))
  full, shp = (1,) * (nd - len(xs)) + xs, (1,) * (nd - len(tgt)) + tuple(tgt)
  out: list[Dim] = []
  for i, (a, b) in enumerate(zip(full, shp)):
    if isinstance(b, int) and b < 1: raise Refused(f"the target {sym.fmt_shape(shp)} holds {b} (an empty or negative dim) beside symbolic dims")
    if fixed(b, 1) or same(a, b): out.append(a)
    elif fixed(a, 1): out.append(b)
    else: raise Refused(f"cannot expand {sym.fmt_shape(full)} to {sym.fmt_shape(shp)}: axis {i} ({sym.fmt(a)} to {sym.fmt(b)}) broadcasts only "
                        "for some sizes")
  t = x if isinstance(x, Tensor) else Tensor(x)
  return t.reshape(full).expand(tuple(out))


def as_data(v: np.ndarray) -> Tensor:
  """A shape value as an int64 Tensor of the dims' run-time values."""
  parts = [Tensor.dim_value(dim(d), dtypes.int64) for d in v.reshape(-1)]
  if v.ndim == 0: return parts[0]
  return Tensor.stack(parts, 0).reshape(v.shape)


# ---- which ops take a symbolic shape value, and at which inputs (None: every input) ----
def _no_tensor(n: OnnxNode) -> bool: return not any(isinstance(v, Tensor) for v in n.ins)
def _always(n: OnnxNode) -> bool: return True
def _all_ints(n: OnnxNode) -> bool: return all(_ints(v) for v in n.ins if v is not None)
def _known_condition(n: OnnxNode) -> bool:
  return isinstance(c := n.ins[0], np.ndarray) and c.dtype == np.bool_ and all(_ints(v) for v in n.ins[1:3])


class Rule(NamedTuple):
  inputs: tuple[int, ...] | None  # the inputs that may hold a symbolic shape value
  keeps: Callable[[OnnxNode], bool]   # whether this node keeps it a shape value (else it becomes data)
  run: Callable[..., Value] | None  # the conversion on shape values (None: the op's own handler takes them)


RULES: dict[str, Rule] = {
  # moved around, or a shape that sets a shape: the op's handler takes the dims
  **{k: Rule((0,), _no_tensor, None) for k in ("Gather", "Unsqueeze", "Squeeze", "Identity", "Shape")},
  "Concat": Rule(None, _no_tensor, None), "Reshape": Rule((0, 1), _always, None), "ConstantOfShape": Rule((0,), _always, None),
  "Range": Rule((1,), _always, None), "Slice": Rule((0, 1, 2), _always, None), "Resize": Rule((3,), _always, None),
  "Tile": Rule((1,), _always, None),
  "Expand": Rule((1,), _always, _expand),
  **{k: Rule(None, _always, None) for k in ("If", "Loop", "Scan")},  # they refuse a Shape's symbolic dims themselves
  # arithmetic that stays a dim (or a known bool)
  **{k: Rule(None, _all_ints, _elementwise) for k in BINARY},
  "Where": Rule((1, 2), _known_condition, _where),
  **{k: Rule((0,), lambda n: _reduce_axes(n) is not None, _reduce) for k in _REDUCES},
  "Cast": Rule((0,), lambda n: n.attr("to") in _INT_CODES, _cast),
}


def check_shape_value(n: OnnxNode) -> None:
  """Before node n converts: each input holding a Shape's symbolic dims stays a shape value where RULES takes it there, else
  becomes data (n.from_shape records it, for a refusal that needs the value at load)."""
  rule = RULES.get(n.op)
  for i, v in enumerate(n.ins):
    if isinstance(v, np.ndarray) and v.dtype == object and not symbolic(v): n.ins[i] = v.astype(np.int64)  # every dim fixed: a plain shape
  for i, v in enumerate(n.ins):
    if not symbolic(v): continue
    assert isinstance(v, np.ndarray)
    if rule is not None and (rule.inputs is None or i in rule.inputs) and rule.keeps(n): continue
    n.from_shape[i] = fmt_value(v)
    n.ins[i] = as_data(v)


def run_rule(n: OnnxNode, fallback: Callable[..., Value], *args: Any) -> Value:
  """The node through its shape-value rule when an input holds symbolic dims, else through its handler."""
  rule = RULES.get(n.op)
  if rule is None or rule.run is None or not any(symbolic(v) for v in n.ins): return fallback(n, *args)
  try: return rule.run(n, *args)
  except Refused as e: raise n.error(f"on the symbolic dims of a Shape: {e}") from None


# ---- Slice on a symbolic axis, or to a symbolic end ----
def slice_dims(n: OnnxNode, t: Tensor, axes: Sequence[int], starts: Sequence[Dim], ends: Sequence[Dim], steps: Sequence[int]) -> Tensor:
  """t[starts:ends:steps] on axes where an axis or a bound is symbolic: for a step of 1 a view whose start and length are
  dims (dims.span: [1:] of seq is seq - 1 long, [past:] of past + seq is seq long, [0:d] of a fixed axis d long); where
  Python's clamping would make the length depend on the size (min(5, seq)), or for another step, refused by name."""
  spec: list[tuple[Dim, int]] = [(0, 1)] * t.ndim
  shape = list(t.shape)
  for a, b, e, s in zip(axes, starts, ends, steps):
    size = t.shape[a]
    if s == 0: raise n.error(f"step 0 on axis {a}")
    where = f"[{_bound(b)}:{_bound(e)}{'' if s == 1 else f':{s}'}] of axis {a} of {sym.fmt_shape(t.shape)}"
    if isinstance(size, int) and isinstance(b, int) and isinstance(e, int):
      r = range(*slice(b, e, s).indices(size))
      if not len(r): raise n.error(f"slice {where} is empty (empty tensors are not supported)")
      spec[a], shape[a] = (r.start, s), len(r)
    elif s == 1:
      try: start, shape[a] = sym.span(size, b, e, f"slice {where}")
      except GraphError as ex: raise n.error(str(ex)) from None
      spec[a] = (start, 1)
    else: raise n.error(f"slice {where} would have the length {_length(b, e, s, size)}, which is no polynomial in named dims: a strided "
                        "slice of a symbolic axis or to a symbolic bound is not supported")
  if tuple(shape) == t.shape and all(x == (0, 1) for x in spec): return t
  return t._view("shrink", tuple(spec), tuple(shape))


def _bound(d: Dim) -> str: return "" if isinstance(d, int) and abs(d) >= 2**62 else sym.fmt(d)  # INT64_MAX: to the end


def _length(b: Dim, e: Dim, s: int, size: Dim) -> str:
  """The length of [b:e:s] on an axis of size, as a formula (for a refusal)."""
  n = sym.fmt(size)
  if s != 1: return f"about {n} / {abs(s)}" if isinstance(b, int) and isinstance(e, int) else f"({sym.fmt(e)} - {sym.fmt(b)}) / {abs(s)}"
  if not (isinstance(b, int) and isinstance(e, int)): return f"min({sym.fmt(e)}, {n})" if fixed(b, 0) else f"{sym.fmt(e)} - {sym.fmt(b)}"
  hi = bounds(size)[1]
  if b < 0 and e >= hi: return f"min({n}, {-b})"
  end = n if e >= hi else f"{n} - {-e}" if e < 0 else f"min({n}, {e})"
  return end if b == 0 else f"{end} - {b}" if b > 0 else f"{end} - ({n} - {-b})"
