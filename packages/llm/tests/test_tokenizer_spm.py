"""kiln's SentencePiece-style tokenizer of a GGUF vocabulary (scores, byte tokens, "▁") against Hugging Face tokenizers'
form of the same vocabulary (a BPE with byte fallback, as transformers converts such models): the same ids, characters
outside the vocabulary as byte tokens, and decode inverting encode."""
from __future__ import annotations

from tokenizer_case import CORPUS, gguf_spm_fields, hf_spm, random_texts

from kiln.llm.spm import SentencePiece
from kiln.llm.tokenizer import tokenizer_from_gguf_fields

TEXTS = [t.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>").replace("<|endoftext|>", "</s>") for t in CORPUS + random_texts(2, 150)]


def test_ids_equal_hugging_face():
  ours = tokenizer_from_gguf_fields(gguf_spm_fields(), "test.gguf")
  assert isinstance(ours, SentencePiece) and ours.add_bos and ours.add_space_prefix
  theirs = hf_spm()
  for text in TEXTS:
    want = theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, add_special=False) == want, text
    assert ours.decode(want, strip_added=False) == text
    assert ours.decode(ours.encode(text)) == text   # the bos encode adds is taken off again


def test_byte_fallback_and_specials():
  tok = tokenizer_from_gguf_fields(gguf_spm_fields(), "test.gguf")
  ids = tok.encode("<s>Hi 🎉</s>x", add_special=False)
  assert ids[0] == 1 and 2 in ids
  emoji = [tok.id_to_token(i) for i in ids if tok.id_to_token(i).startswith("<0x")]
  assert emoji[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]      # U+1F389 is in no training text: its UTF-8 bytes
  after = ids[ids.index(2) + 1]
  assert tok.id_to_token(after).startswith("▁")                      # a space prefix after a special token (llama.cpp)
  assert tok.decode(ids, strip_added=False) == "<s>Hi 🎉</s>x" and tok.decode(ids, skip_special=True) == "Hi 🎉x"
  assert tok.decode(ids) == "Hi 🎉</s>x"   # the first bos is taken for the one encode adds
  assert tok.encode("Hi")[0] == tok.bos_id                            # add_bos: SentencePiece's default
  for text in TEXTS:
    assert tok.decode(tok.encode(text, add_special=False), strip_added=False) == text, text


def test_stream_gives_the_same_text():
  tok = tokenizer_from_gguf_fields(gguf_spm_fields(), "test.gguf")
  text = "Straße 🙂 日本語 and  spaces</s>next"
  ids = tok.encode(text, add_special=False)
  pieces = list(tok.stream(ids))
  assert "".join(pieces) == text and len(pieces) > 3 and all("\ufffd" not in p for p in pieces)
