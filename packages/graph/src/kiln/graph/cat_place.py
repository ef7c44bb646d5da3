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
are on byte ranges): they no longer overlap on threads, which a split kernel did not need.

A piece that does not qualify (no kernel's own output: a blocked conv's product read through its NCHW view, a model
input; or a dense block's features, placed in the first concatenation) is copied into its place by a kernel of its own,
where that pays (_copies_pay): a concatenation's kernel computes every piece for every element and selects, a copy moves
each element once. The same holds one step further out: a kernel that computes elementwise ops over a concatenation at
its own index (DenseNet's batch norm and ReLU over each dense block's concatenation) runs as a kernel per piece, each
over its slab of the result, its chain rebuilt over the piece and its other operands sliced (_slabs).

| before                                                     | after                                                      |
|------------------------------------------------------------|------------------------------------------------------------|
| Y = relu(cat(P_0, ..., P_n) * s + b): a kernel, n selects an element | Y's slab i = relu(P_i * s[i] + b[i]): a kernel each, no select |

A dense block reads many such concatenations, each a prefix of the next (layer l's batch norm over the block's input and
features 1..l): slabs took a kernel per piece per layer, a quadratic number of small kernels. Where two or more
concatenations read that way are prefixes of one largest one, they share its buffer (_share): each piece is stored there
once, each smaller concatenation is a view of its first channels of every image, and each batch norm is one kernel over
its view (with more than one image the view is strided: its loads are mapped as a spread piece's stores are).

| before                                                     | after                                                      |
|------------------------------------------------------------|------------------------------------------------------------|
| layer l: l + 1 slab kernels, each piece's slab of Y_l      | layer l: one kernel, Y_l = relu(C[:, :c_l] * s + b)        |
| pieces: stored in their own buffers, read by every slab    | pieces: stored once in C's buffer (a copy where no kernel's own output) |"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from math import prod
from typing import NamedTuple, TypeGuard

from kiln.codegen.choose.heuristic import SELECT_RUN, SELECT_UNROLL
from kiln.graph.dims import is_static, max_numel, static_shape
from kiln.graph.kernelize import Kernel, Kernelizer
from kiln.graph.lazy import Node
from kiln.ir.dtype import DType, PtrDType
from kiln.ir.kernels import Dim
from kiln.ir.uop import Ops, UOp

PLACE_CATS = True
CAT_ALIGN = 64  # bytes: a cache line, every CPU vector and CUDA's 16-byte loads
COPY_PIECES = True  # a piece that is no kernel's output gets a copy kernel into its place where that pays; False: never
COPY_START = 1024  # elements a copy moves in the time a kernel takes to start (dispatch, the split)
SHARE_CATS = True  # concatenations that are prefixes of one another (read by elementwise kernels, or realized) share one buffer (_share)


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
  where it has more than one), a piece that is no kernel's own output copied there by a kernel of its own where that
  pays (_copies_pay), a kernel that selects among a concatenation's pieces at its own index computed piece by piece
  (_slabs), and where each placed piece goes."""
  if not PLACE_CATS: return list(kernels), {}
  by_node = {k.node: k for k in kernels}
  made = set(by_node)
  readers: dict[Node, set[Node]] = {}
  for k in kernels:
    for s in k.slots[1:]: readers.setdefault(s, set()).add(k.node)
  placed: Placement = {}
  hosts: dict[Node, list[Kernel]] = {}  # a node filled in place -> the kernels that take its kernel's place
  spread: dict[Node, UOp] = {}
  if COPY_PIECES and SHARE_CATS: _share(kernels, outputs, made, readers, placed, hosts, spread, stored)
  for k in kernels:
    n = k.node
    if n in outputs or n in placed or n in hosts or not is_static(n.shape): continue
    c = n if n.op == "CAT" else _selected_cat(n, k) if COPY_PIECES and _elementwise(n) else None
    if c is None: continue
    shape = static_shape("cat", n.shape)
    places = _places(n, c.src, c.arg, prod(shape[:c.arg]), prod(shape[c.arg:]))
    item = stored(n).itemsize
    if any(pl.at * item % CAT_ALIGN for pl in places) or places[0].rows > 1 and places[0].stride * item % CAT_ALIGN: continue
    pays = COPY_PIECES and _copies_pay(c, shape)
    fills = _pieces(c, places, pays, made, by_node, outputs, placed, hosts, readers, stored) if c is n else \
      _slabs(n, c, k, places, made, stored) if pays else None
    if fills is None: continue
    if places[0].rows > 1:
      asts = [_spread(f.ast, pl) for f, pl in fills]
      if any(a is None for a in asts): continue
      spread.update((f.node, a) for (f, _), a in zip(fills, asts) if a is not None)
    placed.update((f.node, pl) for f, pl in fills)
    hosts[n] = [f for f, _ in fills if f.node not in made]
  out: list[Kernel] = []
  for k in kernels:
    for f in hosts.get(k.node, [k]):
      out.append(dataclasses.replace(f, ast=spread[f.node]) if f.node in spread else f)
  return out, placed


def _places(n: Node, pieces: Sequence[Node], ax: int, rows: int, stride: int) -> list[Place]:
  """Where each of a concatenation's pieces along axis ax lies in the buffer of n (the concatenation, or a node of its
  shape computed from it): `rows` runs of its elements from ax on, one every `stride` elements."""
  at, out = 0, []
  for s in pieces:
    run = prod(static_shape("cat", s.shape[ax:]))
    out.append(Place(n, at, rows, run, stride))
    at += run
  return out


def _stores_in_place(p: Node | None, into: Node, fills: list[tuple[Kernel, Place]], outputs: set[Node], placed: Placement,
                     hosts: dict[Node, list[Kernel]], stored: Callable[[Node], DType]) -> TypeGuard[Node]:
  """Whether piece p (a kernel's node, or None) may have its kernel store straight into `into`'s buffer: no output, not
  placed elsewhere nor replaced, of the buffer's dtype, and not a piece of it already (one kernel, one place)."""
  return p is not None and p not in outputs and p not in placed and p not in hosts and stored(p) == stored(into) \
    and all(p is not f.node for f, _ in fills)


def _share(kernels: Sequence[Kernel], outputs: set[Node], made: set[Node], readers: dict[Node, set[Node]], placed: Placement,
           hosts: dict[Node, list[Kernel]], spread: dict[Node, UOp], stored: Callable[[Node], DType]) -> None:
  """Concatenations whose pieces are a prefix of a larger one's, each read by an elementwise kernel at its own index (a
  dense block: every layer's batch norm and ReLU over the block's input and the features so far) or a kernel of its own,
  all live in the largest one's buffer: its pieces are placed there once (a copy kernel for one that is no kernel's own
  output), each smaller concatenation is a view of its first channels, and each reader is one kernel over its view, where
  slabs (_slabs) took a kernel per piece per reader and a concatenation's own kernel copied every earlier piece again.
  A concatenation of a concatenation along the same axis counts as its pieces (a block exported as a chain of two-piece
  concatenations). Fills placed, hosts and spread; a group whose views do not fold is left as it was."""
  over: dict[Node, tuple[Kernel, Node]] = {}  # a reader's node -> its kernel and the concatenation it selects from
  for k in kernels:
    n = k.node
    if n.op != "CAT" and n not in outputs and _elementwise(n) and (c := _selected_cat(n, k)) is not None and c not in outputs and _tail_static(c):
      over[n] = (k, c)
  cats = [c for _, c in over.values()] + [k.node for k in kernels if k.node.op == "CAT" and k.node not in outputs and _tail_static(k.node)]
  flat = {c: _flat(c) for c in dict.fromkeys(cats)}
  by_start: dict[tuple[int, Node], list[Node]] = {}
  for c, f in flat.items(): by_start.setdefault((c.arg, f[0]), []).append(c)
  groups: dict[Node, list[Node]] = {}  # the largest concatenation -> those that are prefixes of it (itself too)
  for same in by_start.values():
    for c in same:
      root = max((d for d in same if len(flat[d]) >= len(flat[c]) and flat[d][:len(flat[c])] == flat[c]), key=lambda d: len(flat[d]))
      groups.setdefault(root, []).append(c)
  by_node = {k.node: k for k in kernels}
  for root, members in groups.items():
    if len(members) > 1 and root not in placed and not any(c in hosts for c in members):
      _share_group(root, flat, set(members), over, outputs, made, by_node, readers, placed, hosts, spread, stored)


def _tail_static(c: Node) -> bool:
  """Whether c's shape is static from its axis on: the leading dims (a dynamic export's batch) may be symbolic, each
  image's run of the concatenation then at a static offset and stride, the buffer sized for their upper bounds."""
  return is_static(c.shape[c.arg:])


def _flat(c: Node) -> tuple[Node, ...]:
  """c's pieces, a concatenation along the same axis among them replaced by its own pieces."""
  return tuple(p for s in c.src for p in (_flat(s) if s.op == "CAT" and s.arg == c.arg else (s,)))


def _share_group(root: Node, flat: dict[Node, tuple[Node, ...]], members: set[Node], over: dict[Node, tuple[Kernel, Node]], outputs: set[Node],
                 made: set[Node], by_node: dict[Node, Kernel], readers: dict[Node, set[Node]], placed: Placement,
                 hosts: dict[Node, list[Kernel]], spread: dict[Node, UOp], stored: Callable[[Node], DType]) -> None:
  """root's buffer holding its pieces (stored in place, or copied there), its smaller members views of it and each
  member's reader one kernel over its view; nothing changes where a piece's or a view's index would keep a division."""
  ax, item, pieces = root.arg, stored(root).itemsize, flat[root]
  if not all(is_static(s.shape[ax:]) for s in pieces): return
  rows, stride = max_numel(root.shape[:ax]), prod(static_shape("cat", root.shape[ax:]))  # rows at a symbolic batch's upper bound
  places = _places(root, pieces, ax, rows, stride)
  if len(set(pieces)) < len(pieces) or any(stored(c) != stored(root) for c in members): return  # a piece twice: two places, one kernel
  if any(pl.at * item % CAT_ALIGN for pl in places) or rows > 1 and stride * item % CAT_ALIGN: return
  # the kernels that read a member, in kernel order: each elementwise reader, and each member's own kernel (which goes)
  users = [n for n in by_node if n in members or n in over and over[n][1] in members]
  using = set(users)
  if rows > 1 and any(not readers.get(c, set()) <= using for c in members if c in by_node and c is not root): return  # read as dense
  fills: list[tuple[Kernel, Place]] = []  # each piece's kernel (its own, or a copy) and its place
  copies: dict[Node, Kernel] = {}  # a piece that is no kernel's own output -> the kernel that copies it into its place
  for s, pl in zip(pieces, places):
    if pl.run == 0: continue
    p = _piece(s, made)
    if _stores_in_place(p, root, fills, outputs, placed, hosts, stored) and p not in members and (rows == 1 or readers.get(p, set()) <= using):
      fills.append((by_node[p], pl))
    else:
      copies[s] = _copy(s, root, made, stored)
      fills.append((copies[s], pl))
  asts: dict[Node, UOp] = {}
  for f, pl in fills if rows > 1 else ():
    if (a := _spread(f.ast, pl)) is None: return
    asts[f.node] = a
  views = {c: Place(root, 0, rows, prod(static_shape("cat", c.shape[ax:])), stride) for c in members if c is not root}
  readers_of: dict[Node, list[Kernel]] = {c: [] for c in members if c in by_node}  # a member's own kernel: none
  for n in users:
    if n in readers_of: continue
    c = over[n][1]
    rk = Kernelizer(n, made | {c}, stored).kernel()
    if c in views and rows > 1:
      if (a := _spread(rk.ast, views[c], rk.slots.index(c))) is None: return
      rk = dataclasses.replace(rk, ast=a)
    readers_of[n] = [rk]
  spread.update(asts)
  placed.update((f.node, pl) for f, pl in fills)
  placed.update(views)
  for n in users:  # each copy runs just before the first reader whose concatenation holds its piece
    hosts[n] = [copies.pop(s) for s in flat[over[n][1] if n in over else n] if s in copies] + readers_of[n]


def _pieces(c: Node, places: list[Place], copying: bool, made: set[Node], by_node: dict[Node, Kernel], outputs: set[Node],
            placed: Placement, hosts: dict[Node, list[Kernel]], readers: dict[Node, set[Node]],
            stored: Callable[[Node], DType]) -> list[tuple[Kernel, Place]] | None:
  """Each non-empty piece's kernel and its place: the kernel whose own output the piece is, where it may store there, else
  a copy where `copying` (copies pay); None where neither."""
  fills: list[tuple[Kernel, Place]] = []
  for s, pl in zip(c.src, places):
    p = _piece(s, made)
    if _stores_in_place(p, c, fills, outputs, placed, hosts, stored) and (pl.rows == 1 or readers.get(p, set()) == {c}):
      fills.append((by_node[p], pl))
    elif copying: fills.append((_copy(s, c, made, stored), pl))
    else: return None
  return [(f, pl) for f, pl in fills if pl.run > 0]  # an empty piece has nothing to write


def _selected_cat(n: Node, k: Kernel) -> Node | None:
  """A concatenation kernel k renders at n's own index, reached from n through elementwise ops of n's shape (DenseNet's
  batch norm and ReLU over a dense block's concatenation), else None: computed over one piece's slab at a time, each
  select of the concatenation folds to its piece."""
  seen, todo = {n}, [n]
  while todo:
    for s in todo.pop().src:
      if s in seen or s not in k.rendered or s.shape != n.shape: continue
      if s.op == "CAT": return s
      if _elementwise(s): seen.add(s); todo.append(s)
  return None


def _elementwise(x: Node) -> bool:
  """An ALU, or a reshape to the same shape (the copy a conv realizes its input as): what commutes with slicing."""
  return x.op == "ALU" or x.op == "VIEW" and x.arg == ("reshape", x.shape) and x.src[0].shape == x.shape


def _copies_pay(c: Node, shape: tuple[int, ...]) -> bool:
  """Whether computing a concatenation piece by piece, a kernel each, costs less than one kernel over all of it: that
  kernel's vector computes every piece for every element and selects (a select is not a branch), so a dense block's
  concatenation of 30 pieces loaded each element 30 times (DenseNet-121: a fifth of its time); a kernel a piece moves
  each element once but costs a kernel's start. Not along an axis the codegen unrolls whole (a Winograd transform's 16
  or 36 stacked sums), where each copy of its body folds to its own piece."""
  n, size = len(c.src), shape[c.arg]
  if size <= SELECT_UNROLL and size <= SELECT_RUN * n: return False
  return prod(shape) * (n - 1) >= n * COPY_START


def _copy(s: Node, c: Node, made: set[Node], stored: Callable[[Node], DType]) -> Kernel:
  """A kernel that computes piece s (reading what is realized, as the concatenation's kernel did) into a buffer of its own."""
  node = Node("VIEW", (s,), ("reshape", s.shape), s.shape, c.dtype, origin=c.origin)  # the Concat's work, in a profile
  return Kernelizer(node, made, stored).kernel()


def _slabs(n: Node, c: Node, k: Kernel, places: list[Place], made: set[Node], stored: Callable[[Node], DType]) -> list[tuple[Kernel, Place]] | None:
  """Kernels that compute n one piece of c at a time, each over its slab of c's axis, and their places: n's elementwise
  chain rebuilt over the piece, its other operands sliced to the slab (nothing left to select, so every slab of one
  shape is the same kernel to the cache); None where the chain holds something else of n's shape."""
  out, at = [], 0
  for s, pl in zip(c.src, places):
    if (piece := _rebuilt(n, {c: s}, k, at, c.arg, s.shape)) is None: return None
    if pl.run > 0: out.append((Kernelizer(piece, made, stored).kernel(), pl))
    at += static_shape("cat", s.shape)[c.arg]
  return out


def _rebuilt(x: Node, memo: dict[Node, Node], k: Kernel, at: int, ax: int, shape: tuple[Dim, ...]) -> Node | None:
  """x over the slab of `shape` at `at` along axis ax: the elementwise nodes k renders rebuilt over what memo maps their
  sources to (the concatenation: its piece), anything else of x's shape sliced; None where a source has another shape."""
  if (hit := memo.get(x)) is not None: return hit
  if _elementwise(x) and (x in k.rendered or x is k.node):
    srcs = [_rebuilt(y, memo, k, at, ax, shape) if y.shape == x.shape else None for y in x.src]
    if any(y is None for y in srcs): return None
    new = Node(x.op, tuple(y for y in srcs if y is not None), ("reshape", shape) if x.op == "VIEW" else x.arg, shape, x.dtype, origin=x.origin)
  else:
    new = Node("VIEW", (x,), ("shrink", tuple((at, 1) if a == ax else (0, 1) for a in range(len(x.shape)))), shape, x.dtype, origin=x.origin)
  memo[x] = new
  return new


def _spread(ast: UOp, pl: Place, slot: int = 0) -> UOp | None:
  """A kernel with its slot (0: its output, a piece; else a concatenation it reads in a shared buffer) a view of pl.span
  elements and element i at (i // run) * stride + i % run; None where the simplifier leaves a division or remainder the
  index did not have."""
  nodes = ast.toposort()
  g = next((u for u in nodes if u.op is Ops.DEFINE_GLOBAL and u.arg == slot), None)
  if g is None or not isinstance(g.dtype, PtrDType): return None
  wide = UOp.define_global(slot, g.dtype.base.ptr(pl.span))
  moved: dict[UOp, UOp] = {}
  for u in nodes:
    if u.op is Ops.INDEX and u.src[0] is g:  # its index and gate are the loops' and other slots' values, never this slot's
      i = u.src[1]
      j = (i // pl.run * pl.stride + i % pl.run).simplify()
      if _divisions(j) > _divisions(i): return None
      moved[u] = wide.index(j, *u.src[2:])
  return ast.substitute(moved)


def _divisions(u: UOp) -> int: return sum(x.op in (Ops.IDIV, Ops.MOD) for x in u.toposort())
