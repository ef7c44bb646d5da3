"""The ONNX recurrent operators (LSTM, GRU, RNN), unrolled over a sequence of fixed length into kiln.graph Tensor ops and
registered in onnx_ops.OPS (onnx.py imports this module for that)."""
from __future__ import annotations
