"""The JSON graph form of a UOp: a flat, topologically ordered node list (no recursion either way), keeping `key`.

A document is untrusted input (a disk-cache entry, a file a user hands kiln). Its limits, each refused with a
DocumentLimitError (a SerializeError) naming the limit and the value, before the nodes it describes are built:
  MAX_DOCUMENT_BYTES   32 MiB   the JSON text (a node is ~50-160 bytes: room for MAX_NODES)
  MAX_NODES            200,000  nodes (measured: 200,000 load in ~4 s and ~300 MB; real kernel ASTs have hundreds to thousands)
  MAX_SOURCES          4,096    sources of one node (a SINK's stores, a REDUCE's ranges, a vector's lanes)
  MAX_DEPTH            50,000   the longest source chain (every walk in kiln.ir is iterative: the limit bounds work, not
                                recursion; the tests round-trip 20,000 and compile 10,000; 100,000 compiled in ~45 s)
  MAX_STRING_CHARS     1,024    a string arg (kernel and variable names) and a dtype name's length
  MAX_ARG_ITEMS        64       values in one arg, tuples included, nested at most MAX_ARG_DEPTH (8) deep
  MAX_SLOTS            4,096    DEFINE_GLOBAL slots 0..4095 (a CUDA launch takes at most 4 KiB of parameters)
  MAX_BUFFER_BYTES     2**47    a pointer dtype's size in bytes (the x86-64/AArch64 user address space: no larger buffer
                                can exist), so element counts are at most 2**47 too; 2**62 elements is refused unallocated
  MAX_VECTOR_WIDTH     1,024    lanes of a vector dtype
  ints                          every int arg lies in [-2**63, 2**64): int64 or uint64; a CONST and a DEFINE_VAR's bounds fit
                                their own dtype
Malformed documents (bad JSON, NaN/Infinity tokens, duplicate keys, wrong types, sources that are not earlier nodes,
unknown ops or dtypes) are SerializeErrors too.
"""
from __future__ import annotations

import json
import math
import struct
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.ir.dtype import DType, PtrDType, parse_dtype
from kiln.ir.errors import KilnError, SerializeError
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp, nan_text

MAX_DOCUMENT_BYTES = 32 << 20
MAX_NODES = 200_000
MAX_DEPTH = 50_000
MAX_SOURCES = 4096
MAX_STRING_CHARS = 1024
MAX_ARG_ITEMS = 64
MAX_ARG_DEPTH = 8
MAX_SLOTS = 4096
MAX_BUFFER_BYTES = 1 << 47
MAX_VECTOR_WIDTH = 1024


class DocumentLimitError(SerializeError):
  """A document exceeds one of the limits above; `limit` names it, `value` is what the document had."""

  def __init__(self, what: str, value: int, limit: str, maximum: int):
    self.what, self.limit, self.value, self.maximum = what, limit, value, maximum
    super().__init__(f"{what} is {value}, over {limit} = {maximum}")


def check_limit(what: str, value: int, limit: str, maximum: int) -> None:
  if value > maximum: raise DocumentLimitError(what, value, limit, maximum)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out = dict(pairs)
  if len(out) != len(pairs):
    dup = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)[:5]
    raise SerializeError(f"duplicate keys {dup} in one JSON object (parsers disagree on which one counts)")
  return out


def _short(x: Any, n: int = 200) -> str:
  """repr of a piece of an untrusted document, clipped: an error message must not carry megabytes of it."""
  r = repr(x)
  return r if len(r) <= n else f"{r[:n]}... ({len(r)} characters)"


def _no_constant(tok: str) -> Any: raise SerializeError(f"{tok} is not JSON (write a float arg as {{'float': hex}})")


def load_json_document(s: str | bytes | bytearray, max_bytes: int, limit: str, what: str) -> Any:
  """Strict JSON of at most max_bytes (the limit's name is `limit`): no NaN/Infinity tokens, no duplicate keys, nesting
  within the parser's recursion limit. Every failure is a SerializeError naming `what`."""
  if not isinstance(s, str | bytes | bytearray): raise SerializeError(f"{what} must be str or bytes, got {type(s).__name__}")
  check_limit(f"{what}: the document's size in bytes", len(s), limit, max_bytes)  # a str counts characters: at least a byte each
  try: return json.loads(s, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
  except SerializeError as e: raise SerializeError(f"{what}: {e}") from None
  except RecursionError: raise SerializeError(f"{what}: JSON nested too deeply") from None
  except (ValueError, TypeError) as e: raise SerializeError(f"{what}: invalid JSON: {e}") from None  # UnicodeDecodeError is a ValueError


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


def _nan_value(v: str) -> float:
  if v == "nan": return math.nan
  bits = int(v[4:], 16) if v.startswith("nan:") and len(v) == 20 else -1
  if not 0 <= bits < 1 << 64 or (bits >> 52) & 0x7FF != 0x7FF or not bits & ((1 << 52) - 1): raise ValueError(f"not a NaN: {v!r}")
  return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def _arg_out(a: Any) -> Any:
  if isinstance(a, float): return {"float": nan_text(a) if math.isnan(a) else float.hex(a)}
  if isinstance(a, Ops): return {"op": a.name}
  if isinstance(a, AxisType): return {"axis": a.name}
  if isinstance(a, tuple): return {"tuple": [_arg_out(x) for x in a]}
  return a


def _check_arg(a: Any) -> None:
  """Sizes of an encoded arg before it is decoded: strings, ints, items and nesting."""
  stack, items = [(a, 0)], 0
  while stack:
    x, depth = stack.pop()
    items += 1
    check_limit("an arg's number of values", items, "MAX_ARG_ITEMS", MAX_ARG_ITEMS)
    check_limit("an arg's nesting depth", depth, "MAX_ARG_DEPTH", MAX_ARG_DEPTH)
    if isinstance(x, str): check_limit("a string arg's length", len(x), "MAX_STRING_CHARS", MAX_STRING_CHARS)
    elif isinstance(x, int) and not isinstance(x, bool) and not -(1 << 63) <= x < (1 << 64):
      raise SerializeError(f"int arg {_short(x)} fits neither int64 nor uint64")
    elif isinstance(x, dict | list): stack.extend((y, depth + 1) for y in ([*x.keys(), *x.values()] if isinstance(x, dict) else x))


def _check_dtype(dt: DType) -> None:
  if isinstance(dt, PtrDType):
    check_limit(f"a {dt.base} buffer's size in bytes", dt.size * dt.base.nbytes, "MAX_BUFFER_BYTES", MAX_BUFFER_BYTES)
  check_limit(f"the vector width of {dt}", dt.count, "MAX_VECTOR_WIDTH", MAX_VECTOR_WIDTH)


def _check_node_arg(op: Ops, dt: DType, arg: Any) -> None:
  """What an op's arg means, where a wrong one would reach code that trusts it."""
  if op is Ops.CONST: _check_const(dt, arg)
  elif op is Ops.DEFINE_GLOBAL:
    if isinstance(arg, bool) or not isinstance(arg, int) or arg < 0: raise SerializeError(f"a DEFINE_GLOBAL slot is an int >= 0, got {arg!r}")
    check_limit("the DEFINE_GLOBAL slot", arg + 1, "MAX_SLOTS", MAX_SLOTS)
  elif op is Ops.DEFINE_VAR and isinstance(arg, tuple) and len(arg) == 3 and dt.kind in "iu" and dt.count == 1:
    if any(isinstance(b, bool) or not isinstance(b, int) or not dt.min <= b <= dt.max for b in arg[1:]):
      raise SerializeError(f"variable {arg[0]!r} bounds [{arg[1]!r}, {arg[2]!r}] are not ints that fit {dt}")


def _arg_in(a: Any) -> Any:
  if isinstance(a, dict):
    if len(a) != 1: raise SerializeError(f"an encoded arg has exactly one key (float, op, axis or tuple), got {_short(a)}")
    (k, v), = a.items()
    try:
      if k == "float" and isinstance(v, str): return _nan_value(v) if v.startswith("nan") else float.fromhex(v)
      if k == "op" and isinstance(v, str): return Ops[v]
      if k == "axis" and isinstance(v, str): return AxisType[v]
      if k == "tuple" and isinstance(v, list): return tuple(_arg_in(x) for x in v)
    except (KeyError, ValueError): raise SerializeError(f"bad {k} arg {_short(v)}") from None
    raise SerializeError(f"unknown arg encoding {_short(a)}")
  if isinstance(a, list): raise SerializeError(f"lists are not UOp args: {_short(a)}")
  if isinstance(a, float): raise SerializeError(f"a float arg is written as {{'float': hex}}, got the bare number {a!r}")
  return a


def _check_const(dt: Any, v: Any) -> None:
  """A CONST's arg must have the Python type of its dtype, or the rebuilt node (and its key) would differ from the original."""
  if not isinstance(dt, DType) or dt.kind in "vp": raise SerializeError(f"a CONST cannot have dtype {dt}")
  ok = isinstance(v, bool) if dt.is_bool else (isinstance(v, int) and not isinstance(v, bool) and dt.min <= v <= dt.max) if dt.is_int \
    else isinstance(v, float) if dt.is_float else False
  if not ok: raise SerializeError(f"CONST of dtype {dt} cannot hold {_short(v)}")


def to_graph(root: UOp) -> UOpGraph:
  order = root.toposort()
  idx = {u: i for i, u in enumerate(order)}
  return UOpGraph(nodes=[UOpNode(op=u.op.name, dtype=str(u.dtype), src=[idx[s] for s in u.src], arg=_arg_out(u.arg)) for u in order])


def from_graph(g: UOpGraph) -> UOp:
  """The root of a JSON graph, each node checked against the document limits before it is built."""
  check_limit("the number of nodes", len(g.nodes), "MAX_NODES", MAX_NODES)
  built: list[UOp] = []
  depth: list[int] = []
  for i, n in enumerate(g.nodes):
    try:
      check_limit("the number of sources", len(n.src), "MAX_SOURCES", MAX_SOURCES)
      if any(not 0 <= s < i for s in n.src): raise SerializeError(f"a source is not an earlier node: {_short(n.src)}")
      depth.append(1 + max((depth[s] for s in n.src), default=0))
      check_limit("the graph's depth", depth[-1], "MAX_DEPTH", MAX_DEPTH)
      if n.op not in Ops.__members__: raise SerializeError(f"unknown op {n.op!r}")
      check_limit("the dtype name's length", len(n.dtype), "MAX_STRING_CHARS", MAX_STRING_CHARS)
      _check_arg(n.arg)
      op, dt, arg = Ops[n.op], parse_dtype(n.dtype), _arg_in(n.arg)
      _check_dtype(dt)
      _check_node_arg(op, dt, arg)
      built.append(UOp(op, dt, tuple(built[s] for s in n.src), arg))
    except DocumentLimitError as e: raise DocumentLimitError(f"node {i} ({n.op}): {e.what}", e.value, e.limit, e.maximum) from None
    except SerializeError as e: raise SerializeError(f"node {i} ({n.op}): {e}") from None
    except (KilnError, ValueError, TypeError, KeyError) as e: raise SerializeError(f"node {i} ({n.op}): {e}") from e
  return built[-1]


def to_json(root: UOp) -> str: return to_graph(root).model_dump_json()


def from_json(s: str | bytes) -> UOp:
  doc = load_json_document(s, MAX_DOCUMENT_BYTES, "MAX_DOCUMENT_BYTES", "invalid UOp JSON graph")
  if isinstance(doc, dict) and isinstance(nodes := doc.get("nodes"), list):  # counted before pydantic makes a model of each
    check_limit("the number of nodes", len(nodes), "MAX_NODES", MAX_NODES)
  try: g = UOpGraph.model_validate(doc, strict=True)
  except ValidationError as e: raise SerializeError(f"invalid UOp JSON graph: {e}") from e
  return from_graph(g)
