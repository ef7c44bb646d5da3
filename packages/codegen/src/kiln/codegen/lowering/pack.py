"""PACK (CPU): the panel a reduce axis reads, per outer tile, copied into contiguous per-thread scratch, and the loads
that then read the packed copy. The per-thread scratch is handed out here, to KEEP's rows too: region after region in
one thread's scratch (region k at used_k); a split kernel's threads each have one (slot s's at s * slot bytes)."""
from __future__ import annotations

from kiln.codegen.choose.base import affine_coeff, axis_size, divmod_free_steps
from kiln.codegen.choose.heuristic import operand_load
from kiln.codegen.lowering.expand import simp, simplify_indices, vectorize
from kiln.codegen.lowering.linearize import Scope
from kiln.codegen.lowering.loops import LowerCtx
from kiln.ir.analysis import free_ranges
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp


def scratch_ptr(dt: DType) -> UOp:
  # sized when lowering ends (every pack's share is known by then); one pointer per dtype is all a kernel needs
  return UOp(Ops.DEFINE_GLOBAL, dt.ptr(), (), -1)


class Packer:
  def __init__(self, ctx: LowerCtx):
    self.ctx = ctx
    self.packed: dict[UOp, tuple[UOp, UOp, int]] = {}  # packed load -> (its reduce range, its scratch base, lanes)
    self.used = 0  # elements of scratch per thread (packed panels, kept rows)
    self.dtype: DType | None = None  # one scratch pointer per kernel, so one element type

  def reserve(self, elements: int, dt: DType) -> UOp:
    """`elements` of dt in the calling thread's scratch: the index of the first. Each thread that claims chunks gets a
    scratch of its own (the split kernel's entry offsets the pointer by its slot), reused chunk after chunk."""
    if self.dtype not in (None, dt): raise CodegenError(f"per-thread scratch of {self.dtype.name} cannot hold {dt.name} too")
    base = UOp.const(self.ctx.idx, self.used)
    self.used += elements
    self.dtype = dt
    return base

  def loads(self, stores: list[UOp], loops: list[UOp]) -> dict[UOp, set[UOp]]:
    """The loads to pack: under a PACK reduce axis, using the vector axis but not the innermost output loop (so the
    packed panel is reused by every iteration of that loop). Returns each with the output loops it needs open."""
    out: dict[UOp, set[UOp]] = {}
    plans = self.ctx.plans
    if not loops or self.ctx.vec is None: return out
    inner = loops[-1]
    for red in (u for st in stores for u in st.toposort() if u.op is Ops.REDUCE):
      kr = [r for r in red.src[1:] if plans[r].pack]
      if len(kr) != 1 or len(red.src) != 2: continue
      for ld in (u for u in red.src[0].toposort() if _packable(u)):
        rs = free_ranges(ld)
        vec_r = next(p.rng for p in plans.values() if p.ev is self.ctx.vec[0])  # the output's vector axis (a reduce may have its own)
        if inner not in rs and kr[0] in rs and vec_r in rs and rs - {kr[0]} <= set(loops) and not _panel_already(ld, kr[0], vec_r, self.ctx.vec[1]):
          out[ld] = rs - {kr[0]}
    return out

  def emit(self, scope: Scope, ld: UOp, subst: dict[UOp, UOp]) -> None:
    """Copy the panel ld reads for the current outer tile into this thread's scratch: panel[k, lane] at (k*W + lane).
    A row of the panel is copied as runs of lanes (`runs`): a conv's window row spans image rows, contiguous within each."""
    ctx = self.ctx
    assert ctx.vec is not None
    lane, w = ctx.vec
    k = next(r for r in free_ranges(ld) if ctx.plans[r].pack)
    size = axis_size(k)
    assert size is not None
    base = self.reserve(size * w, ld.dtype)
    m = unroll_rows(substitute(ld, subst), k, size)
    lv = ctx.count_loop(size // m)
    inner = ctx.lin.open(scope, lv)
    self.packed[ld] = (k, base, w)
    ctx.lin.floor[scratch_ptr(ld.dtype)] = scope  # the panel is read after this copy
    for c in range(m):  # m panel rows a step: k = lv*m + c (a conv's 3x3 window offsets: their // and % fold away)
      kv = lv * m + c if m > 1 else lv
      src = (simp if m > 1 else simplify_indices)(substitute(ld, {**subst, k: kv}))
      for piece, at, (j, n) in runs(src, lane, w):
        st = vectorize(UOp(Ops.STORE, dtypes.void, (scratch_ptr(ld.dtype).index(simp(base + kv * w + at + j)), piece)), (j, n), masked=True)
        for one in (st.src if st.op is Ops.SINK else (st,)): ctx.lin.emit(inner, one)
    ctx.lin.close(inner)

  def unpack(self, body: UOp, rsubst: dict[UOp, UOp]) -> UOp:
    """Loads that were packed read the packed panel instead: (k*W + lane) in this thread's scratch."""
    if not self.packed: return body
    assert self.ctx.vec is not None
    m = {}
    for ld, (k, base, w) in self.packed.items():
      if k not in rsubst: continue  # another REDUCE's panel (a kernel of two stores, one packed): not in this loop nest
      m[substitute(ld, rsubst)] = UOp(Ops.LOAD, ld.dtype, (scratch_ptr(ld.dtype).index(simp(base + rsubst[k] * w + self.ctx.vec[0])),))
    return substitute(body, m) if m else body


def _panel_already(u: UOp, k: UOp, lane: UOp, w: int) -> bool:
  """Whether a load reads its panel as the copy would lay it out, one contiguous run of w lanes per step of k (a conv's
  weight stored in blocks of the register tile's columns, conv._product_blocked): copying it moves every element once
  for nothing. A gated load is still copied (its copy takes the bounds test out of the inner loop)."""
  ld = operand_load(u)
  if ld is None or u.op is Ops.WHERE or len(ld.src[0].src) != 2: return False
  idx = ld.src[0].src[1]
  return affine_coeff(idx, lane) == 1 and affine_coeff(idx, k) == w


def _packable(u: UOp) -> bool:
  """A plain load, or a load under a bounds test (a padded conv's input, opt.operand_load); a gated load alone is not."""
  ld = operand_load(u)
  return ld is not None and (u.op is Ops.WHERE or len(ld.src[0].src) == 2)


def runs(src: UOp, lane: UOp, w: int) -> list[tuple[UOp, int, tuple[UOp, int]]]:
  """The lanes of src as runs of n lanes each, (piece, first lane, (run lane variable, n)) per run: the longest power-of-two
  runs (at least 4 lanes) in which every load reads contiguous lanes (a conv's window row over 8x8 images: 4 runs of 8),
  each then one vector load (masked where the load is gated: a padded conv's bounds test). All w lanes as one run when
  they are contiguous already or no such runs exist (the lanes then gather, as they always did)."""
  idxs = [u.src[0].src[1] for u in src.toposort() if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX]
  def affine(e: UOp, v: UOp) -> bool: return affine_coeff(e, v) in (0, 1)
  if all(affine(i, lane) for i in idxs): return [(src, 0, (lane, w))]
  n = w // 2
  while n >= 4 and w % n == 0:
    j = UOp(Ops.DEFINE_VAR, lane.dtype, (), (f"{lane.arg[0]}.run", 0, n - 1))  # not an identifier, as expand_var's
    pieces = [simp(substitute(src, {lane: j + s * n})) for s in range(w // n)]
    if all(affine(u.src[0].src[1], j) for p in pieces for u in p.toposort() if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX):
      return [(p, s * n, (j, n)) for s, p in enumerate(pieces)]
    n //= 2
  return [(src, 0, (lane, w))]


UNROLL_ROWS = 32  # the most panel rows one step of a panel copy may take


def unroll_rows(ld: UOp, k: UOp, size: int) -> int:
  """How many panel rows one step of the copy takes: the fewest that leave its index no // or % of the step
  (choose.base.divmod_free_steps), at most UNROLL_ROWS; 1 for a matmul's panel."""
  return divmod_free_steps(ld, k, size, UNROLL_ROWS)
