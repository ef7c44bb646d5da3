"""The KV cache: per layer, keys and values of every position so far, in host arrays sized for the context bound.

Each array is (ctx, kv_heads, head_dim) float32, position-major, so the filled part is its front: the plans read it in
place as their `k{i}`/`v{i}` inputs of `past` rows (kiln.graph's compile(bind=) wraps the arrays' memory, nothing is
copied in), and a step's new rows are written at row `past` (a copy of the step's rows, not of the cache)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.llm.errors import LLMError


class ContextFullError(LLMError):
  """More tokens than the context the model was loaded with (load(..., context=N)): names both."""


class KVCache:
  def __init__(self, layers: int, ctx: int, kv_heads: int, head_dim: int):
    if ctx < 1: raise LLMError(f"a KV cache of context {ctx}: it must hold at least one position")
    self.ctx, self.length = ctx, 0
    self.k = [np.zeros((ctx, kv_heads, head_dim), np.float32) for _ in range(layers)]
    self.v = [np.zeros((ctx, kv_heads, head_dim), np.float32) for _ in range(layers)]

  @property
  def nbytes(self) -> int: return sum(a.nbytes for a in (*self.k, *self.v))

  def bind(self) -> dict[str, object]:
    """The plans' cache inputs by name, as executor Buffers over the arrays (compile(bind=))."""
    from kiln.executor import Buffer
    out: dict[str, object] = {}
    for i, (k, v) in enumerate(zip(self.k, self.v)): out[f"k{i}"], out[f"v{i}"] = Buffer.from_numpy(k), Buffer.from_numpy(v)
    return out

  def room(self, n: int) -> None:
    """A ContextFullError unless n more positions fit."""
    if self.length + n > self.ctx:
      raise ContextFullError(f"{self.length} cached + {n} new tokens is more than the context of {self.ctx} positions (load with a larger context=)")

  def append(self, new: Sequence[np.ndarray]) -> None:
    """Write one step's rows (k0, v0, k1, v1, ... each (seq, kv_heads, head_dim)) at row `length`, then advance it."""
    n = new[0].shape[0]
    self.room(n)
    a, b = self.length, self.length + n
    for i in range(len(self.k)):
      self.k[i][a:b] = new[2 * i]
      self.v[i][a:b] = new[2 * i + 1]
    self.length = b

  def reset(self, length: int = 0) -> None:
    """Forget every position from `length` on (the rows stay; the plans read only the first `length`)."""
    if not 0 <= length <= self.length: raise LLMError(f"reset to {length}: the cache holds {self.length} positions")
    self.length = length
