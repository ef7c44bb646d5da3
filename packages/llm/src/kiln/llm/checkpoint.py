"""A language model's checkpoint: its ModelConfig and its weights by Hugging Face name, whatever file holds them.

kiln.llm.checkpoint_open's `open_checkpoint(path)` opens a GGUF file (kiln.llm.gguf_checkpoint) or a Hugging Face folder
(kiln.llm.hf: config.json with model.safetensors, or shards named by model.safetensors.index.json). Either way:
  config            ModelConfig
  names()           the weights in HF naming ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
                    "model.norm.weight", "lm_head.weight" unless the embeddings are tied; phi3's fused
                    "self_attn.qkv_proj" and "mlp.gate_up_proj"; gpt2's "transformer.h.0.attn.c_attn.weight", ...)
  tensor(name)      float32 in HF layout, (out, in) for every linear (GPT-2's Conv1D weights too, which HF stores as
                    (in, out)), dequantised; a read-only view of the mapped file where nothing needs converting
  rows(name, ids)   the given rows of tensor(name) only (an embedding lookup without dequantising the table)
  quant(name)       QuantTensor: the stored format and bytes (a read-only view of the map) and what tensor() undoes
  tokenizer_files   {file name: path} of the tokenizer files of a HF folder (tokenizer.json, tokenizer_config.json, ...)
  tokenizer_metadata  a GGUF file's tokenizer.* fields as Python values (lists for arrays), for kiln.llm's tokenizer
Before a checkpoint is returned, every weight its config needs is checked to be present with the shape the config says.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from kiln.llm.config import ModelConfig
from kiln.llm.errors import CheckpointError
from kiln.llm.quants import QuantTensor


class Checkpoint(ABC):
  """A checkpoint's config and weights (see the module's docstring)."""
  path: str
  config: ModelConfig
  tokenizer_files: dict[str, str]
  tokenizer_metadata: dict[str, Any]

  @abstractmethod
  def names(self) -> list[str]: ...

  @abstractmethod
  def files(self) -> list[str]:
    """The files whose bytes make the config and weights (the plan cache's key hashes them: runtime.py)."""

  @abstractmethod
  def quant(self, name: str) -> QuantTensor: ...

  def tensor(self, name: str) -> np.ndarray: return self.quant(name).dequantize()

  def release(self, name: str) -> None:
    """The stored bytes of `name` are no longer needed resident (the caller repacked them): a mapped file may drop them
    from the process's memory (GGUF); reading them again still works. A folder's safetensors keep theirs."""
    return None

  def rows(self, name: str, ids: Any) -> np.ndarray: return self.quant(name).dequantize(rows=np.asarray(ids))

  def shape(self, name: str) -> tuple[int, ...]: return self.quant(name).shape

  def __contains__(self, name: object) -> bool: return name in set(self.names())

  def _missing(self, name: str) -> CheckpointError:
    return CheckpointError(f"{self.path}: no weight named {name!r} (the checkpoint has {len(self.names())}; see names())")

  def _check_weights(self) -> None:
    """Every weight the config needs is present with the shape it says: a checkpoint that opens can be run."""
    have = set(self.names())
    for name, shape in expected_weights(self.config).items():
      if name not in have: raise CheckpointError(f"{self.path}: the {self.config.arch} model needs weight {name!r}, which the checkpoint lacks")
      got = self.shape(name)
      if got != shape: raise CheckpointError(f"{self.path}: weight {name!r} has shape {got}, the config needs {shape}")


def expected_weights(c: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The HF names and (out, in) shapes of the weights a model of config c reads."""
  h, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
  out: dict[str, tuple[int, ...]] = {}
  if c.arch == "gpt2":
    out.update({"transformer.wte.weight": (v, h), "transformer.wpe.weight": (c.max_position, h), "transformer.ln_f.weight": (h,),
                "transformer.ln_f.bias": (h,)})
    for i in range(c.num_layers):
      p = f"transformer.h.{i}."
      for n, shape in (("ln_1", (h,)), ("ln_2", (h,))): out.update({p + n + ".weight": shape, p + n + ".bias": shape})
      for n, o, k in (("attn.c_attn", 3 * h, h), ("attn.c_proj", h, h), ("mlp.c_fc", f, h), ("mlp.c_proj", h, f)):
        out.update({p + n + ".weight": (o, k), p + n + ".bias": (o,)})
  else:
    out.update({"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)})
    q, kv = c.q_size, c.kv_size
    for i in range(c.num_layers):
      p = f"model.layers.{i}."
      out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,), p + "self_attn.o_proj.weight": (h, q),
                  p + "mlp.down_proj.weight": (h, f)})
      if c.arch == "phi3": out.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * f, h)})
      else:
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h)})
        if c.attention_bias: out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
      if c.attention_out_bias: out[p + "self_attn.o_proj.bias"] = (h,)
      if c.mlp_bias and c.arch != "phi3": out.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (h,)})
  if not c.tie_word_embeddings: out["lm_head.weight"] = (v, h)
  return out

