"""UNROLLs the heuristic takes for the memory layout a kernel reads, not for its arithmetic: an elementwise kernel that
reads a channels-last buffer along NCHW rows unrolls the channels by the lanes (transposed_reads), and a register-tiled
product that reads a conv's window view in place takes a channel's taps a step (window_steps)."""
from __future__ import annotations

from kiln.codegen.choose.axis_plan import _loads
from kiln.codegen.choose.base import Opt, OptOps, affine_coeff, axis_size, divmod_free_steps
from kiln.ir.analysis import free_ranges
from kiln.ir.ops import Ops
from kiln.ir.rewrite import substitute
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp

# an elementwise kernel that reads its vector's lanes a whole number of vectors apart unrolls the axis that load reads
# contiguously by the lanes, so the copies transpose blocks in registers (transposed_reads); False: each lane a gather
TRANSPOSED_READS = True


def transposed_reads(st: UOp, out_axes: list[UOp], vec_axis: UOp, w: int, lanes: int) -> list[Opt]:
  """UNROLL by one vector's lanes the output axis that a load reads contiguously where it reads the vector's lanes a
  whole number of vectors apart (a channels-last buffer read back along NCHW rows: a residual add, a copy to NCHW).
  Each copy's gather is then lane p of w aligned blocks, the same blocks for every copy, which lowering loads once and
  transposes in registers (expand._block_rows). The vector must be exactly one register (w == lanes): a square block."""
  if not TRANSPOSED_READS or w != lanes or lanes < 4: return []
  for ld in _loads(st):
    # gated along the vector: a masked gather, no blocks (a gate of the other axes alone, a concatenation's piece, is
    # constant in each copy where the pieces are whole blocks)
    if len(ld.src[0].src) > 2 and vec_axis in free_ranges(ld.src[0].src[2]): continue
    idx = ld.src[0].src[1]
    if (s := affine_coeff(idx, vec_axis)) is None or s <= 0 or s % lanes: continue
    for a in out_axes:
      if a is not vec_axis and (n := axis_size(a)) is not None and n % lanes == 0 and _runs_along(idx, a, n, lanes):
        return [Opt(OptOps.UNROLL, a.arg[0], lanes)]
  return []


def _runs_along(idx: UOp, a: UOp, n: int, lanes: int) -> bool:
  """Whether idx reads each run of `lanes` consecutive values of axis a contiguously, lane j of a run one element past
  lane 0's (a = lanes*q + j): a blocked buffer's channels, c % B for a B a multiple of the lanes, count too."""
  if affine_coeff(idx, a) == 1: return True
  q = UOp.variable("runs_q", 0, n // lanes - 1, a.dtype)
  at = [simplify(substitute(idx, {a: q * lanes + j})) for j in range(lanes)]
  return all((d := simplify(i - at[0])).op is Ops.CONST and d.arg == j for j, i in enumerate(at))


WINDOW_STEPS = 64  # the most steps of K a product's loop body takes whole to drop its window's // and % (window_steps)


def window_steps(st: UOp, rows: UOp, vec_axis: UOp, k: UOp) -> int:
  """Steps of K to unroll in a register-tiled product whose row operand (the one broadcast per row: a conv's window
  view read in place, an image stem's) indexes K = (channel, *kernel) with // and %: the fewest after which none is left
  (a 3x3 window's 9, a 7x7's 49), so each step's tap offsets are constants. Each of a tile's rows took its own division
  and remainder per step. 0 where no load needs it."""
  size = axis_size(k)
  if size is None: return 0
  lds = [ld for ld in _loads(st) if rows in free_ranges(ld) and vec_axis not in free_ranges(ld) and k in free_ranges(ld)]
  m = max((divmod_free_steps(ld.src[0], k, size, WINDOW_STEPS) for ld in lds), default=1)
  return m if m > 1 else 0
