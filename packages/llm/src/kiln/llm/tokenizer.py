"""A model's tokenizer: `load_tokenizer(path)` for a Hugging Face folder (tokenizer.json, hf_tokenizer.py) or a GGUF file's
own vocabulary (gguf_vocab.py: byte-level BPE in bpe.py, SentencePiece in spm.py); each is a tokenizer_base.Tokenizer with
encode, decode, bos_id, eos_id, stop_ids, vocab_size, add_bos and apply_chat_template (chat.py)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kiln.llm.chat import CHATML
from kiln.llm.gguf_vocab import Vocab, read_gguf_fields, vocab_from_fields
from kiln.llm.tokenizer_base import ChatTemplateError, Tokenizer, TokenizerError

__all__ = ["CHATML", "ChatTemplateError", "Tokenizer", "TokenizerError", "load_tokenizer", "tokenizer_from_gguf_fields"]


def load_tokenizer(source: str | os.PathLike[str]) -> Tokenizer:
  """The tokenizer of a Hugging Face folder (its tokenizer.json) or of a GGUF file (its tokenizer.ggml.* fields)."""
  path = os.fspath(source)
  if os.path.isdir(path):
    from kiln.llm.hf_tokenizer import HFTokenizer
    return HFTokenizer(path)
  if not os.path.exists(path): raise TokenizerError(f"{path}: no such file or folder")
  return tokenizer_from_gguf_fields(read_gguf_fields(path), path)


def tokenizer_from_gguf_fields(fields: Mapping[str, Any], source: str) -> Tokenizer:
  """The tokenizer a GGUF file's metadata describes (fields: key -> Python value, as read_gguf_fields gives)."""
  return tokenizer_from_vocab(vocab_from_fields(fields, source))


def tokenizer_from_vocab(vocab: Vocab) -> Tokenizer:
  if vocab.model == "gpt2":
    from kiln.llm.bpe import ByteLevelBPE
    return ByteLevelBPE(vocab)
  from kiln.llm.spm import SentencePiece
  return SentencePiece(vocab)
