"""ModelConfig: the shape and the math choices of a decoder-only language model, one record for every architecture kiln.llm
runs, made from a Hugging Face config.json (`ModelConfig.from_hf`) or from a GGUF file's metadata (`ModelConfig.from_gguf`).

The model code reads only this record, never the raw config: the per-architecture defaults (HF's config classes' values
where a key is absent) and the differences between families live here, once:
  llama / mistral   RMSNorm, RoPE (rotate-half layout), grouped-query attention, SwiGLU; Llama 3's, linear and dynamic
                    RoPE scaling; mistral's sliding window
  qwen2             as llama, with q/k/v biases
  phi3              as llama (HF stores q/k/v fused as qkv_proj and gate/up as gate_up_proj), longrope scaling
  gemma             RMSNorm computing x * (1 + w), embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), head_dim 256
  gpt2              LayerNorm with biases, learned positions (no RoPE), fused c_attn, GELU (tanh) MLP, biases everywhere
Anything else is an UnsupportedArchitecture naming it and SUPPORTED.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kiln.llm import limits
from kiln.llm.errors import CheckpointError, UnsupportedArchitecture

Arch = Literal["llama", "mistral", "qwen2", "phi3", "gemma", "gpt2"]
SUPPORTED: tuple[str, ...] = ("llama", "mistral", "qwen2", "phi3", "gemma", "gpt2")
# HF `architectures` entries -> arch, for a config.json without model_type
_HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Phi3ForCausalLM": "phi3",
               "GemmaForCausalLM": "gemma", "GPT2LMHeadModel": "gpt2"}
# rope scaling kinds kiln computes (HF's rope_type names; "su" is longrope's old name)
ROPE_TYPES = ("linear", "dynamic", "llama3", "longrope")
_ACTS: dict[str, Any] = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                         "gelu_fast": "gelu_tanh"}


class ModelConfig(BaseModel):
  """One model's configuration (frozen). Sizes: q has num_heads x head_dim outputs, k and v num_kv_heads x head_dim.

  rope_scaling is HF's dict normalised to carry "rope_type" (one of ROPE_TYPES), or None for plain RoPE;
  rope_freq_factors (from a GGUF's rope_freqs tensor, where llama.cpp's converter precomputed Llama 3's scaling) divide
  the inverse frequencies. `rope_inv_freq()` is the one place both are applied. partial_rotary_factor < 1 rotates only
  the first rotary_dim dims of each head. positions is "learned" for gpt2 (wpe), "rope" otherwise."""
  model_config = ConfigDict(frozen=True, extra="forbid")

  arch: Arch
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  norm_eps: float
  max_position: int
  positions: Literal["rope", "learned"] = "rope"
  rope_theta: float = 10000.0
  rope_scaling: dict[str, Any] | None = None
  rope_freq_factors: tuple[float, ...] | None = None
  partial_rotary_factor: float = 1.0
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q, k and v projections have biases (qwen2; llama's attention_bias also gives o one)
  attention_out_bias: bool = False
  mlp_bias: bool = False
  mlp: Literal["swiglu", "geglu", "gelu"] = "swiglu"
  act: Literal["silu", "gelu", "gelu_tanh"] = "silu"
  norm: Literal["rms", "layer"] = "rms"
  norm_add_one: bool = False  # gemma: RMSNorm's output is x_normed * (1 + w)
  embed_scale: float = 1.0  # gemma: embeddings are multiplied by sqrt(hidden_size)
  sliding_window: int | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  @model_validator(mode="before")
  @classmethod
  def _ids_in_vocab(cls, data: Any) -> Any:
    """End-of-sequence ids outside the vocabulary are dropped (the model can never produce them, and configs of small test
    models carry their family's defaults: phi3's 32000 with a vocabulary of 100), a bos outside it is None."""
    if not isinstance(data, dict) or not isinstance(data.get("vocab_size"), int): return data
    n, out = data["vocab_size"], dict(data)
    ok = lambda t: isinstance(t, int) and 0 <= t < n  # noqa: E731
    if isinstance(out.get("eos_token_ids"), (list, tuple)): out["eos_token_ids"] = tuple(t for t in out["eos_token_ids"] if ok(t))
    if out.get("bos_token_id") is not None and not ok(out["bos_token_id"]): out["bos_token_id"] = None
    return out

  @model_validator(mode="after")
  def _check(self) -> ModelConfig:
    for name, v, top in (("vocab_size", self.vocab_size, limits.MAX_VOCAB), ("hidden_size", self.hidden_size, limits.MAX_HIDDEN),
                         ("intermediate_size", self.intermediate_size, limits.MAX_HIDDEN), ("num_layers", self.num_layers, limits.MAX_LAYERS),
                         ("num_heads", self.num_heads, limits.MAX_HEADS), ("num_kv_heads", self.num_kv_heads, limits.MAX_HEADS),
                         ("head_dim", self.head_dim, limits.MAX_HIDDEN), ("max_position", self.max_position, limits.MAX_POSITIONS)):
      if not 1 <= v <= top: raise ValueError(f"{name} is {v}, outside 1..{top}")
    if self.num_heads % self.num_kv_heads: raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
    if self.num_heads * self.head_dim > limits.MAX_HIDDEN: raise ValueError(f"num_heads x head_dim is over {limits.MAX_HIDDEN}")
    if not (math.isfinite(self.norm_eps) and self.norm_eps > 0): raise ValueError(f"norm_eps {self.norm_eps} is not a positive number")
    if self.positions == "rope":
      if not (math.isfinite(self.rope_theta) and self.rope_theta > 1): raise ValueError(f"rope_theta {self.rope_theta} is not a number over 1")
      if not 0 < self.partial_rotary_factor <= 1: raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} is outside (0, 1]")
      if self.rotary_dim < 2 or self.rotary_dim % 2: raise ValueError(f"the rotary dims ({self.rotary_dim}) must be a positive even number")
      if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rotary_dim // 2:
        raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} values, the rotary dims need {self.rotary_dim // 2}")
      if self.rope_scaling is not None: _check_rope_scaling(self.rope_scaling, self.rotary_dim)
    if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
      raise ValueError(f"bos_token_id {self.bos_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
    if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
      raise ValueError(f"eos_token_ids {list(self.eos_token_ids)} are not all inside the vocabulary (0..{self.vocab_size - 1})")
    return self

  @property
  def rotary_dim(self) -> int:
    """The dims of each head RoPE rotates (the first ones; the rest pass through)."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def q_size(self) -> int: return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int: return self.num_kv_heads * self.head_dim

  def rope_inv_freq(self, seq_len: int | None = None) -> np.ndarray:
    """The rotary inverse frequencies (rotary_dim // 2 float32 values) as HF's rope initialisers compute them for this
    config: plain, linear, dynamic NTK, Llama 3 and longrope scaling, and a GGUF's precomputed freq factors. dynamic and
    longrope depend on the sequence length the positions reach (seq_len; the trained length when None), as in HF."""
    if self.positions != "rope": raise CheckpointError(f"{self.arch} has learned positions, no rotary frequencies")
    dim, base, rs = self.rotary_dim, self.rope_theta, self.rope_scaling or {}
    kind = rs.get("rope_type")
    expo = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    if kind == "dynamic":
      n = max(seq_len or 0, self.max_position)
      f = float(rs["factor"])
      base = base * math.pow((f * n / self.max_position) - (f - 1), dim / (dim - 2))
    inv: np.ndarray = (1.0 / np.power(np.float32(base), expo)).astype(np.float32)
    if kind == "linear": inv = inv / np.float32(rs["factor"])
    elif kind == "llama3": inv = _llama3(inv, rs)
    elif kind == "longrope":
      orig = int(rs.get("original_max_position_embeddings") or self.max_position)
      ext = rs["long_factor"] if seq_len is not None and seq_len > orig else rs["short_factor"]
      inv = (1.0 / (np.asarray(ext, np.float32) * np.power(np.float32(base), expo))).astype(np.float32)
    if self.rope_freq_factors is not None: inv = inv / np.asarray(self.rope_freq_factors, np.float32)
    return inv.astype(np.float32)

  def rope_attention_factor(self) -> float:
    """The factor HF multiplies cos and sin by (1 but for longrope, whose attention_factor is sqrt(1 + ln(s)/ln(orig)))."""
    rs = self.rope_scaling or {}
    if rs.get("rope_type") != "longrope": return 1.0
    if rs.get("attention_factor") is not None: return float(rs["attention_factor"])
    orig = int(rs.get("original_max_position_embeddings") or self.max_position)
    factor = self.max_position / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

  @classmethod
  def from_hf(cls, config_json: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
    """The config of a Hugging Face config.json (its parsed dict). `where` names the file in errors."""
    return _build(lambda: _from_hf(config_json, where), where)

  @classmethod
  def from_gguf(cls, meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]] | None = None, where: str = "GGUF metadata",
                rope_freq_factors: tuple[float, ...] | None = None, rope_scaling: dict[str, Any] | None = None) -> ModelConfig:
    """The config of a GGUF file from its metadata (`general.architecture` and the `{arch}.*` keys) and, where given, its
    tensors' GGUF names and numpy shapes, which say the vocabulary size, the biases and whether the output is tied.
    rope_freq_factors and rope_scaling carry what the file stores as tensors (rope_freqs; phi3's rope_factors_long/short).
    eos_token_ids are the eos, eot and eom ids the file names (llama.cpp ends generation at any of them)."""
    return _build(lambda: _from_gguf(meta, tensors or {}, where, rope_freq_factors, rope_scaling), where)


def _build(make: Any, where: str) -> ModelConfig:
  try: cfg: ModelConfig = make()
  except ValidationError as e:
    errs = "; ".join((f"{'.'.join(str(p) for p in err['loc'])}: " if err['loc'] else "") + err['msg'].removeprefix("Value error, ")
                     for err in e.errors()[:5])
    raise CheckpointError(f"{where}: {errs}") from None
  except (KeyError, TypeError, ValueError) as e:
    if isinstance(e, CheckpointError): raise
    raise CheckpointError(f"{where}: {e!r} while reading the model configuration") from None
  return cfg


def _check_rope_scaling(rs: Mapping[str, Any], rotary_dim: int) -> None:
  kind = rs.get("rope_type")
  if kind not in ROPE_TYPES: raise ValueError(f"rope scaling type {kind!r} is not supported (kiln has {', '.join(ROPE_TYPES)})")
  need = {"linear": ("factor",), "dynamic": ("factor",), "longrope": ("long_factor", "short_factor"),
          "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
  for k in need:
    if rs.get(k) is None: raise ValueError(f"rope scaling {kind!r} needs {k!r}")
  if kind == "longrope":
    for k in ("long_factor", "short_factor"):
      if len(rs[k]) != rotary_dim // 2: raise ValueError(f"rope scaling {k} has {len(rs[k])} values, the rotary dims need {rotary_dim // 2}")
  elif not float(rs["factor"]) > 0: raise ValueError(f"rope scaling factor {rs['factor']!r} is not positive")


def _llama3(inv: np.ndarray, rs: Mapping[str, Any]) -> np.ndarray:
  """Llama 3's frequency-dependent scaling, as HF's _compute_llama3_parameters."""
  factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
  old = float(rs["original_max_position_embeddings"])
  lo_wavelen, hi_wavelen = old / lo, old / hi
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > lo_wavelen, inv / factor, inv)
  smooth = (old / wavelen - lo) / (hi - lo)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope_scaling(rs: Any) -> dict[str, Any] | None:
  if rs is None: return None
  if not isinstance(rs, Mapping): raise ValueError(f"rope_scaling must be an object or null, got {type(rs).__name__}")
  kind = rs.get("rope_type", rs.get("type"))
  if kind in (None, "default"): return None
  out = dict(rs)
  out.pop("type", None)
  out["rope_type"] = "longrope" if kind == "su" else kind
  return out


def _ids(v: Any) -> tuple[int, ...]:
  if v is None: return ()
  return tuple(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))


def _hf_arch(cj: Mapping[str, Any], where: str) -> Any:
  mt = cj.get("model_type")
  if mt is None:
    classes = cj.get("architectures") or []
    mt = next((_HF_CLASSES[c] for c in classes if c in _HF_CLASSES), classes[0] if classes else None)
  if mt not in SUPPORTED: raise UnsupportedArchitecture(f"{where}: architecture {mt!r} is not supported (kiln.llm runs {', '.join(SUPPORTED)})")
  return mt


def _from_hf(cj: Mapping[str, Any], where: str) -> ModelConfig:
  if not isinstance(cj, Mapping): raise CheckpointError(f"{where}: a config must be a JSON object, got {type(cj).__name__}")
  arch = _hf_arch(cj, where)
  if arch == "gpt2": return _gpt2_from_hf(cj, where)

  def need(k: str) -> Any:
    if k not in cj: raise CheckpointError(f"{where}: {k!r} is missing")
    return cj[k]
  hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
  gemma = arch == "gemma"
  head_dim = cj.get("head_dim") or (256 if gemma and "head_dim" not in cj else hidden // max(heads, 1))
  act_name = (cj.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else cj.get("hidden_act", "silu")
  act = _ACTS.get(act_name)
  if act is None: raise CheckpointError(f"{where}: activation {act_name!r} is not supported (kiln has {', '.join(_ACTS)})")
  defaults = {"llama": (1e-6, 2048, False), "mistral": (1e-6, 4096 * 32, False), "qwen2": (1e-6, 32768, False),
              "phi3": (1e-5, 4096, False), "gemma": (1e-6, 8192, True)}[arch]
  bias = bool(cj.get("attention_bias", False))
  sw = cj.get("sliding_window") if arch in ("mistral", "phi3") or (arch == "qwen2" and cj.get("use_sliding_window")) else None
  rp = cj.get("rope_parameters")  # transformers 5 writes rope_theta, the scaling and partial_rotary_factor here, not at the top level
  rp = rp if isinstance(rp, Mapping) else {}
  prf = cj.get("partial_rotary_factor", rp.get("partial_rotary_factor"))
  theta = cj.get("rope_theta", rp.get("rope_theta"))
  scaling = cj.get("rope_scaling") or {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")} or None
  return ModelConfig(
    arch=arch, vocab_size=int(need("vocab_size")), hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
    num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=int(cj.get("num_key_value_heads") or heads),
    head_dim=int(head_dim), norm_eps=float(cj.get("rms_norm_eps", defaults[0])), max_position=int(cj.get("max_position_embeddings", defaults[1])),
    rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=_rope_scaling(scaling),
    partial_rotary_factor=float(prf) if prf is not None else 1.0,
    tie_word_embeddings=bool(cj.get("tie_word_embeddings", defaults[2])), attention_bias=bias or arch == "qwen2",
    attention_out_bias=bias, mlp_bias=bool(cj.get("mlp_bias", False)), mlp="geglu" if gemma else "swiglu", act=act, norm="rms",
    norm_add_one=gemma, embed_scale=math.sqrt(hidden) if gemma else 1.0, sliding_window=int(sw) if sw else None,
    bos_token_id=cj.get("bos_token_id"), eos_token_ids=_ids(cj.get("eos_token_id")))


def _gpt2_from_hf(cj: Mapping[str, Any], where: str) -> ModelConfig:
  if cj.get("scale_attn_by_inverse_layer_idx") or cj.get("reorder_and_upcast_attn") or cj.get("scale_attn_weights") is False:
    raise CheckpointError(f"{where}: gpt2's scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn / unscaled attention are not supported")
  hidden, heads = int(cj.get("n_embd", 768)), int(cj.get("n_head", 12))
  act_name = cj.get("activation_function", "gelu_new")
  vocab = int(cj.get("vocab_size", 50257))
  eot = 50256 if vocab > 50256 else None  # GPT2Config's default bos/eos, where the vocabulary has it
  act = _ACTS.get(act_name)
  if act not in ("gelu", "gelu_tanh"): raise CheckpointError(f"{where}: gpt2 activation {act_name!r} is not supported (kiln has gelu, gelu_new)")
  return ModelConfig(
    arch="gpt2", vocab_size=vocab, hidden_size=hidden, intermediate_size=int(cj.get("n_inner") or 4 * hidden),
    num_layers=int(cj.get("n_layer", 12)), num_heads=heads, num_kv_heads=heads, head_dim=hidden // max(heads, 1),
    norm_eps=float(cj.get("layer_norm_epsilon", 1e-5)), max_position=int(cj.get("n_positions", 1024)), positions="learned",
    tie_word_embeddings=bool(cj.get("tie_word_embeddings", True)), attention_bias=True, attention_out_bias=True, mlp_bias=True,
    mlp="gelu", act=act, norm="layer", bos_token_id=cj.get("bos_token_id", eot), eos_token_ids=_ids(cj.get("eos_token_id", eot)))


# GGUF architectures -> kiln arch (mistral GGUFs say "llama")
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "phi3": "phi3", "gemma": "gemma", "gpt2": "gpt2"}


def _from_gguf(meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], where: str, factors: tuple[float, ...] | None,
               rope_scaling: dict[str, Any] | None) -> ModelConfig:
  ga = meta.get("general.architecture")
  if ga not in _GGUF_ARCHS:
    raise UnsupportedArchitecture(f"{where}: general.architecture {ga!r} is not supported (kiln.llm runs {', '.join(_GGUF_ARCHS)})")
  arch = _GGUF_ARCHS[ga]

  def key(k: str, default: Any = KeyError) -> Any:
    v = meta.get(f"{ga}.{k}", default)
    if v is KeyError: raise CheckpointError(f"{where}: metadata key {ga}.{k} is missing")
    return v
  hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
  head_dim = int(key("attention.key_length", hidden // max(heads, 1)))
  emb = tensors.get("token_embd.weight")
  vocab = int(key("vocab_size", 0)) or (emb[0] if emb else len(meta.get("tokenizer.ggml.tokens") or ()))
  ff = key("feed_forward_length")
  ff = int(ff[0] if isinstance(ff, (list, tuple, np.ndarray)) else ff)  # some converters store one per layer
  kv = key("attention.head_count_kv", heads)
  kv = int(kv[0] if isinstance(kv, (list, tuple, np.ndarray)) else kv)
  bos = meta.get("tokenizer.ggml.bos_token_id")
  eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
  common: dict[str, Any] = dict(arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_layers=int(key("block_count")),
                                num_heads=heads, num_kv_heads=kv, head_dim=head_dim, max_position=int(key("context_length")),
                                tie_word_embeddings="output.weight" not in tensors,
                                bos_token_id=int(bos) if bos is not None else None,
                                eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)))
  if arch == "gpt2":
    return ModelConfig(**common, norm_eps=float(key("attention.layer_norm_epsilon")), positions="learned", attention_bias=True,
                       attention_out_bias=True, mlp_bias=True, mlp="gelu", act="gelu_tanh", norm="layer")
  rope_dim = int(key("rope.dimension_count", head_dim))
  scaling = rope_scaling
  st, sf = key("rope.scaling.type", None), key("rope.scaling.factor", None)
  if st == "linear" and sf and scaling is None: scaling = {"rope_type": "linear", "factor": float(sf)}
  elif st not in (None, "none", "linear") and scaling is None:
    raise CheckpointError(f"{where}: {ga}.rope.scaling.type {st!r} is not supported (kiln has linear)")
  gemma = arch == "gemma"
  return ModelConfig(**common, norm_eps=float(key("attention.layer_norm_rms_epsilon")), rope_theta=float(key("rope.freq_base", 10000.0)),
                     rope_scaling=scaling, rope_freq_factors=factors, partial_rotary_factor=rope_dim / head_dim,
                     attention_bias="blk.0.attn_q.bias" in tensors, attention_out_bias="blk.0.attn_output.bias" in tensors,
                     mlp_bias="blk.0.ffn_down.bias" in tensors, mlp="geglu" if gemma else "swiglu", act="gelu_tanh" if gemma else "silu",
                     norm_add_one=gemma, embed_scale=math.sqrt(hidden) if gemma else 1.0,
                     sliding_window=int(key("attention.sliding_window")) if key("attention.sliding_window", None) else None)
