"""Indexing by data beyond Tensor.gather, as rows of a (R, S) table: a flat row index picks rows (gather) or says where
rows of updates go (scatter). A row index is either a numpy array known at load (checked there, so the kernels read it as
a constant) or a Tensor computed at run time, each of whose indices `wrapped` turns into a row number under a run-time
check (index_check.py), so a bad index is an IndexOutOfRangeError after the run, never a read outside a buffer.

kiln has no kernel that writes at a data-dependent place, so a scatter is computed where its result is read:
  - constant rows: for each table row, numpy finds at load which updates land on it (slot j: the j-th in order), and the
    result row is a gather of those updates combined with the data row;
  - run-time rows: each result row compares its number with every update's row (R x U compares, a reduction), so the
    work grows as R * U (* S with a reduction): refused past DENSE_LIMIT elements."""
from __future__ import annotations

import numpy as np

from kiln.graph.lazy import GraphError
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType, dtypes
from kiln.ir.kernels import Dim

REDUCTIONS = ("none", "add", "mul", "max", "min")
DENSE_LIMIT = 1 << 24  # elements a run-time-index scatter may compare (R * U, times S with a reduction)


def index_dtype(size: int) -> DType:
  """The narrowest of int32 and int64 that holds every row number of a table of size rows."""
  return dtypes.int32 if size <= int(dtypes.int32.max) else dtypes.int64


def wrapped(idx: Tensor, size: int, label: str, dt: DType | None = None) -> Tensor:
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


def _identity(op: str, dt: DType) -> int | float | bool:
  if op == "add": return 0
  if op == "mul": return 1
  if dt.is_float: return -np.inf if op == "max" else np.inf
  return dt.min if op == "max" else dt.max


def _reduce(x: Tensor, op: str, axis: int) -> Tensor:
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


def slots(rows: np.ndarray, nrows: int) -> np.ndarray:
  """(m, nrows): slot j of row r is the position of the j-th update (in order) whose row is r, or -1 (m: the most
  updates any row gets)."""
  order = np.argsort(rows, kind="stable")
  sr = rows[order]
  occ = np.arange(rows.size) - np.searchsorted(sr, sr, side="left")  # each update's place among those of its row
  out = np.full((int(occ.max()) + 1 if occ.size else 0, nrows), -1, np.int64)
  out[occ, sr] = order
  return out


def last_of(rows: np.ndarray, nrows: int) -> np.ndarray:
  """(nrows,): the position of the last update whose row is r, or -1 (the write that wins, as onnxruntime applies them in order)."""
  out = np.full(nrows, -1, np.int64)
  np.maximum.at(out, rows, np.arange(rows.size, dtype=np.int64))
  return out


def scatter_np(data: np.ndarray, rows: np.ndarray, upd: np.ndarray, op: str) -> np.ndarray:
  """data (R, S) with upd[u] (U, S) applied to row rows[u] in order, as onnxruntime applies them (the load-time fold)."""
  out = data.copy()
  if op == "none":
    last = last_of(rows, data.shape[0])
    hit = last >= 0
    out[hit] = upd[last[hit]]
    return out
  for s in slots(rows, data.shape[0]):  # one update per row at a time, in order: exactly onnxruntime's sequence
    hit = s >= 0
    dst, src = out[hit], upd[s[hit]]
    if op == "add": out[hit] = dst + src
    elif op == "mul": out[hit] = dst * src
    elif op == "max": out[hit] = np.where(dst > src, dst, src)
    else: out[hit] = np.where(dst < src, dst, src)
  return out


def scatter_rows(data: Tensor, rows: np.ndarray | Tensor, upd: Tensor, op: str, label: str) -> Tensor:
  """data (R, S) with upd[u] (U, S) applied to row rows[u] (in [0, R)) in order: 'none' overwrites (the last of
  duplicate rows wins, as onnxruntime), add/mul/max/min combine. rows: constant (numpy) or computed (a Tensor)."""
  r, s = data.shape
  assert isinstance(r, int) and isinstance(s, int)
  u0 = upd.shape[0]
  assert isinstance(u0, int)
  dt = index_dtype(max(r, u0))
  if isinstance(rows, np.ndarray): return _scatter_const(data, rows.reshape(-1), upd, op, label, dt)
  u = u0
  eq = rows.cast(dt).reshape(1, u).eq(Tensor.arange(r, dt).reshape(r, 1))  # (R, U): update u lands on row r
  if op == "none":
    pos = eq.where(Tensor.arange(u, dt).reshape(1, u), -1).max(1)  # the last update landing on each row, or -1
    picked = upd.gather(pos.maximum(0), 0, name=label)
    return (pos >= 0).reshape(r, 1).where(picked, data)
  red = _reduce(eq.reshape(r, u, 1).where(upd.reshape(1, u, s), Tensor.full((), _identity(op, upd.dtype), upd.dtype)), op, 1)
  return eq.max(1).reshape(r, 1).where(combine(op, data, red), data)


def _scatter_const(data: Tensor, rows: np.ndarray, upd: Tensor, op: str, label: str, dt: DType) -> Tensor:
  r = data.shape[0]
  assert isinstance(r, int)
  if op == "none":
    last = last_of(rows, r)
    hit = last >= 0
    picked = upd.gather(Tensor(np.maximum(last, 0).astype(dt.np)), 0, name=label)
    return picked if hit.all() else Tensor(hit.reshape(r, 1)).where(picked, data)
  sl = slots(rows, r)
  hit = sl[0] >= 0
  g = upd.gather(Tensor(np.maximum(sl, 0).astype(dt.np)), 0, name=label)  # (m, R, S): each row's updates, slot by slot
  if sl.shape[0] == 1: red = g.reshape(g.shape[1:])
  else: red = _reduce(Tensor((sl >= 0)[:, :, None]).where(g, Tensor.full((), _identity(op, upd.dtype), upd.dtype)), op, 0)
  out = combine(op, data, red)
  return out if hit.all() else Tensor(hit.reshape(r, 1)).where(out, data)
