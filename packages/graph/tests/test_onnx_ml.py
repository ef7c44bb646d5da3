"""The ai.onnx.ml operators scikit-learn exports put around a linear model (onnx_ops_ml.py), against onnxruntime: a
classifier's labels and scores under each post_transform, one-row (binary) classifiers, a regressor, Normalizer,
Scaler, Binarizer, and ZipMap's list of {label: score} maps; and the typed refusals (string labels, coefficients that do
not fit the features, a node reading a ZipMap's maps, an operator of the domain kiln lacks)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx_case import RNG, f32, onnx, ort

from kiln.graph import ONNXError
from kiln.graph import onnx as konnx

helper = onnx.helper
ML = "ai.onnx.ml"
# PROBIT is onnxruntime's float32 Winitzki erfinv: for a score near 0.5 its two square roots cancel (sqrt(v*v - w) - v,
# v about 4.3, the difference about 1e-5), so an ulp anywhere before (a score's sum order, a log) moves a result near 0
# by up to ~1% of itself, ~1e-4: in onnxruntime as in kiln, unless every operation is bit-identical
PROBIT_TOL = 2e-4


def _model(node: Any, x: np.ndarray, outs: list[Any]) -> bytes:
  g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)], outs)
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
  m.ir_version = 8
  return m.SerializeToString()


def _tensor(name: str, dtype: Any, rank: int | None = None) -> Any:
  """An output of unknown dims (named ones: the checker wants a shape), rank 2 unless given (a label: 1)."""
  rank = rank if rank is not None else 1 if name == "label" else 2
  return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [f"{name}{i}" for i in range(rank)])


def _same(data: bytes, x: np.ndarray, tol: float = 2e-6) -> None:
  want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
  got = list(konnx.load(data).run({"x": x}).values())
  assert len(got) == len(want)
  for g, w in zip(got, want):
    if isinstance(w, list):  # ZipMap's maps
      assert isinstance(g, list) and len(g) == len(w)
      for gm, wm in zip(g, w):
        assert list(gm) == list(wm)
        np.testing.assert_allclose(list(gm.values()), list(wm.values()), rtol=tol, atol=tol)
      continue
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    if w.dtype.kind == "f": np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    else: np.testing.assert_array_equal(g, w)


def _classifier(x: np.ndarray, classes: int, **attrs: Any) -> bytes:
  f = x.shape[-1]
  rng = np.random.default_rng([classes, f])  # the same model whichever tests ran before in this worker
  node = helper.make_node("LinearClassifier", ["x"], ["label", "scores"], domain=ML,
                          coefficients=rng.normal(size=classes * f).astype(np.float32).tolist(),
                          intercepts=rng.normal(size=classes).astype(np.float32).tolist(), **attrs)
  return _model(node, x, [_tensor("label", np.int64), _tensor("scores", np.float32)])


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"])
def test_a_multiclass_classifier_matches_onnxruntime(transform: str) -> None:
  x = np.random.default_rng(0).uniform(-2, 2, (16, 5)).astype(np.float32)  # its own seed: not the module's shared stream
  x[3] = 0  # a row of zero scores but the intercepts
  x[5, 2] = np.nan  # a row of NaN scores: onnxruntime labels it with the first class
  data = _classifier(x, 4, classlabels_ints=[7, 3, 11, 5], post_transform=transform)
  _same(data, x if transform != "PROBIT" else x * 0.05, tol=PROBIT_TOL if transform == "PROBIT" else 2e-6)


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "PROBIT"])
@pytest.mark.parametrize("labels", [[4, 9], []])
def test_a_one_row_classifier_labels_by_the_sign(labels: list[int], transform: str) -> None:
  x = np.random.default_rng(1).uniform(-2, 2, (12, 3)).astype(np.float32)  # its own seed (PROBIT: see PROBIT_TOL)
  if transform == "PROBIT" and labels:
    with pytest.raises(ONNXError, match="PROBIT with one row"): konnx.load(_classifier(x, 1, classlabels_ints=labels, post_transform=transform))
    return
  data = _classifier(x, 1, classlabels_ints=labels, post_transform=transform) if labels else _classifier(x, 1, post_transform=transform)
  _same(data, x * 0.05 if transform == "PROBIT" else x, tol=PROBIT_TOL if transform == "PROBIT" else 1e-5)


def test_the_classifier_takes_one_row_and_other_input_types() -> None:
  _same(_classifier(f32(6), 3, classlabels_ints=[0, 1, 2]), f32(6))
  xd = RNG.normal(size=(5, 4))
  _same(_classifier(xd, 3, classlabels_ints=[0, 1, 2], post_transform="SOFTMAX"), xd, tol=1e-5)
  xi = RNG.integers(-3, 4, size=(5, 4)).astype(np.int64)
  _same(_classifier(xi, 3, classlabels_ints=[0, 1, 2]), xi, tol=1e-5)


def test_a_regressor_matches_onnxruntime() -> None:
  x = f32(10, 6)
  node = helper.make_node("LinearRegressor", ["x"], ["y"], domain=ML, targets=2,
                          coefficients=RNG.normal(size=12).astype(np.float32).tolist(), intercepts=[0.5, -1.0])
  _same(_model(node, x, [_tensor("y", np.float32)]), x)


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer(norm: str) -> None:
  x = f32(8, 5, lo=0.1, hi=3)
  _same(_model(helper.make_node("Normalizer", ["x"], ["y"], domain=ML, norm=norm), x, [_tensor("y", np.float32)]), x)


def test_scaler_and_binarizer() -> None:
  x = f32(7, 3)
  _same(_model(helper.make_node("Scaler", ["x"], ["y"], domain=ML, offset=[0.5, -1.0, 2.0], scale=[2.0, 0.25, 1.5]), x,
               [_tensor("y", np.float32)]), x)
  _same(_model(helper.make_node("Scaler", ["x"], ["y"], domain=ML, offset=[0.5], scale=[3.0]), x, [_tensor("y", np.float32)]), x)
  _same(_model(helper.make_node("Binarizer", ["x"], ["y"], domain=ML, threshold=0.3), x, [_tensor("y", np.float32)]), x)


def _pipeline(x: np.ndarray, keys: dict[str, Any]) -> bytes:
  """scikit-learn's logistic regression as skl2onnx writes it: classifier, L1 normalizer, ZipMap."""
  f = x.shape[1]
  nodes = [helper.make_node("LinearClassifier", ["x"], ["label", "p"], domain=ML, classlabels_ints=[0, 1, 2], post_transform="LOGISTIC",
                            coefficients=RNG.normal(size=3 * f).astype(np.float32).tolist(), intercepts=[0.1, 0.2, -0.3]),
           helper.make_node("Normalizer", ["p"], ["pn"], domain=ML, norm="L1"),
           helper.make_node("ZipMap", ["pn"], ["probabilities"], domain=ML, **keys)]
  key_type = onnx.TensorProto.INT64 if "classlabels_int64s" in keys else onnx.TensorProto.STRING
  scores = helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)
  maps = helper.make_value_info("probabilities", helper.make_sequence_type_proto(helper.make_map_type_proto(key_type, scores)))
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)], [_tensor("label", np.int64), maps])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
  m.ir_version = 8
  return m.SerializeToString()


@pytest.mark.parametrize("keys", [{"classlabels_int64s": [0, 1, 2]}, {"classlabels_strings": ["setosa", "versicolor", "virginica"]}])
def test_a_logistic_regression_pipeline_gives_onnxruntimes_maps(keys: dict[str, Any]) -> None:
  x = f32(9, 4)
  _same(_pipeline(x, keys), x)
  km = konnx.load(_pipeline(x, keys))
  got = km.run({"x": x})["probabilities"]
  assert isinstance(got, list) and all(isinstance(m, dict) for m in got)
  with pytest.raises(ONNXError, match="ZipMap output is a list of maps"):
    km.run({"x": x}, out={"probabilities": np.zeros((9, 3), np.float32)})


def test_refusals_name_what_is_wrong() -> None:
  x = f32(4, 3)
  with pytest.raises(ONNXError, match="string class labels"):
    konnx.load(_classifier(x, 2, classlabels_strings=["a", "b"]))
  node = helper.make_node("LinearClassifier", ["x"], ["label", "scores"], domain=ML, classlabels_ints=[0, 1, 2],
                          coefficients=[0.5] * 12, intercepts=[0.0, 0.0, 0.0])  # 4 features' worth for 3 features
  with pytest.raises(ONNXError, match="12 coefficients for 3 outputs of 3 features"):
    konnx.load(_model(node, x, [_tensor("label", np.int64), _tensor("scores", np.float32)]))
  zm = helper.make_node("ZipMap", ["x"], ["m"], domain=ML, classlabels_int64s=[0, 1, 2])
  reader = helper.make_node("Identity", ["m"], ["y"])
  g = helper.make_graph([zm, reader], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)], [_tensor("y", np.float32)])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
  with pytest.raises(ONNXError, match="sequence of maps"):
    konnx.load(m.SerializeToString())
  mapper = helper.make_node("CategoryMapper", ["x"], ["y"], domain=ML)
  with pytest.raises(ONNXError, match="CategoryMapper of domain 'ai.onnx.ml' is not supported"):
    konnx.load(_model(mapper, x, [_tensor("y", np.int64)]))


def test_array_feature_extractor_looks_labels_up() -> None:
  """A classifier's label as scikit-learn's SGD export computes it: its classes (a constant) at the argmax (computed)."""
  x = f32(6, 4)
  classes = helper.make_tensor("classes", onnx.TensorProto.INT64, [4], [10, 20, 30, 40])
  nodes = [helper.make_node("ArgMax", ["x"], ["am"], axis=1),
           helper.make_node("ArrayFeatureExtractor", ["classes", "am"], ["label"], domain=ML)]
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)], [_tensor("label", np.int64, 2)],
                        [classes])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
  m.ir_version = 8
  _same(m.SerializeToString(), x)
  # the other way round: computed X, constant indices (a column subset)
  cols = helper.make_tensor("cols", onnx.TensorProto.INT64, [3], [3, 0, 2])
  g = helper.make_graph([helper.make_node("ArrayFeatureExtractor", ["x", "cols"], ["y"], domain=ML)], "g",
                        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)], [_tensor("y", np.float32)], [cols])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
  m.ir_version = 8
  _same(m.SerializeToString(), x)
  bad = helper.make_tensor("cols", onnx.TensorProto.INT64, [2], [1, 4])
  m.graph.initializer[0].CopyFrom(bad)
  with pytest.raises(ONNXError, match=r"index 4 is out of range \[0, 4\)"):
    konnx.load(m.SerializeToString())
