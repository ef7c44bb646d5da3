"""The one entry to a kernel's options: `choose_opts` (the lowering asks it: the caller's list, else the heuristic's) and
`reassociated_for` (kiln.graph asks it with a device: the options for sums taken in another order, where they differ).
The tuner's candidates are kiln.codegen.choose.search's; the CUDA matrix product's tile is kiln.codegen.choose.tiling's."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kiln.codegen.choose.base import Opt, OptOps, Target
from kiln.codegen.choose.heuristic import heuristic_opts, reassociated_opts
from kiln.codegen.choose.tiling import choose_tile
from kiln.codegen.registry import target_of
from kiln.ir.errors import IRError
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp

if TYPE_CHECKING:
  from kiln.codegen.choose.contraction import Contraction


def choose_opts(ast: UOp, target: Target, explicit: Sequence[Opt] | None = None, reassociate: bool = False,
                product: Contraction | None = None) -> list[Opt]:
  """The options a prepared kernel is lowered with: `explicit` as given (a caller's opts=, a tuned choice, kiln.graph's
  reassociated list), else the heuristic's for the target (reassociate: the caller takes float sums in another order);
  for a matrix product the renderer's tiled kernel covers (`product`, the pipeline's tiling pass), the tiling's tile."""
  if explicit is not None: return list(explicit)
  if product is not None: return [Opt(OptOps.TILE, 0, choose_tile(product, target))]
  return heuristic_opts(ast, target, reassociate)


def reassociated_for(ast: UOp, device: str) -> list[Opt] | None:
  """For a caller whose sums have no order of their own (kiln.graph): the options with reductions summed in another order
  (a global pool vectorised along its maps, not gathered across its channels) for an unprepared kernel on a device, None
  where that changes nothing (the kernel then keeps the default options and its cache key) or the device's renderer
  chooses no options (target_of is None)."""
  if not _one_plain_reduce(ast): return None  # most kernels: no prepare, no heuristic
  if (target := target_of(device)) is None or target.vector_bytes == 0: return None  # a GPU's lanes gather nothing
  # imported when called: the lowering imports this module, and prepare is a lowering pass
  from kiln.codegen.lowering.prepare import prepare
  try: prepared = prepare(ast)[0]
  except IRError: return None  # the plan's build reports it, as for any kernel
  return reassociated_opts(prepared, target)


def _one_plain_reduce(ast: UOp) -> bool:
  """A kernel the reassociating rule may change (a quick look before preparing it: the rule's own test wants the
  simplified indices): one store, one REDUCE (over one axis or several: a pool over rows and columns), every load of
  its body indexed by the output's innermost loop (a matmul's row operand is not; any load where that loop is symbolic)
  and none gated (a padded conv input)."""
  if len(ast.src) != 1 or ast.src[0].op is not Ops.STORE: return False
  loops = [u for u in ast.src[0].src[0].toposort() if u.op is Ops.RANGE and u.arg[1] is AxisType.LOOP]
  reds = [u for u in ast.toposort() if u.op is Ops.REDUCE]
  if not loops or len(reds) != 1: return False
  inner = max(loops, key=lambda r: r.arg[0])
  loads = [u for u in reds[0].src[0].toposort() if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX]
  symbolic = inner.src[0].op is not Ops.CONST  # no vectors along it: a load it does not index may be read along the reduce
  return bool(loads) and all(len(ld.src[0].src) == 2 and (symbolic or inner in ld.src[0].src[1].toposort()) for ld in loads)
