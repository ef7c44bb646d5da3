"""kiln.llm's GGUF tokenizers against Hugging Face tokenizers at a realistic size (not a test: minutes of CPU).

A byte-level BPE of VOCAB tokens is trained with `tokenizers` on the Python standard library's sources and docstrings (code,
prose, digits, some Unicode); its vocabulary and merges are written as GGUF tokenizer fields, and for every pre-tokenizer
kiln knows the ids of kiln's encoder are compared with tokenizers' on held-out files (every id, every file). The same for a
SentencePiece-style vocabulary with scores (tokenizers' form: a byte-fallback BPE with every joining pair as a merge).
Then encode throughput, kiln vs tokenizers (one thread: TOKENIZERS_PARALLELISM=false), in interleaved rounds.

  python packages/llm/benchmarks/bench_tokenizer.py [--vocab 32000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from tokenizer_case import SPECIALS, hf_pre_tokenizer  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from kiln.llm.tokenizer import tokenizer_from_gguf_fields  # noqa: E402


def corpus() -> tuple[list[str], list[str]]:
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
  texts = []
  for f in files:
    try: texts.append(open(f, encoding="utf-8").read())
    except (UnicodeDecodeError, OSError): pass
  return texts[1::2], texts[::2][:300]


def bpe_fields(tok: Tokenizer, pre: str) -> dict:
  model = json.loads(tok.to_str())["model"]
  vocab = model["vocab"]
  tokens = sorted(vocab, key=vocab.__getitem__)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens], "tokenizer.ggml.merges": merges}


def with_pre(tok: Tokenizer, pre: str, ignore_merges: bool) -> Tokenizer:
  model = json.loads(tok.to_str())["model"]
  merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
  out = Tokenizer(models.BPE(model["vocab"], merges, ignore_merges=ignore_merges))
  out.add_special_tokens(SPECIALS)
  out.pre_tokenizer = hf_pre_tokenizer(pre)
  out.decoder = decoders.ByteLevel()
  return out


def spm_pair(train: list[str], size: int) -> tuple[dict, Tokenizer]:
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
  tok.train_from_iterator(train, trainers.BpeTrainer(vocab_size=size, show_progress=False, limit_alphabet=200))
  learnt = json.loads(tok.to_str())["model"]["vocab"]
  pieces = sorted(learnt, key=learnt.__getitem__)
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
  scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
  types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
  fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for joined in pieces:
    for cut in range(1, len(joined)):
      a, b = joined[:cut], joined[cut:]
      if a in vocab and b in vocab and types[vocab[a]] == 1 and types[vocab[b]] == 1: merges.append((scores[vocab[joined]], vocab[a], vocab[b], a, b))
  merges.sort(key=lambda m: (-m[0], m[1], m[2]))
  hf = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  hf.add_special_tokens(["<unk>", "<s>", "</s>"])
  hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  return fields, hf


def compare(name: str, ours, theirs, texts: list[str], rounds: int) -> None:
  t0 = time.perf_counter()
  bad = 0
  for t in texts:
    want = theirs.encode(t, add_special_tokens=False).ids
    if ours.encode(t, add_special=False) != want: bad += 1
    if ours.decode(want) != t: bad += 1
  n_bytes = sum(len(t.encode()) for t in texts)
  kiln_s, hf_s = [], []
  for _ in range(rounds):   # interleaved; kiln's word memo is emptied so each round tokenizes from scratch
    if hasattr(ours, "_words"): ours._words.clear()
    s = time.perf_counter()
    for t in texts: ours.encode(t, add_special=False)
    kiln_s.append(time.perf_counter() - s)
    s = time.perf_counter()
    for t in texts: theirs.encode(t, add_special_tokens=False)
    hf_s.append(time.perf_counter() - s)
  k, h = min(kiln_s), min(hf_s)
  print(f"{name:10s} files {len(texts)} ({n_bytes / 1e6:.1f} MB)  mismatching files {bad}  kiln {n_bytes / k / 1e6:.2f} MB/s  "
        f"tokenizers {n_bytes / h / 1e6:.2f} MB/s  kiln/tokenizers time {k / h:.1f}x  (check {time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--pre", default="gpt2,llama-bpe,qwen2,smollm,default")
  args = ap.parse_args()
  print(f"nproc {os.cpu_count()}  load {os.getloadavg()}")
  train, held = corpus()
  pres = [p for p in args.pre.split(",") if p]   # --pre "" checks the SentencePiece vocabulary alone
  if pres:
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    s = time.perf_counter()
    base.train_from_iterator(train, trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    print(f"trained {base.get_vocab_size()} tokens in {time.perf_counter() - s:.0f} s")
  from kiln.llm.pretokenize import PRE_TOKENIZERS
  for pre in pres:
    s = time.perf_counter()
    ours = tokenizer_from_gguf_fields(bpe_fields(base, pre), f"{pre}.gguf")
    print(f"{pre}: {ours.vocab_size} tokens, kiln tokenizer made in {time.perf_counter() - s:.2f} s")
    compare(pre, ours, with_pre(base, pre, PRE_TOKENIZERS[pre][1]), held, args.rounds)
  fields, hf = spm_pair(train, args.vocab)
  s = time.perf_counter()
  ours = tokenizer_from_gguf_fields(fields, "spm.gguf")
  print(f"spm: {ours.vocab_size} tokens, kiln tokenizer made in {time.perf_counter() - s:.2f} s")
  compare("spm", ours, hf, held[:100], args.rounds)


if __name__ == "__main__":
  main()
