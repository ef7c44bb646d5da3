"""kiln.graph.onnx's GridSample and Col2Im (onnx_ops_sample.py) against onnxruntime: every mode x padding x align_corners
in 2-D and 3-D (one model each, many nodes), grids that land on halves and whole pixels and far outside, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx_case import N, check, f32, model  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

ort.set_default_logger_severity(3)  # the models leave their outputs' shapes to inference: no warnings about that
PADDINGS = ("zeros", "border", "reflection")


def _grid(*shape: int) -> np.ndarray:
  """Random positions over and past the input, and the awkward ones: the corners, exact halves and whole pixels of each
  align mode (nearest's ties, floor at an integer), and far away (reflection folds them back many times)."""
  g = f32(*shape, lo=-2.5, hi=2.5)
  g.reshape(-1)[:16] = [-1, 1, 0, 0.5, -0.5, 1 / 3, -0.75, 0.25, 3.7, -7.9, 20.25, -1.5, 1.5, 0.2, -0.2, 0.6]
  return g


def _all_modes(modes: tuple[str, ...], flip: int) -> tuple[list, dict[str, type]]:
  """A node per mode x padding, align_corners alternating (flip=1: the other half of the combinations)."""
  nodes, outs = [], {}
  for j, (mode, pad) in enumerate((m, p) for m in modes for p in PADDINGS):
    name = f"y_{mode}_{pad}"
    nodes.append(N("GridSample", ["x", "g"], [name], mode=mode, padding_mode=pad, align_corners=(j + flip) % 2))
    outs[name] = np.float32
  return nodes, outs


@pytest.mark.parametrize("opset, modes, flip", [(20, ("linear", "nearest", "cubic"), 0), (16, ("bilinear", "nearest", "bicubic"), 1)])
def test_grid_sample_2d_every_mode(opset: int, modes: tuple[str, ...], flip: int) -> None:
  """Every mode x padding x align_corners over the two opsets' mode names."""
  x, g = f32(2, 3, 4, 5), _grid(2, 6, 7, 2)
  nodes, outs = _all_modes(modes, flip)
  check(model(nodes, {"x": x, "g": g}, outs, opset=opset), {"x": x, "g": g})


def test_grid_sample_3d_and_small_axes() -> None:
  """Trilinear and nearest in 3-D (each padding, align_corners alternating); an axis of 1 and of 2 (reflection's range
  is a pixel or two)."""
  x, g = f32(2, 2, 3, 1, 2), _grid(2, 3, 4, 5, 3)
  combos = [("linear", "zeros", 1), ("linear", "border", 0), ("linear", "reflection", 0), ("nearest", "zeros", 0), ("nearest", "border", 1),
            ("nearest", "reflection", 0)]  # reflection with align_corners about an axis of 1 is refused (test_grid_sample_refusals)
  nodes = [N("GridSample", ["x", "g"], [f"y{j}"], mode=m, padding_mode=p, align_corners=a) for j, (m, p, a) in enumerate(combos)]
  check(model(nodes, {"x": x, "g": g}, {f"y{j}": np.float32 for j in range(len(combos))}, opset=20), {"x": x, "g": g})


def test_grid_sample_float64_and_a_computed_grid() -> None:
  """The grid computed in the model (raft's flow + coordinates), in float64 as the input."""
  x, flow = f32(1, 2, 6, 5).astype(np.float64), f32(1, 4, 3, 2, lo=-0.3, hi=0.3).astype(np.float64)
  base = f32(1, 4, 3, 2, lo=-1, hi=1).astype(np.float64)
  check(model([N("Add", ["b", "f"], ["g"]), N("GridSample", ["x", "g"], ["y"], mode="cubic", padding_mode="border")],
              {"x": x, "f": flow}, {"y": np.float64}, {"b": base}, opset=20), {"x": x, "f": flow}, tol=1e-9)


def test_grid_sample_float64_input_float32_grid() -> None:
  """ONNX lets the grid be float32 beside a float64 input (onnxruntime has no such kernel): the sum stays in float64. The
  grid lands on pixel centres, each weight 1 or 0, so the output is the input's float64 values exactly."""
  x, g = np.random.default_rng(0).normal(size=(1, 1, 3, 3)), np.array([[[[-1, 0], [1, -1]], [[0, 1], [1, 1]]]], np.float32)
  km = konnx.load(model([N("GridSample", ["x", "g"], ["y"], align_corners=1)], {"x": x, "g": g}, {"y": np.float64}, opset=20))
  np.testing.assert_array_equal(km.run({"x": x, "g": g})["y"], x[0, 0][[[1, 0], [2, 2]], [[0, 2], [1, 2]]][None, None])


def test_grid_sample_refusals() -> None:
  def load(xs: tuple[int, ...], gs: tuple[int, ...], **attrs: object) -> None:
    konnx.load(model([N("GridSample", ["x", "g"], ["y"], **attrs)], {"x": f32(*xs), "g": f32(*gs)}, {"y": np.float32}, opset=20))
  with pytest.raises(ONNXError, match="cubic mode on 3-D"): load((1, 1, 2, 3, 4), (1, 2, 2, 2, 3), mode="cubic")
  with pytest.raises(ONNXError, match="size 1"): load((1, 1, 1, 4), (1, 2, 2, 2), padding_mode="reflection", align_corners=1)
  with pytest.raises(ONNXError, match="mode='area' is not supported"): load((1, 1, 3, 4), (1, 2, 2, 2), mode="area")


COL2IM = [([5, 5], [1, 5], {}), ([5, 5], [3, 3], {"strides": [2, 2]}), ([6, 6], [2, 2], {"dilations": [1, 5]}),
          ([3, 4, 5], [1, 1, 5], {}), ([7, 9], [3, 2], {"strides": [2, 3], "pads": [2, 0, 1, 2], "dilations": [2, 1]})]


def test_col2im() -> None:
  """Strides, pads, dilations, 3-D, and blocks that overlap (each pixel the sum of several entries), against onnxruntime."""
  feeds, nodes, outs, inits = {}, [], {}, {}
  for j, (img, blk, attrs) in enumerate(COL2IM):
    r = len(img)
    pads, st, dl = attrs.get("pads", [0] * 2 * r), attrs.get("strides", [1] * r), attrs.get("dilations", [1] * r)
    blocks = int(np.prod([(i + pads[a] + pads[a + r] - (dl[a] * (b - 1) + 1)) // st[a] + 1 for a, (i, b) in enumerate(zip(img, blk))]))
    feeds[f"x{j}"] = f32(2, 2 * int(np.prod(blk)), blocks)
    inits |= {f"i{j}": np.array(img, np.int64), f"b{j}": np.array(blk, np.int64)}
    nodes.append(N("Col2Im", [f"x{j}", f"i{j}", f"b{j}"], [f"y{j}"], **attrs))
    outs[f"y{j}"] = np.float32
  check(model(nodes, feeds, outs, inits, opset=18), feeds)


def test_col2im_refusals() -> None:
  inits = {"i": np.array([5, 5], np.int64), "b": np.array([3, 3], np.int64)}
  with pytest.raises(ONNXError, match="blocks do not fit"):
    konnx.load(model([N("Col2Im", ["x", "i", "b"], ["y"])], {"x": f32(1, 9, 10)}, {"y": np.float32}, inits, opset=18))
  with pytest.raises(ONNXError, match="not a multiple"):
    konnx.load(model([N("Col2Im", ["x", "i", "b"], ["y"])], {"x": f32(1, 10, 9)}, {"y": np.float32}, inits, opset=18))
