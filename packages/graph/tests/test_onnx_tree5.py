"""ai.onnx.ml opset 5's TreeEnsemble (onnx_ops_trees._tree_ensemble) against onnxruntime, on forests built here: interior
nodes and leaves in their separate lists, every branch mode including BRANCH_MEMBER, NaN features with and without
missing_value_tracks_true, several targets, SUM and AVERAGE, post transforms, float and double inputs, a one-leaf tree;
and the typed refusals."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx_case import onnx, ort

from kiln.graph import ONNXError
from kiln.graph import onnx as konnx

helper = onnx.helper
ML = "ai.onnx.ml"
F = 4


def _forest(depths: list[int], modes: list[int], targets: int, seed: int, dtype: Any = np.float32) -> dict[str, Any]:
  """Trees of the given depths (depth 0: one node whose two branches reach the same leaf), interior nodes numbered in
  breadth-first order across the forest, leaves in the order they are made. Thresholds and member sets are small
  integers, so that EQ, NEQ and MEMBER meet equal values in integer-valued X."""
  rng = np.random.default_rng(seed)
  tp = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
  feat: list[int] = []; split: list[float] = []; mode: list[int] = []; miss: list[int] = []
  tid: list[int] = []; fid: list[int] = []; tleaf: list[int] = []; fleaf: list[int] = []
  roots: list[int] = []; leaf_t: list[int] = []; leaf_w: list[float] = []; members: list[float] = []
  def leaf() -> int:
    leaf_t.append(int(rng.integers(0, targets))); leaf_w.append(float(rng.normal()))
    return len(leaf_t) - 1
  def node(level: int, depth: int) -> int:
    k = len(feat)
    m = modes[int(rng.integers(0, len(modes)))]
    feat.append(int(rng.integers(0, F))); split.append(float(rng.integers(-2, 3))); mode.append(m); miss.append(int(rng.integers(0, 2)))
    tid.append(0); fid.append(0); tleaf.append(0); fleaf.append(0)
    if m == 6: members.extend([*sorted({float(v) for v in rng.integers(-2, 3, size=2)}), float("nan")])
    for ids, flags in ((tid, tleaf), (fid, fleaf)):
      if level + 1 >= depth: ids[k], flags[k] = leaf(), 1
      else: ids[k], flags[k] = node(level + 1, depth), 0
    return k
  for depth in depths:
    if depth == 0:
      k = len(feat)
      roots.append(k); feat.append(0); split.append(0.0); mode.append(0); miss.append(0)
      one = leaf()
      tid.append(one); fid.append(one); tleaf.append(1); fleaf.append(1)
    else: roots.append(node(0, depth))
  attrs = {"nodes_featureids": feat, "nodes_truenodeids": tid, "nodes_falsenodeids": fid, "nodes_trueleafs": tleaf, "nodes_falseleafs": fleaf,
           "nodes_missing_value_tracks_true": miss, "tree_roots": roots, "leaf_targetids": leaf_t, "n_targets": targets,
           "nodes_modes": helper.make_tensor("modes", onnx.TensorProto.UINT8, [len(mode)], mode),
           "nodes_splits": helper.make_tensor("splits", tp, [len(split)], split),
           "leaf_weights": helper.make_tensor("weights", tp, [len(leaf_w)], leaf_w)}
  if members: attrs["membership_values"] = helper.make_tensor("members", tp, [len(members)], members)
  return attrs


def _model(attrs: dict[str, Any], dtype: Any = np.float32, **extra: Any) -> bytes:
  tp = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
  node = helper.make_node("TreeEnsemble", ["x"], ["y"], domain=ML, **attrs, **extra)
  g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", tp, ["N", F])], [helper.make_tensor_value_info("y", tp, ["N", "T"])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ML, 5)])
  m.ir_version = 10
  return m.SerializeToString()


def _x(rows: int = 40, dtype: Any = np.float32, nan: bool = True) -> np.ndarray:
  x = np.random.default_rng(9).integers(-3, 4, (rows, F)).astype(dtype)
  if nan: x[::5, 1] = np.nan
  return x


def _same(data: bytes, x: np.ndarray, tol: float = 1e-5) -> None:
  (want,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
  (got,) = konnx.load(data, dims={"N": (1, 64)}).run({"x": x}).values()
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])  # AVERAGE, SUM, MIN, MAX: each leaf weighs one of 3 targets
def test_a_forest_of_every_mode_matches_onnxruntime(aggregate: int) -> None:
  attrs = _forest([3, 2, 4, 0], [0, 1, 2, 3, 4, 5, 6], 3, seed=aggregate)
  _same(_model(attrs, aggregate_function=aggregate), _x())


def _softmax(s: np.ndarray) -> np.ndarray:
  e = np.exp(s - s.max(1, keepdims=True))
  return e / e.sum(1, keepdims=True)


def _softmax_zero(s: np.ndarray) -> np.ndarray:
  """SOFTMAX_ZERO: a zero score stays out of the sum and stays 0."""
  zero = np.abs(s) <= 1e-7
  e = np.where(zero, 0.0, np.exp(s - s.max(1, keepdims=True)))
  return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize("transform", [1, 2, 3])
def test_post_transforms_follow_the_spec(transform: int) -> None:
  """The spec's codes: SOFTMAX 1, LOGISTIC 2, SOFTMAX_ZERO 3. onnxruntime 1.32 reads 1 as LOGISTIC and 2 as SOFTMAX (its
  own enum's order; and it skips LOGISTIC for one target, onnxruntime issues 26596, 24862), so the reference here is its
  untransformed scores under the spec's transform; SOFTMAX_ZERO (the same code in both) is also checked against it."""
  attrs = _forest([3, 2, 4], [0, 1, 3], 3, seed=11)
  x = _x()
  (raw,) = ort.InferenceSession(_model(attrs), providers=["CPUExecutionProvider"]).run(None, {"x": x})
  (got,) = konnx.load(_model(attrs, post_transform=transform), dims={"N": (1, 64)}).run({"x": x}).values()
  want = {1: _softmax(raw), 2: 1 / (1 + np.exp(-raw)), 3: _softmax_zero(raw)}[transform]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  if transform == 3: _same(_model(attrs, post_transform=transform), x)


@pytest.mark.parametrize("mode", range(7))
def test_each_mode_alone(mode: int) -> None:
  _same(_model(_forest([3, 3], [mode], 1, seed=mode)), _x())


def test_a_double_input_compares_in_double() -> None:
  attrs = _forest([3, 2], [0, 1, 6], 2, seed=3, dtype=np.float64)
  x = _x(dtype=np.float64)
  x[1, attrs["nodes_featureids"][0]] = attrs["nodes_splits"].double_data[0] + 1e-12  # a value a float32 compare would round onto the threshold
  _same(_model(attrs, np.float64), x, tol=1e-12)


def test_refusals_name_what_is_wrong() -> None:
  attrs = _forest([2], [0], 1, seed=0)
  def load(data: bytes) -> None: konnx.load(data, dims={"N": (1, 8)})
  with pytest.raises(ONNXError, match="aggregate_function 4 is not one of 0-3"): load(_model(attrs, aggregate_function=4))
  with pytest.raises(ONNXError, match="tree_roots"): load(_model(dict(attrs, tree_roots=[7])))
  with pytest.raises(ONNXError, match="true branch leads outside"): load(_model(dict(attrs, nodes_truenodeids=[5] + attrs["nodes_truenodeids"][1:])))
  with pytest.raises(ONNXError, match="target outside"): load(_model(dict(attrs, leaf_targetids=[1] * len(attrs["leaf_targetids"]))))
