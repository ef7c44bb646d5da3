"""The ONNX operators for ConvTranspose and LRN, registered in onnx_ops.OPS (onnx.py imports this module for that)."""
from __future__ import annotations
