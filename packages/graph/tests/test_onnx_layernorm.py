"""ONNX LayerNormalization's optional Mean and InvStdDev outputs (float32 statistics kept as dims of 1)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_case import N, check, f32, model


@pytest.mark.parametrize("axis", [-1, 1])
def test_mean_and_inv_std_dev_outputs(axis):
  x, w, b = f32(2, 3, 5), f32(*([3, 5] if axis == 1 else [5])), f32(*([3, 5] if axis == 1 else [5]))
  m = model([N("LayerNormalization", ["x", "w", "b"], ["y", "mean", "inv"], axis=axis, epsilon=1e-3)], {"x": x},
            {"y": np.float32, "mean": np.float32, "inv": np.float32}, inits={"w": w, "b": b})
  check(m, {"x": x}, tol=1e-5)
