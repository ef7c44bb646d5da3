"""Tensor.gather's in_range: indices the caller built in range (kiln's own tables) skip the run-time index check; a wrong
claim still reads inside the table (the kernel clamps every gathered index), never outside it, while a checked gather
of the same indices is an IndexOutOfRangeError."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import Tensor, compile
from kiln.graph.lazy import IndexOutOfRangeError


def _gather(in_range: bool) -> object:
  idx = Tensor.input("i", (4,), np.int64)
  return compile([Tensor(np.array([10.0, 20.0, 30.0], np.float32)).gather(idx, 0, name="g", in_range=in_range)])


def test_in_range_indices_skip_the_check_and_stay_inside_the_table() -> None:
  checked, trusted = _gather(False), _gather(True)
  assert len(trusted.plan.kernels) < len(checked.plan.kernels)  # no check kernel
  ok = np.array([0, 2, 1, 0], np.int64)
  np.testing.assert_array_equal(trusted.run({"i": ok})[0], [10, 30, 20, 10])
  bad = np.array([0, 7, -9, 2], np.int64)
  with pytest.raises(IndexOutOfRangeError): checked.run({"i": bad})
  np.testing.assert_array_equal(trusted.run({"i": bad})[0], [10, 30, 10, 30])  # clamped into [0, 3): read inside the table


@pytest.mark.parametrize("reduce", ["min", "max", "argmax"])
def test_an_unchecked_gather_indexed_by_a_reduction_fused_into_its_kernel(reduce: str) -> None:
  # the reduction's vector of lanes meets the gather's per-lane index arithmetic in one kernel (it once failed to lower)
  labels = np.array([7, 3, 9, 1, 5], np.int64)
  x = Tensor.input("x", (16, 5), np.float32)
  if reduce == "argmax":
    iota = Tensor(np.arange(5, dtype=np.int64).reshape(1, 5))
    i = x.eq(x.max(1, keepdims=True)).where(iota, Tensor.full((), 5, np.int64)).min(1)
    i = i.eq(5).where(0, i)
  else:
    i = getattr((x * 5).cast(np.int64), reduce)(1)  # truncation: the values are positive
  m = compile([Tensor(labels).gather(i, 0, in_range=True)])
  rng = np.random.default_rng(3)
  v = rng.random((16, 5), dtype=np.float32) * 0.999
  want = {"argmax": v.argmax(1), "min": np.floor(v * 5).astype(np.int64).min(1), "max": np.floor(v * 5).astype(np.int64).max(1)}[reduce]
  np.testing.assert_array_equal(m.run({"x": v})[0], labels[want])
