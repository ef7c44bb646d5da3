"""The ONNX padding, tiling, masking, index-reduction, normalisation and extra reduction operators beyond onnx_ops' core
set, built from kiln.graph Tensor ops and registered in onnx_ops.OPS with the attributes each understands (onnx.py imports
this module for that)."""
from __future__ import annotations
