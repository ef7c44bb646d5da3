"""The forward graph (model.py) per architecture against a numpy float64 reference (reference_model.py), run through the
runtime (runtime.py): teacher-forced logits of a whole prompt, in chunks, and token by token over the KV cache."""
import numpy as np
import pytest
from reference_model import HF_CONFIGS, checkpoint_get, config, logits, weights

from kiln.executor import cache_stats
from kiln.llm.config import ModelConfig
from kiln.llm.errors import LLMError
from kiln.llm.kv import ContextFullError
from kiln.llm.model import ModelError
from kiln.llm.runtime import Runner

TOL = 1e-4  # of the largest logit


def _err(got: np.ndarray, want: np.ndarray) -> float: return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2"])
def test_logits_match_the_reference(arch: str):
  cfg = config(arch)
  W = weights(cfg)
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 11)
  want = logits(cfg, W, ids)
  r = Runner(cfg, checkpoint_get(cfg, W), ctx=24, chunk=4)  # 11 tokens: chunks of 4, 4 and 3
  assert _err(r.feed(ids, last_only=False), want) <= TOL
  assert r.cache.length == 11
  if arch == "gpt2": return
  r.reset()
  first = r.feed(ids[:3], last_only=False)
  rows = [r.feed([int(t)]) for t in ids[3:]]  # decode: the last row's logits, one token at a time
  assert _err(np.concatenate([first, np.stack(rows)]), want) <= TOL


@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_long_chunks_then_chunks(arch: str):
  """Long chunks of 8 and chunks of 4: 16 tokens run as two long chunks, the next 3 as one chunk padded to 4, and 7
  tokens (more than 8 - 4) as one long chunk; each feed's last logits as the reference's (mistral: a sliding window
  shorter than a long chunk)."""
  cfg = config(arch)
  W = weights(cfg)
  ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 19)
  want = logits(cfg, W, ids)
  r = Runner(cfg, checkpoint_get(cfg, W), ctx=24, chunk=4, long=8)
  assert _err(r.feed(ids[:16]), want[15]) <= TOL and sorted(r.plans) == ["long"]
  assert _err(r.feed(ids[16:]), want[-1]) <= TOL
  assert r.cache.length == 19 and sorted(r.plans) == ["long", "prefill"]
  assert _err(r.feed([int(ids[0])]), logits(cfg, W, np.append(ids, ids[0]))[-1]) <= TOL  # a decode step reads what both appended
  r = Runner(cfg, checkpoint_get(cfg, W), ctx=24, chunk=4, long=8)
  assert _err(r.feed(ids[:7]), want[6]) <= TOL and sorted(r.plans) == ["long"]  # 7 tokens: one long chunk padded by 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_decode_from_an_empty_cache(arch: str):
  """Token by token from the first token: the decode plan's attention reads the cache and the step's own key apart, from
  an empty cache (past 0: no cached key at all) on, and for mistral past its sliding window of 6."""
  cfg = config(arch)
  W = weights(cfg)
  ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 10)
  want = logits(cfg, W, ids)
  r = Runner(cfg, checkpoint_get(cfg, W), ctx=16, chunk=4)
  for i, t in enumerate(ids): assert _err(r.feed([int(t)]), want[i]) <= TOL, i
  assert sorted(r.plans) == ["decode"]


def test_one_compile_serves_every_position():
  cfg = config("llama")
  W = weights(cfg)
  r = Runner(cfg, W.__getitem__, ctx=40, chunk=8)
  rng = np.random.default_rng(2)
  r.feed(rng.integers(0, cfg.vocab_size, 5))  # the prefill plan
  r.feed([3])  # the decode plan
  compiles, plans = cache_stats()["compiles"], dict(r.plans)
  for _ in range(29): r.feed([int(rng.integers(cfg.vocab_size))])
  r.feed(rng.integers(0, cfg.vocab_size, 5))
  assert cache_stats()["compiles"] == compiles and r.plans == plans and sorted(plans) == ["decode", "prefill"]
  assert r.cache.length == 40
  with pytest.raises(ContextFullError, match="context of 40"): r.feed([1])
  with pytest.raises(LLMError, match="outside the vocabulary"): Runner(cfg, W.__getitem__, ctx=8).feed([cfg.vocab_size])


def test_a_weight_of_the_wrong_shape_is_named():
  cfg = config("qwen2")
  W = weights(cfg)
  W["model.layers.1.mlp.up_proj.weight"] = W["model.layers.1.mlp.up_proj.weight"][:, :-1]
  with pytest.raises(ModelError, match="model.layers.1.mlp.up_proj.weight"): Runner(cfg, W.__getitem__, ctx=8).feed([1])


def test_a_transformers_5_config_gives_rope_theta_and_scaling_in_rope_parameters():
  """transformers 5's save_pretrained writes rope_theta and rope_scaling inside rope_parameters (read as 10000 and none,
  a Llama 3 or a Qwen2 with theta 1e6 gave wrong logits)."""
  old = dict(HF_CONFIGS["llama"])
  new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
  new["rope_parameters"] = {**old["rope_scaling"], "rope_theta": old["rope_theta"]}
  assert ModelConfig.from_hf(new) == ModelConfig.from_hf(old) == config("llama")
  phi = {k: v for k, v in HF_CONFIGS["phi3"].items() if k != "partial_rotary_factor"}
  phi["rope_parameters"] = {"rope_type": "default", "rope_theta": 250.0, "partial_rotary_factor": 0.5}
  c = ModelConfig.from_hf(phi)
  assert (c.rope_theta, c.rope_scaling, c.rotary_dim) == (250.0, None, c.head_dim // 2)
