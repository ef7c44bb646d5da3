"""Concatenations in place (cat_place.py): a realized concatenation whose pieces are kernels' own outputs, each one run
of its buffer per image, is filled by those kernels storing into views of it: no copy kernel. Against numpy every time, with and
without the placement."""
from __future__ import annotations

import numpy as np
import pytest
from test_conv import conv_ref

from kiln.graph import Tensor, cat_place, compile
from kiln.ir.ops import Ops

RNG = np.random.default_rng(41)


def rand(*shape: int) -> np.ndarray: return RNG.uniform(-1, 1, shape).astype(np.float32)


def _relu(v: np.ndarray) -> np.ndarray: return np.maximum(v, 0)


def _fire(n: int, c: int = 8, e: int = 16, hw: int = 12) -> tuple:  # noqa: ANN202
  """SqueezeNet's fire module and the squeeze conv after it: expand 1x1 and 3x3 (both ReLU), concatenated, then a 1x1."""
  x, w1, w3, ws = rand(n, c, hw, hw), rand(e, c, 1, 1), rand(e, c, 3, 3), rand(8, 2 * e, 1, 1)
  xi = Tensor.input("x", x.shape)
  cat = Tensor.cat([xi.conv2d(Tensor(w1)).relu(), xi.conv2d(Tensor(w3), padding=1).relu()], axis=1)
  c = compile([cat.conv2d(Tensor(ws))])
  e1, e3 = conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), conv_ref(x, w3, None, [1, 1], [(1, 1)] * 2, [1, 1], 1)
  e = np.concatenate([_relu(e1), _relu(e3)], 1)
  return c, x, conv_ref(e, ws, None, [1, 1], [(0, 0)] * 2, [1, 1], 1)


def _copies(c) -> int: return sum(k.node.op == "CAT" and k.node.arg == 1 for k in c.kernels)  # type: ignore[no-untyped-def]  # (Winograd's tiles: axis 0)


def _piece_copies(c) -> int:  # type: ignore[no-untyped-def]
  """Kernels that copy a concatenation's piece into its place: a copy of one of its sources, the concatenation read."""
  pieces = {s for k in c.kernels for n in k.slots if n.op == "CAT" for s in n.src}
  return sum(k.node.op == "VIEW" and k.node.src[0] in pieces and k.node.arg == ("reshape", k.node.src[0].shape) for k in c.kernels)


@pytest.mark.parametrize("place", [True, False])
def test_a_fire_modules_concatenation_is_written_in_place(monkeypatch: pytest.MonkeyPatch, place: bool) -> None:
  """One image: each expand conv's kernel (its ReLU as epilogue) stores into its channels of the concatenation's buffer,
  and the squeeze conv reads that buffer; off, a kernel copies both pieces."""
  monkeypatch.setattr(cat_place, "PLACE_CATS", place)
  c, x, want = _fire(1)
  assert _copies(c) == (0 if place else 1), c.plan.describe()
  for _ in range(2): np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("after_copies", [True, False])
def test_a_winograd_pieces_activation_moves_into_its_crop(monkeypatch: pytest.MonkeyPatch, after_copies: bool) -> None:
  """A 3x3 expand conv of 32 channels over a 16x16 map runs as Winograd, whose output tiles a kernel crops back to NCHW:
  its bias and ReLU move into that copy (epilogue.AFTER_COPIES), so the piece is a kernel's own output and is placed;
  left in the concatenation's kernel, they kept the copy."""
  from kiln.graph import epilogue
  monkeypatch.setattr(epilogue, "AFTER_COPIES", after_copies)
  c, x, want = _fire(1, 32, 32, 16)
  assert any(k.ast.arg.startswith("reduce_36x") for k in c.kernels), c.plan.describe()  # Winograd's 36 products
  assert _copies(c) == 0 and _piece_copies(c) == (0 if after_copies else 1), c.plan.describe()
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [2, 3])
def test_more_images_spread_each_piece_over_its_runs(n: int) -> None:
  """With more images a piece's channels are one run per image, a stride of the whole concatenation apart: each expand
  conv's kernel stores there (its index folded to image * stride + its own), and nothing copies."""
  c, x, want = _fire(n)
  assert _copies(c) == 0, c.plan.describe()
  for _ in range(2): np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_a_piece_read_elsewhere_keeps_the_copy_with_more_images() -> None:
  """Two images, and one piece is also a model output's input: laid out in runs of the concatenation, that reader would
  misread it, so a kernel of its own copies that piece into its runs (the other piece's kernel stores there itself)."""
  x, w1, w3 = rand(2, 8, 12, 12), rand(16, 8, 1, 1), rand(16, 8, 3, 3)
  xi = Tensor.input("x", x.shape)
  e1 = xi.conv2d(Tensor(w1)).relu()
  cat = Tensor.cat([e1, xi.conv2d(Tensor(w3), padding=1).relu()], axis=1)
  c = compile([cat.conv2d(Tensor(rand(8, 32, 1, 1))), e1.sum(axis=1)])
  assert (_copies(c), _piece_copies(c)) == (0, 1), c.plan.describe()
  r1 = _relu(conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1))
  np.testing.assert_allclose(c.run({"x": x})[1], r1.sum(1), rtol=1e-4, atol=1e-4)


def test_a_piece_in_two_concatenations_is_placed_in_the_first() -> None:
  """A dense block: the first layer's features are in both later concatenations. The first concatenation takes them in
  place; in the second, that piece (it already lives in another buffer) and the input are copied into their places by a
  kernel each, and its other piece stays where it is."""
  x, wa, wb, wc = rand(1, 16, 8, 8), rand(16, 16, 1, 1), rand(16, 32, 1, 1), rand(8, 48, 1, 1)
  xi = Tensor.input("x", x.shape)
  a = xi.conv2d(Tensor(wa)).relu()
  b = Tensor.cat([a, xi.conv2d(Tensor(wa)) * 2], axis=1).conv2d(Tensor(wb)).relu()
  out = Tensor.cat([a, b, xi], axis=1).conv2d(Tensor(wc))
  c = compile([out])
  assert (_copies(c), _piece_copies(c)) == (0, 2), c.plan.describe()
  ra = _relu(conv_ref(x, wa, None, [1, 1], [(0, 0)] * 2, [1, 1], 1))
  rb = _relu(conv_ref(np.concatenate([ra, 2 * conv_ref(x, wa, None, [1, 1], [(0, 0)] * 2, [1, 1], 1)], 1), wb, None, [1, 1], [(0, 0)] * 2, [1, 1], 1))
  want = conv_ref(np.concatenate([ra, rb, x], 1), wc, None, [1, 1], [(0, 0)] * 2, [1, 1], 1)
  for _ in range(2): np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def _dense_block(n: int, layers: int, norm: bool, chain: bool = False, batch: tuple[int, int] | None = None):  # type: ignore[no-untyped-def]
  """DenseNet's block: each layer's 3x3 conv reads the concatenation of the block's input and every earlier layer's
  features, through a batch norm's per-channel scale and shift and a ReLU where `norm`. `chain`: each concatenation is
  the previous one's and the newest features (as Caffe2's DenseNet export builds them), else all of them at once.
  `batch`: the images a symbolic dim with these bounds (a dynamic export), else n."""
  g, x = 8, rand(n, 16, 12, 12)
  ws = [rand(g, 16 + g * i, 3, 3) for i in range(layers)]
  ss = [(rand(1, 16 + g * i, 1, 1), rand(1, 16 + g * i, 1, 1)) for i in range(layers)]
  xi = Tensor.input("x", x.shape) if batch is None else Tensor.input("x", ("batch", *x.shape[1:]), dims={"batch": batch})
  feats, want = [xi], [x]
  cat = xi
  for w, (a, b) in zip(ws, ss):
    cat, ref = Tensor.cat([cat, feats[-1]], axis=1) if chain and len(feats) > 1 else Tensor.cat(feats, axis=1), np.concatenate(want, 1)
    inp = (cat * Tensor(a) + Tensor(b)).relu() if norm else cat
    if norm: ref = _relu(ref * a + b)
    feats.append(inp.conv2d(Tensor(w), padding=1).relu())
    want.append(_relu(conv_ref(ref, w, None, [1, 1], [(1, 1)] * 2, [1, 1], 1)))
  last = Tensor.cat([cat, feats[-1]], axis=1) if chain else Tensor.cat(feats, axis=1)
  return compile([last.sum(axis=(2, 3))]), x, np.concatenate(want, 1).sum(axis=(2, 3))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("copy", [True, False])
def test_a_dense_blocks_concatenations_copy_each_piece_once(monkeypatch: pytest.MonkeyPatch, n: int, copy: bool) -> None:
  """Every concatenation of a dense block holds pieces that already live in an earlier one's buffer: each such piece is
  copied into its place by a kernel of its own, and no kernel selects among the pieces; COPY_PIECES off, the later
  concatenations keep their kernel. Against numpy either way, one image and three."""
  monkeypatch.setattr(cat_place, "COPY_PIECES", copy)
  c, x, want = _dense_block(n, 5, norm=False)
  assert (_copies(c) == 0) == copy and (_piece_copies(c) > 0) == copy, c.plan.describe()
  for _ in range(2): np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-3)


def _selecting(c) -> int:  # type: ignore[no-untyped-def]
  """Kernels that render a select among a concatenation's pieces (a WHERE on a comparison with a constant offset)."""
  return sum(any(u.op is Ops.WHERE and u.src[0].op is Ops.CMPLT and u.src[0].src[1].op is Ops.CONST for u in k.ast.toposort())
             for k in c.kernels)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("copy", [True, False])
def test_a_batch_norm_over_a_concatenation_runs_piece_by_piece(monkeypatch: pytest.MonkeyPatch, n: int, copy: bool) -> None:
  """DenseNet's batch norm and ReLU over each concatenation: the kernel that computed them selected among all the pieces
  for every element; computed a piece's slab at a time (its scale and shift sliced to the slab), nothing selects.
  COPY_PIECES off: one kernel each, selecting. Against numpy either way."""
  monkeypatch.setattr(cat_place, "COPY_PIECES", copy)
  c, x, want = _dense_block(n, 5, norm=True)
  assert (_selecting(c) == 0) == copy, c.plan.describe()
  for _ in range(2): np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-3)


def _cat_reads(c) -> list:  # type: ignore[no-untyped-def]
  """The concatenations kernels of their own shape read as buffers (a slot), one entry per reading kernel."""
  return [s for k in c.kernels for s in k.slots[1:] if s.op == "CAT" and s.shape == k.node.shape]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("chain", [False, True])
def test_a_dense_blocks_batch_norms_read_one_shared_buffer(monkeypatch: pytest.MonkeyPatch, n: int, share: bool, chain: bool) -> None:
  """Each layer's batch norm and ReLU reads the concatenation of the block so far: every such concatenation is a prefix
  of the last one, so all live in its buffer (each piece stored there once, by its own kernel) and each batch norm is one
  kernel reading its view, the first channels of every image (with three images a strided view: its loads are mapped).
  A chain of two-piece concatenations counts as one of all their pieces: the same. SHARE_CATS off: a kernel per piece
  per batch norm (slabs; in a chain the first piece is the previous concatenation, still selected from). Against numpy
  every way."""
  monkeypatch.setattr(cat_place, "SHARE_CATS", share)
  c, x, want = _dense_block(n, 5, norm=True, chain=chain)
  reads = _cat_reads(c)
  if share: assert not any(k.node.op == "CAT" for k in c.kernels), c.plan.describe()  # the last one too: the block's buffer
  slabs = sum(k.node.shape[1:2] == (8,) and any(s.shape[2:] == (1, 1) for s in k.slots) for k in c.kernels)  # a batch norm over a piece
  assert (_selecting(c) == 0) == (share or not chain), c.plan.describe()  # a chain's slabs: the first piece still selects
  if share: assert len(reads) == 4 and len({r.shape for r in reads}) == 4 and slabs == 0, c.plan.describe()
  else: assert not reads and slabs >= 4, c.plan.describe()
  for _ in range(2): np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("chain", [False, True])
def test_a_dense_block_over_a_symbolic_batch_shares_its_buffer(chain: bool) -> None:
  """A dynamic export's batch: the shared buffer is sized for the batch's upper bound and each image's run of it is at a
  static offset and stride, so the pieces' stores and the views' loads are mapped as with a static batch. One plan, run
  with three images and with one, against numpy."""
  c, x, want = _dense_block(3, 5, norm=True, chain=chain, batch=(1, 4))
  reads = _cat_reads(c)
  assert _selecting(c) == 0 and len(reads) == 4 and not any(k.node.op == "CAT" for k in c.kernels), c.plan.describe()
  for n in (3, 1): np.testing.assert_allclose(c.run({"x": x[:n]})[0], want[:n], rtol=1e-4, atol=1e-3)


def test_a_small_concatenation_keeps_its_kernel() -> None:
  """Below COPY_START elements a copy per piece would cost more kernel starts than the selects it saves."""
  a, b = rand(1, 16, 2, 2), rand(1, 16, 2, 2)
  ai, bi = Tensor.input("a", a.shape), Tensor.input("b", b.shape)
  c = compile([Tensor.cat([ai + 1, bi * 2], axis=1).conv2d(Tensor(rand(4, 32, 1, 1)))])
  assert (_copies(c), _piece_copies(c)) == (1, 0), c.plan.describe()
