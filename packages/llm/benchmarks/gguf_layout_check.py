"""Bench environment only: kiln.llm's GGUF reader against Hugging Face transformers' own GGUF loader
(transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint, which also turns llama.cpp's layout back into HF's).

Tiny random models of each architecture transformers reads from GGUF (llama, qwen2, phi3, gpt2: not gemma) are written
as llama.cpp's converter writes them (packages/llm/tests/checkpoint_files.py), llama's in Q8_0 with its Q/K rows
permuted; each weight kiln's Checkpoint.tensor() gives must equal transformers' tensor of the same name, and the two name
sets must agree. Prints one line per architecture and exits non-zero on a difference.

  $BPY packages/llm/benchmarks/gguf_layout_check.py
"""
from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]  # transformers imports it if present; the bench env's does not load
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CASES = (("llama", "Q8_0"), ("qwen2", "F32"), ("phi3", "F16"), ("gpt2", "F32"))
CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def transformers_tensors(path: Path) -> dict[str, np.ndarray]:
  from transformers import AutoConfig, AutoModelForCausalLM
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  conf = load_gguf_checkpoint(str(path))["config"]
  model_type = conf.pop("model_type")
  conf["pad_token_id"] = 0  # phi3's default (32000) is outside a tiny vocabulary
  model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf))
  out = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
  return {k: (v.detach().numpy() if hasattr(v, "detach") else np.asarray(v)) for k, v in out.items()}


def main() -> int:
  from checkpoint_files import hf_weights, tiny_config, write_gguf

  from kiln.llm.checkpoint_open import open_checkpoint
  warnings.filterwarnings("ignore")
  vocab = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [chr(65 + i % 26) * (1 + i // 26) for i in range(40)],
           "tokenizer.ggml.token_type": [1] * 40, "tokenizer.ggml.merges": ["A A"], "tokenizer.ggml.bos_token_id": 1,
           "tokenizer.ggml.eos_token_id": 2}
  bad = 0
  with tempfile.TemporaryDirectory() as d:
    for arch, fmt in CASES:
      cj = tiny_config(arch, hidden_size=64, intermediate_size=128) if arch == "llama" else tiny_config(arch)
      path = Path(d) / f"{arch}.gguf"
      write_gguf(path, cj, hf_weights(cj, seed=3), fmt=lambda n, f=fmt: f, meta=vocab)
      ck, ref = open_checkpoint(path), transformers_tensors(path)
      worst = 0.0
      for name in ck.names():
        if name not in ref: continue
        want = ref[name].T if arch == "gpt2" and name.endswith(CONV1D) else ref[name]
        got = ck.tensor(name)
        worst = max(worst, float(np.abs(got - want).max()) if got.shape == want.shape else float("inf"))
      names_ok = set(ck.names()) == set(ref)
      bad += worst != 0.0 or not names_ok
      print(f"{arch:6} {fmt:5} max |kiln - transformers| = {worst}, same names: {names_ok} ({len(ck.names())} weights)")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
