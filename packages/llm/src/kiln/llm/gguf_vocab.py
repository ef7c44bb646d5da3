"""A GGUF file's own vocabulary (its tokenizer.ggml.* fields), checked, and what its two tokenizers share: the special
tokens matched in text, the stop ids, bos/eos/add_bos. bpe.py (tokenizer.ggml.model "gpt2") and spm.py ("llama") encode.

Fields read (llama.cpp's meaning, llama-vocab.cpp):
  tokenizer.ggml.model         "gpt2" (byte-level BPE) or "llama" (SentencePiece); others ("bert", "t5", "rwkv", "none",
                               "plamo2") are refused by name
  tokenizer.ggml.pre           gpt2 only: the pre-tokenizer (pretokenize.PRE_TOKENIZERS); absent is "default"
  tokenizer.ggml.tokens        the token texts (gpt2: in GPT-2's byte-to-unicode alphabet; llama: "▁" for a space)
  tokenizer.ggml.token_type    1 NORMAL, 2 UNKNOWN, 3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE (absent: all NORMAL)
  tokenizer.ggml.scores        llama: a piece's merge priority, higher first (absent: all 0)
  tokenizer.ggml.merges        gpt2: "left right" rules, earlier first
  tokenizer.ggml.{bos,eos,eot,eom,unknown,padding}_token_id, add_bos_token, add_eos_token, add_space_prefix
  tokenizer.chat_template      the jinja2 chat template
Of tokens with the same text the last wins the lookup (llama.cpp's token_to_id), a merge repeated keeps its first
rank (llama.cpp's bpe_ranks). Absent bos/eos ids stay None (llama.cpp guesses 1/2 or 11; kiln does not guess); an id
outside the vocabulary is ignored with a warning, as llama.cpp does.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.llm.tokenizer_base import (
  END_OF_GENERATION_TEXTS,
  MAX_MERGES,
  MAX_TEMPLATE_CHARS,
  MAX_TOKEN_BYTES,
  MAX_VOCAB,
  ChatTemplateError,
  Tokenizer,
  TokenizerError,
  limit,
)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SUPPORTED_MODELS = ("gpt2", "llama")
_PREFIX = "tokenizer.ggml."


@dataclasses.dataclass(frozen=True)
class Vocab:
  source: str
  model: str
  pre: str
  tokens: list[str]
  types: list[int]
  scores: list[float]
  merges: list[tuple[str, str]]
  bos_id: int | None
  eos_id: int | None
  eot_id: int | None
  eom_id: int | None
  unk_id: int | None
  pad_id: int | None
  add_bos: bool
  add_eos: bool
  add_space_prefix: bool
  chat_template: str | None


def _get(fields: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
  value = fields.get(key)
  wrong = value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is int))
  if wrong:
    raise TokenizerError(f"{source}: {key} is a {type(value).__name__}, not {getattr(kind, '__name__', kind)}")
  return value


def _list(fields: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str, length: int | None) -> list[Any] | None:
  value = fields.get(key)
  if value is None: return None
  if not isinstance(value, (list, tuple)): raise TokenizerError(f"{source}: {key} is a {type(value).__name__}, not an array")
  if length is not None and len(value) != length: raise TokenizerError(f"{source}: {key} has {len(value)} entries for {length} tokens")
  for v in value:
    if not isinstance(v, kind) or isinstance(v, bool):
      raise TokenizerError(f"{source}: {key} holds a {type(v).__name__} ({v!r:.40}), not {getattr(kind, '__name__', kind)}")
  return list(value)


def vocab_from_fields(fields: Mapping[str, Any], source: str) -> Vocab:
  """The vocabulary the GGUF metadata fields describe (values as Python str / int / float / bool / lists), checked."""
  model = _get(fields, _PREFIX + "model", str, source)
  if model is None: raise TokenizerError(f"{source}: no tokenizer.ggml.model: the file carries no vocabulary")
  if model not in SUPPORTED_MODELS:
    raise TokenizerError(f"{source}: tokenizer.ggml.model {model!r} is not supported (supported: {', '.join(SUPPORTED_MODELS)})")
  tokens = _list(fields, _PREFIX + "tokens", str, source, None)
  if not tokens: raise TokenizerError(f"{source}: tokenizer.ggml.tokens is missing or empty")
  n = len(tokens)
  limit(f"{source}: tokenizer.ggml.tokens' count", n, "MAX_VOCAB", MAX_VOCAB)
  longest = max(len(t.encode("utf-8", "surrogatepass")) for t in tokens)
  limit(f"{source}: the longest token's bytes", longest, "MAX_TOKEN_BYTES", MAX_TOKEN_BYTES)
  types = _list(fields, _PREFIX + "token_type", int, source, n) or [NORMAL] * n
  bad = next((t for t in types if not NORMAL <= t <= BYTE), None)
  if bad is not None: raise TokenizerError(f"{source}: tokenizer.ggml.token_type holds {bad}, not a token type 1..6")
  scores = [float(s) for s in _list(fields, _PREFIX + "scores", (float, int), source, n) or [0.0] * n]
  merges: list[tuple[str, str]] = []
  if model == "gpt2":
    rules = _list(fields, _PREFIX + "merges", str, source, None)
    if rules is None: raise TokenizerError(f"{source}: a gpt2 vocabulary needs tokenizer.ggml.merges")
    limit(f"{source}: tokenizer.ggml.merges' count", len(rules), "MAX_MERGES", MAX_MERGES)
    for rule in rules:
      cut = rule.find(" ", 1)   # from 1: a rule's left part may itself begin with a space (llama.cpp's reading)
      if cut < 0: raise TokenizerError(f"{source}: tokenizer.ggml.merges holds {rule!r:.60}, not 'left right'")
      merges.append((rule[:cut], rule[cut + 1:]))
  pre = _get(fields, _PREFIX + "pre", str, source) or "default"

  def token_id(key: str) -> int | None:
    value = _get(fields, _PREFIX + key, int, source)
    if value is not None and not 0 <= value < n:   # llama.cpp too warns and goes on: files write -1 as 2**32 - 1 for "none"
      warnings.warn(f"{source}: tokenizer.ggml.{key} {value} is outside the vocabulary [0, {n}): ignored", stacklevel=3)
      return None
    return value

  def flag(key: str, default: bool) -> bool:
    value = _get(fields, _PREFIX + key, (bool, int), source)
    return default if value is None else bool(value)

  from kiln.llm.pretokenize import PRE_TOKENIZERS
  if model == "gpt2" and pre not in PRE_TOKENIZERS:
    raise TokenizerError(f"{source}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer kiln knows (known: {', '.join(sorted(PRE_TOKENIZERS))})")
  # llama.cpp's defaults where the file is silent: SentencePiece adds bos and a space prefix; Llama 3's BPE adds bos
  add_bos_default = model == "llama" or PRE_TOKENIZERS.get(pre, ((), False))[1]
  template = _get(fields, "tokenizer.chat_template", str, source)
  if template is not None:
    limit(f"{source}: tokenizer.chat_template's characters", len(template), "MAX_TEMPLATE_CHARS", MAX_TEMPLATE_CHARS, ChatTemplateError)
  return Vocab(source, model, pre, tokens, types, scores, merges,
               token_id("bos_token_id"), token_id("eos_token_id"), token_id("eot_token_id"), token_id("eom_token_id"),
               token_id("unknown_token_id"), token_id("padding_token_id"),
               flag("add_bos_token", add_bos_default), flag("add_eos_token", False), flag("add_space_prefix", model == "llama"),
               template)


def read_gguf_fields(path: str) -> dict[str, Any]:
  """The tokenizer.* metadata of a GGUF file as Python values (arrays as lists), parsed by kiln.llm.gguf_file (its limits
  and CheckpointErrors for a malformed file)."""
  from kiln.llm.gguf_file import GGUFFile
  meta = GGUFFile(path).metadata
  return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in meta.items() if k.startswith("tokenizer.")}


class VocabTokenizer(Tokenizer):
  """What the gpt2 and llama tokenizers of a GGUF vocabulary share. Special tokens (CONTROL, USER_DEFINED and UNKNOWN, as
  llama.cpp caches them) written in text are matched first, leftmost and then longest, and become their ids; with
  parse_special=False only USER_DEFINED ones are (llama.cpp's parse_special). Subclasses encode the text between them."""

  def __init__(self, vocab: Vocab):
    self.vocab = vocab
    self.source = vocab.source
    self.vocab_size = len(vocab.tokens)
    self.bos_id, self.eos_id = vocab.bos_id, vocab.eos_id
    self.add_bos, self.add_eos = vocab.add_bos, vocab.add_eos
    self.chat_template = vocab.chat_template
    self.ids: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
      self.ids[t] = i
    stops = {i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None}
    stops.update(self.ids[t] for t in END_OF_GENERATION_TEXTS if t in self.ids)
    self.stop_ids = frozenset(stops)
    special = [(t, i) for i, t in enumerate(vocab.tokens) if vocab.types[i] in (CONTROL, USER_DEFINED, UNKNOWN) and t]
    self.special_ids = {t: self.ids[t] for t, _ in special}
    self._all_special = _alternation([t for t, _ in special])
    self._user_defined = _alternation([t for t, i in special if vocab.types[i] == USER_DEFINED])

  def token_to_id(self, text: str) -> int | None:
    return self.ids.get(text)

  def id_to_token(self, token_id: int) -> str:
    self.check_ids([token_id])
    return self.vocab.tokens[token_id]

  def _encode_text(self, text: str, parse_special: bool) -> list[int]:
    rx = self._all_special if parse_special else self._user_defined
    out: list[int] = []
    pos, after_special = 0, True
    if rx is not None:
      for m in rx.finditer(text):
        if m.start() > pos: self._encode_segment(text[pos:m.start()], after_special, out)
        out.append(self.special_ids[m.group()])
        pos, after_special = m.end(), True
    if pos < len(text): self._encode_segment(text[pos:], after_special, out)
    return out

  def _encode_segment(self, text: str, after_special: bool, out: list[int]) -> None:
    raise NotImplementedError

  def is_special(self, token_id: int) -> bool:
    return self.vocab.types[token_id] in (CONTROL, UNKNOWN)


def _alternation(texts: list[str]) -> re.Pattern[str] | None:
  """One expression matching any of texts, leftmost first and then longest (Hugging Face's added-token matcher)."""
  if not texts: return None
  return re.compile("|".join(re.escape(t) for t in sorted(set(texts), key=len, reverse=True)))
