"""A slice of a concatenation (or of a pad of an expression), fused: each piece's index is clamped into that piece, and a
read window (windows.py) rebases it. The symbolic simplifier keeps the clamp's values but not its bounds (min(max(5 - r, 0), 2)
becomes where(3 < r, 5 - r, 2), bounded by both arms), so a simplified rebased index could not be proven inside its view and
the verifier refused the kernel (hypothesis found cat then [::-1, 1:] on a 3x4). With it, two siblings a movement fuzzer
found: a gather whose table and indices both take windows, and a slice of nothing but a pad under a symbolic batch.
Results against numpy, fused and not."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.graph import Tensor, compile
from kiln.graph.windows import read_windows
from kiln.ir.ops import Ops

RNG = np.random.default_rng(31)
X = RNG.uniform(-1, 1, (3, 4)).astype(np.float32)


def _both(t: Tensor, want: np.ndarray) -> None:
  for fuse in (True, False):
    got = compile([t], fuse=fuse).run({})[0]
    assert got.shape == want.shape, (fuse, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"fuse={fuse}")


def _sl(start: int, step: int) -> slice: return slice(start if step > 0 else -1 - start, None, step)


def test_the_hypothesis_find() -> None:
  t = Tensor(X)
  _both(Tensor.cat([t, t * 2], 0)[::-1, 1:], np.concatenate([X, X * 2], 0)[::-1, 1:])


SLICES = [(_sl(b0, s0), _sl(b1, s1)) for (s0, s1), (b0, b1) in itertools.product(itertools.product([1, -1, 2, -2], repeat=2), [(1, 1), (1, 0)])]


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("sl", SLICES, ids=[f"{a.start}:{a.step},{b.start}:{b.step}" for a, b in SLICES])
def test_cat_of_three_then_slice(axis: int, sl: tuple[slice, slice]) -> None:
  t = Tensor(X)
  _both(Tensor.cat([t, t.exp(), t * 3.0], axis)[sl], np.concatenate([X, np.exp(X), X * 3], axis)[sl])


@pytest.mark.parametrize("axis", [0, 1])
def test_cat_of_realized_pieces_then_slice(axis: int) -> None:
  a, b = (Tensor(X) * 2.0).contiguous(), (Tensor(X) + 1.0).contiguous()
  _both(Tensor.cat([a, b], axis)[1::2, ::-2], np.concatenate([X * 2, X + 1], axis)[1::2, ::-2])


@pytest.mark.parametrize("axis", [0, 1])
def test_pad_of_an_expression_then_slice(axis: int) -> None:
  """The same clamp where a pad's input is inlined (a pad of a buffer reads it gated and takes no window)."""
  pads = ((1, 2), (0, 0)) if axis == 0 else ((0, 0), (1, 2))
  want = np.pad(X * 2, pads)
  for sl in [(slice(1, None), slice(1, None, 2)), (slice(None, None, -2), slice(-2, None, -1))]:
    _both((Tensor(X) * 2.0).pad(pads)[sl], want[sl])


@pytest.mark.parametrize("axis", [1, 2])
def test_cat_then_slice_under_a_symbolic_batch(axis: int) -> None:
  t = Tensor.input("x", ("b", 3, 4), dims={"b": (1, 5)})
  sl = (slice(None), slice(1, None), slice(None, None, -2))
  c = compile([Tensor.cat([t, t * 2.0], axis)[sl]])
  for b in (1, 5):
    xn = RNG.uniform(-1, 1, (b, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(c.run({"x": xn})[0], np.concatenate([xn, xn * 2], axis)[sl], rtol=1e-6)


def test_every_rebased_index_stays_in_its_window() -> None:
  """The property the verifier checks, on read_windows itself: a rebased index is proven in [0, count)."""
  t = Tensor(X)
  c = compile([Tensor.cat([t, t * 2], 0)[::-1, 1:]])
  seen = 0
  for k in c.kernels:
    ast, wins = read_windows(k.ast)
    for u in ast.toposort():
      if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL and (w := wins.get(u.src[0].arg)) is not None:
        assert 0 <= u.src[1].vmin and u.src[1].vmax < w[1], (u.src[1].vmin, u.src[1].vmax, w)
        seen += 1
  assert seen  # the case does take a window: the test reads rebased indices


def test_a_gather_whose_indices_take_a_window_too() -> None:
  """Both a gather's table and its indices read from past element 0: the table's index loads through the indices' read,
  and was rebased over the whole indices buffer while the plan bound that slot to a 1-element view (PlanError: the kernel
  reads 4 x int64, the buffer has 1). A sibling the movement fuzzer found."""
  x = RNG.uniform(-1, 1, (1, 2, 2)).astype(np.float32)
  idx = np.array([1, -2, 0, 1], np.int64)
  t = Tensor(x).gather(Tensor(idx), 2)
  _both(t[:, 1:, 3:], np.take(x, idx, 2)[:, 1:, 3:])
  _both(t[:, 1:, ::-2], np.take(x, idx, 2)[:, 1:, ::-2])


def test_a_slice_of_only_padding_under_a_symbolic_batch() -> None:
  """The value is the pad's alone, so no kernel reads the input; the input still gives run() the batch (it was a
  GraphError at compile: 'symbolic dims ['b'] are not a dim of any input'). A sibling the symbolic fuzzer found."""
  t = Tensor.input("x", ("b", 2), dims={"b": (1, 4)})
  y = t.pad(((0, 0), (0, 2)), 7.0)[:, 3:] + 1.0
  for fuse in (True, False):
    c = compile([y], fuse=fuse)
    for b in (1, 4):
      np.testing.assert_array_equal(c.run({"x": np.ones((b, 2), np.float32)})[0], np.full((b, 1), 8.0, np.float32))


def test_dual_path_chain_renders_each_node_at_a_bounded_number_of_indices() -> None:
  """DPN's blocks: each block's residual half and dense half are slices of the one before, concatenated again, so the
  pieces of the first block are reached along 2**depth paths, each at its own index. Inlined whole, a kernel rendered them
  2**depth times (dpn68's load took a minute); a node inlined at more than MAX_INDICES indices is realized instead."""
  from collections import Counter

  from kiln.graph import kernelize

  depth, c = 5, 2
  x0 = RNG.uniform(-1, 1, (2, 2 * c)).astype(np.float32)
  t, want = Tensor(x0).exp(), np.exp(x0)
  for _ in range(depth):
    t = Tensor.cat([t[:, :c] + t[:, c:2 * c] * 0.5, t[:, c:] * 1.5, t[:, :c] - 0.25], 1)
    want = np.concatenate([want[:, :c] + want[:, c:2 * c] * 0.5, want[:, c:] * 1.5, want[:, :c] - 0.25], 1)
  sizes: list[int] = []
  orig = kernelize.Kernelizer.kernel

  def kernel(self: kernelize.Kernelizer) -> kernelize.Kernel:
    k = orig(self)
    sizes.append(max(Counter(n for n, _ in self.memo).values()))
    return k
  kernelize.Kernelizer.kernel = kernel  # type: ignore[method-assign]
  try: got = compile([t]).run({})[0]
  finally: kernelize.Kernelizer.kernel = orig  # type: ignore[method-assign]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert max(sizes) <= kernelize.MAX_INDICES, max(sizes)  # the most indices one node was rendered at in one kernel
