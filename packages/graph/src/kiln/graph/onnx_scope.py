"""Subgraphs of an ONNX model (If's branches, Loop's and Scan's bodies): the scope a subgraph's nodes are converted in,
the outer names it reads, and the limits of onnx_limits applied to every subgraph before a node is converted.

A subgraph sees every value of the scopes around it (ONNX outer-scope references): its `Scope` is a dict of its own
values whose misses fall through to the enclosing scope. Errors inside a subgraph name the path to the node, e.g.
`node If_3 > then_branch > node Add_1 (Add, opset 17): ...`: `Ctx.path` is that prefix while the subgraph converts.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kiln.graph import onnx_limits as lim
from kiln.graph.lazy import ONNXError
from kiln.graph.onnx_external import Tensors
from kiln.graph.onnx_ops import Value

if TYPE_CHECKING:
  from kiln.graph.flow_program import Body

MAX_GRAPH_NESTING = 32  # subgraphs inside subgraphs (the walks here and the conversion recurse once per level)


class Scope(dict[str, Value]):
  """A subgraph's values: its own (inputs, initializers, node outputs), then, for a name it does not define, the enclosing
  scope's (an outer-scope reference)."""

  def __init__(self, parent: dict[str, Value] | None = None):
    super().__init__()
    self.parent = parent

  def __missing__(self, name: str) -> Value:
    if self.parent is None: raise KeyError(name)
    return self.parent[name]

  def __contains__(self, name: object) -> bool:
    return dict.__contains__(self, name) or (self.parent is not None and name in self.parent)

  def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
    return self[name] if name in self else default


@dataclass
class Ctx:
  """What converting one model shares across its (sub)graphs: the onnx module, opsets, stored tensors, load budget; the
  converter of a node list (onnx.py's); the path prefix of node names; and the body that records run-time branches (the
  program scope: the main graph or the branch being converted; an unrolled loop body records into the scope around it)."""
  onnx: Any
  opset: int
  stored: Tensors
  budget: lim.LoadBudget
  convert: Callable[[Any, dict[str, Value], Ctx], None]  # convert(graph, env, ctx): every node of graph, outputs into env
  body: Body
  path: str = ""
  depth: int = 0
  cuts: bool = True  # whether the main graph can be cut here: in it, or in a branch of an If known at load (specialise.py)
  loops: dict[int, Any] = field(default_factory=dict)  # run-time loops with scan outputs made, by id of their NodeProto: a
  # continuation converting the Loop again reads the slots the prefix's loop filled (onnx_ops_flow._scan_loop)
  ml_opset: int = 1  # the ai.onnx.ml domain's opset: its nodes' (OnnxNode.opset), as `opset` is the default domain's

  def sub(self, where: str, body: Body | None = None, folded: bool = False) -> Ctx:
    """The context of a subgraph one level deeper: `where` is its node's path-qualified name and attribute ('If_3 > then_branch');
    folded: the branch an If known at load takes (the main graph may still be cut in it)."""
    if self.depth + 1 > MAX_GRAPH_NESTING:
      raise ONNXError(f"node {where}: subgraphs nest {self.depth + 1} deep, over MAX_GRAPH_NESTING = {MAX_GRAPH_NESTING}")
    return replace(self, path=f"{where} > node ", depth=self.depth + 1, body=self.body if body is None else body, cuts=self.cuts and folded)


def subgraphs(node: Any) -> Iterator[tuple[str, Any]]:
  """(attribute name, GraphProto) of every graph a node's attributes hold."""
  for a in node.attribute:
    if a.HasField("g"): yield a.name, a.g
    for g in a.graphs: yield a.name, g


def outer_names(graph: Any) -> set[str]:
  """The names a graph (and any subgraph in it) reads without defining them: references to the enclosing scopes."""
  defined = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {o for p in graph.node for o in p.output if o}
  used = {i for p in graph.node for i in p.input if i} | {o.name for o in graph.output}
  for p in graph.node:
    for _, g in subgraphs(p): used |= outer_names(g)
  return used - defined


def stored_values(graph: Any) -> Iterator[Any]:
  """The TensorProtos a graph stores as values, its subgraphs' too: initializers and Constant nodes' `value`."""
  yield from graph.initializer
  for p in graph.node:
    if p.op_type == "Constant": yield from (a.t for a in p.attribute if a.HasField("t"))
    for _, g in subgraphs(p): yield from stored_values(g)


class _AsModel:
  """A subgraph in the shape onnx_limits.check_model reads (its size is counted with the whole model's)."""
  def __init__(self, graph: Any): self.graph = graph
  def ByteSize(self) -> int: return 0


def check_subgraphs(onnx: Any, m: Any) -> None:
  """onnx_limits' checks on every subgraph (names, tensors, attributes, depth), their nodes counted with the main graph's
  against MAX_NODES, nested at most MAX_GRAPH_NESTING deep."""
  total = len(m.graph.node)

  def walk(graph: Any, depth: int, where: str) -> None:
    nonlocal total
    for p in graph.node:
      for attr, g in subgraphs(p):
        label = f"{where}node {p.name[:64] or '<' + p.op_type[:64] + '>'} > {attr[:64]}"
        if depth + 1 > MAX_GRAPH_NESTING:
          raise ONNXError(f"{label}: subgraphs nest {depth + 1} deep, over MAX_GRAPH_NESTING = {MAX_GRAPH_NESTING}")
        total += len(g.node)
        lim.limit("the number of nodes, every subgraph's counted", total, "MAX_NODES", lim.MAX_NODES)
        try: lim.check_model(onnx, _AsModel(g))
        except ONNXError as e: raise ONNXError(f"{label}: {e}") from None
        walk(g, depth + 1, f"{label} > ")
  walk(m.graph, 0, "")
