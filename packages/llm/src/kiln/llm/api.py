"""`load(path)` and the LLM it returns: a checkpoint (GGUF file or Hugging Face folder), its tokenizer and a runtime.

```python
from kiln.llm import load
llm = load("model.gguf")                       # or a Hugging Face folder; context=N positions (default min(trained, 2048))
ids = llm.tokenizer.encode("Hello")
logits = llm.logits(ids)                       # (len(ids), vocab) float32, teacher-forced from an empty cache
for tok in llm.generate(ids, max_new_tokens=64, temperature=0.0): ...
for text in llm.chat([{"role": "user", "content": "Hi"}]): print(text, end="")
```

One LLM holds one KV cache: a generate() or chat() continues from the longest prefix of its prompt already cached (a
chat's earlier turns are not computed again), and two of its generators must not be interleaved.
Matrices in Q8_0, Q4_0, Q4_1, F16 or BF16 stay in their format (qweight.py: repacked once at load into planes no bigger
than the file's bytes, dequantised inside the kernels that read them); other formats (Q5_0, Q5_1, the K-quants) and the
vectors (norms, biases) are dequantised to float32 at load.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.llm.checkpoint import Checkpoint
from kiln.llm.checkpoint_open import open_checkpoint
from kiln.llm.config import ModelConfig
from kiln.llm.errors import LLMError
from kiln.llm.model import Matrix
from kiln.llm.qweight import QuantWeight, pack
from kiln.llm.runtime import DEFAULT_CHUNK, DEFAULT_LONG, Runner, checkpoint_key
from kiln.llm.sampling import Sampler, Stop
from kiln.llm.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_gguf_fields

DEFAULT_CONTEXT = 2048


@dataclass
class Timings:
  """The last generate()'s counts and seconds: prefill (the prompt's uncached tokens) and decode (one token per step)."""
  prefill_tokens: int = 0
  prefill_s: float = 0.0
  decode_tokens: int = 0
  decode_s: float = 0.0
  first_token_s: float = 0.0  # from the call to the first token

  def rate(self, tokens: int, s: float) -> float: return tokens / s if s > 0 else 0.0


@dataclass
class LLM:
  checkpoint: Checkpoint
  tokenizer: Tokenizer | None
  runner: Runner
  timings: Timings = field(default_factory=Timings)
  _cached: list[int] = field(default_factory=list)  # the tokens whose keys and values the cache holds

  @property
  def config(self) -> ModelConfig: return self.checkpoint.config

  @property
  def context(self) -> int: return self.runner.ctx

  def _tok(self) -> Tokenizer:
    if self.tokenizer is None: raise LLMError(f"{self.checkpoint.path} has no tokenizer (no tokenizer.json / GGUF vocabulary): pass token ids")
    return self.tokenizer

  def logits(self, ids: Sequence[int]) -> np.ndarray:
    """Every position's logits, (len(ids), vocab) float32, teacher-forced from an empty cache."""
    ids = _ids(ids)
    self._cached = []
    self.runner.reset()
    out = self.runner.feed(ids, last_only=False)
    self._cached = list(ids)
    return out.astype(np.float32, copy=False)

  def _prefill(self, ids: list[int]) -> np.ndarray:
    """The last prompt token's logits, reusing the longest cached prefix (at least one token is run)."""
    n = 0
    for a, b in zip(self._cached, ids[:-1]):
      if a != b: break
      n += 1
    self._cached = []  # unknown until the feed completes (a failed one leaves part of a chunk cached)
    self.runner.reset(n)
    out = self.runner.feed(ids[n:])
    self._cached = list(ids)
    self.timings.prefill_tokens = len(ids) - n
    return out

  def generate(self, ids: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stop: str | int | Iterable[str | int] | None = None,
               repetition_penalty: float = 1.0) -> Iterator[int]:
    """Token ids as they are produced, after the prompt `ids`: at most max_new_tokens, ending early at a stop token (the
    tokenizer's end-of-sequence and end-of-turn ids, and any int in `stop`) or once the text contains a string in `stop`.
    The stop token itself is not yielded; the tokens of a stop string are. temperature 0 is greedy."""
    ids = _ids(ids)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0: raise LLMError(f"max_new_tokens {max_new_tokens!r} must be an int >= 0")
    sampler = Sampler(temperature, top_k, top_p, repetition_penalty, seed)
    tok = self.tokenizer
    eos = tok.stop_ids if tok is not None else frozenset(self.config.eos_token_ids)
    stops = Stop.of(stop, eos, tok.decode if tok is not None else None)
    return self._generate(ids, max_new_tokens, sampler, stops)

  def _generate(self, ids: list[int], max_new: int, sampler: Sampler, stops: Stop) -> Iterator[int]:
    self.timings = t = Timings()
    if max_new == 0: return
    start = time.perf_counter()
    logits = self._prefill(ids)
    t.prefill_s = time.perf_counter() - start
    history, out = list(ids), []
    room = self.context - len(ids)
    for i in range(max_new):
      nxt = sampler.next(logits, history)
      if i == 0: t.first_token_s = time.perf_counter() - start
      if nxt in stops.ids: return
      yield nxt
      history.append(nxt)
      out.append(nxt)
      if stops.hit(out) or i + 1 == max_new or i + 1 > room: return  # i + 1 > room: the context is full, nothing more fits
      s = time.perf_counter()
      logits = self.runner.feed([nxt])
      self._cached.append(nxt)
      t.decode_s += time.perf_counter() - s
      t.decode_tokens += 1

  def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = 64, stop: str | Iterable[str | int] | None = None,
           **sampling: Any) -> Iterator[str]:
    """The reply to `messages` (the model's chat template applied), streamed as text pieces; sampling as generate()."""
    tok = self._tok()
    ids = tok.encode_chat(messages)
    stops = Stop.of(stop, (), tok.decode)
    pending = ""
    for piece in tok.stream(self.generate(ids, max_new_tokens, stop=stop, **sampling), skip_special=True):
      if not stops.strings:
        yield piece
        continue
      pending += piece  # hold back text that might begin a stop string
      cut = stops.trim(pending)
      if len(cut) < len(pending):
        if cut: yield cut
        return
      keep = max((len(s) - 1 for s in stops.strings), default=0)
      if len(pending) > keep:
        yield pending[:len(pending) - keep]
        pending = pending[len(pending) - keep:]
    if pending: yield stops.trim(pending)


def _ids(ids: Sequence[int]) -> list[int]:
  if isinstance(ids, str): raise LLMError("token ids are a list of ints: encode text with llm.tokenizer.encode first")
  out = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
  if not out: raise LLMError("no token ids: a prompt needs at least one token (a bos)")
  return out


def _tokenizer(ck: Checkpoint) -> Tokenizer | None:
  """The checkpoint's tokenizer, or None where it carries none (a folder without tokenizer.json, a GGUF without a vocabulary:
  no tokenizer.ggml.model, or the "none" / "no_vocab" llama.cpp writes and loads for a model without one)."""
  if os.path.isdir(ck.path): return load_tokenizer(ck.path) if "tokenizer.json" in ck.tokenizer_files else None
  meta = ck.tokenizer_metadata
  return tokenizer_from_gguf_fields(meta, ck.path) if meta.get("tokenizer.ggml.model") not in (None, "none", "no_vocab") else None


class Weights:
  """A checkpoint's weights by Hugging Face name for the forward graph (model.Get), each packed (qweight.pack) or
  dequantised once: every plan wraps the same arrays. A packed matrix's file pages are released once its planes are made."""
  def __init__(self, ck: Checkpoint):
    self.ck = ck
    self.arrays: dict[str, Matrix] = {}

  def __call__(self, name: str) -> Matrix:
    if (a := self.arrays.get(name)) is None:
      qt = self.ck.quant(name)
      if (a := pack(qt)) is not None: self.ck.release(name)  # its planes are the copy kept: the file's pages need not stay
      else: a = qt.dequantize()
      self.arrays[name] = a
    return a

  def stack(self, names: Sequence[str], outs: Sequence[int], inn: int) -> QuantWeight | None:
    """The packed matrices `names`, of shapes (outs[i], inn), as one (QuantWeight.stack), made once and kept in their
    place (their planes are copied into it); None where any is not packed, not of its shape, or they do not stack."""
    key = "+".join(names)
    if isinstance(got := self.arrays.get(key), QuantWeight): return got
    parts = [self(n) for n in names]
    if not all(isinstance(a, QuantWeight) and a.shape == (o, inn) for a, o in zip(parts, outs)): return None
    if (st := QuantWeight.stack([a for a in parts if isinstance(a, QuantWeight)])) is None: return None
    for n in names: del self.arrays[n]
    self.arrays[key] = st
    return st


def load(path: str | os.PathLike[str], context: int | None = None, chunk: int = DEFAULT_CHUNK, device: str = "CPU",
         long: int = DEFAULT_LONG) -> LLM:
  """The model at `path` (a GGUF file or a Hugging Face folder), ready to run `context` positions (default: its trained
  length, at most DEFAULT_CONTEXT); prompts run in chunks of `chunk` tokens (the last padded), and in chunks of `long`
  while that many are left (runtime.py). The plans compile on first use."""
  ck = open_checkpoint(path)
  cfg = ck.config
  ctx = min(cfg.max_position, DEFAULT_CONTEXT) if context is None else int(context)
  if not 1 <= ctx <= cfg.max_position and cfg.positions == "learned":
    raise LLMError(f"context {ctx}: {cfg.arch} has {cfg.max_position} learned positions")
  if ctx < 1: raise LLMError(f"context {ctx} must be at least 1")
  return LLM(ck, _tokenizer(ck), Runner(cfg, Weights(ck), ctx, chunk, device, long, key=lambda: checkpoint_key(ck)))
