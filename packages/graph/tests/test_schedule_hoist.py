"""realize_rules' transcendental rule: a SIN, EXP2, LOG2, ERF or TANH that a kernel computes again under loops it does not
vary over (RoPE's sin of position x frequency, inside the batch and head loops) is realized once; one whose loops are
the outer ones (a squeeze-and-excitation gate over the channels, read along each row) stays inline."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import Tensor, compile
from kiln.graph import realize_rules as RULES

RNG = np.random.default_rng(0)


def _rope_like() -> tuple[list[Tensor], dict[str, np.ndarray], np.ndarray]:
  b, h, s, d = 4, 4, 32, 16
  x = RNG.normal(size=(b, h, s, d)).astype(np.float32)
  pos = np.arange(s, dtype=np.float32)
  freq = (1.0 / 10000 ** (np.arange(d) / d)).astype(np.float32)
  xt, pt = Tensor.input("x", (b, h, s, d)), Tensor.input("pos", (s,))
  angle = pt.reshape(s, 1) * Tensor(freq).reshape(1, d)  # (s, d): an input, so nothing folds at build
  out = xt * angle.sin().reshape(1, 1, s, d)
  want = x * np.sin(pos[:, None] * freq[None, :])[None, None]
  return [out], {"x": x, "pos": pos}, want


@pytest.mark.parametrize("hoist_min", [RULES.HOIST_MIN, 0])
def test_a_sin_repeated_over_outer_loops_is_realized_once(monkeypatch: pytest.MonkeyPatch, hoist_min: int) -> None:
  monkeypatch.setattr(RULES, "HOIST_MIN", hoist_min)
  outs, feeds, want = _rope_like()
  c = compile(outs)
  # the sin's (32, 16) evaluations would repeat 4 x 4 times: realized, it is a kernel of its own
  assert len(c.plan.kernels) == (2 if hoist_min else 1), [k.name for k in c.plan.kernels]
  np.testing.assert_allclose(c.run(feeds)[0], want, rtol=1e-5, atol=1e-6)


def test_a_gate_over_the_outer_loops_stays_inline() -> None:
  n, ch, hw = 2, 24, 64
  x = RNG.normal(size=(n, ch, hw)).astype(np.float32)
  g = RNG.normal(size=(n, ch, 1)).astype(np.float32)
  c = compile([Tensor.input("x", (n, ch, hw)) * Tensor.input("g", (n, ch, 1)).sigmoid()])
  assert len(c.plan.kernels) == 1, [k.name for k in c.plan.kernels]  # computed once per row already: nothing repeats
  np.testing.assert_allclose(c.run({"x": x, "g": g})[0], x / (1 + np.exp(-g)), rtol=1e-5, atol=1e-6)
