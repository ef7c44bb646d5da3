"""A Gather's indices checked as onnxruntime checks them: an index outside [-n, n) is an IndexOutOfRangeError naming the
gather and the index, never a clamped read (the kernel still clamps, so memory stays safe, but that row is a wrong answer).

Constant indices are checked when the gather is made. Indices known only at run time get a *check*: one small
reduction over them that the scheduler adds to the plan as a hidden output (kiln.executor.checks), whose value is 0
when every index is in range and otherwise one of the bad indices, read after each run. It computes

    max over the indices of where(out_of_range, idx ^ MIN, MIN) ^ MIN

in the indices' own dtype (before the kernel's cast to its 32-bit index, which would wrap 2**32 + 1 to 1): XOR with the
dtype's minimum orders values as unsigned, so any bad index beats the in-range marker MIN, and XOR again gives back the
index itself, while no bad index gives 0 (0 is always in range). Unsigned indices need no XOR. The kernel writes the
whole value each run, so nothing is reset between runs.

A symbolic gathered axis (batch*seq rows) has its size only at run time: the check compares with that size (the dim's
value in the kernel), widening the indices to int64 for the comparison where the size may not fit their dtype, and
constant indices are checked now only against the dim's bounds (outside [-max, max) is an error at once; outside
[-min, min) gets a run-time check, like computed indices)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.graph.dims import dmax, dmin, fmt, fmt_shape, is_static
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, Node, prod
from kiln.ir.dtype import DType, dtypes
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp


def out_of_range(size: Dim) -> str: return f"is out of range [-{fmt(size)}, {fmt(size)})"


def bad_index(idx: np.ndarray, size: Dim) -> int | None:
  """The first index of a constant array outside [-size, size) for every value of size (its upper bound), or None."""
  flat, n = np.asarray(idx).reshape(-1), dmax(size)
  bad = flat[(flat < -n) | (flat >= n)]
  return int(bad[0]) if bad.size else None


def _always_in_range(idx: np.ndarray, size: Dim) -> bool:
  """Whether every index of a constant array is in [-size, size) for every value of size (its lower bound)."""
  flat, n = np.asarray(idx).reshape(-1), dmin(size)
  return not flat.size or bool(((flat >= -n) & (flat < n)).all())


def gather_node(table: Node, ind: Node, axis: int, shape: tuple[Dim, ...], name: str | None, in_range: bool = False) -> Node:
  """The GATHER node of table[..., ind, ...] along axis (arg: (axis, label, checked)), its constant indices checked now.
  in_range: the caller built the indices so that each is in [0, size) (a walk over tables kiln made at load): no run-time
  check (the kernel clamps every gathered index all the same, so a wrong claim reads inside the table, never outside)."""
  size = table.shape[axis]
  label = name or "gather"
  empty = is_static(ind.shape) and prod(ind.shape) == 0
  if size == 0 and not empty: raise GraphError(f"{label}: gathers from axis {axis} of {fmt_shape(table.shape)}, which is empty")
  if (data := ind.data) is not None and (bad := bad_index(data, size)) is not None:
    raise IndexOutOfRangeError(f"{_where(label, axis, table)}: index {bad} {out_of_range(size)}{_bounds(size)}", bad)
  return Node("GATHER", (table, ind), (axis, label, not in_range), shape, table.dtype)


def _bounds(size: Dim) -> str: return f" for every {fmt(size)} up to {dmax(size)}" if isinstance(size, UOp) else ""


def _where(label: str, axis: int, table: Node) -> str:
  # a gather from 0..n-1 (an IOTA) is another op's index wrapped and checked (kiln.graph.indexing): its label names the place
  return label if table.op == "IOTA" else f"{label} (axis {axis} of {fmt_shape(table.shape)})"


def gather_checks(nodes: Sequence[Node]) -> list[tuple[Node, str]]:
  """(check node, message with {value}) for each GATHER among nodes whose indices are not constant and can be out of range."""
  out = []
  for n in nodes:
    if n.op != "GATHER": continue
    (axis, label, checked), (table, ind) = n.arg, n.src
    if not checked: continue  # in range by construction (gather_node's in_range)
    if (data := ind.data) is not None and _always_in_range(data, table.shape[axis]): continue  # checked when the gather was made
    if (c := _check(ind, table.shape[axis])) is not None:
      out.append((c, f"{_where(label, axis, table)}: index {{value}} {out_of_range(table.shape[axis])}"))
  return out


def _check(ind: Node, size: Dim) -> Node | None:
  dt = ind.dtype
  lo, hi = dmin(size), dmax(size)
  low, high = not dt.is_unsigned and int(dt.min) < -lo, int(dt.max) > lo - 1  # can a value of dt fall below, above, for some size?
  if not (low or high) or (is_static(ind.shape) and prod(ind.shape) == 0): return None
  shape = ind.shape
  def const(v: Dim, t: DType = dt) -> Node:  # v a symbolic dim: its value at run time
    c = Node("CONST", (), v if isinstance(v, UOp) else t.np.type(v).item(), (), t)
    if not shape: return c
    c = Node("VIEW", (c,), ("reshape", (1,) * len(shape)), (1,) * len(shape), t)
    return Node("VIEW", (c,), ("expand", shape), shape, t)
  def alu(op: Ops, *src: Node, out: DType | None = None) -> Node: return Node("ALU", src, op, src[0].shape, out or src[-1].dtype)
  # compared in dt where -size and size - 1 fit it for every size, else in int64 (a wider dt than the size's int32 already fits)
  ct = dt if hi - 1 <= int(dt.max) and (not low or -hi >= int(dt.min)) else dtypes.int64
  wide = ind if ct == dt else alu(Ops.CAST, ind, out=ct)
  def last() -> Node: return alu(Ops.SUB, const(size, ct), const(1, ct)) if isinstance(size, UOp) else const(size - 1, ct)
  def first() -> Node: return alu(Ops.NEG, const(size, ct)) if isinstance(size, UOp) else const(-size, ct)
  oob = alu(Ops.CMPLT, last(), wide, out=dtypes.bool) if high else None
  if low:
    below = alu(Ops.CMPLT, wide, first(), out=dtypes.bool)
    oob = below if oob is None else alu(Ops.OR, oob, below)
  assert oob is not None
  marker = 0 if dt.is_unsigned else int(dt.min)
  key = ind if dt.is_unsigned else alu(Ops.XOR, ind, const(marker))
  v = alu(Ops.WHERE, oob, key, const(marker))
  if shape:
    v = Node("REDUCE", (v,), (Ops.MAX, tuple(range(len(shape)))), (1,) * len(shape), dt)
  if dt.is_unsigned: return v
  m = Node("CONST", (), dt.np.type(marker).item(), (), dt)
  if v.shape: m = Node("VIEW", (m,), ("reshape", v.shape), v.shape, dt)
  return alu(Ops.XOR, v, m)
