"""ai.onnx.ml's SVMClassifier and SVMRegressor (libsvm's models: scikit-learn's SVC, NuSVC, SVR, NuSVR and OneClassSVM as
skl2onnx exports them), built from kiln.graph Tensor ops and registered in onnx_ops.OPS.

Semantics follow onnxruntime's kernels, the reference users compare with:
- The kernel of a row x with each support vector v (kernel_params = [gamma, coef0, degree]): LINEAR x.v, POLY
  (gamma x.v + coef0)^degree, RBF exp(-gamma |x - v|^2) (summed as squared differences, as onnxruntime does, not as
  |x|^2 - 2 x.v + |v|^2, which cancels), SIGMOID tanh(gamma x.v + coef0).
- Without support vectors (liblinear's layout) every output's score is x.coefficients[c] + rho[0] (the first rho for
  every class, as onnxruntime reads it).
- A classifier with support vectors takes one decision per pair of classes i < j (in order):
  d = sum over class i's vectors of coefficients[j - 1, v] K(x, v) + sum over class j's of coefficients[i, v] K(x, v)
  + rho[pair], a vote for i where d > 0, else for j. The label is the class with the most votes (the first of a tie).
  Scores: the decisions, post-transformed when there are three classes or more; two classes' single decision as
  [-d, d] under NONE, [logistic(-d), logistic(d)] under LOGISTIC and [1 - d, d] under SOFTMAX and SOFTMAX_ZERO
  (onnxruntime 1.32's outputs; PROBIT is refused: onnxruntime's output there is not a function of the row). With prob_a
  and prob_b, Platt's pairwise probabilities r = clip(1 - logistic(d A + B), 1e-7, 1 - 1e-7) are coupled into class
  probabilities by libsvm's iterative method (Wu, Lin and Weng 2004) as onnxruntime runs it, then post-transformed
  (_coupled).
- A regressor: K(x, v) . coefficients + rho[0], or x . coefficients + rho[0] without support vectors; one_class maps a
  score over 0 to 1 and the rest to -1.

A pair's decision is summed in double from float products, as onnxruntime sums it (_decisions); other sums run in kiln's
order, so a coupling whose error sits at the stopping bound may take one round more or less than onnxruntime's."""
from __future__ import annotations

import numpy as np

from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.onnx_ops_ml import float_list, int_list, label_of, post_transformed, rows_of
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

KERNELS = ("LINEAR", "POLY", "RBF", "SIGMOID")
COUPLING_ROUNDS = 100  # libsvm's and onnxruntime's bound on the coupling's rounds
MAX_COUPLED_CLASSES = 32  # the coupling unrolls classes^2 terms a round into each round's kernel: more is refused by name
PROB_CLIP = 1e-7


def _kernel(n: OnnxNode, x: Tensor, vectors: np.ndarray) -> Tensor:
  """K(x, v) for every row of x (N, F) and every vector (V, F): (N, V)."""
  kind = n.attr("kernel_type", "LINEAR")
  if kind not in KERNELS: raise n.error(f"kernel_type {kind!r} is not one of {', '.join(KERNELS)}")
  params = float_list(n, "kernel_params")
  if len(params) not in (0, 3): raise n.error(f"kernel_params has {len(params)} values (needs gamma, coef0, degree)")
  gamma, coef0, degree = (float(v) for v in params) if len(params) else (0.0, 0.0, 0.0)
  if kind == "RBF":
    d = x.unsqueeze(1) - Tensor(vectors).unsqueeze(0)
    return ((d * d).sum(2) * -gamma).exp()
  dot = x @ Tensor(np.ascontiguousarray(vectors.T))
  if kind == "LINEAR": return dot
  g = dot * gamma + coef0
  if kind == "SIGMOID": return g.tanh()
  return g * g if degree == 2 else g * g * g if degree == 3 else g.pow(degree)


def _features(n: OnnxNode, x: Tensor, count: int, what: str) -> None:
  if not isinstance(f := x.shape[1], int): raise n.error("the feature dim must be known at load")
  if f != count: raise n.error(f"input has {f} features; the {what} have {count}")


def _support(n: OnnxNode, vectors: int) -> np.ndarray:
  """The support vectors as (V, F), F from their count (onnxruntime's)."""
  sv = float_list(n, "support_vectors")
  if vectors < 1 or sv.size == 0 or sv.size % vectors: raise n.error(f"{sv.size} support_vectors values do not split into {vectors} vectors")
  return sv.reshape(vectors, -1)


def _pairs(c: int) -> list[tuple[int, int]]: return [(i, j) for i in range(c - 1) for j in range(i + 1, c)]


def _decisions(n: OnnxNode, k: Tensor, per_class: list[int], coef: np.ndarray, rho: np.ndarray) -> Tensor:
  """The (N, pairs) one-against-one decisions from the kernels k (N, V), in float64: each kernel times its coefficient
  in a (V, pairs) table of each pair's two blocks (zero elsewhere), rounded to float32 as onnxruntime's float product
  is, then summed in double with rho, as onnxruntime sums (a float32 sum of large kernels, a linear kernel's, moves the
  decisions by ~1e-5 of themselves)."""
  c, v = len(per_class), int(sum(per_class))
  if coef.size < (c - 1) * v: raise n.error(f"{coef.size} coefficients for {c} classes of {v} support vectors (needs {(c - 1) * v})")
  coef = coef[:(c - 1) * v].reshape(c - 1, v)
  start = np.concatenate([[0], np.cumsum(per_class)]).astype(int)
  pairs = _pairs(c)
  if len(rho) < len(pairs): raise n.error(f"rho has {len(rho)} values for {len(pairs)} pairs of classes")
  table = np.zeros((v, len(pairs)), np.float32)
  for p, (i, j) in enumerate(pairs):
    table[start[i]:start[i + 1], p] = coef[j - 1, start[i]:start[i + 1]]
    table[start[j]:start[j + 1], p] = coef[i, start[j]:start[j + 1]]
  terms = (k.unsqueeze(2) * Tensor(table).unsqueeze(0)).cast(dtypes.float64)  # (N, V, pairs): float products, then double
  return terms.sum(1) + Tensor(rho[:len(pairs)].astype(np.float64))


def _votes(d: Tensor, c: int) -> Tensor:
  """(N, C) votes: pair (i, j)'s to i where its (double) decision is over 0, else to j."""
  pairs = _pairs(c)
  to_i, to_j = np.zeros((len(pairs), c), np.float32), np.zeros((len(pairs), c), np.float32)
  for p, (i, j) in enumerate(pairs): to_i[p, i], to_j[p, j] = 1.0, 1.0
  won = (d > 0).where(1.0, 0.0)
  return won @ Tensor(to_i) + (1.0 - won) @ Tensor(to_j)


def _pair_probability(d: Tensor, a: np.ndarray, b: np.ndarray) -> Tensor:
  """onnxruntime's sigmoid_probability, clipped: 1 - logistic(d A + B), its logistic mirrored for negative arguments."""
  v = d * Tensor(a) + Tensor(b)
  t = (1.0 + (-v.abs()).exp()).reciprocal()
  logistic = (v < 0).where(1.0 - t, t)
  return (1.0 - logistic).maximum(PROB_CLIP).minimum(1.0 - PROB_CLIP)


def _coupled(r: Tensor, c: int) -> Tensor:
  """Class probabilities (N, C) from the pairwise ones r (N, pairs), by libsvm's multiclass_probability as onnxruntime
  runs it: Q from r, p from 1/C, then rounds of one Gauss-Seidel pass over the classes until every |Qp_i - pQp| is under
  0.005 / C, at most COUPLING_ROUNDS. Each row stops on its own: a round leaves a row that has converged as it was (its
  check gives the same answer every round after). Columns are kept as separate (N,) tensors so that each round is one
  elementwise kernel (p realized between rounds) and no term is evaluated at two indices."""
  pairs = _pairs(c)
  col = [r[:, k] for k in range(len(pairs))]
  rr: dict[tuple[int, int], Tensor] = {}
  for k, (i, j) in enumerate(pairs): rr[i, j], rr[j, i] = col[k], 1.0 - col[k]
  q = [[(_sum([rr[j, i] * rr[j, i] for j in range(c) if j != i]) if i == j else -(rr[j, i] * rr[i, j]))
        for j in range(c)] for i in range(c)]
  qs = Tensor.stack([q[i][j] for i in range(c) for j in range(c)], 1).contiguous()
  q = [[qs[:, i * c + j] for j in range(c)] for i in range(c)]
  eps = np.float32(0.005) / np.float32(c)
  pm = Tensor.full((), 1.0 / c).expand((r.shape[0], c)).contiguous()
  for _ in range(COUPLING_ROUNDS):
    p = [pm[:, i] for i in range(c)]
    qp = [_sum([q[i][j] * p[j] for j in range(c)]) for i in range(c)]
    pqp = _sum([p[i] * qp[i] for i in range(c)])
    err = (qp[0] - pqp).abs()
    for i in range(1, c): err = err.maximum((qp[i] - pqp).abs())
    done = err < float(eps)
    for i in range(c):
      diff = (pqp - qp[i]) / q[i][i]
      p[i] = p[i] + diff
      grow = 1.0 + diff
      pqp = (pqp + diff * (diff * q[i][i] + 2.0 * qp[i])) / grow / grow
      qp = [(qp[j] + diff * q[i][j]) / grow for j in range(c)]
      p = [pj / grow for pj in p]
    pm = Tensor.stack([done.where(pm[:, i], p[i]) for i in range(c)], 1).contiguous()
  return pm


def _sum(terms: list[Tensor]) -> Tensor:
  """Terms added left to right (the order onnxruntime's loops add them)."""
  out = terms[0]
  for t in terms[1:]: out = out + t
  return out


def _classifier(n: OnnxNode) -> list[Value]:
  if n.attr("classlabels_strings"): raise n.error("string class labels (classlabels_strings) are not supported: kiln has no string tensors")
  labels = int_list(n, "classlabels_ints")
  c = len(labels)
  if c < 2: raise n.error(f"needs at least two classlabels_ints, got {c}")
  coef, rho = float_list(n, "coefficients"), float_list(n, "rho")
  prob_a, prob_b = float_list(n, "prob_a"), float_list(n, "prob_b")
  if len(prob_a) != len(prob_b): raise n.error(f"prob_a has {len(prob_a)} values and prob_b {len(prob_b)}: they pair up")
  if coef.size == 0 or rho.size == 0: raise n.error("needs coefficients and rho")
  how = n.attr("post_transform", "NONE")
  x = rows_of(n)
  per_class = [int(v) for v in n.attr("vectors_per_class", [])]
  if sum(per_class) == 0: return _linear_mode(n, x, labels, coef, rho, bool(len(prob_a)))
  if len(per_class) != c or min(per_class) < 0: raise n.error(f"vectors_per_class has {len(per_class)} counts for {c} classes")
  sv = _support(n, sum(per_class))
  _features(n, x, sv.shape[1], "support vectors")
  d64 = _decisions(n, _kernel(n, x, sv), per_class, coef, rho)
  label = label_of(_votes(d64, c), labels)
  d = d64.cast(dtypes.float32)
  if len(prob_a):
    npairs = len(_pairs(c))
    if len(prob_a) < npairs: raise n.error(f"prob_a has {len(prob_a)} values for {npairs} pairs of classes")
    if c > MAX_COUPLED_CLASSES: raise n.error(f"probabilities (prob_a) for {c} classes: at most {MAX_COUPLED_CLASSES} are supported")
    return [label, post_transformed(n, _coupled(_pair_probability(d, prob_a[:npairs], prob_b[:npairs]), c))]
  if c > 2: return [label, post_transformed(n, d)]
  if how == "PROBIT": raise n.error("post_transform PROBIT on a two-class classifier without probabilities is not supported")
  s = d.reshape(-1)
  if how == "LOGISTIC": return [label, Tensor.stack([(-s).sigmoid(), s.sigmoid()], 1)]
  return [label, Tensor.stack([-s if how == "NONE" else 1.0 - s, s], 1)]


def _linear_mode(n: OnnxNode, x: Tensor, labels: np.ndarray, coef: np.ndarray, rho: np.ndarray, proba: bool) -> list[Value]:
  """No support vectors: scores x . coefficients[c] + rho[0]; the label the first largest score's, but for two classes
  (onnxruntime's ChooseClass): with every coefficient >= 0 the second where the top score is at least 0.5, else with
  mixed signs the second where it is over 0, else the top score's."""
  c = len(labels)
  if proba: raise n.error("prob_a/prob_b without support vectors (vectors_per_class) are not supported")
  if coef.size % c: raise n.error(f"{coef.size} coefficients do not split into {c} classes")
  w = coef.reshape(c, -1)
  _features(n, x, w.shape[1], "coefficients")
  s = x @ Tensor(np.ascontiguousarray(w.T)) + float(rho[0])
  label = label_of(s, labels)
  if c == 2:
    top = s.max(1)
    second = top >= 0.5 if bool((coef >= 0).all()) else top > 0
    label = second.where(Tensor.full((), int(labels[1]), np.int64), label)
  return [label, post_transformed(n, s)]


def _regressor(n: OnnxNode) -> Value:
  if (how := n.attr("post_transform", "NONE")) != "NONE": raise n.error(f"post_transform {how!r} is not supported (NONE)")
  coef, rho = float_list(n, "coefficients"), float_list(n, "rho")
  if coef.size == 0 or rho.size == 0: raise n.error("needs coefficients and rho")
  x = rows_of(n)
  if (v := int(n.attr("n_supports", 0))) > 0:
    sv = _support(n, v)
    if coef.size < v: raise n.error(f"{coef.size} coefficients for {v} support vectors")
    _features(n, x, sv.shape[1], "support vectors")
    y = _kernel(n, x, sv) @ Tensor(coef[:v].reshape(v, 1)) + float(rho[0])
  else:
    _features(n, x, coef.size, "coefficients")
    y = x @ Tensor(coef.reshape(-1, 1)) + float(rho[0])
  return (y > 0).where(1.0, -1.0) if int(n.attr("one_class", 0)) else y


_COMMON = "coefficients kernel_params kernel_type post_transform rho support_vectors"
_op("SVMClassifier", _classifier, _COMMON + " classlabels_ints classlabels_strings prob_a prob_b vectors_per_class")
_op("SVMRegressor", _regressor, _COMMON + " n_supports one_class")
