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
anything that is not a reshape or an elementwise op.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.graph.dims import is_static
from kiln.graph.lazy import Node, consumers, toposort

# reads of each source element per element of a view, where it is not the ratio of their sizes: a pad's added elements
# read nothing, so each source element is read once
_ONE_READ_VIEWS = frozenset({"pad", "reshape", "permute"})


def _is_product(n: Node) -> bool:
  """A realized reduction: a REDUCE marked realized, or a realized view of one (Tensor.contiguous of a conv's product; a
  Winograd conv's tiles put back in NCHW order and cropped: reshapes, a permute, a slice, whose copy takes the chain)."""
  if not n.realize or not is_static(n.shape): return False  # (a conv's product is static; symbolic reshapes are left alone)
  while n.op == "VIEW" and n.arg[0] in ("reshape", "permute", "shrink"): n = n.src[0]
  return n.op == "REDUCE"


def _chain(r: Node, readers: Mapping[Node, list[Node]], outputs: set[Node]) -> list[Node]:
  """The elementwise chain after r: each node the sole reader of the one before, ending on an elementwise op."""
  chain: list[Node] = []
  cur = r
  while cur not in outputs and len(rs := readers[cur]) == 1:
    p = rs[0]
    if p.realize or p in outputs or not (p.op == "ALU" or p.op == "VIEW" and p.arg[0] == "reshape"): break
    chain.append(p)
    cur = p
  while chain and chain[-1].op != "ALU": chain.pop()  # a trailing reshape stays a view of the buffer
  return chain


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


def _fused(r: Node, chain: Sequence[Node], new: Mapping[Node, Node]) -> Node:
  """The chain computed in r's shape over r's own computation (not its buffer), realized: r's kernel with the chain as its
  epilogue. new maps the original graph's nodes to the rewritten ones."""
  shape = r.shape
  prev, cur = Node(r.op, tuple(new[s] for s in r.src), r.arg, r.shape, r.dtype, origin=r.origin), r  # r, no longer realized
  for p in chain:
    if p.op == "ALU":
      src = tuple(prev if s is cur else _as_shape(new[s], shape) for s in p.src)
      prev = Node("ALU", src, p.arg, shape, p.dtype, origin=p.origin)
    cur = p
  return Node(prev.op, prev.src, prev.arg, shape, prev.dtype, realize=True, origin=prev.origin)


def fuse_epilogues(outputs: Sequence[Node]) -> dict[Node, Node]:
  """Each node of the graph of outputs -> its node in the rewritten graph (the table in the module's docstring)."""
  nodes = toposort(list(outputs))
  readers, outs = consumers(nodes), set(outputs)
  moves: dict[Node, tuple[Node, list[Node]]] = {}  # the chain's last node -> (the product, the chain)
  for r in nodes:
    if _is_product(r) and (chain := _chain(r, readers, outs)) and _reads_per_element(chain[-1], readers) >= 1:
      moves[chain[-1]] = (r, chain)
  new: dict[Node, Node] = {}
  for n in nodes:  # sources first, so a chain's operands are already rewritten when it is
    if n in moves:
      r, chain = moves[n]
      new[n] = _as_shape(_fused(r, chain, new), n.shape)
    else: new[n] = n if all(new[s] is s for s in n.src) else _rebuild(n, tuple(new[s] for s in n.src))
  return new
