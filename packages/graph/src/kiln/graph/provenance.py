"""Which ONNX nodes a kernel computes: every graph Node remembers the ONNX node whose conversion made it (`Node.origin`, an
Origin), and a kernel covers the origins of the nodes it renders.

The ONNX converter sets the current origin around each node's conversion (`made_by`); a Node takes it when it is made, so
no Tensor op has to pass it on. A node rebuilt by a graph rewrite (epilogue.py, a program's substitution) keeps its
source's origin. Nodes made outside a conversion (a Tensor graph built by hand, the run-time index checks) have none.
Provenance never reaches the kernel's AST: the kernels and their cache keys are the same with or without it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple


class Origin(NamedTuple):
  """An ONNX node: its name (with the path of the subgraph it sits in) and its operator type."""
  name: str
  op_type: str


def of_node(path: str, proto: Any) -> Origin:
  """An ONNX NodeProto's origin; a node with no name is named by its operator and first output ('<Relu y>'), unique in
  its graph as an output name is."""
  out = next((o for o in proto.output if o), "")
  return Origin(path + (proto.name or f"<{proto.op_type} {out}>"), proto.op_type)


_current: ContextVar[Origin | None] = ContextVar("kiln_graph_origin", default=None)


def current() -> Origin | None:
  """The origin a Node made now takes (Node's default)."""
  return _current.get()


@contextmanager
def made_by(origin: Origin) -> Iterator[None]:
  """Nodes made inside come from `origin` (a nested conversion, an If's branch, sets its own)."""
  token = _current.set(origin)
  try: yield
  finally: _current.reset(token)


def kernel_origins(kernel: Any) -> list[Origin]:
  """The ONNX nodes a scheduled kernel (kernelize.Kernel) computes: the origins of the nodes it renders, each once, in the
  order the nodes were made (the model's order)."""
  nodes = sorted({kernel.node, *kernel.rendered}, key=lambda n: n.id)
  return list(dict.fromkeys(n.origin for n in nodes if n.origin is not None))


def primary(kernel: Any) -> Origin | None:
  """The ONNX node a kernel's time is charged to in totals per operator type: the one whose reduction it computes (a Conv,
  MatMul or ReduceMean beside the elementwise ops fused around it), else the one that made the node it writes."""
  nodes = sorted({kernel.node, *kernel.rendered}, key=lambda n: n.id)
  red = next((n.origin for n in nodes if n.op == "REDUCE" and n.origin is not None), None)
  if red is not None: return red  # type: ignore[no-any-return]
  if kernel.node.origin is not None: return kernel.node.origin  # type: ignore[no-any-return]
  return next((n.origin for n in reversed(nodes) if n.origin is not None), None)
