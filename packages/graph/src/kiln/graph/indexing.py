"""Indexing by data beyond Tensor.gather, as rows of a (R, S) table: a flat row index picks rows (gather) or says where
rows of updates go (scatter). A row index is either a numpy array known at load (checked there, so the kernels read it as
a constant) or a Tensor computed at run time, each of whose indices `wrapped` turns into a row number under a run-time
check (index_check.py), so a bad index is an IndexOutOfRangeError after the run, never a read outside a buffer. A gather's
table may have symbolic dims (a (batch, seq) mask): its row numbers then use symbolic strides (`scaled`: the dims' values
at run time), and the gather clamps and checks them against the run-time row count.

kiln has no kernel that writes at a data-dependent place, so a scatter is computed where its result is read:
  - constant rows: for each table row, numpy finds at load which updates land on it (slot j: the j-th in order), and the
    result row is a gather of those updates combined with the data row;
  - run-time rows: each result row compares its number with every update's row (R x U compares, a reduction), so the
    work grows as R * U (* S with a reduction): refused past DENSE_LIMIT elements.
A scatter's table and updates may have symbolic dims too (bart's shift_tokens_right writes input_ids[:, :-1] into
[:, 1:] of a (batch, seq) table, its indices from a Range): its rows are then computed at run time, and the updates
keep their own axes (*U, S) (a (batch, seq - 1) does not flatten: a sum stays a dim of its own). Where the updates are
one axis that holds at least one, the winning update of a row is gathered; otherwise (several axes, or none at run
time) each row takes the product of its winner and 1s (x * 1 is x, a -0.0 and a NaN included), (*U, R, S) work."""
from __future__ import annotations

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.dims import dmax, dmin
from kiln.graph.kernelize import strides
from kiln.graph.lazy import GraphError
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType, dtypes
from kiln.ir.kernels import Dim
from kiln.ir.uop import UOp

REDUCTIONS = ("none", "add", "mul", "max", "min")
DENSE_LIMIT = 1 << 24  # elements a run-time-index scatter may compare (R * U, times S with a reduction)
MAX_NAN_LEVELS = 1 << 12  # updates to one row a folded max/min scatter with NaNs applies one step each


def index_dtype(size: Dim) -> DType:
  """The narrowest of int32 and int64 that holds every row number of a table of size rows (a symbolic size: at its bound)."""
  return dtypes.int32 if dmax(size) <= int(dtypes.int32.max) else dtypes.int64


def scaled(t: Tensor, stride: Dim) -> Tensor:
  """t * stride in t's dtype; a symbolic stride (a product of dims) is its value at run time."""
  if isinstance(stride, UOp): return t * Tensor.dim_value(stride, t.dtype)
  return t if stride == 1 else t * stride


def wrapped(idx: Tensor, size: Dim, label: str, dt: DType | None = None) -> Tensor:
  """idx in [0, size): a negative index counted once from the end, as ONNX says. It is a Gather from 0..size-1 (an IOTA:
  nothing stored), so the Gather's plan check makes an index outside [-size, size) an IndexOutOfRangeError naming
  label (index_check._where) after the run."""
  if not idx.dtype.is_int: raise GraphError(f"{label}: indices must be integers, got {idx.dtype.name}")
  return Tensor.arange(size, dt or index_dtype(size)).gather(idx, 0, name=label)


def coords(shape: tuple[Dim, ...], axis: int, dt: DType) -> Tensor:
  """Each element's index along axis of shape, broadcast to shape (an IOTA: nothing stored)."""
  one: list[Dim] = [1] * len(shape)
  one[axis] = shape[axis]
  return Tensor.arange(shape[axis], dt).reshape(tuple(one)).expand(shape)


def flat_order(shape: tuple[Dim, ...], dt: DType) -> Tensor:
  """Each element's row-major position in shape (symbolic strides at run time; one axis: an IOTA, nothing stored)."""
  if len(shape) == 1: return Tensor.arange(shape[0], dt)
  st = strides(shape)
  out = scaled(coords(shape, 0, dt), st[0])
  for a in range(1, len(shape)): out = out + scaled(coords(shape, a, dt), st[a])
  return out


def _gathers_winner(ushape: tuple[Dim, ...]) -> bool:
  """Whether a run-time scatter with reduction none gathers each row's winning update (one axis of updates, never
  empty), rather than reducing over all of them (the gather's index would be out of range where there are none)."""
  return len(ushape) == 1 and dmin(ushape[0]) >= 1


def dense_work(nrows: Dim, ushape: tuple[Dim, ...], s: Dim, op: str) -> int:
  """The elements a run-time-index scatter compares or reduces at the dims' upper bounds (against DENSE_LIMIT)."""
  return dmax(nrows) * sym.max_numel(ushape) * (1 if op == "none" and _gathers_winner(ushape) else dmax(s))


def _identity(op: str, dt: DType) -> int | float | bool:
  if op == "add": return 0
  if op == "mul": return 1
  if dt.is_float: return -np.inf if op == "max" else np.inf
  return dt.min if op == "max" else dt.max


def _reduce(x: Tensor, op: str, axis: int | tuple[int, ...]) -> Tensor:
  if op == "add": return x.sum(axis)
  if op == "mul": return x.prod(axis)
  if op == "max": return x.max(axis)
  if x.dtype.is_float: return x.min(axis)
  ones = -1 if not x.dtype.is_unsigned else int(x.dtype.max)  # ~x reverses the order with no overflow (-x wraps the minimum)
  return (x ^ ones).max(axis) ^ ones


def combine(op: str, dst: Tensor, src: Tensor) -> Tensor:
  """dst combined with an update src, as onnxruntime does (max: dst > src ? dst : src, which keeps a NaN update)."""
  if op == "add": return dst + src
  if op == "mul": return dst * src
  if op == "max": return (src < dst).where(dst, src)
  return (dst < src).where(dst, src)


def _levels(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(order, rows in that order, each update's place among those of its row): updates sorted by row, stable."""
  order = np.argsort(rows, kind="stable")
  sr = rows[order]
  return order, sr, np.arange(rows.size) - np.searchsorted(sr, sr, side="left")


def slots(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The rows any update lands on (H, sorted) and (m, H) slots: slot j of the h-th of them is the position of the j-th
  update (in order) landing on it, or -1 (m: the most updates one row gets)."""
  order, sr, occ = _levels(rows)
  hit, which = np.unique(sr, return_inverse=True)
  out = np.full((int(occ.max()) + 1 if occ.size else 0, hit.size), -1, np.int64)
  out[occ, which] = order
  return hit, out


def last_of(rows: np.ndarray, nrows: int) -> np.ndarray:
  """(nrows,): the position of the last update whose row is r, or -1 (the write that wins, as onnxruntime applies them in order)."""
  out = np.full(nrows, -1, np.int64)
  np.maximum.at(out, rows, np.arange(rows.size, dtype=np.int64))
  return out


_AT = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def scatter_np(data: np.ndarray, rows: np.ndarray, upd: np.ndarray, op: str) -> np.ndarray:
  """data (R, S) with upd[u] (U, S) applied to row rows[u] in order, as onnxruntime applies them (the load-time fold)."""
  out = data.copy()
  if op == "none":
    last = last_of(rows, data.shape[0])
    hit = last >= 0
    out[hit] = upd[last[hit]]
    return out
  if op in ("add", "mul") or data.dtype.kind != "f" or not (np.isnan(data).any() or np.isnan(upd).any()):
    _AT[op].at(out, rows, upd)  # unbuffered, one update at a time in order: onnxruntime's sequence
    return out
  order, _, occ = _levels(rows)  # max/min with a NaN: onnxruntime's dst > src ? dst : src, which numpy's maximum is not
  if (m := int(occ.max()) + 1) > MAX_NAN_LEVELS:
    raise GraphError(f"scatter: reduction {op} with NaN values and {m} updates to one row (over {MAX_NAN_LEVELS}, each a step at load)")
  by = np.argsort(occ, kind="stable")
  for p in np.split(order[by], np.searchsorted(occ[by], np.arange(1, m))):  # one update per row at a time, in order
    r, dst, src = rows[p], out[rows[p]], upd[p]
    out[r] = np.where(dst > src, dst, src) if op == "max" else np.where(dst < src, dst, src)
  return out


def scatter_rows(data: Tensor, rows: np.ndarray | Tensor, upd: Tensor, op: str, label: str) -> Tensor:
  """data (R, S) with upd (*U, S) applied at rows (*U) (in [0, R)) in row-major order over U: 'none' overwrites (the
  last of duplicate rows wins, as onnxruntime), add/mul/max/min combine. rows: constant (numpy: fixed R and U) or
  computed (a Tensor: R, U and S may be symbolic)."""
  r, s = data.shape
  ushape = tuple(rows.shape)
  if isinstance(rows, np.ndarray):
    assert isinstance(r, int) and sym.is_static(ushape)
    u = int(np.prod(ushape))
    return _scatter_const(data, rows.reshape(-1), upd.reshape(u, s), op, label, index_dtype(max(r, u)))
  lead = tuple(range(len(ushape)))
  dt = index_dtype(sym.add(sym.mul(*ushape), r))
  eq = rows.cast(dt).unsqueeze(-1).eq(Tensor.arange(r, dt).reshape((1,) * len(ushape) + (r,)))  # (*U, R): update u lands on row r
  if op != "none": return eq.max(lead).reshape(r, 1).where(_combine_all(op, data, upd.unsqueeze(-2), eq.unsqueeze(-1)), data)
  order = flat_order(ushape, dt)
  pos = eq.where(order.unsqueeze(-1), -1).max(lead)  # the last update landing on each row, or -1
  hit = (pos >= 0).reshape(r, 1)
  if _gathers_winner(ushape): return hit.where(upd.gather(pos.maximum(0), 0, name=label), data)
  win = order.unsqueeze(-1).eq(pos.reshape((1,) * len(ushape) + (r,))).unsqueeze(-1)  # (*U, R, 1): the one update each row takes
  vals = upd.unsqueeze(-2) if not upd.dtype.is_bool else upd.unsqueeze(-2).cast(dtypes.uint8)
  picked = win.where(vals, 1).prod(lead)
  return hit.where(picked if not upd.dtype.is_bool else picked.ne(0), data)


def _combine_all(op: str, d: Tensor, vals: Tensor, valid: Tensor) -> Tensor:
  """d (N, S) combined with the valid ones of vals (*K, N or 1, S) along K in row-major order, for rows with at least one."""
  k = vals.shape[:-2]
  lead = tuple(range(len(k)))
  if all(isinstance(x, int) and x == 1 for x in k): return combine(op, d, vals.reshape(vals.shape[-2:]).expand(d.shape))
  if op in ("max", "min") and d.dtype.is_float: return _ordered_extreme(op, d, vals, valid)
  return combine(op, d, _reduce(valid.where(vals, Tensor.full((), _identity(op, d.dtype), d.dtype)), op, lead))


def _ordered_extreme(op: str, d: Tensor, vals: Tensor, valid: Tensor) -> Tensor:
  """Float max/min as onnxruntime applies updates one by one (dst > src ? dst : src): a NaN update makes NaN, which the
  next update replaces, so the result is the plain max of the steps after the last NaN (d is step 1, slot k step
  k + 2), or NaN when that NaN is the last update. Plain reductions compute it, whatever their order."""
  k = tuple(vals.shape[:-2])
  lead = tuple(range(len(k)))
  step = flat_order(k, index_dtype(sym.add(sym.mul(*k), 2))).reshape(*k, 1, 1) + 2
  last_nan = (valid & vals.ne(vals)).where(step, 0).max(lead).maximum(d.ne(d).where(1, 0).cast(step.dtype))  # 0: no NaN
  last = valid.where(step, 0).max(lead)
  after = ((step > last_nan) & valid).where(vals, Tensor.full((), -np.inf if op == "max" else np.inf, d.dtype))
  red = _reduce(after, op, lead)
  out = last_nan.eq(0).where(combine(op, d, red), red)
  return (last_nan.eq(last) & (last_nan > 1)).where(Tensor.full((), np.nan, d.dtype), out)


def _scatter_const(data: Tensor, rows: np.ndarray, upd: Tensor, op: str, label: str, dt: DType) -> Tensor:
  r = data.shape[0]
  assert isinstance(r, int)
  if op == "none":
    last = last_of(rows, r)
    hit = last >= 0
    picked = upd.gather(Tensor(np.maximum(last, 0).astype(dt.np)), 0, name=label)
    return picked if hit.all() else Tensor(hit.reshape(r, 1)).where(picked, data)
  hit, sl = slots(rows)  # combined over the rows updates land on, then read back into all the rows
  g = upd.gather(Tensor(np.maximum(sl, 0).astype(dt.np)), 0, name=label)  # (m, H, S): each hit row's updates, slot by slot
  if hit.size == r: return _combine_all(op, data, g, Tensor((sl >= 0)[:, :, None]))  # every row: hit is 0..R-1
  out = _combine_all(op, data.gather(Tensor(hit.astype(dt.np)), 0, name=label), g, Tensor((sl >= 0)[:, :, None]))
  back = np.zeros(r, dt.np)
  back[hit] = np.arange(hit.size)
  mask = np.zeros((r, 1), np.bool_)
  mask[hit] = True
  return Tensor(mask).where(out.gather(Tensor(back), 0, name=label), data)
