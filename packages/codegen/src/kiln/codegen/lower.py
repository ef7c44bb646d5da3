"""Lowering: a kernel AST plus optimisation options to a linear program a renderer can walk.

Every user RANGE becomes a loop (or, on GPUs, a thread index) over units of `factor` elements, plus an expand variable
for the elements inside a unit: the vector lanes of an UPCAST axis, or the copies of an UNROLL axis. REDUCEs become
accumulators (DEFINE_ACC, ACC_STORE, reads as LOAD(acc)); unrolled copies share one loop, so register tiling keeps all
its accumulators live in one reduce loop. The Linearizer places each value in the outermost scope its sources allow.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

from kiln.codegen.linearize import Linearizer, Scope
from kiln.codegen.opt import Opt, OptOps, Target, affine_coeff, axis_size, heuristic_opts
from kiln.codegen.threads import CORE_ID
from kiln.ir.analysis import free_ranges, free_ranges_of, identity
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import AxisType, GroupOp, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp
from kiln.ir.verify import verify


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
  flops: int = 0
  mem_bytes: int = 0


@functools.lru_cache(maxsize=1 << 14)
def _simplify(u: UOp) -> UOp:
  # lowering simplifies the same small index graphs again and again (per lane, per unrolled copy): UOps are interned, so memoise
  return simplify(u)


def _expand_var(axis_id: int, kind: str, amount: int) -> UOp:
  # not an identifier, so it can never clash with a user variable
  return UOp(Ops.DEFINE_VAR, dtypes.index, (), (f"{kind}.{axis_id}", 0, amount - 1))


@dataclass
class AxisPlan:
  rng: UOp
  factor: int = 1  # elements per unit: the UPCAST width or UNROLL count
  kind: str = ""  # "vec", "unroll" or ""
  threads: int = 1
  local: int = 0  # GPU threads per block along this axis
  group: int = 0  # GPU threads sharing this reduce axis
  outer: bool = False  # CPU: opened before the other output loops
  pack: bool = False  # CPU: loads of this reduce axis that skip the innermost output loop read a packed copy
  fma: bool = False  # a sum of products over this axis accumulates with fused multiply-adds
  ev: UOp | None = None  # the expand variable (lane or unroll copy)


class Lowerer:
  def __init__(self, ast: UOp, target: Target, opts: list[Opt]):
    self.ast, self.target, self.opts = ast, target, opts
    self.lin = Linearizer()
    self.plans: dict[UOp, AxisPlan] = {}
    self.vec: tuple[UOp, int] | None = None  # (lane variable, width)
    self.acc_count = itertools.count()
    self.loop_count = itertools.count()
    self.core_id: UOp | None = None
    self.specials: dict[str, UOp] = {}
    self.grid: list[int | UOp] = [1, 1, 1]
    self.block: list[int] = [1, 1, 1]
    self.red_results: dict[tuple[UOp, tuple], UOp] = {}
    self.placeholders: dict[UOp, UOp] = {}  # placeholder -> REDUCE
    self.scratch: UOp | None = None
    self.packed: dict[UOp, tuple[UOp, UOp, int]] = {}  # packed load -> (its reduce range, its scratch base, lanes)
    self.scratch_used = 0  # elements of packed panels per thread
    self.pack_threads = 1
    self.finish_scope: Scope | None = None  # where a threaded reduction's result exists (the finishing call)
    self.red_vars: dict[UOp, list[UOp]] = {}  # placeholder -> the unroll variables its result depends on
    self.store_loops: dict[UOp, set[UOp]] = {}  # store -> its loops, taken before simplification could drop one
    self.tails: set[UOp] = set()  # stores that are the scalar tail of a peeled vector axis (core 0 runs them)
    self.grid_blocks: dict[int, UOp] = {}  # GPU grid dim -> blocks, when several store groups share the grid
    self.floor: Scope | None = None  # GPU: a gated store's reduces go inside its gate, so threads past the end load nothing
    self.nesting = 0  # how many REDUCEs enclose the one being emitted

  # ---- planning ----
  def plan_axes(self, ranges: list[UOp]) -> None:
    by_id = {r.arg[0]: r for r in ranges}
    for r in ranges: self.plans[r] = AxisPlan(r)
    for o in self.opts:
      if o.axis not in by_id: raise CodegenError(f"{o} names axis {o.axis}, but the kernel's axes are {sorted(by_id)}")
      p = self.plans[by_id[o.axis]]
      size = axis_size(p.rng)
      if o.op in (OptOps.UPCAST, OptOps.UNROLL):
        if p.factor != 1: raise CodegenError(f"{o}: axis {o.axis} is already split by {p.factor}")
        if size is None or size % o.amount:
          raise CodegenError(f"{o}: the amount must divide the axis size ({size if size is not None else 'symbolic'})")
        if o.op is OptOps.UPCAST:
          if self.vec is not None: raise CodegenError(f"{o}: only one axis can be vectorised")
          if self.target.vector_bytes == 0: raise CodegenError(f"{o}: {self.target.device} takes no UPCAST (no explicit vectors)")
        p.factor, p.kind = o.amount, ("vec" if o.op is OptOps.UPCAST else "unroll")
        p.ev = _expand_var(o.axis, "lane" if p.kind == "vec" else "unroll", o.amount)
        if p.kind == "vec": self.vec = (p.ev, o.amount)
      elif o.op is OptOps.THREAD:
        if self.target.vector_bytes == 0: raise CodegenError(f"{o}: THREAD is a CPU option")
        p.threads = o.amount
      elif o.op is OptOps.LOCAL:
        if self.target.vector_bytes != 0: raise CodegenError(f"{o}: LOCAL is a GPU option")
        if o.amount > self.target.max_local: raise CodegenError(f"{o}: at most {self.target.max_local} threads per block")
        p.local = o.amount
      elif o.op is OptOps.GROUP:
        if self.target.vector_bytes != 0: raise CodegenError(f"{o}: GROUP is a GPU option")
        if o.amount > self.target.max_local or o.amount & (o.amount - 1): raise CodegenError(f"{o}: needs a power of two <= {self.target.max_local}")
        if p.rng.arg[1] is not AxisType.REDUCE: raise CodegenError(f"{o}: GROUP shares a reduce axis; axis {o.axis} is an output axis")
        p.group = o.amount
      elif o.op is OptOps.FMA:
        if p.rng.arg[1] is not AxisType.REDUCE: raise CodegenError(f"{o}: FMA applies to a reduce axis")
        p.fma = True
      elif o.op in (OptOps.OUTER, OptOps.PACK):
        if self.target.vector_bytes == 0: raise CodegenError(f"{o}: {o.op.name} is a CPU option")
        if o.op is OptOps.OUTER:
          if p.rng.arg[1] is AxisType.REDUCE: raise CodegenError(f"{o}: only output axes can be made outermost")
          p.outer = True
        else:
          if p.rng.arg[1] is not AxisType.REDUCE or size is None: raise CodegenError(f"{o}: PACK needs a reduce axis of constant size")
          p.pack = True
    if sum(p.threads > 1 for p in self.plans.values()) > 1: raise CodegenError("only one axis can be split over threads")
    if any(p.pack and p.kind == "vec" for p in self.plans.values()):  # a panel is k x lanes of an output axis
      raise CodegenError("PACK packs panels across the vectorised output axis; it cannot pack a reduce axis that is itself the UPCAST one")
    groups = [p for p in self.plans.values() if p.group]
    if len(groups) > 1: raise CodegenError("only one reduce axis can be a GROUP")
    # a GROUP's barrier needs every thread of the block, and its shared array one reduction per block
    if groups and any(p.local for p in self.plans.values()):
      raise CodegenError("GROUP cannot be combined with LOCAL (a block does one group reduction)")

  # ---- loops ----
  def open_axis(self, scope: Scope, r: UOp, subst: dict[UOp, UOp]) -> tuple[Scope, UOp]:
    """Open the loop for range r inside scope; returns the new scope and the expression that replaces r."""
    p = self.plans[r]
    end = substitute(r.src[0], subst)
    units = end // p.factor if p.factor > 1 else end
    if p.threads > 1:
      if self.core_id is None: self.core_id = self._core(p.threads, finish=False)
      chunk = (units + (p.threads - 1)) // p.threads
      start = self.core_id * chunk
      stop = (start + chunk < units).where(start + chunk, units)
    else: start, stop = UOp.const(dtypes.index, 0), units
    lv = UOp(Ops.RANGE, dtypes.index, (_simplify(start), _simplify(stop)), (next(self.loop_count), r.arg[1]))
    inner = self.lin.open(scope, lv)
    expr = lv * p.factor + p.ev if p.ev is not None else lv
    return inner, expr

  def _grid_axes(self, out: list[UOp], subst: dict[UOp, UOp]) -> list[tuple[int, UOp, UOp, UOp]]:
    """(dim, range, end, blocks) for the output axes that go to the grid: up to three, innermost first."""
    res: list[tuple[int, UOp, UOp, UOp]] = []
    for dim, r in enumerate(reversed(out[-3:])):
      size = axis_size(r)
      if dim > 0 and (size is None or size > self.target.max_grid[dim]): break
      end, p = substitute(r.src[0], subst), self.plans[r]
      res.append((dim, r, end, (end + (p.local - 1)) // p.local if p.local else end))
    return res

  def gpu_axes(self, out: list[UOp], subst: dict[UOp, UOp]) -> tuple[list[UOp], UOp | None]:
    """Map up to three output axes to the grid (the innermost with its LOCAL threads); returns the axes left as loops
    and the gate (index < size) the body needs when a size does not divide evenly or the grid is larger (several stores)."""
    gate: UOp | None = None
    mapped = self._grid_axes(out, subst)
    for dim, r, end, nblocks in mapped:
      p, size = self.plans[r], axis_size(r)
      blocks = self.grid_blocks.get(dim, nblocks)  # store groups of different sizes share one grid: it spans the largest
      if (empty := blocks.op is Ops.CONST and blocks.arg < 1): blocks = UOp.const(dtypes.index, 1)  # an empty axis: one block, gated off
      gid = self._special(f"gidx{dim}", blocks)
      if p.local:
        expr = gid * p.local + self._special(f"lidx{dim}", p.local)
        self.block[dim] = p.local
        if size is None or size % p.local or blocks is not nblocks or empty: gate = (expr < end) if gate is None else gate & (expr < end)
      else:
        expr = gid
        if blocks is not nblocks or empty: gate = (expr < end) if gate is None else gate & (expr < end)
      self.grid[dim] = _simplify(blocks) if blocks.op is not Ops.CONST else int(blocks.arg)
      subst[r] = expr
    return out[:len(out) - len(mapped)], gate

  def _core(self, threads: int, finish: bool) -> UOp:
    # a threaded reduction adds a finishing call with core_id == threads, so the id's bound says so
    self.core_id = UOp(Ops.SPECIAL, dtypes.index, (UOp.const(dtypes.index, threads + finish),), CORE_ID)
    return self.core_id

  def _special(self, name: str, size: int | UOp) -> UOp:
    s = size if isinstance(size, UOp) else UOp.const(dtypes.index, size)
    return self.specials.setdefault(name, UOp(Ops.SPECIAL, dtypes.index, (_simplify(s),), name))

  # ---- expressions ----
  def hide_reduces(self, u: UOp) -> UOp:
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

  def expand_vars(self, u: UOp) -> list[UOp]:
    """The unroll variables u depends on, its reduces' results included (vector lanes are vectorize's, not copies)."""
    out: list[UOp] = []
    for n in u.toposort():
      found = [n] if n.op is Ops.DEFINE_VAR and n.arg[0].startswith("unroll.") else self.red_vars.get(n, [])
      out += [v for v in found if v not in out]
    return sorted(out, key=lambda v: v.arg[0])

  def instantiate(self, u: UOp, combo: dict[UOp, int]) -> UOp:
    """One unrolled copy of u: unroll variables to constants, placeholders to that copy's reduce results, then vectorise."""
    m: dict[UOp, UOp] = {v: UOp.const(dtypes.index, c) for v, c in combo.items()}
    out = _simplify_indices(substitute(u, m)) if m else u
    phs = {n: self.red_results[(n, tuple(combo[v] for v in self.red_vars[n]))] for n in out.toposort() if n in self.placeholders}
    if phs: out = substitute(out, phs)
    return self.vectorize(out) if self.vec is not None else out

  def vectorize(self, u: UOp) -> UOp:
    """Turn the scalar graph u (in terms of the lane variable) into vector ops over the lanes."""
    assert self.vec is not None
    lane, w = self.vec
    vdep: set[UOp] = set()
    out: dict[UOp, UOp] = {}
    for n in u.toposort():
      if n is lane:
        out[n] = UOp(Ops.VECTORIZE, dtypes.index.vec(w), tuple(UOp.const(dtypes.index, i) for i in range(w)))
        vdep.add(n)
        continue
      if not any(s in vdep for s in n.src) or n.op in (Ops.GEP, Ops.DEFINE_ACC) or (n.op is Ops.LOAD and n.src[0].op is Ops.DEFINE_ACC):
        # scalar, or a vector already (accumulators and their reads)
        out[n] = n
        if isinstance(n.dtype, DType) and n.dtype.count > 1: vdep.add(n)
        continue
      vdep.add(n)
      if n.op is Ops.INDEX: out[n] = n; continue  # noqa: E702  (rewritten by its LOAD/STORE)
      if n.op is Ops.LOAD: out[n] = self._vload(n, lane, w); continue  # noqa: E702
      if n.op is Ops.STORE: out[n] = self._vstore(n, out[n.src[1]], lane, w); continue  # noqa: E702
      if n.op in GroupOp.ALU or n.op in (Ops.CAST, Ops.BITCAST):
        srcs = tuple(_bcast(out[s], w) for s in n.src)
        dt = n.dtype.vec(w) if isinstance(n.dtype, DType) and n.dtype.count == 1 else n.dtype
        out[n] = UOp(n.op, dt, srcs, n.arg)
        continue
      raise CodegenError(f"cannot vectorise {n.op}")
    return out[u]

  def _lanes(self, idx: UOp, lane: UOp, w: int) -> list[UOp]:
    return [_simplify(substitute(idx, {lane: UOp.const(dtypes.index, i)})) for i in range(w)]

  def _vload(self, ld: UOp, lane: UOp, w: int) -> UOp:
    buf, idx, *gate = ld.src[0].src
    dt = ld.dtype
    if not gate and affine_coeff(idx, lane) == 1:
      return UOp(Ops.LOAD, dt.vec(w), (buf.index(_simplify(substitute(idx, {lane: UOp.const(dtypes.index, 0)}))),))  # type: ignore[union-attr]
    idxs = self._lanes(idx, lane, w)
    gates = self._lanes(gate[0], lane, w) if gate else [None] * w
    return UOp(Ops.VECTORIZE, dt.vec(w), tuple(buf.index(i, g).load() for i, g in zip(idxs, gates)))  # type: ignore[union-attr]

  def _vstore(self, st: UOp, val: UOp, lane: UOp, w: int) -> UOp:
    buf, idx, *gate = st.src[0].src
    val = _bcast(val, w)
    if not gate and affine_coeff(idx, lane) == 1:
      return UOp(Ops.STORE, dtypes.void, (buf.index(_simplify(substitute(idx, {lane: UOp.const(dtypes.index, 0)}))), val))
    idxs = self._lanes(idx, lane, w)
    gates = self._lanes(gate[0], lane, w) if gate else [None] * w
    return UOp(Ops.SINK, dtypes.void, tuple(UOp(Ops.STORE, dtypes.void, (buf.index(i, g), UOp(Ops.GEP, val.dtype.scalar(), (val,), l)))  # type: ignore[union-attr]
                                            for l, (i, g) in enumerate(zip(idxs, gates))))

  # ---- reduces ----
  def emit_reduces(self, u: UOp, scope: Scope, subst: dict[UOp, UOp], loop_scopes: dict[UOp, Scope]) -> None:
    """Emit every placeholder's REDUCE found in u, each in the outermost scope its free ranges allow."""
    for ph in [n for n in u.toposort() if n in self.placeholders]:
      if ph in self.red_vars: continue
      red = self.placeholders[ph]
      deps = [loop_scopes[r] for r in free_ranges(red) if r in loop_scopes] + ([self.floor] if self.floor is not None else [])
      target = max(deps, key=lambda s: s.depth, default=self.lin.root)
      if target.depth > scope.depth: target = scope
      self.emit_reduce(ph, red, target, subst, loop_scopes)

  def emit_reduce(self, ph: UOp, red: UOp, scope: Scope, subst: dict[UOp, UOp], loop_scopes: dict[UOp, Scope]) -> None:
    op, ranges = red.arg, list(red.src[1:])
    dt = red.dtype
    assert isinstance(dt, DType)
    value = self.hide_reduces(red.src[0])
    value = substitute(value, subst)
    value = _simplify(value)
    # the whole body, nested reduces included: their placeholders in `value` say nothing yet (they are emitted after this one)
    whole = substitute(red.src[0], subst)
    own = {self.plans[r].ev for r in ranges}
    out_vars = sorted({v for v in (*self.expand_vars(value), *self.expand_vars(whole)) if v not in own}, key=lambda v: v.arg[0])
    red_vec = any(self.plans[r].kind == "vec" for r in ranges)
    lane_dep = self.vec is not None and not red_vec and self.vec[0] in whole.toposort()
    acc_dt = dt.vec(self.vec[1]) if self.vec is not None and (lane_dep or red_vec) else dt
    group = next((self.plans[r].group for r in ranges if self.plans[r].group), 0)
    tp = next((self.plans[r] for r in ranges if self.plans[r].threads > 1), None)
    combos = _combos(out_vars)
    work = scope
    if tp is not None:  # calls 0..T-1 each reduce a chunk; the finishing call (core_id == T) folds their partials
      if self.nesting:  # its result would exist only in the finishing call, but the enclosing reduce's loops are outside it
        raise CodegenError(f"THREAD on reduce axis {tp.rng.arg[0]}: its REDUCE is nested inside another REDUCE; split an output axis instead")
      if scope is not self.lin.root or self.finish_scope is not None:
        raise CodegenError("only one full reduction per kernel can be split over threads")
      work = self.lin.open_if(scope, self._core(tp.threads, finish=True) < tp.threads)
    accs = {}
    for c in combos:
      accs[c] = UOp(Ops.DEFINE_ACC, acc_dt, (UOp.const(acc_dt, identity(op, dt)),), next(self.acc_count))
      self.lin.emit(work, accs[c])
    # loops over the reduce axes, innermost last
    inner, rsubst, lscopes = work, dict(subst), dict(loop_scopes)
    gate: UOp | None = None
    for r in ranges:
      p = self.plans[r]
      if p.group:
        lid = self._special("lidx0", p.group)
        end = substitute(r.src[0], rsubst)
        trips = (end + (p.group - 1)) // p.group
        lv = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 0), _simplify(trips)), (next(self.loop_count), AxisType.REDUCE))
        inner = self.lin.open(inner, lv)
        rsubst[r] = lv * p.group + lid
        gate = rsubst[r] < end
        self.block[0] = p.group
      else:
        inner, rsubst[r] = self.open_axis(inner, r, rsubst)
      lscopes[r] = inner
    body = _simplify(self.unpack(substitute(self.hide_reduces(red.src[0]), rsubst), rsubst))
    if gate is not None: body = _gate_loads(body, gate)
    self.nesting += 1
    try: self.emit_reduces(body, inner, rsubst, lscopes)
    finally: self.nesting -= 1
    fuse = op is Ops.ADD and dt.is_float and dt.itemsize >= 4 and any(self.plans[r].fma for r in ranges)
    red_vars = [ev for r in ranges if self.plans[r].kind == "unroll" and (ev := self.plans[r].ev) is not None]
    for rc in _combos(red_vars):  # reduce copies in increasing order keep the scalar loop's order of operations
      for c in combos:
        v = self.instantiate(body, {**dict(zip(out_vars, c)), **dict(zip(red_vars, rc))})
        if gate is not None: v = gate.where(v, UOp.const(dt, identity(op, dt))) if v.dtype == dt else v
        cur = self.lin.acc_read(accs[c], next(self.acc_count))
        if fuse and v.op is Ops.MUL:  # acc = fma(a, b, acc): one rounding per step, twice the throughput
          new = UOp(Ops.FMA, acc_dt, (_bcast(v.src[0], acc_dt.count), _bcast(v.src[1], acc_dt.count), cur))
        else: new = _combine(op, cur, v)
        self.lin.emit(inner, UOp(Ops.ACC_STORE, dtypes.void, (accs[c], new)))
    for r in reversed(ranges): self.lin.close(lscopes[r])
    if tp is not None: scope, accs = self.thread_combine(work, scope, accs, acc_dt, op, tp.threads)
    for c in combos:
      res = self.lin.acc_read(accs[c], next(self.acc_count))
      if red_vec:  # fold the lanes in order
        lanes = [UOp(Ops.GEP, dt, (res,), i) for i in range(acc_dt.count)]
        res = lanes[0]
        for x in lanes[1:]: res = _combine(op, res, x)
      if group: res = self.group_combine(scope, res, op, dt)
      self.red_results[(ph, c)] = res
    self.red_vars[ph] = out_vars

  def thread_combine(self, work: Scope, scope: Scope, accs: dict, acc_dt: DType, op: Ops, threads: int) -> tuple[Scope, dict]:
    """CPU: each call leaves its partials in scratch; the finishing call folds them in core_id order (deterministic)."""
    assert self.core_id is not None
    w, n = acc_dt.count, len(accs)
    self.scratch = UOp(Ops.DEFINE_GLOBAL, acc_dt.scalar().ptr(threads * w * n), (), -1)
    for ci, acc in enumerate(accs.values()):
      part = self.lin.acc_read(acc, next(self.acc_count))
      self.lin.emit(work, UOp(Ops.STORE, dtypes.void, (self.scratch.index((self.core_id + ci * threads) * w), part)))
    self.lin.close(work)
    fin = self.lin.open_if(scope, self.core_id.eq(threads))
    out = {}
    for ci, (c, acc) in enumerate(accs.items()):
      acc2 = UOp(Ops.DEFINE_ACC, acc_dt, acc.src, next(self.acc_count))
      self.lin.emit(fin, acc2)
      lv = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 0), UOp.const(dtypes.index, threads)), (next(self.loop_count), AxisType.REDUCE))
      inner = self.lin.open(fin, lv)
      part = UOp(Ops.LOAD, acc_dt, (self.scratch.index((lv + ci * threads) * w),))
      self.lin.emit(inner, UOp(Ops.ACC_STORE, dtypes.void, (acc2, _combine(op, self.lin.acc_read(acc2, next(self.acc_count)), part))))
      self.lin.close(inner)
      out[c] = acc2
    self.finish_scope = fin
    return fin, out

  # ---- packing ----
  def pack_loads(self, stores: list[UOp], loops: list[UOp]) -> dict[UOp, set[UOp]]:
    """The loads to pack: under a PACK reduce axis, using the vector axis but not the innermost output loop (so the
    packed panel is reused by every iteration of that loop). Returns each with the output loops it needs open."""
    out: dict[UOp, set[UOp]] = {}
    if not loops or self.vec is None: return out
    inner = loops[-1]
    for red in (u for st in stores for u in st.toposort() if u.op is Ops.REDUCE):
      kr = [r for r in red.src[1:] if self.plans[r].pack]
      if len(kr) != 1 or len(red.src) != 2: continue
      for ld in (u for u in red.src[0].toposort() if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and len(u.src[0].src) == 2):
        rs = free_ranges(ld)
        vec_r = next(p.rng for p in self.plans.values() if p.kind == "vec")
        if inner not in rs and kr[0] in rs and vec_r in rs and rs - {kr[0]} <= set(loops): out[ld] = rs - {kr[0]}
    return out

  def emit_pack(self, scope: Scope, ld: UOp, subst: dict[UOp, UOp]) -> None:
    """Copy the panel ld reads for the current outer tile into this thread's scratch: panel[k, lane] at (k*W + lane)."""
    assert self.vec is not None
    lane, w = self.vec
    k = next(r for r in free_ranges(ld) if self.plans[r].pack)
    size = axis_size(k)
    assert size is not None and isinstance(ld.dtype, DType)
    threads = max(p.threads for p in self.plans.values())
    if threads > 1 and self.core_id is None: self._core(threads, finish=False)  # the split loop may open later, inside this one
    base = (self.core_id * (size * w) if self.core_id is not None and threads > 1 else UOp.const(dtypes.index, 0)) + self.scratch_used
    self.scratch_used += size * w
    lv = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 0), UOp.const(dtypes.index, size)), (next(self.loop_count), AxisType.REDUCE))
    inner = self.lin.open(scope, lv)
    src = _simplify_indices(substitute(ld, {**subst, k: lv}))
    self.packed[ld] = (k, base, w)
    self.pack_threads = threads
    st = self.vectorize(UOp(Ops.STORE, dtypes.void, (self._scratch_ptr(ld.dtype).index(_simplify(base + lv * w + lane)), src)))
    for one in (st.src if st.op is Ops.SINK else (st,)): self.lin.emit(inner, one)
    self.lin.close(inner)

  def _scratch_ptr(self, dt: DType) -> UOp:
    # sized when lowering ends (every pack's share is known by then); one pointer per dtype is all a kernel needs
    return UOp(Ops.DEFINE_GLOBAL, dt.ptr(), (), -1)

  def unpack(self, body: UOp, rsubst: dict[UOp, UOp]) -> UOp:
    """Loads that were packed read the packed panel instead: (k*W + lane) in this thread's scratch."""
    if not self.packed: return body
    assert self.vec is not None
    m = {}
    for ld, (k, base, w) in self.packed.items():
      assert isinstance(ld.dtype, DType)
      m[substitute(ld, rsubst)] = UOp(Ops.LOAD, ld.dtype, (self._scratch_ptr(ld.dtype).index(_simplify(base + rsubst[k] * w + self.vec[0])),))
    return substitute(body, m) if m else body

  def group_combine(self, scope: Scope, partial: UOp, op: Ops, dt: DType) -> UOp:
    """GPU: the block's threads leave partials in shared memory; thread 0 folds them in order."""
    n = self.block[0]
    lid = self.specials["lidx0"]
    smem = UOp(Ops.DEFINE_LOCAL, dt.ptr(n), (), f"red{next(self.acc_count)}")
    self.lin.emit(scope, UOp(Ops.STORE, dtypes.void, (smem.index(lid), partial)))
    self.lin.emit(scope, UOp(Ops.BARRIER, dtypes.void, (smem,)))
    acc = UOp(Ops.DEFINE_ACC, dt, (UOp.const(dt, identity(op, dt)),), next(self.acc_count))
    self.lin.emit(scope, acc)
    lv = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 0), UOp.const(dtypes.index, n)), (next(self.loop_count), AxisType.REDUCE))
    inner = self.lin.open(scope, lv)
    cur = self.lin.acc_read(acc, next(self.acc_count))
    self.lin.emit(inner, UOp(Ops.ACC_STORE, dtypes.void, (acc, _combine(op, cur, smem.index(lv).load()))))
    self.lin.close(inner)
    return self.lin.acc_read(acc, next(self.acc_count))

  # ---- stores ----
  def lower_group(self, stores: list[UOp], axes: list[UOp]) -> None:
    subst: dict[UOp, UOp] = {}
    scope = self.lin.root
    threads = max((p.threads for p in self.plans.values()), default=1)
    if threads > 1 and set(stores) <= self.tails and not any(self.plans[r].threads > 1 for r in axes):
      # a peeled tail that no split axis shares runs once, on the first thread
      if self.core_id is None: self._core(threads, finish=False)
      assert self.core_id is not None
      scope = self.lin.open_if(scope, self.core_id.eq(0))
    loop_scopes: dict[UOp, Scope] = {}
    gate: UOp | None = None
    loops = axes
    if self.target.vector_bytes == 0:
      loops, gate = self.gpu_axes(axes, subst)
      if loops and any(p.group for p in self.plans.values()):  # its shared array would be reused across iterations without a barrier
        raise CodegenError(f"GROUP needs every output axis on the grid, but axes {[r.arg[0] for r in loops]} would be loops inside a block")
    loops = sorted(loops, key=lambda r: not self.plans[r].outer)
    packs = self.pack_loads(stores, loops)
    for r in loops:
      scope, subst[r] = self.open_axis(scope, r, subst)
      loop_scopes[r] = scope
      opened = set(loops[:loops.index(r) + 1])
      for ld in [ld for ld, needs in packs.items() if needs <= opened]:  # a panel is packed once its outer loops are open
        self.emit_pack(scope, ld, subst)
        del packs[ld]
    body_scope = scope
    if gate is not None: body_scope = self.floor = self.lin.open_if(scope, _simplify(gate))
    red_scope = body_scope
    if (g := max((p.group for p in self.plans.values()), default=0)):  # only thread 0 of a block writes a group reduction
      body_scope = self.lin.open_if(body_scope, self._special("lidx0", g).eq(0))
    for st in stores:
      if gate is not None: st = st.replace(src=(st.src[0], _gate_loads(st.src[1], gate)))  # loads hoisted out of the gate read nothing
      s = _simplify(substitute(self.hide_reduces(st), subst))
      self.emit_reduces(s, red_scope, subst, loop_scopes)
      target = self.finish_scope if self.finish_scope is not None else body_scope
      for c in _combos(self.expand_vars(s)):
        out = self.instantiate(s, dict(zip(self.expand_vars(s), c)))
        for one in (out.src if out.op is Ops.SINK else (out,)): self.lin.emit(target, one)
    self.floor = None
    self.lin.close_to(self.lin.root)

  def lower(self) -> LoweredKernel:
    ast = self.ast
    stores = [s for s in ast.src if s.op is Ops.STORE]
    loops_of = self.store_loops or {st: free_ranges(st) for st in stores}
    all_ranges = sorted({n for n in ast.toposort() if n.op is Ops.RANGE} | {r for rs in loops_of.values() for r in rs}, key=lambda r: r.arg[0])
    self.plan_axes(all_ranges)
    groups: dict[tuple[UOp, ...], list[UOp]] = {}
    for st in stores: groups.setdefault(tuple(sorted(loops_of[st] | free_ranges(st), key=lambda r: r.arg[0])), []).append(st)
    threaded = [p for p in self.plans.values() if p.threads > 1]
    if threaded and len([g for g, sts in groups.items() if not set(sts) <= self.tails]) > 1:
      raise CodegenError("a THREAD split needs a kernel whose stores share one loop nest")
    if threaded and threaded[0].rng.arg[1] is AxisType.REDUCE and any(axes for axes in groups):
      raise CodegenError(f"THREAD on reduce axis {threaded[0].rng.arg[0]} needs a full reduction (no output axes); split an output axis instead")
    if self.target.vector_bytes == 0 and len(groups) > 1:  # GPU: size the shared grid for the largest store group
      for axes in groups:
        for dim, _, _, nb in self._grid_axes(list(axes), {}):
          cur = self.grid_blocks.get(dim)
          self.grid_blocks[dim] = nb if cur is None or cur is nb else _simplify(cur.maximum(nb))
      for dim, nb in self.grid_blocks.items():  # a symbolic size bound to 0 must still launch the block the other groups run in
        if nb.op is not Ops.CONST and nb.vmin < 1: self.grid_blocks[dim] = _simplify(nb.maximum(1))
    for axes, sts in groups.items(): self.lower_group(sts, list(axes))
    uops = self.lin.program()
    globals_ = sorted({n for n in ast.toposort() if n.op is Ops.DEFINE_GLOBAL}, key=lambda g: g.arg)
    # a loop kept for its trip count may use a variable the simplified stores no longer mention
    vars_ = sorted({n for n in UOp.sink(ast, *all_ranges).toposort() if n.op is Ops.DEFINE_VAR}, key=lambda v: v.arg[0])
    outs = sorted({st.src[0].src[0].arg for st in stores})
    ins = sorted({n.src[0].src[0].arg for n in ast.toposort() if n.op is Ops.LOAD and n.src[0].op is Ops.INDEX})
    threads = threaded[0].threads if threaded else 1
    lk = LoweredKernel(name=ast.arg if isinstance(ast.arg, str) else "kernel", uops=uops, globals=globals_, vars=vars_, opts=self.opts,
                       threads=threads, outs=outs, ins=ins)
    if self.target.vector_bytes == 0:
      lk.global_size, lk.local_size = tuple(self.grid), tuple(self.block)  # type: ignore[assignment]
    elif threads > 1: lk.global_size = (threads, 1, 1)
    lk.min_elements = _min_elements(ast)
    if self.packed:
      if self.scratch is not None: raise CodegenError("PACK cannot be combined with a threaded full reduction")
      dt = next(iter(self.packed)).dtype
      assert isinstance(dt, DType)
      self.scratch = UOp(Ops.DEFINE_GLOBAL, dt.ptr(), (), -1)
    lk.scratch, lk.finish = self.scratch, self.finish_scope is not None
    if isinstance(sp := self.scratch.dtype if self.scratch is not None else None, PtrDType):
      # a threaded reduction's scratch has its size in its pointer; packed panels add up per thread
      lk.scratch_bytes = sp.nbytes if sp.size > 0 else self.scratch_used * self.pack_threads * sp.itemsize
    lk.flops, lk.mem_bytes = _estimate(ast)
    return lk



def _simplify_indices(u: UOp) -> UOp:
  """Simplify only the index and gate of every INDEX: what contiguity checks and bounds need. The values themselves are
  left to LLVM/nvcc, which fold constants too, so each unrolled copy does not pay for a whole-graph rewrite."""
  m = {n: UOp(Ops.INDEX, n.dtype, (n.src[0], *(_simplify(s) for s in n.src[1:]))) for n in u.toposort() if n.op is Ops.INDEX}
  return substitute(u, {k: v for k, v in m.items() if v is not k})


def _bcast(u: UOp, w: int) -> UOp:
  if not isinstance(u.dtype, DType) or u.dtype.count == w or w == 1: return u
  return UOp(Ops.VECTORIZE, u.dtype.vec(w), (u,) * w)


def _combine(op: Ops, a: UOp, b: UOp) -> UOp: return UOp(op, a.dtype, (a, _bcast(b, a.dtype.count)))  # type: ignore[union-attr]


def _combos(vars_: list[UOp]) -> list[tuple[int, ...]]:
  return list(itertools.product(*(range(v.arg[2] + 1) for v in vars_)))


def _gate_loads(u: UOp, gate: UOp) -> UOp:
  """Add `gate` to every INDEX under u, so lanes past the end of a group-strided loop read nothing."""
  m = {n: UOp(Ops.INDEX, n.dtype, (n.src[0], n.src[1], gate if len(n.src) == 2 else n.src[2] & gate)) for n in u.toposort()
       if n.op is Ops.INDEX and n.src[0].op is Ops.DEFINE_GLOBAL}
  return substitute(u, m)


def _min_elements(ast: UOp) -> dict[int, int]:
  """Per slot, how many elements the kernel may touch (index vmax + 1) over all variable values."""
  need: dict[int, int] = {}
  for n in ast.toposort():
    if n.op is Ops.INDEX and n.src[0].op is Ops.DEFINE_GLOBAL:
      hi = n.src[1].vmax
      need[n.src[0].arg] = max(need.get(n.src[0].arg, 1), int(hi) + 1 if isinstance(hi, int) else 1)
  return need


def _estimate(ast: UOp) -> tuple[int, int]:
  """Flops and bytes moved at the variables' upper bounds (a rough figure for profiles)."""
  trips: dict[UOp, int] = {}
  nodes = ast.toposort()
  free = free_ranges_of(nodes)  # every node's free ranges in one pass (free_ranges() per node was quadratic in depth)
  for n in nodes:
    if n.op is Ops.RANGE: trips[n] = max(int(n.src[0].vmax), 0)
  def iters(u: UOp) -> int:  # a REDUCE runs over its own ranges too; anything else over its free ranges
    rs = free[u] | (set(u.src[1:]) if u.op is Ops.REDUCE else set())
    return math.prod(trips[r] for r in rs) if rs else 1
  flops = sum(iters(n) for n in nodes if (n.op in GroupOp.ALU and isinstance(n.dtype, DType) and n.dtype.is_float) or n.op is Ops.REDUCE)
  mem = 0
  touched = _min_elements(ast)
  for g in {n for n in nodes if n.op is Ops.DEFINE_GLOBAL}:
    assert isinstance(g.dtype, PtrDType)
    mem += touched.get(g.arg, 1) * g.dtype.base.itemsize
  return flops, mem


def lower(ast: UOp, target: Target, opts: list[Opt] | None = None) -> LoweredKernel:
  """Verify, simplify, choose options (the heuristic unless given) and lower ast to a linear program."""
  if ast.op is not Ops.SINK: raise CodegenError(f"a kernel is a SINK of STOREs, got {ast.op}")
  verify(ast)
  prepared, loops = _prepare(ast)
  chosen = heuristic_opts(prepared, target) if opts is None else list(opts)
  tails: set[UOp] = set()
  if target.vector_bytes and (peeled := _peel(ast, chosen)) is not None:
    ast, n_main = peeled
    prepared, loops = _prepare(ast)
    tails = set([s for s in prepared.src if s.op is Ops.STORE][n_main:])
  lw = Lowerer(prepared, target, chosen)
  lw.store_loops, lw.tails = loops, tails
  return lw.lower()


def _prepare(ast: UOp) -> tuple[UOp, dict[UOp, set[UOp]]]:
  """Simplify each store, keeping the loops it had: bounds may fold an index that uses a possibly empty range to a
  constant, but the store must still run once per iteration (zero times when the range is empty). An output axis of
  one element becomes the constant 0 (so a sum kept as shape (1,) is a full reduction the optimiser can split)."""
  reduced = {r for n in ast.toposort() if n.op is Ops.REDUCE for r in n.src[1:]}
  ones = {r: UOp.const(dtypes.index, 0) for s in ast.src if s.op is Ops.STORE for r in free_ranges(s)
          if r.src[0].op is Ops.CONST and r.src[0].arg == 1 and r not in reduced}
  if ones: ast = substitute(ast, ones)
  orig = [s for s in ast.src if s.op is Ops.STORE]
  simp = [_simplify(s) for s in orig]
  loops = {s: {_simplify(r) for r in free_ranges(o)} for s, o in zip(simp, orig)}
  return UOp.sink(*simp, *(s for s in ast.src if s.op is not Ops.STORE), name=ast.arg), loops


def _peel(ast: UOp, opts: list[Opt]) -> tuple[UOp, int] | None:
  """CPU: an output axis whose UPCAST does not divide it. When the kernel reads none of the buffers it stores, the axis
  becomes whole tiles, the last one shifted back to overlap the one before it. Otherwise it is split into a main range
  the vector width divides and a scalar tail range (a new axis), each store copied for the tail. Returns the new kernel
  and how many stores are main."""
  ranges = {r.arg[0]: r for r in ast.toposort() if r.op is Ops.RANGE}
  reduced = {r for n in ast.toposort() if n.op is Ops.REDUCE for r in n.src[1:]}
  split = [(ranges[o.axis], o.amount) for o in opts if o.op is OptOps.UPCAST and o.axis in ranges and ranges[o.axis] not in reduced
           and (n := axis_size(ranges[o.axis])) is not None and n > o.amount and n % o.amount]
  if not split: return None
  r, w = split[0]
  size = axis_size(r)
  assert size is not None
  stores = [s for s in ast.src if s.op is Ops.STORE]
  written = {s.src[0].src[0].arg for s in stores}
  if not any(u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0].arg in written for u in ast.toposort()):
    # no stored buffer is read, so the last, partial tile can be a whole vector tile shifted back to end at the axis's
    # end: it recomputes, bit for bit the same, a few elements the tile before it stored (1000x1000 matmul: 230 -> 300
    # GFLOP/s against a scalar tail). Where a split puts those two tiles on two threads, both write the same bytes.
    tiles = -(-size // w)
    big = UOp.range(tiles * w, r.arg[0], r.arg[1])
    col = (big - big % w).minimum(size - w) + big % w
    return UOp.sink(*[substitute(s, {r: col}) for s in stores], *(s for s in ast.src if s.op is not Ops.STORE), name=ast.arg), len(stores)
  main_n = size - size % w
  main = UOp.range(main_n, r.arg[0], r.arg[1])
  tail = UOp.range(size - main_n, max(ranges) + 1, r.arg[1])
  mains = [substitute(s, {r: main}) for s in stores]
  tails = [substitute(s, {r: tail + main_n}) for s in stores if r in free_ranges(s)]
  return UOp.sink(*mains, *tails, *(s for s in ast.src if s.op is not Ops.STORE), name=ast.arg), len(mains)
