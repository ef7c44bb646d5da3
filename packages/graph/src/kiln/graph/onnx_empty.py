"""Zero-size tensors in ONNX models: a value with a dim of 0 holds no elements, so it is known at load, whatever feeds it.

kiln's kernels never see one: an empty value is an empty numpy array in the converter's environment, as a constant is.

| where an empty value appears                     | what kiln does                                               |
|--------------------------------------------------|--------------------------------------------------------------|
| a model input with a static dim of 0             | an empty array at load; run() checks the fed array's shape   |
| a node whose inputs are all known, one empty     | onnx's reference implementation computes it (only shapes and a reduction's fill are at stake) |
| a Slice of a computed value that selects nothing on a fixed axis | an empty array (phi3's q[..., rotary_dim:] with the whole head rotated) (2) |
| a Concat with empty pieces beside computed ones  | the empty pieces are dropped                                 |
| CastLike with an empty target beside a computed input | its handler reads only the target's dtype                |
| any other node with an empty and a computed input | shape inference gives its outputs, empty ones empty arrays; a non-empty one is refused (1) |

(1) unless its computed inputs are a few numbers each (a Pad's pads, a Reduce's axes): a run reads them back, and the node is
then computed as in the second row (specialise.py)
(2) with symbolic dims beside (phi3 exported with a dynamic batch), a SymbolicEmpty, which no array can hold: only Concat
(which drops it) and Shape (its dims) read one; any other reader, or a graph output, is refused naming it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.specialise import unspecialisable
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType
from kiln.ir.kernels import Dim

if TYPE_CHECKING:  # onnx_ops' Slice handler calls empty_slice
  from kiln.graph.onnx_ops import OnnxNode, Value


@dataclass(frozen=True)
class SymbolicEmpty:
  """An empty value (a dim of 0) whose other dims are symbolic: no array can hold it, and no kernel needs to."""
  shape: tuple[Dim, ...]
  dtype: DType

  @property
  def ndim(self) -> int: return len(self.shape)

  @property
  def size(self) -> int: return 0


def is_empty(v: Any) -> bool: return isinstance(v, SymbolicEmpty) or (isinstance(v, np.ndarray) and v.size == 0)


def _elem_type(onnx: Any, v: Value) -> int:
  dt = v.dtype if isinstance(v, np.ndarray) else v.dtype.np
  return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)))


def _reference(n: OnnxNode, onnx: Any) -> list[Value]:
  """The node computed by onnx's reference implementation on its (all known, small: one is empty) inputs."""
  from onnx.reference import ReferenceEvaluator
  names = [f"in{i}" if v is not None else "" for i, v in enumerate(n.ins)]
  node = onnx.helper.make_node(n.proto.op_type, names, [f"out{i}" for i in range(len(n.proto.output))], domain=n.proto.domain)
  node.attribute.extend(n.proto.attribute)
  h = onnx.helper
  known = [(nm, v) for nm, v in zip(names, n.ins) if v is not None]
  graph = h.make_graph([node], "empty", [h.make_tensor_value_info(nm, _elem_type(onnx, v), v.shape) for nm, v in known],
                       [h.make_value_info(o, onnx.TypeProto()) for o in node.output])
  model = h.make_model(graph, opset_imports=[h.make_opsetid("", n.opset)])
  feeds = dict(known)
  return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]


def _inferred_empty(n: OnnxNode, onnx: Any, why: str = "") -> list[Value]:
  """Outputs of a node reading an empty value beside computed ones (or known ones the reference could not compute, why):
  empty arrays where shape inference says so."""
  h = onnx.helper
  types = {}
  for name, v in zip(n.proto.input, n.ins):
    if not name or v is None: continue
    shape = [d if isinstance(d, int) else f"d{k}" for k, d in enumerate(v.shape)]
    types[name] = h.make_tensor_type_proto(_elem_type(onnx, v), shape)
  schema = onnx.defs.get_schema(n.proto.op_type, n.opset, n.proto.domain)
  try: got = onnx.shape_inference.infer_node_outputs(schema, n.proto, types)
  except Exception as e: raise n.error(f"an input is empty (a dim of 0) and its outputs' shapes could not be inferred: {e}") from e
  outs: list[Value] = []
  for o in n.proto.output:
    t = got.get(o)
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.tensor_type.shape.dim] if t is not None else [-1]
    if t is None or -1 in dims or 0 not in dims:
      runtime = [i for i, v in enumerate(n.ins) if isinstance(v, Tensor)]
      if not runtime:  # every input known, and onnx's reference refused them (a Reshape's 0 copying a dim the data does not have)
        raise n.error(f"an input is empty (a dim of 0) and onnx's reference implementation cannot compute the node on its values: {why}")
      if all(unspecialisable(v.node) is None for v in n.ins if isinstance(v, Tensor)):  # a few numbers each (a Reduce's axes)
        n.const(runtime[0], "beside an empty input")  # read back by a run, which converts the rest with it (then all known)
      raise n.error("an input is empty (a dim of 0) beside values computed at run time, and the output is not: not supported")
    outs.append(np.zeros(dims, h.tensor_dtype_to_np_dtype(t.tensor_type.elem_type)))
  return outs


def empty_outputs(n: OnnxNode, onnx: Any) -> list[Value] | None:
  """The node's outputs when one of its inputs is empty (None when none is, or when its handler copes: Concat)."""
  if not any(is_empty(v) for v in n.ins): return None
  if all(v is None or isinstance(v, np.ndarray) for v in n.ins):
    try: return _reference(n, onnx)
    except ValueError as e: return _inferred_empty(n, onnx, str(e))  # the reference's numpy fails on some empties (Flatten's reshape(0, -1))
  if n.op == "Concat": n.ins = [None if is_empty(v) else v for v in n.ins]  # an empty piece adds nothing
  if n.op in ("Concat", "CastLike") or (n.op == "Shape" and isinstance(n.ins[0], SymbolicEmpty)): return None
  for name, v in zip(n.proto.input, n.ins):
    if isinstance(v, SymbolicEmpty):
      raise n.error(f"input {name!r} is empty (a dim of 0) beside symbolic dims {sym.fmt_shape(v.shape)}: "
                    "only Concat and Shape may read such a value")
  return _inferred_empty(n, onnx)


def empty_input(shape: Sequence[int | str], dt: np.dtype) -> np.ndarray | None:
  """An input declared with a static dim of 0: its value, an empty array (None for any other input)."""
  static = all(isinstance(d, int) for d in shape)
  return np.zeros([int(d) for d in shape], dt) if static and 0 in shape else None


def empty_slice(n: OnnxNode, t: Tensor, axes: Sequence[int], starts: Sequence[Any], ends: Sequence[Any],
                steps: Sequence[int]) -> np.ndarray | SymbolicEmpty | None:
  """A Slice of computed t that selects nothing on a fixed axis: its result has no elements, so it is known at load, an
  empty array, or a SymbolicEmpty where its other dims are symbolic (None when every fixed axis keeps an element)."""
  shape: list[Any] = list(t.shape)
  for a, b, e, st in zip(axes, starts, ends, steps):
    if isinstance(shape[a], int) and isinstance(b, int) and isinstance(e, int) and st != 0: shape[a] = len(range(*slice(b, e, st).indices(shape[a])))
  if 0 not in shape: return None
  return np.zeros(shape, t.dtype.np) if sym.is_static(shape) else SymbolicEmpty(tuple(shape), t.dtype)
