"""The ONNX indexing operators GatherND, GatherElements, ScatterND and ScatterElements, registered in onnx_ops.OPS
(onnx.py imports this module for that)."""
from __future__ import annotations
