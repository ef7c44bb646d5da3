"""ai.onnx.ml's LabelEncoder, OneHotEncoder, Imputer and FeatureVectorizer (onnx_ops_encode.py) against onnxruntime:
numeric keys and values of each kind, defaults, repeated keys and categories, NaN keys (opset 4) and NaN to impute, a
float input truncated to its category, an unknown category under zeros=0 (a run-time error in both), padded and cut
vectorizer inputs; and the typed refusals of strings."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx_case import onnx, ort

from kiln.graph import ONNXError
from kiln.graph import onnx as konnx
from kiln.graph.errors import IndexOutOfRangeError

helper = onnx.helper
ML = "ai.onnx.ml"


def _model(op: str, ins: dict[str, np.ndarray], out_dtype: Any, ml_opset: int = 2, **attrs: Any) -> bytes:
  node = helper.make_node(op, list(ins), ["y"], domain=ML, **attrs)
  vals = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in ins.items()]
  rank = 2 if op == "FeatureVectorizer" else next(iter(ins.values())).ndim + (op == "OneHotEncoder")
  out = helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(np.dtype(out_dtype)), [f"y{i}" for i in range(rank)])
  m = helper.make_model(helper.make_graph([node], "g", vals, [out]), opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)])
  m.ir_version = 8
  return m.SerializeToString()


def _same(data: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
  (want,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
  (got,) = konnx.load(data).run(feeds).values()
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
  np.testing.assert_array_equal(got, want)
  return got


@pytest.mark.parametrize("keys,values", [("int64s", "int64s"), ("int64s", "floats"), ("floats", "int64s"), ("floats", "floats")])
def test_label_encoder_maps_numbers(keys: str, values: str) -> None:
  kv = {"int64s": [3, 7, -2, 7, 0], "floats": [3.0, 7.5, -2.0, 7.5, 0.0]}
  vv = {"int64s": [10, 20, 30, 40, 50], "floats": [0.5, 1.5, 2.5, 3.5, 4.5]}
  x = np.array([[3, 7, 1, -2], [0, 0, 9, 7]], np.int64) if keys == "int64s" else np.array([[3, 7.5, 1, -2], [0, -0.0, np.nan, 7.5]], np.float32)
  _same(_model("LabelEncoder", {"x": x}, np.int64 if values == "int64s" else np.float32,
               **{f"keys_{keys}": kv[keys], f"values_{values}": vv[values]}), {"x": x})


def test_label_encoder_defaults_and_nan_keys_in_opset_4() -> None:
  x = np.array([1.0, np.nan, 2.0, 5.0], np.float32)
  keys = helper.make_tensor("k", onnx.TensorProto.FLOAT, [3], [1.0, np.nan, 2.0])
  _same(_model("LabelEncoder", {"x": x}, np.int64, 4, keys_tensor=keys, values_int64s=[4, 5, 6], default_int64=-9), {"x": x})
  default = helper.make_tensor("d", onnx.TensorProto.FLOAT, [1], [42.0])
  _same(_model("LabelEncoder", {"x": x}, np.float32, 4, keys_floats=[1.0, 2.0], values_floats=[0.25, 0.75], default_tensor=default), {"x": x})


def test_a_nan_key_matches_nothing_before_opset_4() -> None:
  """Opset 2 (keys in a plain map): NaN equals no key, so a NaN element takes the default. The node's opset is its
  domain's (ai.onnx.ml 2 here), not the model's default domain's (17), which once made this take opset 4's rule."""
  x = np.array([1.0, np.nan, 2.0], np.float32)
  got = _same(_model("LabelEncoder", {"x": x}, np.int64, 2, keys_floats=[1.0, float("nan")], values_int64s=[4, 5]), {"x": x})
  assert got.tolist() == [4, -1, -1]


@pytest.mark.parametrize("dtype", [np.int64, np.float32])
def test_one_hot_encoder(dtype: Any) -> None:
  x = np.array([[1, 4, 9], [4, -3, 2]], dtype) if dtype == np.int64 else np.array([[1.7, 4.2, 9.0], [4.0, -3.9, -0.5]], np.float32)
  _same(_model("OneHotEncoder", {"x": x}, np.float32, 1, cats_int64s=[4, 1, -3, 2, 4]), {"x": x})  # 4 twice: the last counts


def test_one_hot_encoder_without_zeros_fails_the_run_on_an_unknown_category() -> None:
  known, unknown = np.array([[1, 2], [2, 1]], np.int64), np.array([[1, 5]], np.int64)
  data = _model("OneHotEncoder", {"x": known}, np.float32, 1, cats_int64s=[1, 2], zeros=0)
  _same(data, {"x": known})
  m = konnx.load(_model("OneHotEncoder", {"x": unknown}, np.float32, 1, cats_int64s=[1, 2], zeros=0))
  with pytest.raises(IndexOutOfRangeError, match="no category"): m.run({"x": unknown})
  with pytest.raises(Exception, match="Unknown Category"):
    ort.InferenceSession(_model("OneHotEncoder", {"x": unknown}, np.float32, 1, cats_int64s=[1, 2], zeros=0),
                         providers=["CPUExecutionProvider"]).run(None, {"x": unknown})


def test_imputer() -> None:
  x = np.array([[1.0, np.nan, 3.0], [np.nan, 5.0, 0.0]], np.float32)
  _same(_model("Imputer", {"x": x}, np.float32, 1, imputed_value_floats=[9.0, 8.0, 7.0], replaced_value_float=np.nan), {"x": x})
  _same(_model("Imputer", {"x": x}, np.float32, 1, imputed_value_floats=[-1.0], replaced_value_float=0.0), {"x": x})
  xi = np.array([[1, 0, 3], [0, 5, 0]], np.int64)
  _same(_model("Imputer", {"x": xi}, np.int64, 1, imputed_value_int64s=[7, 8, 9], replaced_value_int64=0), {"x": xi})


def test_feature_vectorizer_pads_and_cuts() -> None:
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  b = np.array([[7, 8], [9, 10]], np.float32)
  c = np.array([[0.5, 1.5, 2.5, 3.5], [4.5, 5.5, 6.5, 7.5]], np.float32)
  feeds = {"a": a, "b": b, "c": c}
  _same(_model("FeatureVectorizer", feeds, np.float32, 1, inputdimensions=[3, 4, 2]), feeds)
  ints = {"a": a.astype(np.int64), "b": b.astype(np.int64)}  # one input type for all (onnxruntime's), the output float
  _same(_model("FeatureVectorizer", ints, np.float32, 1, inputdimensions=[3, 2]), ints)


def test_strings_are_refused_by_name() -> None:
  x = np.array([1, 2], np.int64)
  with pytest.raises(ONNXError, match="string values_strings"):
    konnx.load(_model("LabelEncoder", {"x": x}, np.int64, keys_int64s=[1], values_strings=["a"]))
  with pytest.raises(ONNXError, match="string cats_strings"):
    konnx.load(_model("OneHotEncoder", {"x": x}, np.float32, 1, cats_strings=["a"]))
  with pytest.raises(ONNXError, match="1 keys for 2 values"):
    konnx.load(_model("LabelEncoder", {"x": x}, np.int64, keys_int64s=[1], values_int64s=[1, 2]))
