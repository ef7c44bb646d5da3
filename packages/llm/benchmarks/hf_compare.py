"""kiln.llm against Hugging Face transformers on random-weight checkpoints (bench environment).

For each architecture a small config gets random weights from transformers (initializer_range 0.2: logits far enough
apart that greedy decoding is decided by the model, not by rounding), is saved with save_pretrained (safetensors) to a
temporary folder and loaded with kiln.llm.load. Checked: teacher-forced logits (max |kiln - HF| / max |HF| <= 1e-3) and
64 greedy tokens equal (HF's generate with do_sample=False, no end token). Then decode speed on a SmolLM-135M-shaped
Llama (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, float32, random weights): kiln and transformers
alternate in rounds in this process, each generating the same number of tokens after the same prompt.

Run: `$BPY packages/llm/benchmarks/hf_compare.py [--rounds 3] [--tokens 32] [--skip-speed] [--threads 2]`.
Exits 1 on a wrong result."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-3
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def configs() -> dict[str, Any]:
  from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config
  return {
    "llama": LlamaConfig(**SMALL, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32}),
    "qwen2": Qwen2Config(**SMALL, tie_word_embeddings=True),
    "mistral": MistralConfig(**SMALL, sliding_window=16),
    "phi3": Phi3Config(**{**SMALL, "num_key_value_heads": 4}, partial_rotary_factor=0.5),
    "gemma": GemmaConfig(**SMALL, head_dim=16),
    "gpt2": GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None),
  }


def hf_model(cfg: Any) -> Any:
  import torch
  from transformers import AutoModelForCausalLM
  torch.manual_seed(0)
  cfg._attn_implementation = "eager"
  return AutoModelForCausalLM.from_config(cfg).float().eval()


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
  import torch
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
  return [int(t) for t in out[0, len(ids):]]


def check(arch: str, cfg: Any, folder: Path) -> bool:
  import torch

  from kiln.llm import load
  model = hf_model(cfg)
  model.save_pretrained(folder, safe_serialization=True)
  llm = load(folder, context=128, chunk=32)
  rng = np.random.default_rng(1)
  ids = [int(i) for i in rng.integers(0, cfg.vocab_size, 40)]
  with torch.no_grad(): want = model(torch.tensor([ids])).logits[0].double().numpy()
  got = llm.logits(ids)
  err = float(np.abs(got - want).max() / np.abs(want).max())
  prompt = ids[:8]
  ref = hf_greedy(model, prompt, 64)
  gen = list(llm.generate(prompt, max_new_tokens=64, stop=[]))
  same = next((i for i, (a, b) in enumerate(zip(gen, ref)) if a != b), min(len(gen), len(ref)))
  ok = err <= TOL and gen == ref
  print(f"{arch:<8} logits max|diff|/max|logit| {err:.1e}   greedy: {same}/64 tokens equal   {'OK' if ok else 'WRONG'}")
  return ok


def speed(rounds: int, tokens: int, folder: Path) -> None:
  import torch
  from transformers import LlamaConfig

  from kiln.llm import load
  cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None)
  model = hf_model(cfg)
  model.save_pretrained(folder, safe_serialization=True)
  t = time.perf_counter()
  llm = load(folder, context=512)
  llm.runner.plan("prefill"); llm.runner.plan("decode")
  print(f"\nSmolLM-135M-shaped llama (float32, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters): kiln load + compile "
        f"{time.perf_counter() - t:.1f} s")
  prompt = [int(i) for i in np.random.default_rng(2).integers(0, cfg.vocab_size, 64)]
  rows: dict[str, list[tuple[float, float]]] = {"kiln": [], "transformers": []}
  for r in range(rounds + 1):  # round 0 warms both up and is not counted
    list(llm.generate([0], max_new_tokens=1))  # forget the cached prompt: each round prefills it again
    t = time.perf_counter()
    list(llm.generate(prompt, max_new_tokens=tokens, stop=[]))
    tm = llm.timings
    if r: rows["kiln"].append((tm.rate(tm.prefill_tokens, tm.prefill_s), tm.rate(tm.decode_tokens, tm.decode_s)))
    with torch.no_grad():
      x = torch.tensor([prompt])
      t = time.perf_counter()
      out = model(x, use_cache=True)
      pre = time.perf_counter() - t
      past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
      t = time.perf_counter()
      for _ in range(tokens - 1):
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
      dec = time.perf_counter() - t
    if r: rows["transformers"].append((len(prompt) / pre, (tokens - 1) / dec))
  load = os.getloadavg()
  print(f"{rounds} rounds, prompt {len(prompt)} tokens, {tokens} generated; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load average {load[0]:.1f} {load[1]:.1f}")
  med = {k: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for k, v in rows.items()}
  for k, (p, d) in med.items(): print(f"  {k:<13} prefill {p:8.1f} tokens/s   decode {d:7.1f} tokens/s")
  print(f"  kiln / transformers: prefill {med['kiln'][0] / med['transformers'][0]:.2f}x, decode {med['kiln'][1] / med['transformers'][1]:.2f}x")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--skip-speed", action="store_true")
  ap.add_argument("--only", nargs="*", help="architectures to check (default: all)")
  args = ap.parse_args()
  os.environ.setdefault("KILN_THREADS", str(args.threads))
  sys.path.insert(0, str(ROOT / "packages/graph/benchmarks"))
  from zoo.tvshim import import_torchvision
  import_torchvision()  # transformers imports torchvision where it is installed
  import torch
  torch.set_num_threads(args.threads)
  bad = 0
  with tempfile.TemporaryDirectory() as tmp:
    for arch, cfg in configs().items():
      if args.only and arch not in args.only: continue
      bad += not check(arch, cfg, Path(tmp) / arch)
    if not args.skip_speed: speed(args.rounds, args.tokens, Path(tmp) / "speed")
  return 1 if bad else 0


if __name__ == "__main__": sys.exit(main())
