"""Bench environment only: kiln.llm's ModelConfig against transformers 5's configs and RoPE initialisers.

Each case is a config made by transformers' config class and serialised as save_pretrained writes it (transformers 5
keeps rope_theta, the scaling and partial_rotary_factor inside rope_parameters); ModelConfig.from_hf reads it back and
its rope_inv_freq / rope_attention_factor must give what transformers' ROPE_INIT_FUNCTIONS (or the model's rotary
embedding, for plain RoPE) give, at the trained length and past it. Prints one line per case, exits non-zero on a
relative difference over 1e-6.

  $BPY packages/llm/benchmarks/config_check.py
"""
from __future__ import annotations

import json
import sys
import warnings

import numpy as np

sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]  # transformers imports it if present; the bench env's does not load

BASE = {"vocab_size": 40, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096}
CASES = [
  ("llama", {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}}),
  ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
  ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
  ("mistral", {"rope_theta": 1000000.0}),
  ("qwen2", {"rope_theta": 1000000.0}),
  ("gemma", {"head_dim": 32}),
  ("phi3", {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "long_factor": list(np.linspace(1, 30, 32)), "short_factor": list(np.linspace(1, 2, 32))}}),
  ("phi3", {"partial_rotary_factor": 0.5}),
]


def reference(hf_config, model_type: str, seq: int | None) -> tuple[np.ndarray, float]:
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  kind = (hf_config.rope_parameters or {}).get("rope_type", "default")
  if kind in ROPE_INIT_FUNCTIONS:
    inv, att = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", seq_len=seq)
    return inv.numpy(), float(att)
  import importlib
  mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
  emb = getattr(mod, f"{model_type.capitalize()}RotaryEmbedding")(hf_config)
  return emb.inv_freq.numpy(), float(getattr(emb, "attention_scaling", 1.0))


def main() -> int:
  from transformers import AutoConfig

  from kiln.llm.config import ModelConfig
  warnings.filterwarnings("ignore")
  bad = 0
  for model_type, over in CASES:
    hf = AutoConfig.for_model(model_type, **{**BASE, **over})
    ours = ModelConfig.from_hf(json.loads(hf.to_json_string()))
    want_hd = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if (ours.head_dim, ours.num_kv_heads, ours.norm_eps) != (want_hd, hf.num_key_value_heads, hf.rms_norm_eps):
      bad += 1
      print(f"{model_type}: head_dim/kv heads/eps {(ours.head_dim, ours.num_kv_heads, ours.norm_eps)}, transformers has "
            f"{(want_hd, hf.num_key_value_heads, hf.rms_norm_eps)}")
    for seq in (None, 200000):
      inv, att = reference(hf, model_type, seq)
      err = float(np.abs(ours.rope_inv_freq(seq) - inv).max() / np.abs(inv).max()) if len(inv) == ours.rotary_dim // 2 else float("inf")
      att_err = abs(ours.rope_attention_factor() - att)
      bad += err > 1e-6 or att_err > 1e-6
      kind = (ours.rope_scaling or {}).get("rope_type", "plain")
      print(f"{model_type:7} {kind:8} seq {seq!s:6}  inv_freq rel. difference {err:.1e}  "
            f"attention factor {ours.rope_attention_factor():.4f} vs {att:.4f}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
