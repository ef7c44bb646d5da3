"""OneHot, and the forms of core operators that their handlers refuse: BatchNormalization in training mode, MaxPool's
Indices output, Split with pieces of size 0, Pad in mode wrap. Registered in onnx_ops.OPS (onnx.py imports this module for
that); each of the last four takes over its operator's entry and hands every other form to the handler it had.

- OneHot: the indices (floats truncated, negatives counted once from the end) against 0..depth-1; one outside
  [-depth, depth) is all off, as onnxruntime. depth sets the output's shape: a constant.
- BatchNormalization with training_mode=1 (opset 14+): normalised by the batch's own mean and biased variance over every
  axis but 1; running_mean/var = the input's * momentum + the batch's * (1 - momentum). torch exports timm's weight
  standardisation (StdConv) so, on constant weights: it folds at load.
- MaxPool's Indices: the first maximum of each window in the window's row-major order (as onnxruntime scans it), as a flat
  index into the unpadded input, (n * C + c) * spatial + position; storage_order=1 numbers the position column-major.
- Split with a piece of size 0: that piece is an empty array (onnx_empty.py says what reads it), the others slices.
- Pad in mode wrap: per axis, negative pads crop first (as onnxruntime), then a gather of constant indices, each place
  modulo the length left (a pad may be longer than the axis).
"""
from __future__ import annotations

import math

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import onnx_ops_shape  # noqa: F401  (it registers Pad, whose handler wrap mode extends)
from kiln.graph.onnx_ops import OPS, OnnxNode, Value, _norm, _op, _spatial
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes
from kiln.ir.ops import Ops

_BASE = {op: OPS[op] for op in ("BatchNormalization", "MaxPool", "Split", "Pad")}  # onnx_ops' handlers, for every other form


def _base(n: OnnxNode) -> Value:
  return _BASE[n.op][0](n)  # type: ignore[no-any-return]


# ---- OneHot ----
def _one_hot(n: OnnxNode) -> Value:
  ind, values = n.ins[0], n.ins[2] if len(n.ins) > 2 else None
  if ind is None or values is None: raise n.error("needs indices, depth and values")
  depth = n.const(1, "depth")
  if depth.size != 1: raise n.error(f"depth must be one number, got shape {depth.shape}")
  d = int(np.trunc(depth.reshape(-1)[0]))  # a float depth is cast to an integer, as the spec says
  if d < 1: raise n.error(f"depth {depth.reshape(-1)[0]} must be >= 1")
  if values.shape != (2,): raise n.error(f"values must hold two elements (off, on), got shape {values.shape}")
  rank = ind.ndim
  axis = int(n.attr("axis", -1))
  if not -rank - 1 <= axis <= rank: raise n.error(f"axis {axis} is out of range for indices of rank {rank} (the output has rank {rank + 1})")
  a = axis % (rank + 1)
  i = n.t(0)
  if i.dtype.is_float: i = i.cast(dtypes.int64)  # truncated toward zero, as onnxruntime casts
  elif i.dtype != dtypes.int64: i = i.cast(dtypes.int64)
  i = (i < 0).where(i + d, i)  # a negative index counts once from the end; still negative, it matches no position
  positions = Tensor(np.arange(d, dtype=np.int64).reshape((d,) + (1,) * (rank - a)))
  hot = positions.eq(i.unsqueeze(a))
  v = n.t(2)
  return hot.where(v.slice([1], [2], [0]).reshape(()), v.slice([0], [1], [0]).reshape(()))


# ---- BatchNormalization in training mode ----
def _batchnorm(n: OnnxNode) -> Value | list[Value]:
  if n.opset < 14 or not n.attr("training_mode", 0): return _base(n)
  n.attr("momentum")
  x = n.t(0)
  if x.ndim < 2: raise n.error(f"input {sym.fmt_shape(x.shape)} needs rank >= 2 (N, C, ...)")
  ft = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
  axes = (0, *range(2, x.ndim))
  xf = x.cast(ft) if x.dtype != ft else x
  mean = xf.mean(axes, keepdims=True)
  dev = xf - mean
  var = (dev * dev).mean(axes, keepdims=True)  # biased, as onnxruntime's (and torch's) batch statistics
  shape = (1, -1) + (1,) * (x.ndim - 2)
  sc, b = (n.t(i).cast(ft).reshape(shape) for i in (1, 2))
  y = dev * (var + float(n.attr("epsilon", 1e-5))).rsqrt() * sc + b
  outs: list[Value] = [y.cast(x.dtype) if y.dtype != x.dtype else y]
  if any(n.proto.output[1:]):
    mom = float(n.attr("momentum", 0.9))
    for i, cur in ((3, mean), (4, var)):
      run = n.t(i)
      outs.append((run.cast(ft) * mom + cur.reshape(-1) * (1.0 - mom)).cast(run.dtype))
  return outs if len(outs) > 1 else outs[0]


# ---- MaxPool's Indices ----
def _max_pool(n: OnnxNode) -> Value | list[Value]:
  if len(n.proto.output) < 2 or not n.proto.output[1]: return _base(n)
  x = n.t(0)
  kernel = list(n.attr("kernel_shape") or [])
  if not kernel: raise n.error("attribute kernel_shape is required")
  if n.attr("ceil_mode", 0): raise n.error("ceil_mode=1 with the Indices output is not supported")
  st, dl, pads = _spatial(n, x, kernel)
  if any(p >= k for k, pair in zip(kernel, pads) for p in pair):
    raise n.error(f"pads {[p for pair in zip(*pads) for p in pair]} must each be smaller than the kernel {kernel} (as onnxruntime requires)")
  d = len(kernel)
  if x.ndim != d + 2: raise n.error(f"input {sym.fmt_shape(x.shape)} needs N, C and {d} spatial dims for kernel {kernel}")
  sp = sym.static_shape("MaxPool (spatial dims)", x.shape[2:])
  size = math.prod(sp)
  y = x.max_pool(kernel, st, pads, dl)
  k_axes = tuple(range(x.ndim, x.ndim + d))
  low = -math.inf if x.dtype.is_float else x.dtype.min
  win = x.pad(((0, 0), (0, 0), *pads), low).windows(kernel, st, dl)  # (N, C, *out, *kernel)
  pos = Tensor(np.arange(size, dtype=np.int64).reshape(sp)).pad(pads, size).windows(kernel, st, dl)  # each element's row-major place
  hit = win.eq(y.reshape(*y.shape, *[1] * d))
  first = hit.where(pos, Tensor.full((), size, dtypes.int64)).min(k_axes)  # the window's first maximum, in its row-major order
  if n.attr("storage_order", 0):  # its place column-major instead
    rest, col = first, None
    for a in reversed(range(d)):
      coord = rest._bin(Ops.MOD, sp[a])
      rest = rest._bin(Ops.IDIV, sp[a])
      col = coord * math.prod(sp[:a]) if col is None else col + coord * math.prod(sp[:a])
    assert col is not None
    first = col
  nc = (Tensor.arange(x.shape[0], dtypes.int64).reshape(-1, 1) * x.shape[1] + Tensor.arange(x.shape[1], dtypes.int64).reshape(1, -1)) * size
  return [y, first + nc.reshape(*nc.shape, *[1] * d)]


# ---- Split with pieces of size 0 ----
def _split(n: OnnxNode) -> Value | list[Value]:
  raw = n.opt_const(1, "split") if n.opset >= 13 else n.attr("split")
  sizes = [] if raw is None else [int(v) for v in np.asarray(raw).reshape(-1)]
  if 0 not in sizes: return _base(n)
  if n.opset >= 18: n.attr("num_outputs")
  x = n.ins[0]
  if x is None: raise n.error("input 0 is missing")
  a = _norm(n.attr("axis", 0), x.ndim, n)
  if min(sizes) < 0 or sum(sizes) != x.shape[a]: raise n.error(f"split sizes {sizes} do not add up to axis {a} of {sym.fmt_shape(x.shape)}")
  shape = sym.static_shape("Split (a piece of size 0: an empty array of the other dims)", x.shape)
  dt = x.dtype if isinstance(x, np.ndarray) else x.dtype.np
  out: list[Value] = []
  start = 0
  for s in sizes:
    if s == 0: out.append(np.zeros(tuple(0 if j == a else d for j, d in enumerate(shape)), dt))
    elif isinstance(x, np.ndarray): out.append(np.take(x, range(start, start + s), a))
    else: out.append(x.slice([start], [start + s], [a]))
    start += s
  return out


# ---- Pad in mode wrap ----
def _pad_wrap(n: OnnxNode) -> Value:
  if n.attr("mode", "constant") != "wrap": return _base(n)
  x = n.t(0)
  if n.opset < 11: pads, axes = [int(v) for v in n.attr("pads") or []], list(range(x.ndim))
  else:
    pads = [int(v) for v in n.const(1, "pads").reshape(-1)]
    n.opt_const(2, "constant_value")  # mode wrap reads none
    ax = n.opt_const(3, "axes")
    axes = list(range(x.ndim)) if ax is None else [_norm(int(v), x.ndim, n) for v in ax.reshape(-1)]
  if len(pads) != 2 * len(axes): raise n.error(f"{len(pads)} pads for {len(axes)} axes (two per axis: all befores, then all afters)")
  for a, b, e in zip(axes, pads[:len(axes)], pads[len(axes):]):
    if b == e == 0: continue  # an axis left alone may be symbolic (a batch)
    d = sym.static_dim("Pad (mode wrap)", x.shape, a)
    if d - max(-b, 0) - max(-e, 0) < 1: raise n.error(f"pads {pads} crop axis {a} of {sym.fmt_shape(x.shape)} to nothing: there is nothing to wrap")
    if b < 0 or e < 0: x, d = x.slice([max(-b, 0)], [d - max(-e, 0)], [a]), d - max(-b, 0) - max(-e, 0)
    b, e = max(b, 0), max(e, 0)
    if b or e: x = x.gather(Tensor(np.arange(-b, d + e, dtype=np.int64) % d), a, name=f"node {n.name} ({n.op})")
  return x


_op("OneHot", _one_hot, "axis")
_op("BatchNormalization", _batchnorm, " ".join(_BASE["BatchNormalization"][1]))
_op("MaxPool", _max_pool, " ".join(_BASE["MaxPool"][1]))
_op("Split", _split, " ".join(_BASE["Split"][1]))
_op("Pad", _pad_wrap, " ".join(_BASE["Pad"][1]))
