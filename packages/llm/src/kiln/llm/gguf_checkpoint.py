"""A GGUF file as a Checkpoint: llama.cpp's tensor names mapped to Hugging Face's, and what llama.cpp's converter
(convert_hf_to_gguf.py) changed about the weights undone, so tensor() returns what the HF checkpoint held:
  - llama: the rows of each Q and K projection (weight and bias) were interleaved per head for llama.cpp's rope layout
    (LlamaModel.permute: rows (head, 2, d/2) -> (head, d/2, 2)); QuantTensor.row_perm gathers them back;
  - gemma: norm weights were stored as 1 + w; QuantTensor.offset = -1 (the float32 sum and difference can lose the last
    bits of a w much smaller than 1);
  - gpt2: the Conv1D weights were transposed to (out, in) already, as HF's other linears; wte was written twice, as
    token_embd and as output, so a gpt2 GGUF has an lm_head.weight of its own (tie_word_embeddings False: the output
    may be quantized apart from the embeddings, as llama.cpp's quantize does);
  - Llama 3's RoPE scaling was precomputed into a rope_freqs tensor (ModelConfig.rope_freq_factors) and phi3's longrope
    factors into rope_factors_long/short (ModelConfig.rope_scaling); those are config, not weights, so not in names().
Tensors other than a model's weights and those are left out of names().
"""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import ModelConfig
from kiln.llm.errors import CheckpointError
from kiln.llm.gguf_file import GGUFFile
from kiln.llm.quants import QuantTensor

_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc",
               "ffn_down": "mlp.c_proj"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_arch: str, name: str) -> str | None:
  """The HF name of a GGUF tensor of a model of architecture gguf_arch (None: not a weight kiln maps)."""
  gpt2 = gguf_arch == "gpt2"
  m = _BLOCK.fullmatch(name)
  if m:
    i, part, kind = m.groups()
    if gpt2: return f"transformer.h.{i}.{_GPT2_BLOCK[part]}.{kind}" if part in _GPT2_BLOCK else None
    base = "mlp.gate_up_proj" if gguf_arch == "phi3" and part == "ffn_up" else _LLAMA_BLOCK.get(part)  # phi3's ffn_up holds gate and up
    return f"model.layers.{i}.{base}.{kind}" if base else None
  m = _TOP.fullmatch(name)
  if m:
    base = (_GPT2_TOP if gpt2 else _LLAMA_TOP).get(m.group(1))
    return f"{base}.{m.group(2)}" if base else None
  return None


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
  """row_perm undoing llama.cpp's LlamaModel.permute on a (rows, ...) Q or K weight of n_head heads: HF row
  h*d + j*(d/2) + i was stored at row h*d + 2i + j."""
  if rows % n_head or (rows // n_head) % 2: raise CheckpointError(f"{rows} rows are not n_head = {n_head} heads of an even size")
  return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(0, 2, 1).reshape(-1)


class GGUFCheckpoint(Checkpoint):
  """A GGUF file (v2/v3) of a llama, qwen2, phi3, gemma or gpt2 model (mistral's GGUFs say llama)."""

  def __init__(self, path: str | os.PathLike[str]):
    self.file = f = GGUFFile(path)
    self.path = f.path
    self.metadata: dict[str, Any] = f.metadata
    arch = f.metadata.get("general.architecture")
    shapes = {n: t.shape for n, t in f.tensors.items()}
    self.config = ModelConfig.from_gguf(f.metadata, shapes, where=self.path, rope_freq_factors=self._vector("rope_freqs.weight"),
                                        rope_scaling=self._longrope(arch))
    self._map: dict[str, str] = {}
    for name in f.tensors:
      hf = hf_name(str(arch), name)
      if hf is None: continue
      if self.config.tie_word_embeddings and hf == "lm_head.weight": continue
      self._map[hf] = name
    self.tokenizer_files: dict[str, str] = {}
    self.tokenizer_metadata = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    self._check_weights()

  def _vector(self, name: str) -> tuple[float, ...] | None:
    if name not in self.file.tensors: return None
    t = self.file.tensors[name]
    if len(t.shape) != 1: raise CheckpointError(f"{self.path}: tensor {name!r} has shape {t.shape}, not a vector")
    return tuple(float(x) for x in QuantTensor(t.format.name, t.shape, self.file.raw(name)).dequantize())

  def _longrope(self, arch: Any) -> dict[str, Any] | None:
    long, short = self._vector("rope_factors_long.weight"), self._vector("rope_factors_short.weight")
    if long is None and short is None: return None
    if long is None or short is None: raise CheckpointError(f"{self.path}: has one of rope_factors_long / rope_factors_short without the other")
    m = self.metadata
    orig, attn = m.get(f"{arch}.rope.scaling.original_context_length"), m.get(f"{arch}.rope.scaling.attn_factor")
    rs: dict[str, Any] = {"rope_type": "longrope", "long_factor": list(long), "short_factor": list(short)}
    if orig is not None: rs["original_max_position_embeddings"] = int(orig)
    if attn is not None: rs["attention_factor"] = float(attn)
    return rs

  def files(self) -> list[str]: return [self.path]

  def names(self) -> list[str]: return list(self._map)

  def __contains__(self, name: object) -> bool: return name in self._map

  def release(self, name: str) -> None:
    if (g := self._map.get(name)) is not None: self.file.release(g)

  def quant(self, name: str) -> QuantTensor:
    g = self._map.get(name)
    if g is None: raise self._missing(name)
    t, c = self.file.tensors[g], self.config
    perm = None
    if self.metadata.get("general.architecture") == "llama":
      if g.startswith("blk.") and g.split(".")[2] in ("attn_q", "attn_k"):
        perm = unpermute_rows(t.shape[0], c.num_heads if g.split(".")[2] == "attn_q" else c.num_kv_heads)
    offset = -1.0 if c.arch == "gemma" and name.endswith("norm.weight") else 0.0
    data = self.file.raw(g)
    if len(t.shape) == 1 and perm is not None:  # a bias: permuted value by value, so one row per value
      if t.format.block_size != 1: raise CheckpointError(f"{self.path}: tensor {g!r} is a {t.format.name} vector; kiln reads Q/K biases as floats")
      data = data.reshape(t.shape[0], -1)
    return QuantTensor(t.format.name, t.shape, data, row_perm=perm, offset=offset)
