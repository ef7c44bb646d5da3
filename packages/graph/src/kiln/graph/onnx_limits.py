"""Limits on an ONNX model, an untrusted document: checked before onnx parses it, before the checker and before a node is
converted. Each is an ONNXError naming the limit and the value:
  MAX_MODEL_BYTES       2 GiB - 1   the file, bytes or ModelProto (protobuf's own limit: a bigger model keeps its weights as
                                    external data, which kiln maps). A path must be a regular file: onnx.load would read a
                                    FIFO or /dev/zero forever, and reads any file whole into memory
  MAX_NODES             100,000     nodes of the main graph (exported transformers have thousands to tens of thousands)
  MAX_DEPTH             10,000      the longest chain of nodes
  MAX_NAME_BYTES        4,096       a node, value, initializer or attribute name
  MAX_RANK              32          dims of a tensor (as kiln.graph.weights)
  MAX_TENSOR_BYTES      2**47       an input, initializer or node output (kiln.ir.serialize.MAX_BUFFER_BYTES: the address
                                    space); dims are non-negative and multiplied as Python ints, so a product cannot wrap
  MAX_FOLDED_ELEMENTS   2**27       elements a load-time fold with numpy may make beyond the largest input it was handed
                                    (ConstantOfShape, Range, Expand, Gather, Concat, broadcasting of constants): <= 1 GiB of
                                    8-byte values
  MAX_FOLDED_BYTES      1 GiB       bytes all the load-time folds of one model may make together, plus twice the bytes of
                                    the tensors the model stores (so a model that casts or transposes its own weights at
                                    load still loads): ten folds each under MAX_FOLDED_ELEMENTS cannot add up to more
  MAX_UNROLLED_STEPS    4096        time steps the recurrent nodes (LSTM, GRU, RNN) of one model unroll together, each
                                    direction counted: every step is a few kernels to build and compile
  MAX_SCAN_BYTES        2**28       a scan output of a Loop run a number of times known only at run time: its slot has room
                                    for this many bytes of rows (memory the OS maps as rows are written), a run past it refused
  MAX_ATTRIBUTE_ITEMS   2**20       ints, floats or strings of one attribute
  MAX_ATTRIBUTE_BYTES   2**20       a string attribute (and each string of a list)
An initializer stored in the model must hold exactly its dims' worth of data.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from kiln.graph.lazy import ONNXError
from kiln.ir.files import open_regular
from kiln.ir.serialize import MAX_BUFFER_BYTES

MAX_MODEL_BYTES = (1 << 31) - 1
MAX_NODES = 100_000
MAX_DEPTH = 10_000
MAX_NAME_BYTES = 4096
MAX_RANK = 32
MAX_TENSOR_BYTES = MAX_BUFFER_BYTES
MAX_FOLDED_ELEMENTS = 1 << 27
MAX_FOLDED_BYTES = 1 << 30
MAX_UNROLLED_STEPS = 4096
MAX_SCAN_BYTES = 1 << 28
MAX_ATTRIBUTE_ITEMS = 1 << 20
MAX_ATTRIBUTE_BYTES = 1 << 20


def limit(what: str, value: int, name: str, maximum: int) -> None:
  if value > maximum: raise ONNXError(f"{what} is {value}, over {name} = {maximum}")


def read_model(onnx: Any, path: str) -> Any:
  """The ModelProto in the file at path, read at most MAX_MODEL_BYTES: a regular file (opened without blocking, so a FIFO
  cannot hang it), its size checked by fstat before a byte is read. The format follows the extension, as onnx.load's."""
  fd = open_regular(path, "the model file", ONNXError)
  try:
    st = os.fstat(fd)
    limit(f"{path!r}: the model file's size in bytes", st.st_size, "MAX_MODEL_BYTES", MAX_MODEL_BYTES)
    chunks, got = [], 0
    while chunk := os.read(fd, min(1 << 24, MAX_MODEL_BYTES + 1 - got)):  # the file may grow after fstat: never past the limit
      chunks.append(chunk)
      got += len(chunk)
      limit(f"{path!r}: the model file's size in bytes", got, "MAX_MODEL_BYTES", MAX_MODEL_BYTES)
  finally: os.close(fd)
  fmt = onnx.serialization.registry.get_format_from_file_extension(os.path.splitext(path)[1]) or "protobuf"
  return onnx.load_model_from_string(b"".join(chunks), format=fmt)


def _name(what: str, name: str) -> None:
  limit(f"{what}: the length in bytes of the name {name[:64]!r}...", len(name.encode("utf-8", "surrogatepass")), "MAX_NAME_BYTES", MAX_NAME_BYTES)


def check_shape(what: str, dims: Any, itemsize: int) -> None:
  """At most MAX_RANK non-negative dims whose product (Python ints: no wrap) of itemsize-byte elements fits MAX_TENSOR_BYTES."""
  dims = [int(d) for d in dims]
  limit(f"{what}: the rank", len(dims), "MAX_RANK", MAX_RANK)
  if any(d < 0 for d in dims): raise ONNXError(f"{what}: negative dim in {dims}")
  limit(f"{what}: the size in bytes of dims {dims}", math.prod(dims) * max(itemsize, 1), "MAX_TENSOR_BYTES", MAX_TENSOR_BYTES)


def _itemsize(onnx: Any, data_type: int) -> int:
  try: return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize)
  except Exception: return 1  # an unknown or exotic element type: the checker and the converter refuse it by name


def check_tensor(onnx: Any, t: Any, what: str) -> None:
  """A TensorProto's name and dims; one stored in the model must hold exactly its dims' worth of data."""
  _name(what, t.name)
  size = _itemsize(onnx, t.data_type)
  check_shape(f"{what} {t.name[:64]!r}", t.dims, size)
  if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED): return
  n = math.prod(int(d) for d in t.dims)
  if t.raw_data:
    if len(t.raw_data) != n * size:
      raise ONNXError(f"{what} {t.name[:64]!r}: raw_data holds {len(t.raw_data)} bytes, dims {list(t.dims)} take {n * size}")
    return
  try: field = onnx.helper.tensor_dtype_to_field(t.data_type)
  except Exception: return
  per = 2 if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1
  if size >= 1 and t.data_type not in (getattr(onnx.TensorProto, k, -1) for k in ("INT4", "UINT4", "FLOAT4E2M1")):
    if (have := len(getattr(t, field))) != n * per:
      raise ONNXError(f"{what} {t.name[:64]!r}: {field} holds {have} values, dims {list(t.dims)} take {n * per}")


def _check_attribute(onnx: Any, a: Any, label: str) -> None:
  _name(f"{label}: attribute", a.name)
  for f in ("ints", "floats", "strings", "tensors"):
    limit(f"{label}: attribute {a.name[:64]!r}'s number of {f}", len(getattr(a, f)), "MAX_ATTRIBUTE_ITEMS", MAX_ATTRIBUTE_ITEMS)
  for s in (a.s, *a.strings):
    limit(f"{label}: attribute {a.name[:64]!r}: a string's length in bytes", len(s), "MAX_ATTRIBUTE_BYTES", MAX_ATTRIBUTE_BYTES)
  for t in ([a.t] if a.HasField("t") else []) + list(a.tensors): check_tensor(onnx, t, f"{label}: attribute {a.name[:64]!r} tensor")


def check_model(onnx: Any, m: Any) -> None:
  """Every limit that reads the proto alone, before onnx.checker: size, node count and depth, names, tensors, attributes."""
  limit("the model's size in bytes", m.ByteSize(), "MAX_MODEL_BYTES", MAX_MODEL_BYTES)
  g = m.graph
  limit("the number of nodes", len(g.node), "MAX_NODES", MAX_NODES)
  for vi in (*g.input, *g.output, *g.value_info):
    _name("value", vi.name)
    dims = vi.type.tensor_type.shape.dim
    limit(f"value {vi.name[:64]!r}: the rank", len(dims), "MAX_RANK", MAX_RANK)
    if bad := [d.dim_value for d in dims if d.HasField("dim_value") and d.dim_value < -1]:  # -1: a dim not known (as onnxruntime reads it)
      raise ONNXError(f"value {vi.name[:64]!r}: negative dim {bad[0]}")
  for t in g.initializer: check_tensor(onnx, t, "initializer")
  depth: dict[str, int] = {}
  for node in g.node:
    label = f"node {node.name[:64] or '<' + node.op_type[:64] + '>'} ({node.op_type[:64]})"
    for s in (node.name, node.op_type, node.domain, *node.input, *node.output): _name(label, s)
    for a in node.attribute: _check_attribute(onnx, a, label)
    d = 1 + max((depth.get(i, 0) for i in node.input), default=0)
    limit(f"{label}: the graph's depth", d, "MAX_DEPTH", MAX_DEPTH)
    for o in node.output: depth[o] = d


def check_opset(onnx: Any, m: Any) -> None:
  """The default domain's opset is one the installed onnx defines: an operator's meaning changes between opsets, and a
  model from the future would be read with rules that may not be its own."""
  newest = int(onnx.defs.onnx_opset_version())
  for o in m.opset_import:
    if o.domain in ("", "ai.onnx") and not 1 <= o.version <= newest:
      raise ONNXError(f"the model imports opset {o.version} of the default domain; kiln reads opsets 1..{newest} (the installed onnx's newest)")


_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
                           "Max", "Min", "Where", "MatMul", "Gemm"})


def _elements(v: Any) -> int: return math.prod(int(d) for d in v.shape)


def check_fold(op: str, ins: list[Any], label: str, attrs: Any = None, budget: LoadBudget | None = None) -> None:
  """Before a node whose inputs are all constants is folded with numpy: the elements it would make, bounded from its inputs'
  values (ConstantOfShape, Range, Expand), shapes (broadcasting: each aligned dim's largest, which also bounds a matmul;
  Concat: their sum) or both (Gather: the indices' count times a slice of the data, along `attrs`' axis), beyond the
  largest input it was handed, within MAX_FOLDED_ELEMENTS, and (at 8 bytes an element) within what `budget` has left."""
  arrs = [x for x in ins if x is not None]
  if not arrs or not all(isinstance(x, np.ndarray) for x in arrs): return
  if any(x.dtype == object for x in arrs): return  # a symbolic shape: nothing folds (ConstantOfShape/Range become lazy Tensors)
  if op == "ConstantOfShape": dims = [[int(x) for x in arrs[0].reshape(-1)]]
  elif op == "Range" and len(arrs) == 3:
    s, e, d = (float(x.reshape(-1)[0]) if x.size else 0.0 for x in arrs)
    if not all(math.isfinite(x) for x in (s, e, d)) or d == 0:
      raise ONNXError(f"{label}: Range needs finite bounds and a non-zero delta, got {s}, {e}, {d}")
    dims = [[max(math.ceil((e - s) / d), 0)]]
  elif op == "Expand" and len(arrs) == 2: dims = [list(arrs[0].shape), [int(x) for x in arrs[1].reshape(-1)]]
  elif op in _BROADCASTING: dims = [list(x.shape) for x in arrs]
  elif op == "Concat": dims = [[sum(_elements(x) for x in arrs)]]
  elif op == "Gather" and len(arrs) == 2:
    data, ind = arrs
    axis = int((attrs or {}).get("axis", 0))
    if not -data.ndim <= axis < data.ndim: return  # the converter names a bad axis itself
    dims = [list(data.shape[:axis % data.ndim]) + list(ind.shape) + list(data.shape[axis % data.ndim + 1:])]
  else: return  # the rest make at most about what they are handed (MemoryError stays the backstop)
  if any(x < 0 for ds in dims for x in ds): return  # numpy refuses a negative dim itself, allocating nothing
  rank = max(len(ds) for ds in dims)
  limit(f"{label}: the folded value's rank", rank, "MAX_RANK", MAX_RANK)
  bound = math.prod(max([ds[len(ds) - rank + k] for ds in dims if len(ds) - rank + k >= 0], default=1) for k in range(rank))
  if bound > max((_elements(x) for x in arrs), default=0):
    limit(f"{label}: a load-time fold's element count", bound, "MAX_FOLDED_ELEMENTS", MAX_FOLDED_ELEMENTS)
    if budget is not None: budget.check(label, budget.folded + 8 * bound)  # before numpy allocates it


def stored_bytes(onnx: Any, tensors: Iterable[Any]) -> int:
  """The bytes of the TensorProtos a model stores (initializers and Constant values, in the model or as external data),
  from their dims."""
  return sum(math.prod(int(d) for d in t.dims) * _itemsize(onnx, t.data_type) for t in tensors)


class LoadBudget:
  """What loading one model may make in all, across its nodes: bytes of folded constants (MAX_FOLDED_BYTES, plus twice
  the bytes the model stores) and unrolled recurrence steps (MAX_UNROLLED_STEPS)."""

  def __init__(self, stored_bytes: int = 0):
    self.fold_limit, self.folded, self.steps = MAX_FOLDED_BYTES + 2 * stored_bytes, 0, 0

  def fold(self, label: str, outs: list[Any], ins: list[Any]) -> None:
    """Count a fold's new arrays: neither a view of another (a Reshape's) nor one of its inputs handed on (an Identity's)."""
    self.folded += sum(o.nbytes for o in outs if isinstance(o, np.ndarray) and o.base is None and not any(o is i for i in ins))
    self.check(label, self.folded)

  def check(self, label: str, total: int) -> None:
    if total > self.fold_limit:
      raise ONNXError(f"{label}: the model's load-time folds would make {total} bytes in all, over MAX_FOLDED_BYTES = {MAX_FOLDED_BYTES} "
                      f"plus twice the {(self.fold_limit - MAX_FOLDED_BYTES) // 2} bytes the model stores")

  def unroll(self, label: str, steps: int) -> None:
    self.steps += steps
    limit(f"{label}: the time steps the model's recurrent nodes unroll in all", self.steps, "MAX_UNROLLED_STEPS", MAX_UNROLLED_STEPS)


def check_value(label: str, v: Any) -> None:
  """A node's output (a lazy Tensor or a folded numpy array) within MAX_RANK and MAX_TENSOR_BYTES."""
  shape, dt = getattr(v, "shape", None), getattr(v, "dtype", None)
  if shape is None: return
  shape = [d.vmax if hasattr(d, "vmax") else d for d in shape]  # a symbolic dim of a Tensor: its upper bound
  size = dt.itemsize if dt is not None and hasattr(dt, "itemsize") else 1
  check_shape(f"{label}: output", shape, size)
