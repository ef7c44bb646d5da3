"""Two reductions side by side in one kernel (realize_rules.sibling_reductions): an MLP's gate and up products read by
silu(gate) * up each get their own kernel, the elementwise work in the second's epilogue; chained ones (softmax's sum over
its max) stay in one."""
from __future__ import annotations

import numpy as np

from kiln.graph import Tensor, compile

RNG = np.random.default_rng(0)


def test_two_products_of_one_input_are_two_kernels() -> None:
  x = RNG.normal(size=(16, 32)).astype(np.float32)
  wg, wu = (RNG.normal(size=(48, 32)).astype(np.float32) * 0.1 for _ in range(2))
  xt = Tensor.input("x", (16, 32))
  c = compile([(xt @ Tensor(wg).T).silu() * (xt @ Tensor(wu).T)])
  assert len(c.plan.kernels) == 2, [k.name for k in c.plan.kernels]  # one kernel of both products before
  g = x @ wg.T
  np.testing.assert_allclose(c.run({"x": x})[0], g / (1 + np.exp(-g)) * (x @ wu.T), rtol=1e-5, atol=1e-5)


def test_a_chain_of_reductions_stays_one_kernel() -> None:
  x = RNG.normal(size=(8, 40)).astype(np.float32)
  xt = Tensor.input("x", (8, 40))
  c = compile([xt.softmax(-1)])
  e = np.exp(x - x.max(-1, keepdims=True))
  np.testing.assert_allclose(c.run({"x": x})[0], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
  before = len(c.plan.kernels)
  assert before == 1  # softmax keeps its max and its sum in one kernel
