"""Every tensor an ONNX model stores, as numpy: the one place kiln reads a file because a model said so.

A TensorProto anywhere in the model (an initializer, a Constant's or ConstantOfShape's `value`, any tensor attribute) may
keep its bytes in a file beside the model (`data_location = EXTERNAL`). onnx's own `numpy_helper.to_array` resolves such
a location against the process's working directory and reads the whole file, so kiln never lets it see one: `Tensors`
resolves every location against the model's directory (relative, no `..`, no symlink out of it, a regular file opened
without blocking), checks offset and length against the dims and the file before anything is mapped, and maps each data
file once, read-only (no read until a kernel touches a page; each tensor is a view of that one map).
"""
from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.graph import onnx_limits as lim
from kiln.graph.lazy import ONNXError
from kiln.ir.files import open_regular

EXTERNAL_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})


def _np_dtype(onnx: Any, data_type: int, where: str) -> np.dtype:
  try: dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
  except Exception as e: raise ONNXError(f"{where}: element type {data_type} is not supported") from e
  if dt.kind not in "biuf" or data_type == onnx.TensorProto.BFLOAT16: raise ONNXError(f"{where}: element type {dt} is not supported")
  return dt


def model_tensors(graph: Any) -> Iterator[tuple[Any, str]]:
  """Every TensorProto of a graph with where it sits: initializers, then each node's tensor attributes (and those of any
  subgraph an attribute holds)."""
  for t in graph.initializer: yield t, f"initializer {t.name[:64]!r}"
  for node in graph.node:
    label = f"node {node.name[:64] or '<' + node.op_type[:64] + '>'} ({node.op_type[:64]})"
    for a in node.attribute:
      if a.HasField("t"): yield a.t, f"{label}: attribute {a.name[:64]!r}"
      for t in a.tensors: yield t, f"{label}: attribute {a.name[:64]!r}"
      for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs): yield from model_tensors(sub)


class Tensors:
  """The arrays of a model's TensorProtos, external data resolved against `base` (the model's directory; None for a
  model handed over as bytes or a ModelProto, which then may not name external files)."""

  def __init__(self, onnx: Any, base: str | None):
    self.onnx, self.base = onnx, None if base is None else os.path.realpath(base)
    self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}  # real path -> (its one map, its bytes)

  def array(self, t: Any, where: str) -> np.ndarray:
    """The tensor's value: a read-only view of its mapped file region for external data, else a copy of its stored bytes."""
    if t.data_location == self.onnx.TensorProto.EXTERNAL: return self._external(t, where)
    try: return np.asarray(self.onnx.numpy_helper.to_array(t)).copy()
    except Exception as e: raise ONNXError(f"{where} cannot be read: {type(e).__name__}: {e}") from e

  def _external(self, t: Any, where: str) -> np.ndarray:
    where = f"{where} (external data)"
    if self.base is None: raise ONNXError(f"{where}: external data needs the model's path (load it from a file, not bytes or a ModelProto)")
    info: dict[str, str] = {}
    for e in t.external_data:
      if e.key not in EXTERNAL_KEYS: raise ONNXError(f"{where}: unknown external_data key {e.key!r}")
      info[e.key] = e.value
    loc = info.get("location", "")
    if not loc or "\0" in loc or os.path.isabs(loc) or ".." in loc.replace("\\", "/").split("/"):
      raise ONNXError(f"{where}: location {loc!r} must be a relative path inside the model's directory")
    path = os.path.realpath(os.path.join(self.base, loc))
    if os.path.commonpath([path, self.base]) != self.base: raise ONNXError(f"{where}: location {loc!r} leaves the model's directory")
    dt = _np_dtype(self.onnx, t.data_type, where)
    dims = [int(d) for d in t.dims]
    lim.check_shape(where, dims, dt.itemsize)
    need = math.prod(dims) * dt.itemsize  # Python ints: np.prod wrapped dims [2**32, 2**32] to 0 bytes
    offset, length = self._field(info, "offset", where) or 0, self._field(info, "length", where)
    if length is not None and length != need: raise ONNXError(f"{where}: length {length} bytes, but dims {dims} of {dt} take {need}")
    data = self._file(path, loc, where)
    if offset + need > data.size:
      raise ONNXError(f"{where}: bytes {offset}..{offset + need} of {loc!r} are needed, the file has {data.size} (truncated or a bad offset)")
    return data[offset:offset + need].view(dt.newbyteorder("<")).reshape(dims)

  @staticmethod
  def _field(info: dict[str, str], key: str, where: str) -> int | None:
    if key not in info: return None
    text = info[key]
    if not (text.isascii() and text.isdigit()):  # as onnxruntime reads it: no sign, spaces or other scripts' digits
      raise ONNXError(f"{where}: {key} {text!r} is not a non-negative integer")
    return int(text)

  def _file(self, path: str, loc: str, where: str) -> np.ndarray:
    """The whole data file as read-only bytes, mapped once for every tensor that names it."""
    if (hit := self._maps.get(path)) is not None: return hit[1]
    fd = open_regular(path, f"{where}: data file {loc!r}", ONNXError)
    try:
      size = os.fstat(fd).st_size
      if size == 0: m, data = None, np.zeros(0, np.uint8)
      else:
        try: m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e: raise ONNXError(f"{where}: cannot map {loc!r}: {e}") from None  # e.g. too many maps
        data = np.frombuffer(m, np.uint8)
    finally: os.close(fd)  # the map keeps its own duplicate of the descriptor
    if m is not None: self._maps[path] = (m, data)
    return data

  def maps(self) -> list[mmap.mmap]:
    """The maps made so far (one per data file): a plan reading them checks before each run that none has shrunk."""
    return [m for m, _ in self._maps.values()]
