"""ai.onnx.ml's TreeEnsembleClassifier and TreeEnsembleRegressor (decision trees, random forests, boosted trees as scikit-
learn, XGBoost and LightGBM export them) and opset 5's TreeEnsemble (_tree_ensemble), built from kiln.graph Tensor ops
and registered in onnx_ops.OPS.

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
column follows onnxruntime's rules for it (_binary). MIN and MAX aggregation take each output's least or greatest weight
over the trees whose reached leaf weighs it, 0 where none does (Leaves, as onnxruntime). Refused by name: string class
labels, a regressor's post transform. A NaN feature value takes a node's true way where its missing_value_tracks_true says so,
else the way its comparison gives (false but for BRANCH_NEQ), as onnxruntime."""
from __future__ import annotations

from typing import Any

import numpy as np

from kiln.graph.indexing import coords
from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.onnx_ops_ml import above, float_list, int_list, label_of, post_transformed, rows_of
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "LEAF", "BRANCH_MEMBER")  # MEMBER: opset 5
MAX_DEPTH = 4096  # levels walked: a deeper tree is refused (a malformed one may loop; a real one is far shallower)


class _Forest:
  """A forest as global tables over its node numbers: leaf, next (true, false; a leaf's are itself), feature, threshold,
  mode code (MODES), missing-true, each tree's root, the depth, and for BRANCH_MEMBER nodes their sets (a (nodes, S) table
  padded with NaN, which no value equals)."""

  def __init__(self, n: OnnxNode, leaf: np.ndarray, nxt: np.ndarray, feature: np.ndarray, value: np.ndarray, mode: np.ndarray,
               missing_true: np.ndarray, roots: list[int], members: np.ndarray | None = None):
    self.leaf, self.next, self.mode, self.missing_true = leaf, nxt, mode, missing_true
    self.feature = np.where(leaf, 0, feature).astype(np.int64)
    self.value = np.where(leaf, 0, value).astype(value.dtype if value.dtype == np.float64 else np.float32)  # X's float type
    self.roots, self.trees, self.members = np.asarray(roots, np.int64), list(range(len(roots))), members
    self.depth = self._depth(n)

  @classmethod
  def from_nodes(cls, n: OnnxNode) -> tuple[_Forest, dict[tuple[int, int], int]]:
    """TreeEnsembleClassifier/Regressor's nodes_* lists (ids per tree), and the global number of each (tree, node)."""
    tree, node = int_list(n, "nodes_treeids"), int_list(n, "nodes_nodeids")
    feature, value = int_list(n, "nodes_featureids"), float_list(n, "nodes_values")
    modes = n.strs("nodes_modes")
    true_id, false_id = int_list(n, "nodes_truenodeids"), int_list(n, "nodes_falsenodeids")
    missing = int_list(n, "nodes_missing_value_tracks_true")
    m = len(tree)
    if m == 0: raise n.error("has no nodes")
    for name, arr in (("nodes_nodeids", node), ("nodes_featureids", feature), ("nodes_values", value), ("nodes_modes", modes),
                      ("nodes_truenodeids", true_id), ("nodes_falsenodeids", false_id)):
      if len(arr) != m: raise n.error(f"{name} has {len(arr)} entries for {m} nodes")
    if len(missing) not in (0, m): raise n.error(f"nodes_missing_value_tracks_true has {len(missing)} entries for {m} nodes")
    if bad := sorted(set(modes) - set(MODES[:7])): raise n.error(f"node mode {bad[0]!r} is not one of {', '.join(MODES[:7])}")
    index = {(int(t), int(i)): k for k, (t, i) in enumerate(zip(tree, node))}
    if len(index) != m: raise n.error("two nodes share a (tree, node) id")
    leaf = np.array([md == "LEAF" for md in modes])
    nxt = np.empty((m, 2), np.int64)
    for k in range(m):
      if leaf[k]: nxt[k] = k
      else:
        for j, target in enumerate((true_id[k], false_id[k])):
          if (g := index.get((int(tree[k]), int(target)))) is None:
            raise n.error(f"node {int(node[k])} of tree {int(tree[k])} leads to node {int(target)}, which the tree does not have")
          nxt[k, j] = g
    children = {int(g) for k in range(m) if not leaf[k] for g in nxt[k]}
    roots = []
    for t in sorted({int(t) for t in tree}):  # one root a tree (the node no other leads to), every node of the tree reached from it
      top = [k for k in range(m) if int(tree[k]) == t and k not in children]
      if len(top) != 1: raise n.error(f"tree {t} has {len(top)} roots (nodes no other node leads to); a tree has one")
      roots.append(top[0])
    forest = cls(n, leaf, nxt, feature, value, np.array([MODES.index(md) for md in modes], np.int64),
                 (missing if len(missing) else np.zeros(m, np.int64)).astype(bool), roots)
    if len(forest.seen) != m: raise n.error(f"{m - len(forest.seen)} nodes are not reached from their tree's root")
    return forest, index

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

  def leaves(self, n: OnnxNode, index: dict[tuple[int, int], int], prefix: str, outputs: int, how: str = "SUM") -> Leaves:
    """The leaves' weights from the `{prefix}_treeids/_nodeids/_ids/_weights` attributes, aggregated `how` (Leaves.of)."""
    t, i, ids = (int_list(n, f"{prefix}_{a}") for a in ("treeids", "nodeids", "ids"))
    w = float_list(n, f"{prefix}_weights")
    if not len(t) == len(i) == len(ids) == len(w): raise n.error(f"{prefix}_treeids/_nodeids/_ids/_weights differ in length")
    nodes = []
    for tt, nn, c in zip(t.tolist(), i.tolist(), ids.tolist()):
      if (k := index.get((tt, nn))) is None: raise n.error(f"a weight names node {nn} of tree {tt}, which does not exist")
      if not 0 <= c < outputs: raise n.error(f"a weight names output {c} of {outputs}")
      nodes.append(k)
    return Leaves.of(np.asarray(nodes, np.int64), ids.astype(np.int64), w, len(self.leaf), outputs, how, np.float32)

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
    branch_modes = set(self.mode[~self.leaf].tolist())
    mode = Tensor(self.mode) if len(branch_modes) > 1 else None
    only = MODES[branch_modes.pop()] if len(branch_modes) == 1 else "BRANCH_LEQ"
    missing = Tensor(self.missing_true) if self.missing_true.any() else None
    members = Tensor(self.members) if self.members is not None else None
    def at(table: Tensor, i: Tensor) -> Tensor: return table.gather(i, 0, name=label, in_range=True)  # built in range: no check
    for _ in range(self.depth):
      v = at(xs, base + at(feature, cur))  # features checked < F at load; rows from coords
      t = at(value, cur)
      go = _compare(v, t, at(mode, cur) if mode is not None else None, only, at(members, cur) if members is not None else None)
      if missing is not None: go = go | (at(missing, cur) & v.eq(v).logical_not())  # NaN: the missing way
      cur = at(nxt, cur * 2 + go.where(0, 1).cast(dtypes.int64)).contiguous()
    return cur


def _compare(v: Tensor, t: Tensor, mode: Tensor | None, only: str, members: Tensor | None) -> Tensor:
  """The true way at each walker: its node's comparison of v with t (`only` where every branch node uses one); members:
  each walker's node's set (padded with NaN, which equals nothing) for BRANCH_MEMBER."""
  tests = {"BRANCH_LEQ": lambda: v <= t, "BRANCH_LT": lambda: v < t, "BRANCH_GTE": lambda: v >= t, "BRANCH_GT": lambda: v > t,
           "BRANCH_EQ": lambda: v.eq(t), "BRANCH_NEQ": lambda: v.eq(t).logical_not()}
  if members is not None: tests["BRANCH_MEMBER"] = lambda: v.unsqueeze(-1).eq(members).max(-1)
  if mode is None: return tests[only]()
  go = tests["BRANCH_LEQ"]()
  for name in (*MODES[1:6], "BRANCH_MEMBER"):
    if name in tests: go = mode.eq(MODES.index(name)).where(tests[name](), go)
  return go


AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")  # aggregate_function: the older ops' names, opset 5's codes 0-3 in this order


class Leaves:
  """The leaves' weights as a (nodes, outputs) table and how the trees' are aggregated (AGGREGATES). SUM and AVERAGE add a
  leaf's weights for an output; MIN and MAX take their least or greatest, and `has` says which (leaf, output) pairs have
  any: under MIN or MAX an output no reached leaf weighs is 0, base_values not added, as onnxruntime 1.32 gives it (its
  older aggregator added them; the spec says nothing of an empty aggregate)."""

  def __init__(self, table: np.ndarray, how: str, has: np.ndarray | None):
    self.table, self.how, self.has = table, how, has

  @classmethod
  def of(cls, nodes: np.ndarray, outputs_of: np.ndarray, weights: np.ndarray, count: int, outputs: int, how: str, dt: Any) -> Leaves:
    """The table from one weight per (node, output) entry, several entries of a pair aggregated as the trees' are."""
    if how in ("SUM", "AVERAGE"):
      table = np.zeros((count, outputs), dt)
      np.add.at(table, (nodes, outputs_of), weights.astype(dt))
      return cls(table, how, None)
    table = np.full((count, outputs), np.inf if how == "MIN" else -np.inf, dt)
    (np.minimum if how == "MIN" else np.maximum).at(table, (nodes, outputs_of), weights.astype(dt))
    has = np.zeros((count, outputs), bool)
    has[nodes, outputs_of] = True
    return cls(np.where(has, table, 0).astype(dt), how, has)

  @property
  def outputs(self) -> int: return int(self.table.shape[1])


def _scores(n: OnnxNode, forest: _Forest, x: Tensor, leaves: Leaves) -> Tensor:
  at = forest.walk(n, x)
  def gathered(table: np.ndarray) -> Tensor: return Tensor(table).gather(at, 0, name=f"node {n.name} ({n.op})", in_range=True)
  base = float_list(n, "base_values")
  if len(base) not in (0, leaves.outputs): raise n.error(f"base_values has {len(base)} values for {leaves.outputs} outputs")
  def based(s: Tensor) -> Tensor: return s + Tensor(base) if len(base) else s
  w = gathered(leaves.table)  # (rows, trees, outputs)
  if leaves.has is None:
    s = w.sum(1)
    return based(s * (1.0 / len(forest.trees)) if leaves.how == "AVERAGE" else s)
  has = gathered(leaves.has)
  far = float("inf") if leaves.how == "MIN" else float("-inf")
  s = has.where(w, far).min(1) if leaves.how == "MIN" else has.where(w, far).max(1)
  return has.max(1).where(based(s), 0.0)  # no reached leaf weighs the output: 0, no base (Leaves)


def _classifier(n: OnnxNode) -> list[Value]:
  if n.attr("classlabels_strings"): raise n.error("string class labels (classlabels_strings) are not supported: kiln has no string tensors")
  labels = int_list(n, "classlabels_int64s")
  if len(labels) == 0: raise n.error("needs classlabels_int64s")
  forest, index = _Forest.from_nodes(n)
  ids = int_list(n, "class_ids")
  if len(labels) == 2 and len(set(ids.tolist())) == 1: return _binary(n, forest, forest.leaves(n, index, "class", int(ids[0]) + 1), labels)
  s = _scores(n, forest, rows_of(n), forest.leaves(n, index, "class", len(labels)))
  return [label_of(s, labels), post_transformed(n, s)]


def _binary(n: OnnxNode, forest: _Forest, leaves: Leaves, labels: np.ndarray) -> list[Value]:
  """Two labels, one score column (a boosted binary classifier): onnxruntime's rules. With every weight >= 0 the score s is
  a probability: label 1 where s > 0.5, scores [1 - p, p]; with mixed signs a margin: label 1 where s > 0, scores [-s, s]
  (NONE, SOFTMAX, SOFTMAX_ZERO alike); under LOGISTIC p = logistic(s) and the scores are [1 - p, p] either way."""
  how = n.attr("post_transform", "NONE")
  if how == "PROBIT": raise n.error("post_transform PROBIT on a binary classifier with one score column is not supported")
  one = Leaves(leaves.table[:, -1:], leaves.how, None)  # the one column the weights name
  positive = bool((float_list(n, "class_weights") >= 0).all())
  s = _scores(n, forest, rows_of(n), one).reshape(-1)
  label = above(s, 0.5 if positive else 0.0, int(labels[0]), int(labels[1]))
  if how == "LOGISTIC" or positive:
    p = s.sigmoid() if how == "LOGISTIC" else s
    return [label, Tensor.stack([1.0 - p, p], 1)]
  return [label, Tensor.stack([-s, s], 1)]


def _regressor(n: OnnxNode) -> Value:
  how = n.attr("aggregate_function", "SUM")
  if how not in AGGREGATES: raise n.error(f"aggregate_function {how!r} is not one of {', '.join(AGGREGATES)}")
  if (pt := n.attr("post_transform", "NONE")) != "NONE": raise n.error(f"post_transform {pt!r} is not supported (NONE)")
  forest, index = _Forest.from_nodes(n)
  return _scores(n, forest, rows_of(n), forest.leaves(n, index, "target", int(n.attr("n_targets", 1)), how))


TRANSFORMS_V5 = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")  # TreeEnsemble's post_transform codes


def _tree_ensemble(n: OnnxNode) -> Value:
  """ai.onnx.ml opset 5's TreeEnsemble: interior nodes (nodes_*) and leaves (leaf_*, one target and weight each) in
  separate lists, a branch leading to either by its *_leafs flag, trees by their roots. Numbered here as the interior
  nodes then the leaves, and walked as the older ops are; X's float type is kept (a double X compares in double).
  post_transform follows the spec's codes (NONE 0, SOFTMAX 1, LOGISTIC 2, SOFTMAX_ZERO 3, PROBIT 4), not onnxruntime 1.32,
  which reads 1 as LOGISTIC and 2 as SOFTMAX (its own enum's order) and skips LOGISTIC for a single target (its issues
  26596 and 24862): a model that relies on either gives kiln the spec's answer."""
  if not 0 <= (agg := int(n.attr("aggregate_function", 1))) < len(AGGREGATES):
    raise n.error(f"aggregate_function {agg} is not one of 0-3 ({', '.join(AGGREGATES)})")
  if not 0 <= (pt := int(n.attr("post_transform", 0))) < len(TRANSFORMS_V5): raise n.error(f"post_transform {pt} is not one of 0-4")
  feature, true_id, false_id = int_list(n, "nodes_featureids"), int_list(n, "nodes_truenodeids"), int_list(n, "nodes_falsenodeids")
  m = len(feature)
  if m == 0: raise n.error("has no nodes")
  true_leaf, false_leaf = int_list(n, "nodes_trueleafs"), int_list(n, "nodes_falseleafs")
  missing = int_list(n, "nodes_missing_value_tracks_true")
  modes = np.asarray(n.tensor("nodes_modes")).reshape(-1).astype(np.int64) if "nodes_modes" in n.attrs else np.zeros(0, np.int64)
  splits = np.asarray(n.tensor("nodes_splits")).reshape(-1) if "nodes_splits" in n.attrs else np.zeros(0)
  for name, arr in (("nodes_truenodeids", true_id), ("nodes_falsenodeids", false_id), ("nodes_trueleafs", true_leaf),
                    ("nodes_falseleafs", false_leaf), ("nodes_modes", modes), ("nodes_splits", splits)):
    if len(arr) != m: raise n.error(f"{name} has {len(arr)} entries for {m} nodes")
  if len(missing) not in (0, m): raise n.error(f"nodes_missing_value_tracks_true has {len(missing)} entries for {m} nodes")
  if len(modes) and not 0 <= int(modes.min()) <= int(modes.max()) <= 6: raise n.error(f"a node mode is not one of 0-6: {sorted(set(modes.tolist()))}")
  targets, weights = int_list(n, "leaf_targetids"), np.asarray(n.tensor("leaf_weights")).reshape(-1) if "leaf_weights" in n.attrs else np.zeros(0)
  leaves = len(targets)
  if leaves == 0 or len(weights) != leaves: raise n.error(f"{len(weights)} leaf_weights for {leaves} leaf_targetids (needs as many, at least one)")
  outputs = int(n.attr("n_targets", 0))
  if outputs < 1 or not 0 <= int(targets.min()) <= int(targets.max()) < outputs: raise n.error(f"a leaf names a target outside [0, {outputs})")
  nxt = np.empty((m + leaves, 2), np.int64)
  nxt[m:] = np.arange(m, m + leaves)[:, None]
  for j, (ids, is_leaf) in enumerate(((true_id, true_leaf), (false_id, false_leaf))):
    bound = np.where(is_leaf != 0, leaves, m)
    if ((ids < 0) | (ids >= bound)).any(): raise n.error(f"a node's {('true', 'false')[j]} branch leads outside the nodes or leaves")
    nxt[:m, j] = np.where(is_leaf != 0, ids + m, ids)
  roots = int_list(n, "tree_roots")
  if len(roots) == 0 or not 0 <= int(roots.min()) <= int(roots.max()) < m: raise n.error(f"tree_roots must be node positions in [0, {m})")
  x = n.t(0)
  if x.ndim != 2: raise n.error(f"input of rank {x.ndim}: needs (N, F)")
  if x.dtype != dtypes.float64: x = x.cast(dtypes.float32) if x.dtype != dtypes.float32 else x
  dt = np.float64 if x.dtype == dtypes.float64 else np.float32
  code = np.concatenate([np.where(modes == 6, MODES.index("BRANCH_MEMBER"), modes), np.full(leaves, MODES.index("LEAF"))])
  forest = _Forest(n, np.arange(m + leaves) >= m, nxt, np.concatenate([feature, np.zeros(leaves, np.int64)]),
                   np.concatenate([splits, np.zeros(leaves)]).astype(dt), code,
                   np.concatenate([missing if len(missing) else np.zeros(m, np.int64), np.zeros(leaves, np.int64)]).astype(bool),
                   [int(r) for r in roots], _members(n, modes, m + leaves, dt))
  table = Leaves.of(np.arange(m, m + leaves), targets.astype(np.int64), weights, m + leaves, outputs, AGGREGATES[agg], dt)
  return post_transformed(n, _scores(n, forest, x, table), TRANSFORMS_V5[pt])


def _members(n: OnnxNode, modes: np.ndarray, nodes: int, dt: Any) -> np.ndarray | None:
  """The sets of the BRANCH_MEMBER nodes (membership_values, one set a member node in order, NaN between sets) as a
  (nodes, largest set) table padded with NaN; None without member nodes."""
  where = np.nonzero(modes == 6)[0]
  if not len(where): return None
  if "membership_values" not in n.attrs: raise n.error("BRANCH_MEMBER nodes need membership_values")
  vals: np.ndarray = np.asarray(n.tensor("membership_values")).reshape(-1).astype(dt)
  cuts = np.nonzero(np.isnan(vals))[0]
  sets = np.split(vals, cuts)
  sets = [s[~np.isnan(s)] for s in sets]
  if len(sets) > len(where) and all(len(s) == 0 for s in sets[len(where):]): sets = sets[:len(where)]  # a trailing NaN
  if len(sets) != len(where): raise n.error(f"membership_values has {len(sets)} sets for {len(where)} BRANCH_MEMBER nodes")
  table: np.ndarray = np.full((nodes, max(1, max(len(s) for s in sets))), np.nan, dt)
  for k, s in zip(where, sets): table[k, :len(s)] = s
  return table


_NODES = ("nodes_treeids nodes_nodeids nodes_featureids nodes_values nodes_values_as_tensor nodes_modes nodes_truenodeids "
          "nodes_falsenodeids nodes_missing_value_tracks_true nodes_hitrates nodes_hitrates_as_tensor base_values base_values_as_tensor "
          "post_transform")
_op("TreeEnsembleClassifier", _classifier, _NODES + " class_treeids class_nodeids class_ids class_weights class_weights_as_tensor "
    "classlabels_int64s classlabels_strings")
_op("TreeEnsemble", _tree_ensemble, "aggregate_function leaf_targetids leaf_weights membership_values n_targets nodes_falseleafs "
    "nodes_falsenodeids nodes_featureids nodes_hitrates nodes_missing_value_tracks_true nodes_modes nodes_splits nodes_trueleafs "
    "nodes_truenodeids post_transform tree_roots")
_op("TreeEnsembleRegressor", _regressor, _NODES + " target_treeids target_nodeids target_ids target_weights target_weights_as_tensor "
    "n_targets aggregate_function")
