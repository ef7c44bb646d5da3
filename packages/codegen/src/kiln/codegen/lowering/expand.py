"""Expansion, the expression work of lowering: memoised simplification, the unroll variables a value depends on, one
unrolled copy of a value, and vectorising a scalar graph over the lanes of the UPCAST axis."""
from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping

from kiln.codegen.choose.base import affine_coeff
from kiln.codegen.lowering.index_width import may_wrap
from kiln.ir.dtype import PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp

# lowering simplifies the same small index graphs again and again (per lane, per unrolled copy): simplify keeps every
# node's result between calls (its memo), so a repeated graph costs one lookup
simp = simplify


def simplify_indices(u: UOp) -> UOp:
  """Simplify only the index and gate of every INDEX: what contiguity checks and bounds need. The values themselves are
  left to LLVM/nvcc, which fold constants too, so each unrolled copy does not pay for a whole-graph rewrite."""
  m = {n: _simplified_index(n, n.src) for n in u.toposort() if n.op is Ops.INDEX}
  return substitute(u, {k: v for k, v in m.items() if v is not k})


def _simplified_index(n: UOp, src: tuple[UOp, ...]) -> UOp:
  """INDEX n over sources src (its own, or an unrolled copy's) with its index and gate simplified."""
  return UOp(Ops.INDEX, n.dtype, (src[0], *(simp(s) for s in src[1:])))


def bcast(u: UOp, w: int) -> UOp:
  if u.dtype.kind == "p" or u.dtype.count == w or w == 1: return u
  return UOp(Ops.VECTORIZE, u.dtype.vec(w), (u,) * w)


def combine(op: Ops, a: UOp, b: UOp) -> UOp: return UOp(op, a.dtype, (a, bcast(b, a.dtype.count)))


def combos(vars_: list[UOp]) -> list[tuple[int, ...]]:
  return list(itertools.product(*(range(v.arg[2] + 1) for v in vars_)))


def gate_loads(u: UOp, gate: UOp) -> UOp:
  """Add `gate` to every INDEX under u, so lanes past the end of a group-strided loop read nothing."""
  m = {n: UOp(Ops.INDEX, n.dtype, (n.src[0], n.src[1], gate if len(n.src) == 2 else n.src[2] & gate)) for n in u.toposort()
       if n.op is Ops.INDEX and n.src[0].op is Ops.DEFINE_GLOBAL}
  return substitute(u, m)


def unroll_vars(u: UOp, red_vars: Mapping[UOp, list[UOp]]) -> list[UOp]:
  """The unroll variables u depends on, those of its reduces' results (red_vars: placeholder -> variables) included.
  Vector lanes are vectorize's, not copies."""
  out: list[UOp] = []
  for n in u.toposort():
    found = [n] if n.op is Ops.DEFINE_VAR and n.arg[0].startswith("unroll.") else red_vars.get(n, [])
    out += [v for v in found if v not in out]
  return sorted(out, key=lambda v: v.arg[0])


def unrolled(u: UOp, combo: dict[UOp, int]) -> UOp:
  """One unrolled copy of u: its unroll variables become this copy's constants, and a select whose test they decide
  (a stack's chain of selects on an axis unrolled whole: opt._selected_axes) is its chosen arm, so the copy holds only
  its own piece instead of every piece for LLVM to fold (a stack of 64 twelve-op pieces: 3.7 -> 1.6 s to compile). Integer
  tests only: a float compare of constants keeps its select (NaN's order is the renderer's business). Every INDEX comes
  out simplified (simplify_indices): those the variables reach per copy, the rest once for all of u's copies."""
  if not combo: return u
  m: dict[UOp, UOp] = {v: UOp.const(v.dtype, c) for v, c in combo.items()}
  out: dict[UOp, UOp] = {}
  base, reached = _reached(u, tuple(sorted(combo, key=lambda v: v.arg[0])))
  for n in reached:
    if n in m: out[n] = m[n]; continue
    src = tuple(out.get(s, s) for s in n.src)
    if n.op is Ops.WHERE and (c := src[0]).op is Ops.CMPLT and all(x.op is Ops.CONST and not x.dtype.is_float for x in c.src):
      out[n] = src[1] if c.src[0].arg < c.src[1].arg else src[2]
      continue
    if n.op is Ops.INDEX: out[n] = _simplified_index(n, src)
    else: out[n] = n if all(a is b for a, b in zip(src, n.src)) else n.replace(src=src)
  return out.get(base, base)


@functools.lru_cache(maxsize=64)
def _reached(u: UOp, vars_: tuple[UOp, ...]) -> tuple[UOp, tuple[UOp, ...]]:
  """simplify_indices(u), and its nodes that vars_ reach (the variables among them), sources first: all an unrolled copy
  rebuilds. Cached: each copy of u asks again, and the rest of u (its other indices simplified) is shared by them all.
  A few entries: a kernel's copies ask one after another, and each entry keeps a whole kernel graph alive."""
  base, found = simplify_indices(u), set(vars_)
  order: list[UOp] = []
  for n in base.toposort():
    if n in found or any(s in found for s in n.src):
      found.add(n)
      order.append(n)
  return base, tuple(order)


def vectorize(u: UOp, vec: tuple[UOp, int], masked: bool = False) -> UOp:
  """Turn the scalar graph u (in terms of the lane variable) into vector ops over the lanes; vec is (lane variable, width).
  masked (CPU, masked loads): a gated load of contiguous lanes is one load under a vector of per-lane gates, not a gather
  of gated scalars; a load of lanes STRIDE_LOADS apart (a 2x2 pool's rows) one load of the span under a mask of every
  stride-th lane, its lanes then picked out (a shuffle), not a gather."""
  lane, w = vec
  vdep: set[UOp] = set()
  out: dict[UOp, UOp] = {}
  for n in u.toposort():
    if n is lane:
      out[n] = UOp(Ops.VECTORIZE, lane.dtype.vec(w), tuple(UOp.const(lane.dtype, i) for i in range(w)))
      vdep.add(n)
      continue
    if not any(s in vdep for s in n.src) or n.op in (Ops.GEP, Ops.DEFINE_ACC) or (n.op is Ops.LOAD and n.src[0].op is Ops.DEFINE_ACC):
      # scalar, or a vector already: accumulators of these lanes and their reads (another width, as in the fold of a row
      # reduce's own lanes, is no lane of these)
      out[n] = n
      if n.dtype.count == w: vdep.add(n)
      continue
    vdep.add(n)
    if n.op is Ops.INDEX: out[n] = n; continue  # (rewritten by its LOAD/STORE)
    if n.op is Ops.LOAD: out[n] = _vload(n, lane, w, out if masked else None); continue
    if n.op is Ops.STORE: out[n] = _vstore(n, out[n.src[1]], lane, w); continue
    if n.op in GroupOp.ALU or n.op in (Ops.CAST, Ops.BITCAST):
      srcs = tuple(bcast(out[s], w) for s in n.src)
      dt = n.dtype.vec(w) if n.dtype.kind != "p" and n.dtype.count == 1 else n.dtype
      out[n] = UOp(n.op, dt, srcs, n.arg)
      continue
    raise CodegenError(f"cannot vectorise {n.op}")
  return out[u]


@functools.lru_cache(maxsize=1 << 14)
def _lanes(idx: UOp, lane: UOp, w: int) -> tuple[UOp, ...]:
  # memoised: unrolled copies share most of their loads (a Winograd transform's 36 outputs read one window), and each
  # gathered load costs w substitutions and simplifications. A value of these lanes already a vector (a reduction's
  # accumulator read as a gather's index) gives each lane its own element.
  vecs = _lane_vectors(idx, w)
  return tuple(simp(substitute(idx, {lane: UOp.const(lane.dtype, i), **{v: UOp(Ops.GEP, v.dtype.scalar(), (v,), i) for v in vecs}}))
               for i in range(w))


@functools.lru_cache(maxsize=1 << 14)
def _lane_vectors(idx: UOp, w: int) -> tuple[UOp, ...]:
  """The values in a scalar index that are vectors of the lanes already (vectorize keeps accumulators and their reads as
  they are): an index over one varies by lane whatever its lane variable's coefficient says."""
  return tuple(n for n in idx.toposort() if n.dtype.count == w and n.dtype.kind != "p")


STRIDE_LOADS = (2, 3, 4)  # lane strides loaded as one masked span (at most 64 elements) and shuffled
# a load whose lanes follow none of _vload's patterns is one gather (llvm.masked.gather) of the vectorised index under the lanes'
# gates, not a scalar load per lane: a Winograd input transform's windows (tiles that cross tile rows, read under the
# padding's gate) were 16 index computations, selects and loads a vector, each lane's index simplified in Python
VECTOR_GATHERS = True
_GATHER_ITEMS = (4, 8)  # element sizes gathered (float32/int32, float64/int64): not bool's or bfloat16's, which have memory forms of their own


def _phase(first: UOp, c: int) -> int:
  """first % c where the index says (a 2x2 pool's right column: 2*x + 1 is 1), else 0. A load of lanes c apart that
  starts at phase o reads the span from first - o (a multiple of c, so never before the buffer) with every c-th lane
  from o on: the pool's left and right columns then read the same span, one load with its lanes picked two ways, and
  LLVM keeps the max on the picked vectors (16 full lanes) instead of on two half-empty spans (CNN pool over 32x32x32
  maps of 32 images: 6 -> 3 vector maxima per 16 outputs, llvm.maximum being six instructions each)."""
  m = simp(first % c)
  return int(m.arg) if m.op is Ops.CONST and 0 < int(m.arg) < c else 0


def _vload(ld: UOp, lane: UOp, w: int, vec_of: Mapping[UOp, UOp] | None = None) -> UOp:
  buf, idx, *gate = ld.src[0].src
  dt = ld.dtype
  c = affine_coeff(idx, lane) if not _lane_vectors(idx, w) else None
  if vec_of is not None and not gate and c in STRIDE_LOADS and c * w <= 64:
    # the span's elements at every c-th lane only are read (the mask), so it never reads past the last lane's element
    first = simp(substitute(idx, {lane: UOp.const(lane.dtype, 0)}))
    o = _phase(first, c)
    mask = UOp(Ops.VECTORIZE, dtypes.bool.vec(c * w), tuple(UOp.const(dtypes.bool, i % c == o) for i in range(c * w)))
    span = UOp(Ops.LOAD, dt.vec(c * w), (UOp(Ops.INDEX, buf.dtype, (buf, simp(first - o) if o else first, mask)),))
    return UOp(Ops.VECTORIZE, dt.vec(w), tuple(UOp(Ops.GEP, dt, (span,), i * c + o) for i in range(w)))
  if c == 1 and (not gate or vec_of is not None):
    first = simp(substitute(idx, {lane: UOp.const(lane.dtype, 0)}))
    if not gate: return UOp(Ops.LOAD, dt.vec(w), (buf.index(first),))
    assert vec_of is not None
    g = bcast(vec_of[gate[0]], w)  # the lanes' gates: a masked load reads only the lanes whose gate is on, zero elsewhere
    return UOp(Ops.LOAD, dt.vec(w), (UOp(Ops.INDEX, buf.dtype, (buf, first, g)),))
  if gate and (gv := _gather(ld, w, vec_of)) is not None: return gv
  idxs = _lanes(idx, lane, w)
  if vec_of is not None and not gate and (found := _runs(idxs)) is not None:
    # a gather whose lanes read a few contiguous runs (Winograd's 4x4 tiles read back into rows: 4 runs of 4) loads each
    # run as one vector and picks its lanes from them (LLVM's shuffles), not one scalar load and insert per lane
    runs, offs = found
    spans = [UOp(Ops.LOAD, dt.vec(n), (buf.index(start),)) if n > 1 else buf.index(start).load() for start, n, _ in runs]
    at = {d: (s, d - d0) for s, (_, _, d0) in zip(spans, runs) for d in range(d0, d0 + s.dtype.count)}
    return UOp(Ops.VECTORIZE, dt.vec(w), tuple(sp if sp.dtype.count == 1 else UOp(Ops.GEP, dt, (sp,), k) for sp, k in (at[o] for o in offs)))
  if vec_of is not None and not gate and (blocks := _block_rows(buf, idxs, w)) is not None:
    starts, b, p = blocks
    rows = [_transpose(tuple(UOp(Ops.LOAD, dt.vec(b), (buf.index(r),)) for r in starts[g:g + b]))[p] for g in range(0, w, b)]
    return rows[0] if b == w else UOp(Ops.VECTORIZE, dt.vec(w), tuple(UOp(Ops.GEP, dt, (r,), i) for r in rows for i in range(b)))
  if not gate and (gv := _gather(ld, w, vec_of)) is not None: return gv
  gates = _lanes(gate[0], lane, w) if gate else [None] * w
  return UOp(Ops.VECTORIZE, dt.vec(w), tuple(buf.index(i, g).load() for i, g in zip(idxs, gates)))


def _gather(ld: UOp, w: int, vec_of: Mapping[UOp, UOp] | None) -> UOp | None:
  """ld's lanes as one gather (INDEX of a vector index, under a vector of the lanes' gates), where the target loads that
  way (vec_of: the CPU's vectorised values), the element has a plain memory form, the index varies by lane, and none of
  its scalar arithmetic can wrap (the lowered program's wrap check sees scalar indices only: index_width.wrap_risk)."""
  buf, idx, *gate = ld.src[0].src
  if vec_of is None or not VECTOR_GATHERS or ld.dtype.itemsize not in _GATHER_ITEMS: return None
  if (vi := vec_of.get(idx)) is None or vi.dtype.count != w or any(may_wrap(n) for n in idx.toposort()): return None
  src = (buf, vi, bcast(vec_of[gate[0]], w)) if gate else (buf, vi)
  return UOp(Ops.LOAD, ld.dtype.vec(w), (UOp(Ops.INDEX, buf.dtype, src),))


def _block_rows(buf: UOp, idxs: tuple[UOp, ...], w: int) -> tuple[list[UOp], int, int] | None:
  """A gather whose lanes are a whole number of b-element blocks apart (b = w, or the stride where it is a smaller power
  of two: a 32-lane panel over 16-channel blocks), lane i at lane 0's index + i*s, where lane 0's index is a known phase
  p past a multiple of b (a channels-last buffer's channel c read along an NCHW row, c % b = p): the aligned blocks that
  hold its lanes, b and p. Its value is lane p of each block, so the b copies of an axis unrolled by b (p = 0..b-1) read
  the same blocks, one vector load each, and take their rows of the blocks' transpose (_transpose, per b lanes): b loads
  and b*log2(b) shuffles for b*b elements, where the copies' gathers were a scalar load each. The buffer holds a whole
  number of blocks, so each block is inside it where its lane is."""
  size = buf.dtype.size if isinstance(buf.dtype, PtrDType) else -1
  if w < 4 or w & (w - 1) or size <= 0 or (s := _offset(idxs[1], idxs[0])) is None or s <= 0: return None
  b = w if s % w == 0 else s if w % s == 0 and s >= 4 else 0
  if not b or size % b or any(_offset(i, idxs[0]) != k * s for k, i in enumerate(idxs)): return None
  if (ph := simp(idxs[0] % b)).op is not Ops.CONST: return None
  p = int(ph.arg)
  start = simp(idxs[0] - p) if p else idxs[0]
  return [simp(start + k * s) if k else start for k in range(w)], b, p


@functools.lru_cache(maxsize=1 << 10)
def _transpose(rows: tuple[UOp, ...]) -> tuple[UOp, ...]:
  """The transpose of w vectors of w lanes (w a power of two): row j of the result holds lane j of each. log2(w)
  stages; at stage b each pair of rows b apart swaps its b x b off-diagonal blocks, each new row a pick of two rows'
  lanes (one shuffle: render/llvm_shuffle.py)."""
  w = len(rows)
  out, b = list(rows), 1
  while b < w:
    new = list(out)
    for i in (i for i in range(w) if not i & b):
      lo, hi = out[i], out[i + b]
      gep = lambda v, j: UOp(Ops.GEP, v.dtype.scalar(), (v,), j)
      new[i] = UOp(Ops.VECTORIZE, lo.dtype, tuple(gep(lo, j) if not j & b else gep(hi, j - b) for j in range(w)))
      new[i + b] = UOp(Ops.VECTORIZE, lo.dtype, tuple(gep(lo, j + b) if not j & b else gep(hi, j) for j in range(w)))
    out, b = new, b * 2
  return tuple(out)



RUN_LANES = 2  # a gather is loaded as contiguous runs where they average at least this many lanes each (_runs); 0: never


@functools.lru_cache(maxsize=1 << 14)
def _offset(i: UOp, first: UOp) -> int | None:
  d = simp(i - first)
  return int(d.arg) if d.op is Ops.CONST else None


def _runs(idxs: tuple[UOp, ...]) -> tuple[list[tuple[UOp, int, int]], list[int]] | None:
  """The lanes' indices as runs of consecutive elements, (first index, length, offset from lane 0's) each, and each
  lane's offset from lane 0's, where every lane's index is lane 0's plus a constant and the runs average at least
  RUN_LANES lanes; else None."""
  if not RUN_LANES: return None
  found = [_offset(i, idxs[0]) for i in idxs]
  offs = [o for o in found if o is not None]
  if len(offs) < len(found): return None
  runs: list[list[int]] = []
  for d in sorted(set(offs)):
    if runs and d == runs[-1][0] + runs[-1][1]: runs[-1][1] += 1
    else: runs.append([d, 1])
  if len(runs) * RUN_LANES > len(idxs): return None
  return [(simp(idxs[0] + d) if d else idxs[0], n, d) for d, n in runs], offs


def _vstore(st: UOp, val: UOp, lane: UOp, w: int) -> UOp:
  buf, idx, *gate = st.src[0].src
  val = bcast(val, w)
  if not gate and not _lane_vectors(idx, w) and affine_coeff(idx, lane) == 1:
    return UOp(Ops.STORE, dtypes.void, (buf.index(simp(substitute(idx, {lane: UOp.const(lane.dtype, 0)}))), val))
  idxs = _lanes(idx, lane, w)
  gates = _lanes(gate[0], lane, w) if gate else [None] * w
  return UOp(Ops.SINK, dtypes.void, tuple(UOp(Ops.STORE, dtypes.void, (buf.index(i, g), UOp(Ops.GEP, val.dtype.scalar(), (val,), l)))
                                          for l, (i, g) in enumerate(zip(idxs, gates))))
