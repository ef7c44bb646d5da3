"""Convs as transformers' stems use them (Whisper's: 1-d, stride 2, GELU, then channels last into a layer norm): the
product stays a register-tiled product where only its window start is padded, and epilogues that read the product twice
(exact GELU and SiLU fork on their input, kiln.graph.epilogue) move into the conv's kernel as a whole, unless a value
inside them has a reader outside."""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_conv import conv_ref, max_pool_ref

from kiln.codegen.choose import Opt, OptOps, Target, heuristic_opts
from kiln.codegen.lowering.prepare import prepare
from kiln.graph import Tensor, compile
from kiln.graph.schedule import Compiled
from kiln.ir.ops import Ops

RNG = np.random.default_rng(37)


def rand(*shape: int) -> np.ndarray: return RNG.uniform(-1, 1, shape).astype(np.float32)


def _with(c: Compiled, op: Ops) -> list[str]:
  return [k.ast.arg for k in c.kernels if any(u.op is op for u in k.ast.toposort())]


def _conv1d(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
  """float64 1-d conv, padding 1, stride 2 (Whisper's second conv)."""
  xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1)))
  n = (xp.shape[2] - w.shape[2]) // 2 + 1
  cols = np.stack([xp[:, :, k:k + 2 * n - 1:2] for k in range(w.shape[2])], -1)  # (N, C, n, k)
  return np.einsum("ncjk,ock->noj", cols, w.astype(np.float64)) + b.astype(np.float64)[:, None]


def _gelu(v: np.ndarray) -> np.ndarray: return v * 0.5 * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def test_conv_padded_at_the_start_only_is_a_tiled_product() -> None:
  """Whisper's second conv (k=3, stride 2, padding 1 over an even length) passes only the start of its input: one bounds
  test left, simplified to WHERE(out, 0, load). Still a register-tiled product with a packed panel (it was a loop
  gathering every lane, a sixth of the speed)."""
  x, w, b = rand(2, 16, 32), rand(32, 16, 3), rand(32)
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), stride=2, padding=1)])
  tiled = [k for k in c.kernels if {OptOps.PACK, OptOps.UNROLL} <= {o.op for o in heuristic_opts(prepare(k.ast)[0], Target(threads=2))}]
  assert len(tiled) == 1, c.plan.describe()
  np.testing.assert_allclose(c.run({"x": x})[0], _conv1d(x, w, b), rtol=1e-4, atol=1e-4)


def test_gelu_after_a_conv_runs_in_its_kernel() -> None:
  """Conv, exact GELU, channels last, layer norm over the channels: erf runs in the product's kernel only (in the layer
  norm it ran three times per element: for the mean, the variance and the output)."""
  # 16 output positions: over fewer, conv.py's product runs channels-last and its epilogue apart
  x, w, b = rand(2, 8, 32), rand(16, 8, 3), rand(16)
  y = Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), stride=2, padding=1).gelu().permute(0, 2, 1).layernorm()
  c = compile([y])
  sums = _with(c, Ops.REDUCE)
  assert len(sums) == 2 and _with(c, Ops.ERF) == sums[:1], c.plan.describe()  # the product with GELU, the norm
  g = _gelu(_conv1d(x, w, b)).transpose(0, 2, 1)
  d = g - g.mean(-1, keepdims=True)
  np.testing.assert_allclose(c.run({"x": x})[0], d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5), rtol=1e-4, atol=1e-4)


def test_silu_after_a_conv_runs_in_its_kernel_unless_its_input_is_read_elsewhere() -> None:
  x, w, b = rand(2, 8, 32), rand(16, 8, 3), rand(16)
  y = Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), stride=2, padding=1)
  ref = _conv1d(x, w, b)
  c = compile([y.silu().mean(-1)])
  assert _with(c, Ops.EXP2) == _with(c, Ops.REDUCE)[:1], c.plan.describe()  # x * sigmoid(x): exp in the product's kernel
  np.testing.assert_allclose(c.run({"x": x})[0], (ref / (1 + np.exp(-ref))).mean(-1), rtol=1e-4, atol=1e-5)
  c = compile([y.silu().mean(-1), y.max(-1)])  # the product has a reader outside the SiLU: it stays where it was
  assert len(_with(c, Ops.EXP2)) == 1 and _with(c, Ops.EXP2) != _with(c, Ops.REDUCE)[:1], c.plan.describe()
  got = c.run({"x": x})
  np.testing.assert_allclose(got[0], (ref / (1 + np.exp(-ref))).mean(-1), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[1], ref.max(-1), rtol=1e-5, atol=1e-5)


def test_depthwise_conv_written_channels_last_takes_its_lanes_along_the_map() -> None:
  """PVTv2's and SegFormer's Mix-FFN: a depthwise conv over (C, H, W) whose output is read as (H*W, C) by the next
  linear layer. Lanes along the store's contiguous channels would gather every tap with stride H*W; they go along the
  map instead, whose taps are contiguous, and the store scatters once per output."""
  x, w = rand(2, 32, 16, 16), rand(32, 1, 3, 3)
  y = Tensor.input("x", x.shape).conv2d(Tensor(w), padding=1, groups=32).reshape(2, 32, 256).permute(0, 2, 1)
  c = compile([y.gelu()])
  k = next(k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort()))
  p = prepare(k.ast)[0]
  store = next(s for s in p.src if s.op is Ops.STORE)
  lanes = [o.axis for o in heuristic_opts(p, Target(vector_bytes=64, threads=2)) if o.op is OptOps.UPCAST]
  inner = max(r.arg[0] for r in store.src[0].toposort() if r.op is Ops.RANGE)
  assert lanes and lanes[0] != inner, (lanes, inner)
  xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
  ref = sum(xp[:, :, i:i + 16, j:j + 16] * w[None, :, 0, i, j, None, None] for i in range(3) for j in range(3)).reshape(2, 32, 256).transpose(0, 2, 1)
  np.testing.assert_allclose(c.run({"x": x})[0], _gelu(ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("o,k,stride,pad,pool", [(64, 7, 2, 3, True), (32, 3, 2, 1, False), (48, 3, 2, 0, True)])
def test_an_image_stem_computes_channels_last_and_its_pool_too(o: int, k: int, stride: int, pad: int, pool: bool) -> None:
  """An image's stem (3 input channels: ResNet's 7x7/2, MobileNetV2's and SqueezeNet's 3x3/2): its product has few rows
  in NCHW (the output channels) and K of 27-147, so it runs channels-last (conv.STEM_CHANNELS_LAST), its rows the
  output positions; the max pool after it reads that buffer with its vector across the channels and writes channels-
  last too (conv.pooled), where in NCHW each lane of a row gathered C apart. Against numpy."""
  x, w, b = rand(2, 3, 40, 40), rand(o, 3, k, k), rand(o)
  y = Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), stride=stride, padding=pad).relu()
  if pool: y = y.max_pool([3, 3], [2, 2], [(1, 1), (1, 1)])
  c = compile([y])
  want = np.maximum(conv_ref(x, w, b, [stride] * 2, [(pad, pad)] * 2, [1, 1], 1), 0)
  if pool: want = max_pool_ref(np.pad(want, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf), 3, 2)
  sums = _with(c, Ops.REDUCE)
  positions = 2 * ((40 + 2 * pad - k) // stride + 1) ** 2
  assert f"x{positions}x" in sums[0], c.plan.describe()  # rows: every image's output positions
  if pool: assert sums[1] == f"reduce_2x{want.shape[2]}x{want.shape[3]}x{o}", c.plan.describe()  # (N, OH, OW, C)
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_an_image_stem_over_a_symbolic_batch_splits_its_rows() -> None:
  """A dynamic export's stem: its channels-last product's rows are every image's positions, a symbolic count, and its 32
  output channels one register tile. The threads split the rows (heuristic._thread_axis takes a symbolic axis for
  SYMBOLIC_GUESS units): with the one column tile the only static choice, it ran on one thread. Against numpy at 1 and 3."""
  w, b = rand(32, 3, 3, 3), rand(32)
  x = Tensor.input("x", ("batch", 3, 24, 24), dims={"batch": (1, 4)})
  c = compile([x.conv2d(Tensor(w), Tensor(b), stride=2, padding=1).relu()])
  product = next(k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort()))
  opts = heuristic_opts(prepare(product.ast)[0], Target(vector_bytes=64, threads=2, cores=2))
  assert any(o.op is OptOps.THREAD for o in opts), opts
  for n in (1, 3):
    a = rand(n, 3, 24, 24)
    want = np.maximum(conv_ref(a, w, b, [2, 2], [(1, 1)] * 2, [1, 1], 1), 0)
    np.testing.assert_allclose(c.run({"x": a})[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [3, 7])
def test_an_image_stems_product_takes_a_channels_taps_a_step(k: int) -> None:
  """The stem's channels-last product reads the window view in place, K = (channel, ky, kx): its loop takes k*k steps at
  a time (heuristic._window_steps), after which each step's tap offsets are constants; a step at a time, each of the
  register tile's rows took a division and a remainder per step (SqueezeNet's stem, K = 27: 113 GFLOP/s)."""
  w = rand(32, 3, k, k)
  c = compile([Tensor.input("x", (2, 3, 40, 40)).conv2d(Tensor(w), stride=2, padding=k // 2)])
  product = next(kk for kk in c.kernels if any(u.op is Ops.REDUCE for u in kk.ast.toposort()))
  p = prepare(product.ast)[0]
  red = next(u for u in p.toposort() if u.op is Ops.REDUCE).src[1]
  opts = heuristic_opts(p, Target(vector_bytes=64, threads=2, cores=2))
  assert Opt(OptOps.UNROLL, red.arg[0], k * k) in opts, opts
  x = rand(2, 3, 40, 40)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, None, [2, 2], [(k // 2, k // 2)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)
