"""Epilogues of realized reductions: the elementwise chain after a conv's product moves into the product's own kernel.

A conv's product is realized in the matmul's loop order, (N, groups, O/groups, 1, P), and read through an NCHW view
(tensor.conv2d). The elementwise ops that follow it (bias, batch norm, relu) would otherwise be inlined into whatever
reads them: a max pool or a global mean then computes them per element it reads, with a broadcast load of the bias in
its inner loop. Computed in the product's kernel, they run once per element on registers the product already holds,
and the consumer reduces plain values. The move is worth it when the consumers read each element at least once
(a pool over a partition of the map, a second reader); a slice that reads a few elements keeps the chain itself.

The move is a rewrite of the graph before scheduling (a graph the caller holds is not changed). R is a realized
reduction of shape S (the product), and T the end of its chain: reshapes and elementwise ops, each the sole reader of
the one before.

| before                                       | after                                                                  |
|----------------------------------------------|------------------------------------------------------------------------|
| R realized; the chain inlined in T's readers | T' realized: the chain's ops over R's own computation in shape S, each other operand reshaped to S |
| T's readers read T                           | T's readers read T' reshaped to T's shape (index arithmetic, no copy)  |

A chain stops at a node with several readers, a realized node or a graph output (each needs its own value), and at
anything that is not a reshape, a permute or an elementwise op. Through a permute (a channels-last product, a blocked
depthwise conv, each read back as NCHW) the chain is still computed in R's layout: an operand from outside it (a batch
norm's scale, a residual input) is read through the chain's views undone, and T's readers read T' through them. A
product whose bias is added in its own layout before it is realized (R = the sum plus the bias) counts as one. A reader
that realized T's reshape (Tensor.contiguous: a depthwise conv realizes a computed input, read per tap) would now copy T'
in its own order: it reads T' through the reshape instead; one that realized a permute of it reads it in place too where
the permute keeps its last axis a run of T''s buffer (a blocked depthwise conv's 16 channels a position, from a
channels-last product). R may also be a realized copy: a realized view of a realized node or of a concatenation
(Winograd's output tiles cropped back to NCHW), whose kernel then computes the chain as it copies.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kiln.graph.dims import is_static, static_shape
from kiln.graph.lazy import Node, consumers, toposort
from kiln.ir.ops import Ops

# a realized reshape whose source became a reshape of a realized product is read in place, not copied (_copy_of_realized)
DROP_COPIES = True
# ... and so is a realized permute of one whose last axis stays contiguous in the realized buffer, at least MIN_RUN
# elements a run (a blocked depthwise conv's (N, C/16, H, W, 16) copy of a channels-last product: the lanes read 16
# channels in a row either way, and the copy was a kernel, a pass over the map and a buffer)
DROP_PERMUTED_COPIES = True
MIN_RUN = 8
MAX_LAYOUT_CHECK = 1 << 22  # elements whose index map is worked out to prove it (a load-time numpy pass)
# the chain after a product goes through permutes too (a channels-last product or a blocked depthwise conv read as NCHW),
# its operands read in the product's layout through the permutes undone; False: reshapes only
THROUGH_PERMUTES = True
# the chain after a realized copy of a realized node or a concatenation moves into the copy too (_is_product)
AFTER_COPIES = True
# ... and one of symbolic shape (a dynamic export's product, its batch folded into the rows: conv._folds, few_rows)
SYMBOLIC_PRODUCTS = True
# reads of each source element per element of a view, where it is not the ratio of their sizes: a pad's added elements
# read nothing, so each source element is read once
_ONE_READ_VIEWS = frozenset({"pad", "reshape", "permute"})


def _is_product(n: Node) -> bool:
  """A realized reduction: a REDUCE marked realized, or a realized view of one (Tensor.contiguous of a conv's product; a
  Winograd conv's tiles put back in NCHW order and cropped: reshapes, a permute, a slice, whose copy takes the chain)."""
  if not n.realize or not (is_static(n.shape) or SYMBOLIC_PRODUCTS): return False
  start = n
  while n.op == "VIEW" and n.arg[0] in ("reshape", "permute", "shrink"): n = n.src[0]
  # a realized copy (Winograd's output tiles, a concatenation the scheduler realizes, cropped back to NCHW by a kernel of
  # their own) takes the chain as a product does: its readers then read the bias and activation's result, not the crop
  if AFTER_COPIES and n is not start and (n.realize or n.op == "CAT"): return True
  # a product with its bias added in its own layout (a channels-last product, a blocked depthwise conv) is one as well
  if THROUGH_PERMUTES and n.op == "ALU" and n.arg is Ops.ADD:
    return any(m.op == "REDUCE" and not m.realize for m in map(_unreshaped, n.src))
  return n.op == "REDUCE"


def _unreshaped(n: Node) -> Node:
  """The node n reshapes (through reshapes computed inline: a sum without keepdims), else n."""
  while n.op == "VIEW" and not n.realize and n.arg[0] == "reshape": n = n.src[0]
  return n


def _chain(r: Node, readers: Mapping[Node, list[Node]], outputs: set[Node], order: Mapping[Node, int]) -> list[Node]:
  """The elementwise ops after r in graph order (`order`), ending on the one whose value leaves them (T): the nodes
  between r and T, every reader of r and of each of them but T among them. A chain where each node is the sole reader
  of the one before, or a diamond that reads a value twice (exact GELU x * (1 + erf(x / sqrt 2)) / 2, SiLU x * sigmoid x:
  a chain stopped at its fork, so a conv's GELU ran in its reader, Whisper's layer norm computing erf three times per
  element). The largest such T; none where r's readers branch to anything else."""
  if r in outputs: return []
  region = {r}  # r and the elementwise nodes it reaches through readers (a graph output needs its own value: not one)
  todo = [r]
  while todo:
    for p in readers[todo.pop()]:
      if p in region or p.realize or p in outputs or not (p.op == "ALU" or p.op == "VIEW" and _chain_view(p)): continue
      region.add(p)
      todo.append(p)
  for t in sorted((n for n in region if n.op == "ALU"), key=lambda n: -order[n]):
    between = _between(r, t, region)
    if all(set(readers[n]) <= between for n in between if n is not t): return sorted(between - {r}, key=lambda n: order[n])
  return []


def _chain_view(v: Node) -> bool: return v.arg[0] == "reshape" or THROUGH_PERMUTES and v.arg[0] == "permute"


def _between(r: Node, t: Node, region: set[Node]) -> set[Node]:
  """r, t and the nodes of region on the paths from r to t."""
  memo: dict[Node, bool] = {r: True}
  todo = [t]
  while todo:  # each node's sources first: a node reaches r when one of its sources in region does
    n = todo[-1]
    if n in memo: todo.pop(); continue
    if pending := [s for s in n.src if s in region and s not in memo]: todo += pending; continue
    memo[n] = any(memo.get(s, False) for s in n.src)
    todo.pop()
  return {n for n, ok in memo.items() if ok}


def _reads_per_element(n: Node, readers: Mapping[Node, list[Node]]) -> float:
  """How many times n's readers read each of its elements: 1 for an elementwise op or a reduction, and through views the
  ratio of the view's size to its source's (an expand reads each element many times, a slice some not at all)."""
  total = 0.0
  for c in readers[n]:
    if c.op != "VIEW" or c.realize: total += 1.0
    else:
      ratio = 1.0 if c.arg[0] in _ONE_READ_VIEWS else c.max_numel / max(n.max_numel, 1)
      total += ratio * _reads_per_element(c, readers)
  return total


def _as_shape(n: Node, shape: tuple) -> Node:
  return n if n.shape == shape else Node("VIEW", (n,), ("reshape", shape), shape, n.dtype, origin=n.origin)


def _rebuild(n: Node, src: tuple[Node, ...]) -> Node:
  return Node(n.op, src, n.arg, n.shape, n.dtype, n.realize, origin=n.origin)


def _views(r: Node, chain: Sequence[Node]) -> dict[Node, tuple[Node, ...]] | None:
  """Each chain node's views from r (reshapes and permutes, in order), r's own none; None where two sources of an
  elementwise op reach it through different views (their values are not laid out alike in r's shape)."""
  views: dict[Node, tuple[Node, ...]] = {r: ()}
  for p in chain:
    got = {views[s] for s in p.src if s in views}
    if len(got) != 1: return None
    views[p] = next(iter(got)) + ((p,) if p.op == "VIEW" else ())
  return views


def _back(n: Node, views: tuple[Node, ...]) -> Node:
  """n (in the shape the views end in) as the same elements in the shape they start from: each view undone, last first."""
  if not any(v.arg[0] == "permute" for v in views): return _as_shape(n, views[0].src[0].shape) if views else n
  for v in reversed(views):
    src = v.src[0]
    if v.arg[0] == "permute":
      inv = tuple(sorted(range(len(v.arg[1])), key=lambda a: v.arg[1][a]))
      n = Node("VIEW", (n,), ("permute", inv), src.shape, n.dtype, origin=n.origin)
    else: n = _as_shape(n, src.shape)
  return n


def _forward(n: Node, views: tuple[Node, ...]) -> Node:
  """n (in r's shape) through the views, as the chain's end reads it."""
  for v in views: n = Node("VIEW", (n,), v.arg, v.shape, n.dtype, origin=n.origin)
  return n


def _fused(r: Node, chain: Sequence[Node], new: Mapping[Node, Node], views: Mapping[Node, tuple[Node, ...]]) -> Node:
  """The chain computed in r's shape over r's own computation (not its buffer), realized: r's kernel with the chain as its
  epilogue. new maps the original graph's nodes to the rewritten ones; the chain's views are its values in r's shape, and
  an operand from outside the chain is read in r's shape through the chain's views undone."""
  shape = r.shape
  made = {r: Node(r.op, tuple(new[s] for s in r.src), r.arg, r.shape, r.dtype, origin=r.origin)}  # r, no longer realized
  for p in chain:
    if p.op == "ALU":
      src = tuple(made[s] if s in made else _back(new[s], views[p]) for s in p.src)
      made[p] = Node("ALU", src, p.arg, shape, p.dtype, origin=p.origin)
    else: made[p] = made[p.src[0]]
  last = made[chain[-1]]
  return Node(last.op, last.src, last.arg, shape, last.dtype, realize=True, origin=last.origin)


def fuse_epilogues(outputs: Sequence[Node]) -> dict[Node, Node]:
  """Each node of the graph of outputs -> its node in the rewritten graph (the table in the module's docstring)."""
  nodes = toposort(list(outputs))
  readers, outs, order = consumers(nodes), set(outputs), {n: i for i, n in enumerate(nodes)}
  moves: dict[Node, tuple[Node, list[Node]]] = {}  # the chain's last node -> (the product, the chain)
  paths: dict[Node, dict[Node, tuple[Node, ...]]] = {}
  for r in nodes:
    if _is_product(r) and (chain := _chain(r, readers, outs, order)) and _reads_per_element(chain[-1], readers) >= 1:
      if (views := _views(r, chain)) is None: continue
      moves[chain[-1]], paths[chain[-1]] = (r, chain), views
  new: dict[Node, Node] = {}
  for n in nodes:  # sources first, so a chain's operands are already rewritten when it is
    if n in moves:
      r, chain = moves[n]
      done = _fused(r, chain, new, paths[n])
      new[n] = _forward(done, paths[n][n]) if any(v.arg[0] == "permute" for v in paths[n][n]) else _as_shape(done, n.shape)
    elif all(new[s] is s for s in n.src): new[n] = n
    elif n not in outs and _copy_of_realized(n, new[n.src[0]]):
      new[n] = Node("VIEW", (new[n.src[0]],), n.arg, n.shape, n.dtype, origin=n.origin)  # the same reshape, inline
    else: new[n] = _rebuild(n, tuple(new[s] for s in n.src))
  return new


def _copy_of_realized(n: Node, src: Node) -> bool:
  """Whether n realizes a view (Tensor.contiguous) whose source, rewritten, is now reshapes of a realized node: a conv
  realizes its computed input before reading it per tap, and once that input's chain moved into its product the copy
  would copy the product's buffer in the same order. Read through the reshape instead, it is one kernel fewer. A view
  through permutes is read in place where its last axis is a run of the buffer (_runs_contiguous)."""
  if not (DROP_COPIES and n.realize and n.op == "VIEW" and n.arg[0] in ("reshape", "permute")): return False
  views = [n]
  while src.op == "VIEW" and not src.realize and src.arg[0] in ("reshape", "permute"): views, src = [src, *views], src.src[0]
  if not src.realize: return False
  if all(v.arg[0] == "reshape" for v in views): return True
  return DROP_PERMUTED_COPIES and _runs_contiguous(src, views)


def _runs_contiguous(buf: Node, views: list[Node]) -> bool:
  """Whether the last axis of views' last shape, read through `views` (reshapes and permutes, outermost last) from buf's
  buffer, is at least MIN_RUN elements that lie next to each other there: each vector of the reader is one load."""
  if not (is_static(buf.shape) and all(is_static(v.shape) for v in views)) or not views[-1].shape: return False
  if static_shape("view", views[-1].shape)[-1] < MIN_RUN or buf.numel > MAX_LAYOUT_CHECK: return False
  idx = np.arange(buf.numel, dtype=np.int64).reshape(static_shape("view", buf.shape))
  for v in views: idx = idx.reshape(static_shape("view", v.shape)) if v.arg[0] == "reshape" else idx.transpose(v.arg[1])
  return bool((np.diff(idx, axis=-1) == 1).all())
