"""kiln.graph.onnx's OneHot and the forms onnx_ops_misc.py adds to core operators (BatchNormalization in training mode,
MaxPool's Indices, Split with empty pieces, Pad mode wrap) against onnxruntime, and their refusals."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx_case import N, check, f32, model  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

ort.set_default_logger_severity(3)  # the models leave their outputs' shapes to inference: no warnings about that


def i64(*v: int) -> np.ndarray: return np.asarray(v, np.int64)


def test_one_hot() -> None:
  """Every axis, negative indices, indices out of range both ways (all off), float indices (truncated), values fed."""
  ind, indf, vals = np.array([[0, 5, -6], [-1, 7, 2]], np.int64), np.array([0, 1.7, -1.2, 2.5, 4.99, -5.5], np.float32), i64(2, 9)
  nodes = [N("OneHot", ["i", "d", "v"], [f"y{a}"], axis=a) for a in (-1, 0, 1, -3)]
  nodes += [N("OneHot", ["f", "d", "w"], ["yf"]), N("OneHot", ["i", "d", "w"], ["yw"], axis=1)]
  outs = {f"y{a}": np.float32 for a in (-1, 0, 1, -3)} | {"yf": np.int64, "yw": np.int64}
  feeds = {"i": ind, "f": indf, "w": vals}
  check(model(nodes, feeds, outs, {"d": i64(5), "v": np.array([-1, 3], np.float32)}, opset=11), feeds)


def test_one_hot_refusals() -> None:
  def load(depth: int, axis: int) -> None:
    inits = {"d": i64(depth), "v": np.zeros(2, np.float32)}
    konnx.load(model([N("OneHot", ["i", "d", "v"], ["y"], axis=axis)], {"i": i64(0, 1)}, {"y": np.float32}, inits, opset=11))
  with pytest.raises(ONNXError, match="depth 0 must be >= 1"): load(0, -1)
  with pytest.raises(ONNXError, match="axis 3 is out of range"): load(4, 3)


def test_batchnorm_training_mode() -> None:
  """The batch's own statistics and the running ones, statistics fed and constant; and torch's weight standardisation
  (every input a constant, only Y read), which folds at load: no kernel of its own."""
  x = f32(2, 3, 4, 5)
  st = {"s": f32(3), "b": f32(3), "m": f32(3), "v": f32(3, lo=0.5, hi=2)}
  bn = N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1, momentum=0.7, epsilon=1e-3)
  check(model([bn], {"x": x, **st}, {"y": np.float32, "rm": np.float32, "rv": np.float32}, opset=15), {"x": x, **st})
  check(model([bn], {"x": x}, {"y": np.float32, "rm": np.float32, "rv": np.float32}, st, opset=15), {"x": x})
  w = {"w": f32(1, 8, 27), "s": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "m": np.zeros(8, np.float32), "v": np.ones(8, np.float32)}
  xw = f32(1, 8, 27)
  std = [N("BatchNormalization", ["w", "s", "b", "m", "v"], ["wn", "_m", "_v"], training_mode=1, momentum=1.0), N("Mul", ["x", "wn"], ["y"])]
  check(model(std, {"x": xw}, {"y": np.float32}, w, opset=15), {"x": xw}, kernels=1)


def test_maxpool_indices() -> None:
  """Ties (the first in the window's row-major order wins), pads, strides, dilations, auto_pad, storage_order=1, 1-D and 3-D."""
  x = f32(2, 3, 7, 8)
  x[0, 0, 1:3, 1:3] = 1.5
  cases = [{"kernel_shape": [3, 3]}, {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]},
           {"kernel_shape": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 2], "storage_order": 1},
           {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER"}]
  nodes = [N("MaxPool", ["x"], [f"y{j}", f"i{j}"], **a) for j, a in enumerate(cases)]
  nodes.append(N("MaxPool", ["x"], ["so"], kernel_shape=[2, 2], storage_order=1))  # storage_order orders only Indices
  outs = {k: t for j in range(len(cases)) for k, t in ((f"y{j}", np.float32), (f"i{j}", np.int64))} | {"so": np.float32}
  check(model(nodes, {"x": x}, outs, opset=12), {"x": x})
  x1, x3 = f32(2, 3, 9), f32(1, 2, 4, 5, 6)
  nodes = [N("MaxPool", ["a"], ["ya", "ia"], kernel_shape=[3], strides=[2]),
           N("MaxPool", ["b"], ["yb", "ib"], kernel_shape=[2, 3, 2], strides=[1, 2, 2], storage_order=1)]
  check(model(nodes, {"a": x1, "b": x3}, {"ya": np.float32, "ia": np.int64, "yb": np.float32, "ib": np.int64}, opset=12), {"a": x1, "b": x3})
  with pytest.raises(ONNXError, match="ceil_mode=1 with the Indices output"):
    konnx.load(model([N("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], ceil_mode=1)], {"x": x}, {"y": np.float32, "i": np.int64}, opset=12))


def test_split_with_empty_pieces() -> None:
  """A piece of size 0 is an empty array; what reads it (Concat here) leaves it out."""
  x = f32(2, 3, 8)
  nodes = [N("Split", ["x", "s"], ["a", "b", "c"], axis=2), N("Concat", ["b", "a", "c"], ["y"], axis=2)]
  check(model(nodes, {"x": x}, {"y": np.float32, "a": np.float32}, {"s": i64(5, 0, 3)}, opset=13), {"x": x})


def test_pad_wrap() -> None:
  """Pads before and after, past the axis's length, negative ones (which crop first, as onnxruntime), and axes."""
  x = f32(2, 3, 5)
  pads = [i64(0, 2, 0, 0, 1, 3), i64(0, -1, 7, 0, 1, -2), i64(0, 0, -4, 0, 0, 6)]
  nodes = [N("Pad", ["x", f"p{j}"], [f"y{j}"], mode="wrap") for j in range(3)] + [N("Pad", ["x", "q", "", "ax"], ["ya"], mode="wrap")]
  inits = {f"p{j}": p for j, p in enumerate(pads)} | {"q": i64(4, 9), "ax": i64(-1)}
  check(model(nodes, {"x": x}, {"y0": np.float32, "y1": np.float32, "y2": np.float32, "ya": np.float32}, inits, opset=19), {"x": x})
  with pytest.raises(ONNXError, match="to nothing"):
    konnx.load(model([N("Pad", ["x", "p"], ["y"], mode="wrap")], {"x": x}, {"y": np.float32}, {"p": i64(0, 0, -3, 0, 0, -2)}, opset=19))
