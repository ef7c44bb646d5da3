"""The ONNX indexing operators GatherND, GatherElements, ScatterND and ScatterElements (and Scatter, its name before opset
11), registered in onnx_ops.OPS (onnx.py imports this module for that).

Each reads its data as rows of a (R, S) table (kiln.graph.indexing): GatherND's index tuple, or GatherElements' index with
each element's own position, is one flat row number. Three cases, by what is known at load:
  - every input: folded with numpy, updates applied in order as onnxruntime applies them (Swin's shifted-window masks);
  - the indices (torch's exports build them from arange): the row numbers are computed and checked at load, and the
    kernels read them as a constant (an index out of range is an ONNXError naming the node);
  - indices computed at run time: each index is wrapped under a run-time check (an IndexOutOfRangeError after the run,
    never a read or write outside a buffer); a scatter then compares every row with every update (indexing.DENSE_LIMIT).
Negative indices count once from the end. Duplicate indices in a scatter with reduction none: the last update wins, as
onnxruntime applies them in order. A gather's data may have symbolic dims (transformers' attention_mask[batch_idx, kv_idx]
on a (batch, seq) mask): its row numbers are computed at run time from symbolic strides, constant indices included where a
stride or an indexed axis is symbolic (checked at load against the dims' bounds, the rest at run time). A scatter's data,
indices and updates may have symbolic dims too (bart's shift_tokens_right writes input_ids[:, :-1] into [:, 1:], its
indices a Range to seq): its rows are then computed at run time, the updates kept on their own axes (indexing.scatter_rows)
and the dense compare bounded at the dims' upper bounds."""
from __future__ import annotations

import math

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import onnx_limits as lim
from kiln.graph.index_check import bad_index, out_of_range
from kiln.graph.indexing import DENSE_LIMIT, REDUCTIONS, coords, dense_work, index_dtype, scaled, scatter_np, scatter_rows, wrapped
from kiln.graph.kernelize import strides
from kiln.graph.onnx_ops import OnnxNode, Value, _norm, _op
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType
from kiln.ir.kernels import Dim

INDEX_DTYPES = {"GatherND": ("int64",), "ScatterND": ("int64",), "GatherElements": ("int32", "int64"),
                "ScatterElements": ("int32", "int64"), "Scatter": ("int32", "int64")}


def _label(n: OnnxNode) -> str: return f"node {n.name} ({n.op})"


def _input(n: OnnxNode, i: int, what: str) -> Value:
  v = n.ins[i] if i < len(n.ins) else None
  if v is None: raise n.error(f"input {i} ({what}) is missing")
  return v


def _np_dtype(v: Value) -> np.dtype: return v.dtype.np if isinstance(v, Tensor) else v.dtype


def _indices(n: OnnxNode, v: Value) -> None:
  if (name := np.dtype(_np_dtype(v)).name) not in INDEX_DTYPES[n.op]:
    raise n.error(f"indices must be {' or '.join(INDEX_DTYPES[n.op])}, got {name}")


def _strides(shape: tuple[int, ...]) -> list[int]:
  return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _made(n: OnnxNode, elements: int, *given: Value) -> None:
  """Before numpy makes an array of elements at load (a fold's result, a constant row index): within MAX_FOLDED_ELEMENTS
  beyond the largest input it was handed, and within what the model's load budget has left."""
  if elements <= max((math.prod(sym.static_shape(n.op, g.shape)) for g in given if sym.is_static(g.shape)), default=0): return
  lim.limit(f"{_label(n)}: a load-time array's element count", elements, "MAX_FOLDED_ELEMENTS", lim.MAX_FOLDED_ELEMENTS)
  n.budget.check(_label(n), n.budget.folded + 8 * elements)


def _const(n: OnnxNode, a: np.ndarray, dt: DType) -> Tensor:
  """A constant row index for the kernels, counted in the model's load budget as a fold's result is."""
  out = np.ascontiguousarray(a, dt.np)
  n.budget.folded += out.nbytes
  n.budget.check(_label(n), n.budget.folded)
  return Tensor(out)


# ---- row numbers: numpy (checked now) and Tensor (checked at run time), a bad index named alike ----
def _nd_where(j: int, b: int, dshape: tuple[Dim, ...]) -> str: return f"indices[..., {j}] on axis {b + j} of data {sym.fmt_shape(dshape)}"


def _nd_rows(n: OnnxNode, ind: np.ndarray, dshape: tuple[Dim, ...], b: int) -> np.ndarray:
  """GatherND/ScatterND: each index tuple indices[..., :] (after b batch dims) as a row of data (*dshape[:b + k], rest),
  whose dims up to b + k are fixed (the rest may be symbolic)."""
  k, lead = ind.shape[-1], ind.shape[:-1]
  pre = sym.static_shape(n.op, dshape[:b + k])
  st = _strides(pre)
  rows = np.zeros(lead, np.int64)
  for j in range(k):
    size, c = pre[b + j], ind[..., j].astype(np.int64)
    if (bad := bad_index(c, size)) is not None:
      raise n.error(f"{_nd_where(j, b, dshape)}: index {bad} {out_of_range(size)}")
    rows += np.where(c < 0, c + size, c) * st[b + j]
  for a in range(b):  # the batch position picks its own block of rows
    rows += np.arange(lead[a], dtype=np.int64).reshape([-1 if i == a else 1 for i in range(len(lead))]) * st[a]
  return rows


def _nd_rows_t(n: OnnxNode, ind: Tensor, dshape: tuple[Dim, ...], b: int, dt: DType) -> Tensor:
  k, lead = ind.shape[-1], ind.shape[:-1]
  assert isinstance(k, int)  # _gather_nd and _scatter_nd checked it
  st = strides(dshape[:b + k])
  terms = [scaled(wrapped(ind[..., j], dshape[b + j], f"{_label(n)}: {_nd_where(j, b, dshape)}", dt), st[b + j]) for j in range(k)]
  terms += [scaled(coords(lead, a, dt), st[a]) for a in range(b)]
  if not terms: raise n.error("indices select no axis (their last dim is 0)")
  out = terms[0]
  for t in terms[1:]: out = out + t
  return out


def _elem_rows(n: OnnxNode, ind: np.ndarray, dshape: tuple[int, ...], a: int) -> np.ndarray:
  """GatherElements/ScatterElements: each element's position, its axis a coordinate the index, as a flat element number."""
  size, st = dshape[a], _strides(dshape)
  if (bad := bad_index(ind, size)) is not None: raise n.error(f"axis {a} of data {dshape}: index {bad} {out_of_range(size)}")
  i = ind.astype(np.int64)
  rows = np.where(i < 0, i + size, i) * st[a]
  for d in range(ind.ndim):
    if d != a: rows = rows + np.arange(ind.shape[d], dtype=np.int64).reshape([-1 if i == d else 1 for i in range(ind.ndim)]) * st[d]
  return rows


def _elem_rows_t(n: OnnxNode, ind: Tensor, dshape: tuple[Dim, ...], a: int, dt: DType) -> Tensor:
  st = strides(dshape)
  rows = scaled(wrapped(ind, dshape[a], f"{_label(n)}: axis {a} of data {sym.fmt_shape(dshape)}", dt), st[a])
  for d in range(ind.ndim):
    if d != a and ind.shape[d] != 1: rows = rows + scaled(coords(ind.shape, d, dt), st[d])
  return rows


def _elements_shapes(n: OnnxNode, data: Value, ind: Value) -> tuple[int, tuple[Dim, ...]]:
  """The axis and the data's shape of GatherElements/ScatterElements: the same rank, and the indices no larger than the
  data off the axis for every value of the dims (onnxruntime refuses larger): the same dim, or at most its lower bound."""
  _indices(n, ind)
  if data.ndim < 1 or ind.ndim != data.ndim: raise n.error(f"data (rank {data.ndim}) and indices (rank {ind.ndim}) need the same rank >= 1")
  a = _norm(n.attr("axis", 0), data.ndim, n)
  dshape = tuple(data.shape)
  for d, (i, k) in enumerate(zip(ind.shape, dshape)):
    if d != a and i is not k and sym.dmax(i) > sym.dmin(k):
      raise n.error(f"indices {sym.fmt_shape(ind.shape)} can be larger than data {sym.fmt_shape(dshape)} on axis {d} (only axis {a} may differ)")
  return a, dshape


def _nd_runtime(n: OnnxNode, ind: Value, dshape: tuple[Dim, ...], b: int, k: int) -> Value:
  """GatherND/ScatterND's constant indices where a stride or an indexed axis is symbolic: checked now against the dims'
  upper bounds and made a Tensor, so the row numbers are computed at run time (and checked there against this run's)."""
  if not isinstance(ind, np.ndarray) or sym.is_static(dshape[:b + k]): return ind
  for j in range(k):
    if (bad := bad_index(ind[..., j], dshape[b + j])) is not None:
      raise n.error(f"{_nd_where(j, b, dshape)}: index {bad} {out_of_range(dshape[b + j])} for every value up to {sym.dmax(dshape[b + j])}")
  return Tensor(ind)


def _elements_runtime(n: OnnxNode, ind: Value, dshape: tuple[Dim, ...], a: int) -> Value:
  """GatherElements/ScatterElements' constant indices into data of symbolic shape, as _nd_runtime."""
  if not isinstance(ind, np.ndarray) or sym.is_static(dshape): return ind
  if (bad := bad_index(ind, dshape[a])) is not None:
    raise n.error(f"axis {a} of data {sym.fmt_shape(dshape)}: index {bad} {out_of_range(dshape[a])} for every value up to {sym.dmax(dshape[a])}")
  return Tensor(ind)


# ---- the operators ----
def _gather_nd(n: OnnxNode) -> Value:
  data, ind = _input(n, 0, "data"), _input(n, 1, "indices")
  _indices(n, ind)
  b, r, q = n.attr("batch_dims", 0), data.ndim, ind.ndim
  if r < 1 or q < 1: raise n.error(f"data (rank {r}) and indices (rank {q}) need rank >= 1")
  if not isinstance(b, int) or not 0 <= b < min(q, r): raise n.error(f"batch_dims={b!r} is out of range [0, {min(q, r)})")
  k = ind.shape[-1]
  if not isinstance(k, int) or k > r - b: raise n.error(f"indices' last dim {sym.fmt(k)} is more than data's rank {r} less batch_dims {b}")
  dshape = tuple(data.shape)
  if tuple(ind.shape[:b]) != dshape[:b]:
    raise n.error(f"the batch dims of indices {sym.fmt_shape(ind.shape)} and data {sym.fmt_shape(dshape)} differ")
  nrows, s, rest = sym.mul(*dshape[:b + k]), sym.mul(*dshape[b + k:]), dshape[b + k:]
  out_shape = (*ind.shape[:-1], *rest)
  ind = _nd_runtime(n, ind, dshape, b, k)
  if isinstance(ind, np.ndarray):
    rows = _nd_rows(n, ind, dshape, b)
    if isinstance(data, np.ndarray):
      assert isinstance(s, int) and isinstance(nrows, int)  # a constant's shape is fixed
      _made(n, rows.size * s, data, ind)
      return data.reshape(nrows, s)[rows].reshape(out_shape)
    if rows.size == 0: raise n.error(f"the output {out_shape} is empty (kiln has no empty tensors)")
    idx = _const(n, rows, index_dtype(nrows))
  else: idx = _nd_rows_t(n, ind, dshape, b, index_dtype(nrows))
  return n.t(0).reshape(nrows, s).gather(idx, 0, name=_label(n)).reshape(out_shape)


def _gather_elements(n: OnnxNode) -> Value:
  data, ind = _input(n, 0, "data"), _input(n, 1, "indices")
  a, dshape = _elements_shapes(n, data, ind)
  size = sym.mul(*dshape)
  ind = _elements_runtime(n, ind, dshape, a)
  if isinstance(ind, np.ndarray):
    assert isinstance(size, int)
    rows = _elem_rows(n, ind, sym.static_shape(n.op, dshape), a)
    if isinstance(data, np.ndarray): return data.reshape(-1)[rows]
    if rows.size == 0: raise n.error(f"the output {ind.shape} is empty (kiln has no empty tensors)")
    idx = _const(n, rows, index_dtype(size))
  else: idx = _elem_rows_t(n, ind, dshape, a, index_dtype(size))  # computed indices may have symbolic dims
  return n.t(0).reshape(size).gather(idx, 0, name=_label(n))


def _reduction(n: OnnxNode) -> str:
  if n.op == "Scatter": return "none"
  op = n.attr("reduction", "none")
  if op not in REDUCTIONS: raise n.error(f"attribute reduction={op!r} is not one of {', '.join(REDUCTIONS)}")
  return str(op)


def _scatter(n: OnnxNode, rows: np.ndarray | Tensor, nrows: Dim, s: Dim, ushape: tuple[Dim, ...]) -> Value:
  """data as (R, S) rows, updates as (*U, S), rows (*U) the row each update goes to; the result in data's shape."""
  data, upd, op = n.ins[0], n.ins[2], _reduction(n)
  assert data is not None and upd is not None
  if (ud := np.dtype(_np_dtype(upd))) != (dd := np.dtype(_np_dtype(data))): raise n.error(f"updates ({ud.name}) and data ({dd.name}) differ in dtype")
  if op != "none" and dd == np.bool_: raise n.error(f"reduction={op} on bool data is not supported (onnxruntime refuses it)")
  if sym.is_static(ushape) and math.prod(ushape) == 0: return data  # no updates
  dshape = tuple(data.shape)
  if isinstance(rows, np.ndarray):
    assert isinstance(nrows, int) and isinstance(s, int)  # constant rows are numbers of fixed rows
    if isinstance(data, np.ndarray) and isinstance(upd, np.ndarray):
      _made(n, 2 * nrows, rows, data)
      return scatter_np(data.reshape(nrows, s), rows.reshape(-1), upd.reshape(-1, s), op).reshape(dshape)
    counts = np.unique(rows, return_counts=True)[1]
    size = 2 * nrows + (0 if op == "none" else int(counts.max()) * counts.size)  # row indices and masks; update slots of the rows hit
    _made(n, size, rows, data)
    n.budget.folded += 8 * size  # what the kernels read
    n.budget.check(_label(n), n.budget.folded)
  elif (work := dense_work(nrows, ushape, s, op)) > DENSE_LIMIT:
    raise n.error(f"indices computed at run time: kiln has no kernel that writes where an index says, so each of the {sym.fmt(nrows)} rows "
                  f"compares itself with all {sym.fmt(sym.mul(*ushape))} updates ({work} elements at the dims' upper bounds), over "
                  f"indexing.DENSE_LIMIT = {DENSE_LIMIT}; make the indices constants")
  return scatter_rows(n.t(0).reshape(nrows, s), rows, n.t(2).reshape(*ushape, s), op, _label(n)).reshape(dshape)


def _scatter_nd(n: OnnxNode) -> Value:
  data, ind, upd = _input(n, 0, "data"), _input(n, 1, "indices"), _input(n, 2, "updates")
  _indices(n, ind)
  r, q = data.ndim, ind.ndim
  if r < 1 or q < 1: raise n.error(f"data (rank {r}) and indices (rank {q}) need rank >= 1")
  dshape, ishape = tuple(data.shape), tuple(ind.shape)
  k = ishape[-1]
  if not isinstance(k, int) or k > r: raise n.error(f"indices' last dim {sym.fmt(k)} is more than data's rank {r}")
  if tuple(upd.shape) != (want := ishape[:-1] + dshape[k:]):
    raise n.error(f"updates have shape {sym.fmt_shape(upd.shape)}; indices {sym.fmt_shape(ishape)} and data {sym.fmt_shape(dshape)} need "
                  f"{sym.fmt_shape(want)}")
  ushape, nrows = ishape[:-1] or (1,), sym.mul(*dshape[:k])
  ind = _nd_runtime(n, ind, dshape, 0, k)
  if isinstance(ind, np.ndarray): rows: np.ndarray | Tensor = _nd_rows(n, ind, dshape, 0).reshape(ushape)
  else: rows = _nd_rows_t(n, ind, dshape, 0, index_dtype(nrows)).reshape(*ushape)
  return _scatter(n, rows, nrows, sym.mul(*dshape[k:]), ushape)


def _scatter_elements(n: OnnxNode) -> Value:
  data, ind, upd = _input(n, 0, "data"), _input(n, 1, "indices"), _input(n, 2, "updates")
  a, dshape = _elements_shapes(n, data, ind)
  ishape = tuple(ind.shape)
  if tuple(upd.shape) != ishape: raise n.error(f"updates {sym.fmt_shape(upd.shape)} and indices {sym.fmt_shape(ishape)} differ in shape")
  ind = _elements_runtime(n, ind, dshape, a)
  size = sym.mul(*dshape)
  if isinstance(ind, np.ndarray): rows: np.ndarray | Tensor = _elem_rows(n, ind, sym.static_shape(n.op, dshape), a)
  else: rows = _elem_rows_t(n, ind, dshape, a, index_dtype(size))
  return _scatter(n, rows, size, 1, ishape)


_op("GatherND", _gather_nd, "batch_dims"); _op("GatherElements", _gather_elements, "axis")
_op("ScatterND", _scatter_nd, "reduction"); _op("ScatterElements", _scatter_elements, "axis reduction")
_op("Scatter", _scatter_elements, "axis")
