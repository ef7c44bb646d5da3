"""Running the forward graph over a KV cache: each plan compiled once for every position, the cache bound in place.

Four plans over one cache (kv.py: each plan reads it and writes its chunk's rows into it in place), each built the first
time it is needed: "decode" (one token), "prefill" (a chunk of `chunk` tokens, the last real one's logits), "long" (the
same over `long` tokens) and "all" (a chunk, every token's logits: teacher-forced logits). past (0..ctx) is a runtime
variable of each, so no kernel is compiled after a plan's first run. A prompt runs in chunks, the last one padded to the
chunk's size (model.py says why the chunk is a fixed size): the padded rows' keys and values land past the real ones,
where the next chunk overwrites them (the cache keeps `slack` rows past the context for them), and their logits are not
returned. While more than `long` less `chunk` tokens are left, a prompt takes a long chunk (padded by less than a chunk's
rows): each run of a plan pays once for what does not grow with its rows (a packed matrix dequantised into the plan's
scratch, each kernel's start), so long prompts run faster in fewer, longer chunks, while a short prompt pays for the
padding of a chunk only. With device="CUDA" the plans, their weights and the cache are on the GPU: a run copies its
token ids and positions in and its logits out."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import ModelConfig
from kiln.llm.errors import LLMError
from kiln.llm.kv import KVCache
from kiln.llm.model import Get, forward

DEFAULT_CHUNK = 64  # rows a prefill chunk's matrix products are tiled over; a shorter prompt pays for the padding
DEFAULT_LONG = 256  # rows of a long prompt's chunks (the "long" plan)
MAX_HASHED_BYTES = 1 << 40  # a checkpoint file the plan cache's key hashes (the loader has checked it already)


def checkpoint_key(ck: Checkpoint) -> str | None:
  """The caller's part of the plan cache key of a checkpoint's plans (kiln.graph.compile_cache): the sha256 of each file
  its config and weights come from (remembered beside the file's stat: a checkpoint is hashed once) and kiln.llm's code,
  which makes the graph's arrays of them. None when the plan cache is off or a file cannot be hashed: the plans then
  compile in every process."""
  from kiln.executor import plan_cache
  if not plan_cache.enabled(): return None
  from kiln.graph.plan_keys import file_digest, stamp
  parts = ["kiln-llm 1", f"llm+{stamp('kiln.llm')}"]
  for path in ck.files():
    if (got := file_digest(path, MAX_HASHED_BYTES)) is None: return None
    parts.append(f"{os.path.basename(path)}={got[0]}")
  return "\n".join(parts)


class Runner:
  def __init__(self, cfg: ModelConfig, get: Get, ctx: int, chunk: int = DEFAULT_CHUNK, device: str = "CPU", long: int = DEFAULT_LONG,
               key: Callable[[], str | None] | None = None):
    """`key` gives the plan cache key of the weights `get` hands out (checkpoint_key), asked once, when a plan is first
    built; None: the plans are not kept."""
    if chunk < 1: raise LLMError(f"a prefill chunk of {chunk} tokens: it must be at least 1")
    self.cfg, self.get, self.ctx, self.chunk, self.device = cfg, get, ctx, min(chunk, ctx), device
    self._keyer = key
    self.long = min(long, ctx)  # no long chunks where it is not longer than a chunk
    self.cache = KVCache(cfg.num_layers, ctx, cfg.num_kv_heads, cfg.head_dim, slack=max(self.chunk, self.long), device=device)
    self._bound = self.cache.bind()
    self.plans: dict[str, Any] = {}
    self._cache_key: str | None = None

  def plan(self, kind: str) -> Any:
    """The compiled plan (kiln.graph Compiled) "decode", "prefill", "long" or "all", built on first use."""
    if (p := self.plans.get(kind)) is None:
      from kiln.graph import compile
      from kiln.graph.build_target import building_for
      if kind not in ("decode", "prefill", "long", "all"): raise LLMError(f"no plan {kind!r} (decode, prefill, long, all)")
      seq = 1 if kind == "decode" else self.long if kind == "long" else self.chunk
      with building_for(self.device):  # the layouts that pay on the plan's device (kiln.graph.build_target)
        f = forward(self.cfg, self.get, self.ctx, seq, last_only=kind != "all", rows=self.cache.rows)
      if self._keyer is not None: self._cache_key, self._keyer = self._keyer(), None  # hashed once, at the first plan
      key = None if self._cache_key is None else f"{self._cache_key}\nplan {kind}"
      p = self.plans[kind] = compile([f.logits], self.device, bind=self._bound, writes=f.writes, cache=key)
    return p

  def feed(self, ids: Sequence[int], last_only: bool = True) -> np.ndarray:
    """Run `ids` after the cached tokens, appending their keys and values; the logits of the last token (vocab,), or of
    every token (len(ids), vocab) when not last_only."""
    a = np.asarray(list(ids), dtype=np.int64)
    if a.ndim != 1 or a.size == 0: raise LLMError(f"feed takes a non-empty list of token ids, got shape {a.shape}")
    if (bad := a[(a < 0) | (a >= self.cfg.vocab_size)]).size:
      raise LLMError(f"token id {int(bad[0])} is outside the vocabulary of {self.cfg.vocab_size}")
    self.cache.room(a.size)
    rows, lo = [], 0
    while lo < a.size:
      kind, size = self._next(a.size - lo, last_only)
      part = a[lo:lo + size]
      n, past = part.size, self.cache.length
      chunk = np.zeros(size, np.int32)
      chunk[:n] = part
      pos = np.minimum(np.arange(past, past + size, dtype=np.int32), self.ctx - 1)  # padded rows: any position in the tables
      feeds = {"ids": chunk, "pos": pos}
      if kind in ("prefill", "long"): feeds["last"] = np.array([n - 1], np.int32)
      logits = self.plan(kind).run(feeds, vars={"past": past})[0]
      self.cache.advance(n)  # the plan wrote the chunk's keys and values at row past (its padded rows past them)
      rows.append(logits if last_only else logits[:n])
      lo += n
    return rows[-1][-1] if last_only else np.concatenate(rows, 0)

  def _next(self, left: int, last_only: bool) -> tuple[str, int]:
    """The plan for the next chunk of a feed with `left` tokens to go, and its rows."""
    if not last_only: return "all", self.chunk
    if left == 1 or self.chunk == 1: return "decode", 1
    if self.long > self.chunk and left > self.long - self.chunk: return "long", self.long
    return "prefill", self.chunk

  def reset(self, length: int = 0) -> None: self.cache.reset(length)
