"""Tiny random models for kiln.llm's tests: a ModelConfig per architecture, random weights in HF naming and layout, a
numpy float64 forward pass written from the architectures' definitions (HF's modeling code), and an HF folder writer
(config.json + model.safetensors through kiln.graph.weights' writer)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from kiln.llm.config import ModelConfig

HF_CONFIGS: dict[str, dict[str, Any]] = {
  "llama": {"model_type": "llama", "vocab_size": 160, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 16}},
  "qwen2": {"model_type": "qwen2", "vocab_size": 150, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": True},
  "mistral": {"model_type": "mistral", "vocab_size": 120, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "sliding_window": 6,
              "tie_word_embeddings": False},
  "gemma": {"model_type": "gemma", "vocab_size": 130, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 128},
  "phi3": {"model_type": "phi3", "vocab_size": 140, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "partial_rotary_factor": 0.5, "sliding_window": None},
  "gpt2": {"model_type": "gpt2", "vocab_size": 110, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128, "activation_function": "gelu_new"},
}


def config(arch: str) -> ModelConfig: return ModelConfig.from_hf(HF_CONFIGS[arch])


def weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 weights in HF naming and layout (GPT-2's Conv1D weights are (in, out))."""
  rng = np.random.default_rng(seed)
  d, f, qd, kd, V = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.vocab_size
  W: dict[str, np.ndarray] = {}
  def mat(name: str, *shape: int, fan: int | None = None) -> None:
    W[name] = (rng.standard_normal(shape) / math.sqrt(fan or shape[-1])).astype(np.float32)
  def vec(name: str, n: int, one: float = 0.0) -> None: W[name] = (one + 0.1 * rng.standard_normal(n)).astype(np.float32)
  if cfg.arch == "gpt2":
    mat("transformer.wte.weight", V, d, fan=1); mat("transformer.wpe.weight", cfg.max_position, d, fan=4)
    for i in range(cfg.num_layers):
      p = f"transformer.h.{i}."
      for n in ("ln_1", "ln_2"): vec(p + n + ".weight", d, 1.0); vec(p + n + ".bias", d)
      mat(p + "attn.c_attn.weight", d, 3 * d, fan=d); vec(p + "attn.c_attn.bias", 3 * d)
      mat(p + "attn.c_proj.weight", d, d, fan=d); vec(p + "attn.c_proj.bias", d)
      mat(p + "mlp.c_fc.weight", d, f, fan=d); vec(p + "mlp.c_fc.bias", f)
      mat(p + "mlp.c_proj.weight", f, d, fan=f); vec(p + "mlp.c_proj.bias", d)
    vec("transformer.ln_f.weight", d, 1.0); vec("transformer.ln_f.bias", d)
    return W
  one = 0.0 if cfg.norm_add_one else 1.0
  mat("model.embed_tokens.weight", V, d, fan=1)
  if not cfg.tie_word_embeddings: mat("lm_head.weight", V, d)
  vec("model.norm.weight", d, one)
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    vec(p + "input_layernorm.weight", d, one); vec(p + "post_attention_layernorm.weight", d, one)
    if cfg.arch == "phi3":
      mat(p + "self_attn.qkv_proj.weight", qd + 2 * kd, d); mat(p + "mlp.gate_up_proj.weight", 2 * f, d)
    else:
      for n, m in (("q_proj", qd), ("k_proj", kd), ("v_proj", kd)):
        mat(p + f"self_attn.{n}.weight", m, d)
        if cfg.attention_bias: vec(p + f"self_attn.{n}.bias", m)
      mat(p + "mlp.gate_proj.weight", f, d); mat(p + "mlp.up_proj.weight", f, d)
    mat(p + "self_attn.o_proj.weight", d, qd); mat(p + "mlp.down_proj.weight", d, f)
  return W


def checkpoint_get(cfg: ModelConfig, W: dict[str, np.ndarray]):  # noqa: ANN201
  """W as Checkpoint.tensor gives it: every linear (out, in), GPT-2's Conv1D weights transposed."""
  conv = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
  return lambda n: np.ascontiguousarray(W[n].T) if cfg.arch == "gpt2" and n.endswith(conv) else W[n]


def _act(x: np.ndarray, kind: str) -> np.ndarray:
  if kind == "silu": return x / (1 + np.exp(-x))
  if kind == "gelu": return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _norm(cfg: ModelConfig, W: dict[str, np.ndarray], x: np.ndarray, name: str) -> np.ndarray:
  if cfg.norm == "layer":
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * W[name + ".weight"] + W[name + ".bias"]
  g = W[name + ".weight"] + (1.0 if cfg.norm_add_one else 0.0)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g


def _attend(cfg: ModelConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
  T, hd = q.shape[0], cfg.head_dim
  g = cfg.num_heads // cfg.num_kv_heads
  k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
  s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  ok = (j <= i) & ((i - j < cfg.sliding_window) if cfg.sliding_window else True)
  s = np.where(ok[None], s, -np.inf)
  s = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(T, -1)


def logits(cfg: ModelConfig, W32: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
  """Every position's logits, (len(ids), vocab) float64, computed in float64 from the float32 weights."""
  W = {k: v.astype(np.float64) for k, v in W32.items()}
  T, d, hd = len(ids), cfg.hidden_size, cfg.head_dim
  if cfg.arch == "gpt2":
    x = W["transformer.wte.weight"][ids] + W["transformer.wpe.weight"][:T]
    for i in range(cfg.num_layers):
      p = f"transformer.h.{i}."
      qkv = _norm(cfg, W, x, p + "ln_1") @ W[p + "attn.c_attn.weight"] + W[p + "attn.c_attn.bias"]
      q, k, v = (qkv[:, j * d:(j + 1) * d].reshape(T, cfg.num_heads, hd) for j in range(3))
      x = x + _attend(cfg, q, k, v) @ W[p + "attn.c_proj.weight"] + W[p + "attn.c_proj.bias"]
      m = _act(_norm(cfg, W, x, p + "ln_2") @ W[p + "mlp.c_fc.weight"] + W[p + "mlp.c_fc.bias"], cfg.act)
      x = x + m @ W[p + "mlp.c_proj.weight"] + W[p + "mlp.c_proj.bias"]
    return _norm(cfg, W, x, "transformer.ln_f") @ W["transformer.wte.weight"].T
  rot = cfg.rotary_dim
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, rot, 2) / rot)
  if (rs := cfg.rope_scaling) and rs["rope_type"] == "llama3":  # written again here from Llama 3's definition
    f, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    wl = 2 * math.pi / inv
    sm = np.clip((old / wl - lo) / (hi - lo), 0, 1)
    inv = np.where(wl < old / hi, inv, np.where(wl > old / lo, inv / f, (1 - sm) * inv / f + sm * inv))
  elif rs: raise NotImplementedError(rs)
  ang = np.arange(T)[:, None] * inv[None]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
  def rope(t: np.ndarray) -> np.ndarray:
    a, b = t[..., :rot // 2], t[..., rot // 2:rot]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, t[..., rot:]], -1)
  x = W["model.embed_tokens.weight"][ids] * cfg.embed_scale
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    h = _norm(cfg, W, x, p + "input_layernorm")
    if cfg.arch == "phi3": q, k, v = np.split(h @ W[p + "self_attn.qkv_proj.weight"].T, [cfg.q_size, cfg.q_size + cfg.kv_size], -1)
    else:
      q, k, v = (h @ W[p + f"self_attn.{n}.weight"].T + (W[p + f"self_attn.{n}.bias"] if cfg.attention_bias else 0)
                 for n in ("q_proj", "k_proj", "v_proj"))
    q, k = rope(q.reshape(T, cfg.num_heads, hd)), rope(k.reshape(T, cfg.num_kv_heads, hd))
    x = x + _attend(cfg, q, k, v.reshape(T, cfg.num_kv_heads, hd)) @ W[p + "self_attn.o_proj.weight"].T
    h = _norm(cfg, W, x, p + "post_attention_layernorm")
    if cfg.arch == "phi3": g, u = np.split(h @ W[p + "mlp.gate_up_proj.weight"].T, 2, -1)
    else: g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
    x = x + (_act(g, cfg.act) * u) @ W[p + "mlp.down_proj.weight"].T
  head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]
  return _norm(cfg, W, x, "model.norm") @ head.T


def write_hf(folder: Path, arch: str, W: dict[str, np.ndarray]) -> Path:
  """An HF folder: config.json and model.safetensors (kiln's writer)."""
  from kiln.graph.weights import save_safetensors
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(HF_CONFIGS[arch]))
  save_safetensors(str(folder / "model.safetensors"), W)
  return folder


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
  """A character-level tokenizer.json (tokenizers' BPE with no merges) with ChatML's special tokens and template, eos
  <|im_end|>, its vocabulary filled up to vocab_size with tokens text never encodes to (<x40>: no merges make them)."""
  from tokenizers import Tokenizer, decoders, models
  specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
  vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz .,!?\n"))}
  vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
  tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
  tk.add_special_tokens(specials)
  tk.decoder = decoders.Fuse()
  tk.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False,
                                                            "chat_template": CHATML}))
