"""kiln.graph's errors, in a module of their own so every module of the layer (dims.py, lazy.py, ...) can raise them
without importing the graph."""
from __future__ import annotations

from kiln.executor.checks import PlanCheckError
from kiln.ir.errors import IRError


class GraphError(IRError):
  """A tensor graph op got operands it cannot take (shapes, dtypes, axes); the message names the op and the shapes."""


class ONNXError(GraphError):
  """An ONNX model could not be loaded: malformed, failing onnx.checker, or using an operator or attribute kiln does not support."""


class IndexOutOfRangeError(GraphError, PlanCheckError):
  """An index outside its axis's [-n, n) (a Gather's, as onnxruntime refuses it): the message names the node, the index and the
  range, `.value` is the index. Raised when the gather is made for constant indices, else after the run that read it (the
  plan stays usable: the next run with good indices succeeds). Also a PlanCheckError, what an exported plan raises."""
