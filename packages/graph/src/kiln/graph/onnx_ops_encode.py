"""ai.onnx.ml's encoders and fillers that scikit-learn pipelines put before a model (skl2onnx: LabelEncoder, OneHotEncoder,
SimpleImputer, ColumnTransformer's FeatureVectorizer): LabelEncoder, OneHotEncoder, Imputer and FeatureVectorizer, built
from kiln.graph Tensor ops and registered in onnx_ops.OPS. Numbers only: a string key, value, category or input is
refused by name (kiln has no string tensors).

Semantics follow onnxruntime's kernels:
- LabelEncoder maps each element equal to a key to that key's value, others to the default (opset 2: -1, -0.0; opset 4
  also default_tensor); of two equal keys the first counts; from opset 4 a NaN key matches a NaN element (before, none).
- OneHotEncoder gives (..., categories) float: 1 where an element (a float truncated to an integer, as onnxruntime casts
  it) equals the category; of two equal categories the last counts. With zeros=0 an element in no category is an error
  at run time (a checked gather's IndexOutOfRangeError naming the node), as onnxruntime fails the run.
- Imputer replaces each element equal to replaced_value (NaN: each NaN) by its feature's imputed value (or the one value).
- FeatureVectorizer concatenates its inputs' columns as float (N, sum of inputdimensions): an input with fewer columns
  than its dimension is padded with zeros, one with more is cut, as onnxruntime copies them."""
from __future__ import annotations

from typing import Any

import numpy as np

from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.onnx_ops_ml import as_float32
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes


def _list(n: OnnxNode, name: str, dtype: Any) -> np.ndarray | None:
  """A list attribute as an array of dtype; None where it is not given (an empty list is given)."""
  if name in n.attrs: return np.asarray(n.attr(name), dtype)
  return None


def _no_strings(n: OnnxNode, *names: str) -> None:
  if found := [a for a in names if n.attrs.get(a)]: raise n.error(f"string {found[0]} are not supported: kiln has no string tensors")


def _table(n: OnnxNode, kind: str) -> np.ndarray:
  """LabelEncoder's keys or values: the floats or int64s list, or the `{kind}_tensor` (opset 4)."""
  _no_strings(n, f"{kind}_strings")
  if f"{kind}_tensor" in n.attrs:
    t = n.tensor(f"{kind}_tensor")
    if t.dtype.kind not in "iuf": raise n.error(f"{kind}_tensor of {t.dtype} is not supported (numbers only: kiln has no string tensors)")
    return t.reshape(-1)
  found = [a for a in (f"{kind}_floats", f"{kind}_int64s") if a in n.attrs]
  if len(found) != 1: raise n.error(f"needs exactly one of {kind}_floats, {kind}_int64s, {kind}_tensor")
  return np.asarray(n.attr(found[0]), np.float32 if found[0].endswith("floats") else np.int64)


def _label_encoder(n: OnnxNode) -> Value:
  _no_strings(n, "classes_strings", "default_string")
  keys, values = _table(n, "keys"), _table(n, "values")
  if len(keys) != len(values): raise n.error(f"{len(keys)} keys for {len(values)} values")
  if len(keys) == 0: raise n.error("has no keys")
  if "default_tensor" in n.attrs: default = np.asarray(n.tensor("default_tensor")).reshape(-1)[:1].astype(values.dtype)
  else: default = np.asarray([n.attr("default_float", -0.0) if values.dtype.kind == "f" else n.attr("default_int64", -1)], values.dtype)
  x = n.t(0)
  if x.dtype.is_float != (keys.dtype.kind == "f"): raise n.error(f"input of {x.dtype.name} for keys of {keys.dtype}")
  keys = keys.astype(np.float32 if keys.dtype.kind == "f" and x.dtype == dtypes.float32 else keys.dtype)
  nan_key = keys.dtype.kind == "f" and n.opset >= 4 and bool(np.isnan(keys).any())
  k = len(keys)
  iota = Tensor(np.arange(k, dtype=np.int64))
  hit = x.unsqueeze(-1).eq(Tensor(keys).cast(x.dtype))
  if nan_key: hit = hit | (x.ne(x).unsqueeze(-1) & Tensor(np.isnan(keys)))
  first = hit.where(iota, Tensor.full((), k, np.int64)).min(-1)  # the first matching key, k for none
  table = Tensor(np.concatenate([values, default]))
  return table.gather(first, 0, in_range=True)


def _one_hot_encoder(n: OnnxNode) -> Value:
  _no_strings(n, "cats_strings")
  cats = _list(n, "cats_int64s", np.int64)
  if cats is None or len(cats) == 0: raise n.error("needs cats_int64s")
  x = n.t(0)
  if x.ndim > 2: raise n.error(f"input of rank {x.ndim}: onnxruntime takes at most 2")
  if x.dtype.is_bool: raise n.error("a bool input is not supported")
  xi = x if x.dtype == dtypes.int64 else x.cast(dtypes.int64)  # floats truncate toward 0, as onnxruntime's cast
  c = len(cats)
  last = np.array([i == max(np.nonzero(cats == v)[0]) for i, v in enumerate(cats)])  # the index a category's value maps to
  hit = xi.unsqueeze(-1).eq(Tensor(cats)) & Tensor(last)
  if int(n.attr("zeros", 1)): return hit.where(1.0, 0.0)
  # an element in no category gathers row c of the c x c identity: the checked gather fails the run, naming the node
  at = hit.where(Tensor(np.arange(c, dtype=np.int64)), Tensor.full((), -1, np.int64)).max(-1)
  return Tensor(np.eye(c, dtype=np.float32)).gather((at < 0).where(c, at), 0, name=f"node {n.name} ({n.op}): an element in no category")


def _imputer(n: OnnxNode) -> Value:
  x = n.t(0)
  floats, ints = _list(n, "imputed_value_floats", np.float32), _list(n, "imputed_value_int64s", np.int64)
  if (floats is None or not len(floats)) == (ints is None or not len(ints)):
    raise n.error("needs exactly one of imputed_value_floats and imputed_value_int64s")
  imputed = floats if floats is not None and len(floats) else ints
  assert imputed is not None
  if x.dtype.is_float != (imputed.dtype.kind == "f"): raise n.error(f"input of {x.dtype.name} for imputed values of {imputed.dtype}")
  if not x.ndim or imputed.size not in (1, x.shape[-1]):
    raise n.error(f"{imputed.size} imputed values for {x.shape[-1] if x.ndim else 0} features (needs 1 or one a feature)")
  fill = Tensor(imputed).cast(x.dtype)
  if x.dtype.is_float:
    r = float(n.attr("replaced_value_float", 0.0))
    return (x.ne(x) if np.isnan(r) else x.eq(r)).where(fill, x)
  return x.eq(int(n.attr("replaced_value_int64", 0))).where(fill, x)


def _feature_vectorizer(n: OnnxNode) -> Value:
  widths = [int(d) for d in n.attr("inputdimensions", [])]
  if len(widths) != len(n.ins): raise n.error(f"inputdimensions has {len(widths)} entries for {len(n.ins)} inputs")
  parts = []
  for i, w in enumerate(widths):
    x = as_float32(n.t(i))
    x = x.reshape(1, -1) if x.ndim == 1 else x
    if x.ndim != 2 or not isinstance(have := x.shape[1], int): raise n.error(f"input {i} must be (N, F) with F known at load")
    if have > w: x = x[:, :w]
    elif have < w: x = x.pad([(0, 0), (0, w - have)])
    parts.append(x)
  return Tensor.cat(parts, 1)


_op("LabelEncoder", _label_encoder, "keys_floats keys_int64s keys_strings keys_tensor values_floats values_int64s values_strings values_tensor "
    "default_float default_int64 default_string default_tensor classes_strings")
_op("OneHotEncoder", _one_hot_encoder, "cats_int64s cats_strings zeros")
_op("Imputer", _imputer, "imputed_value_floats imputed_value_int64s replaced_value_float replaced_value_int64")
_op("FeatureVectorizer", _feature_vectorizer, "inputdimensions")
