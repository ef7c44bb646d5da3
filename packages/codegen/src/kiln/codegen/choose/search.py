"""The option sets a tuner times for one kernel: the heuristic's options and variations of them, derived from the kernel's
shape (pure and deterministic: no runtime, no clock). A `Space` is the heuristic's list plus knobs, each an option on one
axis with a few amounts to try; `ordered()` lists the knob settings nearest the heuristic first, so a search cut short by
its time budget has tried the likeliest variations. Lists the lowering rejects (CodegenError) are the caller's to skip."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.codegen.choose.base import Opt, OptOps, Target
from kiln.codegen.choose.choice import choose_opts
from kiln.codegen.choose.heuristic import matmul_rows
from kiln.codegen.choose.tiling import choose_tile, fitting_tiles
from kiln.codegen.lowering.index_width import needs_wide
from kiln.codegen.lowering.prepare import prepare
from kiln.ir.analysis import free_ranges
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp

if TYPE_CHECKING:
  from kiln.codegen.choose.contraction import Contraction

_COUNTED = (OptOps.UPCAST, OptOps.UNROLL, OptOps.THREAD, OptOps.LOCAL, OptOps.GROUP)  # amount <= 1: no option; flags: 0


@dataclass(frozen=True)
class Knob:
  """One option on one axis and the amounts to try; choices[0] is the heuristic's (<= 1 for a counted option, 0 for a
  flag: the option is absent)."""
  op: OptOps
  axis: int
  choices: tuple[int, ...]

  def present(self, v: int) -> bool: return v > 1 if self.op in _COUNTED else v > 0


@dataclass(frozen=True)
class Space:
  base: tuple[Opt, ...]  # the heuristic's options
  knobs: tuple[Knob, ...]

  @property
  def origin(self) -> tuple[int, ...]: return tuple(0 for _ in self.knobs)  # choice indices of the heuristic's list

  def opts(self, idx: Sequence[int]) -> list[Opt]:
    """The option list for choice indices `idx` (one per knob): the heuristic's list with each knob's option replaced
    (in place, so all-zero indices give the heuristic's list exactly), new ones appended in knob order."""
    val = {(k.op, k.axis): k.choices[i] for k, i in zip(self.knobs, idx)}
    out: list[Opt] = []
    for o in self.base:
      if (o.op, o.axis) not in val: out.append(o)
      elif (v := val.pop((o.op, o.axis))) and Knob(o.op, o.axis, ()).present(v): out.append(Opt(o.op, o.axis, v))
    out += [Opt(k.op, k.axis, v) for k in self.knobs if (k.op, k.axis) in val and k.present(v := val[(k.op, k.axis)])]
    return out

  def ordered(self) -> list[tuple[int, ...]]:
    """Every setting's choice indices, the heuristic's first, then by how many knobs differ from it, then lexically;
    settings giving an option list seen before are dropped."""
    combos = sorted(itertools.product(*(range(len(k.choices)) for k in self.knobs)), key=lambda c: (sum(i != 0 for i in c), c))
    seen: set[tuple[Opt, ...]] = set()
    out = []
    for c in combos:
      if (key := tuple(self.opts(c))) not in seen: seen.add(key); out.append(c)
    return out


def _choices(first: int, *rest: int) -> tuple[int, ...]: return tuple(dict.fromkeys((first, *rest)))


def space(ast: UOp, target: Target, product: Contraction | None = None) -> Space:
  """The search space for a kernel on a target. Matmul-like kernels (the heuristic tiles them: it makes the vector axis
  outermost): register tile rows 1/2/4/8, one or two vectors, reduce unroll 1/2/4, with and without PACK, with and without
  the thread split. Other vectorised kernels: vector widths (and a reduce unroll when one axis is reduced per output);
  full reductions: widths up to eight vectors; KEEP or not where the heuristic keeps a row; all: the thread split (its
  chunk count, half and twice it) or not.
  GPUs: block sizes; a matrix product the renderer prints as a tiled kernel (`product`, its renderer's tiled_product): the
  tiles that fit it (OptOps.TILE). Kernels of several stores keep the heuristic's (empty) list."""
  if product is not None and needs_wide(ast) is None:  # the pipeline tiles only 32-bit index arithmetic
    tile = choose_tile(product, target)
    return Space((Opt(OptOps.TILE, 0, tile),), (Knob(OptOps.TILE, 0, _choices(tile, *fitting_tiles(product, target))),))
  prepared, _ = prepare(ast)
  base = tuple(choose_opts(prepared, target))
  stores = [s for s in prepared.src if s.op is Ops.STORE]
  if len(stores) != 1: return Space(base, ())
  st = stores[0]
  out_axes = sorted(free_ranges(st), key=lambda r: r.arg[0])
  red_axes = sorted({r for u in st.toposort() if u.op is Ops.REDUCE for r in u.src[1:]}, key=lambda r: r.arg[0])
  have = {(o.op, o.axis): o.amount for o in base}
  knobs: list[Knob] = []
  if target.vector_bytes == 0:
    for o in base:
      if o.op in (OptOps.LOCAL, OptOps.GROUP):
        knobs.append(Knob(o.op, o.axis, _choices(o.amount, *(n for n in (32, 64, 128, 256, 512) if n <= target.max_local))))
    return Space(base, tuple(knobs))
  dt = st.src[1].dtype
  lanes = max(1, target.vector_bytes // dt.itemsize) if dt.kind != "p" else 1
  vec = next((o for o in base if o.op is OptOps.UPCAST), None)
  mm = any(o.op is OptOps.OUTER for o in base)  # the heuristic's register-tiled product
  full_red = vec is not None and any(r.arg[0] == vec.axis for r in red_axes)
  if vec is not None:
    widths = (lanes, 2 * lanes, 4 * lanes, 8 * lanes) if full_red else (lanes, 2 * lanes) if mm else (lanes // 2, lanes, 2 * lanes, 4 * lanes)
    knobs.append(Knob(OptOps.UPCAST, vec.axis, _choices(vec.amount, *(w for w in widths if w > 1))))
  if mm and len(red_axes) == 1 and (rows_axis := matmul_rows(st)) is not None:
    rows, k = rows_axis.arg[0], red_axes[0].arg[0]
    knobs.append(Knob(OptOps.UNROLL, rows, _choices(have.get((OptOps.UNROLL, rows), 1), 1, 2, 4, 8)))
    knobs.append(Knob(OptOps.UNROLL, k, _choices(have.get((OptOps.UNROLL, k), 1), 1, 2, 4)))
    knobs.append(Knob(OptOps.PACK, k, _choices(have.get((OptOps.PACK, k), 0), 1, 0)))
  elif vec is not None and not full_red and len(red_axes) == 1 and red_axes[0].arg[1] is AxisType.REDUCE:
    k = red_axes[0].arg[0]
    knobs.append(Knob(OptOps.UNROLL, k, _choices(have.get((OptOps.UNROLL, k), 1), 1, 2, 4)))
  knobs += [Knob(OptOps.KEEP, o.axis, (1, 0)) for o in base if o.op is OptOps.KEEP]  # store and reload, or compute again
  if target.threads > 1:
    th = next((o for o in base if o.op is OptOps.THREAD), None)
    axis = th.axis if th is not None else vec.axis if mm and vec is not None else out_axes[0].arg[0] if out_axes else \
      red_axes[0].arg[0] if len(red_axes) == 1 else None
    # chunks for the threads to claim: the heuristic's count, half and twice as many (coarser or finer sharing), or none
    n = th.amount if th is not None else 2 * target.threads
    if axis is not None: knobs.append(Knob(OptOps.THREAD, axis, _choices(th.amount if th is not None else 0, n, max(n // 2, 2), 2 * n, 0)))
  return Space(base, tuple(knobs))


def candidates(ast: UOp, target: Target, product: Contraction | None = None) -> list[list[Opt]]:
  """Every option list of the kernel's space, the heuristic's first, nearest variations next."""
  sp = space(ast, target, product)
  return [sp.opts(c) for c in sp.ordered()]
