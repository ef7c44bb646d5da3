"""What every kiln.llm tokenizer offers (Tokenizer), its errors, and the limits on the untrusted files it is made from.

The errors and limits live in tokenizer_limits (below chat.py, which this module renders through) and are re-exported here.
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from kiln.llm.chat import render_chat
from kiln.llm.tokenizer_limits import (
  MAX_MERGES,
  MAX_RENDERED_CHARS,
  MAX_TEMPLATE_CHARS,
  MAX_TOKEN_BYTES,
  MAX_TOKENIZER_CONFIG_BYTES,
  MAX_TOKENIZER_JSON_BYTES,
  MAX_VOCAB,
  ChatTemplateError,
  TokenizerError,
  limit,
)

__all__ = ["END_OF_GENERATION_TEXTS", "MAX_MERGES", "MAX_RENDERED_CHARS", "MAX_TEMPLATE_CHARS", "MAX_TOKENIZER_CONFIG_BYTES",
           "MAX_TOKENIZER_JSON_BYTES", "MAX_TOKEN_BYTES", "MAX_VOCAB", "ChatTemplateError", "StreamDecoder", "Tokenizer", "TokenizerError",
           "limit", "utf8_text"]

# Texts of tokens that end a turn or the text: besides the file's eos (and eot / eom) ids, a vocabulary token with one of
# these texts is a stop token (llama.cpp's end-of-generation list in llama-vocab.cpp, plus "</s>" and "<|end_of_text|>", the
# eos texts of SentencePiece models and Llama 3, for a file that leaves its eos id out).
END_OF_GENERATION_TEXTS = frozenset({
  "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
  "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>", "</s>", "<|end_of_text|>",
})


class Tokenizer:
  """A model's tokenizer. Subclasses set the attributes and implement _encode_text, decode and the token tables.

  encode(text) cuts the text at the special tokens written in it (CONTROL and USER_DEFINED tokens of a GGUF vocabulary,
  the added tokens of a tokenizer.json), which become their ids, and tokenizes the rest; with add_special (the default) it
  puts bos first when the file says add_bos (and eos last when it says add_eos), as Hugging Face's encode and llama.cpp's
  tokenize do. decode(ids) is its inverse, so decode(encode(t)) == t: the bos that encode puts first (eos last) as the file
  says is taken off again (strip_added=False keeps it), special tokens are written as their text unless skip_special."""

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  stop_ids: frozenset[int]     # eos, eot, eom and the end-of-turn tokens END_OF_GENERATION_TEXTS names
  add_bos: bool
  add_eos: bool
  chat_template: str | None    # the template the file carries (None: apply_chat_template's fallback, see chat.py)
  source: str                  # the file it was read from, for messages

  def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
    if not isinstance(text, str): raise TokenizerError(f"{self.source}: encode takes a str, not {type(text).__name__}")
    if not text.isascii():
      try: text.encode("utf-8")
      except UnicodeEncodeError as e:
        raise TokenizerError(f"{self.source}: the text holds a lone surrogate at index {e.start}, not Unicode text") from None
    ids = self._encode_text(text, parse_special)
    if add_special:
      if self.add_bos and self.bos_id is not None: ids.insert(0, self.bos_id)
      if self.add_eos and self.eos_id is not None: ids.append(self.eos_id)
    return ids

  def _encode_text(self, text: str, parse_special: bool) -> list[int]:
    raise NotImplementedError

  def decode(self, ids: Iterable[int], skip_special: bool = False, strip_added: bool = True) -> str:
    ids = self.check_ids(list(ids))
    if strip_added:
      if self.add_bos and ids[:1] == [self.bos_id]: ids = ids[1:]
      if self.add_eos and ids[-1:] == [self.eos_id]: ids = ids[:-1]
    return self._decode(ids, skip_special)

  def _decode(self, ids: list[int], skip_special: bool) -> str:
    raise NotImplementedError

  def token_to_id(self, text: str) -> int | None:
    raise NotImplementedError

  def id_to_token(self, token_id: int) -> str:
    raise NotImplementedError

  def check_ids(self, ids: Sequence[int]) -> list[int]:
    out = [int(i) for i in ids]
    for i in out:
      if not 0 <= i < self.vocab_size: raise TokenizerError(f"{self.source}: token id {i} is outside the vocabulary [0, {self.vocab_size})")
    return out

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
    """The conversation as the model's chat template writes it (kiln.llm.chat: sandboxed jinja2), ready for encode."""
    return render_chat(self, messages, add_generation_prompt, extra)

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
    """apply_chat_template, encoded; bos is put first when the file says add_bos and the template did not write it."""
    ids = self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special=False)
    if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]: ids.insert(0, self.bos_id)
    return ids

  def stream(self, ids: Iterable[int], skip_special: bool = False) -> Iterator[str]:
    """Text as ids arrive: each piece once its bytes make whole characters (a character split over tokens waits)."""
    decoder = StreamDecoder(self, skip_special)
    for i in ids:
      piece = decoder.push(i)
      if piece: yield piece
    rest = decoder.flush()
    if rest: yield rest


class StreamDecoder:
  """Incremental decode: push(id) returns the text the id completes. It decodes a short window of recent ids and emits what
  the window adds past the text already given, holding back a trailing U+FFFD (a character whose bytes are not all in yet).
  The window starts at the ids given last time, so a tokenizer that strips the first token's leading space (SentencePiece)
  strips it from text already given, not from the new piece."""

  def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
    self.skip_special = skip_special
    self.decode = lambda ids, skip: tokenizer.decode(ids, skip, strip_added=False)
    # decode's strip_added: a bos first, as encode puts it, gives no text
    self.skip_bos = tokenizer.bos_id if tokenizer.add_bos else None
    self.ids: list[int] = []
    self.prefix = 0   # the window's start
    self.read = 0     # ids whose text is already given

  def push(self, token_id: int) -> str:
    first, self.skip_bos = self.skip_bos, None
    if not self.ids and token_id == first: return ""
    self.ids.append(int(token_id))
    decode = self.decode
    before = decode(self.ids[self.prefix:self.read], self.skip_special)
    now = decode(self.ids[self.prefix:], self.skip_special)
    if now.endswith("\ufffd") or len(now) <= len(before): return ""
    self.prefix, self.read = self.read, len(self.ids)
    return now[len(before):]

  def flush(self) -> str:
    decode = self.decode
    before, now = decode(self.ids[self.prefix:self.read], self.skip_special), decode(self.ids[self.prefix:], self.skip_special)
    self.prefix = self.read = len(self.ids)
    return now[len(before):]


def utf8_text(data: bytes) -> str:
  """Bytes decoded as UTF-8, a malformed sequence as U+FFFD (what Hugging Face's and llama.cpp's detokenizers write)."""
  return codecs.decode(data, "utf-8", errors="replace")
