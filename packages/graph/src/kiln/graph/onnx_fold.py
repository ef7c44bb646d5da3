"""Batch normalization folded into the Conv before it, at load time (onnxruntime's Conv+BatchNormalization fusion).

With constant statistics a batch norm is y * a + (beta - mean * a), a = scale / sqrt(var + eps), per output channel.
Scaling the conv's weights by a instead (w'[co] = w[co] * a[co], b' = (b - mean) * a + beta) leaves only the bias add
after the product, which the scheduler can keep in the conv's own kernel. The model is the same function; only the
float32 rounding moves (a is applied to each weight, not to each sum; both fold in float64 and round once to float32).

| a Conv + BatchNormalization pair folds only when                        | why                                            |
|--------------------------------------------------------------------------|------------------------------------------------|
| the conv's output is read by the batch norm alone (no other node, not a graph output) | another reader needs the unscaled product |
| the conv's weight (and bias, if any) and the four statistics are constants of float32 | the fold is numpy at load time     |
| the batch norm is in inference mode with only its first output used     | training mode normalises by the batch's own statistics |
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kiln.graph.onnx_ops import OnnxNode, Value


def _uses(graph: Any) -> Counter[str]:
  """How many times each value is read: by a node's input, or as a graph output."""
  uses: Counter[str] = Counter(i for p in graph.node for i in p.input if i)
  uses.update(o.name for o in graph.output)
  return uses


def _f32_const(v: Value | None) -> bool:
  return isinstance(v, np.ndarray) and v.dtype == np.float32


class BatchNormFolds:
  """Decides, per Conv, whether the batch norm reading it folds into its weights, and remembers the folded batch norms
  (their output is then the conv's own)."""

  def __init__(self, graph: Any, onnx: Any):
    self.onnx = onnx
    self.uses = _uses(graph)
    self.bn_of = {p.input[0]: p for p in graph.node if p.op_type == "BatchNormalization" and p.input}
    self.folded: set[str] = set()  # the output names of batch norms folded into their conv

  def _foldable_bn(self, conv: OnnxNode, env: dict[str, Value]) -> tuple[Any, dict[str, Any]] | None:
    """The BatchNormalization proto to fold into this Conv and its attributes, or None (see the module's table)."""
    out = conv.proto.output[0] if conv.proto.output else ""
    bn = self.bn_of.get(out)
    if bn is None or self.uses[out] != 1 or len(bn.input) < 5: return None
    attrs = {a.name: self.onnx.helper.get_attribute_value(a) for a in bn.attribute}
    if attrs.get("training_mode", 0) or any(bn.output[1:]): return None
    if not all(_f32_const(env.get(name)) for name in bn.input[1:5]): return None
    w = conv.ins[1] if len(conv.ins) > 1 else None
    b = conv.ins[2] if len(conv.ins) > 2 else None
    if not _f32_const(w) or (b is not None and not _f32_const(b)): return None
    assert isinstance(w, np.ndarray)
    if w.ndim < 3 or any(np.shape(env[name]) != (w.shape[0],) for name in bn.input[1:5]): return None
    return bn, attrs

  def conv(self, conv: OnnxNode, env: dict[str, Value]) -> None:
    """Scale conv's weight and bias inputs in place by the batch norm that reads it, when it folds."""
    if (found := self._foldable_bn(conv, env)) is None: return
    bn, attrs = found
    eps = float(attrs.get("epsilon", 1e-5))
    sc, beta, mu, var = (np.asarray(env[name], np.float64) for name in bn.input[1:5])
    a = sc / np.sqrt(var + eps)  # as the unfolded batch norm (onnx_ops._batchnorm) computes it
    w = np.asarray(conv.ins[1], np.float64)
    b = np.zeros(w.shape[0]) if len(conv.ins) < 3 or conv.ins[2] is None else np.asarray(conv.ins[2], np.float64)
    conv.ins[1:] = [(w * a.reshape(-1, *[1] * (w.ndim - 1))).astype(np.float32), ((b - mu) * a + beta).astype(np.float32)]
    self.folded.add(bn.output[0])

  def passes_through(self, proto: Any) -> bool:
    """Whether this BatchNormalization was folded into its conv (its output is the conv's)."""
    return proto.op_type == "BatchNormalization" and bool(proto.output) and proto.output[0] in self.folded
