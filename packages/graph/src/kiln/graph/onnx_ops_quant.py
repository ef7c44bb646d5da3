"""The ONNX operators for the ONNX quantization operators, registered in onnx_ops.OPS (onnx.py imports this module for that)."""
from __future__ import annotations
