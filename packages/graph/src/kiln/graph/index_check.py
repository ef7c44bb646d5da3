"""A Gather's indices checked as onnxruntime checks them: an index outside [-n, n) is an IndexOutOfRangeError naming the
gather and the index, never a clamped read (the kernel still clamps, so memory stays safe, but that row is a wrong answer).

Constant indices are checked when the gather is made. Indices known only at run time get a *check*: one small
reduction over them that the scheduler adds to the plan as a hidden output (kiln.executor.checks), whose value is 0
when every index is in range and otherwise one of the bad indices, read after each run. It computes

    max over the indices of where(out_of_range, idx ^ MIN, MIN) ^ MIN

in the indices' own dtype (before the kernel's cast to its 32-bit index, which would wrap 2**32 + 1 to 1): XOR with the
dtype's minimum orders values as unsigned, so any bad index beats the in-range marker MIN, and XOR again gives back the
index itself, while no bad index gives 0 (0 is always in range). Unsigned indices need no XOR. The kernel writes the
whole value each run, so nothing is reset between runs."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.graph.dims import fmt_shape, is_static
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, Node, prod
from kiln.ir.dtype import DType, dtypes
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops


def out_of_range(size: int) -> str: return f"is out of range [-{size}, {size})"


def bad_index(idx: np.ndarray, size: int) -> int | None:
  """The first index of a constant array outside [-size, size), or None."""
  flat = np.asarray(idx).reshape(-1)
  bad = flat[(flat < -size) | (flat >= size)]
  return int(bad[0]) if bad.size else None


def gather_node(table: Node, ind: Node, axis: int, shape: tuple[Dim, ...], name: str | None) -> Node:
  """The GATHER node of table[..., ind, ...] along axis (arg: (axis, label)), its constant indices checked now."""
  size = table.shape[axis]
  assert isinstance(size, int)  # Tensor.gather requires a static gathered axis
  label = name or "gather"
  empty = is_static(ind.shape) and prod(ind.shape) == 0
  if size == 0 and not empty: raise GraphError(f"{label}: gathers from axis {axis} of {fmt_shape(table.shape)}, which is empty")
  if (data := ind.data) is not None and (bad := bad_index(data, size)) is not None:
    raise IndexOutOfRangeError(f"{_where(label, axis, table)}: index {bad} {out_of_range(size)}", bad)
  return Node("GATHER", (table, ind), (axis, label), shape, table.dtype)


def _where(label: str, axis: int, table: Node) -> str:
  # a gather from 0..n-1 (an IOTA) is another op's index wrapped and checked (kiln.graph.indexing): its label names the place
  return label if table.op == "IOTA" else f"{label} (axis {axis} of {fmt_shape(table.shape)})"


def gather_checks(nodes: Sequence[Node]) -> list[tuple[Node, str]]:
  """(check node, message with {value}) for each GATHER among nodes whose indices are not constant and can be out of range."""
  out = []
  for n in nodes:
    if n.op != "GATHER" or n.src[1].data is not None: continue
    (axis, label), (table, ind) = n.arg, n.src
    if (c := _check(ind, table.shape[axis])) is not None:
      out.append((c, f"{_where(label, axis, table)}: index {{value}} {out_of_range(table.shape[axis])}"))
  return out


def _check(ind: Node, size: int) -> Node | None:
  dt = ind.dtype
  low, high = not dt.is_unsigned and int(dt.min) < -size, int(dt.max) > size - 1  # can a value of dt fall below, above?
  if not (low or high) or (is_static(ind.shape) and prod(ind.shape) == 0): return None
  shape = ind.shape
  def const(v: int) -> Node:
    c = Node("CONST", (), dt.np.type(v).item(), (), dt)
    if not shape: return c
    c = Node("VIEW", (c,), ("reshape", (1,) * len(shape)), (1,) * len(shape), dt)
    return Node("VIEW", (c,), ("expand", shape), shape, dt)
  def alu(op: Ops, *src: Node, out: DType | None = None) -> Node: return Node("ALU", src, op, src[0].shape, out or src[-1].dtype)
  oob = alu(Ops.CMPLT, const(size - 1), ind, out=dtypes.bool) if high else None
  if low:
    below = alu(Ops.CMPLT, ind, const(-size), out=dtypes.bool)
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
