"""Choosing the next token from logits: greedy (temperature 0), temperature, top-k, top-p and a repetition penalty, with
a seeded numpy Generator; and stop conditions (stop token ids, stop strings).

The order is Hugging Face's: the repetition penalty on the raw logits, then temperature, top-k, top-p."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kiln.llm.errors import LLMError


class SamplingError(LLMError):
  """A sampling setting out of its range (a negative temperature, top_p outside (0, 1], top_k < 1, a penalty <= 0)."""


@dataclass
class Sampler:
  """`next(logits, history)` -> token id. temperature 0 is greedy (argmax, the lowest id on ties); top_k keeps the k most
  likely, top_p the fewest whose probabilities add up to at least top_p; repetition_penalty > 1 makes tokens already in
  `history` less likely (a positive logit divided by it, a negative one multiplied); seed makes the draws repeatable."""
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  repetition_penalty: float = 1.0
  seed: int | None = None
  rng: np.random.Generator = field(init=False, repr=False)

  def __post_init__(self) -> None:
    if not (self.temperature >= 0 and np.isfinite(self.temperature)): raise SamplingError(f"temperature {self.temperature!r} must be a number >= 0")
    if self.top_k is not None and (not isinstance(self.top_k, int | np.integer) or self.top_k < 1):
      raise SamplingError(f"top_k {self.top_k!r} must be an int >= 1 (or None)")
    if self.top_p is not None and not 0 < self.top_p <= 1: raise SamplingError(f"top_p {self.top_p!r} must be in (0, 1] (or None)")
    if not self.repetition_penalty > 0: raise SamplingError(f"repetition_penalty {self.repetition_penalty!r} must be > 0")
    self.rng = np.random.default_rng(self.seed)

  def next(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
    x = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
    if self.repetition_penalty != 1.0 and len(history):
      seen = np.unique(np.asarray(history, dtype=np.int64))
      seen = seen[(seen >= 0) & (seen < x.size)]
      x[seen] = np.where(x[seen] > 0, x[seen] / self.repetition_penalty, x[seen] * self.repetition_penalty)
    if self.temperature == 0: return int(np.argmax(x))
    x = x / self.temperature
    if self.top_k is not None and self.top_k < x.size:
      kth = np.partition(x, -self.top_k)[-self.top_k]
      x[x < kth] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if self.top_p is not None and self.top_p < 1:
      order = np.argsort(-p, kind="stable")
      before = np.cumsum(p[order]) - p[order]  # the mass of the more likely tokens: keep each while it is under top_p
      drop = order[before >= self.top_p]
      p[drop] = 0
      p /= p.sum()
    return int(self.rng.choice(p.size, p=p))


@dataclass
class Stop:
  """When generation ends: a token in `ids` (end of sequence, end of turn), or the text generated so far containing one of
  `strings` (the tokens that complete it are still produced; the caller trims the text). `decode` turns ids into text."""
  ids: frozenset[int] = frozenset()
  strings: tuple[str, ...] = ()
  decode: Callable[[Sequence[int]], str] | None = None

  @staticmethod
  def of(stop: str | int | Iterable[str | int] | None, eos: Iterable[int], decode: Callable[[Sequence[int]], str] | None) -> Stop:
    """generate()'s `stop`: token ids (ints) and stop strings (strs), one or a list, beside the model's own end tokens."""
    items = [] if stop is None else [stop] if isinstance(stop, str | int) else list(stop)
    ids, strs = set(eos), []
    for s in items:
      if isinstance(s, bool) or not isinstance(s, str | int | np.integer): raise SamplingError(f"stop takes token ids and strings, got {s!r}")
      if isinstance(s, str):
        if not s: raise SamplingError("stop: an empty stop string")
        strs.append(s)
      else: ids.add(int(s))
    if strs and decode is None: raise SamplingError("stop strings need a tokenizer to decode the generated tokens")
    return Stop(frozenset(ids), tuple(strs), decode)

  def hit(self, generated: Sequence[int]) -> bool:
    """Whether the last token generated ends generation."""
    if generated and generated[-1] in self.ids: return True
    if not self.strings or self.decode is None: return False
    longest = max(len(s) for s in self.strings)
    tail = self.decode(list(generated[-(longest + 8):]))  # a stop string's characters come from at most that many tokens
    return any(s in tail for s in self.strings)

  def trim(self, text: str) -> str:
    """text up to the first stop string in it."""
    cut = min((i for s in self.strings if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]
