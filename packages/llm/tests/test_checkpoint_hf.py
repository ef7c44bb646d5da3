"""Hugging Face folders: config.json and safetensors weights (one file or shards with their index, F32 / F16 / BF16)
written by kiln.graph.weights' writer, opened by open_checkpoint: names, values, layout (GPT-2's Conv1D as (out, in)),
the config, the tokenizer files; malformed folders are typed errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from checkpoint_files import hf_weights, tiny_config, write_hf

from kiln.ir.dtype import f32_to_bf16_bits
from kiln.llm.checkpoint_open import open_checkpoint
from kiln.llm.errors import CheckpointError, UnsupportedArchitecture
from kiln.llm.hf import HFCheckpoint


@pytest.mark.parametrize("shards", [1, 3])
def test_llama_folder(tmp_path: Path, shards: int) -> None:
  cj = tiny_config("llama", eos_token_id=2)
  w = hf_weights(cj, seed=1)
  stored: dict[str, object] = dict(w)
  stored["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"].astype(np.float16)
  bits = f32_to_bf16_bits(w["model.layers.1.mlp.up_proj.weight"])
  stored["model.layers.1.mlp.up_proj.weight"] = (bits, "BF16")
  stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # a buffer, not a weight
  files = {"tokenizer.json": "{}", "tokenizer_config.json": {"chat_template": "x"}, "generation_config.json": {"eos_token_id": [2, 5]}}
  ck = open_checkpoint(write_hf(tmp_path / "m", cj, stored, shards=shards, files=files))
  assert isinstance(ck, HFCheckpoint) and set(ck.names()) == set(w)
  for name, ref in w.items():
    got = ck.tensor(name)
    if name == "model.layers.0.mlp.up_proj.weight": ref = ref.astype(np.float16).astype(np.float32)
    if name == "model.layers.1.mlp.up_proj.weight": ref = (bits.astype(np.uint32) << 16).view(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ref, err_msg=name)
  assert ck.quant("model.layers.1.mlp.up_proj.weight").format == "BF16" and ck.quant("model.norm.weight").format == "F32"
  q = ck.quant("model.layers.0.self_attn.q_proj.weight")
  assert not q.data.flags.writeable and q.shape == (32, 32)
  assert np.shares_memory(ck.tensor("model.norm.weight"), q.data) is False  # different weights...
  assert np.shares_memory(ck.tensor("model.layers.0.self_attn.q_proj.weight"), q.data)  # ...but F32 is a view of the map
  np.testing.assert_array_equal(ck.rows("model.embed_tokens.weight", [4, 1]), w["model.embed_tokens.weight"][[4, 1]])
  c = ck.config
  assert (c.arch, c.num_kv_heads, c.head_dim, c.norm_eps, c.eos_token_ids, c.bos_token_id) == ("llama", 2, 8, 1e-5, (2, 5), 1)
  assert set(ck.tokenizer_files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
  assert ck.tokenizer_files["tokenizer.json"] == str(tmp_path / "m" / "tokenizer.json")


def test_gpt2_conv1d_and_prefix(tmp_path: Path) -> None:
  """GPT-2 as the original checkpoints store it: GPT2Model's names (no "transformer."), Conv1D weights (in, out), the
  attn.bias causal-mask buffers; tied, so a stored lm_head is not a weight."""
  cj = tiny_config("gpt2")
  w = hf_weights(cj, seed=2)
  stored = {k.removeprefix("transformer."): v for k, v in w.items()}
  stored["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
  stored["lm_head.weight"] = np.zeros((40, 32), np.float32)
  ck = open_checkpoint(write_hf(tmp_path / "g", cj, stored))
  assert set(ck.names()) == set(w)
  c_attn = "transformer.h.1.attn.c_attn.weight"
  assert ck.shape(c_attn) == (96, 32) and ck.quant(c_attn).transposed
  np.testing.assert_array_equal(ck.tensor(c_attn), w[c_attn].T)
  np.testing.assert_array_equal(ck.tensor("transformer.h.1.attn.c_attn.bias"), w["transformer.h.1.attn.c_attn.bias"])
  np.testing.assert_array_equal(ck.tensor("transformer.h.0.mlp.c_fc.weight"), w["transformer.h.0.mlp.c_fc.weight"].T)
  assert ck.config.positions == "learned" and ck.config.tie_word_embeddings


@pytest.mark.parametrize("arch", ["qwen2", "gemma", "phi3"])
def test_other_architectures(tmp_path: Path, arch: str) -> None:
  cj = tiny_config(arch)
  w = hf_weights(cj, seed=3)
  ck = open_checkpoint(write_hf(tmp_path / arch, cj, w))
  assert set(ck.names()) == set(w) and ck.config.arch == arch
  for name, ref in w.items(): np.testing.assert_array_equal(ck.tensor(name), ref, err_msg=name)


def test_malformed_folders(tmp_path: Path) -> None:
  cj = tiny_config("llama")
  w = hf_weights(cj)
  d = write_hf(tmp_path / "a", cj, w)
  (d / "model.safetensors").unlink()
  (d / "pytorch_model.bin").write_bytes(b"pickle")
  with pytest.raises(CheckpointError, match="pytorch_model.bin.*convert them to safetensors"): open_checkpoint(d)
  d = write_hf(tmp_path / "b", cj, w, shards=2)
  idx = json.loads((d / "model.safetensors.index.json").read_text())
  idx["weight_map"]["model.norm.weight"] = "../evil.safetensors"
  (d / "model.safetensors.index.json").write_text(json.dumps(idx))
  with pytest.raises(CheckpointError, match="in the folder itself"): open_checkpoint(d)
  idx["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"  # the other shard holds it
  (d / "model.safetensors.index.json").write_text(json.dumps(idx))
  with pytest.raises(CheckpointError, match="model.norm.weight"): open_checkpoint(d)
  d = write_hf(tmp_path / "c", {**cj, "model_type": "bert"}, w)
  with pytest.raises(UnsupportedArchitecture, match="'bert'.*llama, mistral, qwen2, phi3, gemma, gpt2"): open_checkpoint(d)
  d = write_hf(tmp_path / "d", cj, w)
  (d / "config.json").write_text("{not json")
  with pytest.raises(CheckpointError, match="config.json is not valid JSON"): open_checkpoint(d)
  d = write_hf(tmp_path / "e", cj, {**w, "model.layers.0.mlp.up_proj.weight": np.zeros((64, 32), np.int32)})
  with pytest.raises(CheckpointError, match="int32; kiln reads F32, F16 and BF16"): open_checkpoint(d)
  d = write_hf(tmp_path / "f", cj, {k: v for k, v in w.items() if k != "lm_head.weight"})
  with pytest.raises(CheckpointError, match="lm_head.weight"): open_checkpoint(d)
  d = write_hf(tmp_path / "g", cj, w)
  raw = (d / "model.safetensors").read_bytes()
  (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
  with pytest.raises(CheckpointError, match="model.safetensors"): open_checkpoint(d)
  with pytest.raises(CheckpointError, match="no weight named 'nope'"): open_checkpoint(write_hf(tmp_path / "h", cj, w)).tensor("nope")


def test_ids_outside_the_vocabulary(tmp_path: Path) -> None:
  """A small model's config with its family's default ids (phi3's eos 32000, gpt2's 50256) past its vocabulary: those eos
  ids are dropped (never produced), such a bos is None; ids inside stay."""
  cj = tiny_config("phi3", eos_token_id=[32000, 7], bos_token_id=32001)
  ck = open_checkpoint(write_hf(tmp_path / "p", cj, hf_weights(cj), files={"generation_config.json": {"eos_token_id": [32000, 9]}}))
  assert ck.config.eos_token_ids == (7, 9) and ck.config.bos_token_id is None
