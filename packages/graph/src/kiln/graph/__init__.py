"""kiln.graph: a lazy `Tensor` that records a graph, a scheduler that fuses it into one ExecutionPlan, and (kiln.graph.onnx)
an ONNX importer."""
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, Node, ONNXError
from kiln.graph.schedule import Compiled, schedule
from kiln.graph.tensor import Tensor, compile
from kiln.graph.version import __version__

__all__ = ["Tensor", "compile", "Compiled", "schedule", "Node", "GraphError", "ONNXError", "IndexOutOfRangeError", "__version__"]
