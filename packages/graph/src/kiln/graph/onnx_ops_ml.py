"""The ai.onnx.ml operators that scikit-learn exports (skl2onnx) put around a linear model (trees: onnx_ops_trees.py): LinearClassifier,
LinearRegressor, Normalizer, Scaler, Binarizer, ArrayFeatureExtractor (a classifier's label looked up in its classes) and
ZipMap, built from kiln.graph Tensor ops and registered in
onnx_ops.OPS (onnx.py imports this module for that; ML_OPS lists the operators it accepts from that domain).

Semantics follow onnxruntime's kernels, the reference users compare with, where the spec leaves room: a LinearClassifier
with one row of coefficients labels by the sign of its score s; given two class labels its scores are [1 - p, p], p the
logistic of s under LOGISTIC and s itself under any other transform, and without them s alone, untransformed (PROBIT
aside). Otherwise the label is the first largest raw score and the post transform applies to the scores. String class
labels are refused by name: kiln has no string tensors.

ZipMap gives a sequence of maps, one {label: score} per row, which no kernel can hold: its value here is a `ZipMapped`
(the scores and the keys), allowed only as a graph output; Model.run builds the dicts from the scores on the host."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

ML_DOMAIN = "ai.onnx.ml"
ML_OPS = frozenset({"LinearClassifier", "LinearRegressor", "Normalizer", "Scaler", "Binarizer", "ZipMap", "ArrayFeatureExtractor",
                    "TreeEnsembleClassifier", "TreeEnsembleRegressor", "TreeEnsemble",  # onnx_ops_trees.py
                    "SVMClassifier", "SVMRegressor",  # onnx_ops_svm.py
                    "LabelEncoder", "OneHotEncoder", "Imputer", "FeatureVectorizer"})  # onnx_ops_encode.py
SQRT2 = 1.41421356  # onnxruntime's PROBIT constant


@dataclass(frozen=True)
class ZipMapped:
  """ZipMap's output: the (N, C) float scores and the C keys (ints or strings) each row's map takes."""
  scores: Tensor | np.ndarray
  keys: tuple[Any, ...]

  def rows(self, scores: np.ndarray) -> list[dict[Any, float]]:
    """The maps, one a row, of the scores a run computed."""
    return [dict(zip(self.keys, row)) for row in np.asarray(scores, np.float32).reshape(-1, len(self.keys)).tolist()]


def as_float32(x: Tensor) -> Tensor: return x if x.dtype == dtypes.float32 else x.cast(dtypes.float32)


def float_list(n: OnnxNode, name: str) -> np.ndarray:
  """A float list attribute, or its `_as_tensor` form (opset 3), as float32; empty where neither is given."""
  if name + "_as_tensor" in n.attrs: return np.asarray(n.tensor(name + "_as_tensor"), np.float32).reshape(-1)
  return np.asarray(n.attr(name, []), np.float32)


def int_list(n: OnnxNode, name: str) -> np.ndarray:
  """An int list attribute as int64; empty where it is not given."""
  return np.asarray(n.attr(name, []), np.int64)


def rows_of(n: OnnxNode) -> Tensor:
  """Input 0 as float32 rows (N, F): a 1-D input is one row, as onnxruntime reads it."""
  x = n.t(0)
  if x.ndim not in (1, 2): raise n.error(f"input of rank {x.ndim}: needs (N, F) or (F,)")
  x = x.reshape(1, -1) if x.ndim == 1 else x
  return as_float32(x)


def _linear(n: OnnxNode, x: Tensor, count_attr: str | None) -> tuple[Tensor, int]:
  """x @ coefficients.T + intercepts: the (N, C) scores and C. C is the intercepts' count where given (onnxruntime's), else
  `count_attr`'s value, else coefficients over the features."""
  f = x.shape[1]
  if not isinstance(f, int): raise n.error("the feature dim must be known at load")
  coef, inter = float_list(n, "coefficients"), float_list(n, "intercepts")
  c = len(inter) if len(inter) else int(n.attr(count_attr, 1)) if count_attr else len(coef) // max(f, 1)
  if c < 1 or coef.size != c * f:
    raise n.error(f"{coef.size} coefficients for {c} outputs of {f} features (needs {c * f})")
  scores = x @ Tensor(np.ascontiguousarray(coef.reshape(c, f).T))
  return (scores + Tensor(inter) if len(inter) else scores), c


def _probit(s: Tensor) -> Tensor:
  """onnxruntime's PROBIT: sqrt(2) erfinv(2 s - 1), erfinv by Winitzki's approximation (a = 0.147), as it computes it."""
  x = s * 2.0 - 1.0
  sgn = (x < 0).where(-1.0, 1.0)
  ln = ((1.0 - x) * (1.0 + x)).log()
  v = 2.0 / (3.14159 * 0.147) + 0.5 * ln
  return sgn * ((v * v - ln * (1.0 / 0.147)).sqrt() - v).sqrt() * SQRT2


def post_transformed(n: OnnxNode, s: Tensor, how: str | None = None) -> Tensor:
  """s under the node's post_transform (or `how`, where the node gives it another way: TreeEnsemble's codes)."""
  how = how if how is not None else n.attr("post_transform", "NONE")
  if how == "NONE": return s
  if how == "LOGISTIC": return s.sigmoid()
  if how == "SOFTMAX": return s.softmax(-1)
  if how == "SOFTMAX_ZERO":  # a score of (about) zero stays out of the sum and its value is 0 * exp(-max), as onnxruntime does
    m = s.max(-1, keepdims=True)
    zero = s.abs() <= 1e-7
    e = zero.where(s * (-m).exp(), (s - m).exp())
    return e / zero.where(0.0, e).sum(-1, keepdims=True)
  if how == "PROBIT": return _probit(s)
  raise n.error(f"post_transform {how!r} is not one of NONE, LOGISTIC, SOFTMAX, SOFTMAX_ZERO, PROBIT")


def _linear_classifier(n: OnnxNode) -> list[Value]:
  if n.attr("classlabels_strings"): raise n.error("string class labels (classlabels_strings) are not supported: kiln has no string tensors")
  x = rows_of(n)
  scores, c = _linear(n, x, None)
  labels = [int(v) for v in n.attr("classlabels_ints", [])]
  if c == 1:
    neg, pos = (labels[0], labels[1]) if len(labels) == 2 else (0, 1)
    s = scores.reshape(-1)
    label = above(s, 0.0, neg, pos)
    if n.attr("post_transform", "NONE") == "PROBIT":
      if len(labels) == 2: raise n.error("post_transform PROBIT with one row of coefficients and two class labels is not supported")
      return [label, _probit(scores)]
    if len(labels) != 2: return [label, scores]  # the raw scores, whatever the transform (onnxruntime's)
    p = s.sigmoid() if n.attr("post_transform", "NONE") == "LOGISTIC" else s  # the others leave a lone score as it is
    return [label, Tensor.stack([1.0 - p, p], 1)]
  if len(labels) != c: raise n.error(f"{len(labels)} class labels for {c} classes")
  return [label_of(scores, np.asarray(labels, np.int64)), post_transformed(n, scores)]


def above(s: Tensor, threshold: float, neg: int, pos: int) -> Tensor:
  """A one-column classifier's labels: pos where the score is over the threshold, else neg (int64)."""
  return (s > threshold).where(Tensor.full((), pos, np.int64), Tensor.full((), neg, np.int64))


def label_of(scores: Tensor, labels: np.ndarray) -> Tensor:
  """Each row's label: labels[the first largest score's column], labels[0] for a row of NaN (onnxruntime's loop keeps its
  first column when no score compares larger). The column is in range by construction: no run-time index check."""
  c = len(labels)
  iota = Tensor(np.arange(c, dtype=np.int64).reshape(1, c))
  first = scores.eq(scores.max(1, keepdims=True)).where(iota, Tensor.full((), c, np.int64)).min(1)
  return Tensor(labels).gather(first.eq(c).where(0, first), 0, in_range=True)


def _linear_regressor(n: OnnxNode) -> Value:
  if (how := n.attr("post_transform", "NONE")) != "NONE": raise n.error(f"post_transform {how!r} is not supported (NONE)")
  return _linear(n, rows_of(n), "targets")[0]


def _normalizer(n: OnnxNode) -> Value:
  x = n.t(0)
  x = as_float32(x)
  how = n.attr("norm", "MAX")
  if how == "MAX": d = x.max(-1, keepdims=True)
  elif how == "L1": d = x.abs().sum(-1, keepdims=True)
  elif how == "L2": d = (x * x).sum(-1, keepdims=True).sqrt()
  else: raise n.error(f"norm {how!r} is not one of MAX, L1, L2")
  return x / d


def _per_feature(n: OnnxNode, name: str, x: Tensor) -> Tensor:
  v = float_list(n, name)
  if v.size not in (1, x.shape[-1]): raise n.error(f"{name} has {v.size} values for {x.shape[-1]} features (needs 1 or {x.shape[-1]})")
  return Tensor(v)


def _scaler(n: OnnxNode) -> Value:
  x = n.t(0)
  x = as_float32(x)
  return (x - _per_feature(n, "offset", x)) * _per_feature(n, "scale", x)


def _binarizer(n: OnnxNode) -> Value:
  x = n.t(0)
  if not x.dtype.is_float: raise n.error(f"needs a float input, got {x.dtype.name}")
  return (x > float(n.attr("threshold", 0.0))).where(1.0, 0.0).cast(x.dtype)


def _zipmap(n: OnnxNode) -> Any:  # a ZipMapped where a Value goes: onnx.py keeps it out of every other node's inputs
  ints, strs = n.attr("classlabels_int64s"), n.strs("classlabels_strings")
  if bool(ints) == bool(strs): raise n.error("needs exactly one of classlabels_int64s and classlabels_strings")
  keys = tuple(int(k) for k in ints) if ints else tuple(strs)
  v = n.ins[0]
  if v is None: raise n.error("input 0 is missing")
  shape = v.shape
  if len(shape) != 2 or shape[1] != len(keys): raise n.error(f"input {tuple(shape)} needs (N, {len(keys)}): one score a key")
  return ZipMapped(v if isinstance(v, np.ndarray) else as_float32(n.t(0)), keys)


def _array_feature_extractor(n: OnnxNode) -> Value:
  """X[..., Y]: the last axis' entries at the indices Y (flattened), as (1, len(Y)) for a 1-D X (onnxruntime's shapes).
  Indices known at load must be in [0, size) (onnxruntime refuses others); indices computed at run time go through
  Tensor.gather's check (one out of range is an IndexOutOfRangeError naming the node; a negative one counts from the end)."""
  x, y = n.ins[0], n.ins[1] if len(n.ins) > 1 else None
  if x is None or y is None: raise n.error("needs X and Y")
  if (y.dtype.kind not in "iu") if isinstance(y, np.ndarray) else not y.dtype.is_int: raise n.error(f"indices Y must be integers, got {y.dtype}")
  size = x.shape[-1] if x.ndim else None
  if size is None: raise n.error("X must have at least one dim")
  if isinstance(y, np.ndarray) and isinstance(size, int) and y.size and (int(y.min()) < 0 or int(y.max()) >= size):
    raise n.error(f"index {int(y.min()) if int(y.min()) < 0 else int(y.max())} is out of range [0, {size}) of X's last axis")
  if isinstance(x, np.ndarray) and isinstance(y, np.ndarray): out: Value = np.take(x, y.reshape(-1), axis=-1)
  else:
    t = n.t(0)
    idx = Tensor(np.ascontiguousarray(y.reshape(-1))) if isinstance(y, np.ndarray) else n.t(1).reshape(-1)
    out = t.gather(idx, t.ndim - 1, name=f"node {n.name} ({n.op})")
  return out.reshape(1, -1) if x.ndim == 1 else out


_op("ArrayFeatureExtractor", _array_feature_extractor)
_op("LinearClassifier", _linear_classifier, "classlabels_ints classlabels_strings coefficients intercepts multi_class post_transform")
_op("LinearRegressor", _linear_regressor, "coefficients intercepts post_transform targets")
_op("Normalizer", _normalizer, "norm")
_op("Scaler", _scaler, "offset scale")
_op("Binarizer", _binarizer, "threshold")
_op("ZipMap", _zipmap, "classlabels_int64s classlabels_strings")
