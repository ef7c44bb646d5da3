"""The BERT-style encoder the distributed tests run: the benchmark's (stack_bench.ray_rows.encoder, in the repository's
benchmarks/, not installed), with the tests' request maker."""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from stack_bench.ray_rows import encoder, requests  # noqa: E402

__all__ = ["encoder", "feeds", "same"]


def feeds(batch: int, seq: int = 16, vocab: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
  return requests(1, batch, seq, vocab, seed)[0]


def same(got: dict, want: dict) -> None:
  """Exactly the outputs the single-host plan gives."""
  assert sorted(got) == sorted(want)
  for k in want: np.testing.assert_array_equal(got[k], want[k], err_msg=k)
