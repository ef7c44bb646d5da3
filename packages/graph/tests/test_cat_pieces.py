"""A concatenation's pieces that hold a reduction or a gather get kernels of their own (schedule.py): a concatenation
renders as selects among its pieces, which a vector kernel computes for every element, unless the codegen unrolls its
axis whole (at most SELECT_UNROLL: each copy then folds to its piece)."""
from __future__ import annotations

import numpy as np

from kiln.graph import Tensor, compile
from kiln.ir.ops import Ops

RNG = np.random.default_rng(38)


def _reduces(k) -> int: return sum(u.op is Ops.REDUCE for u in k.ast.toposort())  # type: ignore[no-untyped-def]


def test_a_reduction_and_a_gather_concatenated_run_over_their_own_pieces() -> None:
  x, w = RNG.standard_normal((2, 40, 16), dtype=np.float32), RNG.standard_normal((16, 24), dtype=np.float32)
  y, idx = RNG.standard_normal((2, 5, 24), dtype=np.float32), RNG.integers(0, 5, 40).astype(np.int32)
  xt, yt = Tensor.input("x", x.shape), Tensor.input("y", y.shape)
  cat = Tensor.cat([xt @ Tensor(w), yt.gather(Tensor(idx), 1), yt[:, :1] * 2], axis=1)  # (2, 81, 24): the product, a gather, a plain piece
  c = compile([cat])
  last = c.kernels[-1]  # the concatenation: selects among loads, the product and the gather each in a kernel of its own
  assert _reduces(last) == 0 and sum(_reduces(k) for k in c.kernels) == 1 and len(c.kernels) == 3, c.plan.describe()
  want = np.concatenate([x @ w, y[:, idx], y[:, :1] * 2], 1)
  np.testing.assert_allclose(c.run({"x": x, "y": y})[0], want, rtol=1e-5, atol=1e-5)


def test_a_concatenation_the_codegen_unrolls_keeps_its_pieces_inline() -> None:
  x, w = RNG.standard_normal((2, 8, 16), dtype=np.float32), RNG.standard_normal((16, 24), dtype=np.float32)
  c = compile([Tensor.cat([Tensor.input("x", x.shape) @ Tensor(w), Tensor.input("y", (2, 1, 24))], axis=1)])  # 9 along the axis
  assert len(c.kernels) == 1, c.plan.describe()
  y = RNG.standard_normal((2, 1, 24), dtype=np.float32)
  np.testing.assert_allclose(c.run({"x": x, "y": y})[0], np.concatenate([x @ w, y], 1), rtol=1e-5, atol=1e-5)
