"""The ONNX operators for control flow: If, Loop and Scan, registered in onnx_ops.OPS (onnx.py imports this module for that)."""
from __future__ import annotations
