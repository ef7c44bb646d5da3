"""Mobile-net convs that lower as depthwise window sums (conv.py): a conv with one input channel per group and several
outputs each (a depthwise multiplier, FastViT's downsampling) against numpy, in the blocked layout and in NCHW."""
from __future__ import annotations

import numpy as np
import pytest
from test_conv import conv_ref

from kiln.graph import Tensor, compile
from kiln.ir.ops import Ops

RNG = np.random.default_rng(41)


def rand(*shape: int) -> np.ndarray: return RNG.uniform(-1, 1, shape).astype(np.float32)


# (input shape, outputs per input channel, kernel, stride, padding, the window sum's kernel): narrow rows take the
# blocked layout (C*r channels in blocks of 16), rows of 16 and more NCHW
MULTIPLIER = [((2, 6, 8, 8), 2, 7, 2, 3, "reduce_2x1x4x4x16"), ((1, 5, 6, 6), 3, 3, 1, 1, "reduce_1x1x6x6x16"),
              ((2, 3, 8, 20), 2, 3, 1, 1, "reduce_2x6x8x20"), ((1, 4, 9, 34), 3, 5, 2, 2, "reduce_1x12x5x17")]


@pytest.mark.parametrize("xs,r,k,stride,padding,window_sum", MULTIPLIER)
def test_depthwise_multiplier_is_a_depthwise_window_sum(xs, r, k, stride, padding, window_sum: str) -> None:
  """Each input channel read by r output channels (groups = C, O = C*r): the conv runs as a depthwise one over the
  channels repeated r times, its window sum over the output's channels (one kernel tap a step); its input, computed (a
  relu), against numpy. As a product of one row per group its window sum was over (N, C, r, 1, P)."""
  x, w, b = rand(*xs), rand(xs[1] * r, 1, k, k), rand(xs[1] * r)
  c = compile([Tensor.input("x", xs).relu().conv2d(Tensor(w), Tensor(b), stride=stride, padding=padding, groups=xs[1])])
  sums = [kk.ast.arg for kk in c.kernels if any(u.op is Ops.REDUCE for u in kk.ast.toposort())]
  assert sums == [window_sum], c.plan.describe()
  pads = [(padding, padding)] * 2
  want = conv_ref(np.maximum(x, 0), w, b, [stride] * 2, pads, [1, 1], xs[1])
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def _silu(v: np.ndarray) -> np.ndarray: return v / (1 + np.exp(-v))


@pytest.mark.parametrize("stride,padding,kernels", [(1, (1, 1), ["reduce_2x1x24x1x640", "reduce_2x24x20x32"]),
                                                    (2, (0, 1), ["reduce_2x1x24x1x640", "elementwise_2x24x21x33", "reduce_2x24x10x16"])])
def test_depthwise_reads_its_producers_buffer_through_the_pad(stride: int, padding: tuple[int, int], kernels: list[str]) -> None:
  """A mobile block's expansion (1x1 conv, SiLU) and depthwise conv (NCHW: rows of 16 and more): the SiLU is the
  product's epilogue, and the depthwise conv's realized input, which then only copied the product's buffer, is dropped:
  the window sum (or, strided, its padded copy) reads the product's buffer through the NCHW reshape under the pad's
  bounds test, a gated load at the unclamped index (a clamped one was a gather)."""
  x, w1, w2 = rand(2, 8, 20, 32), rand(24, 8, 1, 1), rand(24, 1, 3, 3)
  h = Tensor.input("x", x.shape).conv2d(Tensor(w1)).silu()
  c = compile([h.conv2d(Tensor(w2), stride=stride, padding=[padding, padding], groups=24)])
  assert [k.ast.arg for k in c.kernels] == kernels, c.plan.describe()
  reader = c.kernels[1]  # reads the product's buffer through the pad
  loads = [u for u in reader.ast.toposort() if u.op is Ops.INDEX and u.src[0].arg == 1]
  assert loads and all(len(u.src) == 3 for u in loads), "the product's buffer is read by gated loads"
  ref = _silu(conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1))
  want = conv_ref(ref, w2, None, [stride] * 2, [padding, padding], [1, 1], 24)
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xs,k,stride,copy", [((2, 32, 8, 8), 5, 1, "elementwise_2x2x12x12x16"), ((1, 16, 9, 9), 7, 1, "elementwise_1x1x15x15x16"),
                                              ((2, 32, 4, 4), 3, 1, "elementwise_2x2x4x4x16"), ((2, 32, 8, 8), 5, 2, "elementwise_2x2x8x8x16")])
def test_blocked_copy_takes_the_padding_where_the_taps_outnumber_it(xs, k: int, stride: int, copy: str) -> None:
  """A blocked depthwise conv copies its input into blocks anyway: where its window sum reads at least
  conv.PADDED_COPY_TAPS taps per padded element (a 5x5 window over 8x8 maps: 11, a 7x7 over 9x9: 18), the copy takes
  the padding along and every tap is an ungated load; a 3x3 over 4x4 maps (4) and a strided 5x5 (2.8) read it in place,
  each tap under the pad's bounds test. Against numpy either way."""
  x, w, b = rand(*xs), rand(xs[1], 1, k, k), rand(xs[1])
  c = compile([Tensor.input("x", xs).conv2d(Tensor(w), Tensor(b), stride=stride, padding=k // 2, groups=xs[1])])
  assert c.kernels[0].ast.arg == copy, c.plan.describe()
  window = next(kk for kk in c.kernels if any(u.op is Ops.REDUCE for u in kk.ast.toposort()))
  gated = any(u.op is Ops.INDEX and len(u.src) > 2 for u in window.ast.toposort())
  assert gated == (copy.split("x")[-2] == str(xs[-1])), "in place: gated taps; padded: none"
  want = conv_ref(x, w, b, [stride] * 2, [(k // 2, k // 2)] * 2, [1, 1], xs[1])
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def _kernels_with(c, op: Ops) -> list[str]: return [k.ast.arg for k in c.kernels if any(u.op is op for u in k.ast.toposort())]


def test_a_channels_last_products_activation_is_its_epilogue() -> None:
  """A 1x1 conv over 2x2 maps computes its product channels-last and reads it back through a permute: its batch norm
  and ReLU6 run in the product's kernel (their per-channel operands read in the product's layout through the permute
  undone), not in a kernel of their own before the next conv."""
  x, w, b, a, s, w2 = rand(2, 64, 2, 2), rand(128, 64, 1, 1), rand(128), rand(1, 128, 1, 1), rand(1, 128, 1, 1), rand(32, 128, 1, 1)
  h = (Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b)) * Tensor(a) + Tensor(s)).minimum(6).maximum(0)
  c = compile([h.conv2d(Tensor(w2))])
  first = c.kernels[0].ast.arg
  assert _kernels_with(c, Ops.MAX) == [first] and first in _kernels_with(c, Ops.REDUCE), c.plan.describe()
  ref = np.clip((conv_ref(x, w, b, [1, 1], [(0, 0)] * 2, [1, 1], 1)) * a + s, 0, 6)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(ref, w2, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)


def test_a_blocked_depthwise_convs_activation_is_its_epilogue() -> None:
  """A squeeze-and-excitation block after a blocked depthwise conv: the SiLU, read by the pool and by the scaling, runs
  once, in the window sum's kernel (read back through the blocked layout's permute, it ran in both readers), and the
  residual input, an operand from outside the chain, is read in the blocked layout."""
  x, w, a = rand(2, 32, 4, 4), rand(32, 1, 3, 3), rand(1, 32, 1, 1)
  xi = Tensor.input("x", x.shape)
  d = xi.conv2d(Tensor(w), padding=1, groups=32).silu() * Tensor(a) + xi
  y = d * d.mean((2, 3), keepdims=True).sigmoid()
  c = compile([y.mean((2, 3))])
  window = next(k.ast.arg for k in c.kernels if k.ast.arg.endswith("x16") and any(u.op is Ops.REDUCE for u in k.ast.toposort()))
  assert window in _kernels_with(c, Ops.EXP2) and len(_kernels_with(c, Ops.EXP2)) == 2, c.plan.describe()  # the SiLU; the gate
  dd = conv_ref(x, w, None, [1, 1], [(1, 1)] * 2, [1, 1], 32)
  dd = _silu(dd) * a + x
  want = (dd / (1 + np.exp(-dd.mean((2, 3), keepdims=True)))).mean((2, 3))
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_a_blocked_depthwise_conv_reads_a_channels_last_product_in_place() -> None:
  """A mobile block over a 14x14 map: the expansion's product runs channels-last (196 positions are no whole number of
  vectors) with its ReLU6 as epilogue, and the blocked depthwise conv's (N, C/16, H, W, 16) copy of it, whose 16
  channels a position are 16 neighbours in that buffer too, is dropped (epilogue.DROP_PERMUTED_COPIES): the window sum
  reads the product's buffer through the permute, a vector a tap, under the pad's bounds test."""
  x, w1, w2 = rand(1, 24, 14, 14), rand(64, 24, 1, 1), rand(64, 1, 3, 3)
  h = Tensor.input("x", x.shape).conv2d(Tensor(w1)).minimum(6).maximum(0)
  c = compile([h.conv2d(Tensor(w2), padding=1, groups=64)])
  names = [k.ast.arg for k in c.kernels]
  assert len(names) == 3 and not any(n.startswith("elementwise") and n.endswith("x16") for n in names[:2]), c.plan.describe()
  ref = np.clip(conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), 0, 6)
  want = conv_ref(ref, w2, None, [1, 1], [(1, 1)] * 2, [1, 1], 64)
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_mobile_block_over_wide_rows_stays_channels_last(stride: int) -> None:
  """An inverted residual block over a 32x32 map (rows of BLOCK and more): the depthwise conv runs blocked because its
  input, the expansion's ReLU6, can come from a channels-last product (conv._relaid computes the 1x1 conv's product that
  way for it), which it then reads in place; the projection's input is the blocked layout, so its product is
  channels-last too (conv.POINTWISE_CHANNELS_LAST). No layout copy between the three, and numpy's result."""
  x, w1, w2, w3 = rand(1, 32, 32, 32), rand(64, 32, 1, 1), rand(64, 1, 3, 3), rand(32, 64, 1, 1)
  h = Tensor.input("x", x.shape).conv2d(Tensor(w1)).minimum(6).maximum(0)
  y = h.conv2d(Tensor(w2), stride=stride, padding=1, groups=64).minimum(6).maximum(0).conv2d(Tensor(w3))
  c = compile([y])
  names = [k.ast.arg for k in c.kernels]
  window = [n for n in names if n.endswith("x16") and n.startswith("reduce")]
  assert len(window) == 1 and not any(n.startswith("elementwise") for n in names[:-1]), c.plan.describe()
  e = np.clip(conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), 0, 6)
  d = np.clip(conv_ref(e, w2, None, [stride] * 2, [(1, 1)] * 2, [1, 1], 64), 0, 6)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(d, w3, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)


def test_a_relaid_expansion_read_twice_is_computed_once() -> None:
  """The expansion's output read by the depthwise conv and by a residual add (GhostNet's primary features are read by its
  cheap depthwise op and by the concatenation): the conv's node is rewritten to read the channels-last product, so both
  readers share it; one product kernel, not an NCHW one beside the channels-last one."""
  x, w1, w2 = rand(1, 32, 32, 32), rand(64, 32, 1, 1), rand(64, 1, 3, 3)
  h = Tensor.input("x", x.shape).conv2d(Tensor(w1)).maximum(0)
  c = compile([h.conv2d(Tensor(w2), padding=1, groups=64) + h])
  products = [k.ast.arg for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert len(products) == 2, c.plan.describe()  # the 1x1 product and the window sum
  e = np.maximum(conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), 0)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(e, w2, None, [1, 1], [(1, 1)] * 2, [1, 1], 64) + e, rtol=1e-4, atol=1e-4)
