"""vmin/vmax: exact for constants, variables and ranges; sound (a superset of every value) for every ALU op.

Integer results are computed on Python ints; a result that could leave its dtype's range may wrap, so it widens to
the whole dtype. Floats are bounded only where it is exact (constants, casts from ints).
A leaf under uop.py: it reads nodes and fills their _bounds slot, and never builds one.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kiln.ir.alu import cast as alu_cast
from kiln.ir.alu import compute_np
from kiln.ir.dtype import ConstLike, DType
from kiln.ir.ops import Ops

if TYPE_CHECKING:
  from kiln.ir.uop import UOp  # typing only: uop.py imports this module

Bounds = tuple[ConstLike, ConstLike]


def _full(dt: DType) -> Bounds:
  if dt.kind not in "vp" and dt.count == 1: return dt.min, dt.max
  if dt.count > 1: return dt.scalar().min, dt.scalar().max
  return 0, 0


def _tdiv(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def _idiv(a: Bounds, b: Bounds) -> list[int]:
  (alo, ahi), (blo, bhi) = a, b
  cands: list[int] = []
  for lo, hi in ((max(int(blo), 1), int(bhi)), (int(blo), min(int(bhi), -1))):
    if lo <= hi: cands += [_tdiv(x, y) for x in (alo, ahi) for y in (lo, hi)]  # type: ignore[arg-type]
  if blo <= 0 <= bhi: cands += [int(alo), int(ahi)]  # x // 0 == x
  return cands


def _mod(a: Bounds, b: Bounds) -> list[int]:
  (alo, ahi), (blo, bhi) = (int(a[0]), int(a[1])), (int(b[0]), int(b[1]))
  if blo > 0 and 0 <= alo and ahi < blo: return [alo, ahi]
  m = max(abs(blo), abs(bhi)) - 1
  lo = 0 if alo >= 0 else max(alo, -m)
  hi = 0 if ahi <= 0 else min(ahi, m)
  return [lo, hi, 0]


def _pow2_above(x: ConstLike) -> int: return (1 << max(int(x), 0).bit_length()) - 1


def _bitwise(op: Ops, a: Bounds, b: Bounds, dt: DType) -> list[ConstLike] | None:
  if dt.is_bool:
    if op is Ops.AND: return [a[0] and b[0], a[1] and b[1]]
    if op is Ops.OR: return [a[0] or b[0], a[1] or b[1]]
    return None
  if op is Ops.XOR and (c := _const_of(a, b)) is not None:
    x, k = c
    if k == -1: return [-int(x[1]) - 1, -int(x[0]) - 1]  # x ^ -1 == ~x == -x - 1, decreasing in x
    if x[0] >= 0:  # x only flips the low bits under m: the bits of k above them stay
      m = _pow2_above(x[1])
      return [k & ~m, k | m]
  if op is Ops.AND and (a[0] >= 0 or b[0] >= 0):  # AND with a non-negative value is at most that value
    return [0, min(v[1] for v in (a, b) if v[0] >= 0)]
  if a[0] < 0 or b[0] < 0: return None
  if op is Ops.AND: return [0, min(a[1], b[1])]
  if op is Ops.OR: return [max(a[0], b[0]), _pow2_above(max(a[1], b[1]))]
  return [0, _pow2_above(max(a[1], b[1]))]


def _const_of(a: Bounds, b: Bounds) -> tuple[Bounds, int] | None:
  """(the other operand's bounds, the constant) when one operand of a binary op is a single integer value."""
  if b[0] == b[1]: return a, int(b[0])
  if a[0] == a[1]: return b, int(a[0])
  return None


def _shift(op: Ops, a: Bounds, b: Bounds, dt: DType) -> list[ConstLike] | None:
  if b[0] == b[1] and 0 <= b[0] < dt.bits:
    s = int(b[0])
    if op is Ops.SHR: return [int(a[0]) >> s, int(a[1]) >> s]
    if a[0] >= 0: return [int(a[0]) << s, int(a[1]) << s]
    return None
  if op is Ops.SHR: return [min(int(a[0]), 0), max(int(a[1]), 0)]
  return None


def _cmp(op: Ops, a: Bounds, b: Bounds) -> Bounds:
  if op is Ops.CMPLT:
    if a[1] < b[0]: return True, True
    if a[0] >= b[1]: return False, False
  elif op in (Ops.CMPEQ, Ops.CMPNE):
    if a[1] < b[0] or b[1] < a[0]: return (op is Ops.CMPNE,) * 2
    if a[0] == a[1] == b[0] == b[1]: return (op is Ops.CMPEQ,) * 2
  return False, True


_INT_RULES: dict[Ops, Callable[[Bounds, Bounds], list]] = {
  Ops.ADD: lambda a, b: [a[0] + b[0], a[1] + b[1]],
  Ops.SUB: lambda a, b: [a[0] - b[1], a[1] - b[0]],
  Ops.MUL: lambda a, b: [x * y for x in a for y in b],
  Ops.MAX: lambda a, b: [max(a[0], b[0]), max(a[1], b[1])],
  Ops.IDIV: _idiv,
  Ops.MOD: _mod,
}


def _node_bounds(u: UOp) -> Bounds:
  op, dt = u.op, u.dtype
  if op is Ops.CONST: return u.arg, u.arg
  if op is Ops.DEFINE_VAR: return u.arg[1], u.arg[2]
  if op is Ops.BIND: return u.src[0]._vbounds()
  if op is Ops.RANGE and len(u.src) == 2: return int(u.src[0].vmin), max(int(u.src[1].vmax) - 1, int(u.src[0].vmin))  # lowered loop [start, end)
  if op is Ops.SPECIAL and not u.src: return _full(dt)  # a stand-in with no size (lowering's reduce placeholder): any value
  if op in (Ops.RANGE, Ops.SPECIAL): return 0, max(int(u.src[0].vmax) - 1, 0)
  if dt.kind in "vp": return 0, 0
  srcb = [s._vbounds() for s in u.src]  # already filled (sources come first)
  if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE): return _cmp(op, srcb[0], srcb[1])
  if op is Ops.WHERE:
    c = srcb[0]
    if c[0] == c[1]: return srcb[1] if c[0] else srcb[2]
    if any(isinstance(v, float) and math.isnan(v) for v in (*srcb[1], *srcb[2])): return _full(dt)  # min(1.0, nan) would drop the NaN
    if (mm := _min_max(u, srcb)) is not None: return mm
    a, b = _guarded(u, 1, srcb[1]), _guarded(u, 2, srcb[2])
    return min(a[0], b[0]), max(a[1], b[1])
  if op is Ops.CAST: return _cast_bounds(srcb[0], u.src[0].dtype, dt)
  if op in (Ops.ERF, Ops.TANH) and dt.count == 1 and all(math.isfinite(v) for v in srcb[0]): return -1.0, 1.0  # NaN only from NaN
  if dt.count != 1 or dt.is_float: return _full(dt)
  cands: list | None = None
  if op in _INT_RULES and not dt.is_bool: cands = _INT_RULES[op](srcb[0], srcb[1])
  elif op is Ops.NEG: cands = [-srcb[0][1], -srcb[0][0]]
  elif op in (Ops.AND, Ops.OR, Ops.XOR): cands = _bitwise(op, srcb[0], srcb[1], dt)
  elif op in (Ops.SHL, Ops.SHR): cands = _shift(op, srcb[0], srcb[1], dt)
  elif op is Ops.REDUCE and u.arg is Ops.MAX:  # over a possibly empty range it is the identity, the dtype's min
    cands = list(srcb[0]) + ([dt.min] if any(int(r.src[0].vmin) < 1 for r in u.src[1:]) else [])
  if cands is None: return _full(dt)
  lo, hi = min(cands), max(cands)
  if dt.is_bool: return bool(lo), bool(hi)
  if lo < dt.min or hi > dt.max: return _full(dt)  # may wrap
  return lo, hi


def _min_max(u: UOp, srcb: list[Bounds]) -> Bounds | None:
  """(x < y).where(x, y) is min(x, y) and (x < y).where(y, x) is max(x, y): tighter than the union of the arms, so a clamp
  `x.maximum(0).minimum(n - 1)` proves an index in bounds. Integers only (a float NaN makes the comparison false)."""
  c, x, y = u.src
  if c.op is not Ops.CMPLT or u.dtype.is_float or {c.src[0], c.src[1]} != {x, y} or x is y: return None
  (xl, xh), (yl, yh) = srcb[1], srcb[2]
  if c.src[0] is x: return min(xl, yl), min(xh, yh)  # the smaller one
  return max(xl, yl), max(xh, yh)


def _int_const(u: UOp) -> int | None: return u.arg if u.op is Ops.CONST and isinstance(u.arg, int) and not isinstance(u.arg, bool) else None


def _affine(e: UOp, x: UOp) -> tuple[int, int] | None:
  """(k, d) where e is k * x + d with integer constants k, d (x itself, times, plus or minus a constant), else None."""
  if e is x: return 1, 0
  if e.op not in (Ops.ADD, Ops.MUL, Ops.SUB) or len(e.src) != 2: return None
  for i, (v, c) in enumerate(((e.src[0], e.src[1]), (e.src[1], e.src[0]))):
    if (k := _int_const(c)) is None or (inner := _affine(v, x)) is None: continue
    if e.op is Ops.ADD: return inner[0], inner[1] + k
    if e.op is Ops.MUL: return inner[0] * k, inner[1] * k
    return (inner[0], inner[1] - k) if i == 0 else (-inner[0], k - inner[1])  # v - k, or k - v
  return None


def _fits(e: UOp, x: UOp, lo: int, hi: int) -> bool:
  """Whether every step of the affine e (as _affine reads it) stays in its dtype for x in [lo, hi]: then e's value is the
  affine one, with no wrap on the way."""
  if e is x: return True
  lin = _affine(e, x)
  assert lin is not None
  ends = (lin[0] * lo + lin[1], lin[0] * hi + lin[1])
  if min(ends) < e.dtype.min or max(ends) > e.dtype.max: return False
  return all(_fits(s, x, lo, hi) for s in e.src if s.op is not Ops.CONST)


def _guarded(u: UOp, arm: int, own: Bounds) -> Bounds:
  """The bounds of arm 1 (true) or 2 (false) of u = (x < c).where(..) or (c < x).where(..), c an integer constant, where
  the arm is affine in x: taken over the x the arm is chosen for, intersected with its own bounds. The simplifier writes
  min(2x + 1, 1499) as (x < 749).where(2x + 1, 1499), whose union of arms would prove an index past its buffer."""
  c = u.src[0]
  # int64 (a kernel past 2**31 elements) keeps the union: its lowering narrows a vector's base index that fits int32,
  # and a tighter base bound would let the lanes after it pass int32 there (test_index_width's 2**31 + 3 kernel)
  if c.op is not Ops.CMPLT or u.dtype.is_float or u.dtype.count != 1 or u.dtype.itemsize > 4: return own
  x, k = (c.src[0], _int_const(c.src[1])) if _int_const(c.src[1]) is not None else (c.src[1], _int_const(c.src[0]))
  if k is None or x.dtype.is_float or (lin := _affine(u.src[arm], x)) is None: return own
  lo, hi = int(x.vmin), int(x.vmax)
  if x is c.src[0]:  # x < k: the true arm's x are below k, the false arm's at or above
    if arm == 1: hi = min(hi, k - 1)
    else: lo = max(lo, k)
  elif arm == 1: lo = max(lo, k + 1)  # k < x: the true arm's x are above k, the false arm's at or below
  else: hi = min(hi, k)
  if lo > hi: return own  # never chosen: its bounds do not matter, keep them sound anyway
  ends = (lin[0] * lo + lin[1], lin[0] * hi + lin[1])
  if not _fits(u.src[arm], x, lo, hi): return own  # a step may wrap there: the arm's own bounds say so
  return max(own[0], min(ends)), min(own[1], max(ends))


def _cast_bounds(b: Bounds, src: DType, dst: DType) -> Bounds:
  if dst.count != 1: return _full(dst)
  if dst.is_bool:
    if b[0] == b[1]: return (b[0] != 0,) * 2
    return (False, True) if not (b[0] > 0 or b[1] < 0) else (True, True)
  if any(isinstance(v, float) and math.isnan(v) for v in b): return _full(dst)
  if src.is_float and dst.is_int and b[0] != b[1]: return _full(dst)  # a non-constant float may be NaN (-> 0)
  if not src.is_float and dst.is_int:
    lo, hi = int(b[0]), int(b[1])
    return (lo, hi) if dst.min <= lo and hi <= dst.max else _full(dst)
  # int->float, float->float and constant float->int casts are monotone: cast the ends with the evaluator's own rounding
  ends = alu_cast(np.asarray(b, dtype=np.float64 if src.is_float else object).astype(compute_np(src)), src, dst)
  return (float(ends[0]), float(ends[1])) if dst.is_float else (int(ends[0]), int(ends[1]))


def compute_bounds(root: UOp) -> None:
  """Fill _bounds for root and every node under it that lacks them, sources first (no recursion)."""
  for u in root.toposort(lambda x: x._bounds is None):  # stop at nodes that have bounds: O(new nodes), not O(graph)
    object.__setattr__(u, "_bounds", _node_bounds(u))
