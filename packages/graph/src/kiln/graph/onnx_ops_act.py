"""The ONNX activation and elementwise-maths operators beyond onnx_ops' core set, each built from kiln.graph Tensor ops and
registered in onnx_ops.OPS with the attributes it understands (onnx.py imports this module for that)."""
from __future__ import annotations
