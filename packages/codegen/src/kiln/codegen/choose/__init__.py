"""Choosing a kernel's optimisation options: one home for every rule that picks them.

  base        what an option is (OptOps, Opt) and what the optimiser may assume of a device (Target)
  axis_plan   each option's rule against its axis and the target, a table (plan_axes)
  heuristic   the deterministic choice from the prepared AST (heuristic_opts, reassociated_opts)
  choice      the entry: choose_opts (explicit, else the heuristic), reassociated_for (kiln.graph, by device)
  search      the tuner's candidates (kiln.executor.tune times them)
  contraction, tiling   a kernel that is one matrix product, and the CUDA tile for it (TILES: the tiles OptOps.TILE names)

A layer above asks with a device, whose machine model kiln.codegen.registry.target_of gives, never a renderer's attributes.
The lowering imports the modules it needs (base, axis_plan, choice), not this package."""
from kiln.codegen.choose.base import GPU_WARP, Opt, OptOps, Target, affine_coeff, axis_size
from kiln.codegen.choose.choice import choose_opts, reassociated_for
from kiln.codegen.choose.heuristic import heuristic_opts, reassociated_opts

__all__ = ["GPU_WARP", "Opt", "OptOps", "Target", "affine_coeff", "axis_size", "choose_opts", "heuristic_opts", "reassociated_for",
           "reassociated_opts"]
