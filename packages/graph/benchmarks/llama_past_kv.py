"""A Llama-style decoder with a KV cache, loaded once and run at every past length (issue 35): transformers'
LlamaForCausalLM built from a small LlamaConfig (2 layers, random weights), wrapped to take input_ids, attention_mask and
each layer's past keys and values, and to return the logits and the present keys and values (past + seq long), exported
with torch's exporter (dynamo) with dims seq, total (the mask's length) and past (from 0: the first step has no cache).

kiln loads it once with those dims as bounds and runs it at past lengths 0 to 512 against onnxruntime on the same file,
with a left-padded mask on some steps; one load means one compile, which the kernel cache's compile count confirms.
Run it in the bench environment: `$BPY packages/graph/benchmarks/llama_past_kv.py [--cache DIR] [--max-past N]`.
The export is cached in DIR (default .zoo-cache/llama_past_kv). Exits 1 on a wrong result or a recompile."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 4, 2, 64, 1000
HEAD_DIM = HIDDEN // HEADS
MAX_SEQ, MAX_PAST = 64, 512
TOL = 1e-4  # of each output's largest magnitude


def export(path: Path) -> None:
  sys.path.insert(0, str(ROOT / "packages/graph/benchmarks"))
  from zoo.tvshim import import_torchvision
  import_torchvision()  # transformers imports torchvision where it is installed
  import onnx
  import torch
  from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                    intermediate_size=128, max_position_embeddings=MAX_PAST + MAX_SEQ)
  model = LlamaForCausalLM(cfg).eval()

  class WithCache(torch.nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.m = model

    def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> tuple[Any, ...]:
      cache = DynamicCache(config=cfg)
      for i in range(LAYERS): cache.update(past[2 * i], past[2 * i + 1], i)
      out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, return_dict=True)
      return (out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)))

  p, s = 3, 2  # example sizes (torch.export specialises 0 and 1)
  ids, mask = torch.randint(0, VOCAB, (1, s)), torch.ones(1, p + s, dtype=torch.int64)
  past = [torch.randn(1, KV_HEADS, p, HEAD_DIM) for _ in range(2 * LAYERS)]
  seq, total = torch.export.Dim("seq", min=1, max=MAX_SEQ), torch.export.Dim("total", min=1, max=MAX_PAST + MAX_SEQ)
  plen = torch.export.Dim("past", min=0, max=MAX_PAST)
  names = ["input_ids", "attention_mask", *(f"past_{kv}_{i}" for i in range(LAYERS) for kv in "kv")]
  shapes = {"input_ids": {1: seq}, "attention_mask": {1: total}, "past": tuple({2: plen} for _ in range(2 * LAYERS))}
  with torch.no_grad():
    prog = torch.onnx.export(WithCache().eval(), (ids, mask, *past), dynamo=True, input_names=names, dynamic_shapes=shapes, verbose=False)
  path.parent.mkdir(parents=True, exist_ok=True)
  onnx.save_model(prog.model_proto, str(path.with_suffix(".tmp")))
  path.with_suffix(".tmp").replace(path)


def feeds(rng: np.random.Generator, p: int, s: int, pad: int) -> dict[str, np.ndarray]:
  """One step: s new tokens after p cached ones, the first `pad` positions masked out (left padding)."""
  mask = np.ones((1, p + s), np.int64)
  mask[0, :pad] = 0
  out = {"input_ids": rng.integers(0, VOCAB, (1, s)).astype(np.int64), "attention_mask": mask}
  for i in range(LAYERS):
    for kv in "kv": out[f"past_{kv}_{i}"] = rng.standard_normal((1, KV_HEADS, p, HEAD_DIM)).astype(np.float32)
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cache", type=Path, default=ROOT / ".zoo-cache/llama_past_kv")
  ap.add_argument("--max-past", type=int, default=MAX_PAST)
  args = ap.parse_args()
  path = args.cache / "model.onnx"
  if not path.exists():
    t = time.perf_counter()
    export(path)
    print(f"exported {path} in {time.perf_counter() - t:.1f} s")
  import onnxruntime as ort

  from kiln.executor import cache_stats
  from kiln.graph import onnx as konnx

  t = time.perf_counter()
  model = konnx.load(str(path), dims={"seq": (1, MAX_SEQ), "total": (1, MAX_PAST + MAX_SEQ), "past": (0, MAX_PAST)})
  print(f"kiln loaded it in {time.perf_counter() - t:.1f} s ({sum(len(p.kernels) for p in model.plans)} kernels)")
  sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
  rng = np.random.default_rng(35)
  steps = [(p, s, pad) for p, s, pad in [(0, 5, 0), (0, 1, 0), (1, 1, 0), (2, 3, 1), (7, 1, 0), (31, 4, 3), (64, 1, 0), (100, 16, 7),
                                           (255, 1, 0), (256, 2, 0), (300, 64, 11), (511, 1, 0), (512, 64, 0), (512, 1, 5)] if p <= args.max_past]
  compiles, bad = None, 0
  print(f"{'past':>5} {'seq':>4} {'pad':>4}  largest |kiln - ort| / max|ort| per output (logits, present k/v)")
  for p, s, pad in steps:
    f = feeds(rng, p, s, pad)
    want = sess.run(None, f)
    got = list(model.run(f).values())
    if compiles is None: compiles = cache_stats()["compiles"]  # after the first run: every kernel is built
    errs = []
    for g, w in zip(got, want):
      if g.shape != w.shape: errs.append(float("inf"))
      else: errs.append(float(np.abs(g.astype(np.float64) - w).max() / max(float(np.abs(w).max()), 1e-12)) if w.size else 0.0)
    ok = all(e <= TOL for e in errs)
    bad += not ok
    print(f"{p:>5} {s:>4} {pad:>4}  {' '.join(f'{e:.1e}' for e in errs)}  {'OK' if ok else 'WRONG'}")
  recompiled = cache_stats()["compiles"] - (compiles or 0)
  print(f"{len(steps)} steps, {bad} wrong, {recompiled} kernels compiled after the first run")
  return 1 if bad or recompiled else 0


if __name__ == "__main__": sys.exit(main())
