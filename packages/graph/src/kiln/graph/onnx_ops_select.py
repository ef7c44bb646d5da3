"""The ONNX operators that select by value: TopK, NonZero and Unique, registered in onnx_ops.OPS (onnx.py imports this
module for that). kiln has no sort kernel and no kernel that writes where data says, so each is comparisons, selects and
reductions, in kernels.

TopK (k known at load, or computed at run time: a length in [0, the axis] read back, the rest of the model compiled once for
a runtime variable each run binds, specialise.py). Along the axis the elements take one strict order, onnxruntime's: the
larger (largest=1) or smaller value first, NaN above every number (first for largest, last for smallest), equal values (NaNs
among themselves, -0.0 and 0.0) by the lower index. Two ways to put the axis in that order, by a cost rule on its length n:
  - rank by counting (n <= RANK_MAX_N): each element's place is how many elements come before it (n * n compares summed in
    one kernel), and output place p takes the element whose place is p (k * n): two kernels, cheap while n * n is;
  - a bitonic sort (longer axes: a detector's top-1000 of its anchors): the axis padded to a power of two n2 (the pads after
    every element) goes through log2(n2) * (log2(n2) + 1) / 2 compare-exchange stages, each an elementwise kernel over
    n2 elements reading its partner (i ^ j) as a view, so n2 * log2(n2)^2 / 2 work and no gather; stages with the same j
    compile once (the stage's direction is a constant array the kernel reads).
sorted=0 gives the sorted order too (the spec leaves that order open). Values are moved, never recomputed (exact).

NonZero and Unique: the output's length depends on the data. A kernel computes it (the count of nonzeros, of distinct
values) and OnnxNode.read_back makes it a length read back at run time: the converter cuts the model before the node and
converts the rest once, at load, with the count as a runtime variable c in [0, numel]; each run reads the count back and
binds c (specialise.py: one compile for every count; the rest falls back to a compile per count only where it needs the
count as a number). Given the count c, the output is kernels again:
  - NonZero: the inclusive prefix sums P of the nonzero mask (a blocked scan: sums inside blocks of SCAN_BLOCK, the blocks'
    totals scanned the same way, linear work), then the position of the k-th nonzero, k < c, is #{i : P[i] < k + 1}, found
    by a binary search on P (one kernel per bit of the length, all the same kernel: its step is an array it reads);
  - Unique: rows (the elements, or the slices along axis) compared all against all (n * n * row length, at most
    UNIQUE_MAX_WORK): a row is first when no earlier row equals it; the first rows' order (by value, rows compared
    lexicographically, or by first occurrence) is a count of the first rows before each.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.indexing import index_dtype
from kiln.graph.onnx_ops import OnnxNode, Value, _norm, _op
from kiln.graph.specialise import Length
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

RANK_MAX_N = 1024  # TopK ranks by counting up to this axis length (n * n compares in one kernel); a bitonic sort above it
SCAN_BLOCK = 64  # NonZero's prefix sums: each block's by a masked sum (SCAN_BLOCK compares an element)
UNIQUE_MAX_WORK = 1 << 26  # Unique's all-against-all compares (n * n * row length) kiln does in kernels; refused above


# ---- the order TopK puts an axis in ----
def _before(a: Tensor, ai: Tensor, b: Tensor, bi: Tensor, largest: bool) -> Tensor:
  """Whether element a (at index ai) comes before b (at bi): the larger (smaller) first, NaN above every number, equal
  values (NaNs among themselves) by the lower index. A strict total order: exactly one of two elements comes first."""
  if a.dtype.is_float:
    na, nb = a.ne(a), b.ne(b)
    strict = (na & nb.logical_not()) | (a > b) if largest else (nb & na.logical_not()) | (a < b)
    tie = a.eq(b) | (na & nb)
  else: strict, tie = (a > b if largest else a < b), a.eq(b)
  return strict | (tie & (ai < bi))


def _by_rank(x: Tensor, k: Dim, largest: bool, label: str) -> tuple[Tensor, Tensor]:
  """The first k of each row of x (B, n) in order, by counting each element's place."""
  b, n = x.shape[0], sym.static_dim("TopK", x.shape, 1)  # b: the rows, a symbolic batch too
  dt = index_dtype(sym.mul(b, n))
  i = Tensor.arange(n, dt)
  place = _before(x.unsqueeze(-2), i.reshape(1, 1, n), x.unsqueeze(-1), i.reshape(1, n, 1), largest).cast(dt).sum(-1).contiguous()  # (B, n)
  hit = place.unsqueeze(1).eq(Tensor.arange(k, dt).reshape(1, k, 1))  # (B, k, n): exactly one element a place
  idx = hit.where(i.reshape(1, 1, n), Tensor.full((), 0, dt)).sum(-1)  # (B, k)
  rows = idx if isinstance(b, int) and b == 1 else idx + Tensor.arange(b, dt).reshape(b, 1) * n
  return x.reshape(sym.mul(b, n)).gather(rows, 0, name=label), idx


def _bitonic(x: Tensor, k: Dim, largest: bool) -> tuple[Tensor, Tensor]:
  """The first k of each row of x (B, n) in order, by a bitonic sort of the row padded to a power of two (pads last). A
  symbolic n is padded to the power of two of its upper bound, the pads told by the run-time value of n."""
  b, n = x.shape  # a symbolic batch of rows too (with a static axis)
  n2 = 1 << (sym.dmax(n) - 1).bit_length()
  dt = index_dtype(n2)
  key = x.pad(((0, 0), (0, sym.sub(n2, n)))) if n2 != n else x
  last: Tensor | int = n - 1 if isinstance(n, int) else Tensor.dim_value(n, dt) - 1  # the last element's index: after it, pads
  idx = Tensor.arange(n2, dt).reshape(1, n2).expand(b, n2)
  lower = Tensor(np.array([True, False]).reshape(1, 1, 2, 1))  # the first element of each compared pair
  size = 2
  while size <= n2:
    j = size // 2
    while j >= 1:
      g = n2 // (2 * j)
      kv, iv = key.reshape(b, g, 2, j), idx.reshape(b, g, 2, j)
      pk, pi = (Tensor.cat([t.slice([1], [2], [2]), t.slice([0], [1], [2])], 2) for t in (kv, iv))  # each element's partner, i ^ j
      up = Tensor(((np.arange(g) * 2 * j // size) % 2 == 0).reshape(1, g, 1, 1))  # this block sorts into the order (else against it)
      pad_p, pad_s = pi > last, iv > last
      partner_first = (pad_s & pad_p.logical_not()) | (pad_s.eq(pad_p) & _before(pk, pi, kv, iv, largest))
      take = lower.eq(up).eq(partner_first)  # the first of a pair in an up block takes the one that comes first, and so on
      key, idx = (take.where(p, s).contiguous().reshape(b, n2) for p, s in ((pk, kv), (pi, iv)))
      j //= 2
    size *= 2
  return key.slice([0], [k], [1]), idx.slice([0], [k], [1])  # type: ignore[list-item]  # a symbolic k: a slice to a dim


def _k(n: OnnxNode, d: Dim) -> Dim:
  """TopK's k: the attribute (opset < 10), a constant, or one computed at run time, a length in [0, d] each run binds (d's
  run-time value checked by the run where the axis is symbolic)."""
  if n.opset < 10: return int(n.attr("k"))
  kin = n.ins[1] if len(n.ins) > 1 else None
  if isinstance(kin, Tensor) and 1 not in n.from_shape:
    if sym.max_numel(kin.shape) != 1 or not kin.dtype.is_int:
      raise n.error(f"input 1 (k) must be one integer, got {kin.dtype.name} {sym.fmt_shape(kin.shape)}")
    return _count(n.read_back("k", [kin.reshape(1)], length=Length(sym.dmax(d), at_most=d if isinstance(d, UOp) else None)))
  kv = n.const(1, "k").reshape(-1)
  if kv.size != 1 or kv.dtype.kind not in "iu": raise n.error(f"input 1 (k) must be one integer, got {kv.dtype} of shape {kv.shape}")
  return int(kv[0])


def _topk(n: OnnxNode) -> list[Value]:
  x = n.t(0)
  if x.ndim == 0: raise n.error("input 0 must have at least one axis")
  a = _norm(n.attr("axis", -1), x.ndim, n)
  largest, _ = bool(n.attr("largest", 1)), n.attr("sorted", 1)
  shape = x.shape
  d = shape[a]
  if not isinstance(d, int):
    sym.require_static("TopK", shape, [i for i in range(x.ndim) if i != a], "(with its axis symbolic, the other axes must be fixed)")
  kk = _k(n, d)
  if isinstance(kk, int) and not 0 <= kk <= sym.dmin(d):
    raise n.error(f"k = {kk} must be in [0, {sym.fmt(d)}] (axis {a} of {sym.fmt_shape(shape)}" +
                  ("" if isinstance(d, int) else f": {sym.fmt(d)} may be as small as {sym.dmin(d)}") + ")")
  out = shape[:a] + (kk,) + shape[a + 1:]
  if isinstance(kk, int) and kk == 0:  # nothing to select: empty arrays (the other axes are static)
    return [np.zeros(sym.static_shape("TopK", out), x.dtype.np), np.zeros(sym.static_shape("TopK", out), np.int64)]
  if x.dtype.is_bool: raise n.error("input 0 must be numbers, got bool")
  order = [i for i in range(x.ndim) if i != a] + [a]
  lead = tuple(shape[i] for i in order[:-1])
  rows = x.permute(order).reshape(sym.mul(*lead) if lead else 1, d)
  rank = isinstance(d, int) and d <= RANK_MAX_N
  vals, idx = _by_rank(rows, kk, largest, f"node {n.name} ({n.op})") if rank else _bitonic(rows, kk, largest)
  back = [order.index(i) for i in range(x.ndim)]
  return [t.reshape(*lead, kk).permute(back) for t in (vals, idx.cast(dtypes.int64))]


# ---- NonZero ----
def _scan(m: Tensor) -> Tensor:
  """The inclusive prefix sums of m (N,): sums inside blocks of SCAN_BLOCK, then each block's offset, the exclusive scan
  of the blocks' totals (the same scan, a level up). Realized: its readers gather from it."""
  (size,) = sym.static_shape("NonZero", m.shape)
  zero = Tensor.full((), 0, m.dtype)
  if size <= SCAN_BLOCK: return Tensor(np.tri(size, dtype=np.bool_)).where(m.reshape(1, size), zero).sum(-1).contiguous()
  nb = -(-size // SCAN_BLOCK)
  blocks = (m.pad(((0, nb * SCAN_BLOCK - size),)) if nb * SCAN_BLOCK > size else m).reshape(nb, 1, SCAN_BLOCK)
  local = Tensor(np.tri(SCAN_BLOCK, dtype=np.bool_)).reshape(1, SCAN_BLOCK, SCAN_BLOCK).where(blocks, zero).sum(-1).contiguous()
  total = local.slice([SCAN_BLOCK - 1], [SCAN_BLOCK], [1]).reshape(nb)
  offsets = _scan(total) - total
  return (local + offsets.reshape(nb, 1)).reshape(nb * SCAN_BLOCK).slice([0], [size], [0]).contiguous()


def _count(v: Any) -> Dim:
  """A count read back: a number (known at load), or the runtime variable it binds (OnnxNode.read_back)."""
  return v if isinstance(v, UOp) else int(np.asarray(v).reshape(-1)[0])


def nth_set(m: Tensor, count: Dim, label: str) -> Tensor:
  """The positions of the first `count` ones of the 0/1 vector m (N,), in order: for the k-th, #{i : P[i] < k + 1} of the
  prefix sums P, by a binary search, one realized kernel a bit."""
  (size,) = sym.static_shape("NonZero", m.shape)
  p = _scan(m)
  dt = p.dtype
  k1 = Tensor.arange(count, dt) + 1
  pos = Tensor.full((count,), 0, dt)
  step = 1 << (size.bit_length() - 1)
  while step >= 1:
    cand = pos + Tensor(np.array([step], dt.np))  # the step as an array the kernel reads: every round is the same kernel
    ok = p.gather(cand.minimum(size) - 1, 0, name=label) < k1
    pos = ok.where(cand, pos).contiguous()
    step //= 2
  return pos


def _unravel(flat: Tensor, shape: tuple[int, ...]) -> Tensor:
  """(rank, c) int64: each flat position's index along each axis of shape."""
  f = flat.cast(dtypes.int64)
  out, stride = [], math.prod(shape)
  for d in shape:
    stride //= d
    q = f._bin(Ops.IDIV, stride) if stride > 1 else f
    out.append(q - q._bin(Ops.IDIV, d) * d if d > 1 else q * 0)
  return Tensor.stack(out, 0)


def _nonzero(n: OnnxNode) -> Value:
  x = n.ins[0]
  if x is None: raise n.error("input 0 is missing")
  if isinstance(x, np.ndarray): return np.array(np.nonzero(x.reshape(-1) if x.ndim == 0 else x), np.int64).reshape(max(x.ndim, 1), -1)
  t = n.t(0)
  shape = sym.static_shape("NonZero", t.shape) or (1,)  # a scalar counts as one element of one axis, as onnxruntime
  size = math.prod(shape)
  dt = index_dtype(size + 1)
  m = (t if t.dtype.is_bool else t.ne(Tensor.full((), 0, t.dtype))).reshape(size).cast(dt)
  count = _count(n.read_back("the count of nonzero elements", [m.sum()], length=Length(size)))
  if count == 0: return np.zeros((len(shape), 0), np.int64)
  return _unravel(nth_set(m, count, f"node {n.name} ({n.op})"), shape)


# ---- Unique ----
def _rows_equal(r: Tensor) -> Tensor:
  """(n, n) bool: row i of r (n, m) equals row j (NaN equals NaN: one distinct value, as numpy's unique)."""
  a, b = r.unsqueeze(1), r.unsqueeze(0)
  same = a.eq(b) | (a.ne(a) & b.ne(b)) if r.dtype.is_float else a.eq(b)
  return same.logical_not().cast(dtypes.int32).sum(-1).eq(Tensor.full((), 0, dtypes.int32))


def _rows_less(r: Tensor) -> Tensor:
  """(n, n) bool: row i of r (n, m) is lexicographically below row j (NaN above every number)."""
  m = sym.static_dim("Unique", r.shape, 1)
  a, b = r.unsqueeze(1), r.unsqueeze(0)
  if r.dtype.is_float:
    na, nb = a.ne(a), b.ne(b)
    diff, less = (a.ne(b) & (na & nb).logical_not()), (nb & na.logical_not()) | (a < b)
  else: diff, less = a.ne(b), a < b
  col = Tensor.arange(m, dtypes.int32).reshape(1, 1, m)
  first = diff.where(col, Tensor.full((), m, dtypes.int32)).min(-1, keepdims=True)  # the first column where they differ (m: none)
  return (col.eq(first) & less).cast(dtypes.int32).sum(-1).eq(Tensor.full((), 1, dtypes.int32))


def _unique(n: OnnxNode) -> list[Value]:
  x = n.t(0)
  axis, ordered = n.attr("axis"), bool(n.attr("sorted", 1))
  shape = sym.static_shape("Unique", x.shape)
  if axis is None: rows, a = x.reshape(math.prod(shape), 1), None
  else:
    a = _norm(int(axis), x.ndim, n)
    rows = x.permute([a] + [i for i in range(x.ndim) if i != a]).reshape(shape[a], -1)
  cnt, width = sym.static_shape("Unique", rows.shape)
  if cnt * cnt * width > UNIQUE_MAX_WORK:
    raise n.error(f"{cnt} rows of {width} compared all against all is {cnt * cnt * width} compares, over kiln's UNIQUE_MAX_WORK = {UNIQUE_MAX_WORK}")
  dt = index_dtype(cnt + 1)
  i = Tensor.arange(cnt, dt)
  eq = _rows_equal(rows).contiguous()  # (n, n)
  earlier = i.reshape(cnt, 1) < i.reshape(1, cnt)  # [j, i]: j before i
  first = (eq & earlier).cast(dt).sum(0).eq(Tensor.full((), 0, dt))  # (n,): no earlier row equals it
  total = first.cast(dt).sum()
  known = isinstance(n.ins[0], np.ndarray)  # a constant input: counted now, the whole node folds at load
  count = _count(total.numpy() if known else n.read_back("the count of distinct values", [total], length=Length(cnt)))
  before = _rows_less(rows) if ordered else earlier  # [j, i]: j's value (or first occurrence) comes before i's
  zero = Tensor.full((), 0, dt)
  place = (first.reshape(cnt, 1) & before).where(Tensor.full((), 1, dt), zero).sum(0).contiguous()  # (n,): a first row's place
  hit = (first & place.eq(Tensor.arange(count, dt).reshape(count, 1)))  # (c, n)
  idx = hit.where(i.reshape(1, cnt), zero).sum(-1).contiguous()  # (c,): the first occurrence of each distinct value
  label = f"node {n.name} ({n.op})"
  y = rows.gather(idx, 0, name=label)
  y = y.reshape(count) if a is None else y.reshape(count, *[shape[j] for j in range(x.ndim) if j != a]).permute(
    [j + 1 for j in range(a)] + [0] + list(range(a + 1, x.ndim)))
  inverse = (first.reshape(cnt, 1) & eq).where(place.reshape(cnt, 1), zero).sum(0)  # (n,): the place of its value's first row
  counts = eq.cast(dt).sum(1).gather(idx, 0, name=label)
  return [y, idx.cast(dtypes.int64), inverse.cast(dtypes.int64), counts.cast(dtypes.int64)]


_op("TopK", _topk, "axis k largest sorted")
_op("NonZero", _nonzero)
_op("Unique", _unique, "axis sorted")
