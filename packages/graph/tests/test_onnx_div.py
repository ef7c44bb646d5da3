"""ONNX integer Div: it truncates toward zero, in integers, whether folded at load or run in a kernel."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_case import N, check, model

BIG = np.array([2**62 + 1, -(2**62) - 3, 9007199254740993, -7, 7, -7, 5], np.int64)  # past 2**53 a float quotient rounds
BIG_D = np.array([3, 7, 1, 2, -2, -2, 5], np.int64)


def test_folded_int64_div_is_exact_past_2_53():
  m = model([N("Div", ["a", "b"], ["q"]), N("Add", ["q", "x"], ["y"])], {"x": np.zeros(7, np.int64)}, {"y": np.int64},
            inits={"a": BIG, "b": BIG_D})
  check(m, {"x": np.arange(7, dtype=np.int64)})


@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_run_time_integer_div_truncates(dt):
  info = np.iinfo(dt)
  rng = np.random.default_rng(1)
  a = rng.integers(info.min, info.max, 64, dtype=dt, endpoint=True)
  b = rng.integers(max(info.min, -9), 10, 64, dtype=dt, endpoint=True)
  b[b == 0] = 3
  if info.min < 0: a[:2], b[:2] = [-7, 7], [2, -2]  # ties toward zero, not down
  check(model([N("Div", ["a", "b"], ["q"])], {"a": a, "b": b}, {"q": dt}), {"a": a, "b": b})
