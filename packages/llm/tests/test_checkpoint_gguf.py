"""GGUF checkpoints: tiny models converted as llama.cpp's converter converts them (checkpoint_files.write_gguf), opened by
kiln.llm.open_checkpoint: HF names, HF layout (llama's Q/K permutation, gemma's 1 + w norms, GPT-2's Conv1D undone),
every weight format, the config from the metadata, the tokenizer fields."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoint_files import hf_weights, permute, tiny_config, write_gguf

from kiln.llm.checkpoint_open import open_checkpoint
from kiln.llm.config import ModelConfig
from kiln.llm.errors import CheckpointError, UnsupportedArchitecture
from kiln.llm.gguf_checkpoint import unpermute_rows

TOKENS = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [f"t{i}" for i in range(40)],
          "tokenizer.ggml.scores": [float(i) for i in range(40)],
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 3,
          "tokenizer.chat_template": "{{ messages }}"}


def test_unpermute_round_trip() -> None:
  rng = np.random.default_rng(0)
  for heads, kv in ((4, 4), (8, 2)):
    q, k = rng.standard_normal((heads * 16, 24)), rng.standard_normal((kv * 16, 24))
    np.testing.assert_array_equal(permute(q, heads, heads)[unpermute_rows(len(q), heads)], q)
    np.testing.assert_array_equal(permute(k, heads, kv)[unpermute_rows(len(k), kv)], k)
    b = rng.standard_normal(kv * 16)
    np.testing.assert_array_equal(permute(b, heads, kv)[unpermute_rows(len(b), kv)], b)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "phi3", "gpt2"])
def test_f32_round_trip(tmp_path: Path, arch: str) -> None:
  """F32 GGUF -> tensor() gives back the HF weights exactly (but gemma's norms, through 1 + w - 1), under their HF names."""
  cj = tiny_config(arch)
  w = hf_weights(cj, seed=1)
  write_gguf(tmp_path / "m.gguf", cj, w, meta=TOKENS)
  ck = open_checkpoint(tmp_path / "m.gguf")
  want = ModelConfig.from_hf(cj)
  expected = {n for n in w if not (want.tie_word_embeddings and n == "lm_head.weight")}
  if arch == "gpt2":  # its GGUF holds the output as a copy of wte: a weight of its own, so untied
    assert not ck.config.tie_word_embeddings
    expected.add("lm_head.weight")
    w = {**w, "lm_head.weight": w["transformer.wte.weight"]}
  else: assert ck.config.tie_word_embeddings == want.tie_word_embeddings
  assert set(ck.names()) == expected
  for name in expected:
    hf = w[name].T if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else w[name]
    got = ck.tensor(name)
    assert got.dtype == np.float32 and got.shape == hf.shape, name
    if arch == "gemma" and name.endswith("norm.weight"): np.testing.assert_allclose(got, hf, atol=2e-7, err_msg=name)
    else: np.testing.assert_array_equal(got, hf, err_msg=name)
  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "norm_eps",
                "max_position", "mlp", "act", "norm", "norm_add_one", "embed_scale", "attention_bias", "positions"):
    assert getattr(ck.config, field) == pytest.approx(getattr(want, field)), field
  assert ck.config.bos_token_id == 1 and ck.config.eos_token_ids == (2, 3)  # eos and eot both end generation
  tm = ck.tokenizer_metadata
  assert tm["tokenizer.ggml.tokens"][:2] == ["t0", "t1"] and isinstance(tm["tokenizer.ggml.scores"], list)
  assert tm["tokenizer.chat_template"] == "{{ messages }}" and ck.tokenizer_files == {}


@pytest.mark.parametrize("fmt", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_formats(tmp_path: Path, fmt: str) -> None:
  """Every weight format, on a llama whose rows are whole K-quant blocks (hidden and intermediate 256), Q and K permuted."""
  cj = tiny_config("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1, vocab_size=8)
  w = hf_weights(cj, seed=2)
  want = write_gguf(tmp_path / "m.gguf", cj, w, fmt=lambda n: fmt)
  ck = open_checkpoint(tmp_path / "m.gguf")
  for name, ref in want.items():
    q = ck.quant(name)
    assert q.format == (fmt if ref.ndim == 2 else "F32") and q.shape == ref.shape, name
    assert not q.data.flags.writeable and q.data.dtype == np.uint8
    np.testing.assert_array_equal(ck.tensor(name).view(np.uint32), ref.astype(np.float32).view(np.uint32), err_msg=name)
    if fmt not in ("Q4_K", "Q5_K", "Q6_K"):  # made by quantizing the HF weight: close to it
      assert np.abs(ck.tensor(name) - w[name]).max() < 0.5, name
  emb = "model.embed_tokens.weight"
  np.testing.assert_array_equal(ck.rows(emb, [3, 0, 3]), want[emb][[3, 0, 3]])
  q = "model.layers.0.self_attn.q_proj.weight"
  np.testing.assert_array_equal(ck.rows(q, [5, 9]), want[q][[5, 9]])  # rows of a permuted weight: HF rows


def test_qwen2_biases_and_tied(tmp_path: Path) -> None:
  cj = tiny_config("qwen2")
  w = hf_weights(cj, seed=3)
  write_gguf(tmp_path / "m.gguf", cj, w)
  ck = open_checkpoint(tmp_path / "m.gguf")
  assert ck.config.attention_bias and not ck.config.attention_out_bias and ck.config.tie_word_embeddings
  assert "lm_head.weight" not in ck.names()
  np.testing.assert_array_equal(ck.tensor("model.layers.1.self_attn.k_proj.bias"), w["model.layers.1.self_attn.k_proj.bias"])


def test_llama_biases_are_unpermuted(tmp_path: Path) -> None:
  cj = tiny_config("llama", attention_bias=True)
  w = hf_weights(cj, seed=4)
  rng = np.random.default_rng(5)
  for i in range(2):
    for n, size in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16), ("o_proj", 32)):
      w[f"model.layers.{i}.self_attn.{n}.bias"] = rng.standard_normal(size).astype(np.float32)
  write_gguf(tmp_path / "m.gguf", cj, w)
  ck = open_checkpoint(tmp_path / "m.gguf")
  assert ck.config.attention_bias and ck.config.attention_out_bias
  for n in ("q_proj", "k_proj", "o_proj"):
    np.testing.assert_array_equal(ck.tensor(f"model.layers.1.self_attn.{n}.bias"), w[f"model.layers.1.self_attn.{n}.bias"])


def test_llama3_rope_freqs_and_longrope(tmp_path: Path) -> None:
  """Llama 3's scaling as the converter precomputes it (rope_freqs) gives HF's frequencies; so do phi3's longrope factors."""
  cj = tiny_config("llama", head_dim=32, num_attention_heads=1, num_key_value_heads=1, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64})
  write_gguf(tmp_path / "l3.gguf", cj, hf_weights(cj))
  ck = open_checkpoint(tmp_path / "l3.gguf")
  hf = ModelConfig.from_hf(cj)
  assert ck.config.rope_freq_factors is not None and len(set(ck.config.rope_freq_factors)) > 2  # low, high and smoothed frequencies
  assert ck.config.rope_scaling is None and "rope_freqs.weight" not in ck.names()
  np.testing.assert_allclose(ck.config.rope_inv_freq(), hf.rope_inv_freq(), rtol=1e-6)
  pj = tiny_config("phi3")
  long, short = np.linspace(1, 4, 4, dtype=np.float32), np.linspace(1, 1.5, 4, dtype=np.float32)
  write_gguf(tmp_path / "p.gguf", pj, hf_weights(pj), meta={"phi3.rope.scaling.original_context_length": 16},
             extra={"rope_factors_long.weight": long, "rope_factors_short.weight": short})
  rs = open_checkpoint(tmp_path / "p.gguf").config
  assert rs.rope_scaling is not None and rs.rope_scaling["rope_type"] == "longrope"
  base = ModelConfig.from_hf(pj).rope_inv_freq()
  np.testing.assert_allclose(rs.rope_inv_freq(8), base / short, rtol=1e-6)
  np.testing.assert_allclose(rs.rope_inv_freq(40), base / long, rtol=1e-6)


def test_unsupported_and_missing(tmp_path: Path) -> None:
  import gguf
  w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "bert")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(UnsupportedArchitecture, match=r"'bert'.*llama, qwen2, phi3, gemma, gpt2"): open_checkpoint(tmp_path / "b.gguf")
  cj = tiny_config("llama")
  w2 = hf_weights(cj)
  del w2["model.layers.1.mlp.up_proj.weight"]
  write_gguf(tmp_path / "m.gguf", cj, w2)
  with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"): open_checkpoint(tmp_path / "m.gguf")
  w3 = hf_weights(cj)
  w3["model.layers.0.mlp.down_proj.weight"] = w3["model.layers.0.mlp.down_proj.weight"][:, :32]
  write_gguf(tmp_path / "s.gguf", cj, w3)
  with pytest.raises(CheckpointError, match=r"down_proj.weight.*\(32, 32\).*\(32, 64\)"): open_checkpoint(tmp_path / "s.gguf")


def _mapped_kb(path: Path) -> int:
  """Resident KB of this process's maps of `path` (Linux /proc/self/smaps)."""
  total, cur, want = 0, False, str(path.resolve())
  for line in open("/proc/self/smaps"):
    parts = line.split()
    if parts and "-" in parts[0] and ":" not in parts[0]: cur = parts[-1] == want
    elif cur and parts[0] == "Rss:": total += int(parts[1])
  return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_release_drops_a_tensors_pages_and_loses_nothing(tmp_path: Path) -> None:
  """A repacked matrix's bytes are released from the map (load() does it after packing): they leave the process's resident
  memory, and reading the tensor again gives the same values (the map is file-backed)."""
  cj = tiny_config("llama", num_hidden_layers=1, hidden_size=256, intermediate_size=1024, vocab_size=64)
  write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=2), fmt=lambda n: "Q8_0")
  ck = open_checkpoint(tmp_path / "m.gguf")
  mats = [n for n in ck.names() if len(ck.shape(n)) == 2]
  before = {n: ck.tensor(n) for n in mats}  # every matrix read: its pages resident
  touched = _mapped_kb(tmp_path / "m.gguf")
  for n in mats: ck.release(n)
  released = _mapped_kb(tmp_path / "m.gguf")
  assert released < touched / 4, (touched, released)
  for n in mats: np.testing.assert_array_equal(ck.tensor(n), before[n])
