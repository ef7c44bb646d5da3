"""Symbolic dims: a named dim (batch, sequence) is a runtime variable, UOp.variable(name, lo, hi), one per name.

A dim of a Node's shape is kiln.ir's Dim: an int, or a *monomial* UOp, the product of variables (in name order) times
an int coefficient, e.g. batch*128 after a reshape merges (batch, 128). Keeping every symbolic dim in that one canonical
form lets shapes be compared by identity (UOps are hash-consed) and reshape groups be matched by (coefficient, names).
Sums of symbolic dims (a pad or concat along a symbolic axis) are not dims kiln-graph makes: those ops refuse them.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kiln.graph.lazy import GraphError
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

Mono = tuple[int, tuple[UOp, ...]]  # (coefficient, the variables, sorted by name, repeated for powers)


def is_sym(d: Dim) -> bool: return isinstance(d, UOp)
def is_static(shape: Sequence[Dim]) -> bool: return not any(isinstance(d, UOp) for d in shape)


def variable(name: str, lo: int, hi: int) -> UOp:
  if not isinstance(name, str) or not name.isidentifier(): raise GraphError(f"a dim name must be an identifier, got {name!r}")
  if not (isinstance(lo, int) and isinstance(hi, int)) or isinstance(lo, bool) or isinstance(hi, bool) or not 1 <= lo <= hi:
    raise GraphError(f"dim {name!r}: bounds must be ints 1 <= lo <= hi, got ({lo!r}, {hi!r})")
  if hi > 2**31 - 1: raise GraphError(f"dim {name!r}: upper bound {hi} does not fit int32")
  return UOp.variable(name, lo, hi)


def mono(d: Dim) -> Mono:
  if isinstance(d, int): return d, ()
  if d.op is Ops.DEFINE_VAR: return 1, (d,)
  if d.op is Ops.MUL:
    (ca, va), (cb, vb) = (mono(s.arg if s.op is Ops.CONST else s) for s in d.src)
    return ca * cb, tuple(sorted(va + vb, key=lambda v: v.arg[0]))
  raise GraphError(f"symbolic dim {d!r} is not a product of named dims")


def from_mono(c: int, vs: Sequence[UOp]) -> Dim:
  if not vs: return c
  out = vs[0]
  for v in vs[1:]: out = out * v
  return out if c == 1 else out * c


def mul(*ds: Dim) -> Dim:
  c, vs = 1, list[UOp]()
  for d in ds:
    dc, dv = mono(d)
    c *= dc
    vs.extend(dv)
  return from_mono(c, sorted(vs, key=lambda v: v.arg[0]))


def symbolic_numel(shape: Iterable[Dim]) -> Dim: return mul(*shape)


def dmax(d: Dim) -> int: return d if isinstance(d, int) else int(d.vmax)


def max_numel(shape: Iterable[Dim]) -> int:
  out = 1
  for d in shape: out *= dmax(d)
  return out


def evaluate(d: Dim, vals: Mapping[str, int]) -> int:
  c, vs = mono(d)
  for v in vs: c *= vals[v.arg[0]]
  return c


def variables(shape: Iterable[Dim]) -> list[UOp]:
  return [v for d in shape for v in mono(d)[1]]


def divides(a: Dim, b: Dim) -> bool:
  """Whether a is a factor of b for every value of the variables: its names a sub-multiset of b's and coefficient dividing."""
  (ca, va), (cb, vb) = mono(a), mono(b)
  rest = list(vb)
  for v in va:
    if v not in rest: return False
    rest.remove(v)
  return cb % ca == 0


def div(a: Dim, b: Dim) -> Dim | None:
  """a / b when b divides a for every value of the variables, else None."""
  if not divides(b, a): return None
  (ca, va), (cb, vb) = mono(a), mono(b)
  rest = list(va)
  for v in vb: rest.remove(v)
  return from_mono(ca // cb, rest)


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


def fmt(d: Dim) -> str:
  if isinstance(d, int | np.integer): return str(int(d))
  c, vs = mono(d)
  return "*".join([v.arg[0] for v in vs] + ([str(c)] if c != 1 else []))


def fmt_shape(shape: Sequence[Dim]) -> str: return "(" + ", ".join(fmt(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _smaller(a: Dim, b: Dim) -> bool:
  """Whether a reshape group whose product is a must take in more dims to reach b."""
  if isinstance(a, int) and isinstance(b, int): return a < b
  (ca, va), (cb, vb) = mono(a), mono(b)
  if va == vb: return ca < cb
  return len(va) < len(vb) and divides(from_mono(1, va), from_mono(1, vb))


def reshape_groups(out_shape: Sequence[Dim], in_shape: Sequence[Dim]) -> list[tuple[list[int], list[int]]]:
  """The groups of a reshape: runs of output and input dims with the same product (a merge or a split each). A
  symbolic dim must sit in a group whose products match as monomials (batch*128 from (batch, 128)); anything else
  (a symbolic dim split across groups, or traded for static ones) is a GraphError."""
  out: list[tuple[list[int], list[int]]] = []
  i = j = 0
  no, ni = len(out_shape), len(in_shape)
  while i < no or j < ni:
    gi, gj = [i], [j]
    po: Dim = out_shape[i] if i < no else 1
    pi: Dim = in_shape[j] if j < ni else 1
    while mono(po) != mono(pi):
      if _smaller(po, pi) and i + 1 < no:
        i += 1; gi.append(i); po = mul(po, out_shape[i])
      elif _smaller(pi, po) and j + 1 < ni:
        j += 1; gj.append(j); pi = mul(pi, in_shape[j])
      else: raise GraphError(f"reshape: cannot reshape {fmt_shape(in_shape)} to {fmt_shape(out_shape)}: a symbolic dim "
                             "must stay a dim of its own or be merged with (split from) whole neighbouring dims")
    i, j = i + 1, j + 1
    out.append(([k for k in gi if k < no], [k for k in gj if k < ni]))
  return out
