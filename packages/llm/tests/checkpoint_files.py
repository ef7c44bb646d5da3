"""Tiny checkpoint files for kiln.llm's tests, written as the real tools write them: GGUF through the gguf package's
GGUFWriter, converting HF weights as llama.cpp's convert_hf_to_gguf.py does (its names, LlamaModel.permute on llama's Q
and K, gemma's norms stored as 1 + w, GPT-2's Conv1D weights transposed), and HF folders through kiln.graph.weights'
safetensors writer. Independent of kiln.llm's readers: the mapping tables here are the converter's, not kiln's."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from kiln.graph.weights import save_safetensors

# the converter's HF -> GGUF names (gguf's tensor_mapping.py), for the tiny models' weights
_LLAMA = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GPT2 = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up",
         "mlp.c_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output", "transformer.wte": "token_embd",
        "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm"}
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def gguf_name(hf: str) -> str:
  base, kind = hf.rsplit(".", 1)
  if base in _TOP: return f"{_TOP[base]}.{kind}"
  parts = base.split(".")
  i, rest = parts[2], ".".join(parts[3:])
  return f"blk.{i}.{(_GPT2 if parts[0] == 'transformer' else _LLAMA)[rest]}.{kind}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
  """convert_hf_to_gguf.py's LlamaModel.permute, verbatim but for numpy."""
  if n_head_kv is not None and n_head != n_head_kv: n_head = n_head_kv
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
  """Random raw blocks of a K-quant (which gguf cannot quantize) with finite, moderate float16 scales."""
  bs, ts = gguf.GGML_QUANT_SIZES[T[fmt]]
  raw = rng.integers(0, 256, (rows * cols // bs, ts), dtype=np.uint8)
  scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[fmt]
  for at in scale_at: raw[:, at:at + 2] = (rng.uniform(0.001, 0.01, (len(raw), 1))).astype(np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


def encode(fmt: str, a: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, T]:
  """(raw data for GGUFWriter.add_tensor, its type): a in `fmt` (random blocks for the K-quants)."""
  if fmt == "F32": return a.astype(np.float32), T.F32
  if fmt == "F16": return a.astype(np.float16), T.F16
  if fmt in K_QUANTS: return random_blocks(fmt, math.prod(a.shape[:-1]), a.shape[-1], rng), T[fmt]
  return quantize(a.astype(np.float32), T[fmt]), T[fmt]


def gguf_dequant(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
  return gguf.quants.dequantize(np.asarray(raw).view(np.uint8) if qtype not in (T.F32, T.F16) else raw, qtype).astype(np.float32).reshape(shape)


def write_gguf(path: str | Path, hf_config: dict[str, Any], hf_weights: dict[str, np.ndarray], fmt: Callable[[str], str] = lambda n: "F32",
               meta: dict[str, Any] | None = None, extra: dict[str, np.ndarray] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
  """A GGUF file of the HF model (config dict as config.json, weights in HF naming and layout, GPT-2's Conv1D (in, out)),
  converted as llama.cpp's converter does (GPT-2's wte written twice, as token_embd and output), each weight stored in
  fmt(hf_name) (1-d ones in F32, as the converter keeps them). Returns {HF name: what tensor() must give}: the weight
  after its round trip through the stored format, in HF layout ((out, in) for GPT-2's Conv1D too)."""
  from kiln.llm.config import ModelConfig
  cfg = ModelConfig.from_hf(hf_config)
  arch = cfg.arch if cfg.arch != "mistral" else "llama"
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(cfg.max_position); w.add_embedding_length(cfg.hidden_size); w.add_block_count(cfg.num_layers)
  w.add_feed_forward_length(cfg.intermediate_size); w.add_head_count(cfg.num_heads)
  if arch == "gpt2": w.add_layer_norm_eps(cfg.norm_eps)
  else:
    w.add_head_count_kv(cfg.num_kv_heads); w.add_layer_norm_rms_eps(cfg.norm_eps); w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads: w.add_key_length(cfg.head_dim); w.add_value_length(cfg.head_dim)
  for k, v in (meta or {}).items():
    if isinstance(v, str): w.add_string(k, v)
    elif isinstance(v, bool): w.add_bool(k, v)
    elif isinstance(v, int): w.add_uint32(k, v)
    elif isinstance(v, float): w.add_float32(k, v)
    else: w.add_array(k, v)
  expected: dict[str, np.ndarray] = {}
  for name, a in hf_weights.items():
    if cfg.tie_word_embeddings and name == "lm_head.weight": continue
    g = np.asarray(a, np.float32)
    if arch == "gpt2" and name.endswith(CONV1D): g = g.T.copy()  # the converter stores (out, in)
    hf_layout = g.copy()
    if arch == "gemma" and name.endswith("norm.weight"): g = g + 1
    permuted = arch == "llama" and (".q_proj." in name or ".k_proj." in name)
    if permuted: g = permute(g, cfg.num_heads, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
    f = fmt(name) if g.ndim == 2 else "F32"
    raw, qt = encode(f, g, rng)
    w.add_tensor(gguf_name(name), raw, raw_dtype=qt)
    back = gguf_dequant(raw, qt, g.shape)
    if arch == "gpt2" and name == "transformer.wte.weight":  # the converter writes wte again as the output (GPT2Model.modify_tensors)
      w.add_tensor("output.weight", raw, raw_dtype=qt)
      expected["lm_head.weight"] = back
    if permuted:  # undo the permutation by its inverse as an index (independent of kiln's closed form)
      back = back[np.argsort(permute(np.arange(g.shape[0]), cfg.num_heads, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads))]
    if arch == "gemma" and name.endswith("norm.weight"): back = back - np.float32(1)
    expected[name] = back if f != "F32" or permuted or arch == "gemma" else hf_layout
  if (cfg.rope_scaling or {}).get("rope_type") == "llama3": w.add_tensor("rope_freqs.weight", llama3_factors(hf_config))
  for name, a in (extra or {}).items(): w.add_tensor(name, a.astype(np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return expected


def llama3_factors(hf_config: dict[str, Any]) -> np.ndarray:
  """The rope_freqs tensor llama.cpp's converter precomputes for Llama 3's RoPE scaling (LlamaModel.generate_extra_tensors)."""
  rs = hf_config["rope_scaling"]
  base, dim = hf_config.get("rope_theta", 10000.0), hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
  factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
  freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < old / hi: out.append(1.0)
    elif wavelen > old / lo: out.append(factor)
    else:
      smooth = (old / wavelen - lo) / (hi - lo)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out, np.float32)


def write_hf(folder: str | Path, hf_config: dict[str, Any], hf_weights: dict[str, Any], shards: int = 1, files: dict[str, Any] | None = None) -> Path:
  """A HF folder: config.json, the weights as model.safetensors (or `shards` shards and their index), and `files`
  ({name: JSON-able or str}) beside them. A weight may be (uint16 bits, "BF16") as save_safetensors takes it."""
  d = Path(folder)
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(json.dumps(hf_config))
  names = list(hf_weights)
  if shards == 1: save_safetensors(d / "model.safetensors", hf_weights)
  else:
    weight_map = {}
    for s in range(shards):
      part = names[s::shards]
      fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
      save_safetensors(d / fname, {n: hf_weights[n] for n in part})
      weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  for name, v in (files or {}).items(): (d / name).write_text(v if isinstance(v, str) else json.dumps(v))
  return d


def hf_weights(hf_config: dict[str, Any], seed: int = 0, scale: float = 0.5) -> dict[str, np.ndarray]:
  """Random float32 weights in HF naming and layout (GPT-2's Conv1D (in, out)) for the HF config, written out from the
  HF modeling code's module names."""
  from kiln.llm.config import ModelConfig
  c = ModelConfig.from_hf(hf_config)
  rng = np.random.default_rng(seed)
  h, f, v, q, kv = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  out: dict[str, np.ndarray] = {}

  def put(name: str, *shape: int) -> None: out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  if c.arch == "gpt2":
    put("transformer.wte.weight", v, h); put("transformer.wpe.weight", c.max_position, h)
    for i in range(c.num_layers):
      p = f"transformer.h.{i}."
      for n in ("ln_1", "ln_2"): put(p + n + ".weight", h); put(p + n + ".bias", h)
      put(p + "attn.c_attn.weight", h, 3 * h); put(p + "attn.c_attn.bias", 3 * h)
      put(p + "attn.c_proj.weight", h, h); put(p + "attn.c_proj.bias", h)
      put(p + "mlp.c_fc.weight", h, f); put(p + "mlp.c_fc.bias", f)
      put(p + "mlp.c_proj.weight", f, h); put(p + "mlp.c_proj.bias", h)
    put("transformer.ln_f.weight", h); put("transformer.ln_f.bias", h)
    return out
  put("model.embed_tokens.weight", v, h); put("model.norm.weight", h)
  if not c.tie_word_embeddings: put("lm_head.weight", v, h)
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    put(p + "input_layernorm.weight", h); put(p + "post_attention_layernorm.weight", h)
    if c.arch == "phi3": put(p + "self_attn.qkv_proj.weight", q + 2 * kv, h); put(p + "mlp.gate_up_proj.weight", 2 * f, h)
    else:
      put(p + "self_attn.q_proj.weight", q, h); put(p + "self_attn.k_proj.weight", kv, h); put(p + "self_attn.v_proj.weight", kv, h)
      put(p + "mlp.gate_proj.weight", f, h); put(p + "mlp.up_proj.weight", f, h)
    if c.arch == "qwen2": put(p + "self_attn.q_proj.bias", q); put(p + "self_attn.k_proj.bias", kv); put(p + "self_attn.v_proj.bias", kv)
    put(p + "self_attn.o_proj.weight", h, q); put(p + "mlp.down_proj.weight", h, f)
  return out


def tiny_config(arch: str, **over: Any) -> dict[str, Any]:
  """A tiny HF config.json dict of each architecture (head_dim 8, 2 layers)."""
  base: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2},
    "qwen2": {"model_type": "qwen2", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": True},
    "gemma": {"model_type": "gemma", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64},
    "phi3": {"model_type": "phi3", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "max_position_embeddings": 64},
    "gpt2": {"model_type": "gpt2", "vocab_size": 40, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
  }
  return {**base[arch], **over}
