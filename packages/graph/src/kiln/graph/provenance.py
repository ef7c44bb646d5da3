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


COMPUTE = ("ALU", "REDUCE", "GATHER", "CAT", "IOTA")  # node kinds that compute; a VIEW or CONST only says where values are read


def _rendered(kernel: Any) -> list[Any]:
  """The nodes a scheduled kernel (kernelize.Kernel) renders, in the order they were made (the model's order)."""
  return sorted({kernel.node, *kernel.rendered}, key=lambda n: n.id)


def kernel_origins(kernel: Any) -> list[Origin]:
  """The ONNX nodes a kernel computes, each once, in the model's order: the origins of the computing nodes it renders (a
  VIEW through which it reads another node's buffer is left out), or of the views where it only moves data (a copy)."""
  nodes = _rendered(kernel)
  computing = [n for n in nodes if n.op in COMPUTE and n.origin is not None]
  return list(dict.fromkeys(n.origin for n in (computing or nodes) if n.origin is not None))


def primary(kernel: Any) -> Origin | None:
  """The ONNX node a kernel's time is charged to in totals per operator type: the one whose reduction it computes (a Conv,
  MatMul or ReduceMean beside the elementwise ops fused around it), else the first it computes (the op whose epilogue
  the rest is), else the one that made what it writes."""
  nodes = _rendered(kernel)
  for ops in (("REDUCE",), COMPUTE):
    if (o := next((n.origin for n in nodes if n.op in ops and n.origin is not None), None)) is not None: return o  # type: ignore[no-any-return]
  return kernel.node.origin if kernel.node.origin is not None else next((n.origin for n in nodes if n.origin is not None), None)
