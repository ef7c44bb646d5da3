"""ai.onnx.ml's SVMClassifier and SVMRegressor (onnx_ops_svm.py) against onnxruntime: every kernel type, classifiers of
two and more classes with and without Platt probabilities (the pairwise coupling), each post transform, the layout
without support vectors, a regressor with and without them, one_class; and the typed refusals."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx_case import onnx, ort

from kiln.graph import ONNXError
from kiln.graph import onnx as konnx

helper = onnx.helper
ML = "ai.onnx.ml"
KERNEL_PARAMS = {"LINEAR": [0.0, 0.0, 0.0], "POLY": [0.3, 0.5, 3.0], "RBF": [0.4, 0.0, 0.0], "SIGMOID": [0.2, 0.1, 0.0]}


def _model(node: Any, x: np.ndarray, outs: list[tuple[str, Any, int]]) -> bytes:
  ins = [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)]
  vals = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), [f"{name}{i}" for i in range(rank)])
          for name, dt, rank in outs]
  m = helper.make_model(helper.make_graph([node], "g", ins, vals), opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
  m.ir_version = 8
  return m.SerializeToString()


def _same(data: bytes, x: np.ndarray, tol: float = 2e-5) -> list[np.ndarray]:
  want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
  got = list(konnx.load(data).run({"x": x}).values())
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    if w.dtype.kind == "f": np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    else: np.testing.assert_array_equal(g, w)
  return got


def _classifier(x: np.ndarray, per_class: list[int], kernel: str = "RBF", proba: bool = False, seed: int = 0, **attrs: Any) -> bytes:
  rng = np.random.default_rng([seed, len(per_class), x.shape[1]])
  c, v, f = len(per_class), sum(per_class), x.shape[1]
  pairs = c * (c - 1) // 2
  extra: dict[str, Any] = {"prob_a": rng.uniform(-3, -0.5, pairs).tolist(), "prob_b": rng.uniform(-0.3, 0.3, pairs).tolist()} if proba else {}
  node = helper.make_node("SVMClassifier", ["x"], ["label", "scores"], domain=ML, kernel_type=kernel, kernel_params=KERNEL_PARAMS[kernel],
                          vectors_per_class=per_class, support_vectors=rng.normal(size=v * f).astype(np.float32).tolist(),
                          coefficients=rng.normal(size=(c - 1) * v).astype(np.float32).tolist(),
                          rho=rng.normal(size=pairs).astype(np.float32).tolist(),
                          classlabels_ints=list(range(10, 10 + c)), **extra, **attrs)
  return _model(node, x, [("label", np.int64, 1), ("scores", np.float32, 2)])


def _x(rows: int = 24, f: int = 4, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(rows, f)).astype(np.float32)


@pytest.mark.parametrize("kernel", list(KERNEL_PARAMS))
@pytest.mark.parametrize("proba", [False, True])
def test_a_three_class_classifier_matches_onnxruntime(kernel: str, proba: bool) -> None:
  _same(_classifier(_x(), [3, 2, 4], kernel, proba), _x())


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("proba", [False, True])
def test_a_two_class_classifier_follows_onnxruntimes_score_rules(transform: str, proba: bool) -> None:
  _same(_classifier(_x(), [3, 5], "RBF", proba, post_transform=transform), _x())


def test_the_coupling_over_many_classes_and_rows() -> None:
  """Seven classes: the coupling runs its rounds for every row (some converge sooner than others)."""
  x = _x(64, 5, seed=3)
  got = _same(_classifier(x, [2, 3, 1, 2, 4, 2, 3], "RBF", True, seed=5), x)
  np.testing.assert_allclose(got[1].sum(1), 1.0, rtol=1e-5)  # probabilities


def test_a_classifier_without_support_vectors_scores_linearly() -> None:
  """liblinear's layout (no vectors_per_class): x . coefficients[c] + rho[0]; two classes label by onnxruntime's rule."""
  x = _x(20, 3)
  for c, coef in ((3, np.random.default_rng(2).normal(size=9)), (2, np.random.default_rng(3).normal(size=6)),
                  (2, np.random.default_rng(4).uniform(0, 0.3, size=6))):
    node = helper.make_node("SVMClassifier", ["x"], ["label", "scores"], domain=ML, coefficients=coef.astype(np.float32).tolist(),
                            rho=[0.1], kernel_params=[0.0, 0.0, 0.0], classlabels_ints=list(range(c)))
    _same(_model(node, x, [("label", np.int64, 1), ("scores", np.float32, 2)]), x)


@pytest.mark.parametrize("kernel", list(KERNEL_PARAMS))
@pytest.mark.parametrize("one_class", [0, 1])
def test_a_regressor_matches_onnxruntime(kernel: str, one_class: int) -> None:
  x = _x(30, 4, seed=6)
  rng = np.random.default_rng(7)
  node = helper.make_node("SVMRegressor", ["x"], ["y"], domain=ML, kernel_type=kernel, kernel_params=KERNEL_PARAMS[kernel], n_supports=6,
                          support_vectors=rng.normal(size=24).astype(np.float32).tolist(),
                          coefficients=rng.normal(size=6).astype(np.float32).tolist(), rho=[0.25], one_class=one_class)
  _same(_model(node, x, [("y", np.float32, 2)]), x)


def test_a_regressor_without_support_vectors() -> None:
  x = _x(10, 5)
  node = helper.make_node("SVMRegressor", ["x"], ["y"], domain=ML, coefficients=[0.5, -1.0, 2.0, 0.25, 1.5], rho=[-0.5],
                          kernel_params=[0.0, 0.0, 0.0])
  _same(_model(node, x, [("y", np.float32, 2)]), x)


def test_refusals_name_what_is_wrong() -> None:
  x = _x(4, 4)
  def load(**attrs: Any) -> None:
    base: dict[str, Any] = {"kernel_type": "RBF", "kernel_params": [0.5, 0.0, 0.0], "vectors_per_class": [1, 1], "support_vectors": [0.0] * 8,
                            "coefficients": [1.0, -1.0], "rho": [0.0], "classlabels_ints": [0, 1]}
    base.update(attrs)
    base = {k: v for k, v in base.items() if v is not None}
    konnx.load(_model(helper.make_node("SVMClassifier", ["x"], ["label", "scores"], domain=ML, **base), x,
                      [("label", np.int64, 1), ("scores", np.float32, 2)]))
  with pytest.raises(ONNXError, match="string class labels"): load(classlabels_ints=None, classlabels_strings=["a", "b"])
  with pytest.raises(ONNXError, match="kernel_type 'CUBE'"): load(kernel_type="CUBE")
  with pytest.raises(ONNXError, match="input has 4 features; the support vectors have 2"): load(support_vectors=[0.0] * 4)
  with pytest.raises(ONNXError, match="1 coefficients for 2 classes"): load(coefficients=[1.0])
  with pytest.raises(ONNXError, match="prob_a has 1 values and prob_b 0"): load(prob_a=[1.0])
  with pytest.raises(ONNXError, match="PROBIT on a two-class"): load(post_transform="PROBIT")
  with pytest.raises(ONNXError, match="vectors_per_class has 3 counts for 2 classes"): load(vectors_per_class=[1, 0, 1])
