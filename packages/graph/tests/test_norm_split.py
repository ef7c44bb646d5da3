"""Where a kernel that normalises over each map splits its work (heuristic._reduced_along): an instance norm's mean and
variance over H x W are read at every position of the map, so a chunk of the map's rows would sum the whole map again
(RAFT's 4x32x64x64 instance norms split along the rows: 16 chunks, each summing every map, 6-7 ms a norm). The threads
split the maps instead (images, channels). Against numpy."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kiln.graph import Tensor, compile


@pytest.mark.parametrize("shape", [(4, 32, 64, 64), (1, 8, 32, 48)])
def test_an_instance_norm_splits_its_maps_not_their_rows(shape: tuple[int, ...]) -> None:
  x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
  c = compile([Tensor.input("x", shape).layernorm(None, None, (2, 3), 1e-5).relu()])
  splits = [int(m.group(1)) for pk in c.plan.kernels for o in pk.kernel.applied_opts if (m := re.match(r"THREAD\(axis=(\d+)", o))]
  assert splits and all(a < 2 for a in splits), [pk.kernel.applied_opts for pk in c.plan.kernels]
  mu = x.mean((2, 3), keepdims=True)
  want = np.maximum((x - mu) / np.sqrt(((x - mu) ** 2).mean((2, 3), keepdims=True) + 1e-5), 0)
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)
