"""ONNX GatherND, GatherElements, ScatterND and ScatterElements (issue 35) against onnxruntime: every attribute, negative
and duplicate indices, with every input constant (folded at load), constant indices over run-time data (kernels reading
a checked constant row index) and run-time indices (each index checked after the run). A bad index is an ONNXError at load
or an IndexOutOfRangeError after the run, never a clamped answer; what kiln cannot do is refused at load."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from onnx_case import N, check, f32, model, onnx, ort

from kiln.graph import onnx as konnx
from kiln.graph.lazy import IndexOutOfRangeError, ONNXError

I64 = np.int64
RNG = np.random.default_rng(5)


def _variants(nodes: list, ins: dict[str, np.ndarray], out: np.dtype, const: str, opset: int = 18) -> onnx.ModelProto:
  """The model with the inputs named in const (a space-separated list, or 'all') as initializers, the rest fed."""
  names = list(ins) if const == "all" else const.split()
  return model(nodes, {k: v for k, v in ins.items() if k not in names}, {"y": out}, {k: v for k, v in ins.items() if k in names}, opset)


def _check(nodes: list, ins: dict[str, np.ndarray], out: np.dtype, const: str, opset: int = 18) -> konnx.Model:
  names = list(ins) if const == "all" else const.split()
  return check(_variants(nodes, ins, out, const, opset), {k: v for k, v in ins.items() if k not in names})


# ---- onnx's own node tests for these ops, as given (every input fed), with constant indices, and with every input constant ----
NODE_MODULES = ("gathernd", "gatherelements", "scatternd", "scatterelements", "scatter")


def _node_cases() -> list:
  from onnx.backend.test.case import node
  for m in NODE_MODULES: importlib.import_module(f"onnx.backend.test.case.node.{m}")  # each registers its cases on import
  return [c for c in node._NodeTestCases if c.name.startswith(("test_gathernd", "test_gather_elements", "test_scatter"))]


def _as_constants(m: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
  out = onnx.ModelProto()
  out.CopyFrom(m)
  keep = [i for i in out.graph.input if i.name not in values]
  del out.graph.input[:]
  out.graph.input.extend(keep)
  out.graph.initializer.extend([onnx.numpy_helper.from_array(v, k) for k, v in values.items()])
  return out


def test_onnx_node_cases() -> None:
  cases = _node_cases()
  assert len(cases) >= 22, [c.name for c in cases]
  ran = 0
  for c in cases:
    names = [i.name for i in c.model.graph.input]
    for inputs, _ in c.data_sets:
      feeds = dict(zip(names, inputs))
      for const in ((), names[1:2], names):
        m = _as_constants(c.model, {k: feeds[k] for k in const})
        check(m, {k: v for k, v in feeds.items() if k not in const})
        ran += 1
  assert ran == 3 * len(cases)


# ---- GatherND ----
MASK = np.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], I64)


def _mask_grid(b: int, q: int, s: int) -> np.ndarray:
  """transformers' attention_mask[batch_idx, kv_idx] as torch exports it: the two index grids broadcast and stacked."""
  bi = np.broadcast_to(np.arange(b)[:, None, None, None], (b, 1, q, s))
  ki = np.broadcast_to(np.arange(s)[None, None, None, :], (b, 1, q, s))
  return np.stack([bi, ki], -1).astype(I64)


@pytest.mark.parametrize("dtype", [np.bool_, I64])
@pytest.mark.parametrize("const", ["idx", "", "all"])
def test_transformers_padding_mask(dtype: type, const: str) -> None:
  km = _check([N("GatherND", ["mask", "idx"], ["y"])], {"mask": MASK.astype(dtype), "idx": _mask_grid(2, 3, 5)}, dtype, const)
  if const == "idx": assert km.plan is not None and len(km.plan.kernels) == 1, km.summary()  # one gather reading a constant row index


@pytest.mark.parametrize("const", ["idx", ""])
@pytest.mark.parametrize("b,dshape,ishape", [(0, (4, 3, 2), (5, 1)), (0, (4, 3, 2), (2, 2, 3)), (1, (2, 3, 4), (2, 5, 2)),
                                              (2, (2, 3, 4), (2, 3, 1)), (1, (3, 4), (3, 2, 1)), (0, (6,), (4, 1))])
def test_gathernd(b: int, dshape: tuple, ishape: tuple, const: str) -> None:
  k, bd = ishape[-1], dshape[:b]
  idx = np.stack([np.random.default_rng(k).integers(-d, d, ishape[:-1]) for d in dshape[b:b + k]], -1).astype(I64)  # negatives too
  _check([N("GatherND", ["x", "idx"], ["y"], batch_dims=b)], {"x": f32(*dshape), "idx": idx}, np.float32, const)
  assert idx.shape[:b] == bd


# ---- GatherElements ----
@pytest.mark.parametrize("const", ["idx", "", "all"])
@pytest.mark.parametrize("axis,dshape,ishape", [(0, (3, 4), (5, 4)), (1, (3, 4), (2, 6)), (-1, (2, 3, 4), (2, 2, 3)), (1, (2, 3, 4), (1, 2, 4)),
                                                 (0, (5,), (7,))])
@pytest.mark.parametrize("itype", [I64, np.int32])
def test_gather_elements(axis: int, dshape: tuple, ishape: tuple, const: str, itype: type) -> None:
  d = dshape[axis]
  idx = np.random.default_rng(len(ishape)).integers(-d, d, ishape).astype(itype)
  _check([N("GatherElements", ["x", "idx"], ["y"], axis=axis)], {"x": f32(*dshape), "idx": idx}, np.float32, const)


# ---- ScatterND and ScatterElements ----
REDUCE = ["none", "add", "mul", "max", "min"]


@pytest.mark.parametrize("const", ["idx", "", "all", "x idx"])
@pytest.mark.parametrize("reduction", REDUCE)
def test_scatternd(reduction: str, const: str) -> None:
  idx = np.array([[[1, -1], [0, 2]], [[1, 2], [-2, 0]], [[3, 1], [1, 2]]], I64)  # (3, 2, 2) into (4, 3, 2): duplicates, negatives
  ins = {"x": f32(4, 3, 2), "idx": idx, "u": f32(3, 2, 2)}
  _check([N("ScatterND", ["x", "idx", "u"], ["y"], reduction=reduction)], ins, np.float32, const)
  rows = {"x": f32(4, 3), "idx": np.array([[2], [0], [2]], I64), "u": f32(3, 3)}  # whole rows, a duplicate
  _check([N("ScatterND", ["x", "idx", "u"], ["y"], reduction=reduction)], rows, np.float32, const)


@pytest.mark.parametrize("const", ["idx", "", "all"])
@pytest.mark.parametrize("reduction", REDUCE)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_scatter_elements(reduction: str, const: str, dtype: type) -> None:
  idx = np.array([[1, 0, -1], [1, 1, 0]], I64)  # into (3, 4) along axis 0: duplicates in column 0 and 1
  x, u = f32(3, 4), f32(2, 3)
  if dtype == np.int32: x, u = np.arange(12, dtype=np.int32).reshape(3, 4) - 5, np.array([[7, -3, 2], [-9, 4, 1]], np.int32)
  _check([N("ScatterElements", ["x", "idx", "u"], ["y"], axis=0, reduction=reduction)], {"x": x, "idx": idx, "u": u}, dtype, const)
  if reduction == "none":
    axis1 = {"x": x, "idx": np.array([[3, -4], [0, 1]], np.int32), "u": u[:, :2].copy()}
    _check([N("ScatterElements", ["x", "idx", "u"], ["y"], axis=-1)], axis1, dtype, const)


@pytest.mark.parametrize("const", ["idx", "", "all"])
@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_max_min_with_nan_as_onnxruntime(reduction: str, const: str) -> None:
  """onnxruntime applies updates one by one as dst > src ? dst : src: a NaN update wins, the next update replaces it."""
  rng = np.random.default_rng(1)
  x, u = f32(5, 3), f32(30, 3)
  x[1, 0] = x[3, 2] = np.nan
  u[rng.integers(0, 30, 8), rng.integers(0, 3, 8)] = np.nan
  ins = {"x": x, "idx": rng.integers(-5, 4, (30, 3)).astype(I64), "u": u}  # row 4 gets no update
  _check([N("ScatterElements", ["x", "idx", "u"], ["y"], axis=0, reduction=reduction)], ins, np.float32, const)


def test_scatter_into_computed_data_covering_every_row() -> None:
  """BART's shift: shifted[:, 1:] = ids[:, :-1] as a ScatterND of a computed tensor, then the start token in column 0."""
  ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], I64)
  cols = np.array([[[r, c] for c in range(1, 4)] for r in range(2)], I64)  # (2, 3, 2)
  start = np.array([[r, 0] for r in range(2)], I64)
  nodes = [N("Slice", ["ids", "s0", "s1", "ax"], ["head"]), N("ConstantOfShape", ["shp"], ["z"], value=onnx.helper.make_tensor("v", 7, [1], [0])),
           N("ScatterND", ["z", "cols", "head"], ["t"]), N("ScatterND", ["t", "start", "tok"], ["y"])]
  inits = {"s0": np.array([0], I64), "s1": np.array([-1], I64), "ax": np.array([1], I64), "shp": np.array([2, 4], I64), "cols": cols,
           "start": start, "tok": np.array([2, 2], I64)}
  km = check(model(nodes, {"ids": ids}, {"y": I64}, inits), {"ids": ids})
  assert km.plan is not None and len(km.plan.kernels) <= 2, km.summary()


# ---- bad indices: at load for constants, after the run for computed ones; onnxruntime refuses them too ----
def _ort_refuses(m: onnx.ModelProto, feeds: dict) -> None:
  with pytest.raises(Exception, match="(?i)invalid ind|out of|bounds"):
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


ND0, ND1 = r"indices\[\.\.\., 0\] on axis 0 of data \(2, 3\)", r"indices\[\.\.\., 1\] on axis 1 of data \(2, 3\)"
BAD = [  # (node, inputs, where, the index): most of them wrong only in a way a flat row number would hide
  (N("GatherND", ["x", "idx"], ["y"], name="g"), {"x": f32(2, 3), "idx": np.array([[0, 1], [0, 3]], I64)}, ND1, 3),
  (N("GatherND", ["x", "idx"], ["y"], name="g"), {"x": f32(2, 3), "idx": np.array([[-3, 0]], I64)}, ND0, -3),
  (N("GatherElements", ["x", "idx"], ["y"], axis=1, name="g"), {"x": f32(2, 3), "idx": np.array([[0, 3]], I64)}, r"axis 1 of data \(2, 3\)", 3),
  (N("ScatterND", ["x", "idx", "u"], ["y"], name="g"), {"x": f32(2, 3), "idx": np.array([[1, -4]], I64), "u": f32(1)}, ND1, -4),
  (N("ScatterElements", ["x", "idx", "u"], ["y"], axis=0, name="g"), {"x": f32(2, 3), "idx": np.array([[2, 0]], I64), "u": f32(1, 2)},
   r"axis 0 of data \(2, 3\)", 2),
]


@pytest.mark.parametrize("node,ins,where,bad", BAD)
def test_bad_index(node: object, ins: dict, where: str, bad: int) -> None:
  fed = _variants([node], ins, np.float32, "")
  _ort_refuses(fed, ins)
  with pytest.raises(IndexOutOfRangeError, match=rf"node g \({node.op_type}\): {where}: index {bad} is out of range"):  # type: ignore[attr-defined]
    konnx.load(fed).run(ins)
  with pytest.raises(ONNXError, match=rf"node g \({node.op_type}, opset 18\): {where}: index {bad} is out of range"):  # type: ignore[attr-defined]
    konnx.load(_variants([node], ins, np.float32, "idx"))
  with pytest.raises(ONNXError, match=rf"index {bad} is out of range"): konnx.load(_variants([node], ins, np.float32, "all"))
  good = {k: (np.clip(v, -1, 1) if k == "idx" else v) for k, v in ins.items()}
  km = konnx.load(fed)
  with pytest.raises(IndexOutOfRangeError): km.run(ins)
  np.testing.assert_allclose(km.run(good)["y"], ort.InferenceSession(fed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, good)[0])


# ---- refused at load, naming the node and what is wrong ----
REFUSED = [
  ([N("GatherND", ["x", "idx"], ["y"], batch_dims=2)], {"x": f32(2, 3), "idx": np.zeros((2, 1), I64)}, "batch_dims=2 is out of range"),
  ([N("GatherND", ["x", "idx"], ["y"], batch_dims=1)], {"x": f32(2, 3), "idx": np.zeros((3, 1), I64)}, "batch dims of indices"),
  ([N("GatherND", ["x", "idx"], ["y"])], {"x": f32(2, 3), "idx": np.zeros((1, 3), I64)}, "last dim 3 is more than data's rank 2"),
  ([N("GatherND", ["x", "idx"], ["y"])], {"x": f32(2, 3), "idx": np.zeros((1, 2), np.int32)}, "indices must be int64, got int32"),
  ([N("GatherElements", ["x", "idx"], ["y"], axis=0)], {"x": f32(2, 3), "idx": np.zeros((1, 4), I64)}, r"can be larger than data \(2, 3\) on axis 1"),
  ([N("GatherElements", ["x", "idx"], ["y"], axis=2)], {"x": f32(2, 3), "idx": np.zeros((1, 3), I64)}, "axis 2 is out of range"),
  ([N("ScatterND", ["x", "idx", "u"], ["y"])], {"x": f32(2, 3), "idx": np.zeros((1, 1), I64), "u": f32(2, 3)}, r"updates have shape \(2, 3\)"),
  ([N("ScatterElements", ["x", "idx", "u"], ["y"], reduction="add")], {"x": np.zeros((2, 3), bool), "idx": np.zeros((1, 3), I64),
                                                                      "u": np.ones((1, 3), bool)}, "reduction=add on bool data"),
  ([N("ScatterElements", ["x", "idx", "u"], ["y"])], {"x": f32(2, 3), "idx": np.zeros((1, 3), I64), "u": f32(1, 2)}, "differ in shape"),
]


@pytest.mark.parametrize("nodes,ins,msg", REFUSED)
def test_refused(nodes: list, ins: dict, msg: str) -> None:
  for const in ("idx", ""):
    m = _variants(nodes, ins, ins["x"].dtype, const)
    with pytest.raises(ONNXError, match=rf"node <{nodes[0].op_type}> \({nodes[0].op_type}, opset 18\): .*{msg}"): konnx.load(m)


def test_reduction_attribute_value_is_checked() -> None:
  m = _variants([N("ScatterND", ["x", "idx", "u"], ["y"], reduction="sum")], {"x": f32(2, 3), "idx": np.zeros((1, 1), I64), "u": f32(1, 3)},
                np.float32, "idx")
  with pytest.raises(ONNXError, match=r"reduction='sum' is not one of none, add, mul, max, min"): konnx.load(m)


def test_an_absurd_fold_is_refused_before_numpy_allocates_it() -> None:
  ins = {"x": np.zeros((1, 1 << 14), np.float32), "idx": np.zeros((1 << 14, 1), I64)}  # 192 KiB stored, 2**28 elements folded
  with pytest.raises(ONNXError, match=r"node <GatherND> \(GatherND\): a load-time array's element count is 268435456, over MAX_FOLDED"):
    konnx.load(_variants([N("GatherND", ["x", "idx"], ["y"])], ins, np.float32, "all"))


def test_run_time_scatter_past_the_dense_limit_is_refused() -> None:
  ins = {"x": np.zeros((1 << 13, 1 << 7), np.float32), "idx": np.zeros((1 << 11, 1), I64), "u": np.zeros((1 << 11, 1 << 7), np.float32)}
  m = _variants([N("ScatterND", ["x", "idx", "u"], ["y"], reduction="add")], ins, np.float32, "")
  with pytest.raises(ONNXError, match=r"indices computed at run time.*over indexing.DENSE_LIMIT"): konnx.load(m)


def _symbolic_model(nodes: list, ins: dict[str, tuple], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
  h = onnx.helper
  g = h.make_graph(nodes, "g", [h.make_tensor_value_info(k, onnx.TensorProto.INT64 if k.startswith("i") else onnx.TensorProto.FLOAT, v)
                                for k, v in ins.items()],
                   [h.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for n in nodes for o in n.output],
                   [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
  m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
  for o in m.graph.output: o.type.tensor_type.shape.SetInParent()
  return m


def test_symbolic_indices() -> None:
  """Computed indices may have symbolic dims (BERT's position ids sliced to the sequence length): the data's are fixed."""
  t, x = f32(1, 16), f32(3, 4)
  m = _symbolic_model([N("GatherElements", ["t", "ia"], ["ya"], axis=1), N("GatherND", ["x", "ib"], ["yb"])], {"ia": (1, "s"), "ib": ("n", 2)},
                      {"t": t, "x": x})
  km = konnx.load(m, dims={"s": (1, 16), "n": (1, 8)})
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for s, n in ((5, 1), (16, 7)):
    feeds = {"ia": RNG.integers(-16, 16, (1, s)), "ib": np.stack([RNG.integers(-3, 3, n), RNG.integers(-4, 4, n)], -1)}
    got = km.run(feeds)
    for name, want in zip(("ya", "yb"), sess.run(None, feeds)): np.testing.assert_array_equal(got[name], want)
  with pytest.raises(IndexOutOfRangeError, match=r"axis 1 of data \(1, 16\): index 16 is out of range"):
    km.run({"ia": np.full((1, 2), 16), "ib": feeds["ib"]})


def test_a_possibly_larger_index_is_refused() -> None:
  # symbolic data: test_graph_gather_symbolic.py (gathers), test_onnx_dynamic_rest.py (scatters)
  m = _symbolic_model([N("GatherElements", ["x", "ia"], ["y"], axis=1)], {"ia": ("n", 3)}, {"x": f32(2, 3)})
  with pytest.raises(ONNXError, match=r"indices \(n, 3\) can be larger than data \(2, 3\) on axis 0"): konnx.load(m, dims={"n": (1, 4)})
  konnx.load(m, dims={"n": (1, 2)})
