"""Symbolic dims: a named dim (batch, sequence) is a runtime variable, UOp.variable(name, lo, hi), one per name, with
0 <= lo <= hi (a KV cache's past length may be 0: the kernels then run their loops over it zero times).

A dim of a Node's shape is kiln.ir's Dim: an int, or a *polynomial* UOp in the variables with int coefficients, kept in
one canonical form: its monomials (the variables of each sorted by name, repeated for powers, times a coefficient)
summed in order of degree, then names, the constant last. `batch*128` after a reshape merges (batch, 128), `past + seq`
after a KV cache's concat, `seq - 1` after a slice [1:]. Every dim kiln-graph makes goes through `canon` (add, sub,
mul, div all return it), so equal dims are the same UOp (UOps are hash-consed) and shapes compare by identity.

A reshape matches groups of dims by their monomials (batch*128 from (batch, 128)); a dim that is a sum stays a dim of
its own there (only 1s may join it). A sum's bounds (`bounds`) come from the variables' bounds, term by term (exact for
a monomial or a sum of positive terms, a safe interval otherwise); buffers are declared at the upper bound, and a dim
that the bounds cannot prove >= 0 (seq - 1 with seq from 0) is checked at run time (Compiled.run, `negative`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from kiln.graph.errors import GraphError
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

Mono = tuple[int, tuple[UOp, ...]]  # (coefficient, the variables, sorted by name, repeated for powers)
Terms = dict[tuple[UOp, ...], int]  # a polynomial: variables -> coefficient (() the constant), no zero coefficients


def is_static(shape: Sequence[Dim]) -> bool: return not any(isinstance(d, UOp) for d in shape)


def variable(name: str, lo: int, hi: int) -> UOp:
  if not isinstance(name, str) or not name.isidentifier(): raise GraphError(f"a dim name must be an identifier, got {name!r}")
  if not (isinstance(lo, int) and isinstance(hi, int)) or isinstance(lo, bool) or isinstance(hi, bool) or not 0 <= lo <= hi or hi < 1:
    raise GraphError(f"dim {name!r}: bounds must be ints 0 <= lo <= hi, hi >= 1, got ({lo!r}, {hi!r})")
  if hi > 2**31 - 1: raise GraphError(f"dim {name!r}: upper bound {hi} does not fit int32")
  return UOp.variable(name, lo, hi)


CAPPED = "__upto"  # a capped variable's name: f"{CAPPED}{cap}__{source}", its value min(cap, source's): the name says how to bind it


def capped(v: UOp, cap: int) -> UOp:
  """min(cap, v) as a variable of its own (a Slice [0:300] of an axis of a length read back at run time, which may be
  shorter): every run binds it from v's value, so it needs no registry (value_of)."""
  lo, hi = v.arg[1], v.arg[2]
  return variable(f"{CAPPED}{cap}__{v.arg[0]}", min(lo, cap), min(hi, cap))


def _capped_of(name: str) -> tuple[int, str] | None:
  """(cap, source) of a capped variable's name, None for any other."""
  if not name.startswith(CAPPED) or "__" not in (rest := name[len(CAPPED):]): return None
  cap, source = rest.split("__", 1)
  return (int(cap), source) if cap.isdigit() else None


def source_of(name: str) -> str:
  """The variable a capped one is bound from (itself for any other)."""
  while (c := _capped_of(name)) is not None: name = c[1]
  return name


def value_of(name: str, vals: Mapping[str, int]) -> int:
  """A variable's value in a run: bound in vals, or a capped variable's from its source's."""
  if (got := vals.get(name)) is not None: return got
  if (c := _capped_of(name)) is None: raise KeyError(name)
  return min(c[0], value_of(c[1], vals))


def capped_names(names: Iterable[str]) -> list[str]:
  """The capped variables among names (a plan's, found once when it is built: each run binds them with with_capped)."""
  return [n for n in names if _capped_of(n) is not None]


def with_capped(vals: Mapping[str, int], capped: Iterable[str]) -> Mapping[str, int]:
  """vals with the capped variables (capped_names') bound from their sources (a plan's executor reads them by name)."""
  missing = [n for n in capped if n not in vals]
  return vals if not missing else {**vals, **{n: value_of(n, vals) for n in missing}}


def _names(vs: tuple[UOp, ...]) -> tuple[str, ...]: return tuple(v.arg[0] for v in vs)


@lru_cache(maxsize=1 << 14)
def _uop_terms(d: UOp) -> tuple[tuple[tuple[UOp, ...], int], ...]:
  if d.op is Ops.DEFINE_VAR: return (((d,), 1),)
  if d.op is Ops.CONST and isinstance(d.arg, int) and not isinstance(d.arg, bool): return (((), d.arg),) if d.arg else ()
  if d.op in (Ops.ADD, Ops.SUB, Ops.MUL) and len(d.src) == 2:
    a, b = terms(d.src[0]), terms(d.src[1])
    if d.op is Ops.MUL: return tuple(_mul_terms(a, b).items())
    return tuple(_add_terms(a, b, 1 if d.op is Ops.ADD else -1).items())
  if d.op is Ops.NEG: return tuple((vs, -c) for vs, c in terms(d.src[0]).items())
  raise GraphError(f"symbolic dim {d!r} is not a polynomial in named dims")


def terms(d: Dim) -> Terms:
  """d as a polynomial: {variables (sorted by name): coefficient}."""
  if isinstance(d, UOp): return dict(_uop_terms(d))
  if isinstance(d, int | np.integer) and not isinstance(d, bool | np.bool_): return {(): int(d)} if d else {}
  raise GraphError(f"{d!r} is not a dim")


def _add_terms(a: Terms, b: Terms, sign: int) -> Terms:
  out = dict(a)
  for vs, c in b.items():
    if (s := out.get(vs, 0) + sign * c): out[vs] = s
    else: out.pop(vs, None)
  return out


def _mul_terms(a: Terms, b: Terms) -> Terms:
  out: Terms = {}
  for va, ca in a.items():
    for vb, cb in b.items():
      vs = tuple(sorted(va + vb, key=lambda v: v.arg[0]))
      if (s := out.get(vs, 0) + ca * cb): out[vs] = s
      else: out.pop(vs, None)
  return out


def from_mono(c: int, vs: Sequence[UOp]) -> Dim:
  if not vs or not c: return c
  out = vs[0]
  for v in vs[1:]: out = out * v
  return out if c == 1 else out * c


def from_terms(t: Terms) -> Dim:
  """The canonical dim of a polynomial: monomials by degree, then names, summed left to right, the constant last."""
  if any(t) and not all(-2**31 <= c < 2**31 for c in t.values()):  # a UOp's constants are int32 (an int alone may be any size)
    raise GraphError(f"the dim {_fmt_terms(t)} has a coefficient that does not fit int32 (a symbolic dim's arithmetic is int32)")
  order = sorted((vs for vs, c in t.items() if vs and c), key=lambda vs: (len(vs), _names(vs)))
  out: Dim = 0
  for vs in order: out = from_mono(t[vs], vs) if isinstance(out, int) else out + from_mono(t[vs], vs)
  c = t.get((), 0)
  return c if isinstance(out, int) else out + c if c else out


def canon(d: Dim) -> Dim: return from_terms(terms(d))


def to_json(d: Dim) -> int | list[list[Any]]:
  """A dim as JSON (a kept plan's shapes: the plan cache): an int, or its polynomial as [coefficient, [[name, lo, hi], ...]]
  per monomial (each variable with its bounds)."""
  if not isinstance(d, UOp): return int(d)
  return [[c, [list(v.arg) for v in vs]] for vs, c in terms(d).items()]


def from_json(x: Any) -> Dim:
  """to_json undone (the canonical dim: equal to the one written, the same UOp); a GraphError where it is not a dim's."""
  if isinstance(x, int) and not isinstance(x, bool): return x
  if not isinstance(x, list): raise GraphError(f"{x!r} is not a dim's JSON")
  t: Terms = {}
  for mono_ in x:
    if not (isinstance(mono_, list) and len(mono_) == 2 and isinstance(mono_[0], int) and isinstance(mono_[1], list)):
      raise GraphError(f"{mono_!r} is not a monomial's JSON")
    if not all(isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) for v in mono_[1]):
      raise GraphError(f"{mono_[1]!r} are not variables as [name, lo, hi]")
    vs = tuple(sorted((variable(*v) for v in mono_[1]), key=lambda u: u.arg[0]))
    t = _add_terms(t, {vs: mono_[0]}, 1)
  return from_terms(t)


def is_mono(d: Dim) -> bool:
  """Whether d is a product of named dims and an int (no sum)."""
  return len(terms(d)) <= 1


def mono(d: Dim) -> Mono:
  t = terms(d)
  if not t: return 0, ()
  if len(t) == 1:
    ((vs, c),) = t.items()
    return c, vs
  raise GraphError(f"symbolic dim {fmt(d)} is a sum, not a product of named dims")


def add(*ds: Dim) -> Dim:
  out: Terms = {}
  for d in ds: out = _add_terms(out, terms(d), 1)
  return from_terms(out)


def sub(a: Dim, b: Dim) -> Dim: return from_terms(_add_terms(terms(a), terms(b), -1))


def mul(*ds: Dim) -> Dim:
  out: Terms = {(): 1}
  for d in ds: out = _mul_terms(out, terms(d))
  return from_terms(out)


def same(a: Dim, b: Dim) -> bool:
  """Whether a and b are the same dim for every value of the variables (never UOp's ==, which builds a UOp)."""
  return terms(a) == terms(b)


def symbolic_numel(shape: Iterable[Dim]) -> Dim: return mul(*shape)


def _mono_bounds(c: int, vs: tuple[UOp, ...]) -> tuple[int, int]:
  lo, hi = c * math.prod(v.arg[1] for v in vs), c * math.prod(v.arg[2] for v in vs)  # every variable >= 0
  return (lo, hi) if c >= 0 else (hi, lo)


def bounds(d: Dim) -> tuple[int, int]:
  """The smallest and largest value d may take: exact for a monomial or a sum of positive terms, else a safe interval."""
  return (d, d) if isinstance(d, int) else _bounds(terms(d))


def _bounds(t: Terms) -> tuple[int, int]:
  lo = hi = 0
  for vs, c in t.items():
    a, b = _mono_bounds(c, vs)
    lo, hi = lo + a, hi + b
  return lo, hi


def dmin(d: Dim) -> int: return bounds(d)[0]
def dmax(d: Dim) -> int: return bounds(d)[1]


def max_numel(shape: Iterable[Dim]) -> int:
  out = 1
  for d in shape: out *= dmax(d)
  return out


def evaluate(d: Dim, vals: Mapping[str, int]) -> int:
  out = 0
  for vs, c in terms(d).items(): out += c * math.prod(value_of(v.arg[0], vals) for v in vs)
  return out


def variables(shape: Iterable[Dim]) -> list[UOp]:
  return [v for d in shape for vs in terms(d) for v in vs]


def negative(shape: Iterable[Dim]) -> list[UOp]:
  """The dims of shape whose bounds do not prove them >= 0 (a slice's seq - 1 when seq may be 0): run() checks them."""
  return [d for d in shape if isinstance(d, UOp) and dmin(d) < 0]


def bind_dims(inputs: Iterable[tuple[str, Sequence[Dim]]], shapes: Mapping[str, tuple[int, ...]], whose: str,
              error: type[Exception] = GraphError) -> dict[str, int]:
  """Each variable's value off the fed arrays' shapes (by input name; an input not fed is skipped: the caller names it),
  checked against each input's shape of ints and variables: the rank, each fixed dim, each symbolic dim within its bounds
  and the same in every input that names it. The first that does not fit is `error` naming the input and `whose` shape
  it is ("the model", "the graph"). The one home of this check: Model.run (a FeedError), a Program and Compiled.run."""
  vals: dict[str, int] = {}
  where: dict[str, str] = {}
  for name, shape in inputs:
    if (got := shapes.get(name)) is None: continue
    if len(got) != len(shape): raise error(f"input {name!r} has shape {got}, {whose} takes rank {len(shape)} {fmt_shape(shape)}")
    for k, (n, d) in enumerate(zip(got, shape)):
      if isinstance(d, int):
        if n != d: raise error(f"input {name!r} has shape {got}, {whose} takes {fmt_shape(shape)} (dim {k})")
        continue
      var, lo, hi = d.arg
      if not lo <= n <= hi: raise error(f"input {name!r} dim {k} ({var}) is {n}, outside the bounds [{lo}, {hi}] {whose} was loaded with")
      if var in vals and vals[var] != n: raise error(f"input {name!r} dim {k} ({var}) is {n}, but {where[var]} gave {var} = {vals[var]}")
      vals[var], where[var] = int(n), f"input {name!r} dim {k}"
  return vals


def check_sizes(ds: Iterable[Dim], vals: Mapping[str, int]) -> None:
  """A GraphError when one of the dims (`negative`'s) is below 0 for the values run() read off the feeds."""
  for d in ds:
    if (v := evaluate(d, vals)) < 0:
      given = ", ".join(f"{n} = {vals[n]}" for n in sorted({x.arg[0] for x in variables([d])}))
      raise GraphError(f"the dim {fmt(d)} is {v} for {given}: the graph was built for sizes where it is >= 0 (a slice's [1:] of an empty axis)")


def div(a: Dim, b: Dim) -> Dim | None:
  """a / b when b divides a for every value of the variables (as polynomials), else None."""
  ta, tb = terms(a), terms(b)
  if not tb: return None
  if not ta: return 0
  if len(tb) == 1:  # a monomial divides term by term
    ((vb, cb),) = tb.items()
    out: Terms = {}
    for va, ca in ta.items():
      rest = list(va)
      for v in vb:
        if v not in rest: return None
        rest.remove(v)
      if ca % cb: return None
      out[tuple(rest)] = ca // cb
    return from_terms(out)
  lead = max(ta, key=lambda vs: (len(vs), _names(vs)))  # a sum: a by b's leading term, checked by multiplying back
  blead = max(tb, key=lambda vs: (len(vs), _names(vs)))
  q = div(from_mono(ta[lead], lead), from_mono(tb[blead], blead))
  return q if q is not None and _mul_terms(terms(q), tb) == ta else None


def divides(a: Dim, b: Dim) -> bool:
  """Whether a is a factor of b for every value of the variables."""
  return div(b, a) is not None


def span(n: Dim, b: Dim | None, e: Dim | None, what: str) -> tuple[Dim, Dim]:
  """(start, length) of [b:e] (step 1) on an axis of n elements, by Python's rules: None is an end of the axis, a negative
  int counts from the end, an end past the axis is its end. b and e are ints or dims. The result is exact when
  0 <= start and end <= n for every value in the bounds, or for [0:e] of an axis of one variable's length (min(e, n):
  a capped variable); else a GraphError names the bound (Python would clamp it for some sizes only); length >= 0 is left
  to the run-time check of `negative` dims where the bounds cannot prove it ([1:] of a seq that may be 0)."""
  def at(x: Dim | None, default: Dim) -> Dim:
    if x is None: return default
    if isinstance(x, UOp) and dmin(x) < 0: raise GraphError(f"{what}: the bound {fmt(x)} may be negative")
    if isinstance(x, int) and x < 0: return 0 if x <= -dmax(n) else add(n, x)  # before the start for every size: the start
    return canon(x)
  start, end = at(b, 0), at(e, n)
  over = _bounds(_add_terms(terms(end), terms(n), -1))  # end - n, in Python ints (INT64_MAX is no int32 dim)
  if over[0] >= 0: end = n  # past the end for every size (INT64_MAX, an int >= n's upper bound)
  elif over[1] > 0 and isinstance(e, int) and isinstance(start, int) and start == 0 and len(vs := variables([n])) == 1 \
      and terms(n) == {tuple(vs): 1}:
    end = capped(vs[0], e)  # [0:e] of an axis of v elements: min(e, v), a variable bound from v's value each run
  elif over[1] > 0:
    raise GraphError(f"{what}: the end {fmt(end)} lies past the axis' {fmt(n)} for some sizes, so the length would be min({fmt(end)}, {fmt(n)}), "
                     "which is no dim kiln makes")
  if dmin(start) < 0:
    lo, hi = bounds(n)
    raise GraphError(f"{what}: the start {fmt(start)} is below 0 for some sizes of {fmt(n)} (bounds [{lo}, {hi}]), where Python would clamp it: "
                     "the length is no dim kiln makes")
  if dmax(length := sub(end, start)) < 1: raise GraphError(f"{what} is empty for every size in the bounds (empty tensors are not supported)")
  return start, length


def require_static(op: str, shape: Sequence[Dim], axes: Iterable[int] | None = None, what: str = "") -> None:
  """A typed refusal of a symbolic dim where op does not support one yet."""
  for a in (range(len(shape)) if axes is None else axes):
    if isinstance(shape[a], UOp):
      raise GraphError(f"{op}: symbolic dim {fmt(shape[a])} (axis {a} of {fmt_shape(shape)}) is not supported{' ' + what if what else ''}")


def static_dim(op: str, shape: Sequence[Dim], axis: int) -> int:
  d = shape[axis]
  if not isinstance(d, int): raise GraphError(f"{op}: symbolic dim {fmt(d)} (axis {axis} of {fmt_shape(shape)}) is not supported")
  return d


def static_shape(op: str, shape: Sequence[Dim]) -> tuple[int, ...]:
  """shape, refused with a GraphError if a dim is symbolic (for ops that need sizes at compile time)."""
  require_static(op, shape)
  return tuple(d for d in shape if isinstance(d, int))


def _fmt_mono(c: int, vs: tuple[UOp, ...]) -> str: return "*".join([*_names(vs), *([str(c)] if c != 1 or not vs else [])])


def fmt(d: Dim) -> str:
  """past + seq, seq - 1, batch*128 (a monomial: its names, then its coefficient)."""
  return str(int(d)) if isinstance(d, int | np.integer) else _fmt_terms(terms(d))


def _fmt_terms(t: Terms) -> str:
  order = sorted((vs for vs in t if vs), key=lambda vs: (len(vs), _names(vs))) + ([()] if () in t else [])
  out = ""
  for vs in order:
    c = t[vs]
    text = _fmt_mono(abs(c), vs)
    out = (("-" if c < 0 else "") + text) if not out else f"{out} {'-' if c < 0 else '+'} {text}"
  return out or "0"


def fmt_shape(shape: Sequence[Dim]) -> str: return "(" + ", ".join(fmt(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _one(d: Dim) -> bool: return isinstance(d, int) and d == 1


def _smaller(a: Dim, b: Dim) -> bool:
  """Whether a reshape group whose product is a must take in more dims to reach b."""
  if isinstance(a, int) and isinstance(b, int): return a < b
  (ca, va), (cb, vb) = mono(a), mono(b)
  if va == vb: return ca < cb
  return len(va) < len(vb) and divides(from_mono(1, va), from_mono(1, vb))


def reshape_groups(out_shape: Sequence[Dim], in_shape: Sequence[Dim]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
  """The groups of a reshape: runs of output and input dims with the same product (a merge or a split each). A
  symbolic dim must sit in a group whose products match as monomials (batch*128 from (batch, 128)), and a sum
  (past + seq) in a group of its own with 1s at most; anything else (a symbolic dim split across groups, or traded for
  static ones) is a GraphError."""
  return _reshape_groups(tuple(out_shape), tuple(in_shape))


@lru_cache(maxsize=1 << 14)  # dims are hash-consed: every kernel that renders one reshape asks again (a decoder's layers)
def _reshape_groups(out_shape: tuple[Dim, ...], in_shape: tuple[Dim, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
  out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
  i = j = 0
  no, ni = len(out_shape), len(in_shape)
  while i < no or j < ni:
    gi, gj = [i], [j]
    po: Dim = out_shape[i] if i < no else 1
    pi: Dim = in_shape[j] if j < ni else 1
    while not same(po, pi):
      sums = not (is_mono(po) and is_mono(pi))
      if (_one(po) if sums else _smaller(po, pi)) and i + 1 < no:
        i += 1; gi.append(i); po = mul(po, out_shape[i])
      elif (_one(pi) if sums else _smaller(pi, po)) and j + 1 < ni:
        j += 1; gj.append(j); pi = mul(pi, in_shape[j])
      else: raise GraphError(f"reshape: cannot reshape {fmt_shape(in_shape)} to {fmt_shape(out_shape)}: a symbolic dim "
                             "must stay a dim of its own or be merged with (split from) whole neighbouring dims (a sum of dims: "
                             "only with 1s)")
    i, j = i + 1, j + 1
    out.append((tuple(k for k in gi if k < no), tuple(k for k in gj if k < ni)))
  return tuple(out)
