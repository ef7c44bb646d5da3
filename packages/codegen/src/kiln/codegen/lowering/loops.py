"""What every lowering phase shares: the linearizer, the checked axis plans, the ids of loops and accumulators, the CPU
core id of a THREAD split, and opening an axis's loop."""
from __future__ import annotations

import itertools

from kiln.codegen.choose.axis_plan import AxisPlan
from kiln.codegen.choose.base import Target
from kiln.codegen.lowering.expand import simp
from kiln.codegen.lowering.linearize import Linearizer, Scope
from kiln.codegen.threads import CORE_ID
from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import AxisType, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp


def ceil_div(x: UOp, k: int) -> UOp:
  """ceil(x / k) for x >= 0: a constant computed exactly (x + k - 1 would fold to a wrapped constant near 2**31, where
  index_width cannot see it), else (x + (k - 1)) // k, whose sum index_width checks like any other."""
  return UOp.const(x.dtype, -(-int(x.arg) // k)) if x.op is Ops.CONST else (x + (k - 1)) // k


class LowerCtx:
  def __init__(self, target: Target, plans: dict[UOp, AxisPlan], vec: tuple[UOp, int] | None, idx: DType = dtypes.index):
    self.target, self.plans, self.vec = target, plans, vec  # fixed once the options are checked; vec: (lane variable, width)
    self.idx = idx  # the dtype of the loops and index arithmetic lowering adds (index_width: int64 in a wide kernel)
    self.gpu = target.vector_bytes == 0
    self.lin = Linearizer()
    self.acc_ids = itertools.count()  # accumulators, their reads and shared arrays
    self.loop_ids = itertools.count()
    self.core_id: UOp | None = None  # CPU: the SPECIAL that picks a THREAD split's chunk

  @property
  def threads(self) -> int: return max((p.threads for p in self.plans.values()), default=1)

  def acc_id(self) -> int: return next(self.acc_ids)

  def core(self, threads: int, finish: bool) -> UOp:
    # a threaded reduction adds a finishing call with core_id == threads, so the id's bound says so
    self.core_id = UOp(Ops.SPECIAL, dtypes.index, (UOp.const(dtypes.index, threads + finish),), CORE_ID)
    return self.core_id

  def count_loop(self, end: int | UOp) -> UOp:
    """A loop of its own from 0 to end (a group's strides, a fold of partials, a panel copy)."""
    e = end if isinstance(end, UOp) else UOp.const(self.idx, end)
    return UOp(Ops.RANGE, e.dtype, (UOp.const(e.dtype, 0), e), (next(self.loop_ids), AxisType.REDUCE))

  def open_axis(self, scope: Scope, r: UOp, subst: dict[UOp, UOp]) -> tuple[Scope, UOp]:
    """Open the loop for range r inside scope; returns the new scope and the expression that replaces r."""
    p = self.plans[r]
    end = substitute(r.src[0], subst)
    units = end // p.factor if p.factor > 1 else end
    if p.threads > 1:
      if self.core_id is None: self.core(p.threads, finish=False)
      assert self.core_id is not None
      chunk = ceil_div(units, p.threads)
      # its loops run for chunks 0..threads-1 only (a threaded reduction's finishing call, chunk == threads, skips them):
      # bounds that say so keep the chunk bounds in int32 up to 2**31 - threads (index_width), the same code either way
      cid = self.core_id if self.core_id.src[0].arg == p.threads else UOp(Ops.SPECIAL, dtypes.index, (UOp.const(dtypes.index, p.threads),), CORE_ID)
      start = cid * chunk
      stop = (start + chunk < units).where(start + chunk, units)
    else: start, stop = UOp.const(units.dtype, 0), units
    lv = UOp(Ops.RANGE, r.dtype, (simp(start), simp(stop)), (next(self.loop_ids), r.arg[1]))
    inner = self.lin.open(scope, lv)
    expr = lv * p.factor + p.ev if p.ev is not None else lv
    return inner, expr
