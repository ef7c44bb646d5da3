"""A float32 MAX reduction's vector accumulators as three integer ones (CPU): IEEE-754 maximum (NaN propagates, +0 > -0) is
six instructions a vector on x86 (llvm.maximum: sign test, blends, an unordered compare, vmaxps), a chain of them per
step. On the bits it is three maxima of one cycle each, exact and order-free, put together once after the loop:

  P = signed max of the bits      the largest non-negative value (+0 above -0, a +NaN above +inf) when there is one
  M = unsigned max of ~bits       ~M: the unsigned min of the bits, among negatives the one nearest zero (-0 first)
  Q = unsigned max of the bits    a -NaN's bits are above -inf's (0xFF800000): the only NaN P cannot see

  result = Q if Q > 0xFF800000 (unsigned) else P if P >= 0 else ~M

All three start from -inf's bits (MAX's identity; M from their complement), so an empty reduction is -inf. Each is associative and commutative with
no rounding, so any order of steps and of the lanes' fold gives the same bits as the reference's left-to-right maximum
(NaN payloads aside: a NaN result is some NaN of the row, as llvm.maximum's is). Interleaved A/B on 2-core Zen 4, bit for
bit the same results: one-kernel softmax 8192x128 1.14x, 16384x64 1.12x, 1024x1024 1.11x, a row max 8192x512 1.13x with
AVX-512; softmax 1.02-1.04x with AVX2 (KILN_CPU=x86-64-v3). A threaded full reduction keeps llvm.maximum: its partials
are folded as floats."""
from __future__ import annotations

from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

NEG_INF_BITS = 0xFF800000
ALL_ONES = 0xFFFFFFFF
# (accumulator dtype, its start: -inf's bits, or their complement for M)
PARTS = ((dtypes.int32, NEG_INF_BITS - (1 << 32)), (dtypes.uint32, NEG_INF_BITS ^ ALL_ONES), (dtypes.uint32, NEG_INF_BITS))


def applies(op: Ops, dt: DType, gpu: bool, lanes: int) -> bool:
  """A CPU float32 MAX into a vector accumulator (a vectorised reduce axis, or one maximum per lane of the output's)."""
  return not gpu and op is Ops.MAX and dt == dtypes.float32 and lanes > 1


def starts(lanes: int) -> list[UOp]:
  """The three accumulators' initial vectors (P, M, Q)."""
  return [UOp.const(t.vec(lanes), v) for t, v in PARTS]


def steps(cur: list[UOp], v: UOp) -> list[UOp]:
  """The new (P, M, Q) after one vector v of float32 values."""
  w = v.dtype.count
  s, u = UOp(Ops.BITCAST, dtypes.int32.vec(w), (v,)), UOp(Ops.BITCAST, dtypes.uint32.vec(w), (v,))
  flipped = UOp(Ops.XOR, u.dtype, (u, UOp.const(u.dtype, ALL_ONES)))
  return [UOp(Ops.MAX, p.dtype, (p, x)) for p, x in zip(cur, (s, flipped, u))]


def result(p: UOp, m: UOp, q: UOp) -> UOp:
  """The float32 maximum, lane by lane, from the three accumulators (or their lanes folded, each by its own maximum)."""
  w = p.dtype.count
  b = dtypes.bool.vec(w) if w > 1 else dtypes.bool
  nan, negative = UOp(Ops.CMPLT, b, (UOp.const(q.dtype, NEG_INF_BITS), q)), UOp(Ops.CMPLT, b, (p, UOp.const(p.dtype, 0)))
  nearest = UOp(Ops.XOR, m.dtype, (m, UOp.const(m.dtype, ALL_ONES)))
  bits = UOp(Ops.WHERE, q.dtype, (nan, q, UOp(Ops.WHERE, q.dtype, (negative, nearest, UOp(Ops.BITCAST, q.dtype, (p,))))))
  return UOp(Ops.BITCAST, dtypes.float32.vec(w) if w > 1 else dtypes.float32, (bits,))
