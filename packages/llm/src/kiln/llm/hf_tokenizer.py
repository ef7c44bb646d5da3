"""The tokenizer of a Hugging Face folder: tokenizer.json through the `tokenizers` library (its normalizer, pre-tokenizer,
model and added tokens are what the model was trained with), and beside it:
  tokenizer_config.json    bos_token, eos_token, add_bos_token, add_eos_token, chat_template (a string, or a list of named
                           templates of which "default" is taken)
  chat_template.jinja      the template where tokenizer_config.json has none (newer transformers save it apart)
  generation_config.json   eos_token_id (an id or a list: each is a stop id), bos_token_id where the config names none
Where tokenizer_config.json does not say add_bos_token / add_eos_token, they are what tokenizer.json's post-processor adds
(encode "a" with and without special tokens and compare), which is what transformers' encode does.
"""
from __future__ import annotations

import json
import os
from typing import Any

from kiln.ir.files import open_regular
from kiln.llm.tokenizer_base import (
  END_OF_GENERATION_TEXTS,
  MAX_TEMPLATE_CHARS,
  MAX_TOKENIZER_CONFIG_BYTES,
  MAX_TOKENIZER_JSON_BYTES,
  MAX_VOCAB,
  ChatTemplateError,
  Tokenizer,
  TokenizerError,
  limit,
)


def read_text(path: str, what: str, maximum: int, name: str) -> str:
  """The UTF-8 text of the regular file at path, refused past maximum bytes before it is read."""
  fd = open_regular(path, what, TokenizerError)
  with os.fdopen(fd, "rb") as f:
    limit(f"{path}: {what}'s size in bytes", os.fstat(f.fileno()).st_size, name, maximum)
    data = f.read(maximum + 1)
  limit(f"{path}: {what}'s size in bytes", len(data), name, maximum)
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise TokenizerError(f"{path}: {what} is not UTF-8 ({e})") from e


def _json(folder: str, name: str) -> dict[str, Any]:
  path = os.path.join(folder, name)
  if not os.path.exists(path): return {}
  try:
    value = json.loads(read_text(path, name, MAX_TOKENIZER_CONFIG_BYTES, "MAX_TOKENIZER_CONFIG_BYTES"))
  except json.JSONDecodeError as e:
    raise TokenizerError(f"{path}: {name} is not JSON ({e})") from e
  if not isinstance(value, dict): raise TokenizerError(f"{path}: {name} holds a {type(value).__name__}, not an object")
  return value


def _token_text(value: Any) -> str | None:
  if isinstance(value, dict): value = value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
  def __init__(self, folder: str):
    from tokenizers import Tokenizer as HFTok
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
      raise TokenizerError(f"{folder}: no tokenizer.json (kiln reads a Hugging Face tokenizer from tokenizer.json; a SentencePiece "
                           "tokenizer.model alone is not read)")
    self.source = path
    text = read_text(path, "tokenizer.json", MAX_TOKENIZER_JSON_BYTES, "MAX_TOKENIZER_JSON_BYTES")
    try:
      self._tok = HFTok.from_str(text)
    except Exception as e:   # the Rust parser's errors are plain Exceptions
      raise TokenizerError(f"{path}: tokenizer.json cannot be read by tokenizers ({e})") from e
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    limit(f"{path}: the vocabulary's size", self.vocab_size, "MAX_VOCAB", MAX_VOCAB)
    config = _json(folder, "tokenizer_config.json")
    gen = _json(folder, "generation_config.json")
    model = _json(folder, "config.json")

    def config_id(key: str) -> int | None:
      name = key.replace("_id", "")
      if name in config:   # the tokenizer's own word, null included (Qwen2's bos_token: null), as transformers reads it
        text = _token_text(config[name])
        return None if text is None else self._tok.token_to_id(text)
      for src in (gen, model):
        value = src.get(key)
        if isinstance(value, list): value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool): return value
      return None

    self.bos_id, self.eos_id = config_id("bos_token_id"), config_id("eos_token_id")
    for key, value in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id)):
      if value is not None and not 0 <= value < self.vocab_size: raise TokenizerError(f"{folder}: {key} {value} is outside the vocabulary")
    with_special = self._tok.encode("a", add_special_tokens=True).ids
    plain = self._tok.encode("a", add_special_tokens=False).ids
    probe_bos = len(with_special) > len(plain) and with_special[0] == self.bos_id
    probe_eos = len(with_special) > len(plain) and with_special[-1] == self.eos_id
    self.add_bos = bool(config.get("add_bos_token", probe_bos))
    self.add_eos = bool(config.get("add_eos_token", probe_eos))
    stops = {i for i in (self.eos_id,) if i is not None}
    for src in (gen, model):
      value = src.get("eos_token_id")
      for i in value if isinstance(value, list) else [value]:
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size: stops.add(i)
    stops.update(i for t in END_OF_GENERATION_TEXTS if (i := self._tok.token_to_id(t)) is not None)
    self.stop_ids = frozenset(stops)
    self.chat_template = self._template(folder, config)
    self._special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

  def _template(self, folder: str, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    if template is None:
      path = os.path.join(folder, "chat_template.jinja")
      if os.path.exists(path): template = read_text(path, "chat_template.jinja", MAX_TOKENIZER_CONFIG_BYTES, "MAX_TOKENIZER_CONFIG_BYTES")
    if template is None: return None
    if not isinstance(template, str): raise TokenizerError(f"{folder}: chat_template is a {type(template).__name__}, not a string")
    limit(f"{folder}: the chat template's characters", len(template), "MAX_TEMPLATE_CHARS", MAX_TEMPLATE_CHARS, ChatTemplateError)
    return template

  def _encode_text(self, text: str, parse_special: bool) -> list[int]:
    self._tok.encode_special_tokens = not parse_special
    try:
      return list(self._tok.encode(text, add_special_tokens=False).ids)
    finally:
      self._tok.encode_special_tokens = False

  def _decode(self, ids: list[int], skip_special: bool) -> str:
    return str(self._tok.decode(ids, skip_special_tokens=skip_special))

  def token_to_id(self, text: str) -> int | None:
    return self._tok.token_to_id(text)

  def id_to_token(self, token_id: int) -> str:
    self.check_ids([token_id])
    text = self._tok.id_to_token(token_id)
    if text is None: raise TokenizerError(f"{self.source}: no token has id {token_id}")
    return str(text)

  def is_special(self, token_id: int) -> bool:
    return token_id in self._special
