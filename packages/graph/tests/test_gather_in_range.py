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
