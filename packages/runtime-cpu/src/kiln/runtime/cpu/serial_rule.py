"""When a split kernel runs on its calling thread alone: its work at the variables' values, under the work the heuristic
needs to split a kernel (CompiledSpec.work, split_min: kiln.codegen.choose.heuristic.split_rule).

Why: the split is chosen at compile time with every symbolic axis taken at a guess, so a dynamic export's kernels are
split for any batch, and at a batch of one a worker is woken, hands a cache line back and forth and waits for chunks
worth less than the hand-off. Running alone changes no result: the chunks are the same and one thread claims them all.

The work expression comes from a compiled spec, which may come from a disk cache or a plan file: it is walked, never
executed as code, and an operator outside the small set sizes are made of leaves the kernel split (no rule)."""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

# the integer operators a size expression is made of; values are sizes (never negative), so Python's floor division
# and modulo are C's truncating ones here
_BINARY: dict[Ops, Callable[[int, int], int]] = {Ops.ADD: operator.add, Ops.MUL: operator.mul, Ops.IDIV: operator.floordiv,
                                                 Ops.MOD: operator.mod, Ops.MAX: max}
MAX_NODES = 256  # a size expression larger than this is not worth evaluating per run: the kernel keeps its split


class SerialRule:
  """serial(vals) is True where the kernel's work at these values (its var_names order, core_id excluded) is under
  split_min. Work of one variable (a decode step's positions: a new value every token) is one comparison with the least
  value whose work reaches split_min, found once by bisection over the variable's bounds (sizes grow with their
  variables); work of several is evaluated and memoised by the values (a dynamic export replays a few sizes)."""
  __slots__ = ("_eval", "split_min", "_memo", "at", "below")

  def __init__(self, work: UOp, split_min: int, var_names: Sequence[str]):
    fn = _evaluator(work, list(var_names))
    if fn is None: raise ValueError("work is not a size expression")
    self._eval, self.split_min = fn, split_min
    self._memo: dict[tuple[int, ...], bool] = {}
    self.at, self.below = -1, 0  # the one variable's position and its least value that splits (at -1: several variables)
    if len(used := {x.arg for x in work.toposort() if x.op is Ops.DEFINE_VAR}) == 1:
      name, lo, hi = next(iter(used))
      self.at = list(var_names).index(name)
      self.below = self._least(lo, hi)

  def _least(self, lo: int, hi: int) -> int:
    """The least v in [lo, hi] whose work reaches split_min (hi + 1 where none does)."""
    def splits(v: int) -> bool:
      try: return self._eval(self.at_vals(v)) >= self.split_min
      except ZeroDivisionError: return True
    if not splits(hi): return hi + 1
    while lo < hi:
      mid = (lo + hi) // 2
      if splits(mid): hi = mid
      else: lo = mid + 1
    return lo

  def at_vals(self, v: int) -> tuple[int, ...]:
    """Values with v at the rule's variable (the others never matter to a one-variable rule)."""
    return tuple(v if i == self.at else 0 for i in range(self.at + 1))

  @staticmethod
  def of(work: int | UOp | None, split_min: int, var_names: Sequence[str]) -> SerialRule | None:
    """The rule of a compiled kernel, or None where it has none (fixed work, no threshold, an expression of another shape)."""
    if not split_min or not isinstance(work, UOp): return None
    try: return SerialRule(work, split_min, var_names)
    except ValueError: return None

  def serial(self, vals: Sequence[int]) -> bool:
    if self.at >= 0: return vals[self.at] < self.below
    key = tuple(vals)
    if (hit := self._memo.get(key)) is None:
      try: hit = self._eval(key) < self.split_min
      except ZeroDivisionError: hit = False  # a size divided by a variable at 0: no work to judge, keep the split
      if len(self._memo) < 4096: self._memo[key] = hit
    return hit


def _evaluator(u: UOp, names: list[str]) -> Callable[[Sequence[int]], int] | None:
  """u as a function of the values in `names` order, built from closures (never from text), or None for an operator
  outside _BINARY, constants, variables and integer casts."""
  topo = u.toposort()
  if len(topo) > MAX_NODES: return None
  fns: dict[UOp, Callable[[Sequence[int]], int]] = {}
  for x in topo:
    if x.dtype.count != 1 or x.dtype.is_float or x.dtype.kind == "p": return None
    if x.op is Ops.CONST: fns[x] = (lambda c: lambda v: c)(int(x.arg))
    elif x.op is Ops.DEFINE_VAR:
      if x.arg[0] not in names: return None
      fns[x] = (lambda i: lambda v: v[i])(names.index(x.arg[0]))
    elif x.op is Ops.CAST: fns[x] = fns[x.src[0]]
    elif x.op in _BINARY and len(x.src) == 2:
      fns[x] = (lambda f, a, b: lambda v: f(a(v), b(v)))(_BINARY[x.op], fns[x.src[0]], fns[x.src[1]])
    else: return None
  return fns[u]
