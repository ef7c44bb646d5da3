"""The KV cache: per layer, keys and values of every position so far, in buffers on the plans' device.

Each layer's keys (and values) are one float32 buffer of (ctx + slack, kv_heads, head_dim), position-major, so the filled
part is its front. The plans read its first ctx rows in place as their `k{i}`/`v{i}` inputs of `past` rows, and write a
step's new rows at row `past` themselves (`k{i}_rows`/`v{i}_rows`, the whole buffer: kiln.graph's Tensor.write_rows), so
no key or value crosses to the host: on CUDA the cache lives in device memory and a decode step copies only its token
in and its logits out. The slack rows take a padded chunk's rows past the context (a chunk is a fixed size: runtime.py);
they are written, never read."""
from __future__ import annotations

import numpy as np

from kiln.llm.errors import LLMError


class ContextFullError(LLMError):
  """More tokens than the context the model was loaded with (load(..., context=N)): names both."""


class KVCache:
  def __init__(self, layers: int, ctx: int, kv_heads: int, head_dim: int, slack: int = 0, device: str = "CPU"):
    from kiln.executor import Buffer
    if ctx < 1: raise LLMError(f"a KV cache of context {ctx}: it must hold at least one position")
    self.ctx, self.rows, self.length = ctx, ctx + slack, 0
    self.shape = (kv_heads, head_dim)
    # zeros (rows never written are still read as a clamped index's value), each its own calloc: its pages become
    # resident as positions are written; on the CPU the buffer wraps the array
    self.k = [Buffer.from_numpy(np.zeros((self.rows, kv_heads, head_dim), np.float32), device) for _ in range(layers)]
    self.v = [Buffer.from_numpy(np.zeros((self.rows, kv_heads, head_dim), np.float32), device) for _ in range(layers)]

  @property
  def nbytes(self) -> int: return sum(b.nbytes for b in (*self.k, *self.v))

  def bind(self) -> dict[str, object]:
    """The plans' cache inputs by name (compile(bind=)): `k{i}`, the first ctx rows, and `k{i}_rows`, all of them."""
    per_ctx = self.ctx * int(np.prod(self.shape))
    out: dict[str, object] = {}
    for i, (k, v) in enumerate(zip(self.k, self.v)):
      out[f"k{i}"], out[f"v{i}"] = k.view(0, per_ctx), v.view(0, per_ctx)
      out[f"k{i}_rows"], out[f"v{i}_rows"] = k, v
    return out

  def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer i's cached keys and values, (length, kv_heads, head_dim) each (a copy where the cache is on a device)."""
    return tuple(b.numpy().reshape(self.rows, *self.shape)[:self.length] for b in (self.k[i], self.v[i]))  # type: ignore[return-value]

  def room(self, n: int) -> None:
    """A ContextFullError unless n more positions fit."""
    if self.length + n > self.ctx:
      raise ContextFullError(f"{self.length} cached + {n} new tokens is more than the context of {self.ctx} positions (load with a larger context=)")

  def advance(self, n: int) -> None:
    """Count n more positions as cached: the plan that ran them has written their rows at row `length`."""
    self.room(n)
    self.length += n

  def reset(self, length: int = 0) -> None:
    """Forget every position from `length` on (the rows stay; the plans read only the first `length`)."""
    if not 0 <= length <= self.length: raise LLMError(f"reset to {length}: the cache holds {self.length} positions")
    self.length = length
