"""A concatenation's pieces that hold a reduction or a gather get kernels of their own (schedule.py): a concatenation
renders as selects among its pieces, which a vector kernel computes for every element, unless the codegen unrolls its
axis whole (at most SELECT_UNROLL: each copy then folds to its piece)."""
from __future__ import annotations

import importlib

import numpy as np

from kiln.graph import Tensor, compile
from kiln.ir.ops import Ops

RNG = np.random.default_rng(38)
RULES = importlib.import_module("kiln.graph.realize_rules")


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


def _depthwise(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  k = w.shape[-1]
  p = k // 2
  xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
  out = np.zeros_like(x)
  for i in range(k):
    for j in range(k): out += xp[:, :, i:i + x.shape[2], j:j + x.shape[3]] * w[None, :, 0, i, j, None, None]
  return out


def _mixed_pool(monkeypatch, hw: int, cat_min: int) -> tuple[bool, np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
  """A squeeze-and-excitation's pool over a mixed depthwise conv (MixNet's: 3x3 and 5x5 branches over 20 channels each,
  concatenated, swish): (whether a kernel reads the concatenation realized, kiln's output, numpy's). Realized, it is
  filled by one kernel or by a kernel a piece (cat_place)."""
  monkeypatch.setattr(RULES, "POOLED_CAT_MIN", cat_min)
  x = RNG.standard_normal((2, 40, hw, hw), dtype=np.float32)
  w3, w5 = (RNG.standard_normal((20, 1, k, k), dtype=np.float32) for k in (3, 5))
  xt = Tensor.input("x", x.shape)
  cat = Tensor.cat([xt[:, :20].conv2d(Tensor(w3), groups=20, padding=1), xt[:, 20:].conv2d(Tensor(w5), groups=20, padding=2)], 1)
  c = compile([(cat * cat.sigmoid()).mean((2, 3))])
  m = np.concatenate([_depthwise(x[:, :20], w3), _depthwise(x[:, 20:], w5)], 1)
  realized = any(n.op == "CAT" for k in c.kernels for n in k.slots[1:])
  return realized, c.run({"x": x})[0], (m / (1 + np.exp(-m))).mean((2, 3))


def test_a_pool_over_concatenated_branches_reads_them_realized(monkeypatch) -> None:  # type: ignore[no-untyped-def]
  # inline, the pool's vector ran along the channels and each lane selected its branch with an index of its own: a gather
  n_inline, got_inline, want = _mixed_pool(monkeypatch, 8, 0)
  n, got, want2 = _mixed_pool(monkeypatch, 8, 16)
  assert n and not n_inline  # the concatenation realized before the 8x8 pool
  np.testing.assert_allclose(got_inline, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got, want2, rtol=1e-4, atol=1e-5)


def test_a_pool_over_few_elements_keeps_its_concatenation_inline(monkeypatch) -> None:  # type: ignore[no-untyped-def]
  n_inline, _, _ = _mixed_pool(monkeypatch, 2, 0)
  n, got, want = _mixed_pool(monkeypatch, 2, 16)  # a 2x2 pool: the copy would gather as much as the pool does
  assert not n and not n_inline
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_sum_over_the_concatenation_axis_reads_it_in_place(monkeypatch) -> None:  # type: ignore[no-untyped-def]
  x, y = RNG.standard_normal((2, 24, 64), dtype=np.float32), RNG.standard_normal((2, 40, 64), dtype=np.float32)
  counts = []
  for cat_min in (0, 16):
    monkeypatch.setattr(RULES, "POOLED_CAT_MIN", cat_min)
    xt, yt = Tensor.input("x", x.shape), Tensor.input("y", y.shape)
    c = compile([(Tensor.cat([xt.relu(), yt * 2], 1)).sum(1)])  # over the pieces' own axis: runs of the reduction
    np.testing.assert_allclose(c.run({"x": x, "y": y})[0], np.concatenate([np.maximum(x, 0), y * 2], 1).sum(1), rtol=1e-4, atol=1e-4)
    counts.append(len(c.kernels))
  assert counts[0] == counts[1] == 1, counts
