"""Before and beside lowering: each store simplified with the loops it had, a vector axis the width does not divide
peeled (CPU), and the kernel's figures (elements each buffer may touch, a flop and byte estimate)."""
from __future__ import annotations

import itertools
import math

from kiln.codegen.choose.base import Opt, OptOps, axis_size
from kiln.codegen.lowering.expand import simp
from kiln.ir.analysis import free_ranges, free_ranges_of, identity, reads_stored
from kiln.ir.dtype import PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import AxisType, GroupOp, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp


def drop_empty(ast: UOp) -> UOp:
  """Nothing under a range of constant size 0 ever runs: a load that uses one becomes a zero and a REDUCE over one its
  identity, before anything is simplified (the store keeps its loop and so runs zero times). Such a load's in-bounds
  proof is vacuous (no index value exists), and the empty range's bounds (vmin 0 > vmax -1) let the simplifier fold its
  gate and index to constants, which the linearizer then hoisted out of the zero-trip loop: an 8-lane UPCAST of such an
  axis read 8 doubles of a 1-element buffer at the kernel's entry (a guard-page fault, fuzz seed 1124)."""
  empty = {n for n in ast.toposort() if n.op is Ops.RANGE and n.src[0].op is Ops.CONST and n.src[0].arg <= 0}
  if not empty: return ast
  fr = free_ranges_of(ast.toposort())
  dead = {n: UOp.const(n.dtype, identity(n.arg, n.dtype)) if n.op is Ops.REDUCE else UOp.const(n.dtype, 0) for n in ast.toposort()
          if (n.op is Ops.REDUCE and set(n.src[1:]) & empty) or (n.op is Ops.LOAD and n.src[0].op is Ops.INDEX and fr[n] & empty)}
  return substitute(ast, dead) if dead else ast


def emptied_globals(ast: UOp) -> set[UOp]:
  """The buffers drop_empty leaves unread (read only under a range of constant size 0): the kernel keeps their parameters,
  as callers pass every slot the kernel names."""
  return _globals(ast) - _globals(drop_empty(ast))


def _globals(ast: UOp) -> set[UOp]: return {n for n in ast.toposort() if n.op is Ops.DEFINE_GLOBAL and n.arg >= 0}


def prepare(ast: UOp) -> tuple[UOp, dict[UOp, set[UOp]]]:
  """Simplify each store, keeping the loops it had: bounds may fold an index that uses a possibly empty range to a
  constant, but the store must still run once per iteration (zero times when the range is empty). An output axis of
  one element becomes the constant 0 (so a sum kept as shape (1,) is a full reduction the optimiser can split)."""
  ast = drop_empty(ast)
  reduced = {r for n in ast.toposort() if n.op is Ops.REDUCE for r in n.src[1:]}
  ones = {r: UOp.const(r.dtype, 0) for s in ast.src if s.op is Ops.STORE for r in free_ranges(s)
          if r.src[0].op is Ops.CONST and r.src[0].arg == 1 and r not in reduced}
  if ones: ast = substitute(ast, ones)
  orig = [s for s in ast.src if s.op is Ops.STORE]
  done = [simp(s) for s in orig]
  loops = {s: {simp(r) for r in free_ranges(o)} for s, o in zip(done, orig)}
  return UOp.sink(*done, *(s for s in ast.src if s.op is not Ops.STORE), name=ast.arg), loops


SHIFTED_SYMBOLIC_ROWS = True  # a register tile's symbolic rows as whole, shifted tiles (_shifted_rows); False: whole tiles and a scalar tail


def peel(ast: UOp, opts: list[Opt]) -> tuple[UOp, int] | None:
  """CPU: output axes whose UPCAST (vector lanes) or UNROLL (register-tile rows) does not divide them, and an output axis of
  symbolic size split either way (into whole units and a tail, as below, for every size). When the kernel reads
  none of the buffers it stores, each such static axis becomes whole tiles, the last one shifted back to overlap the one
  before it, and so do a register tile's symbolic rows (_shifted_rows). Otherwise the first is split into a main range
  the amount divides and a scalar tail range (a new axis), each store copied for the tail. Returns the new kernel and
  how many stores are main."""
  ranges = {r.arg[0]: r for r in ast.toposort() if r.op is Ops.RANGE}
  reduced = {r for n in ast.toposort() if n.op is Ops.REDUCE for r in n.src[1:]}
  outs = [(ranges[o.axis], o.amount) for o in opts if o.op in (OptOps.UPCAST, OptOps.UNROLL) and o.axis in ranges and ranges[o.axis] not in reduced]
  split = [(r, w) for r, w in outs if (n := axis_size(r)) is not None and n > w and n % w]
  symbolic = [(r, w) for r, w in outs if w > 1 and axis_size(r) is None]
  lanes = {o.axis for o in opts if o.op is OptOps.UPCAST}
  rows = [(r, w) for r, w in symbolic if r.arg[0] not in lanes]  # a register tile's rows, no vector lanes along them
  if not reads_stored(ast) and (not symbolic or SHIFTED_SYMBOLIC_ROWS and rows == symbolic and len(rows) == 1):
    if not split and not symbolic: return None
    # no stored buffer is read, so the last, partial tile can be a whole tile shifted back to end at the axis's end: it
    # recomputes, bit for bit the same, a few elements the tile before it stored (1000x1000 matmul: 230 -> 300 GFLOP/s
    # against a scalar tail; AVX2's 6-row tile against 4 rows on one Zen 3 core: 1024 rows 78 -> 85 GFLOP/s, 2048 rows
    # 71 -> 86). Where a split puts those two tiles on two threads, both write the same bytes.
    shifted = {r: _shifted_static(r, w) for r, w in split} | {r: _shifted_rows(r, w) for r, w in rows}
    stores = [s for s in ast.src if s.op is Ops.STORE]
    return UOp.sink(*[substitute(s, shifted) for s in stores], *[s for s in ast.src if s.op is not Ops.STORE], name=ast.arg), len(stores)
  if len(symbolic) + len(split) > 1 and symbolic:
    raise CodegenError(f"a split of symbolic axis {symbolic[0][0].arg[0]} beside another split that needs a tail: one axis gets a tail")
  if not split and not symbolic: return None
  if symbolic:  # whole units over (n // w) * w elements, then a tail of n % w (n may be under w: no whole unit)
    r, w = symbolic[0]
    return _main_and_tail(ast, ranges, r, r.src[0] // w * w, r.src[0] % w)
  r, w = split[0]
  size = axis_size(r)
  assert size is not None
  return _main_and_tail(ast, ranges, r, size - size % w, size % w)


def _shifted_static(r: UOp, w: int) -> UOp:
  """Range r (static, size % w > 0) as whole tiles of w, the last shifted back to end at the axis's end."""
  size = axis_size(r)
  assert size is not None
  n = -(-size // w) * w  # past int32 for an axis just under 2**31: that range is int64, its shifted index is r's dtype
  big = UOp.range(n, r.arg[0], r.arg[1], r.dtype if n <= r.dtype.max else dtypes.index64)
  return ((big - big % w).minimum(size - w) + big % w).cast(r.dtype)


def _shifted_rows(r: UOp, w: int) -> UOp:
  """A register tile's symbolic rows r (size n) as ceil(n / w) whole tiles of w, the last shifted back to end at row
  n - 1, or where n < w one tile whose rows past n - 1 repeat row n - 1: every row in [0, n), each repeat recomputing,
  bit for bit, a row the tile stores anyway. A scalar tail of rows instead ran each row alone over the whole K panel (a
  dynamic export's product over a batch of 1-3 images: the weight streamed once a row, not once a tile)."""
  n = r.src[0]
  big = UOp.range((n + (w - 1)) // w * w, r.arg[0], r.arg[1], r.dtype)
  return ((big - big % w).minimum(n - w).maximum(0) + big % w).minimum(n - 1)


def _main_and_tail(ast: UOp, ranges: dict[int, UOp], r: UOp, main_n: int | UOp, tail_n: int | UOp) -> tuple[UOp, int]:
  """The kernel with range r cut into a main range of main_n elements (r's axis id, so its options apply) and a tail
  range of tail_n after it (a new axis), each store that varies along r copied for the tail; and how many stores are main."""
  stores = [s for s in ast.src if s.op is Ops.STORE]
  others = [s for s in ast.src if s.op is not Ops.STORE]
  main = UOp.range(main_n, r.arg[0], r.arg[1], r.dtype)  # of r's dtype: they stand in for r in its index arithmetic
  tail = UOp.range(tail_n, max(ranges) + 1, r.arg[1], r.dtype)
  mains = [substitute(s, {r: main}) for s in stores]
  tails = _own_reduces([substitute(s, {r: tail + main_n}) for s in stores if r in free_ranges(s)], tail, max(ranges) + 2)
  return UOp.sink(*mains, *tails, *others, name=ast.arg), len(mains)


def _own_reduces(tails: list[UOp], tail: UOp, first_id: int) -> list[UOp]:
  """The tail's stores with each REDUCE that does not vary along the tail's range given reduce ranges of its own (new axis
  ids from first_id). The tail runs in a loop nest of its own, and such a REDUCE would otherwise be the main stores' very
  node, lowered in their nest and only read (not computed) in the tail's: two definitions of its accumulator (LLVM
  refused the kernel). The tail computes it again, its axes taking no option; a REDUCE that varies along the range is
  the tail's own already and keeps its axes' options (a register tile's multiply-adds)."""
  ids = itertools.count(first_id)
  swap: dict[UOp, UOp] = {}
  for t in tails:
    for red in t.toposort():
      if red.op is Ops.REDUCE and red not in swap and tail not in free_ranges(red) and not any(red in x.toposort() for x in swap):
        inner = {r for n in red.toposort() if n.op is Ops.REDUCE for r in n.src[1:]}
        swap[red] = substitute(red, {r: UOp.range(r.src[0], next(ids), AxisType.REDUCE, r.dtype) for r in sorted(inner, key=lambda r: r.arg[0])})
  return [substitute(t, swap) for t in tails] if swap else tails


def min_elements(ast: UOp) -> dict[int, int]:
  """Per slot, how many elements the kernel may touch (index vmax + 1) over all variable values."""
  need: dict[int, int] = {}
  for n in ast.toposort():
    if n.op is Ops.INDEX and n.src[0].op is Ops.DEFINE_GLOBAL:
      hi = n.src[1].vmax
      need[n.src[0].arg] = max(need.get(n.src[0].arg, 1), int(hi) + 1 if isinstance(hi, int) else 1)
  return need


def estimate(ast: UOp) -> tuple[int, int]:
  """Flops and bytes moved at the variables' upper bounds (a rough figure for profiles)."""
  trips: dict[UOp, int] = {}
  nodes = ast.toposort()
  free = free_ranges_of(nodes)  # every node's free ranges in one pass (free_ranges() per node was quadratic in depth)
  for n in nodes:
    if n.op is Ops.RANGE: trips[n] = max(int(n.src[0].vmax), 0)
  def iters(u: UOp) -> int:  # a REDUCE runs over its own ranges too; anything else over its free ranges
    rs = free[u] | (set(u.src[1:]) if u.op is Ops.REDUCE else set())
    return math.prod(trips[r] for r in rs) if rs else 1
  flops = sum(iters(n) for n in nodes if (n.op in GroupOp.ALU and n.dtype.is_float) or n.op is Ops.REDUCE)
  mem = 0
  touched = min_elements(ast)
  for g in {n for n in nodes if n.op is Ops.DEFINE_GLOBAL}:
    assert isinstance(g.dtype, PtrDType)
    mem += touched.get(g.arg, 1) * g.dtype.base.itemsize
  return flops, mem
