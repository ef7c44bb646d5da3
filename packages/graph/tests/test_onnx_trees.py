"""TreeEnsembleClassifier and TreeEnsembleRegressor (onnx_ops_trees.py) against onnxruntime, on forests built here: random
trees of several depths (one unbalanced), every branch mode, NaN features with and without missing_value_tracks_true,
the opset-3 `_as_tensor` attributes, SUM, AVERAGE, MIN and MAX, base values, post transforms; and the typed refusals."""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from onnx_case import RNG, onnx, ort

from kiln.graph import ONNXError
from kiln.graph import onnx as konnx

helper = onnx.helper
ML = "ai.onnx.ml"
F = 5
DIMS = {"N": (1, 8)}


def _forest(depths: list[int], modes: tuple[str, ...] = ("BRANCH_LEQ",), missing: bool = False) -> dict[str, list[Any]]:
  """Trees of the given depths, node ids in breadth-first order; tree 1 (if any) lopsided: its true side stops one level
  early. Thresholds are small integers, so that EQ and NEQ branches meet equal values in integer-valued X."""
  a: dict[str, list[Any]] = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
                                              "nodes_truenodeids", "nodes_falsenodeids", "nodes_missing_value_tracks_true")}
  leaves: list[tuple[int, int]] = []
  for t, depth in enumerate(depths):
    todo, nid = [(0, 0)], 1
    while todo:
      node, level = todo.pop(0)
      leaf = level == depth or (t == 1 and level == depth - 1 and node % 2 == 1)
      a["nodes_treeids"].append(t); a["nodes_nodeids"].append(node)
      a["nodes_featureids"].append(int(RNG.integers(0, F)) if not leaf else 0)
      a["nodes_values"].append(float(RNG.integers(-2, 3)) if not leaf else 0.0)
      a["nodes_modes"].append("LEAF" if leaf else modes[int(RNG.integers(0, len(modes)))])
      a["nodes_missing_value_tracks_true"].append(int(RNG.integers(0, 2)) if missing and not leaf else 0)
      if leaf:
        a["nodes_truenodeids"].append(0); a["nodes_falsenodeids"].append(0)
        leaves.append((t, node))
      else:
        a["nodes_truenodeids"].append(nid); a["nodes_falsenodeids"].append(nid + 1)
        todo += [(nid, level + 1), (nid + 1, level + 1)]
        nid += 2
  a["_leaves"] = leaves
  return a


def _model(op: str, attrs: dict[str, Any], x: np.ndarray, outs: list[Any]) -> bytes:
  node = helper.make_node(op, ["x"], [o.name for o in outs], domain=ML, **attrs)
  g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", F])], outs)
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 3)])
  m.ir_version = 8
  return m.SerializeToString()


def _classifier(forest: dict[str, list[Any]], classes: int, **extra: Any) -> bytes:
  attrs = {k: v for k, v in forest.items() if not k.startswith("_")}
  leaves = forest["_leaves"]
  attrs.update(class_treeids=[t for t, _ in leaves for _ in range(classes)], class_nodeids=[n for _, n in leaves for _ in range(classes)],
               class_ids=[c for _ in leaves for c in range(classes)], class_weights=RNG.uniform(0, 1, len(leaves) * classes).tolist(),
               classlabels_int64s=list(range(10, 10 + classes)))
  attrs.update(extra)
  outs = [helper.make_tensor_value_info("label", onnx.TensorProto.INT64, ["N"]),
          helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", classes])]
  return _model("TreeEnsembleClassifier", attrs, np.zeros((1, F), np.float32), outs)


def _regressor(forest: dict[str, list[Any]], targets: int, **extra: Any) -> bytes:
  attrs = {k: v for k, v in forest.items() if not k.startswith("_")}
  leaves = forest["_leaves"]
  attrs.update(target_treeids=[t for t, _ in leaves for _ in range(targets)], target_nodeids=[n for _, n in leaves for _ in range(targets)],
               target_ids=[c for _ in leaves for c in range(targets)], target_weights=RNG.normal(size=len(leaves) * targets).tolist(),
               n_targets=targets, **extra)
  y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", targets])
  return _model("TreeEnsembleRegressor", attrs, np.zeros((1, F), np.float32), [y])


def _x(rows: int = 40, nan: bool = False) -> np.ndarray:
  x = RNG.integers(-3, 4, (rows, F)).astype(np.float32)  # integer-valued: every comparison with a threshold, equality too
  x[::3] += RNG.uniform(-0.5, 0.5, x[::3].shape).astype(np.float32)
  if nan: x[RNG.uniform(size=x.shape) < 0.2] = np.nan
  return x


def _same(data: bytes, x: np.ndarray) -> None:
  want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
  got = list(konnx.load(data, dims={"N": (1, 64)}).run({"x": x}).values())
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    if w.dtype.kind == "f": np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    else: np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("transform", ["NONE", "SOFTMAX", "LOGISTIC"])
def test_a_forest_classifier_matches_onnxruntime(transform: str) -> None:
  data = _classifier(_forest([3, 4, 2]), 3, post_transform=transform, base_values=[0.1, -0.2, 0.3])
  _same(data, _x())
  # a kernel a level (4), then the scores, the argmax, the labels (and the transform's): the walk's gathers are in range
  # by construction, so no index check kernel (a full reduction to one flag: reduce_1) runs beside them
  names = [k.name for k in konnx.load(data, dims=DIMS).plan.kernels]
  assert names.count("gather_nx3") == 4 and len(names) <= 8 and not any(re.fullmatch(r"reduce_1(x1)*", k) for k in names), names


def test_every_branch_mode_and_missing_values() -> None:
  modes = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ")
  forest = _forest([4, 4, 3], modes, missing=True)
  _same(_classifier(forest, 4), _x(nan=True))
  _same(_regressor(forest, 2), _x(nan=True))


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_a_forest_regressor_matches_onnxruntime(aggregate: str) -> None:
  _same(_regressor(_forest([5, 3, 1, 4]), 2, aggregate_function=aggregate, base_values=[1.5, -0.5]), _x(7))


@pytest.mark.parametrize("aggregate", ["MIN", "MAX"])
def test_min_and_max_over_leaves_that_weigh_some_targets(aggregate: str) -> None:
  """Each leaf weighs a random few of 3 targets, one pair twice: a target takes the least or greatest weight over the trees
  whose reached leaf weighs it (both of a pair's weights among them), 0 where none does; base_values added after."""
  forest = _forest([3, 2, 4])
  leaves = forest["_leaves"]
  picks = [(t, n, c) for t, n in leaves for c in range(3) if RNG.uniform() < 0.4] + [(*leaves[0], 1)]
  attrs = {k: v for k, v in forest.items() if not k.startswith("_")}
  attrs.update(target_treeids=[t for t, _, _ in picks], target_nodeids=[n for _, n, _ in picks], target_ids=[c for _, _, c in picks],
               target_weights=RNG.normal(size=len(picks)).tolist(), n_targets=3, aggregate_function=aggregate, base_values=[0.5, -1.0, 2.0])
  y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])
  _same(_model("TreeEnsembleRegressor", attrs, np.zeros((1, F), np.float32), [y]), _x())


def test_the_opset_3_tensor_attributes() -> None:
  forest = _forest([3, 3])
  values = forest.pop("nodes_values")
  data = _regressor(forest, 1, nodes_values_as_tensor=helper.make_tensor("v", onnx.TensorProto.FLOAT, [len(values)], values))
  _same(data, _x())


def test_refusals_name_what_is_wrong() -> None:
  forest = _forest([2])
  forest["nodes_truenodeids"][0] = 99
  with pytest.raises(ONNXError, match="leads to node 99, which the tree does not have"): konnx.load(_regressor(forest, 1), dims=DIMS)
  forest = _forest([2])
  forest["nodes_truenodeids"][1] = 0  # node 1 goes back to the root: leaf 3 is left the only node none leads to
  with pytest.raises(ONNXError, match="are not reached from their tree's root"): konnx.load(_regressor(forest, 1), dims=DIMS)
  forest = _forest([2])
  forest["nodes_truenodeids"][2] = 1  # two parents for node 1: leaf 5 is a second root
  with pytest.raises(ONNXError, match="tree 0 has 2 roots"): konnx.load(_regressor(forest, 1), dims=DIMS)
  forest = _forest([2])
  forest["nodes_featureids"][0] = F
  with pytest.raises(ONNXError, match=f"a node reads feature {F} of {F}"): konnx.load(_regressor(forest, 1), dims=DIMS)
  with pytest.raises(ONNXError, match="aggregate_function 'MEDIAN' is not one of"):
    konnx.load(_regressor(_forest([2]), 1, aggregate_function="MEDIAN"), dims=DIMS)
  with pytest.raises(ONNXError, match="PROBIT on a binary classifier"):
    konnx.load(_classifier(_forest([2]), 1, classlabels_int64s=[0, 1], post_transform="PROBIT"), dims=DIMS)


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX"])
@pytest.mark.parametrize("weights", ["positive", "mixed"])
def test_a_binary_classifier_with_one_score_column(transform: str, weights: str) -> None:
  """A boosted binary model's form: one weight a leaf, two labels. Positive weights straddling 0.5 and mixed ones
  straddling 0 exercise each label threshold."""
  data = _classifier(_forest([3, 2, 3]), 1, classlabels_int64s=[4, 7], post_transform=transform)
  m = onnx.load_from_string(data)
  w = next(a for a in m.graph.node[0].attribute if a.name == "class_weights")
  vals = RNG.uniform(0.0, 0.35, len(w.floats)) if weights == "positive" else RNG.uniform(-0.3, 0.3, len(w.floats))
  del w.floats[:]
  w.floats.extend(vals.tolist())
  _same(m.SerializeToString(), _x(60))
