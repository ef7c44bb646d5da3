"""The ONNX operators for Resize in every mode, registered in onnx_ops.OPS (onnx.py imports this module for that)."""
from __future__ import annotations
