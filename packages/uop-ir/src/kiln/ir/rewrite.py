"""Pattern matching and graph rewriting: UPat, PatternMatcher, graph_rewrite (iterative, with an endless-rewrite guard)."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kiln.ir.dtype import DType
from kiln.ir.errors import RewriteError
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

_ANY = object()


class UPat:
  """A pattern over UOps. src as a tuple matches in order, as a list in any order (commutative ops), as one UPat every source."""
  __slots__ = ("op", "dtype", "src", "arg", "name", "allow_any_len", "custom")

  def __init__(self, op: Ops | Iterable[Ops] | None = None, dtype: DType | Iterable[DType] | None = None,
               src: UPat | tuple[UPat, ...] | list[UPat] | None = None, arg: Any = _ANY, name: str | None = None,
               allow_any_len: bool = False, custom: Callable[[UOp], bool] | None = None):
    self.op: frozenset[Ops] | None = None if op is None else frozenset((op,) if isinstance(op, Ops) else op)
    self.dtype: frozenset | None = None if dtype is None else frozenset((dtype,) if not isinstance(dtype, (tuple, list, set, frozenset)) else dtype)
    self.src, self.arg, self.name, self.allow_any_len, self.custom = src, arg, name, allow_any_len, custom

  @staticmethod
  def var(name: str | None = None, dtype: DType | Iterable[DType] | None = None) -> UPat: return UPat(dtype=dtype, name=name)
  @staticmethod
  def cvar(name: str | None = None, dtype: DType | Iterable[DType] | None = None) -> UPat: return UPat(Ops.CONST, dtype, name=name)
  @staticmethod
  def const(dtype: DType | Iterable[DType] | None, value: Any) -> UPat: return UPat(Ops.CONST, dtype, arg=value)

  def __repr__(self) -> str:
    return f"UPat({sorted(o.name for o in self.op) if self.op else None}, name={self.name!r})"

  # builders so rules read like expressions: UPat.var("x") + UPat.cvar("c")
  def _alu(self, op: Ops, *others: UPat, commutative: bool = False) -> UPat:
    srcs = (self, *others)
    return UPat(op, src=list(srcs) if commutative else srcs)
  def __add__(self, o: UPat) -> UPat: return self._alu(Ops.ADD, o, commutative=True)
  def __mul__(self, o: UPat) -> UPat: return self._alu(Ops.MUL, o, commutative=True)
  def __sub__(self, o: UPat) -> UPat: return self._alu(Ops.SUB, o)
  def __floordiv__(self, o: UPat) -> UPat: return self._alu(Ops.IDIV, o)
  def __mod__(self, o: UPat) -> UPat: return self._alu(Ops.MOD, o)
  def __lt__(self, o: UPat) -> UPat: return self._alu(Ops.CMPLT, o)
  def alu(self, op: Ops, *o: UPat, commutative: bool = False) -> UPat: return self._alu(op, *o, commutative=commutative)

  def fits_shape(self, op: Ops, src_ops: tuple[Ops, ...]) -> bool:
    """False when no node of this op with sources of these ops can match: match()'s checks that read only those ops."""
    if self.op is not None and op not in self.op: return False
    src = self.src
    if src is None: return True
    if isinstance(src, UPat): return src.op is None or all(o in src.op for o in src_ops)
    if len(src) != len(src_ops) and not (self.allow_any_len and len(src_ops) >= len(src)): return False
    if isinstance(src, tuple): return _shape_ok(src, src_ops)
    return len(src) != 2 or _shape_ok(src, src_ops) or _shape_ok((src[1], src[0]), src_ops)

  def match(self, u: UOp, store: dict[str, UOp]) -> list[dict[str, UOp]]:
    if self.op is not None and u.op not in self.op: return []
    if self.arg is not _ANY and not (u.arg is self.arg or (type(u.arg) is type(self.arg) and u.arg == self.arg)): return []
    if self.dtype is not None and u.dtype not in self.dtype and u.dtype.scalar() not in self.dtype: return []
    src = self.src
    if src is not None and not isinstance(src, UPat):
      if len(src) != len(u.src) and not (self.allow_any_len and len(u.src) >= len(src)): return []
      if isinstance(src, tuple) and not _ops_ok(src, u.src): return []  # cheap reject before any binding
      if isinstance(src, list) and len(src) == 2 and not (_ops_ok(src, u.src) or _ops_ok((src[1], src[0]), u.src)): return []
    if self.custom is not None and not self.custom(u): return []
    if self.name is not None:
      if (prev := store.get(self.name)) is not None:
        if prev is not u: return []
      else: store = {**store, self.name: u}
    if src is None: return [store]
    if isinstance(src, UPat): return _match_seq([src] * len(u.src), u.src, store)
    if isinstance(src, list):
      if len(src) == 2:
        return (_match_seq(src, u.src, store) if _ops_ok(src, u.src) else []) + \
          (_match_seq((src[1], src[0]), u.src, store) if _ops_ok((src[1], src[0]), u.src) else [])
      out: list[dict[str, UOp]] = []
      for perm in itertools.permutations(src): out += _match_seq(perm, u.src[:len(perm)], store)
      return out
    return _match_seq(src, u.src, store)


def _shape_ok(pats: Sequence[UPat], ops: Sequence[Ops]) -> bool:
  return all(p.op is None or o in p.op for p, o in zip(pats, ops))


def _ops_ok(pats: Sequence[UPat], srcs: Sequence[UOp]) -> bool:
  for p, s in zip(pats, srcs):
    if p.op is not None and s.op not in p.op: return False
  return True


def _match_seq(pats: Sequence[UPat], srcs: Sequence[UOp], store: dict[str, UOp]) -> list[dict[str, UOp]]:
  stores = [store]
  for p, s in zip(pats, srcs):
    stores = p.match(s, stores[0]) if len(stores) == 1 else [m for st in stores for m in p.match(s, st)]
    if not stores: return stores
  return stores


Rule = tuple[UPat, Callable[..., UOp | None]]


class PatternMatcher:
  """An ordered table of (pattern, function) rules, indexed by op. A function returns a replacement or None."""

  def __init__(self, rules: Sequence[Rule]):
    self.rules = list(rules)
    self.by_op: dict[Ops, list[Rule]] = {}
    self.wildcard: list[Rule] = []
    self._by_shape: dict[tuple[Ops, ...], list[Rule]] = {}
    for pat, fn in self.rules:
      if pat.op is None: self.wildcard.append((pat, fn))
      else:
        for o in pat.op: self.by_op.setdefault(o, []).append((pat, fn))
    if self.wildcard:  # keep table order for nodes that match both kinds
      order = {id(r): i for i, r in enumerate(self.rules)}
      for o in list(self.by_op): self.by_op[o] = sorted(self.by_op[o] + self.wildcard, key=lambda r: order[id(r)])

  def __add__(self, other: PatternMatcher) -> PatternMatcher: return PatternMatcher(self.rules + other.rules)

  def rules_for(self, u: UOp) -> list[Rule]:
    """The rules that can match u's shape (its op and its sources' ops), worked out once per shape: most rules of an op's list
    need sources a node does not have, and trying each costs a match() call."""
    if u.op not in self.by_op and not self.wildcard: return self.wildcard  # no rule for this op (stores, loads, ...)
    src = u.src
    key = (u.op, src[0].op, src[1].op) if len(src) == 2 else (u.op, *[s.op for s in src])
    if (rules := self._by_shape.get(key)) is None:
      rules = self._by_shape[key] = [r for r in self.by_op.get(u.op, self.wildcard) if r[0].fits_shape(u.op, key[1:])]
    return rules

  def rewrite(self, u: UOp, ctx: Any = None) -> UOp | None:
    for pat, fn in self.rules_for(u):
      for m in pat.match(u, {}):
        r = fn(ctx, **m) if ctx is not None else fn(**m)
        if r is not None and r is not u: return r
    return None


def graph_rewrite(root: UOp, pm: PatternMatcher, ctx: Any = None, bottom_up: bool = False, max_rewrites: int | None = None,
                  memo: dict[UOp, UOp] | None = None) -> UOp:
  """Rewrite every node of root's graph to a fixed point, without recursion.

  Default: a node is rewritten after its sources (so rules see simplified operands). bottom_up=True: a node is rewritten
  before its sources are visited (rules see the original operands, as a top-down pass). Either way a replacement is
  itself processed until nothing changes. A rewrite that comes back to a node still being rewritten (a -> b -> a) raises
  RewriteError at once; more than max_rewrites replacements (a rule set that grows the graph forever) raises it too.
  memo: each node's fixed point, shared between calls with the same pm and no ctx (the result is then a function of the
  node alone: UOps are interned, their variables' bounds in their args), so a graph that shares most of its nodes with
  an earlier one (the same index at another vector lane) rewrites only what differs.
  """
  if memo is not None and (done := memo.get(root)) is not None: return done  # (not even a walk of the graph for the limit)
  replace: dict[UOp, UOp] = memo if memo is not None else {}
  active: set[UOp] = set()  # nodes whose result is being computed: meeting one again means its result depends on itself
  # by default 100,000 rewrites plus 50 a node of root's graph, the nodes counted only once the 100,000 are passed: not a
  # walk of the whole graph on every call (lowering simplifies thousands of small indices a kernel)
  limit = max_rewrites
  rewrites = 0

  def step(u: UOp) -> UOp | None:
    nonlocal rewrites, limit
    r = pm.rewrite(u, ctx)
    if r is not None:
      rewrites += 1
      if limit is None and rewrites > 100_000: limit = 100_000 + 50 * len(root.toposort())
      if limit is not None and rewrites > limit:
        raise RewriteError(f"graph_rewrite made more than {limit} rewrites without reaching a fixed point; the last rewrote "
                           f"{u.op} ({u.dtype}) into {r.op} ({r.dtype}): a rule set that keeps growing the graph?")
    return r

  def cycle(u: UOp) -> RewriteError:
    return RewriteError(f"graph_rewrite found an endless rewrite: {u!r} is rewritten, through its own replacements, back into itself "
                        "(a rule set that undoes itself?)")

  stack: list[tuple[UOp, int, UOp]] = [(root, 0, root)]
  while stack:
    n, stage, cur = stack.pop()
    if stage == 0:
      if n in replace: continue
      if n in active: raise cycle(n)
      active.add(n)
      if bottom_up:
        seen = {cur}
        while (r := step(cur)) is not None:
          if r in seen: raise cycle(r)
          seen.add(cur := r)
      stack.append((n, 1, cur))
      stack.extend((s, 0, s) for s in reversed(cur.src) if s not in replace)
    elif stage == 1:
      new_src = tuple(replace[s] for s in cur.src)
      if any(a is not b for a, b in zip(new_src, cur.src)): cur = cur.replace(src=new_src)
      if cur is not n and cur in replace:  # rebuilt into a node already done: reuse its result
        replace[n] = replace[cur]
        active.discard(n)
        continue
      if (r := step(cur)) is not None:
        stack.append((n, 2, r))
        stack.append((r, 0, r))
        continue
      replace[n] = cur
      active.discard(n)
    else:
      replace[n] = replace[cur]
      active.discard(n)
  return replace[root]


def substitute(root: UOp, mapping: dict[UOp, UOp]) -> UOp:
  """Replace nodes by identity (each mapped node and everything above it is rebuilt)."""
  if not mapping: return root
  replace: dict[UOp, UOp] = {}
  for u in root.toposort():
    if u in mapping: replace[u] = mapping[u]; continue
    new_src = tuple(replace[s] for s in u.src)
    replace[u] = u if all(a is b for a, b in zip(new_src, u.src)) else u.replace(src=new_src)
  return replace[root]
