"""ONNX ConvTranspose and LRN (issue 35) against onnxruntime: every ConvTranspose attribute (strides, dilations, group, pads,
output_padding, output_shape, auto_pad, kernel_shape) over 1-, 2- and 3-d inputs, with and without a bias, a weight known
at load and one fed at run time; the phase decomposition's merging (a kernel a multiple of the stride is one
product); what onnxruntime refuses is refused; LRN against onnxruntime where it computes one (4-d, odd size) and against
the ONNX definition written out in numpy where it does not; and the ONNX project's own node-test cases for both."""
from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from onnx_case import N, check, f32, model, onnx

from kiln.graph import onnx as konnx
from kiln.graph.lazy import ONNXError
from kiln.graph.onnx_ops_convt import MAX_PIECES, _axis_runs

# (input shape, weight shape, attributes, bias): each case covers several attributes at once
CASES = [
  ((2, 3, 5), (3, 4, 3), {"strides": [2]}, True),  # 1-d
  ((1, 2, 7), (2, 2, 4), {"strides": [3], "dilations": [2], "pads": [2, 1], "output_padding": [1]}, False),
  ((1, 4, 5, 6), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, True),  # the usual decoder upsample
  ((2, 6, 4, 5), (6, 2, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1], "group": 3}, True),  # DCGAN's 4x4 at stride 2, grouped
  ((1, 4, 5, 4), (4, 2, 3, 2), {"strides": [3, 2], "dilations": [2, 3], "pads": [0, 2, 3, 1]}, True),
  ((1, 2, 4, 4), (2, 3, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, True),  # odd total padding: UPPER and LOWER differ
  ((1, 2, 4, 4), (2, 3, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER", "group": 1}, False),
  ((1, 2, 3, 5), (2, 2, 2, 3), {"strides": [2, 3], "auto_pad": "VALID", "dilations": [1, 2]}, True),
  ((1, 2, 4, 4), (2, 2, 3, 3), {"strides": [3, 2], "output_shape": [10, 8], "pads": [5, 5, 5, 5]}, True),  # output_shape overrides pads
  ((1, 2, 4, 4), (2, 2, 3, 3), {"strides": [3, 3], "output_shape": [12, 7], "auto_pad": "SAME_UPPER"}, False),  # past the reach: zeros
  ((1, 3, 6, 6), (3, 2, 3, 3), {"pads": [1, 2, 2, 1], "kernel_shape": [3, 3]}, True),  # stride 1: one flipped convolution
  ((1, 4, 2, 3, 3), (4, 2, 2, 3, 2), {"strides": [2, 1, 3], "pads": [0, 1, 1, 1, 0, 0], "group": 2}, True),  # 3-d
  ((1, 2, 3, 3, 2), (2, 2, 3, 2, 2), {"strides": [2, 2, 2], "auto_pad": "SAME_LOWER", "dilations": [2, 1, 1]}, False),
]


def _convt(x: tuple, w: tuple, attrs: dict, bias: bool, fed_weight: bool = False) -> tuple:
  wv = f32(*w)
  inits = {"w": wv} | ({"b": f32(w[1] * attrs.get("group", 1))} if bias else {})
  feeds = {"x": f32(*x)}
  if fed_weight: feeds, inits = feeds | inits, {}
  return model([N("ConvTranspose", ["x", *inits, *([k for k in feeds if k != "x"])], ["y"], **attrs)], feeds, {"y": np.float32}, inits), feeds


@pytest.mark.parametrize("x,w,attrs,bias", CASES)
def test_conv_transpose_matches_onnxruntime(x: tuple, w: tuple, attrs: dict, bias: bool) -> None:
  check(*_convt(x, w, attrs, bias), tol=1e-4)


def test_conv_transpose_with_a_weight_fed_at_run_time() -> None:
  check(*_convt((1, 4, 4, 5), (4, 2, 4, 3), {"strides": [2, 3], "pads": [1, 0, 1, 1], "group": 2}, True, fed_weight=True), tol=1e-4)


def test_conv_transpose_under_a_symbolic_batch() -> None:
  m, feeds = _convt((1, 4, 5, 5), (4, 2, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True)
  m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
  km = konnx.load(m, dims={"n": (1, 4)})
  import onnxruntime as ort
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for batch in (1, 3):
    x = f32(batch, 4, 5, 5)
    np.testing.assert_allclose(km.run({"x": x})["y"], sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k,s,kernels", [(2, 2, 2), (8, 4, 5)])
def test_phases_that_share_a_window_are_one_product(k: int, s: int, kernels: int) -> None:
  """A kernel a multiple of the stride: 2x2 at stride 2 is one product (plus the copy that interleaves it and adds the
  bias), 8x8 at stride 4 with pads 2 at most two runs of phases per axis, so four products and the sum, not 16."""
  pads = [0] * 4 if k == s else [2] * 4
  check(*_convt((1, 4, 5, 5), (4, 3, k, k), {"strides": [s, s], "pads": pads}, True), tol=1e-4, kernels=kernels)


def test_an_output_of_nothing_but_padding_is_the_bias() -> None:
  check(*_convt((2, 1, 4), (1, 2, 1), {"strides": [3], "pads": [1, 8]}, True))  # one output, between the stride's taps


def test_axis_runs_read_each_tap_once() -> None:
  """Every tap of every axis lands in exactly one output phase of one run (no tap dropped, none multiplied twice)."""
  for s, d, k, pb, out in [(2, 1, 4, 1, 8), (3, 2, 5, 2, 11), (4, 6, 3, 0, 20), (5, 1, 3, 7, 4)]:
    runs = _axis_runs(s, d, k, pb, out)
    taps = sorted(int(t) for r in runs for t in r.idx.reshape(-1))
    assert taps == [t for t in range(k) if (t * d - pb) % s < out]
    for r in runs:  # phase a + p reads tap idx[p, j] at input q + lo + j*dl: o = q*s + phase = i*s + t*d - pb
      for p, row in enumerate(r.idx):
        for j, t in enumerate(row): assert (r.lo + j * r.dl) * s + t * d - pb == r.a + p


REFUSED = [
  ({"strides": [2, 2], "pads": [0, 0, 0, 0], "auto_pad": "SAME_UPPER"}, "cannot both be given"),
  ({"strides": [2, 2], "output_padding": [2, 0]}, "output_padding"),
  ({"strides": [2, 2], "output_shape": [20, 8]}, "inconsistent"),
  ({"pads": [3, 3, 3, 3]}, "output would have"),
  ({"kernel_shape": [2, 3]}, "kernel_shape"),
  ({"strides": [0, 1]}, "strides"),
  ({"group": 3}, "group"),
  ({"auto_pad": "SAME"}, "auto_pad"),
]


@pytest.mark.parametrize("attrs,words", REFUSED)
def test_conv_transpose_refuses_what_onnxruntime_refuses(attrs: dict, words: str) -> None:
  m, feeds = _convt((1, 2, 4, 4), (2, 2, 3, 3), attrs, False)
  with pytest.raises(ONNXError, match=words): konnx.load(m)


def test_a_weight_of_another_dtype_is_refused() -> None:
  m = model([N("ConvTranspose", ["x", "w"], ["y"])], {"x": f32(1, 2, 3, 3)}, {"y": np.float32}, {"w": f32(2, 2, 3, 3).astype(np.float64)})
  with pytest.raises(ONNXError, match="different dtypes"): konnx.load(m)


def test_too_many_sub_convolutions_are_refused() -> None:
  s, d, k = 17, 13, 17  # every tap its own phase, each reading its own window
  assert len(_axis_runs(s, d, k, 0, 17 * 3)) ** 2 > MAX_PIECES
  m, _ = _convt((1, 1, 3, 3), (1, 1, k, k), {"strides": [s, s], "dilations": [d, d]}, False)
  with pytest.raises(ONNXError, match="MAX_PIECES"): konnx.load(m)


def _lrn_ref(x: np.ndarray, size: int, alpha: float, beta: float, bias: float) -> np.ndarray:
  """The ONNX definition: the squares summed over channels c - floor((size-1)/2) .. c + ceil((size-1)/2)."""
  pre = (size - 1) // 2
  sq = np.pad(x.astype(np.float64) ** 2, [(0, 0), (pre, size - 1 - pre)] + [(0, 0)] * (x.ndim - 2))
  total = sum(sq[:, j:j + x.shape[1]] for j in range(size))
  return (x / (bias + alpha / size * total) ** beta).astype(np.float32)


@pytest.mark.parametrize("size,attrs", [(1, {}), (3, {"alpha": 0.5, "beta": 0.9, "bias": 2.0}), (5, {"alpha": 0.01, "beta": 1.0})])
def test_lrn_matches_onnxruntime(size: int, attrs: dict) -> None:
  feeds = {"x": f32(2, 6, 3, 4)}
  check(model([N("LRN", ["x"], ["y"], size=size, **attrs)], feeds, {"y": np.float32}), feeds, tol=1e-5)


@pytest.mark.parametrize("shape,size,alpha,beta,bias", [
  ((2, 6, 5), 4, 0.5, 0.75, 1.0),  # an even size (onnxruntime refuses it; ONNX defines it) on a 3-d input
  ((1, 5, 2, 3, 2), 3, 0.3, 0.6, 0.5),  # 5-d
  ((1, 20, 3, 3), 25, 0.7, 0.75, 1.5),  # wider than the channels and than the shifted-sum limit: the pooled form
  ((1, 4, 3, 3), 3, 0.2, 2.0, -3.0),  # a base that can be negative: power's sign rules
])
def test_lrn_follows_the_onnx_definition(shape: tuple, size: int, alpha: float, beta: float, bias: float) -> None:
  x = f32(*shape)
  m = model([N("LRN", ["x"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias)], {"x": x}, {"y": np.float32})
  np.testing.assert_allclose(konnx.load(m).run({"x": x})["y"], _lrn_ref(x, size, alpha, beta, bias), rtol=1e-5, atol=1e-5)


def test_lrn_refuses_a_size_below_one() -> None:
  with pytest.raises(ONNXError, match="size"): konnx.load(model([N("LRN", ["x"], ["y"], size=0)], {"x": f32(1, 3, 2, 2)}, {"y": np.float32}))


def _node_cases() -> list[tuple]:
  """The ONNX project's node-test cases for ConvTranspose and LRN (what onnx/backend/test/data/node/test_convtranspose* and
  test_lrn* hold, as model, inputs and outputs), taken from the generators that write those files."""
  found: list[tuple] = []
  for name, op in (("convtranspose", "ConvTranspose"), ("lrn", "LRN")):
    mod: Any = importlib.import_module(f"onnx.backend.test.case.node.{name}")
    saved = mod.expect
    mod.expect = lambda node, inputs, outputs, name, **kw: found.append((name, node, inputs, outputs))
    try:
      for a in dir(getattr(mod, op)):
        if a.startswith("export"): getattr(getattr(mod, op), a)()
    finally: mod.expect = saved
  return found


NODE_CASES = _node_cases()


@pytest.mark.parametrize("case", NODE_CASES, ids=[c[0] for c in NODE_CASES])
def test_onnx_node_cases(case: tuple) -> None:
  name, node, inputs, outputs = case
  vi = onnx.helper.make_tensor_value_info
  m = onnx.helper.make_model(onnx.helper.make_graph(
    [node], name, [vi(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in zip(node.input, inputs)],
    [vi(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in zip(node.output, outputs)]),
    opset_imports=[onnx.helper.make_opsetid("", 17)])
  got = konnx.load(m).run(dict(zip(node.input, inputs)))
  for k, want in zip(node.output, outputs): np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-5)


def test_every_node_case_was_found() -> None:
  assert len([c for c in NODE_CASES if c[0].startswith("test_convtranspose")]) >= 11 and len(NODE_CASES) >= 13
