"""The compile pipeline: one kernel AST to a ProgramSpec. Every renderer's `render` is `compile_ast(ast, self, opts)`; the
renderers only print. The passes, in order, named as KILN_DUMP_AST takes them (kiln.codegen.dump; lower's scopes show as
linearize flattens them):

  verify     kiln.ir.verify            the AST is a SINK of STOREs whose every index is proven inside its buffer
  widen      lowering/index_width.py   32-bit index arithmetic unless the AST's bounds need 64 (then every range and index widened)
  tiling     choose/contraction.py,    CUDA: a matrix product the tiled kernel covers, options not given or a TILE option
             choose/tiling.py,         (the heuristic's: choose_opts gives the product its tile), is printed by
             choose/choice.py          render/cuda_matmul.py with that tile; the passes below are skipped
  prepare    lowering/prepare.py       each store simplified, keeping the loops it had; empty ranges' reads dropped
  opts       choose/choice.py          the options: the caller's, else the heuristic's for the target
  peel       lowering/prepare.py       CPU: an output axis the vector width or unroll does not divide split (main + tail)
  plan       choose/axis_plan.py       each option checked against its axis and the target: an AxisPlan per axis
  lower      lowering/lower.py         the stores a loop-nest group at a time: grid (gpu_grid.py), loops (loops.py), packed
                                       panels (pack.py), kept rows, accumulators (reduce_lowering.py), unrolled and
                                       vector copies (expand.py), placed in the linearizer's scopes
  linearize  lowering/linearize.py     the scopes flattened into a linear program; lower.Lowerer.kernel describes it
  print      render/{llvm,cuda}.py     the printer: source and the ProgramSpec

A program whose lowered index arithmetic could pass int32 (a THREAD split's chunk bounds near 2**31, tiles a peel adds)
is lowered again from `widen` in 64 bits; arithmetic the AST itself asks to wrap in 32 bits is a CodegenError.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kiln.codegen.choose.axis_plan import plan_axes
from kiln.codegen.choose.base import Opt, OptOps, Target
from kiln.codegen.choose.choice import choose_opts
from kiln.codegen.choose.heuristic import split_rule
from kiln.codegen.choose.tiling import tile_for
from kiln.codegen.dump import PASSES, show
from kiln.codegen.lowering import index_width
from kiln.codegen.lowering.loops import LowerCtx
from kiln.codegen.lowering.lower import LoweredKernel, Lowerer, kernel_ranges
from kiln.codegen.lowering.prepare import emptied_globals, peel, prepare
from kiln.ir.dtype import dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp
from kiln.ir.verify import verify

if TYPE_CHECKING:
  from kiln.codegen.choose.contraction import Contraction
  from kiln.codegen.choose.tiling import Tiling
  from kiln.codegen.spec import ProgramSpec

__all__ = ["PASSES", "Printing", "compile_ast", "lower"]


class Printing(Protocol):
  """What the pipeline asks of a renderer: the machine it lowers for, and its printers."""
  target: Target

  def print_kernel(self, lk: LoweredKernel, ast: UOp) -> ProgramSpec: ...
  def tiled_product(self, ast: UOp) -> Contraction | None: ...  # a matrix product it prints as a tiled kernel (CUDA), else None
  def print_tiled(self, ast: UOp, product: Contraction, tiling: Tiling) -> ProgramSpec: ...


def compile_ast(ast: UOp, renderer: Printing, opts: Sequence[Opt] | None = None) -> ProgramSpec:
  """ast's program for the renderer's target: opts as given, else the heuristic's choice, which gives a CUDA matrix product
  the tiled kernel where that covers it. A list holding a TILE asks for the tiled kernel; any other list takes the
  generic lowering it describes."""
  target = renderer.target
  verified(ast)                                                                                   # verify
  wide = index_width.needs_wide(ast) is not None                                                  # widen (the AST's own bounds)
  if (tiled := tiling(ast, renderer, opts, wide)) is not None:                                    # tiling, print
    return show("print", renderer.print_tiled(ast, tiled[0], show("tiling", tiled[1])))
  return show("print", renderer.print_kernel(lower_checked(ast, target, opts, wide), ast))       # prepare ... linearize, print


def tiling(ast: UOp, renderer: Printing, opts: Sequence[Opt] | None, wide: bool) -> tuple[Contraction, Tiling] | None:
  """The tiling pass: the matrix product and its tile when the options (the caller's, else the heuristic's) are a TILE;
  None for the generic lowering. A TILE the kernel cannot take is a CodegenError naming why."""
  asked = [o for o in opts if o.op is OptOps.TILE] if opts is not None else []
  if opts is not None and not asked: return None  # an explicit generic list: no product to match
  product = None if wide else renderer.tiled_product(ast)
  if product is None:
    if not asked: return None
    why = "its index arithmetic is 64-bit" if wide else f"the {renderer.target.device} renderer's tiled kernel does not cover it"
    raise CodegenError(f"{asked[0]}: kernel {ast.arg} is not a tiled matrix product ({why})")
  chosen = choose_opts(ast, renderer.target, opts, product=product)
  if len(chosen) != 1 or chosen[0].axis != 0:
    raise CodegenError(f"TILE is the tiled kernel's only option, on axis 0; got {[str(o) for o in chosen]}")
  return product, tile_for(product, renderer.target, chosen[0].amount)


def lower(ast: UOp, target: Target, opts: Sequence[Opt] | None = None) -> LoweredKernel:
  """The generic lowering alone (tests, tools): verify, widen, prepare, opts, peel, plan, lower, linearize."""
  verified(ast)
  return lower_checked(ast, target, opts, index_width.needs_wide(ast) is not None)


def verified(ast: UOp) -> UOp:
  if ast.op is not Ops.SINK: raise CodegenError(f"a kernel is a SINK of STOREs, got {ast.op}")
  verify(ast)
  return show("verify", ast)


def lower_checked(ast: UOp, target: Target, opts: Sequence[Opt] | None, wide: bool) -> LoweredKernel:
  """Lowered at the AST's index width, again in 64 bits when lowering's own arithmetic could pass int32; a risk left in a
  wide program is 32-bit arithmetic the AST asks for, refused rather than left to wrap."""
  lk = lower_at(ast, target, opts, wide)
  if not wide and index_width.wrap_risk(lk.uops) is not None: lk = lower_at(ast, target, opts, True)
  if (bad := index_width.wrap_risk(lk.uops)) is not None:
    raise CodegenError(f"kernel {lk.name}: index arithmetic {index_width.describe(bad)} may pass {bad.dtype} and wrap; "
                       "build it in int64 (UOp.range, index and kernels.flat_index pick int64 from the bounds)")
  return lk


def lower_at(given: UOp, target: Target, opts: Sequence[Opt] | None, wide: bool) -> LoweredKernel:
  """One lowering at one index width (wide: 64-bit), the passes in order."""
  ast = show("widen", index_width.widen(given) if wide else given)
  prepared, loops = prepare(ast)
  show("prepare", prepared)
  chosen = show("opts", choose_opts(prepared, target, opts))
  chosen_for = prepared  # the AST the options were chosen for (before a tail is peeled)
  tails: set[UOp] = set()
  if target.vector_bytes and (peeled := peel(ast, chosen)) is not None:
    ast, n_main = peeled
    if not wide and index_width.needs_wide(ast) is not None: return lower_at(given, target, chosen, True)  # tiles past 2**31
    prepared, loops = prepare(ast)
    show("peel", prepared)
    tails = set([s for s in prepared.src if s.op is Ops.STORE][n_main:])
  ranges = kernel_ranges(prepared, loops)
  plans, vec = show("plan", plan_axes(ranges, chosen, target))
  lowerer = Lowerer(prepared, LowerCtx(target, plans, vec, dtypes.index64 if wide else dtypes.index), chosen, ranges, loops, tails)
  lowerer.lower()
  uops = show("linearize", lowerer.ctx.lin.program())
  lk = lowerer.kernel(uops, emptied_globals(ast))
  if lk.threads > 1 and (rule := split_rule(chosen_for, target, chosen)) is not None: lk.work, lk.split_min = rule  # split
  return lk
