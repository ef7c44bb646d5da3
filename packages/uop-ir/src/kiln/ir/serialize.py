"""The JSON graph form of a UOp: a flat, topologically ordered node list (no recursion either way), keeping `key`."""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.ir.dtype import DType, parse_dtype
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
    if len(a) != 1: raise SerializeError(f"an encoded arg has exactly one key (float, op, axis or tuple), got {a!r}")
    (k, v), = a.items()
    try:
      if k == "float" and isinstance(v, str): return math.nan if v == "nan" else float.fromhex(v)
      if k == "op" and isinstance(v, str): return Ops[v]
      if k == "axis" and isinstance(v, str): return AxisType[v]
      if k == "tuple" and isinstance(v, list): return tuple(_arg_in(x) for x in v)
    except (KeyError, ValueError): raise SerializeError(f"bad {k} arg {v!r}") from None
    raise SerializeError(f"unknown arg encoding {a!r}")
  if isinstance(a, list): raise SerializeError(f"lists are not UOp args: {a!r}")
  if isinstance(a, float): raise SerializeError(f"a float arg is written as {{'float': hex}}, got the bare number {a!r}")
  return a


def _check_const(dt: Any, v: Any) -> None:
  """A CONST's arg must have the Python type of its dtype, or the rebuilt node (and its key) would differ from the original."""
  if not isinstance(dt, DType) or dt.kind in "vp": raise SerializeError(f"a CONST cannot have dtype {dt}")
  ok = isinstance(v, bool) if dt.is_bool else (isinstance(v, int) and not isinstance(v, bool) and dt.min <= v <= dt.max) if dt.is_int \
    else isinstance(v, float) if dt.is_float else False
  if not ok: raise SerializeError(f"CONST of dtype {dt} cannot hold {v!r}")


def to_graph(root: UOp) -> UOpGraph:
  order = root.toposort()
  idx = {u: i for i, u in enumerate(order)}
  return UOpGraph(nodes=[UOpNode(op=u.op.name, dtype=str(u.dtype), src=[idx[s] for s in u.src], arg=_arg_out(u.arg)) for u in order])


def from_graph(g: UOpGraph) -> UOp:
  built: list[UOp] = []
  for i, n in enumerate(g.nodes):
    try:
      if any(not 0 <= s < i for s in n.src): raise SerializeError(f"a source is not an earlier node: {n.src}")
      if n.op not in Ops.__members__: raise SerializeError(f"unknown op {n.op!r}")
      op, dt, arg = Ops[n.op], parse_dtype(n.dtype), _arg_in(n.arg)
      if op is Ops.CONST: _check_const(dt, arg)
      built.append(UOp(op, dt, tuple(built[s] for s in n.src), arg))
    except SerializeError as e: raise SerializeError(f"node {i} ({n.op}): {e}") from None
    except (KilnError, ValueError, TypeError, KeyError) as e: raise SerializeError(f"node {i} ({n.op}): {e}") from e
  return built[-1]


def to_json(root: UOp) -> str: return to_graph(root).model_dump_json()


def from_json(s: str | bytes) -> UOp:
  try: g = UOpGraph.model_validate_json(s)
  except ValidationError as e: raise SerializeError(f"invalid UOp JSON graph: {e}") from e
  return from_graph(g)
