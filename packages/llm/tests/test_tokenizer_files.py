"""Tokenizers loaded from files: a GGUF written with gguf.GGUFWriter carrying its vocabulary, and a Hugging Face folder
(tokenizer.json, tokenizer_config.json, generation_config.json). Both give the ids Hugging Face tokenizers gives."""
from __future__ import annotations

import json

import gguf
import pytest
from tokenizer_case import CORPUS, gguf_bpe_fields, gguf_spm_fields, hf_bpe, hf_spm

from kiln.llm.bpe import ByteLevelBPE
from kiln.llm.errors import CheckpointError
from kiln.llm.hf_tokenizer import HFTokenizer
from kiln.llm.spm import SentencePiece
from kiln.llm.tokenizer import TokenizerError, load_tokenizer

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_gguf(path, fields, template=None):
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model(fields["tokenizer.ggml.model"])
  if "tokenizer.ggml.pre" in fields: w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
  w.add_token_list(fields["tokenizer.ggml.tokens"])
  w.add_token_types(fields["tokenizer.ggml.token_type"])
  if "tokenizer.ggml.merges" in fields: w.add_token_merges(fields["tokenizer.ggml.merges"])
  if "tokenizer.ggml.scores" in fields: w.add_token_scores(fields["tokenizer.ggml.scores"])
  w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
  w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
  w.add_add_bos_token(fields.get("tokenizer.ggml.add_bos_token", True))
  if template: w.add_chat_template(template)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_gguf_byte_level_bpe(tmp_path):
  path = tmp_path / "bpe.gguf"
  write_gguf(path, gguf_bpe_fields("qwen2"), TEMPLATE)
  tok = load_tokenizer(path)
  assert isinstance(tok, ByteLevelBPE) and tok.vocab.pre == "qwen2" and not tok.add_bos
  theirs = hf_bpe("qwen2")
  for text in CORPUS:
    assert tok.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text
  assert tok.chat_template == TEMPLATE
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_gguf_sentencepiece(tmp_path):
  path = tmp_path / "spm.gguf"
  write_gguf(path, gguf_spm_fields())
  tok = load_tokenizer(path)
  assert isinstance(tok, SentencePiece) and tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2 and tok.vocab.scores[-1] < 0
  theirs = hf_spm()
  for text in CORPUS:
    assert tok.encode(text) == [1] + theirs.encode(text, add_special_tokens=False).ids, text


def test_gguf_without_a_vocabulary(tmp_path):
  path = tmp_path / "none.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(TokenizerError, match="no tokenizer.ggml.model"):
    load_tokenizer(path)
  (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
  with pytest.raises(CheckpointError):   # kiln.llm.gguf_file's parser refuses it
    load_tokenizer(tmp_path / "junk.gguf")


def hf_folder(tmp_path, config=None, generation=None):
  tok = hf_bpe("gpt2")
  tok.save(str(tmp_path / "tokenizer.json"))
  if config is not None: (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  if generation is not None: (tmp_path / "generation_config.json").write_text(json.dumps(generation))
  return tok


def test_hugging_face_folder(tmp_path):
  config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True, "chat_template": TEMPLATE}
  theirs = hf_folder(tmp_path, config, {"eos_token_id": [0, 2]})
  tok = load_tokenizer(tmp_path)
  assert isinstance(tok, HFTokenizer)
  assert tok.bos_id == theirs.token_to_id("<|endoftext|>") and tok.eos_id == theirs.token_to_id("<|im_end|>") and tok.add_bos
  assert tok.stop_ids == {0, 2}
  for text in CORPUS:
    ids = tok.encode(text)
    assert ids == [tok.bos_id] + theirs.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids[1:]) == text
  start = theirs.token_to_id("<|im_start|>")
  assert tok.encode("<|im_start|>", add_special=False) == [start] and tok.encode("<|im_start|>", add_special=False, parse_special=False) != [start]
  assert tok.encode_chat([{"role": "user", "content": "hi"}]) == tok.encode("<|im_start|>user\nhi<|im_end|>\n")


def test_hugging_face_folder_without_config(tmp_path):
  hf_folder(tmp_path)
  tok = load_tokenizer(tmp_path)
  assert tok.bos_id is None and not tok.add_bos and tok.chat_template is None
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"  # ChatML


def test_a_null_bos_token_is_no_bos(tmp_path):
  # Qwen2's tokenizer_config says bos_token: null while its config.json names a bos_token_id: the tokenizer has no bos
  hf_folder(tmp_path, {"bos_token": None, "eos_token": "<|im_end|>"}, {"bos_token_id": 0, "eos_token_id": 2})
  tok = load_tokenizer(tmp_path)
  assert tok.bos_id is None and tok.eos_id == 2 and not tok.add_bos


def test_stream_equals_decode(tmp_path):
  hf_spm().save(str(tmp_path / "tokenizer.json"))   # its decoder strips the first token's leading space: the stream strips it once
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  tok = load_tokenizer(tmp_path)
  for text in CORPUS:
    ids = tok.encode(text.replace("<|im_end|>", "</s>"))
    assert "".join(tok.stream(ids)) == tok.decode(ids), text


def test_text_must_be_unicode(tmp_path):
  hf_folder(tmp_path)
  for tok in (load_tokenizer(tmp_path), load_tokenizer_of(gguf_spm_fields())):
    with pytest.raises(TokenizerError, match="lone surrogate at index 1"):
      tok.encode("a\ud800b")
    with pytest.raises(TokenizerError, match="takes a str"):
      tok.encode(b"bytes")


def load_tokenizer_of(fields):
  from kiln.llm.tokenizer import tokenizer_from_gguf_fields
  return tokenizer_from_gguf_fields(fields, "t.gguf")


def test_hugging_face_folder_errors(tmp_path):
  with pytest.raises(TokenizerError, match="no tokenizer.json"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(TokenizerError, match="cannot be read by tokenizers"):
    load_tokenizer(tmp_path)
  hf_folder(tmp_path, config={"chat_template": 5})
  with pytest.raises(TokenizerError, match="not a string"):
    load_tokenizer(tmp_path)


def test_limits(tmp_path, monkeypatch):
  from kiln.llm import gguf_vocab, hf_tokenizer
  from kiln.llm.tokenizer import tokenizer_from_gguf_fields
  monkeypatch.setattr(gguf_vocab, "MAX_MERGES", 10)
  with pytest.raises(TokenizerError, match="MAX_MERGES = 10"):
    tokenizer_from_gguf_fields(gguf_bpe_fields("gpt2"), "big.gguf")
  monkeypatch.setattr(gguf_vocab, "MAX_VOCAB", 100)
  with pytest.raises(TokenizerError, match="MAX_VOCAB = 100"):
    tokenizer_from_gguf_fields(gguf_spm_fields(), "big.gguf")
  hf_folder(tmp_path)
  monkeypatch.setattr(hf_tokenizer, "MAX_TOKENIZER_JSON_BYTES", 1000)
  with pytest.raises(TokenizerError, match="MAX_TOKENIZER_JSON_BYTES = 1000"):
    load_tokenizer(tmp_path)

