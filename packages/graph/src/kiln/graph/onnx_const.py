"""Nodes whose inputs are all known at load are computed at load, whatever their operator.

Many handlers fold constant inputs with numpy themselves (the shape arithmetic feeding Reshape, Range, ConstantOfShape); any
other node whose inputs are all constants would otherwise leave a kernel that computes the same value on every run (Swin's
shifted-window mask, BERT's zero token types). Such a node's Tensor outputs are compiled and run once on the CPU here, by
the very kernels the model would run: the same operator semantics as at run time, not a second implementation. Its
outputs are then arrays, so a later node that needs a constant (a Reshape's shape, a Slice's starts) gets one.

| a node's Tensor output is computed at load when          | why not otherwise                                         |
|-----------------------------------------------------------|-----------------------------------------------------------|
| every input of the node is known at load (or absent)      | a fed input's value exists only at run time               |
| its graph reads no fed input (no named BUFFER)            | (the same condition, checked on what the handler built)   |
| its shape is static                                       | a symbolic dim's size is known only at run time           |
| at most max(4 x its inputs' elements, 65536) elements    | a large Expand of a scalar is free as a lazy broadcast, costly stored |
| the CPU runtime is installed                             | a GPU-only install computes it in the model's plan instead |
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.onnx_ops import Value
from kiln.graph.tensor import Tensor, compile
from kiln.ir.errors import DeviceError


def _reads_feeds(t: Tensor) -> bool:
  return any(n.op == "BUFFER" and n.arg.name is not None for n in t.node.toposort())


SMALL = 1 << 16  # elements: below this a constant output is always stored rather than recomputed on every run


def fold_known(outs: list[Value], ins: Sequence[Value | None]) -> list[Value]:
  """outs with each Tensor computed from constants alone replaced by its array (one CPU compile for all of them)."""
  arrays = [v for v in ins if isinstance(v, np.ndarray)]
  if any(v is not None and not isinstance(v, np.ndarray) for v in ins): return outs
  limit = max(4 * sum(a.size for a in arrays), SMALL)
  todo = {i: o for i, o in enumerate(outs) if isinstance(o, Tensor) and o.node.data is None and sym.is_static(o.shape)
          and o.node.max_numel <= limit and not _reads_feeds(o)}
  if not todo: return outs
  try: got = compile(list(todo.values())).run({})
  except DeviceError: return outs  # no CPU runtime here (a GPU-only install): the kernels compute it on every run instead
  done = list(outs)
  for i, a in zip(todo, got): done[i] = a
  return done
