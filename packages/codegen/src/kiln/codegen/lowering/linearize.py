"""The linearizer: places statements and the values they need into nested scopes, and flattens them in a valid order.

A value goes to the deepest scope among its sources' scopes, so loop-invariant work sits outside loops; a scope's
block joins its parent only when it closes, so anything placed in the parent meanwhile lands before it. Reads of an
accumulator are unique nodes that stay where the statement using them is.
"""
from __future__ import annotations

from kiln.ir.dtype import dtypes
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

_ARGS = frozenset({Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR, Ops.SPECIAL, Ops.DEFINE_LOCAL})


class Scope:
  __slots__ = ("parent", "opener", "items", "depth", "children", "closed")

  def __init__(self, parent: Scope | None, opener: UOp | None):
    self.parent, self.opener = parent, opener
    self.items: list[UOp] = []
    self.depth: int = parent.depth + 1 if parent is not None else 0
    self.children: list[Scope] = []
    self.closed = False


class Linearizer:
  def __init__(self) -> None:
    self.root = Scope(None, None)
    self.where: dict[UOp, Scope] = {}  # value -> scope holding its definition (while that scope is open)
    self.args: list[UOp] = []
    # buffer -> the shallowest scope a read of it may go to: memory written in that scope (a packed panel) must not be
    # read above the writes, though the read's index may be loop-invariant (one column tile, the reduce axis unrolled)
    self.floor: dict[UOp, Scope] = {}

  def _visible(self, u: UOp, scope: Scope) -> Scope | None:
    s = self.where.get(u)
    if s is None or s.closed: return None
    p: Scope | None = scope
    while p is not None:
      if p is s: return s
      p = p.parent
    return None

  def need(self, u: UOp, scope: Scope) -> Scope:
    """Make sure u and its sources are defined where `scope` can see them; returns u's scope."""
    for n in u.toposort():
      if n.op is Ops.CONST or self._visible(n, scope) is not None: continue
      if n.op in _ARGS:
        if n not in self.args: self.args.append(n)
        self.where[n] = self.root
        continue
      if n.op is Ops.RANGE: raise AssertionError(f"loop {n.arg} used outside its scope")
      if n.op is Ops.LOAD and n.src[0].op is Ops.DEFINE_ACC: target = scope  # an accumulator read stays in place
      else:
        target = self.root
        for s in n.src:
          ss = self.root if s.op is Ops.CONST else self._visible(s, scope)
          assert ss is not None, f"source {s.op} of {n.op} is not defined"
          if ss.depth > target.depth: target = ss
        if n.op is Ops.LOAD and n.src[0].op is Ops.INDEX and (f := self.floor.get(n.src[0].src[0])) is not None and not f.closed:
          if f.depth > target.depth: target = f
      target.items.append(n)
      self.where[n] = target
    return self.where.get(u, self.root)

  def emit(self, scope: Scope, stmt: UOp) -> None:
    for s in stmt.src: self.need(s, scope)
    scope.items.append(stmt)
    if stmt.op is Ops.DEFINE_ACC: self.where[stmt] = scope

  def acc_read(self, acc: UOp, uid: int) -> UOp: return UOp(Ops.LOAD, acc.dtype, (acc,), uid)

  def open(self, scope: Scope, rng: UOp) -> Scope:
    for s in rng.src: self.need(s, scope)
    child = Scope(scope, rng)
    scope.children.append(child)
    self.where[rng] = child
    return child

  def open_if(self, scope: Scope, cond: UOp) -> Scope:
    self.need(cond, scope)
    child = Scope(scope, UOp(Ops.IF, dtypes.void, (cond,), len(scope.children)))
    scope.children.append(child)
    return child

  def close(self, scope: Scope) -> None:
    if scope.closed: return
    for c in scope.children: self.close(c)
    assert scope.parent is not None and scope.opener is not None
    end = Ops.ENDRANGE if scope.opener.op is Ops.RANGE else Ops.ENDIF
    scope.parent.items.extend([scope.opener, *scope.items, UOp(end, dtypes.void, (scope.opener,))])
    scope.closed = True

  def close_to(self, scope: Scope) -> None:
    for c in scope.children: self.close(c)

  def program(self) -> list[UOp]:
    self.close_to(self.root)
    return sorted(self.args, key=_arg_order) + self.root.items


def _arg_order(u: UOp) -> tuple:
  if u.op is Ops.DEFINE_GLOBAL: return (0, u.arg)
  if u.op is Ops.DEFINE_VAR: return (1, u.arg[0])
  if u.op is Ops.DEFINE_LOCAL: return (3, u.arg)
  return (2, u.arg)
