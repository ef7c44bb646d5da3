"""A Slice window computed from data (starts or ends that are data, not a Shape's dims; step 1, axes known): compiled once.

A host step reads the starts, the ends and the axes' lengths in this run back and works out Python's clamped start and
length per axis; each is a runtime variable in [0, the axis' bound] (specialise.Length with vars), so the rest of the model
is compiled once, at load. The window is a gather at start + i, the index kept below the axis' length."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.specialise import Length
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

if TYPE_CHECKING:
  from kiln.graph.onnx_ops import OnnxNode, Value


def _known_ints(v: Value | None) -> bool: return v is None or (isinstance(v, np.ndarray) and v.dtype != object)


def is_window(n: OnnxNode) -> bool:
  """A Slice of step 1 whose starts or ends are data computed at run time (not a Shape's dims), axes and steps known."""
  return (n.opset >= 10 and isinstance(n.ins[0], Tensor) and any(isinstance(n.ins[i], Tensor) and i not in n.from_shape for i in (1, 2))
          and all(_known_ints(n.ins[i] if i < len(n.ins) else None) for i in (3, 4))
          and (len(n.ins) < 5 or n.ins[4] is None or bool((np.asarray(n.ins[4]) == 1).all())))


def slice_window(n: OnnxNode) -> Tensor:
  """x[start:end] on axes with start and end computed at run time: a host step reads them back with the axes' lengths in
  this run and works out Python's clamped start and length per axis; each is a runtime variable in [0, the axis' bound]
  (specialise.Length with vars), so the rest of the model is compiled once. The window is a gather at start + i, the
  index kept below the axis' length."""
  x = n.t(0)
  bounds = [n.t(i).reshape(-1).cast(dtypes.int64) for i in (1, 2)]
  k = sym.static_dim("Slice", bounds[0].shape, 0)
  if sym.static_dim("Slice", bounds[1].shape, 0) != k: raise n.error(f"starts and ends must hold as many values, got {k} and {bounds[1].shape[0]}")
  a = n.ins[3] if len(n.ins) > 3 else None
  axes = [int(v) for v in (range(k) if a is None else np.asarray(a).reshape(-1))]
  if bad := [v for v in axes if not -x.ndim <= v < x.ndim]: raise n.error(f"axis {bad[0]} is out of range for rank {x.ndim}")
  axes = [v % x.ndim for v in axes]
  if len(axes) != k or len(set(axes)) != k: raise n.error(f"axes {axes} must name {k} distinct axes")
  lengths = [Tensor.dim_value(x.shape[ax], dtypes.int64).reshape(1) for ax in axes]

  def host(arrays: list[np.ndarray]) -> np.ndarray:
    s, e, sizes = arrays[0].reshape(-1), arrays[1].reshape(-1), [int(v.reshape(-1)[0]) for v in arrays[2:]]
    out = []
    for b, end, size in zip(s, e, sizes):
      start, stop, _ = slice(int(b), int(end)).indices(size)
      out += [start, max(stop - start, 0)]
    return np.array(out, np.int64)
  w = n.read_back("the window of the slice", [*bounds, *lengths], host, Length(max(sym.dmax(x.shape[ax]) for ax in axes), vars=2 * k))
  for i, ax in enumerate(axes):
    last = Tensor.dim_value(sym.sub(x.shape[ax], 1), dtypes.int64)
    x = x.gather((Tensor.arange(w[2 * i + 1], dtypes.int64) + Tensor.dim_value(w[2 * i], dtypes.int64)).minimum(last), ax, name=n.name)
  return x
