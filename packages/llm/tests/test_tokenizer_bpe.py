"""kiln's byte-level BPE of a GGUF vocabulary against Hugging Face tokenizers on the same vocabulary and merges: exactly the
same ids for every pre-tokenizer kiln knows, special tokens written in the text included, and decode inverting encode."""
from __future__ import annotations

import pytest
from tokenizer_case import CORPUS, SPECIALS, gguf_bpe_fields, hf_bpe, random_texts
from tokenizers import Tokenizer, models

from kiln.llm.bpe import ByteLevelBPE, byte_alphabet, merge
from kiln.llm.pretokenize import PRE_TOKENIZERS, PreTokenizer
from kiln.llm.tokenizer import TokenizerError, tokenizer_from_gguf_fields

TEXTS = CORPUS + random_texts(1, 150)


@pytest.mark.parametrize("pre", ["gpt2", "default", "llama-bpe", "qwen2", "smollm"])
def test_ids_equal_hugging_face(pre):
  ours = tokenizer_from_gguf_fields(gguf_bpe_fields(pre), "test.gguf")
  assert isinstance(ours, ByteLevelBPE)
  theirs = hf_bpe(pre)
  for text in TEXTS:
    want = theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, add_special=False) == want, text
    assert ours.decode(want) == theirs.decode(want, skip_special_tokens=False) == text


def test_special_tokens_in_text_become_their_ids():
  tok = tokenizer_from_gguf_fields(gguf_bpe_fields("gpt2"), "test.gguf")
  start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special=False)
  assert ids[0] == start and ids[-1] == end and start not in ids[1:-1]
  assert tok.encode("<|im_start|>", add_special=False, parse_special=False) != [start]   # written as text when asked
  assert tok.decode(ids, skip_special=True) == "user\nhi"
  assert tok.stop_ids == {tok.token_to_id(t) for t in SPECIALS if t != "<|im_start|>"}   # eos, and <|endoftext|> by its text


def test_add_bos_as_the_file_says():
  fields = gguf_bpe_fields("gpt2") | {"tokenizer.ggml.add_bos_token": True}
  tok = tokenizer_from_gguf_fields(fields, "test.gguf")
  assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id and tok.encode("hi", add_special=False)[0] != tok.bos_id
  assert not tokenizer_from_gguf_fields(gguf_bpe_fields("gpt2"), "t").add_bos
  llama3 = gguf_bpe_fields("llama-bpe")
  del llama3["tokenizer.ggml.add_bos_token"]
  assert tokenizer_from_gguf_fields(llama3, "t").add_bos   # llama.cpp's default for Llama 3's pre-tokenizer


def test_merge_order_is_rank_then_leftmost():
  # a=0 b=1 ab=2 ba=3; "ab" ranks before "ba": a b a b -> ab ab; with "ba" first: a ba b
  merges = {(0, 1): (0, 2), (1, 0): (1, 3)}
  assert merge([0, 1, 0, 1], merges) == [2, 2]
  assert merge([0, 1, 0, 1], {(0, 1): (1, 2), (1, 0): (0, 3)}) == [0, 3, 1]
  # a merge made of a merge may rank before the pair it was made from: priority order, not "all of a pair at once"
  assert merge([0, 1, 0, 1], {(0, 1): (1, 2), (2, 0): (0, 4), (4, 1): (2, 5)}) == [5]


def test_ignore_merges_takes_a_whole_piece_that_is_a_token():
  # "abc" is a token no merge makes (a+b -> ab only): Llama 3's BPE (ignore_merges) takes it whole, GPT-2's does not
  tokens = ["a", "b", "c", "ab", "abc"]
  fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}
  for pre, ignore in (("gpt2", False), ("llama-bpe", True)):
    ours = tokenizer_from_gguf_fields(fields | {"tokenizer.ggml.pre": pre}, "t")
    theirs = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [("a", "b")], ignore_merges=ignore))
    assert ours.encode("abc", add_special=False) == theirs.encode("abc").ids == ([4] if ignore else [3, 2])


def test_byte_alphabet_is_gpt2s():
  alphabet = byte_alphabet()
  assert len(set(alphabet)) == 256 and alphabet[ord("A")] == "A" and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"


def test_pre_tokenizers_keep_every_character():
  for name, (patterns, _) in PRE_TOKENIZERS.items():
    pre = PreTokenizer(patterns)
    for text in TEXTS:
      assert "".join(pre.split(text)) == text, name


@pytest.mark.parametrize("change, message", [
  ({"tokenizer.ggml.model": "t5"}, "'t5' is not supported"),
  ({"tokenizer.ggml.pre": "mystery"}, "'mystery' is not a pre-tokenizer"),
  ({"tokenizer.ggml.merges": ["nospace"]}, "not 'left right'"),
  ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges"),
  ({"tokenizer.ggml.token_type": [1, 2]}, "2 entries for"),
  ({"tokenizer.ggml.tokens": ["x" * 70000]}, "MAX_TOKEN_BYTES"),
  ({"tokenizer.ggml.tokens": [1, 2]}, "holds a int"),
  ({"tokenizer.chat_template": "x" * (1 << 21)}, "MAX_TEMPLATE_CHARS"),
])
def test_malformed_vocabularies_are_typed_errors(change, message):
  fields = gguf_bpe_fields("gpt2") | change
  if change.get("tokenizer.ggml.tokens"): fields.pop("tokenizer.ggml.token_type")
  with pytest.raises(TokenizerError, match=message):
    tokenizer_from_gguf_fields(fields, "bad.gguf")


def test_a_special_id_outside_the_vocabulary_is_ignored():
  with pytest.warns(UserWarning, match="bos_token_id 4294967295 is outside the vocabulary"):
    tok = tokenizer_from_gguf_fields(gguf_bpe_fields("gpt2") | {"tokenizer.ggml.bos_token_id": 2**32 - 1}, "t.gguf")
  assert tok.bos_id is None


def test_ids_outside_the_vocabulary_are_refused():
  tok = tokenizer_from_gguf_fields(gguf_bpe_fields("gpt2"), "test.gguf")
  with pytest.raises(TokenizerError, match="outside the vocabulary"):
    tok.decode([0, tok.vocab_size])
