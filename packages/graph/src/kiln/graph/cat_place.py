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
kernel's aligned vector stores stay aligned."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

from kiln.graph.dims import is_static, static_shape
from kiln.graph.kernelize import Kernel
from kiln.graph.lazy import Node
from kiln.ir.dtype import DType

PLACE_CATS = True
CAT_ALIGN = 64  # bytes: a cache line, every CPU vector and CUDA's 16-byte loads

Placement = dict[Node, tuple[Node, int]]  # a piece -> (its concatenation, its first element there)


def _piece(n: Node, made: set[Node]) -> Node | None:
  """The kernel's node n stands for through reshapes (not realized themselves), else None."""
  while n not in made and n.op == "VIEW" and n.arg[0] == "reshape" and not n.realize: n = n.src[0]
  return n if n in made else None


def place_cats(kernels: Sequence[Kernel], outputs: set[Node], stored: Callable[[Node], DType]) -> tuple[list[Kernel], Placement]:
  """The kernels left once every concatenation that qualifies is written in place, and where each placed piece goes."""
  if not PLACE_CATS: return list(kernels), {}
  made = {k.node for k in kernels}
  placed: Placement = {}
  hosts: set[Node] = set()
  for k in kernels:
    c = k.node
    if c.op != "CAT" or c in outputs or c in placed or not is_static(c.shape) or prod(static_shape("cat", c.shape)[:c.arg]) != 1: continue
    pieces = [_piece(s, made) for s in c.src]
    if any(p is None or p in outputs or p in placed or p in hosts for p in pieces): continue
    if len(set(pieces)) != len(pieces) or any(p is None or stored(p) != stored(c) for p in pieces): continue
    item, offsets, at = stored(c).itemsize, [], 0
    for s in c.src:
      offsets.append(at)
      at += prod(static_shape("cat", s.shape))
    if any(o * item % CAT_ALIGN for o in offsets): continue
    for p, o in zip(pieces, offsets):
      if p is not None: placed[p] = (c, o)
    hosts.add(c)
  return [k for k in kernels if k.node not in hosts], placed
