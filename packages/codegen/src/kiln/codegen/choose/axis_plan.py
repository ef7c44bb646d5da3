"""Options applied to a kernel's axes: each option's rule checks it against its axis and the target and records what it
asks in the axis's plan (AxisPlan), plan_axes runs them all, and KEEP's test of which store values a REDUCE computes too
(kept_twins). The heuristic that picks options is kiln.codegen.choose.heuristic."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen.choose.base import GPU_WARP, Opt, OptOps, Target, affine_coeff, axis_size
from kiln.ir.analysis import exact_int_bounds, free_ranges
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import AxisType, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp


@dataclass
class AxisPlan:
  """What lowering does with one axis, as the options say."""
  rng: UOp
  factor: int = 1  # elements per unit: the UPCAST width or UNROLL count
  kind: str = ""  # "vec", "unroll" or ""
  threads: int = 1
  local: int = 0  # GPU threads per block along this axis
  group: int = 0  # GPU threads sharing this reduce axis
  spread: int = 0  # GPU: the block's threads share this output axis (SPREAD)
  blocks: int = 0  # GPU: blocks sharing this GROUP reduce axis (BLOCKS)
  outer: bool = False  # CPU: opened before the other output loops
  pack: bool = False  # CPU: loads of this reduce axis that skip the innermost output loop read a packed copy
  fma: bool = False  # a sum of products over this axis accumulates with fused multiply-adds
  keep: bool = False  # CPU: the REDUCE over this axis keeps its values for a store that computes them again
  ev: UOp | None = None  # the expand variable (lane or unroll copy)


def expand_var(axis_id: int, kind: str, amount: int, dtype: DType = dtypes.index) -> UOp:
  # not an identifier, so it can never clash with a user variable; of its range's dtype, so its sums need no casts
  return UOp(Ops.DEFINE_VAR, dtype, (), (f"{kind}.{axis_id}", 0, amount - 1))


# one rule per option: check it against its axis's plan and the target, then record it in the plan (vec_taken: an
# output axis is vectorised already)
def _split(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  size = axis_size(p.rng)
  red = p.rng.arg[1] is AxisType.REDUCE
  if p.factor != 1: raise CodegenError(f"{o}: axis {o.axis} is already split by {p.factor}")
  # a vectorised reduce axis the width does not divide (or may not: a symbolic one) finishes with a scalar tail loop
  # (reduce_lowering); a symbolic output axis is split by prepare.peel into whole units, a range whose size the amount
  # divides for every value, and a tail
  divides = size % o.amount == 0 if size is not None else _divides(o.amount, p.rng.src[0])
  divides = divides or (o.op is OptOps.UPCAST and red)
  if not divides:
    raise CodegenError(f"{o}: the amount must divide the axis size ({size if size is not None else 'symbolic'})")
  if o.op is OptOps.UPCAST:
    if vec_taken and not red:
      raise CodegenError(f"{o}: only one axis can be vectorised among the output axes (a reduce axis may take its own UPCAST)")
    if t.vector_bytes == 0: raise CodegenError(f"{o}: {t.device} takes no UPCAST (no explicit vectors)")
  p.factor, p.kind = o.amount, ("vec" if o.op is OptOps.UPCAST else "unroll")
  p.ev = expand_var(o.axis, "lane" if p.kind == "vec" else "unroll", o.amount, p.rng.dtype)


def _tailed(p: AxisPlan) -> bool:
  """Whether the axis's split leaves a tail in its own loop: a static size the factor does not divide, or a symbolic reduce
  axis (a symbolic output axis is split by prepare.peel, its tail a range of its own)."""
  n = axis_size(p.rng)
  return bool(n % p.factor) if n is not None else p.rng.arg[1] is AxisType.REDUCE


def _divides(amount: int, size: UOp) -> bool:
  """Whether amount divides a symbolic size for every value of its variables (a whole number of units: (n // w) * w)."""
  rest = simplify(size % amount)
  return rest.op is Ops.CONST and rest.arg == 0


def _thread(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes == 0: raise CodegenError(f"{o}: THREAD is a CPU option")
  p.threads = o.amount


def _local(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes != 0: raise CodegenError(f"{o}: LOCAL is a GPU option")
  if o.amount > t.max_local: raise CodegenError(f"{o}: at most {t.max_local} threads per block")
  p.local = o.amount


def _group(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes != 0: raise CodegenError(f"{o}: GROUP is a GPU option")
  if o.amount > t.max_local or o.amount & (o.amount - 1): raise CodegenError(f"{o}: needs a power of two <= {t.max_local}")
  if p.rng.arg[1] is not AxisType.REDUCE: raise CodegenError(f"{o}: GROUP shares a reduce axis; axis {o.axis} is an output axis")
  p.group = o.amount


def _spread(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes != 0: raise CodegenError(f"{o}: SPREAD is a GPU option")
  if p.rng.arg[1] is AxisType.REDUCE: raise CodegenError(f"{o}: SPREAD shares an output axis; axis {o.axis} is a reduce axis")
  p.spread = o.amount


def _blocks(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes != 0: raise CodegenError(f"{o}: BLOCKS is a GPU option")
  if p.rng.arg[1] is not AxisType.REDUCE or axis_size(p.rng) is None: raise CodegenError(f"{o}: BLOCKS needs a reduce axis of constant size")
  if o.amount > t.max_grid[0]: raise CodegenError(f"{o}: at most {t.max_grid[0]} blocks")
  p.blocks = o.amount


def _fma(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if p.rng.arg[1] is not AxisType.REDUCE: raise CodegenError(f"{o}: FMA applies to a reduce axis")
  p.fma = True


def _outer(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes == 0: raise CodegenError(f"{o}: {o.op.name} is a CPU option")
  if p.rng.arg[1] is AxisType.REDUCE: raise CodegenError(f"{o}: only output axes can be made outermost")
  p.outer = True


def _pack(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes == 0: raise CodegenError(f"{o}: {o.op.name} is a CPU option")
  if p.rng.arg[1] is not AxisType.REDUCE or axis_size(p.rng) is None: raise CodegenError(f"{o}: PACK needs a reduce axis of constant size")
  p.pack = True


def _keep(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  if t.vector_bytes == 0: raise CodegenError(f"{o}: {o.op.name} is a CPU option")
  if p.rng.arg[1] is not AxisType.REDUCE or axis_size(p.rng) is None: raise CodegenError(f"{o}: KEEP needs a reduce axis of constant size")
  p.keep = True


def _tile(o: Opt, p: AxisPlan, t: Target, vec_taken: bool) -> None:
  raise CodegenError(f"{o} asks for the tiled matrix product (CUDA, the pipeline's tiling pass), which the generic lowering does not print")


_RULES: dict[OptOps, Callable[[Opt, AxisPlan, Target, bool], None]] = {
  OptOps.UPCAST: _split, OptOps.UNROLL: _split, OptOps.THREAD: _thread, OptOps.LOCAL: _local, OptOps.GROUP: _group,
  OptOps.SPREAD: _spread, OptOps.BLOCKS: _blocks,
  OptOps.FMA: _fma, OptOps.OUTER: _outer, OptOps.PACK: _pack, OptOps.KEEP: _keep, OptOps.TILE: _tile}


def _outside_reduces(u: UOp) -> set[UOp]:
  """u's nodes reached without entering a REDUCE's body (REDUCEs themselves included)."""
  seen, stack = set[UOp](), [u]
  while stack:
    if (n := stack.pop()) in seen: continue
    seen.add(n)
    if n.op is not Ops.REDUCE: stack.extend(n.src)
  return seen


def kept_twins(st: UOp, red: UOp) -> dict[UOp, UOp]:
  """For a REDUCE over one axis r of n elements: the store's values that are the REDUCE's own body with r replaced by an
  index e of output axes within [0, n) (softmax stores exp(x[j] - max) and sums exp(x[r] - max); a peeled vector axis
  makes e a shifted j), each mapped to its e. The body may use r only in loads at g + r; the store's loads of the same
  buffers at g + e make the twin. Under KEEP the reduce leaves body(r) in scratch[r] and these read scratch[e]. Only a
  REDUCE outside every other REDUCE, and values outside them too: the scratch holds the row its last run wrote, which is
  the store's row only there."""
  if len(red.src) != 2 or (n := axis_size(r := red.src[1])) is None: return {}
  nodes = _outside_reduces(st.src[1])
  if red not in nodes: return {}
  body = red.src[0]
  uses = [ld for ld in _loads(body) if r in free_ranges(ld)]
  if not uses or any(len(ld.src[0].src) != 2 or affine_coeff(ld.src[0].src[1], r) != 1 or ld.src[0].src[1].op is Ops.LOAD for ld in uses): return {}
  base = {ld: simplify(substitute(ld.src[0].src[1], {r: UOp.const(r.dtype, 0)})) for ld in uses}
  theirs: dict[UOp, list[UOp]] = {}  # buffer -> the store's loads of it outside reduces
  for ld in nodes:
    if ld.op is Ops.LOAD and ld.src[0].op is Ops.INDEX and len(ld.src[0].src) == 2: theirs.setdefault(ld.src[0].src[0], []).append(ld)
  out: dict[UOp, UOp] = {}
  for cand in theirs.get(uses[0].src[0].src[0], []):
    e = simplify(cand.src[0].src[1] - base[uses[0]])
    if e.op is Ops.CONST or r in free_ranges(e) or free_ranges(e) & free_ranges(red): continue
    lo, hi = exact_int_bounds(e) or (e.vmin, e.vmax)  # a peeled axis's shifted index has loose interval bounds
    if lo < 0 or hi >= n: continue
    m: dict[UOp, UOp] = {}
    for ld in uses:
      if (t := next((t for t in theirs.get(ld.src[0].src[0], []) if simplify(t.src[0].src[1] - base[ld]) is e), None)) is None: break
      m[ld] = t
    else:
      if (twin := substitute(body, m)) in nodes and r not in free_ranges(twin): out[twin] = e
  return out


def plan_axes(ranges: list[UOp], opts: list[Opt], target: Target) -> tuple[dict[UOp, AxisPlan], tuple[UOp, int] | None]:
  """Check each option against the kernel's axes and the target. Returns each axis's plan and the vectorised output
  axis's (lane variable, width), None without one (a vectorised reduce axis is its REDUCE's own: reduce_lowering)."""
  by_id = {r.arg[0]: r for r in ranges}
  plans = {r: AxisPlan(r) for r in ranges}
  vec: tuple[UOp, int] | None = None
  for o in opts:
    if o.axis not in by_id: raise CodegenError(f"{o} names axis {o.axis}, but the kernel's axes are {sorted(by_id)}")
    p = plans[by_id[o.axis]]
    _RULES[o.op](o, p, target, vec is not None)
    if o.op is OptOps.UPCAST and p.ev is not None and p.rng.arg[1] is not AxisType.REDUCE: vec = (p.ev, o.amount)
  # rules across axes
  if sum(p.threads > 1 for p in plans.values()) > 1: raise CodegenError("only one axis can be split into chunks for threads (THREAD)")
  # a tail would have to follow the fold of the threads' partials
  # (a symbolic reduce axis may have one; a symbolic output axis is split by prepare.peel, the tail a range of its own)
  if any(p.threads > 1 and p.factor > 1 and _tailed(p) for p in plans.values()):
    raise CodegenError("THREAD on a reduce axis needs its UPCAST to divide the axis")
  if any(p.pack and p.kind == "vec" for p in plans.values()):  # a panel is k x lanes of an output axis
    raise CodegenError("PACK packs panels across the vectorised output axis; it cannot pack a reduce axis that is itself the UPCAST one")
  _check_gpu_block(plans)
  if target.vector_bytes == 0:  # GPU output axes go to the grid, one element per thread: an unroll there would be dropped
    for p in plans.values():
      if p.kind == "unroll" and p.rng.arg[1] is AxisType.LOOP:
        raise CodegenError(f"UNROLL(axis={p.rng.arg[0]}, {p.factor}): on a GPU an output axis goes to the grid, one element per "
                           "thread; UNROLL applies to reduce axes there (use LOCAL for the block's threads)")
  return plans, vec


def _check_gpu_block(plans: dict[UOp, AxisPlan]) -> None:
  """One block shape per kernel: every GROUP (softmax has two: max and sum) and SPREAD names the same thread count."""
  groups = [p for p in plans.values() if p.group]
  if len({p.group for p in groups}) > 1: raise CodegenError(f"GROUPs of one kernel share its block: got amounts {sorted({p.group for p in groups})}")
  # a GROUP's tree needs every thread of the block, each its own lane of the reduce axis; except a one-warp GROUP (its tree is
  # shuffles inside the warp), which may stack rows in the block: LOCAL on one output axis puts that many rows on threadIdx.y
  locals_ = [p for p in plans.values() if p.local]
  if groups and locals_ and (groups[0].group != GPU_WARP or len(locals_) > 1 or locals_[0].rng.arg[1] is not AxisType.LOOP
                             or locals_[0].local * GPU_WARP > 1024):
    raise CodegenError("GROUP combines with LOCAL only as one warp per row (GROUP 32) and LOCAL on one output axis, the rows a block "
                       "stacks (the block's threads share the reductions; SPREAD shares an output axis)")
  for p in plans.values():
    if p.spread and (not groups or p.spread != groups[0].group):
      raise CodegenError(f"SPREAD(axis={p.rng.arg[0]}, {p.spread}) needs a GROUP of the same amount (the block's threads)")
    if p.blocks and not p.group: raise CodegenError(f"BLOCKS(axis={p.rng.arg[0]}, {p.blocks}) needs a GROUP on the same axis")
  if sum(p.blocks > 0 for p in plans.values()) > 1: raise CodegenError("only one reduce axis can be cut over BLOCKS")
  # only the last block holds a BLOCKS result, and only its thread 0 stores: a SPREAD's stores are every thread's
  if any(p.blocks for p in plans.values()) and any(p.spread for p in plans.values()): raise CodegenError("BLOCKS cannot be combined with SPREAD")


def _loads(u: UOp) -> list[UOp]: return [x for x in u.toposort() if x.op is Ops.LOAD and x.src[0].op is Ops.INDEX]
