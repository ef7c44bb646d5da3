"""The lowering pass: a prepared kernel AST, its checked axis plans, to statements placed in the linearizer's scopes.

Every user RANGE becomes a loop (or, on GPUs, a thread index) over units of `factor` elements, plus an expand variable
for the elements inside a unit: the vector lanes of an UPCAST axis, or the copies of an UNROLL axis. REDUCEs become
accumulators (DEFINE_ACC, ACC_STORE, reads as LOAD(acc)); unrolled copies share one loop, so register tiling keeps all
its accumulators live in one reduce loop. The Linearizer places each value in the outermost scope its sources allow.

The stores are lowered a group at a time (the stores that share a loop nest): each group gets its grid (gpu_grid.py), its
loops (loops.py), packed panels (pack.py), kept rows, accumulators (reduce_lowering.py) and unrolled, vectorised copies
(expand.py). These phases interleave within a group, each keeping its own state, so they are one pass; kiln.codegen.pipeline
runs it between the axis plans and the linearizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.codegen.choose.axis_plan import kept_twins
from kiln.codegen.choose.base import Opt, axis_size
from kiln.codegen.lowering.expand import combos, gate_loads, simp, unroll_vars
from kiln.codegen.lowering.gpu_grid import GpuGrid
from kiln.codegen.lowering.linearize import Scope
from kiln.codegen.lowering.loops import LowerCtx, ceil_div
from kiln.codegen.lowering.pack import Packer, scratch_ptr
from kiln.codegen.lowering.prepare import estimate, min_elements
from kiln.codegen.lowering.reduce_lowering import Reductions
from kiln.ir.analysis import free_ranges
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import AxisType, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp


@dataclass
class LoweredKernel:
  name: str
  uops: list[UOp]
  globals: list[UOp]  # DEFINE_GLOBALs by slot
  vars: list[UOp]  # DEFINE_VARs by name
  opts: list[Opt]
  threads: int = 1
  global_size: tuple[int | UOp, int | UOp, int | UOp] | None = None
  local_size: tuple[int | UOp, int | UOp, int | UOp] | None = None
  outs: list[int] = field(default_factory=list)
  ins: list[int] = field(default_factory=list)
  min_elements: dict[int, int] = field(default_factory=dict)  # slot -> elements the kernel may touch
  scratch: UOp | None = None  # CPU: per-call scratch (a threaded reduction's partials, packed panels), a hidden last argument
  finish: bool = False  # CPU: a finishing call (core_id == threads) folds a threaded reduction's partials
  scratch_bytes: int = 0
  slots: int = 0  # CPU, split kernels: threads with a scratch of their own (PACK panels, KEEP rows); 0: no such scratch
  slot_bytes: int = 0  # CPU: the bytes of one such scratch (a multiple of 64)
  flops: int = 0
  mem_bytes: int = 0
  index: DType = dtypes.index  # the dtype of its loops and index arithmetic: dtypes.index64 where the bounds need it (index_width)
  work: UOp | None = None  # CPU, split over a symbolic axis: its element-ops as an expression of its variables (split_rule)
  split_min: int = 0  # ... and the element-ops under which it runs on the calling thread alone (0: always split)


def kernel_ranges(ast: UOp, store_loops: dict[UOp, set[UOp]]) -> list[UOp]:
  """Every RANGE of a prepared kernel, by axis id: those its nodes use and the loops its stores had before simplification
  could drop one (prepare's store_loops)."""
  return sorted({n for n in ast.toposort() if n.op is Ops.RANGE} | {r for rs in store_loops.values() for r in rs}, key=lambda r: r.arg[0])


class Lowerer:
  """Lowers one prepared kernel whose axis plans are checked (ctx): groups the stores by their loop nests and lowers each
  group (grid, loops, packed panels, gates, reduces, stores) into ctx's linearizer; `kernel` describes the result."""
  def __init__(self, ast: UOp, ctx: LowerCtx, opts: list[Opt], ranges: list[UOp], store_loops: dict[UOp, set[UOp]], tails: set[UOp]):
    self.ast, self.target, self.opts, self.ranges = ast, ctx.target, opts, ranges
    self.tails = tails  # stores that are the scalar tail of a peeled vector axis (core 0 runs them)
    self.stores = [s for s in ast.src if s.op is Ops.STORE]
    self.loops_of = store_loops or {st: free_ranges(st) for st in self.stores}  # taken before simplification could drop one
    self.ctx = ctx
    self.grid = GpuGrid(self.ctx)
    self.pack = Packer(self.ctx)
    self.red = Reductions(self.ctx, self.grid, self.pack)

  def lower_group(self, stores: list[UOp], axes: list[UOp]) -> None:
    ctx, plans, lin, red = self.ctx, self.ctx.plans, self.ctx.lin, self.red
    subst: dict[UOp, UOp] = {}
    scope = lin.root
    threads = ctx.threads
    if threads > 1 and set(stores) <= self.tails and not any(plans[r].threads > 1 for r in axes):
      # a peeled tail that no split axis shares runs once, on the first thread
      core_id = ctx.core_id if ctx.core_id is not None else ctx.core(threads, finish=False)
      scope = lin.open_if(scope, core_id.eq(0))
    loop_scopes: dict[UOp, Scope] = {}
    gate: UOp | None = None
    loops = axes
    spread = [r for r in axes if plans[r].spread]
    if ctx.gpu:
      loops, gate = self.grid.map([r for r in axes if r not in spread], subst)
      if loops and any(p.group for p in plans.values()):  # a block's tree would run a different number of times per thread
        raise CodegenError(f"GROUP needs every output axis on the grid or SPREAD over the block, but axes {[r.arg[0] for r in loops]} "
                           "would be loops inside a block")
      self.check_spread(stores, spread)
    loops = sorted(loops, key=lambda r: not plans[r].outer)
    packs = self.pack.loads(stores, loops)
    for r in loops:
      scope, subst[r] = ctx.open_axis(scope, r, subst)
      loop_scopes[r] = scope
      opened = set(loops[:loops.index(r) + 1])
      for ld in [ld for ld, needs in packs.items() if needs <= opened]:  # a panel is packed once its outer loops are open
        self.pack.emit(scope, ld, subst)
        del packs[ld]
    body_scope = scope
    if gate is not None: body_scope = self.grid.open_gate(scope, simp(gate))
    red_scope = body_scope
    sgate: UOp | None = None  # the SPREAD axes' gate: for the loads outside the REDUCEs (those run before its loop)
    for r in spread:  # SPREAD: the block's threads take t, t + g, ... of the axis, past its end gated off
      body_scope, subst[r] = self.spread_loop(body_scope, r, subst)
      loop_scopes[r] = body_scope  # a REDUCE along it runs per element, inside the gate
      inside = simp(subst[r] < substitute(r.src[0], subst))
      sgate = inside if sgate is None else sgate & inside
    g = max((p.group for p in plans.values()), default=0)
    writer: Scope | None = None  # GROUP without SPREAD: every thread has the result, thread 0 (of the last block) writes it
    if len(stores) > 1 and any(p.blocks for p in plans.values()):  # the writer opens before a later store's reductions exist
      raise CodegenError("BLOCKS needs a kernel of one store (only the last block, known after its reduction, may write)")
    for st in stores:
      if gate is not None: st = st.replace(src=(st.src[0], gate_loads(st.src[1], gate)))  # loads hoisted out of the gate read nothing
      st = self.keep(st, subst)
      s = simp(substitute(red.hide(st), subst))
      if sgate is not None: s = gate_loads(s, sgate)  # loads hoisted out of the SPREAD gate read nothing
      red.emit_all(s, red_scope, subst, loop_scopes)
      if g and not spread and writer is None:  # opened after the reductions, so it can test the grid stage's last block
        cond = self.grid.special("lidx0", g).eq(0)
        writer = lin.open_if(body_scope, cond & red.last_block if red.last_block is not None else cond)
      target = red.finish_scope if red.finish_scope is not None else writer if writer is not None else body_scope
      for c in combos(red.expand_vars(s)):
        out = red.instantiate(s, dict(zip(red.expand_vars(s), c)), ctx.vec)
        for one in (out.src if out.op is Ops.SINK else (out,)): lin.emit(target, one)
    self.grid.close_gate()
    lin.close_to(lin.root)

  def spread_loop(self, scope: Scope, r: UOp, subst: dict[UOp, UOp]) -> tuple[Scope, UOp]:
    """SPREAD: a loop over the axis in steps of the block, each thread at its own lane, then a gate for the last step."""
    ctx, p = self.ctx, self.ctx.plans[r]
    end = substitute(r.src[0], subst)
    inner = ctx.lin.open(scope, lv := ctx.count_loop(simp(ceil_div(end, p.spread))))
    expr = lv * p.spread + self.grid.group_lane(p.spread)
    return ctx.lin.open_if(inner, simp(expr < end)), expr

  def check_spread(self, stores: list[UOp], spread: list[UOp]) -> None:
    """A GROUP REDUCE along a SPREAD axis would run its tree inside that axis's gate, where some threads never go."""
    plans = self.ctx.plans
    for red in (u for st in stores for u in st.toposort() if u.op is Ops.REDUCE):
      if any(plans[r].group for r in red.src[1:]) and (bad := [r.arg[0] for r in spread if r in free_ranges(red)]):
        raise CodegenError(f"a GROUP REDUCE varies along SPREAD axes {bad}: its tree needs every thread of the block; drop the SPREAD")

  def keep(self, st: UOp, subst: dict[UOp, UOp]) -> UOp:
    """KEEP: the store's values that a kept REDUCE computes too read them from the REDUCE's scratch row (reduce_lowering
    writes it). Each kept REDUCE gets its rows once, on first sight: one per unrolled copy of it (an UNROLLed output axis
    it varies along: rows interleaved for their latency), the copy's row picked by its unroll variables, which each copy
    turns into its constants. A KEEP no store can use is refused at the end."""
    twins: dict[UOp, UOp] = {}
    for red in (u for u in st.toposort() if u.op is Ops.REDUCE and len(u.src) == 2 and self.ctx.plans[u.src[1]].keep):
      if not (found := kept_twins(st, red)): continue
      if red not in self.red.keep:
        size = axis_size(red.src[1])
        assert size is not None
        row, stride = UOp.const(self.ctx.idx, 0), size
        for v in reversed(unroll_vars(substitute(red, subst), {})):  # copy (c0, c1, ...) -> its row, row-major
          row, stride = row + v * stride, stride * (v.arg[2] + 1)
        self.red.keep[red] = (scratch_ptr(red.dtype), simp(self.pack.reserve(stride, red.dtype) + row))
      ptr, base = self.red.keep[red]
      twins |= {t: UOp(Ops.LOAD, t.dtype, (ptr.index(base + j),)) for t, j in found.items()}
    return st.replace(src=(st.src[0], substitute(st.src[1], twins))) if twins else st

  def store_groups(self) -> dict[tuple[UOp, ...], list[UOp]]:
    """The stores by the loop nest they share (its axes, by id), checked against a THREAD split; on a GPU the grid is sized
    for the largest group."""
    ctx = self.ctx
    groups: dict[tuple[UOp, ...], list[UOp]] = {}
    for st in self.stores: groups.setdefault(tuple(sorted(self.loops_of[st] | free_ranges(st), key=lambda r: r.arg[0])), []).append(st)
    threaded = [p for p in ctx.plans.values() if p.threads > 1]
    if threaded and len([g for g, sts in groups.items() if not set(sts) <= self.tails]) > 1:
      raise CodegenError("a THREAD split needs a kernel whose stores share one loop nest")
    if threaded and threaded[0].rng.arg[1] is AxisType.REDUCE and any(axes for axes in groups):
      raise CodegenError(f"THREAD on reduce axis {threaded[0].rng.arg[0]} needs a full reduction (no output axes); split an output axis instead")
    if ctx.gpu and len(groups) > 1: self.grid.share(groups)  # GPU: size the shared grid for the largest store group
    return groups

  def lower(self) -> None:
    """Every store group lowered into the linearizer's scopes; a KEEP no store used is refused."""
    for axes, sts in self.store_groups().items(): self.lower_group(sts, list(axes))
    if unused := sorted(p.rng.arg[0] for p in self.ctx.plans.values() if p.keep and not any(r.src[1] is p.rng for r in self.red.keep)):
      raise CodegenError(f"KEEP on axes {unused}: no store computes again what their REDUCE computes (softmax's exp along an output axis)")

  def kernel(self, uops: list[UOp], emptied: set[UOp]) -> LoweredKernel:
    """The LoweredKernel of the linearized program `uops`: its parameters (with `emptied`, the buffers read only under an
    empty range: prepare.emptied_globals), launch sizes, scratch and figures."""
    ast, ctx = self.ast, self.ctx
    threaded = [p for p in ctx.plans.values() if p.threads > 1]
    globals_ = sorted({n for n in ast.toposort() if n.op is Ops.DEFINE_GLOBAL} | emptied, key=lambda g: g.arg)
    # a loop kept for its trip count may use a variable the simplified stores no longer mention
    vars_ = sorted({n for n in UOp.sink(ast, *self.ranges).toposort() if n.op is Ops.DEFINE_VAR}, key=lambda v: v.arg[0])
    outs = sorted({st.src[0].src[0].arg for st in self.stores})
    ins = sorted({n.src[0].src[0].arg for n in ast.toposort() if n.op is Ops.LOAD and n.src[0].op is Ops.INDEX})
    threads = threaded[0].threads if threaded else 1
    lk = LoweredKernel(name=ast.arg if isinstance(ast.arg, str) else "kernel", uops=uops, globals=globals_, vars=vars_, opts=self.opts,
                       threads=threads, outs=outs, ins=ins, index=self.ctx.idx)
    if ctx.gpu:
      lk.global_size, lk.local_size = tuple(self.grid.grid), tuple(self.grid.block)  # type: ignore[assignment]
    elif threads > 1: lk.global_size = (threads, 1, 1)
    lk.min_elements = min_elements(ast)
    scratch = self.red.scratch
    if self.pack.dtype is not None:  # packed panels, kept rows
      if scratch is not None: raise CodegenError("PACK and KEEP cannot be combined with a threaded full reduction")
      scratch = scratch_ptr(self.pack.dtype)
    lk.scratch, lk.finish = scratch, self.red.finish_scope is not None
    if isinstance(sp := scratch.dtype if scratch is not None else None, PtrDType):
      # a threaded reduction's partials (one per chunk) have their size in the pointer; packed panels and kept rows
      # add up per thread, and each thread claiming a split kernel's chunks has its own (64-byte aligned) scratch
      if sp.size > 0: lk.scratch_bytes = sp.nbytes
      elif threads > 1:
        lk.slots, lk.slot_bytes = min(threads, max(self.target.threads, 1)), -(-self.pack.used * sp.itemsize // 64) * 64
        lk.scratch_bytes = lk.slots * lk.slot_bytes
      else: lk.scratch_bytes = self.pack.used * sp.itemsize
    lk.flops, lk.mem_bytes = estimate(ast)
    return lk

