"""A Hugging Face folder as a Checkpoint: config.json (and generation_config.json's end-of-sequence ids), the weights in
model.safetensors or in the shards model.safetensors.index.json names, each file mapped and its header checked by
kiln.graph.weights.load_safetensors (nothing is read until a weight is used). Weights are F32, F16 or BF16.

Names are HF's, with two normalisations: GPT-2 checkpoints saved from GPT2Model (the original ones: "h.0.attn.c_attn.weight",
"wte.weight") get GPT2LMHeadModel's "transformer." prefix; buffers some checkpoints carry (rotary_emb.inv_freq, GPT-2's
attn.bias / attn.masked_bias causal masks) are not weights and are left out. A tied checkpoint's stored lm_head.weight is
left out as HF's tying ignores it. GPT-2's Conv1D weights are stored (in, out): quant() says transposed, tensor() gives
(out, in). Other model files (pytorch_model.bin) are refused: they are pickles, which kiln does not load.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from kiln.graph.weights import WeightsError, load_safetensors
from kiln.ir.files import open_regular
from kiln.llm import limits
from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import ModelConfig
from kiln.llm.errors import CheckpointError
from kiln.llm.quants import QuantTensor

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.json", "chat_template.jinja")
_BUFFER = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)")
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_FORMATS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  d = dict(pairs)
  if len(d) != len(pairs): raise ValueError("a key appears twice")
  return d


def read_json(path: str, what: str) -> Any:
  """The JSON document in a regular file of at most MAX_CONFIG_BYTES."""
  fd = open_regular(path, what, CheckpointError)
  with os.fdopen(fd, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size > limits.MAX_CONFIG_BYTES: raise CheckpointError(f"{path}: {what} of {size} bytes is over MAX_CONFIG_BYTES = {limits.MAX_CONFIG_BYTES}")
    raw = f.read(limits.MAX_CONFIG_BYTES + 1)
  try: return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
  except (UnicodeDecodeError, ValueError, RecursionError) as e: raise CheckpointError(f"{path}: {what} is not valid JSON: {e}") from None


class HFCheckpoint(Checkpoint):
  """A Hugging Face model folder (see the module's docstring)."""

  def __init__(self, folder: str | os.PathLike[str]):
    self.path = p = os.path.abspath(os.fspath(folder))
    cfg_path = os.path.join(p, "config.json")
    if not os.path.isfile(cfg_path): raise CheckpointError(f"{p}: a Hugging Face folder needs config.json, which it lacks")
    self.metadata: dict[str, Any] = read_json(cfg_path, "config.json")
    cfg = ModelConfig.from_hf(self.metadata, where=cfg_path)
    gen_path = os.path.join(p, "generation_config.json")
    if os.path.isfile(gen_path): cfg = _with_generation_eos(cfg, read_json(gen_path, "generation_config.json"), gen_path)
    self.config = cfg
    self._arrays: dict[str, tuple[np.ndarray, str]] = {}  # HF name -> (mapped array, format)
    shards = self._shards()
    index = os.path.join(p, "model.safetensors.index.json")
    self._files = [cfg_path, *(f for f in (gen_path, index) if os.path.isfile(f)), *shards]
    for shard, names in shards.items():
      try: tensors = load_safetensors(shard, names)
      except WeightsError as e: raise CheckpointError(str(e)) from None
      for name, t in tensors.items(): self._add(shard, name, t.node.arg.data, t.node.dtype.name)
    if cfg.tie_word_embeddings: self._arrays.pop("lm_head.weight", None)
    self.tokenizer_files = {n: os.path.join(p, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(p, n))}
    self.tokenizer_metadata: dict[str, Any] = {}
    self._check_weights()

  def files(self) -> list[str]: return list(self._files)

  def _shards(self) -> dict[str, list[str] | None]:
    """{safetensors file: the names to load from it (None: all)}."""
    p = self.path
    index = os.path.join(p, "model.safetensors.index.json")
    if os.path.isfile(index):
      doc = read_json(index, "model.safetensors.index.json")
      wm = doc.get("weight_map") if isinstance(doc, dict) else None
      if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
      out: dict[str, list[str] | None] = {}
      for name, file in wm.items():
        if os.path.basename(file) != file or file in (".", "..") or not file.endswith(".safetensors"):
          raise CheckpointError(f"{index}: tensor {name!r} names file {file!r}; shards must be .safetensors files in the folder itself")
        names = out.setdefault(os.path.join(p, file), [])
        assert names is not None
        names.append(name)
      if len(out) > limits.MAX_SHARDS: raise CheckpointError(f"{index}: {len(out)} shards are over MAX_SHARDS = {limits.MAX_SHARDS}")
      return out
    single = os.path.join(p, "model.safetensors")
    if os.path.isfile(single): return {single: None}
    other = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5") if os.path.exists(os.path.join(p, n))]
    hint = f" (it has {', '.join(other)}: pickled or TensorFlow weights, which kiln does not load; convert them to safetensors)" if other else ""
    raise CheckpointError(f"{p}: no model.safetensors or model.safetensors.index.json{hint}")

  def _add(self, shard: str, name: str, arr: np.ndarray, dtype: str) -> None:
    if _BUFFER.fullmatch(name): return
    if self.config.arch == "gpt2" and not name.startswith("transformer.") and name != "lm_head.weight": name = "transformer." + name
    if dtype not in _FORMATS: raise CheckpointError(f"{shard}: weight {name!r} is {dtype}; kiln reads F32, F16 and BF16 weights")
    if name in self._arrays: raise CheckpointError(f"{shard}: weight {name!r} appears in two shards")
    self._arrays[name] = (arr, _FORMATS[dtype])

  def names(self) -> list[str]: return list(self._arrays)

  def __contains__(self, name: object) -> bool: return name in self._arrays

  def quant(self, name: str) -> QuantTensor:
    if name not in self._arrays: raise self._missing(name)
    arr, fmt = self._arrays[name]
    transposed = self.config.arch == "gpt2" and name.endswith(_CONV1D) and arr.ndim == 2
    data = arr.reshape(1, -1) if arr.ndim < 2 else arr.reshape(-1, arr.shape[-1])
    return QuantTensor(fmt, tuple(arr.shape[::-1]) if transposed else tuple(arr.shape), data.view(np.uint8), transposed=transposed)


def _with_generation_eos(cfg: ModelConfig, gen: Any, where: str) -> ModelConfig:
  """cfg with generation_config.json's eos_token_id(s) added (HF's generate stops at those)."""
  eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
  if eos is None: return cfg
  ids = eos if isinstance(eos, list) else [eos]
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids): raise CheckpointError(f"{where}: eos_token_id {eos!r} is not ints")
  merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *ids]))
  try: return ModelConfig(**{**cfg.model_dump(), "eos_token_ids": merged})
  except ValueError as e: raise CheckpointError(f"{where}: {e}") from None
