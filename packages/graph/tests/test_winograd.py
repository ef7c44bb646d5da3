"""Winograd F(4x4, 3x3) (winograd.py): the transform matrices' algebra in float64, conv2d through it against a float64
numpy convolution and against the direct product (KILN_WINOGRAD=0), the cases it refuses, its kernels (two transforms of
stacked sums around one product, the bias in the copy back's epilogue, no kernel for a weight array's transform), and an ONNX Conv -> Relu -> MaxPool
chain through it against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from test_conv import conv_ref, matmul_kernels

from kiln.graph import Tensor, compile, winograd

RNG = np.random.default_rng(44)


def rand(*shape: int) -> np.ndarray: return RNG.uniform(-1, 1, shape).astype(np.float32)


def correlate3(d: np.ndarray, g: np.ndarray) -> np.ndarray:
  """The 4x4 valid cross-correlation of a 6x6 window with a 3x3 kernel."""
  return np.array([[(d[i:i + 3, j:j + 3] * g).sum() for j in range(4)] for i in range(4)])


def test_transforms_compute_the_correlation_exactly() -> None:
  """A^T [(G g G^T) * (B^T d B)] A is the correlation of d with g, in float64 to rounding (a wrong sign or constant in
  any of the three matrices is off by O(1)); the weight's kron table is G g G^T flattened."""
  rng = np.random.default_rng(3)
  bt, at = winograd._BT, winograd._AT
  for _ in range(20):
    d, g = rng.standard_normal((6, 6)), rng.standard_normal((3, 3))
    u = (winograd.WEIGHT_T @ g.reshape(9)).reshape(6, 6)
    np.testing.assert_allclose(u, winograd._G @ g @ winograd._G.T, rtol=1e-12, atol=1e-12)
    y = at @ (u * (bt @ d @ bt.T)) @ at.T
    np.testing.assert_allclose(y, correlate3(d, g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x", ["_BT", "_AT"])
def test_transform_kernel_is_x_d_xt(x: str) -> None:
  """transform(X, d) on a grid of tensors, run as a kernel: X d X^T per element, flattened row by row (the stacked sums
  skip zero coefficients and turn +-1 into adds: a wrong skip or sign is off by O(1)); the stack axis unrolled whole."""
  xm = getattr(winograd, x)
  d = RNG.uniform(-1, 1, (6, 6, 200)).astype(np.float32)
  c = compile([winograd.transform(xm, [[Tensor(d[a, b]) for b in range(6)] for a in range(6)])])
  want = np.einsum("ia,abk,jb->ijk", xm, d.astype(np.float64), xm).reshape(-1, 200)
  np.testing.assert_allclose(c.run()[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert c.kernel_count == 1


CASES = [  # x shape, out channels, pads ((top, bottom), (left, right)), bias
  ((4, 32, 8, 8), 64, ((1, 1), (1, 1)), True),
  ((1, 48, 16, 16), 48, ((1, 1), (1, 1)), False),
  ((3, 32, 7, 9), 64, ((1, 1), (1, 1)), True),  # maps that are not whole tiles: the edge tiles cropped
  ((8, 40, 10, 6), 64, ((0, 0), (0, 0)), True),  # no padding: an 8x4 output
  ((2, 64, 9, 11), 65, ((2, 0), (0, 3)), True),  # uneven pads
  ((16, 64, 4, 4), 64, ((1, 1), (1, 1)), False),  # one tile per image
]


@pytest.mark.parametrize("xs,o,pads,bias", CASES)
def test_conv_matches_numpy_and_the_direct_product(monkeypatch, xs, o, pads, bias) -> None:
  x, w = rand(*xs), rand(o, xs[1], 3, 3)
  b = rand(o) if bias else None
  assert winograd.fits(Tensor(x), Tensor(w), pads, [1, 1], [1, 1], 1)
  want = conv_ref(x, w, b, [1, 1], list(pads), [1, 1], 1)
  got, kernels = {}, {}
  for flag in ("1", "0"):
    monkeypatch.setenv("KILN_WINOGRAD", flag)
    c = compile([Tensor.input("x", xs).conv2d(Tensor(w), None if b is None else Tensor(b), 1, list(pads))])
    got[flag], kernels[flag] = c.run({"x": x})[0], c.kernel_count
    assert got[flag].shape == want.shape
  # the input transform, the products, the output transform, the tiles put back (and a bias that is the graph's output:
  # an output is never an epilogue, the direct product's either)
  assert kernels["1"] == 4 + bias, kernels
  # F(4x4, 3x3) rounds its transform constants: about 1e-5 of the magnitude of a sum over the channels
  scale = np.abs(want).max()
  np.testing.assert_allclose(got["1"], want, rtol=0, atol=3e-5 * scale)
  np.testing.assert_allclose(got["0"], want, rtol=0, atol=3e-6 * scale)


def test_kernels_bias_in_the_epilogue_and_the_weight_transformed_at_build() -> None:
  """The input transform, one product, the output transform and the copy that puts the tiles back in order, the bias
  and relu in its epilogue, for a weight array (its transform done in numpy at build); a weight fed at run time is
  transformed by one more product."""
  xs = (4, 32, 8, 8)
  x = Tensor.input("x", xs)
  c = compile([x.conv2d(Tensor(rand(64, 32, 3, 3)), Tensor(rand(64)), padding=1).relu().max_pool((2, 2))])
  assert c.kernel_count == 5 and len(matmul_kernels(c)) == 1, c.plan.describe()  # + the max pool
  wt = Tensor.input("w", (64, 32, 3, 3))
  c = compile([x.conv2d(wt, padding=1)])
  assert len(matmul_kernels(c)) == 2, c.plan.describe()
  xn, wn = rand(*xs), rand(64, 32, 3, 3)
  want = conv_ref(xn, wn, None, [1, 1], [(1, 1)] * 2, [1, 1], 1)
  np.testing.assert_allclose(c.run({"x": xn, "w": wn})[0], want, rtol=0, atol=3e-5 * np.abs(want).max())


@pytest.mark.parametrize("why,xs,ws,st,dl,groups,pads", [
  ("stride 2", (1, 16, 8, 8), (16, 16, 3, 3), [2, 2], [1, 1], 1, [(1, 1)] * 2),
  ("dilation 2", (1, 16, 8, 8), (16, 16, 3, 3), [1, 1], [2, 2], 1, [(1, 1)] * 2),
  ("groups", (1, 32, 8, 8), (32, 16, 3, 3), [1, 1], [1, 1], 2, [(1, 1)] * 2),
  ("5x5 kernel", (1, 16, 8, 8), (16, 16, 5, 5), [1, 1], [1, 1], 1, [(2, 2)] * 2),
  ("3x1 kernel", (1, 16, 8, 8), (16, 16, 3, 1), [1, 1], [1, 1], 1, [(1, 1), (0, 0)]),
  ("few input channels", (4, 8, 8, 8), (128, 8, 3, 3), [1, 1], [1, 1], 1, [(1, 1)] * 2),
  ("few output channels", (4, 128, 8, 8), (8, 128, 3, 3), [1, 1], [1, 1], 1, [(1, 1)] * 2),
  ("16 -> 16 channels", (4, 16, 8, 8), (16, 16, 3, 3), [1, 1], [1, 1], 1, [(1, 1)] * 2),
  ("few tiles", (1, 64, 8, 8), (64, 64, 3, 3), [1, 1], [1, 1], 1, [(1, 1)] * 2),
  ("output under one tile", (16, 64, 5, 5), (64, 64, 3, 3), [1, 1], [1, 1], 1, [(0, 0)] * 2),
])
def test_refused_cases_take_the_direct_product(why, xs, ws, st, dl, groups, pads) -> None:
  x, w = rand(*xs), rand(*ws)
  assert not winograd.fits(Tensor(x), Tensor(w), pads, st, dl, groups), why
  c = compile([Tensor.input("x", xs).conv2d(Tensor(w), None, st, pads, dl, groups)])
  assert len(matmul_kernels(c)) <= 1, (why, c.plan.describe())  # (a tiny one is no matmul for the heuristic either)
  want = conv_ref(x, w, None, st, pads, dl, groups)
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_refused_dtypes_symbolic_batch_and_the_switch(monkeypatch) -> None:
  w = Tensor(rand(64, 64, 3, 3))
  args = ([(1, 1)] * 2, [1, 1], [1, 1], 1)
  assert winograd.fits(Tensor(rand(4, 64, 8, 8)), w, *args)
  assert not winograd.fits(Tensor(rand(4, 64, 8, 8).astype(np.float64)), Tensor(rand(64, 64, 3, 3).astype(np.float64)), *args)
  # a symbolic batch: one image's tiles are the columns, so 8x8 maps (4 tiles) keep the direct product, 16x16 (16) take it
  assert not winograd.fits(Tensor.input("x", ("batch", 64, 8, 8), dims={"batch": (4, 8)}), w, *args)
  assert winograd.fits(Tensor.input("x", ("batch", 64, 16, 16), dims={"batch": (4, 8)}), w, *args)
  monkeypatch.setenv("KILN_WINOGRAD", "0")
  assert not winograd.fits(Tensor(rand(4, 64, 8, 8)), w, *args)


@pytest.mark.parametrize("hw,pads", [((16, 16), ((1, 1), (1, 1))), ((18, 21), ((1, 1), (0, 2)))])
def test_symbolic_batch_one_compile_every_size(hw: tuple[int, int], pads) -> None:
  """Under a symbolic batch the images stay an outer axis of every step (one image's tiles the product's columns): one
  compile runs batches of 1, 3 and 5 against numpy, through one product kernel (the Winograd plan, not the direct one);
  maps that are not whole tiles are cropped."""
  w, b = rand(48, 40, 3, 3), rand(48)
  x = Tensor.input("x", ("batch", 40, *hw), dims={"batch": (1, 8)})
  assert winograd.fits(x, Tensor(w), pads, [1, 1], [1, 1], 1)
  c = compile([x.conv2d(Tensor(w), Tensor(b), 1, list(pads)).relu()])
  assert len(matmul_kernels(c)) == 1 and c.kernel_count == 5, c.plan.describe()  # (+ the bias and relu: an output is no epilogue)
  for n in (1, 3, 5):
    xn = rand(n, 40, *hw)
    want = np.maximum(conv_ref(xn, w, b, [1, 1], list(pads), [1, 1], 1), 0)
    got = c.run({"x": xn})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5 * np.abs(want).max())


def test_cost_rule() -> None:
  """Channels where the measured direct conv won or tied (16 -> 16, 16 -> 32, 8 -> 16, 3 -> 32, SqueezeNet's 16 -> 64) are
  refused, and so are fewer than MIN_CHANNELS either side; 32 -> 32 and more taken."""
  refused = ((16, 16), (16, 32), (32, 16), (8, 16), (3, 32), (3, 512), (512, 8), (16, 64), (64, 16), (24, 24))
  assert not any(winograd.saves(c, o) for c, o in refused)
  assert all(winograd.saves(c, o) for c, o in ((32, 32), (32, 64), (48, 48), (64, 64), (64, 128), (256, 256), (512, 512)))


def test_onnx_conv_relu_pool_against_onnxruntime() -> None:
  """Conv (bias) -> Relu -> MaxPool -> Conv -> GlobalAveragePool, both convs through Winograd, against onnxruntime."""
  onnx = pytest.importorskip("onnx")
  ort = pytest.importorskip("onnxruntime")
  from onnx import TensorProto, helper

  from kiln.graph import onnx as konnx
  w1, b1, w2 = rand(64, 32, 3, 3), rand(64), rand(96, 64, 3, 3)
  init = [helper.make_tensor(n, TensorProto.FLOAT, a.shape, a.ravel()) for n, a in (("w1", w1), ("b1", b1), ("w2", w2))]
  nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
           helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
           helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]), helper.make_node("GlobalAveragePool", ["c2"], ["y"])]
  g = helper.make_graph(nodes, "wino", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32, 16, 16])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 96, 1, 1])], init)
  model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  model.ir_version = 8
  onnx.checker.check_model(model)
  x = rand(4, 32, 16, 16)
  want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  km = konnx.load(model)
  assert len(matmul_kernels(km.compiled)) == 2, km.plan.describe()  # one product per conv
  np.testing.assert_allclose(km.run({"x": x})["y"], want, rtol=0, atol=3e-5 * np.abs(want).max())


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 4), c=st.sampled_from([24, 32, 40]), o=st.sampled_from([64, 72, 96]), h=st.integers(4, 13), w=st.integers(4, 13),
       pads=st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)), bias=st.booleans(),
       relu=st.booleans())
def test_random_convs_against_numpy(n: int, c: int, o: int, h: int, w: int, pads: tuple[int, int, int, int], bias: bool, relu: bool) -> None:
  """Random maps, pads and channel counts the cost rule takes (or, with few tiles, refuses: then the direct product), with
  an epilogue or not, against the float64 reference."""
  pp = [(pads[0], pads[1]), (pads[2], pads[3])]
  if h + pads[0] + pads[1] < 3 or w + pads[2] + pads[3] < 3: return
  x, wt = RNG.uniform(-1, 1, (n, c, h, w)).astype(np.float32), RNG.uniform(-1, 1, (o, c, 3, 3)).astype(np.float32)
  b = RNG.uniform(-1, 1, o).astype(np.float32) if bias else None
  y = Tensor.input("x", x.shape).conv2d(Tensor(wt), None if b is None else Tensor(b), 1, pp)
  got = compile([y.relu() if relu else y]).run({"x": x})[0]
  want = conv_ref(x, wt, b, [1, 1], pp, [1, 1], 1)
  want = np.maximum(want, 0) if relu else want
  np.testing.assert_allclose(got, want, rtol=0, atol=3e-5 * max(np.abs(want).max(), 1e-3))
