"""scikit-learn models exported by skl2onnx (the way such models reach ONNX), loaded with kiln.graph.onnx and run against
onnxruntime: which load, how far their outputs are from onnxruntime's, and what the others refuse. Bench environment
(scikit-learn, skl2onnx, onnxruntime); nothing is downloaded (iris and a made-up regression problem).

Each model is exported with its batch dim dynamic (skl2onnx leaves it unnamed: kiln gets it as dims={"X:0": (1, 256)}),
and classifiers with predict_proba once with ZipMap (a list of {label: probability} maps, skl2onnx's default) and once
without. A row per export: OK (every output within TOL of onnxruntime's, relative to its largest magnitude; labels
equal), WRONG, REFUSED (kiln's typed error, its first line) or EXPORT-FAIL. Exit status 1 on a WRONG or an untyped error.

  python packages/graph/benchmarks/sklearn_check.py"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

TOL = 1e-5
ROWS = 20


def models() -> dict[str, tuple[Any, np.ndarray]]:
  from sklearn.datasets import load_iris, make_regression
  from sklearn.decomposition import PCA
  from sklearn.ensemble import (
    ExtraTreesRegressor,
    GradientBoostingClassifier,
    GradientBoostingRegressor,
    HistGradientBoostingClassifier,
    RandomForestClassifier,
    RandomForestRegressor,
  )
  from sklearn.impute import SimpleImputer
  from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge, SGDClassifier
  from sklearn.naive_bayes import GaussianNB
  from sklearn.neighbors import KNeighborsClassifier
  from sklearn.neural_network import MLPClassifier
  from sklearn.pipeline import make_pipeline
  from sklearn.preprocessing import Binarizer, MinMaxScaler, Normalizer, OneHotEncoder, StandardScaler
  from sklearn.svm import SVC, SVR, LinearSVC, NuSVC, NuSVR, OneClassSVM
  from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor
  x, y = load_iris(return_X_y=True)
  x = x.astype(np.float32)
  xr, yr = make_regression(100, 6, random_state=0)
  xr = xr.astype(np.float32)
  holes = x.copy()
  holes[::7, 1] = np.nan  # SimpleImputer's NaNs
  cats = (x * 2).astype(np.int64)  # small integer categories for OneHotEncoder
  def fit(m: Any, a: np.ndarray, b: np.ndarray) -> tuple[Any, np.ndarray]: return m.fit(a, b), a
  return {
    "logistic_regression": fit(LogisticRegression(max_iter=500), x, y),
    "logistic_regression_binary": fit(LogisticRegression(max_iter=500), x, (y > 0).astype(int)),
    "standard_scaler+logistic": fit(make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)), x, y),
    "minmax_scaler+logistic": fit(make_pipeline(MinMaxScaler(), LogisticRegression(max_iter=500)), x, y),
    "normalizer+logistic": fit(make_pipeline(Normalizer(), LogisticRegression(max_iter=500)), x, y),
    "binarizer+logistic": fit(make_pipeline(Binarizer(threshold=3.0), LogisticRegression(max_iter=500)), x, y),
    "pca+logistic": fit(make_pipeline(PCA(2), LogisticRegression(max_iter=500)), x, y),
    "linear_svc": fit(LinearSVC(), x, y),
    "sgd_classifier": fit(SGDClassifier(random_state=0), x, y),
    "gaussian_nb": fit(GaussianNB(), x, y),
    "kneighbors": fit(KNeighborsClassifier(), x, y),
    "mlp_classifier": fit(MLPClassifier(max_iter=300, random_state=0), x, y),
    "linear_regression": fit(LinearRegression(), xr, yr),
    "standard_scaler+ridge": fit(make_pipeline(StandardScaler(), Ridge()), xr, yr),
    "decision_tree": fit(DecisionTreeClassifier(random_state=0), x, y),
    "random_forest": fit(RandomForestClassifier(5, random_state=0), x, y),
    "random_forest_100": fit(RandomForestClassifier(100, random_state=0), x, y),
    "gradient_boosting": fit(GradientBoostingClassifier(n_estimators=20, random_state=0), x, y),
    "gradient_boosting_binary": fit(GradientBoostingClassifier(n_estimators=20, random_state=0), x, (y > 0).astype(int)),
    "hist_gradient_boosting": fit(HistGradientBoostingClassifier(max_iter=20, random_state=0), x, y),
    "decision_tree_regressor": fit(DecisionTreeRegressor(random_state=0), xr, yr),
    "random_forest_regressor": fit(RandomForestRegressor(20, random_state=0), xr, yr),
    "extra_trees_regressor": fit(ExtraTreesRegressor(20, random_state=0), xr, yr),
    "gradient_boosting_regressor": fit(GradientBoostingRegressor(n_estimators=30, random_state=0), xr, yr),
    "svc": fit(SVC(probability=True, random_state=0), x, y),
    "svc_no_probability": fit(SVC(random_state=0), x, y),
    "svc_binary": fit(SVC(probability=True, random_state=0), x, (y > 0).astype(int)),
    "svc_binary_no_probability": fit(SVC(random_state=0), x, (y > 0).astype(int)),
    "svc_linear_kernel": fit(SVC(kernel="linear", probability=True, random_state=0), x, y),
    "svc_poly_kernel": fit(SVC(kernel="poly", degree=3, probability=True, random_state=0), x, y),
    "svc_sigmoid_kernel": fit(SVC(kernel="sigmoid", random_state=0), x, y),
    "nu_svc": fit(NuSVC(probability=True, random_state=0), x, y),
    "standard_scaler+svc": fit(make_pipeline(StandardScaler(), SVC(probability=True, random_state=0)), x, y),
    "svr": fit(SVR(), xr, yr),
    "nu_svr": fit(NuSVR(kernel="poly"), xr, yr),
    "one_class_svm": fit(OneClassSVM(gamma="scale"), x, y),
    "simple_imputer+logistic": fit(make_pipeline(SimpleImputer(), LogisticRegression(max_iter=500)), holes, y),
    "one_hot+logistic": fit(make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression(max_iter=500)), cats, y),
  }


def distance(got: Any, want: Any) -> float:
  """The largest difference relative to the reference's largest magnitude; maps compared key by key (keys must agree)."""
  if isinstance(want, list):
    if not isinstance(got, list) or len(got) != len(want) or any(list(g) != list(w) for g, w in zip(got, want)): return float("inf")
    got = np.array([list(g.values()) for g in got])
    want = np.array([list(w.values()) for w in want])
  g, w = np.asarray(got), np.asarray(want)
  if g.shape != w.shape: return float("inf")
  if w.dtype.kind not in "fc": return 0.0 if np.array_equal(g, w) else float("inf")
  return float(np.max(np.abs(g.astype(np.float64) - w))) / max(float(np.max(np.abs(w))), 1e-12) if w.size else 0.0


def check(name: str, model: Any, x: np.ndarray, zipmap: bool | None) -> tuple[str, str]:
  import onnxruntime as ort
  from skl2onnx import to_onnx

  from kiln.graph import onnx as konnx
  from kiln.ir.errors import KilnError
  options = None if zipmap is None else {id(model): {"zipmap": zipmap}}
  try: proto = to_onnx(model, x[:1], options=options, target_opset={"": 17, "ai.onnx.ml": 3})
  except Exception as e: return "EXPORT-FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
  data, inp = proto.SerializeToString(), proto.graph.input[0].name
  ops = ", ".join(sorted({n.op_type for n in proto.graph.node}))
  dims = {(d.dim_param or f"{inp}:{i}"): (1, 256) for i, d in enumerate(proto.graph.input[0].type.tensor_type.shape.dim)
          if not d.HasField("dim_value")}
  feeds = {inp: x[np.linspace(0, len(x) - 1, ROWS).astype(int)]}  # rows across the data set (iris is sorted by class)
  try: got = list(konnx.load(data, dims=dims or None).run(feeds).values())
  except KilnError as e: return "REFUSED", f"{str(e).splitlines()[0][:160]}  [{ops}]"
  want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
  err = max((distance(g, w) for g, w in zip(got, want)), default=0.0) if len(got) == len(want) else float("inf")
  return ("OK" if err <= TOL else "WRONG"), f"error {err:.1e}  [{ops}]"


def main() -> int:
  warnings.filterwarnings("ignore")
  rows, bad = [], 0
  for name, (model, x) in models().items():
    step = model.steps[-1][1] if hasattr(model, "steps") else model
    for zipmap in ((True, False) if hasattr(step, "predict_proba") else (None,)):
      try: status, what = check(name, model, x, zipmap)
      except Exception as e: status, what = "CRASH", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
      bad += status in ("WRONG", "CRASH")
      rows.append(f"| {name}{'' if zipmap is None else f' (zipmap={zipmap})'} | {status} | {what} |")
  print("| model | status | detail |\n|---|---|---|\n" + "\n".join(rows))
  return 1 if bad else 0


if __name__ == "__main__": sys.exit(main())
