"""A language model's plans kept in the plan cache (runtime.checkpoint_key + kiln.graph.compile_cache): a model loaded
again (a new LLM, as a new process makes) rebuilds its prefill and decode plans from the cache, compiling and scheduling
nothing, and gives the same logits and tokens bit for bit; a checkpoint rewritten with other weights is a miss that runs
the new weights; another context is a miss."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoint_files import hf_weights, tiny_config, write_gguf

from kiln.executor import cache_stats
from kiln.llm import load


@pytest.fixture
def cache(plan_cache_dir: Path) -> Path: return plan_cache_dir  # the repository's conftest.py


IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def _run(path: Path, context: int = 32) -> tuple[np.ndarray, list[int], int]:
  """A fresh load's teacher-forced logits, 6 greedy tokens, and how many plans the plan cache gave."""
  hits = cache_stats()["plan_hits"]
  llm = load(path, context=context, chunk=4)
  logits = llm.logits(IDS)
  tokens = list(llm.generate(IDS[:5] + [8, 8, 8], max_new_tokens=6, stop=[]))  # 3 new tokens: the prefill plan, then decode
  return logits, tokens, cache_stats()["plan_hits"] - hits


def _gguf(path: Path, seed: int) -> Path:
  cj = tiny_config("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=40)
  write_gguf(path, cj, hf_weights(cj, seed=seed), fmt=lambda n: "Q8_0")  # packed matrices: their planes are the graph's constants
  return path


def test_plans_load_again_from_the_cache(cache: Path, tmp_path: Path):
  path = _gguf(tmp_path / "m.gguf", seed=1)
  logits, tokens, hits = _run(path)
  assert hits == 0 and len(list(cache.glob("*.json"))) == 3  # all (logits), prefill, decode
  compiles = cache_stats()["compiles"]
  logits2, tokens2, hits2 = _run(path)
  assert hits2 == 3 and cache_stats()["compiles"] == compiles
  np.testing.assert_array_equal(logits2, logits)
  assert tokens2 == tokens
  assert sum(f.stat().st_size for f in cache.glob("*.bin")) < path.stat().st_size // 4  # the weights are not stored again


def test_another_checkpoint_or_context_misses(cache: Path, tmp_path: Path):
  path = _gguf(tmp_path / "m.gguf", seed=1)
  logits, _, _ = _run(path)
  _gguf(path, seed=2)  # the same file rewritten: same shapes, other weights
  logits2, _, hits = _run(path)
  assert hits == 0 and not np.allclose(logits2, logits)
  assert _run(path)[2] == 3
  assert _run(path, context=24)[2] == 0  # another context: other plans
