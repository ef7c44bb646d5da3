"""The JSON graph form of a UOp: a flat, topologically ordered node list (no recursion either way), keeping `key`."""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.ir.dtype import parse_dtype
from kiln.ir.errors import KilnError, SerializeError
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp


class UOpNode(BaseModel):
  model_config = ConfigDict(frozen=True, extra="forbid")
  op: str
  dtype: str
  src: list[int] = Field(default_factory=list)
  arg: Any = None


class UOpGraph(BaseModel):
  """Nodes in topological order; `src` entries index earlier nodes; the last node is the root."""
  model_config = ConfigDict(frozen=True, extra="forbid")
  nodes: list[UOpNode] = Field(min_length=1)


def _arg_out(a: Any) -> Any:
  if isinstance(a, float): return {"float": "nan" if math.isnan(a) else float.hex(a)}
  if isinstance(a, Ops): return {"op": a.name}
  if isinstance(a, AxisType): return {"axis": a.name}
  if isinstance(a, tuple): return {"tuple": [_arg_out(x) for x in a]}
  return a


def _arg_in(a: Any) -> Any:
  if isinstance(a, dict):
    if "float" in a: return math.nan if a["float"] == "nan" else float.fromhex(a["float"])
    if "op" in a: return Ops[a["op"]]
    if "axis" in a: return AxisType[a["axis"]]
    if "tuple" in a: return tuple(_arg_in(x) for x in a["tuple"])
    raise SerializeError(f"unknown arg encoding {a!r}")
  if isinstance(a, list): raise SerializeError(f"lists are not UOp args: {a!r}")
  return a


def to_graph(root: UOp) -> UOpGraph:
  order = root.toposort()
  idx = {u: i for i, u in enumerate(order)}
  return UOpGraph(nodes=[UOpNode(op=u.op.name, dtype=str(u.dtype), src=[idx[s] for s in u.src], arg=_arg_out(u.arg)) for u in order])


def from_graph(g: UOpGraph) -> UOp:
  built: list[UOp] = []
  for i, n in enumerate(g.nodes):
    try:
      if any(not 0 <= s < i for s in n.src): raise SerializeError(f"node {i} ({n.op}) refers to a source that is not an earlier node: {n.src}")
      built.append(UOp(Ops[n.op], parse_dtype(n.dtype), tuple(built[s] for s in n.src), _arg_in(n.arg)))
    except KeyError: raise SerializeError(f"node {i}: unknown op {n.op!r}") from None
    except KilnError as e:
      if isinstance(e, SerializeError): raise
      raise SerializeError(f"node {i} ({n.op}): {e}") from e
  return built[-1]


def to_json(root: UOp) -> str: return to_graph(root).model_dump_json()


def from_json(s: str | bytes) -> UOp:
  try: g = UOpGraph.model_validate_json(s)
  except ValidationError as e: raise SerializeError(f"invalid UOp JSON graph: {e}") from e
  return from_graph(g)
