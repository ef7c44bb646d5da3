"""How wide a kernel's index arithmetic is, decided from the bounds: 32 bits (dtypes.index) while every range, index and
loop bound fits int32, as nearly every kernel does, and 64 bits (dtypes.index64) for a kernel that needs more (a sum
over 2**31 elements). One place decides, so a small kernel's code never changes and a large one never wraps.

A kernel AST says it needs 64 bits when kiln.ir's builders made one of its ranges or indices int64 (UOp.range, index and
kernels.flat_index pick int64 from the bounds). Lowering adds arithmetic of its own (a THREAD split's chunk bounds, a
grid's block count), which may pass int32 near 2**31 even where the AST does not: the lowered program's index
arithmetic is checked (wrap_risk) after lowering. A risk in a narrow kernel lowers it again wide; a risk left in a wide
one is arithmetic the AST itself asked to wrap in 32 bits, and a CodegenError instead of a wrong answer."""
from __future__ import annotations

from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

# leaves whose value is data, not index arithmetic: an index computed from a load (a gather's) is the front end's to bound
_DATA = frozenset({Ops.LOAD, Ops.DEFINE_ACC, Ops.DEFINE_GLOBAL})
_WRAPS = frozenset({Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG, Ops.IDIV, Ops.SHL, Ops.CAST})  # the ops may_wrap can say yes to


def exact_ends(u: UOp) -> tuple[int, int] | None:
  """The exact least and greatest result of a scalar integer ADD, SUB, MUL or NEG over its operands' bounds, as Python
  integers (no wrap); None for any other node."""
  if u.dtype.count != 1 or not u.dtype.is_int or u.op not in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG): return None
  if u.op is Ops.NEG: return -int(u.src[0].vmax), -int(u.src[0].vmin)
  (alo, ahi), (blo, bhi) = ((int(s.vmin), int(s.vmax)) for s in u.src)
  if u.op is Ops.ADD: return alo + blo, ahi + bhi
  if u.op is Ops.SUB: return alo - bhi, ahi - blo
  c = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
  return min(c), max(c)


def _fits(dt: DType, lo: int, hi: int) -> bool: return int(dt.min) <= lo and hi <= int(dt.max)


def may_wrap(u: UOp) -> bool:
  """Whether u, a scalar signed integer node, can leave its dtype for some values its operands' bounds allow: ADD, SUB,
  MUL and NEG by their exact ends, IDIV at MIN // -1, SHL but a constant shift of a non-negative value that stays
  inside, and a CAST to it from an integer whose bounds pass it."""
  dt = u.dtype
  if dt.count != 1 or not dt.is_int or dt.is_unsigned: return False
  if (ends := exact_ends(u)) is not None: return not _fits(dt, *ends)
  if u.op is Ops.CAST:
    s = u.src[0]
    return s.dtype.is_int and s.dtype.count == 1 and not _fits(dt, int(s.vmin), int(s.vmax))
  if u.op is Ops.IDIV: return u.src[0].vmin == dt.min and u.src[1].vmin <= -1 <= u.src[1].vmax
  if u.op is Ops.SHL:
    a, s = u.src
    return not (s.op is Ops.CONST and 0 <= s.arg < dt.bits and a.vmin >= 0 and _fits(dt, 0, int(a.vmax) << s.arg))
  return False


def index_roots(uops: list[UOp]) -> list[UOp]:
  """The index arithmetic of a lowered program: every loop's bounds, every buffer offset and every grid size."""
  roots: list[UOp] = []
  for u in uops:
    if u.op is Ops.RANGE or u.op is Ops.SPECIAL: roots += u.src
    elif u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL: roots.append(u.src[1])
  return roots


def wrap_risk(uops: list[UOp]) -> UOp | None:
  """The first node of the program's index arithmetic (index_roots) that is computed from ranges, grid indices,
  variables and constants alone and may wrap (may_wrap); None when there is none."""
  pure: dict[UOp, bool] = {}
  for root in index_roots(uops):
    for n in root.toposort(lambda x: x not in pure and x.op not in _DATA):  # each node once, over all the roots
      pure[n] = not (n.op is Ops.SPECIAL and not n.src) and all(pure.get(s, False) for s in n.src)
      if pure[n] and n.op in _WRAPS and may_wrap(n): return n
  return None


def needs_wide(ast: UOp) -> UOp | None:
  """A node that makes the kernel's index arithmetic 64-bit: a range or buffer index of a 64-bit dtype (the builders
  give one that dtype where its bounds pass int32); None for a kernel that stays 32-bit."""
  for u in ast.toposort():
    if (u.op is Ops.RANGE and u.dtype.itemsize == 8) or (u.op is Ops.INDEX and u.src[1].dtype.itemsize == 8): return u
  return None


# integer ops whose int64 result is the narrower one's whenever that one does not wrap (may_wrap): widened as they are
_SAME_WIDE = frozenset({Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.AND, Ops.OR, Ops.XOR, Ops.WHERE})


def widen(ast: UOp) -> UOp:
  """The kernel with 64-bit index arithmetic and the same values: every range int64, and every integer an index or a
  range end is computed from rebuilt in int64 where that gives the same value (a signed op that cannot wrap in its own
  dtype, a cast that keeps every value), else computed in its own dtype and then widened (so a wrap the AST asks for
  stays one, as the reference evaluator computes it). Everything else keeps its dtype: a value stored, compared or cast
  to a float reads a range as its int64 one cast back."""
  wide: dict[UOp, UOp] = {}
  narrow: dict[UOp, UOp] = {}
  for u in ast.toposort():
    if u.op is Ops.RANGE:
      wide[u] = UOp(Ops.RANGE, dtypes.index64, (wide[u.src[0]],), u.arg)
      narrow[u] = wide[u] if u.dtype == dtypes.index64 else UOp(Ops.CAST, u.dtype, (wide[u],))
      continue
    src = tuple(narrow[s] for s in u.src)
    if u.op is Ops.INDEX: src = (src[0], wide[u.src[1]], *src[2:])
    elif u.op is Ops.REDUCE: src = (src[0], *(wide[r] for r in u.src[1:]))
    narrow[u] = u if all(a is b for a, b in zip(src, u.src)) else u.replace(src=src)
    if u.dtype.is_int and u.dtype.count == 1: wide[u] = _wide(u, wide, narrow)
  return narrow[ast]


def _wide(u: UOp, wide: dict[UOp, UOp], narrow: dict[UOp, UOp]) -> UOp:
  signed = u.dtype in (dtypes.int32, dtypes.int64)
  if u.op is Ops.CONST and signed: return UOp.const(dtypes.index64, u.arg)
  if signed and u.op in _SAME_WIDE and not may_wrap(u):
    return UOp(u.op, dtypes.index64, tuple(narrow[s] if s.dtype.is_bool else wide[s] for s in u.src))
  if signed and u.op is Ops.CAST and u.src[0] in wide and not may_wrap(u): return wide[u.src[0]]  # it kept every value
  return narrow[u].cast(dtypes.index64)


def describe(u: UOp) -> str:
  """A node of index arithmetic for an error: a range by its axis and trip count, an index by its slot and bounds, any
  other node by its op, dtype and operands' bounds."""
  if u.op is Ops.RANGE and len(u.src) == 1: return f"axis {u.arg[0]} of {u.src[0].vmax} elements ({u.dtype})"
  if u.op is Ops.INDEX: return f"an index into slot {u.src[0].arg} over [{u.src[1].vmin}, {u.src[1].vmax}] ({u.src[1].dtype})"
  return f"{u.op.name} ({u.dtype}) of operands over {', '.join(f'[{s.vmin}, {s.vmax}]' for s in u.src)}"
