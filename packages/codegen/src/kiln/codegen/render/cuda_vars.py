"""Runtime variables a CUDA kernel reads from device memory instead of taking as launch arguments.

Why: a plan's run of launches is one CUDA graph, and a graph holds each kernel's arguments by value. A variable that changes
every run (a language model's past length, decode step after decode step) made every kernel that takes it a node to update
from the host before each launch (cuGraphExecKernelNodeSetParams), hundreds a token. A kernel whose variables live in a
small device array (`const int* kiln_vars`, one int32 per variable in var_names order, written by the runtime before a
launch) keeps the same arguments and grid for every value: the graph is launched as built.

The grid cannot follow the value then: it is fixed at the variables' upper bounds, and blocks past the grid the values
give return at once (the kernel checks its own symbolic grid). That is done only where it costs little and is safe:
- the grid depends on no variable, or it never shrinks as they grow (grid_c: so the upper bounds give the largest grid)
  and at the upper bounds it is at most IDLE_BLOCKS blocks (one wave of blocks that exit at once on any GPU kiln targets, a few microseconds);
- no grid-wide reduction (a BLOCKS combine counts the blocks that finished: a block that returned early would never count);
- a block size that depends on no variable.
Elsewhere (a dynamic batch of 1 to 64 over a large tensor, say) the variables stay launch arguments."""
from __future__ import annotations

from kiln.codegen.lowering.lower import LoweredKernel
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

VARS = "kiln_vars"  # the kernel's parameter after its buffers
IDLE_BLOCKS = 4096  # the most blocks a grid fixed at the upper bounds may have
_C_OP = {Ops.ADD: "+", Ops.MUL: "*", Ops.IDIV: "/"}


def grid_c(u: int | UOp, names: dict[UOp, str]) -> str | None:
  """A grid size as a C expression over the variables' names, when it never shrinks as they grow (so their upper bounds
  give its largest value): variables and constants combined by +, * by a constant of at least 0, C's / by a constant above
  0 (truncation is monotone too) and max; None otherwise (a difference, a division by a variable, a product of two
  variables). names: each DEFINE_VAR's C name."""
  if isinstance(u, int): return str(u)
  if u.op is Ops.CONST: return str(int(u.arg))
  if u.op is Ops.DEFINE_VAR: return names.get(u)
  if len(u.src) != 2 or u.op not in (Ops.ADD, Ops.MUL, Ops.IDIV, Ops.MAX): return None
  a, b = u.src
  if u.op is Ops.MUL and not any(x.op is Ops.CONST and int(x.arg) >= 0 for x in (a, b)): return None
  if u.op is Ops.IDIV and not (b.op is Ops.CONST and int(b.arg) > 0): return None
  ta, tb = grid_c(a, names), grid_c(b, names)
  if ta is None or tb is None: return None
  return f"max({ta}, {tb})" if u.op is Ops.MAX else f"({ta} {_C_OP[u.op]} {tb})"


def in_memory(lk: LoweredKernel, names: dict[UOp, str]) -> list[str] | None:
  """The guard lines a kernel reading its variables from memory starts with (after reading them), or None where its
  variables stay launch arguments (see the module docstring)."""
  if not lk.vars or lk.threads > 1: return None
  if any(isinstance(x, UOp) for x in lk.local_size or ()): return None
  if any(u.op is Ops.DEFINE_LOCAL and str(u.arg).startswith("grid") for u in lk.uops): return None
  grid = lk.global_size or (1, 1, 1)
  guards: list[str] = []
  blocks = 1
  for axis, g in zip("xyz", grid):
    if not isinstance(g, UOp) or g.op is Ops.CONST:
      blocks *= int(g if isinstance(g, int) else g.arg)
      continue
    if (text := grid_c(g, names)) is None: return None
    blocks *= int(g.vmax)  # at the variables' upper bounds (grid_c: it never shrinks as they grow)
    guards.append(f"blockIdx.{axis} >= (unsigned)({text})")
  if blocks > IDLE_BLOCKS and guards: return None
  return [f"if ({' || '.join(guards)}) return;  /* the grid is fixed at the variables' upper bounds */"] if guards else []
