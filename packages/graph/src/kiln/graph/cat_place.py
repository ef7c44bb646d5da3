"""Concatenations in place: where every piece of a realized concatenation is a kernel's own output laid out as its piece
of the result, each of those kernels writes straight into the concatenation's buffer, and the copy is no kernel.

A fire module (SqueezeNet), an inception block or a dense block concatenates what several convs compute along the
channels, and the next conv's product reads the whole: the scheduler realizes the concatenation, a kernel of selects
that copied every piece once more (its pieces were realized anyway: each holds a reduction). With one image (or a
concatenation along the first axis of more than one element) each piece is one contiguous run of the result's buffer,
so its kernel can store there instead.

| before                                                       | after                                                             |
|--------------------------------------------------------------|-------------------------------------------------------------------|
| piece i: a kernel writes buffer P_i                          | piece i: the same kernel writes a view of C's buffer at its offset |
| C = cat(P_0, ..., P_n): a kernel copies every P_i into C     | no kernel: C's buffer is filled by the pieces' kernels            |

A piece qualifies when it is a kernel's node reached from the concatenation through reshapes only (its buffer's order
is the piece's), has the concatenation's buffer dtype, is no output, is not read twice by the same concatenation and is
placed in no other one (a dense block's features sit in every later block's concatenation: the first takes them, the
others copy). The concatenation is no output either (an output's buffer may be the caller's), and is no piece of one
placed itself (a view is never a view's base here). Every piece's offset is a whole number of CAT_ALIGN bytes, so a
kernel's aligned vector stores stay aligned.

With more than one image (a concatenation along an axis after the first whose leading dims hold `rows` > 1 elements) a
piece is `rows` runs of the result, one every `stride` elements: its kernel's stores are spread over a view that spans
them all, element i of the piece to (i // run) * stride + i % run, which the simplifier folds back into the loops (the
index of an image's run times the stride). A piece qualifies then only where the concatenation is its one reader (any
other would read the runs as if they were one), the fold leaves no division in the index and the stride is a whole
number of CAT_ALIGN bytes too. Its view overlaps its siblings' byte ranges, so the plan orders their kernels (the hazards
are on byte ranges): they no longer overlap on threads, which a split kernel did not need."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from math import prod
from typing import NamedTuple

from kiln.graph.dims import is_static, static_shape
from kiln.graph.kernelize import Kernel
from kiln.graph.lazy import Node
from kiln.ir.dtype import DType, PtrDType
from kiln.ir.uop import Ops, UOp

PLACE_CATS = True
CAT_ALIGN = 64  # bytes: a cache line, every CPU vector and CUDA's 16-byte loads


class Place(NamedTuple):
  """Where a piece lives in its concatenation's buffer: `rows` runs of `run` elements, the first at element `at`, one
  every `stride` elements (one image: a single run)."""
  cat: Node
  at: int
  rows: int
  run: int
  stride: int

  @property
  def span(self) -> int: return (self.rows - 1) * self.stride + self.run  # the elements its view covers


Placement = dict[Node, Place]


def _piece(n: Node, made: set[Node]) -> Node | None:
  """The kernel's node n stands for through reshapes (not realized themselves), else None."""
  while n not in made and n.op == "VIEW" and n.arg[0] == "reshape" and not n.realize: n = n.src[0]
  return n if n in made else None


def place_cats(kernels: Sequence[Kernel], outputs: set[Node], stored: Callable[[Node], DType]) -> tuple[list[Kernel], Placement]:
  """The kernels left once every concatenation that qualifies is written in place (a piece's kernel spread over its runs
  where it has more than one), and where each placed piece goes."""
  if not PLACE_CATS: return list(kernels), {}
  by_node = {k.node: k for k in kernels}
  made = set(by_node)
  readers: dict[Node, set[Node]] = {}
  for k in kernels:
    for s in k.slots[1:]: readers.setdefault(s, set()).add(k.node)
  placed: Placement = {}
  hosts: set[Node] = set()
  spread: dict[Node, UOp] = {}
  for k in kernels:
    c = k.node
    if c.op != "CAT" or c in outputs or c in placed or not is_static(c.shape): continue
    shape = static_shape("cat", c.shape)
    rows, stride = prod(shape[:c.arg]), prod(shape[c.arg:])
    pieces = [p for s in c.src if (p := _piece(s, made)) is not None]
    if len(pieces) != len(c.src) or len(set(pieces)) != len(pieces): continue
    if any(p in outputs or p in placed or p in hosts or stored(p) != stored(c) for p in pieces): continue
    item, at, places = stored(c).itemsize, 0, []
    for s in c.src:
      run = prod(static_shape("cat", s.shape)) // rows
      places.append(Place(c, at, rows, run, stride))
      at += run
    if any(pl.at * item % CAT_ALIGN for pl in places): continue
    if rows > 1:
      if stride * item % CAT_ALIGN or any(readers.get(p, set()) != {c} for p in pieces): continue
      asts = [_spread(by_node[p].ast, pl) for p, pl in zip(pieces, places)]
      if any(a is None for a in asts): continue
      spread.update((p, a) for p, a in zip(pieces, asts) if a is not None)
    placed.update(zip(pieces, places))
    hosts.add(c)
  return [dataclasses.replace(k, ast=spread[k.node]) if k.node in spread else k for k in kernels if k.node not in hosts], placed


def _spread(ast: UOp, pl: Place) -> UOp | None:
  """A piece's kernel with its output slot (0) a view of pl.span elements and element i stored at
  (i // run) * stride + i % run; None where the simplifier leaves a division or remainder the index did not have."""
  nodes = ast.toposort()
  g = next((u for u in nodes if u.op is Ops.DEFINE_GLOBAL and u.arg == 0), None)
  if g is None or not isinstance(g.dtype, PtrDType): return None
  wide = UOp.define_global(0, g.dtype.base.ptr(pl.span))
  moved: dict[UOp, UOp] = {}
  for u in nodes:
    if u.op is Ops.INDEX and u.src[0] is g:  # its index and gate are the loops' and other slots' values, never slot 0's
      i = u.src[1]
      j = (i // pl.run * pl.stride + i % pl.run).simplify()
      if _divisions(j) > _divisions(i): return None
      moved[u] = wide.index(j, *u.src[2:])
  return ast.substitute(moved)


def _divisions(u: UOp) -> int: return sum(x.op in (Ops.IDIV, Ops.MOD) for x in u.toposort())
