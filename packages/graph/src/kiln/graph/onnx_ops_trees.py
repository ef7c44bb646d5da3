"""ai.onnx.ml's TreeEnsembleClassifier and TreeEnsembleRegressor (decision trees, random forests, boosted trees as scikit-
learn, XGBoost and LightGBM export them), built from kiln.graph Tensor ops and registered in onnx_ops.OPS.

At load every tree's nodes go into constant tables indexed by one global node number: the feature a node reads, its
threshold, its comparison, whether a missing value (NaN) goes the true way, and its two successors (a leaf's are
itself). At run time all trees of all rows walk together, one level per step for the deepest tree's depth: gather each
walker's feature value from X, compare it with its node's threshold, gather the next node. Each step's positions are
realized (a buffer of (rows, trees) node numbers), so a step reads the last one's and no index expression grows with the
depth. Every index is in range by construction (the roots and successors are checked node numbers, the features checked
against X's at load), so the gathers skip kiln's run-time index check (Tensor.gather's in_range; the kernels clamp all
the same). A leaf's weights form a (nodes, outputs) table; the walkers' leaves are gathered from it and summed over the
trees (AVERAGE: divided by their count), base_values added.

Semantics follow onnxruntime: X is compared in float32 (any input type is cast to it, and thresholds are float32, as
onnxruntime compares for float input); a classifier's label is the class of the first largest score, before the post
transform (onnx_ops_ml.post_transformed), which then applies to the scores; a boosted binary classifier's one score
column follows onnxruntime's rules for it (_binary). Refused by name: string class labels, MIN and MAX aggregation, a
regressor's post transform. A NaN feature value takes a node's true way where its missing_value_tracks_true says so,
else the way its comparison gives (false but for BRANCH_NEQ), as onnxruntime."""
from __future__ import annotations

import numpy as np

from kiln.graph.indexing import coords
from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.onnx_ops_ml import above, label_of, post_transformed, rows_of
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "LEAF")
MAX_DEPTH = 4096  # levels walked: a deeper tree is refused (a malformed one may loop; a real one is far shallower)


def _floats(n: OnnxNode, name: str) -> np.ndarray:
  """A float list attribute, or its `_as_tensor` form (opset 3), as float32; empty where neither is given."""
  if name + "_as_tensor" in n.attrs: return np.asarray(n.tensor(name + "_as_tensor"), np.float32).reshape(-1)
  return np.asarray(n.attr(name, []), np.float32)


def _ints(n: OnnxNode, name: str) -> np.ndarray: return np.asarray(n.attr(name, []), np.int64)


class _Forest:
  """The trees of node n as global tables: feature, threshold, mode code, missing-true, next (true, false), roots, depth."""

  def __init__(self, n: OnnxNode):
    tree, node = _ints(n, "nodes_treeids"), _ints(n, "nodes_nodeids")
    feature, value = _ints(n, "nodes_featureids"), _floats(n, "nodes_values")
    modes = [m.decode() if isinstance(m, bytes) else str(m) for m in n.attr("nodes_modes", [])]
    true_id, false_id = _ints(n, "nodes_truenodeids"), _ints(n, "nodes_falsenodeids")
    missing = _ints(n, "nodes_missing_value_tracks_true")
    m = len(tree)
    if m == 0: raise n.error("has no nodes")
    for name, arr in (("nodes_nodeids", node), ("nodes_featureids", feature), ("nodes_values", value), ("nodes_modes", modes),
                      ("nodes_truenodeids", true_id), ("nodes_falsenodeids", false_id)):
      if len(arr) != m: raise n.error(f"{name} has {len(arr)} entries for {m} nodes")
    if len(missing) not in (0, m): raise n.error(f"nodes_missing_value_tracks_true has {len(missing)} entries for {m} nodes")
    if bad := sorted(set(modes) - set(MODES)): raise n.error(f"node mode {bad[0]!r} is not one of {', '.join(MODES)}")
    self.index = {(int(t), int(i)): k for k, (t, i) in enumerate(zip(tree, node))}
    if len(self.index) != m: raise n.error("two nodes share a (tree, node) id")
    self.leaf = np.array([md == "LEAF" for md in modes])
    nxt = np.empty((m, 2), np.int64)
    for k in range(m):
      if self.leaf[k]: nxt[k] = k
      else:
        for j, target in enumerate((true_id[k], false_id[k])):
          if (g := self.index.get((int(tree[k]), int(target)))) is None:
            raise n.error(f"node {int(node[k])} of tree {int(tree[k])} leads to node {int(target)}, which the tree does not have")
          nxt[k, j] = g
    self.next = nxt
    self.feature = np.where(self.leaf, 0, feature).astype(np.int64)
    self.value = np.where(self.leaf, 0, value).astype(np.float32)
    self.mode = np.array([MODES.index(md) for md in modes], np.int64)
    self.missing_true = (missing if len(missing) else np.zeros(m, np.int64)).astype(bool)
    children = {int(g) for k in range(m) if not self.leaf[k] for g in nxt[k]}
    trees = sorted({int(t) for t in tree})
    roots = []
    for t in trees:  # one root a tree (the node no other leads to), every node of the tree reached from it
      mine = [k for k in range(m) if int(tree[k]) == t]
      top = [k for k in mine if k not in children]
      if len(top) != 1: raise n.error(f"tree {t} has {len(top)} roots (nodes no other node leads to); a tree has one")
      roots.append(top[0])
    self.trees, self.roots = trees, np.asarray(roots, np.int64)
    self.depth = self._depth(n)
    if len(self.seen) != m: raise n.error(f"{m - len(self.seen)} nodes are not reached from their tree's root")

  def _depth(self, n: OnnxNode) -> int:
    """Levels from the roots to the deepest leaf; a cycle or a depth over MAX_DEPTH is refused."""
    level, depth = set(int(r) for r in self.roots), 0
    self.seen = set(level)
    while level - {k for k in level if self.leaf[k]}:
      level = {int(self.next[k, j]) for k in level if not self.leaf[k] for j in (0, 1)}
      self.seen |= level
      depth += 1
      if depth > MAX_DEPTH: raise n.error(f"a tree is deeper than {MAX_DEPTH} levels (or loops)")
    return depth

  def leaves(self, n: OnnxNode, prefix: str, outputs: int) -> np.ndarray:
    """The (nodes, outputs) weights of the leaves from the `{prefix}_treeids/_nodeids/_ids/_weights` attributes."""
    t, i, ids, w = _ints(n, f"{prefix}_treeids"), _ints(n, f"{prefix}_nodeids"), _ints(n, f"{prefix}_ids"), _floats(n, f"{prefix}_weights")
    if not len(t) == len(i) == len(ids) == len(w): raise n.error(f"{prefix}_treeids/_nodeids/_ids/_weights differ in length")
    table = np.zeros((len(self.leaf), outputs), np.float32)
    for tt, nn, c, ww in zip(t.tolist(), i.tolist(), ids.tolist(), w.tolist()):
      if (k := self.index.get((tt, nn))) is None: raise n.error(f"a weight names node {nn} of tree {tt}, which does not exist")
      if not 0 <= c < outputs: raise n.error(f"a weight names output {c} of {outputs}")
      table[k, c] += ww
    return table

  def walk(self, n: OnnxNode, x: Tensor) -> Tensor:
    """The leaf (global node number) each row reaches in each tree: (rows, trees) int64."""
    rows, f = x.shape
    label = f"node {n.name} ({n.op})"
    if not isinstance(f, int): raise n.error("the feature dim must be known at load")
    if (bad := self.feature[~self.leaf]).size and not 0 <= int(bad.min()) <= int(bad.max()) < f:
      raise n.error(f"a node reads feature {int(bad.max()) if int(bad.max()) >= f else int(bad.min())} of {f}")
    xs = x.reshape(-1)
    base = coords((rows, len(self.trees)), 0, dtypes.int64) * f  # each walker's row start in X
    cur = Tensor(self.roots.reshape(1, -1)).expand((rows, len(self.trees)))
    feature, value, nxt = Tensor(self.feature), Tensor(self.value), Tensor(self.next.reshape(-1))
    mode = Tensor(self.mode) if len(set(self.mode.tolist()) - {MODES.index("LEAF")}) > 1 else None
    only = MODES[int(self.mode[~self.leaf][0])] if (~self.leaf).any() else "BRANCH_LEQ"
    missing = Tensor(self.missing_true) if self.missing_true.any() else None
    def at(table: Tensor, i: Tensor) -> Tensor: return table.gather(i, 0, name=label, in_range=True)  # built in range: no check
    for _ in range(self.depth):
      v = at(xs, base + at(feature, cur))  # features checked < F at load; rows from coords
      t = at(value, cur)
      go = _compare(v, t, at(mode, cur) if mode is not None else None, only)
      if missing is not None: go = go | (at(missing, cur) & v.eq(v).logical_not())  # NaN: the missing way
      cur = at(nxt, cur * 2 + go.where(0, 1).cast(dtypes.int64)).contiguous()
    return cur


def _compare(v: Tensor, t: Tensor, mode: Tensor | None, only: str) -> Tensor:
  """The true way at each walker: its node's comparison of v with t (`only` where every branch node uses one)."""
  tests = {"BRANCH_LEQ": lambda: v <= t, "BRANCH_LT": lambda: v < t, "BRANCH_GTE": lambda: v >= t, "BRANCH_GT": lambda: v > t,
           "BRANCH_EQ": lambda: v.eq(t), "BRANCH_NEQ": lambda: v.eq(t).logical_not()}
  if mode is None: return tests[only]()
  go = tests["BRANCH_LEQ"]()
  for code, name in enumerate(MODES[1:-1], 1): go = mode.eq(code).where(tests[name](), go)
  return go


def _scores(n: OnnxNode, forest: _Forest, x: Tensor, weights: np.ndarray, average: bool) -> Tensor:
  leaves = forest.walk(n, x)
  s = Tensor(weights).gather(leaves, 0, name=f"node {n.name} ({n.op})", in_range=True).sum(1)  # (rows, trees, outputs) summed over the trees
  if average: s = s * (1.0 / len(forest.trees))
  base = _floats(n, "base_values")
  if len(base) not in (0, weights.shape[1]): raise n.error(f"base_values has {len(base)} values for {weights.shape[1]} outputs")
  return s + Tensor(base) if len(base) else s


def _classifier(n: OnnxNode) -> list[Value]:
  if n.attr("classlabels_strings"): raise n.error("string class labels (classlabels_strings) are not supported: kiln has no string tensors")
  labels = _ints(n, "classlabels_int64s")
  if len(labels) == 0: raise n.error("needs classlabels_int64s")
  forest = _Forest(n)
  ids = _ints(n, "class_ids")
  if len(labels) == 2 and len(set(ids.tolist())) == 1: return _binary(n, forest, labels, int(ids[0]))
  weights = forest.leaves(n, "class", len(labels))
  s = _scores(n, forest, rows_of(n), weights, False)
  return [label_of(s, labels), post_transformed(n, s)]


def _binary(n: OnnxNode, forest: _Forest, labels: np.ndarray, column: int) -> list[Value]:
  """Two labels, one score column (a boosted binary classifier): onnxruntime's rules. With every weight >= 0 the score s is
  a probability: label 1 where s > 0.5, scores [1 - p, p]; with mixed signs a margin: label 1 where s > 0, scores [-s, s]
  (NONE, SOFTMAX, SOFTMAX_ZERO alike); under LOGISTIC p = logistic(s) and the scores are [1 - p, p] either way."""
  how = n.attr("post_transform", "NONE")
  if how == "PROBIT": raise n.error("post_transform PROBIT on a binary classifier with one score column is not supported")
  weights = forest.leaves(n, "class", column + 1)[:, column:]
  positive = bool((_floats(n, "class_weights") >= 0).all())
  s = _scores(n, forest, rows_of(n), weights, False).reshape(-1)
  label = above(s, 0.5 if positive else 0.0, int(labels[0]), int(labels[1]))
  if how == "LOGISTIC" or positive:
    p = s.sigmoid() if how == "LOGISTIC" else s
    return [label, Tensor.stack([1.0 - p, p], 1)]
  return [label, Tensor.stack([-s, s], 1)]


def _regressor(n: OnnxNode) -> Value:
  how = n.attr("aggregate_function", "SUM")
  if how not in ("SUM", "AVERAGE"): raise n.error(f"aggregate_function {how!r} is not supported (SUM, AVERAGE)")
  if (pt := n.attr("post_transform", "NONE")) != "NONE": raise n.error(f"post_transform {pt!r} is not supported (NONE)")
  forest = _Forest(n)
  return _scores(n, forest, rows_of(n), forest.leaves(n, "target", int(n.attr("n_targets", 1))), how == "AVERAGE")


_NODES = ("nodes_treeids nodes_nodeids nodes_featureids nodes_values nodes_values_as_tensor nodes_modes nodes_truenodeids "
          "nodes_falsenodeids nodes_missing_value_tracks_true nodes_hitrates nodes_hitrates_as_tensor base_values base_values_as_tensor "
          "post_transform")
_op("TreeEnsembleClassifier", _classifier, _NODES + " class_treeids class_nodeids class_ids class_weights class_weights_as_tensor "
    "classlabels_int64s classlabels_strings")
_op("TreeEnsembleRegressor", _regressor, _NODES + " target_treeids target_nodeids target_ids target_weights target_weights_as_tensor "
    "n_targets aggregate_function")
