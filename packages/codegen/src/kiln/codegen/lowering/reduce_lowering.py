"""Reductions: each REDUCE becomes accumulators (DEFINE_ACC, ACC_STORE, reads as LOAD(acc)) in the outermost scope its
free ranges allow; values read its results through placeholders until they exist. A REDUCE with an UPCAST axis
accumulates vectors of its own lanes (a row reduce under a vectorised output axis included), folds them in a fixed
order and finishes a width that does not divide its axis with a scalar tail loop. A THREAD split reduces a chunk per
call and folds the partials in a finishing call; a GPU GROUP folds a block's partials through shared memory."""
from __future__ import annotations

from kiln.codegen.choose.base import axis_size
from kiln.codegen.lowering import max_bits
from kiln.codegen.lowering.expand import bcast, combine, combos, gate_loads, simp, unroll_vars, unrolled, vectorize
from kiln.codegen.lowering.gpu_grid import GpuGrid
from kiln.codegen.lowering.linearize import Scope
from kiln.codegen.lowering.loops import LowerCtx, ceil_div
from kiln.codegen.lowering.pack import Packer
from kiln.ir.analysis import free_ranges, identity
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp


class Reductions:
  def __init__(self, ctx: LowerCtx, grid: GpuGrid, pack: Packer):
    self.ctx, self.grid, self.pack = ctx, grid, pack
    self.placeholders: dict[UOp, UOp] = {}  # placeholder -> REDUCE
    self.results: dict[tuple[UOp, tuple], UOp] = {}  # (placeholder, unrolled copy) -> its result
    self.red_vars: dict[UOp, list[UOp]] = {}  # placeholder -> the unroll variables its result depends on (set once emitted)
    self.nesting = 0  # how many REDUCEs enclose the one being emitted
    self.finish_scope: Scope | None = None  # where a threaded reduction's result exists (the finishing call)
    self.scratch: UOp | None = None  # a threaded reduction's partials
    self.active = ctx.vec  # the lanes values vary along where the reduce being emitted sits: the output's, or an enclosing REDUCE's
    self.keep: dict[UOp, tuple[UOp, UOp]] = {}  # KEEP: REDUCE -> (scratch pointer, its row's first index) it leaves body(r) in
    self.last_block: UOp | None = None  # GPU BLOCKS: true in the block that finished last (it holds the grid's result)
    self.group_scopes: list[Scope] = []  # GPU: the loops of GROUP reduce axes (a tree inside one would run per lane)

  # ---- expressions ----
  def hide(self, u: UOp) -> UOp:
    """Replace the outermost REDUCEs in u by placeholders (their values come from accumulators)."""
    mapping: dict[UOp, UOp] = {}
    stack = [u]
    seen: set[UOp] = set()
    while stack:
      n = stack.pop()
      if n in seen: continue
      seen.add(n)
      if n.op is Ops.REDUCE:
        ph = UOp(Ops.SPECIAL, n.dtype, (), f"reduce.{n.key[:16]}")
        self.placeholders[ph] = n
        mapping[n] = ph
        continue
      stack.extend(n.src)
    return substitute(u, mapping)

  def expand_vars(self, u: UOp) -> list[UOp]: return unroll_vars(u, self.red_vars)

  def instantiate(self, u: UOp, combo: dict[UOp, int], vec: tuple[UOp, int] | None) -> UOp:
    """One unrolled copy of u: unroll variables to constants, placeholders to that copy's reduce results, then vectorise
    over vec's lanes (lane variable, width): the output's, or a REDUCE's own."""
    out = unrolled(u, combo)
    phs = {n: self.results[(n, tuple(combo[v] for v in self.red_vars[n]))] for n in out.toposort() if n in self.placeholders}
    if phs: out = substitute(out, phs)
    return vectorize(out, vec, masked=not self.ctx.gpu) if vec is not None else out

  # ---- accumulators ----
  def emit_all(self, u: UOp, scope: Scope, subst: dict[UOp, UOp], loop_scopes: dict[UOp, Scope]) -> None:
    """Emit every placeholder's REDUCE found in u, each in the outermost scope its free ranges allow."""
    for ph in [n for n in u.toposort() if n in self.placeholders]:
      if ph in self.red_vars: continue
      red = self.placeholders[ph]
      deps = [loop_scopes[r] for r in free_ranges(red) if r in loop_scopes] + ([self.grid.floor] if self.grid.floor is not None else [])
      target = max(deps, key=lambda s: s.depth, default=self.ctx.lin.root)
      if target.depth > scope.depth: target = scope
      self.emit(ph, red, target, subst, loop_scopes)

  def emit(self, ph: UOp, red: UOp, scope: Scope, subst: dict[UOp, UOp], loop_scopes: dict[UOp, Scope]) -> None:
    ctx, plans, lin = self.ctx, self.ctx.plans, self.ctx.lin
    op, ranges = red.arg, list(red.src[1:])
    dt = red.dtype
    value = self.hide(red.src[0])
    value = substitute(value, subst)
    value = simp(value)
    # the whole body, nested reduces included: their placeholders in `value` say nothing yet (they are emitted after this one)
    whole = substitute(red.src[0], subst)
    own = {plans[r].ev for r in ranges}
    out_vars = sorted({v for v in (*self.expand_vars(value), *self.expand_vars(whole)) if v not in own}, key=lambda v: v.arg[0])
    vr = [r for r in ranges if plans[r].kind == "vec"]
    if len(vr) > 1: raise CodegenError(f"a REDUCE vectorises at most one of its axes, got UPCASTs on axes {[r.arg[0] for r in vr]}")
    ev = plans[vr[0]].ev if vr else None
    rvec = (ev, plans[vr[0]].factor) if ev is not None else None
    outer = self.active
    if rvec is not None and outer is not None and outer[0] in whole.toposort():
      raise CodegenError(f"UPCAST on reduce axis {vr[0].arg[0]}: its REDUCE varies along the vectorised axis {outer[0].arg[0].split('.')[1]} "
                         "(its accumulator is a vector of those lanes already); drop one of the two UPCASTs")
    red_vec = rvec is not None
    lane_dep = outer is not None and not red_vec and outer[0] in whole.toposort()
    vec = rvec if red_vec else outer  # the lanes this REDUCE's body varies along
    acc_dt = dt.vec(vec[1]) if vec is not None and (lane_dep or red_vec) else dt
    # a width that does not divide the axis, or may not (a symbolic one), finishes with a scalar tail over what is left
    size = axis_size(vr[0]) if vr else None
    tail: int | UOp = 0 if not vr else size % plans[vr[0]].factor if size is not None else \
      simp(substitute(vr[0].src[0], subst) % plans[vr[0]].factor)
    tailed = isinstance(tail, UOp) or tail > 0
    if tailed and any(n.op is Ops.REDUCE and free_ranges(n) & set(ranges) for n in red.src[0].toposort()):
      raise CodegenError(f"UPCAST on reduce axis {vr[0].arg[0]} does not divide its size ({size}), and its REDUCE holds a REDUCE over its axes: "
                         "the scalar tail cannot repeat that one; pick a width that divides")
    group = next((plans[r].group for r in ranges if plans[r].group), 0)
    tp = next((plans[r] for r in ranges if plans[r].threads > 1), None)
    copies = combos(out_vars)
    work = scope
    if tp is not None:  # chunks 0..C-1 each reduce their part; the finishing call (core_id == C) folds the partials in order
      if self.nesting:  # its result would exist only in the finishing call, but the enclosing reduce's loops are outside it
        raise CodegenError(f"THREAD on reduce axis {tp.rng.arg[0]}: its REDUCE is nested inside another REDUCE; split an output axis instead")
      if scope is not lin.root or self.finish_scope is not None:
        raise CodegenError("only one full reduction per kernel can be split over threads")
      work = lin.open_if(scope, ctx.core(tp.threads, finish=True) < tp.threads)
    # a float32 MAX into vectors accumulates on its bits (max_bits), unless threads fold its partials
    bits = max_bits.applies(op, dt, ctx.gpu, acc_dt.count) and tp is None and not group
    accs: dict = {}
    for c in copies:
      starts = max_bits.starts(acc_dt.count) if bits else [UOp.const(acc_dt, identity(op, dt))]
      accs[c] = [UOp(Ops.DEFINE_ACC, s.dtype, (s,), ctx.acc_id()) for s in starts]
      for a in accs[c]: lin.emit(work, a)
      if not bits: accs[c] = accs[c][0]
    # loops over the reduce axes, innermost last
    inner, rsubst, lscopes = work, dict(subst), dict(loop_scopes)
    gate: UOp | None = None
    for r in ranges:
      p = plans[r]
      if p.group:
        if any(_inside(scope, s) for s in self.group_scopes):
          raise CodegenError(f"GROUP on reduce axis {r.arg[0]}: its REDUCE runs inside another GROUP's loop (each lane its own "
                             "element), where a block-wide tree cannot; GROUP one of the two")
        lid = self.grid.group_lane(p.group)
        end = substitute(r.src[0], rsubst)
        step = p.group * max(p.blocks, 1)  # BLOCKS: block b takes the slices b, b + blocks, ... of g elements each
        trips = ceil_div(end, step)
        inner = lin.open(inner, lv := ctx.count_loop(simp(trips)))
        rsubst[r] = (lv * p.blocks + self.grid.grid_blocks(p.blocks)) * p.group + lid if p.blocks else lv * p.group + lid
        gate = rsubst[r] < end
        self.group_scopes.append(inner)
      else:
        inner, rsubst[r] = ctx.open_axis(inner, r, rsubst)
      lscopes[r] = inner
    body = simp(self.pack.unpack(substitute(self.hide(red.src[0]), rsubst), rsubst))
    if gate is not None: body = gate_loads(body, gate)
    self.nesting += 1
    self.active = vec
    try: self.emit_all(body, inner, rsubst, lscopes)
    finally: self.nesting, self.active = self.nesting - 1, outer
    if (kept := self.kept_row(red, rsubst)) is not None:  # the row is read after this REDUCE, even at an index no loop varies
      lin.floor[kept.src[0]] = scope
    self.accumulate(inner, body, accs, copies, out_vars, ranges, vec, op, dt, gate, kept)
    for r in reversed(ranges): lin.close(lscopes[r])
    per_row = scope is not lin.root
    if tp is not None: scope, accs = self.thread_combine(work, scope, accs, acc_dt, op, tp.threads)
    res = {}
    for c in copies:
      fold = (tree_fold if per_row else seq_fold) if red_vec else (lambda _, x: x)
      # fold the lanes in a fixed order: a tree where it runs per output element (its cost counts), else lane by lane;
      # max_bits' three fold as integers (exact in any order), then make the float once
      if bits: v = max_bits.result(*(fold(op, lin.acc_read(a, ctx.acc_id())) for a in accs[c]))
      else: v = fold(op, lin.acc_read(accs[c], ctx.acc_id()))
      res[c] = self.group_combine(v, op, dt) if group else v
      if (nb := next((plans[r].blocks for r in ranges if plans[r].blocks), 0)):
        if len(copies) > 1 or self.last_block is not None or scope is not lin.root:
          raise CodegenError("BLOCKS cuts one reduction per kernel, outside any other (no unrolled copies)")
        res[c], self.last_block = self.grid_combine(res[c], op, dt, nb)
    if tailed:  # the elements past the last whole vector: a scalar loop continues from the folded lanes
      taccs = {c: UOp(Ops.DEFINE_ACC, dt, (UOp.const(dt, identity(op, dt)),), ctx.acc_id()) for c in copies}
      for c in copies: lin.emit(scope, taccs[c]); lin.emit(scope, UOp(Ops.ACC_STORE, dtypes.void, (taccs[c], res[c])))
      inner, tsubst, tscopes = scope, dict(subst), {}
      for r in ranges:
        if r is vr[0]:
          inner = lin.open(inner, lv := ctx.count_loop(tail))
          tsubst[r] = lv + (size - tail if isinstance(tail, int) and size is not None else simp(substitute(r.src[0], subst) - tail))
        else: inner, tsubst[r] = ctx.open_axis(inner, r, tsubst)
        tscopes[r] = inner
      tbody = simp(self.pack.unpack(substitute(self.hide(red.src[0]), tsubst), tsubst))
      self.accumulate(inner, tbody, taccs, copies, out_vars, ranges, None, op, dt, None, self.kept_row(red, tsubst))
      for r in reversed(ranges): lin.close(tscopes[r])
      res = {c: lin.acc_read(taccs[c], ctx.acc_id()) for c in copies}
    for c in copies:
      lin.need(res[c], scope)  # the fold runs once, where the REDUCE ends, not in the loop of whatever reads it first
      self.results[(ph, c)] = res[c]
    self.red_vars[ph] = out_vars

  def kept_row(self, red: UOp, rsubst: dict[UOp, UOp]) -> UOp | None:
    """KEEP: where body(r) goes, as an INDEX of the scratch row in this loop's terms (None: the REDUCE is not kept)."""
    if (k := self.keep.get(red)) is None: return None
    return k[0].index(simp(k[1] + rsubst[red.src[1]]))

  def accumulate(self, inner: Scope, body: UOp, accs: dict, copies: list, out_vars: list[UOp], ranges: list[UOp], vec: tuple[UOp, int] | None,
                 op: Ops, dt: DType, gate: UOp | None, kept: UOp | None = None) -> None:
    """acc = acc op body for every unrolled copy, in the innermost reduce loop; under KEEP (`kept`: where) body is stored
    too, the same value the accumulator takes."""
    plans = self.ctx.plans
    fuse = op is Ops.ADD and dt.is_float and dt.itemsize >= 4 and any(plans[r].fma for r in ranges)
    red_vars = [ev for r in ranges if plans[r].kind == "unroll" and (ev := plans[r].ev) is not None]
    for rc in combos(red_vars):  # reduce copies in increasing order keep the scalar loop's order of operations
      for c in copies:
        v = self.instantiate(body, {**dict(zip(out_vars, c)), **dict(zip(red_vars, rc))}, vec)
        if gate is not None: v = gate.where(v, UOp.const(dt, identity(op, dt))) if v.dtype == dt else v
        if kept is not None:
          st = self.instantiate(UOp(Ops.STORE, dtypes.void, (kept, body)), {**dict(zip(out_vars, c)), **dict(zip(red_vars, rc))}, vec)
          for one in (st.src if st.op is Ops.SINK else (st,)): self.ctx.lin.emit(inner, one)
        acc = accs[c]
        if isinstance(acc, list):  # max_bits' three accumulators
          cur3 = [self.ctx.lin.acc_read(a, self.ctx.acc_id()) for a in acc]
          for a, n in zip(acc, max_bits.steps(cur3, bcast(v, acc[0].dtype.count))): self.ctx.lin.emit(inner, UOp(Ops.ACC_STORE, dtypes.void, (a, n)))
          continue
        cur = self.ctx.lin.acc_read(acc, self.ctx.acc_id())
        if fuse and v.op is Ops.MUL:  # acc = fma(a, b, acc): one rounding per step, twice the throughput
          new = UOp(Ops.FMA, acc.dtype, (bcast(v.src[0], acc.dtype.count), bcast(v.src[1], acc.dtype.count), cur))
        elif op is Ops.ADD and (chained := _dot4_into(v, cur)) is not None: new = chained
        else: new = combine(op, cur, v)
        self.ctx.lin.emit(inner, UOp(Ops.ACC_STORE, dtypes.void, (acc, new)))

  # ---- folding partials ----
  def thread_combine(self, work: Scope, scope: Scope, accs: dict, acc_dt: DType, op: Ops, threads: int) -> tuple[Scope, dict]:
    """CPU: each chunk leaves its partials in scratch; the finishing call folds them in chunk order (deterministic,
    whichever thread ran which chunk)."""
    ctx, lin, core_id = self.ctx, self.ctx.lin, self.ctx.core_id
    assert core_id is not None
    w, n = acc_dt.count, len(accs)
    self.scratch = scratch = UOp(Ops.DEFINE_GLOBAL, acc_dt.scalar().ptr(threads * w * n), (), -1)
    for ci, acc in enumerate(accs.values()):
      part = lin.acc_read(acc, ctx.acc_id())
      lin.emit(work, UOp(Ops.STORE, dtypes.void, (scratch.index((core_id + ci * threads) * w), part)))
    lin.close(work)
    fin = lin.open_if(scope, core_id.eq(threads))
    out = {}
    for ci, (c, acc) in enumerate(accs.items()):
      acc2 = UOp(Ops.DEFINE_ACC, acc_dt, acc.src, ctx.acc_id())
      lin.emit(fin, acc2)
      inner = lin.open(fin, lv := ctx.count_loop(threads))
      part = UOp(Ops.LOAD, acc_dt, (scratch.index((lv + ci * threads) * w),))
      lin.emit(inner, UOp(Ops.ACC_STORE, dtypes.void, (acc2, combine(op, lin.acc_read(acc2, ctx.acc_id()), part))))
      lin.close(inner)
      out[c] = acc2
    self.finish_scope = fin
    return fin, out

  def group_combine(self, partial: UOp, op: Ops, dt: DType) -> UOp:
    """GPU: the block's threads combine their partials in a fixed tree (render/cuda_c.py's kiln_block_* helpers: warp
    shuffles, then one partial per warp through shared memory) and every thread gets the result. Lowered as a REDUCE of the
    partial over the block, its source a shared array of one slot per warp; the renderer prints the helper call."""
    n = self.grid.block[0]
    smem = UOp(Ops.DEFINE_LOCAL, dt.ptr(max(1, n // 32)), (), f"red{self.ctx.acc_id()}")
    return UOp(Ops.REDUCE, dt, (partial, smem, UOp.const(dtypes.index, n)), op)

  def grid_combine(self, block_result: UOp, op: Ops, dt: DType, nblocks: int) -> tuple[UOp, UOp]:
    """GPU BLOCKS, the second stage: each block leaves its result in a slot of a module-scope array and counts itself done
    (an atomic); the block that counts last folds the slots in block order (thread t the slots t, t + n, ..., then the
    block's tree), so the bits do not depend on which block finished last. With rows (a tiny output axis on the grid's
    y and z) each row has its own slots and count. Lowered as a REDUCE over the grid (sources: the block's result, its
    shared slots, n, the slot array, the done counts, nblocks); a REDUCE with arg "last" reads whether this block is that
    one. One launch: the runtime needs no scratch buffer nor a second kernel (ProgramSpec has neither for
    the GPU)."""
    n, (gy, gz) = self.grid.block[0], self.grid.grid[1:]
    assert isinstance(gy, int) and isinstance(gz, int), "the grid's y and z take constant sizes only (GpuGrid.axes)"
    smem = UOp(Ops.DEFINE_LOCAL, dt.ptr(max(1, n // 32)), (), f"red{self.ctx.acc_id()}")
    k = self.ctx.acc_id()
    slots = UOp(Ops.DEFINE_LOCAL, dt.ptr(nblocks * gy * gz), (), f"grid{k}")  # row-major: a row's nblocks slots
    done = UOp(Ops.DEFINE_LOCAL, dtypes.uint32.ptr(gy * gz), (), f"grid{k}_done")
    total = UOp(Ops.REDUCE, dt, (block_result, smem, UOp.const(dtypes.index, n), slots, done, UOp.const(dtypes.index, nblocks)), op)
    return total, UOp(Ops.REDUCE, dtypes.bool, (total,), "last")


def _dot4_into(v: UOp, acc: UOp) -> UOp | None:
  """acc + v as one chain of DOT4s where v is DOT4(a, b, DOT4(c, d, ... 0)): the innermost 0 replaced by acc (the same
  wrapping sum, and one vpdpbusd a term where the target has it); None for any other v."""
  if v.op is not Ops.DOT4: return None
  inner = acc if _zero(v.src[2]) else _dot4_into(v.src[2], acc)
  if inner is None: return None
  w = acc.dtype.count
  return UOp(Ops.DOT4, acc.dtype, (bcast(v.src[0], w), bcast(v.src[1], w), inner))


def _zero(u: UOp) -> bool:
  """A constant 0, or a vector of them."""
  return (u.op is Ops.CONST and u.arg == 0) or (u.op is Ops.VECTORIZE and all(_zero(s) for s in u.src))


def _inside(scope: Scope, outer: Scope) -> bool:
  p: Scope | None = scope
  while p is not None:
    if p is outer: return True
    p = p.parent
  return False


def seq_fold(op: Ops, v: UOp) -> UOp:
  """A vector's lanes folded in lane order."""
  lanes = [UOp(Ops.GEP, v.dtype.scalar(), (v,), i) for i in range(v.dtype.count)]
  res = lanes[0]
  for x in lanes[1:]: res = combine(op, res, x)
  return res


def tree_fold(op: Ops, v: UOp) -> UOp:
  """A vector's lanes folded pairwise, low half op high half (an odd last lane carried), until one is left: log2(width)
  vector ops instead of width - 1 dependent scalar ones, in a fixed order."""
  dt = v.dtype.scalar()
  def part(x: UOp, start: int, n: int) -> UOp:
    return UOp(Ops.GEP, dt, (x,), start) if n == 1 else UOp(Ops.VECTORIZE, dt.vec(n), tuple(UOp(Ops.GEP, dt, (x,), start + i) for i in range(n)))
  while (n := v.dtype.count) > 1:
    h = n // 2
    nv = combine(op, part(v, 0, h), part(v, h, h))
    if n % 2: nv = UOp(Ops.VECTORIZE, dt.vec(h + 1), (*((nv,) if h == 1 else (part(nv, i, 1) for i in range(h))), part(v, n - 1, 1)))
    v = nv
  return v
