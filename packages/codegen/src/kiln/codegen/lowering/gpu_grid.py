"""GPU grid mapping: up to three output axes become block and thread indices (SPECIALs), gated where the grid is larger
than an axis; store groups of different sizes share one grid sized for the largest."""
from __future__ import annotations

from collections.abc import Iterable

from kiln.codegen.choose.base import axis_bound, axis_size
from kiln.codegen.lowering.expand import simp
from kiln.codegen.lowering.linearize import Scope
from kiln.codegen.lowering.loops import LowerCtx, ceil_div
from kiln.ir.ops import Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp


class GpuGrid:
  def __init__(self, ctx: LowerCtx):
    self.ctx = ctx
    self.specials: dict[str, UOp] = {}  # name -> SPECIAL (gidx0, lidx0, ...)
    self.grid: list[int | UOp] = [1, 1, 1]
    self.block: list[int] = [1, 1, 1]
    self.blocks: dict[int, UOp] = {}  # grid dim -> blocks, when several store groups share the grid
    self.floor: Scope | None = None  # a gated store's reduces go inside its gate, so threads past the end load nothing

  def special(self, name: str, size: int | UOp) -> UOp:
    s = size if isinstance(size, UOp) else UOp.const(self.ctx.idx, size)
    return self.specials.setdefault(name, UOp(Ops.SPECIAL, self.ctx.idx, (simp(s.cast(self.ctx.idx)),), name))

  def group_lane(self, n: int) -> UOp:
    """GROUP: n threads of the block share a reduce axis; returns this thread's lane among them."""
    self.block[0] = n
    return self.special("lidx0", n)

  def grid_blocks(self, n: int) -> UOp:
    """BLOCKS: n blocks share each row's reduction along the grid's x (the rows, if any, are on y and z); returns this
    block's index among them."""
    self.grid[0] = n
    return self.special("gidx0", n)

  def axes(self, out: list[UOp], subst: dict[UOp, UOp]) -> list[tuple[int, UOp, UOp, UOp]]:
    """(dim, range, end, blocks) for the output axes that go to the grid: up to three, innermost first."""
    res: list[tuple[int, UOp, UOp, UOp]] = []
    first = 1 if any(p.blocks for p in self.ctx.plans.values()) else 0  # BLOCKS: the grid's x holds a row's slices
    for dim, r in enumerate(reversed(out[-(3 - first):]), start=first):
      size, p = axis_size(r), self.ctx.plans[r]
      if dim > 0 and axis_bound(r) > self.ctx.target.max_grid[dim]: break  # a symbolic size: its upper bound must fit
      if dim > 0 and size is None and first: break  # BLOCKS sizes its per-row slots by the grid's y and z: constant rows only
      if size is not None and -(-size // max(p.local, 1)) > self.ctx.target.max_grid[dim]: break  # more blocks than a grid has (past 2**31): a loop
      end = substitute(r.src[0], subst)
      res.append((dim, r, end, ceil_div(end, p.local) if p.local else end))
    return res

  def share(self, groups: Iterable[tuple[UOp, ...]]) -> None:
    """Size the grid the store groups (their output axes) share for the largest of them."""
    for axes in groups:
      for dim, _, _, nb in self.axes(list(axes), {}):
        cur = self.blocks.get(dim)
        self.blocks[dim] = nb if cur is None or cur is nb else simp(cur.maximum(nb))
    for dim, nb in self.blocks.items():  # a symbolic size bound to 0 must still launch the block the other groups run in
      if nb.op is not Ops.CONST and nb.vmin < 1: self.blocks[dim] = simp(nb.maximum(1))

  def map(self, out: list[UOp], subst: dict[UOp, UOp]) -> tuple[list[UOp], UOp | None]:
    """Map up to three output axes to the grid (the innermost with its LOCAL threads); returns the axes left as loops
    and the gate (index < size) the body needs when a size does not divide evenly or the grid is larger (several stores)."""
    gate: UOp | None = None
    mapped = self.axes(out, subst)
    for dim, r, end, nblocks in mapped:
      p, size = self.ctx.plans[r], axis_size(r)
      blocks = self.blocks.get(dim, nblocks)  # store groups of different sizes share one grid: it spans the largest
      if (empty := blocks.op is Ops.CONST and blocks.arg < 1): blocks = UOp.const(blocks.dtype, 1)  # an empty axis: one block, gated off
      gid = self.special(f"gidx{dim}", blocks)
      if p.local:
        # beside a GROUP (its lanes are threadIdx.x) the stacked rows are threadIdx.y (opt: one warp per row, one LOCAL axis)
        td = 1 if any(q.group for q in self.ctx.plans.values()) else dim
        expr = gid * p.local + self.special(f"lidx{td}", p.local)
        self.block[td] = p.local
        if size is None or size % p.local or blocks is not nblocks or empty: gate = (expr < end) if gate is None else gate & (expr < end)
      else:
        expr = gid
        if blocks is not nblocks or empty: gate = (expr < end) if gate is None else gate & (expr < end)
      self.grid[dim] = simp(blocks) if blocks.op is not Ops.CONST else int(blocks.arg)
      subst[r] = expr
    return out[:len(out) - len(mapped)], gate

  def open_gate(self, scope: Scope, gate: UOp) -> Scope:
    self.floor = self.ctx.lin.open_if(scope, gate)
    return self.floor

  def close_gate(self) -> None: self.floor = None
