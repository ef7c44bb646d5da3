"""Shared material of the tokenizer tests: a varied corpus, tiny tokenizers trained with Hugging Face's `tokenizers`, and the
GGUF tokenizer fields made from them (what convert_hf_to_gguf.py writes). tokenizers' trainer breaks ties between equally
frequent pairs in hash order, which changes from process to process: tests compare two tokenizers of the same trained
vocabulary, and assert nothing that depends on which pieces were learnt."""
from __future__ import annotations

import functools
import json
import random
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kiln.llm import pretokenize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TRAIN = [
  "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? We'll see; they've said I'd go.",
  "def main(argv):\n    return sum(int(x) for x in argv[1:])  # 12345 + 678\n\n\tindented\ttabs",
  "Ünïcödé: café, naïve, Ærøskøbing, Straße. 日本語のテキスト、中文文本。Русский текст. ελληνικά",
  "Numbers 0 1 22 333 4444 55555 3.14159 1e-9 ½ ² Ⅻ ٣ and emoji 🙂🚀👍🏽 done.",
  "hello hello hello world world   spaced    out\n\n\nnew lines\r\nwindows  \n trailing   ",
]

CORPUS = [
  "", " ", "  ", "\n", "\n\n \n", "a", "Hello world", " Hello  world ", "hello\n\nworld", "I'm fine, you're not; HE'LL 'S 'Ve",
  "12345678901 and 1,000,000.55 ٣٤٥ ½²", "x=1;y=2;print(x+y)#!$%^&*()<>=~|", "日本語 中文 한국어 ไทย العربية עברית",
  "🙂🙂 🚀👍🏽👩‍👩‍👧 e\u0301 ñ", "tabs\tand\u00a0nbsp\u2003em\u3000ideo", "\r\n\r\n  x  \r\n", "ＡＢＣ１２３",
  "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more<|endoftext|><|endoftext|>",
  "<|im_start|><|im_end|>", "<|im_start", "almost <|im_end| special", "\x00\x01\x1c\x1f control chars \x7f",
]


def random_texts(seed: int, count: int) -> list[str]:
  rng = random.Random(seed)
  alphabet = list("aeiou bcdfg HELLO 0123456789 \n\t.,'!?-_'sStT日本🙂é\u0301½") + SPECIALS
  return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def hf_pre_tokenizer(pre: str) -> Any:
  """The Hugging Face pre-tokenizer equal to llama.cpp's pre-type (as the models' own tokenizer.json files write it)."""
  patterns, _ = pretokenize.PRE_TOKENIZERS[pre]
  if pre == "gpt2": return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
  splits = [pre_tokenizers.Split(Regex(p), "isolated") for p in patterns]
  return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@functools.cache
def trained_bpe_json(vocab_size: int = 500) -> str:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(TRAIN * 3, trainer)
  return tok.to_str()


def hf_bpe(pre: str) -> Tokenizer:
  """The trained byte-level BPE with pre's pre-tokenizer (and Llama 3's ignore_merges)."""
  spec = json.loads(trained_bpe_json())
  model = spec["model"]
  merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
  tok = Tokenizer(models.BPE(model["vocab"], merges, ignore_merges=pretokenize.PRE_TOKENIZERS[pre][1]))
  tok.add_special_tokens(SPECIALS)
  tok.pre_tokenizer = hf_pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  return tok


def gguf_bpe_fields(pre: str) -> dict[str, Any]:
  """The GGUF tokenizer fields of the trained BPE: tokens in id order, CONTROL for the special ones, merges as 'a b'."""
  spec = json.loads(trained_bpe_json())
  vocab: dict[str, int] = spec["model"]["vocab"]
  tokens = sorted(vocab, key=vocab.__getitem__)
  assert [vocab[t] for t in tokens] == list(range(len(tokens)))
  merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
  return {
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
    "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens], "tokenizer.ggml.merges": merges,
    "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"], "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
    "tokenizer.ggml.add_bos_token": False,
  }


# --- SentencePiece-style: a vocabulary with scores and byte tokens ---------------------------------------------------------

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]


@functools.cache
def spm_vocab() -> tuple[list[str], list[float], list[int]]:
  """A SentencePiece-BPE-like vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces learnt by a BPE trained with
  tokenizers on "▁"-marked text, each scored by its learning order (earlier higher, all distinct)."""
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
  trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, limit_alphabet=60)
  tok.train_from_iterator(TRAIN * 3, trainer)
  learnt: dict[str, int] = json.loads(tok.to_str())["model"]["vocab"]
  pieces = sorted(learnt, key=learnt.__getitem__)
  tokens = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
  scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
  types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
  return tokens, scores, types


def gguf_spm_fields() -> dict[str, Any]:
  tokens, scores, types = spm_vocab()
  return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0}


def hf_spm() -> Tokenizer:
  """Hugging Face's form of the same vocabulary (what transformers' LlamaConverter makes of a SentencePiece BPE model): a
  BPE with byte_fallback whose merges are every pair of tokens joining into a token, ranked by the join's score, and the
  normalizer that prepends "▁" and writes spaces as "▁"."""
  tokens, scores, types = spm_vocab()
  vocab = {t: i for i, t in enumerate(tokens)}
  normal = [t for t, k in zip(tokens, types) if k == 1]
  merges = []
  for joined in normal:
    for cut in range(1, len(joined)):
      left, right = joined[:cut], joined[cut:]
      if left in vocab and right in vocab and types[vocab[left]] == 1 and types[vocab[right]] == 1:
        merges.append((scores[vocab[joined]], vocab[left], vocab[right], left, right))
  merges.sort(key=lambda m: (-m[0], m[1], m[2]))
  tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  tok.add_special_tokens(SPM_SPECIALS)
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  return tok
