"""What an ONNX model declares, read off its ModelProto without compiling it: inputs and outputs (name, dims with
symbolic ones named, dtype), opsets, producer, the op census, and every node kiln would refuse (kiln.graph.onnx's check,
all of them at once). `kiln inspect` prints it; `kiln run --random` and `kiln bench` make feeds from the declared inputs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

Dim = int | str  # a size, or a symbolic dim's name: its dim_param, or INPUT:AXIS for one with no name (kiln.graph.onnx.load's key)


@dataclass(frozen=True)
class Declared:
  """A graph input or output as the model declares it. dtype is None for an element type numpy has no name for."""
  name: str
  dims: tuple[Dim, ...] | None  # None: the model declares no shape
  dtype: np.dtype | None
  elem_type: str  # ONNX's name for it (FLOAT, INT64, BFLOAT16, ...)

  def shown(self) -> str:
    dims = "?" if self.dims is None else "(" + ", ".join(map(str, self.dims)) + ("," if len(self.dims) == 1 else "") + ")"
    # numpy's name where it has one (float32, int64): what `kiln run`, the made-up feeds and Model.inputs say
    return f"{self.name}  {dims}  {self.dtype if self.dtype is not None else self.elem_type.lower()}"


def _declared(onnx: Any, vi: Any) -> Declared:
  tt = vi.type.tensor_type
  name = onnx.TensorProto.DataType.Name(tt.elem_type) if tt.elem_type in onnx.TensorProto.DataType.values() else str(tt.elem_type)
  try: dt: np.dtype | None = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
  except Exception: dt = None  # an element type onnx maps to no numpy type (UNDEFINED, a string): shown, never fed
  dims = None if not tt.HasField("shape") else tuple(
    int(d.dim_value) if d.HasField("dim_value") and d.dim_value >= 0 else (d.dim_param or f"{vi.name}:{i}") for i, d in enumerate(tt.shape.dim))
  return Declared(vi.name, dims, dt, name)


def inputs(onnx: Any, m: Any) -> list[Declared]:
  """The graph inputs a run is fed: those no initializer gives a value."""
  inits = {i.name for i in m.graph.initializer}
  return [_declared(onnx, vi) for vi in m.graph.input if vi.name not in inits]


def outputs(onnx: Any, m: Any) -> list[Declared]: return [_declared(onnx, vo) for vo in m.graph.output]


def opsets(m: Any) -> dict[str, int]:
  """Each imported operator set's version by domain ("" is ai.onnx's)."""
  return {o.domain or "ai.onnx": int(o.version) for o in m.opset_import}


def _nodes(g: Any) -> Iterator[Any]:
  """Every node of g and of the subgraphs its nodes hold (If's branches, Loop's and Scan's bodies)."""
  for n in g.node:
    yield n
    for a in n.attribute:
      if a.HasField("g"): yield from _nodes(a.g)
      for sub in a.graphs: yield from _nodes(sub)


def census(m: Any) -> Counter[str]:
  """Node count per operator type (a domain other than ai.onnx prefixes it), subgraphs included."""
  return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in _nodes(m.graph))


def refused(m: Any) -> list[str]:
  """Every node of the model's graph kiln would refuse at load (an operator, a domain or an attribute kiln lacks), each
  named: what kiln.graph.onnx.load raises, all of them. A subgraph's nodes are judged when they convert (at load)."""
  from kiln.graph.onnx import _unsupported  # the one home of the check load makes
  return _unsupported(m.graph, opsets(m).get("ai.onnx", 0), opsets(m).get("ai.onnx.ml", 1))


def gather_tables(m: Any) -> dict[str, int]:
  """For each graph input used directly as a Gather's indices into an initializer (a token embedding), the smallest
  size of the axis it indexes: ids below it are in range for every such Gather."""
  sizes = {i.name: list(i.dims) for i in m.graph.initializer}
  out: dict[str, int] = {}
  for n in _nodes(m.graph):
    if n.op_type != "Gather" or len(n.input) < 2 or n.input[0] not in sizes: continue
    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
    dims = sizes[n.input[0]]
    if not -len(dims) <= axis < len(dims): continue  # load refuses it, naming the node
    out[n.input[1]] = min(out.get(n.input[1], dims[axis]), dims[axis])
  return out
