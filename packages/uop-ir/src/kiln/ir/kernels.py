"""Kernel builders: common kernels as ASTs, so users need not write RANGEs and index arithmetic by hand.

Every buffer is a flat, contiguous, row-major (C order) array. Slot 0 is the output; the inputs follow in the order given.
A shape is a tuple of dims, each an int or a symbolic size (an integer UOp, e.g. UOp.variable("n", 1, 4096)); a buffer of
symbolic shape is declared with the size it has at the variables' maxima, so the verifier can still prove every index.
Size-1 dims get no RANGE (their index is 0), which is also how broadcasting works.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from kiln.ir.dtype import ConstLike, DType, dtypes, index_dtype
from kiln.ir.errors import IRError
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp

Dim = int | UOp
Shape = tuple[Dim, ...]
Spec = tuple[Sequence[Dim], DType]


def _dims(shape: Sequence[Dim]) -> Shape:
  out = tuple(shape)
  for d in out:
    if isinstance(d, UOp):
      if not d.dtype.is_int: raise IRError(f"a symbolic dim must be an integer UOp, got {d.dtype}")
    elif isinstance(d, bool) or not isinstance(d, int) or d < 1: raise IRError(f"a dim must be an int >= 1 or an integer UOp, got {d!r}")
  return out


def _is1(d: Dim) -> bool: return isinstance(d, int) and d == 1
def _same(a: Dim, b: Dim) -> bool: return a is b if isinstance(a, UOp) or isinstance(b, UOp) else a == b


def broadcast_shape(*shapes: Sequence[Dim]) -> Shape:
  """numpy broadcasting of shapes; a symbolic dim matches only itself or 1."""
  nd = max((len(s) for s in shapes), default=0)
  out: list[Dim] = []
  for i in range(nd):
    d: Dim = 1
    for s in shapes:
      x = s[i - nd + len(s)] if i - nd + len(s) >= 0 else 1
      if _is1(x): continue
      if _is1(d): d = x
      elif not _same(d, x): raise IRError(f"shapes {[tuple(s) for s in shapes]} do not broadcast: dim {i} is {d!r} and {x!r}")
    out.append(d)
  return tuple(out)


def numel(shape: Sequence[Dim]) -> Dim:
  """Elements of a buffer of this shape (a UOp when a dim is symbolic)."""
  n: Dim = 1
  for d in shape: n = d * n if isinstance(d, UOp) else n * d
  return n


def buffer(slot: int, dtype: DType, shape: Sequence[Dim]) -> UOp:
  n = max(math.prod(int(d.vmax) if isinstance(d, UOp) else d for d in shape), 1)  # declared at the symbolic dims' largest values
  if n > dtypes.index64.max: raise IRError(f"a buffer of shape {tuple(shape)} has {n} elements, more than a {dtypes.index64} index reaches")
  return UOp.define_global(slot, dtype.ptr(n))


def flat_index(idx: Sequence[UOp | int], shape: Sequence[Dim]) -> UOp:
  """Row-major flat index of the n-d index idx into shape (size-1 dims are skipped, which broadcasts them). Built in
  dtypes.index while the bounds of every product and partial sum fit int32, in dtypes.index64 from the first that does
  not (an int32 stride past 2**31, or a sum past it, would wrap)."""
  return _flat_index(tuple(idx), tuple(shape))


# UOps are hash-consed, so the same index into the same shape is the same key: a model's repeated layers render the same
# loads kernel after kernel (a 30-layer decoder's plans asked for ~1k distinct indices ~190k times), and each build costs
# a dozen UOps with their bounds
@functools.lru_cache(maxsize=1 << 14)
def _flat_index(idx: tuple[UOp | int, ...], shape: tuple[Dim, ...]) -> UOp:
  out: UOp | int = 0
  stride: Dim = 1
  for i, d in zip(reversed(idx), reversed(shape)):
    if not _is1(d) and not (isinstance(i, int) and i == 0): out = _madd(i, stride, out)
    stride = d * stride if isinstance(d, UOp) else stride * d
  return out if isinstance(out, UOp) else UOp.const(index_dtype(out, out), out)


def _madd(i: UOp | int, stride: Dim, acc: UOp | int) -> UOp | int:
  """i * stride + acc, in int64 when the bounds of the product or the sum pass int32."""
  if isinstance(i, int) and isinstance(stride, int) and isinstance(acc, int): return i * stride + acc
  u, s, a = (x if isinstance(x, UOp) else UOp.const(index_dtype(x, x), x) for x in (i, stride, acc))
  ends = [int(x) * int(y) for x in (u.vmin, u.vmax) for y in (s.vmin, s.vmax)]
  if index_dtype(min(ends) + min(int(a.vmin), 0), max(ends) + max(int(a.vmax), 0)) == dtypes.index64:
    u, s, a = (x.cast(dtypes.index64) for x in (u, s, a))
  return u * s + a


class _Axes:
  """Hands out RANGEs with fresh axis ids."""
  def __init__(self) -> None: self.n = 0
  def __call__(self, end: Dim, axis_type: AxisType = AxisType.LOOP) -> UOp:
    self.n += 1
    return UOp.range(end, self.n - 1, axis_type)


def _loop_ranges(shape: Shape, ax: _Axes) -> list[UOp | int]: return [0 if _is1(d) else ax(d) for d in shape]


def _aligned(idx: Sequence[UOp | int], shape: Shape) -> list[UOp | int]:
  """The trailing len(shape) entries of idx, with 0 where shape broadcasts (numpy right-alignment)."""
  tail = list(idx[len(idx) - len(shape):]) if shape else []
  return [0 if _is1(d) else i for i, d in zip(tail, shape)]


def _as_uop(v: UOp | ConstLike, dtype: DType) -> UOp:
  u = v if isinstance(v, UOp) else UOp.const(dtype, v)
  return u if u.dtype == dtype else u.cast(dtype)


def elementwise(fn: Callable[..., UOp | ConstLike], out_dtype: DType, *in_specs: Spec, name: str = "elementwise") -> UOp:
  """out = fn(*inputs) elementwise, with numpy broadcasting.

  in_specs: (shape, dtype) per input. fn gets one loaded UOp per input (of that input's dtype) and returns a UOp or a Python
  number; a result of another dtype is cast to out_dtype. Output shape: the broadcast of the input shapes.
  Slots: 0 the output (out_dtype, broadcast shape), then 1.. the inputs in order.
  """
  shapes = [_dims(s) for s, _ in in_specs]
  out_shape = broadcast_shape(*shapes)
  ax = _Axes()
  idx = _loop_ranges(out_shape, ax)
  ins = [buffer(i + 1, dt, s).index(flat_index(_aligned(idx, s), s)).load() for i, (s, (_, dt)) in enumerate(zip(shapes, in_specs))]
  out = buffer(0, out_dtype, out_shape)
  return UOp.sink(out.index(flat_index(idx, out_shape)).store(_as_uop(fn(*ins), out_dtype)), name=name)


def _norm_axes(axes: int | Sequence[int] | None, nd: int) -> tuple[int, ...]:
  if axes is None: return tuple(range(nd))
  ax = (axes,) if isinstance(axes, int) else tuple(axes)
  out = []
  for a in ax:
    if not -nd <= a < nd: raise IRError(f"axis {a} is out of range for {nd} dims")
    out.append(a % nd)
  if len(set(out)) != len(out): raise IRError(f"repeated axis in {ax}")
  return tuple(sorted(out))


def reduced_shape(shape: Sequence[Dim], axes: int | Sequence[int] | None, keepdims: bool = False) -> Shape:
  ax = _norm_axes(axes, len(shape))
  return tuple(1 if i in ax else d for i, d in enumerate(shape) if keepdims or i not in ax)


def reduce(op: Ops, shape: Sequence[Dim], dtype: DType, axes: int | Sequence[int] | None = None, keepdims: bool = False,
           fn: Callable[[UOp], UOp] | None = None, acc_dtype: DType | None = None, name: str | None = None) -> UOp:
  """out = reduce_op(fn(x)) over `axes` (None: all), accumulated in acc_dtype (default dtype) and stored as acc_dtype.

  op: Ops.ADD (sum), Ops.MUL (prod) or Ops.MAX. keepdims keeps reduced axes as size 1. fn, if given, maps each loaded element first.
  Slots: 0 the output (reduced shape), 1 the input x (shape).
  """
  s = _dims(shape)
  ax = _norm_axes(axes, len(s))
  acc_dt = acc_dtype or dtype
  axs = _Axes()
  kept = [0 if i in ax or _is1(d) else axs(d) for i, d in enumerate(s)]
  red = {i: axs(s[i], AxisType.REDUCE) for i in ax if not _is1(s[i])}
  x = buffer(1, dtype, s).index(flat_index([red.get(i, k) for i, k in enumerate(kept)], s)).load()
  v = _as_uop(fn(x) if fn is not None else x, acc_dt).reduce(op, *red.values())
  oshape = reduced_shape(s, ax, keepdims)
  oidx = [k for i, k in enumerate(kept) if keepdims or i not in ax]
  out = buffer(0, acc_dt, oshape)
  return UOp.sink(out.index(flat_index(oidx, oshape)).store(v), name=name or f"reduce_{op.name.lower()}")


def reduce_sum(shape: Sequence[Dim], dtype: DType, axes: int | Sequence[int] | None = None, keepdims: bool = False, **kw) -> UOp:
  """Sum over axes. Slots: 0 out, 1 x."""
  return reduce(Ops.ADD, shape, dtype, axes, keepdims, name=kw.pop("name", "sum"), **kw)


def reduce_max(shape: Sequence[Dim], dtype: DType, axes: int | Sequence[int] | None = None, keepdims: bool = False, **kw) -> UOp:
  """Max over axes (IEEE maximum: NaN propagates). Slots: 0 out, 1 x."""
  return reduce(Ops.MAX, shape, dtype, axes, keepdims, name=kw.pop("name", "max"), **kw)


def reduce_prod(shape: Sequence[Dim], dtype: DType, axes: int | Sequence[int] | None = None, keepdims: bool = False, **kw) -> UOp:
  """Product over axes. Slots: 0 out, 1 x."""
  return reduce(Ops.MUL, shape, dtype, axes, keepdims, name=kw.pop("name", "prod"), **kw)


def matmul(m: Dim, n: Dim, k: Dim, dtype: DType = dtypes.float32, batch: Sequence[Dim] = (), acc_dtype: DType | None = None,
           name: str = "matmul") -> UOp:
  """C = A @ B, batched over the leading `batch` dims (all three buffers carry them).

  Shapes: C (*batch, m, n), A (*batch, m, k), B (*batch, k, n). The products are summed in acc_dtype (default dtype), in
  order of k, and cast to dtype. Slots: 0 C, 1 A, 2 B.
  """
  b = _dims(batch)
  m, n, k = _dims((m, n, k))
  ax = _Axes()
  bi = _loop_ranges(b, ax)
  i, j = _loop_ranges((m, n), ax)
  kk = 0 if _is1(k) else ax(k, AxisType.REDUCE)
  acc = acc_dtype or dtype
  a = buffer(1, dtype, (*b, m, k)).index(flat_index([*bi, i, kk], (*b, m, k))).load()
  bb = buffer(2, dtype, (*b, k, n)).index(flat_index([*bi, kk, j], (*b, k, n))).load()
  v = (_as_uop(a, acc) * _as_uop(bb, acc)).reduce(Ops.ADD, *([kk] if isinstance(kk, UOp) else []))
  c = buffer(0, dtype, (*b, m, n))
  return UOp.sink(c.index(flat_index([*bi, i, j], (*b, m, n))).store(_as_uop(v, dtype)), name=name)


def matmul_dot4(m: Dim, n: Dim, k: Dim, name: str = "matmul_dot4") -> UOp:
  """C = A @ B over words of four bytes, int32: C[i, j] = sum over k of DOT4(A[i, k], B[k, j], 0) (A's bytes unsigned, B's
  signed; the sums wrap). Shapes: C (m, n), A (m, k), B (k, n). Slots: 0 C, 1 A, 2 B."""
  m, n, k = _dims((m, n, k))
  ax = _Axes()
  i, j = _loop_ranges((m, n), ax)
  kk = 0 if _is1(k) else ax(k, AxisType.REDUCE)
  i32 = dtypes.int32
  a = buffer(1, i32, (m, k)).index(flat_index([i, kk], (m, k))).load()
  b = buffer(2, i32, (k, n)).index(flat_index([kk, j], (k, n))).load()
  v = UOp(Ops.DOT4, i32, (a, b, UOp.const(i32, 0))).reduce(Ops.ADD, *([kk] if isinstance(kk, UOp) else []))
  return UOp.sink(buffer(0, i32, (m, n)).index(flat_index([i, j], (m, n))).store(v), name=name)


# ---- softmax, in parts (four kernels) or fused (one) ----

def softmax_max(shape: Sequence[Dim], dtype: DType, axis: int = -1) -> UOp:
  """m = max(x, axis, keepdims). Slots: 0 m, 1 x."""
  return reduce_max(shape, dtype, axis, keepdims=True, name="softmax_max")


def softmax_exp(shape: Sequence[Dim], dtype: DType, axis: int = -1) -> UOp:
  """e = exp(x - m), m broadcast along axis. Slots: 0 e (shape), 1 x (shape), 2 m (shape with axis 1)."""
  return elementwise(lambda x, m: (x - m).exp(), dtype, (shape, dtype), (reduced_shape(shape, axis, True), dtype), name="softmax_exp")


def softmax_sum(shape: Sequence[Dim], dtype: DType, axis: int = -1) -> UOp:
  """s = sum(e, axis, keepdims). Slots: 0 s, 1 e."""
  return reduce_sum(shape, dtype, axis, keepdims=True, name="softmax_sum")


def softmax_div(shape: Sequence[Dim], dtype: DType, axis: int = -1) -> UOp:
  """out = e / s, s broadcast along axis. Slots: 0 out (shape), 1 e (shape), 2 s (shape with axis 1)."""
  return elementwise(lambda e, s: e / s, dtype, (shape, dtype), (reduced_shape(shape, axis, True), dtype), name="softmax_div")


def softmax_parts(shape: Sequence[Dim], dtype: DType, axis: int = -1) -> list[UOp]:
  """[softmax_max, softmax_exp, softmax_sum, softmax_div]: run in order with buffers m, e, s in between (see each for slots)."""
  return [f(shape, dtype, axis) for f in (softmax_max, softmax_exp, softmax_sum, softmax_div)]


def softmax(shape: Sequence[Dim], dtype: DType, axis: int = -1) -> UOp:
  """The whole softmax along axis as one kernel with nested REDUCEs. Slots: 0 out (shape), 1 x (shape)."""
  s = _dims(shape)
  a = _norm_axes(axis, len(s))[0]
  ax = _Axes()
  idx = _loop_ranges(s, ax)
  x = buffer(1, dtype, s)
  def at(r: UOp | int) -> UOp: return x.index(flat_index([r if i == a else v for i, v in enumerate(idx)], s)).load()
  def red(op: Ops, f: Callable[[UOp], UOp]) -> UOp:
    if _is1(s[a]): return f(at(0))
    r = ax(s[a], AxisType.REDUCE)
    return f(at(r)).reduce(op, r)
  mx = red(Ops.MAX, lambda v: v)
  total = red(Ops.ADD, lambda v: (v - mx).exp())
  out = buffer(0, dtype, s)
  # times the row's reciprocal (one divide per row, hoisted out of the row's loop), not a divide per element, as torch does
  return UOp.sink(out.index(flat_index(idx, s)).store((at(idx[a]) - mx).exp() * total.reciprocal()), name="softmax")
