"""TopK, NonZero, Unique (onnx_ops_select.py), NonMaxSuppression and RoiAlign (onnx_ops_detect.py) against onnxruntime:
ties, NaN, both TopK methods, outputs whose length is read back at run time (a runtime variable: compiled once), the host
step's selection fed to the rest of the model, a cut inside a branch of an If known at load."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx_case import RNG, N, check, f32, helper, model

from kiln.executor import cache_stats
from kiln.graph import onnx as konnx
from kiln.graph import onnx_ops_select
from kiln.graph.lazy import IndexOutOfRangeError, ONNXError


def i64(*v: int) -> np.ndarray: return np.array(v, np.int64)


def compiles(km: konnx.Model) -> list[int]:
  assert km.program is not None
  return [s.compiles for s in km.program.specialisations()]


def test_topk_ties_nan_and_both_methods(monkeypatch: pytest.MonkeyPatch) -> None:
  """NaN above every number, equal values (-0.0 and 0.0, NaNs) by the lower index, largest and smallest, on a middle axis;
  the same by counting and by the bitonic sort (forced with RANK_MAX_N = 2, the axis padded from 6 to 8)."""
  x = np.array([[1, np.nan, 3, -0.0, 3, 0.0], [-np.inf, 2, np.nan, 2, 5, -1]], np.float32).reshape(2, 6, 1).repeat(2, 2)
  for rank_max in (1024, 2):
    monkeypatch.setattr(onnx_ops_select, "RANK_MAX_N", rank_max)
    for largest in (1, 0):
      m = model([N("TopK", ["x", "k"], ["v", "i"], axis=1, largest=largest)], {"x": x}, {"v": np.float32, "i": np.int64}, {"k": i64(5)})
      check(m, {"x": x})


@pytest.mark.parametrize("rank_max", [64, 1024])
def test_topk_with_a_k_fed_at_run_time_compiles_once(monkeypatch: pytest.MonkeyPatch, rank_max: int) -> None:
  """An axis of 100 ints of many ties, by the bitonic sort (over RANK_MAX_N = 64: padded to 128, the first k sliced) and by
  counting; k fed: a length in [0, 100] each run binds, the model compiled once at load for every k (0 and the whole axis
  too), and a k outside the axis refused by the run."""
  monkeypatch.setattr(onnx_ops_select, "RANK_MAX_N", rank_max)
  x = RNG.integers(0, 9, (2, 100)).astype(np.int32)
  m = model([N("TopK", ["x", "k"], ["v", "i"])], {"x": x, "k": i64(30)}, {"v": np.int32, "i": np.int64})
  km = check(m, {"x": x, "k": i64(30)})
  before = cache_stats()["compiles"]
  for k in (7, 0, 100, 30):
    got = km.run({"x": x, "k": i64(k)})
    assert got["v"].shape == (2, k) and (got["v"] == -np.sort(-x, 1, kind="stable")[:, :k]).all()
    np.testing.assert_array_equal(got["i"], np.argsort(-x, 1, kind="stable")[:, :k])
  assert compiles(km) == [1] and cache_stats()["compiles"] == before
  with pytest.raises(ONNXError, match=r"<k of node <TopK>> is 101, outside \[0, 100\]"): km.run({"x": x, "k": i64(101)})
  with pytest.raises(ONNXError, match=r"is -1, outside \[0, 100\]"): km.run({"x": x, "k": i64(-1)})


def test_nonzero_count_bound_as_a_runtime_variable_one_compile(monkeypatch: pytest.MonkeyPatch) -> None:
  """The count of a computed mask is read back and binds a runtime variable in [0, 77]: the rest of the model is compiled
  once, at load, and no run compiles a kernel, whatever its count (none, some, all). The positions come from the blocked
  scan and the binary search (blocks of 4 force three levels); no nonzero gives (2, 0)."""
  monkeypatch.setattr(onnx_ops_select, "SCAN_BLOCK", 4)
  m = model([N("Greater", ["x", "t"], ["g"]), N("NonZero", ["g"], ["y"]), N("Transpose", ["y"], ["yt"]), N("GatherND", ["x", "yt"], ["z"])],
            {"x": f32(7, 11)}, {"y": np.int64, "z": np.float32}, {"t": np.float32(0.5).reshape(())})
  km = konnx.load(m)
  assert compiles(km) == [1] and km.program is not None and km.program.specialisations()[0].unbounded is None
  before = cache_stats()["compiles"]
  xs = [f32(7, 11), f32(7, 11), np.zeros((7, 11), np.float32), f32(7, 11, lo=0.6, hi=1), np.ones((7, 11), np.float32)]
  for x in xs:
    got = km.run({"x": x})
    np.testing.assert_array_equal(got["y"], np.array(np.nonzero(x > 0.5)))
    np.testing.assert_array_equal(got["z"], x[x > 0.5])
  assert cache_stats()["compiles"] == before and compiles(km) == [1]
  assert km.run({"x": xs[2]})["y"].shape == (2, 0)
  check(m, {"x": xs[0]})


def test_a_reshape_to_the_element_count_of_a_count_compiles_once() -> None:
  """A Reshape to ReduceProd(Shape(NonZero(x))) (the positions flattened): the product of the shape's dims is a dim, 2 times
  the count, so the Reshape stays symbolic and the rest is compiled once at load for every count (none included)."""
  m = model([N("NonZero", ["x"], ["y"]), N("Shape", ["y"], ["s"]), N("ReduceProd", ["s"], ["p"], keepdims=1),
             N("Reshape", ["y", "p"], ["z"], allowzero=1)], {"x": f32(3, 4)}, {"z": np.int64}, {})  # allowzero: a count of 0 is a size
  km = konnx.load(m)
  assert km.program is not None and km.program.specialisations()[0].unbounded is None
  before = cache_stats()["compiles"]
  for x in (f32(3, 4), np.zeros((3, 4), np.float32), f32(3, 4) > 0.3):
    x = np.asarray(x, np.float32)
    np.testing.assert_array_equal(km.run({"x": x})["z"], np.array(np.nonzero(x)).reshape(-1))
  assert compiles(km) == [1] and cache_stats()["compiles"] == before


def test_a_count_the_rest_needs_as_a_number_falls_back_to_one_compile_per_count() -> None:
  """A Reshape to a shape computed from NonZero's count through float arithmetic (data, not a dim) cannot take the count
  as a runtime variable: the cut says why and compiles the rest per count, as before; the answers are the same."""
  m = model([N("NonZero", ["x"], ["y"]), N("Shape", ["y"], ["s"]), N("Cast", ["s"], ["fs"], to=1), N("ReduceProd", ["fs"], ["fp"], keepdims=1),
             N("Cast", ["fp"], ["p"], to=7), N("Reshape", ["y", "p"], ["z"], allowzero=1)], {"x": f32(3, 4)}, {"z": np.int64}, {})
  km = konnx.load(m)
  assert km.program is not None
  spec = km.program.specialisations()[0]
  for x in (f32(3, 4), np.zeros((3, 4), np.float32), f32(3, 4) > 0.3):
    x = np.asarray(x, np.float32)
    np.testing.assert_array_equal(km.run({"x": x})["z"], np.array(np.nonzero(x)).reshape(-1))
  assert spec.unbounded == "node <Reshape> (Reshape) needs a value computed from it (p) as a number"
  assert compiles(km) == [1 + 3]  # the bound continuation tried at load, then one per count


def test_no_nonzero_then_a_flatten_of_the_empty_positions() -> None:
  """As retinanet's first level with random weights: no score passes, the positions (0, 2) go on through a Flatten, which
  onnx's reference implementation cannot reshape (0, -1): shape inference gives the empty output instead."""
  m = model([N("NonZero", ["x"], ["nz"]), N("Transpose", ["nz"], ["t"]), N("Unsqueeze", ["t", "two"], ["u"]), N("Flatten", ["u"], ["y"])],
            {"x": f32(3, 4)}, {"y": np.int64}, {"two": i64(2)})
  check(m, {"x": np.zeros((3, 4), np.float32)})


def test_nonzero_of_nan_and_negative_zero_and_a_scalar() -> None:
  x = np.array([[np.nan, 0], [-0.0, 2]], np.float32)
  check(model([N("NonZero", ["x"], ["y"])], {"x": x}, {"y": np.int64}), {"x": x})
  s = np.array(3.0, np.float32)
  check(model([N("NonZero", ["x"], ["y"])], {"x": s}, {"y": np.int64}), {"x": s})


def test_unique_sorted_unsorted_and_along_an_axis() -> None:
  x = np.array([2, 1, 1, -0.0, 0.0, 2, 5, 1], np.float32)
  outs = {"y": np.float32, "i": np.int64, "v": np.int64, "c": np.int64}
  for s in (1, 0):
    check(model([N("Unique", ["x"], list(outs), sorted=s)], {"x": x}, outs), {"x": x})
  r = np.array([[1, 0, 0], [1, 0, 0], [2, 3, 4], [0, 5, 1], [0, 1, 6]], np.float32).T.copy()
  for s in (1, 0):
    check(model([N("Unique", ["x"], list(outs), sorted=s, axis=-1)], {"x": r}, outs), {"x": r})


def _nms_model(center: int = 0, fed: bool = False) -> Any:
  inputs = {"b": f32(2, 40, 4), "s": f32(2, 3, 40), "mx": i64(4), "iou": np.array([0.3], np.float32), "st": np.array([0.1], np.float32)}
  consts = {} if fed else {k: inputs.pop(k) for k in ("mx", "iou", "st")}
  return model([N("NonMaxSuppression", ["b", "s", "mx", "iou", "st"], ["sel"], center_point_box=center),
                N("Gather", ["sel", "two"], ["box"], axis=1), N("Squeeze", ["box", "one"], ["k"]), N("Gather", ["s", "k"], ["z"], axis=2)],
               inputs, {"sel": np.int64, "z": np.float32}, {**consts, "two": i64(2), "one": i64(1)})


def test_nms_host_step_both_box_forms_and_fed_thresholds() -> None:
  """Corners in either order and centre boxes; thresholds constant or fed; the selection is read by the rest of the model,
  compiled once at load for any number kept (a runtime variable each run binds). Its own generator: the numbers kept,
  which it asserts differ, must not hang on the order tests draw from the shared one."""
  rng = np.random.default_rng(139)
  def boxes() -> np.ndarray: return (np.abs(rng.uniform(-2, 2, (2, 40, 4))) * 3).astype(np.float32)  # corners in either order
  def scores() -> np.ndarray: return rng.uniform(0, 1, (2, 3, 40)).astype(np.float32)
  for center in (0, 1):
    for fed in (False, True):
      m = _nms_model(center, fed)
      feeds = {"b": boxes(), "s": scores()}
      if fed: feeds |= {"mx": i64(4), "iou": np.array([0.3], np.float32), "st": np.array([0.1], np.float32)}
      check(m, feeds)
  km = konnx.load(_nms_model(0, True))
  before = cache_stats()["compiles"]
  kept = set()
  for mx, st in ((4, 0.1), (1, 0.1), (4, 0.99), (9, 0.0)):  # a different number of boxes kept each run: no compile
    feeds = {"b": boxes(), "s": scores(), "mx": i64(mx), "iou": np.array([0.3], np.float32),
             "st": np.array([st], np.float32)}
    kept.add(km.run(feeds)["sel"].shape[0])
    check(_nms_model(0, True), feeds)
  assert len(kept) == 4 and compiles(km) == [1] and cache_stats()["compiles"] == before
  bad = {"b": f32(2, 40, 4), "s": f32(2, 3, 40), "mx": i64(4), "iou": np.array([1.5], np.float32), "st": np.array([0.1], np.float32)}
  with pytest.raises(ONNXError, match=r"iou_threshold 1.5 must be in \[0, 1\]"): konnx.load(_nms_model(0, True)).run(bad)


def test_nms_equal_scores_by_index_and_a_nan_score_refused() -> None:
  """Scores of a few values only: equal scores are taken by the lower box index, as onnxruntime. A NaN score, where
  onnxruntime's order is undefined, is refused by the run."""
  b = np.abs(f32(1, 50, 4)) * 4
  s = RNG.integers(0, 4, (1, 2, 50)).astype(np.float32) / 4
  m = model([N("NonMaxSuppression", ["b", "s", "mx", "iou"], ["sel"], name="nms")], {"b": b, "s": s}, {"sel": np.int64},
            {"mx": i64(30), "iou": np.array([0.2], np.float32)})
  km = check(m, {"b": b, "s": s})
  s[0, 1, 7] = np.nan
  with pytest.raises(ONNXError, match=r"node nms \(NonMaxSuppression\): a score of batch 0, class 1 is NaN"): km.run({"b": b, "s": s})


def test_a_cut_inside_a_branch_of_an_if_known_at_load() -> None:
  """As torchvision's batched_nms: the If on 'no boxes' folds at load, its else branch holds the NonMaxSuppression; the rest
  of the branch, then of the graph, are converted for the selection."""
  b, s = np.abs(f32(1, 30, 4)) * 3, f32(1, 1, 30, lo=0, hi=1)
  nms = [N("NonMaxSuppression", ["b", "s", "mx", "iou"], ["sel"]), N("Gather", ["sel", "two"], ["col"], axis=1),
         N("Squeeze", ["col", "one"], ["keep"])]
  then = helper.make_graph([N("Constant", [], ["none"], value=helper.make_tensor("v", 7, [0], []))], "then", [],
                           [helper.make_tensor_value_info("none", 7, None)])
  other = helper.make_graph(nms, "else", [], [helper.make_tensor_value_info("keep", 7, None)])
  m = model([N("Shape", ["b"], ["shp"]), N("ReduceProd", ["shp"], ["cnt"], keepdims=0), N("Equal", ["cnt", "zero"], ["c"]),
             N("If", ["c"], ["k"], then_branch=then, else_branch=other), N("Gather", ["b", "k"], ["kept"], axis=1)],
            {"b": b, "s": s}, {"kept": np.float32}, {"mx": i64(10), "iou": np.array([0.4], np.float32), "two": i64(2), "one": i64(1), "zero": i64(0)})
  km = check(m, {"b": b, "s": s})
  assert km.program is not None and "NonMaxSuppression" in km.program.tail.then.cut.label  # type: ignore[union-attr]


def test_roialign_fed_rois_both_modes_and_sampling() -> None:
  """Rois computed at run time, partly outside the map and one malformed (x2 < x1: made 1x1 by output_half_pixel, a
  negative grid with half_pixel and sampling_ratio 0, where onnxruntime fails and kiln refuses); sampling_ratio fixed, and
  0 (the largest grid read back at run time); avg and max."""
  x = f32(2, 3, 9, 11)
  rois = np.array([[0.5, 1.2, 6.7, 7.1], [-3, -2, 4.2, 12.5], [8.1, 2.0, 3.3, 8.8], [2.2, 2.2, 2.9, 3.1]], np.float32)
  bi = i64(0, 1, 1, 0)
  def roi_model(r: np.ndarray, **attrs: Any) -> Any:
    return model([N("RoiAlign", ["x", "r", "bi"], ["y"], output_height=3, output_width=2, spatial_scale=0.75, name="ra", **attrs)],
                 {"x": x, "r": r, "bi": bi[:len(r)]}, {"y": np.float32}, opset=16)
  for mode, sr, ctm in (("avg", 2, "output_half_pixel"), ("max", 0, "output_half_pixel"), ("max", 2, "half_pixel")):
    check(roi_model(rois, mode=mode, sampling_ratio=sr, coordinate_transformation_mode=ctm), {"x": x, "r": rois, "bi": bi})
  m = roi_model(rois, mode="avg", sampling_ratio=0, coordinate_transformation_mode="half_pixel")
  with pytest.raises(ONNXError, match=r"node ra \(RoiAlign.*sample grids"): konnx.load(m).run({"x": x, "r": rois, "bi": bi})  # onnxruntime fails
  check(roi_model(rois[:2], mode="avg", sampling_ratio=0, coordinate_transformation_mode="half_pixel"), {"x": x, "r": rois[:2], "bi": bi[:2]})
  with pytest.raises(IndexOutOfRangeError, match=r"node ra \(RoiAlign\): batch_indices: index 2 is out of range \[-2, 2\)"):
    konnx.load(roi_model(rois, sampling_ratio=2)).run({"x": x, "r": rois, "bi": i64(0, 2, 1, 0)})


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_over_a_symbolic_axis_with_a_fed_k(largest: int) -> None:
  """The axis is a model dim n in [0, 40] (the bitonic sort pads it to 64, the pads told by n's run-time value) and k is
  fed: one compile at load for every n and k (0, 1, the whole axis), NaN first for largest and last for smallest, ties by
  the lower index; a k over this run's n is refused by the run."""
  g = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, largest=largest)], "g",
                        [helper.make_tensor_value_info("x", 1, [3, "n"]), helper.make_tensor_value_info("k", 7, [1])],
                        [helper.make_tensor_value_info("v", 1, [3, "k"]), helper.make_tensor_value_info("i", 7, [3, "k"])])
  km = konnx.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), dims={"n": (0, 40)})
  before = cache_stats()["compiles"]
  for n, k in ((10, 3), (40, 40), (0, 0), (1, 1), (33, 20), (5, 0)):
    x = RNG.integers(0, 5, (3, n)).astype(np.float32)
    if n: x[0, 0] = np.nan
    got = km.run({"x": x, "k": i64(k)})
    order = np.argsort(np.where(np.isnan(x), -np.inf if largest else np.inf, -x if largest else x), 1, kind="stable")[:, :k]
    np.testing.assert_array_equal(got["i"], order)
    np.testing.assert_array_equal(got["v"], np.take_along_axis(x, order, 1))
  assert compiles(km) == [1] and cache_stats()["compiles"] == before
  with pytest.raises(ONNXError, match=r"<k of node <TopK>> is 6, outside \[0, 5\] \(n in this run\)"):
    km.run({"x": np.zeros((3, 5), np.float32), "k": i64(6)})


def test_a_length_deciding_an_if_whose_branch_reads_a_value_back_compiles_once() -> None:
  """NonZero's count decides an If ("no nonzero?") whose else branch reads a count back itself (torchvision's batched_nms):
  with the count a variable the If cannot be a run-time branch (a cut inside one), so the graph is cut before it on its
  condition, and both continuations are compiled at load, the count still a variable in each: no run compiles a kernel,
  whatever the count, and every run gives onnxruntime's answer (the then branch for no nonzero)."""
  then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=helper.make_tensor("v", 7, [], [0]))], "then", [],
                           [helper.make_tensor_value_info("t", 7, [])])
  other = helper.make_graph([helper.make_node("NonZero", ["x"], ["z"]), helper.make_node("ReduceSum", ["z"], ["r"], keepdims=0)], "else", [],
                            [helper.make_tensor_value_info("r", 7, [])])
  m = model([N("NonZero", ["x"], ["y"]), N("Shape", ["y"], ["s"]), N("Gather", ["s", "one"], ["g"]), N("Cast", ["g"], ["f"], to=1),
             N("Equal", ["f", "zero"], ["c"]), N("If", ["c"], ["o"], then_branch=then, else_branch=other, name="if")],
            {"x": f32(3, 4)}, {"o": np.int64}, {"zero": np.float32(0).reshape(()), "one": i64(1).reshape(())})
  km = konnx.load(m)
  assert km.program is not None
  specs = km.program.specialisations()
  assert [s.unbounded for s in specs] == [None] * len(specs)
  assert specs[1].cut.label == "node if (If)" and specs[1].compiles == 2  # both conditions, at load
  before, counts = cache_stats()["compiles"], compiles(km)
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for x in (f32(3, 4), np.zeros((3, 4), np.float32), np.eye(3, 4, dtype=np.float32), f32(3, 4)):
    np.testing.assert_array_equal(km.run({"x": x})["o"], sess.run(None, {"x": x})[0])
  assert cache_stats()["compiles"] == before and compiles(km) == counts


def test_an_if_whose_outputs_differ_in_shape_by_branch_is_cut_on_its_condition() -> None:
  """A run-time If whose then branch gives an empty (0,) and else branch a (4,) cannot be one Switch: the main graph is cut
  on its condition, both continuations compiled at load, and each run gives the branch's own shape."""
  then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=helper.make_tensor("v", 1, [0], []))], "then", [],
                           [helper.make_tensor_value_info("t", 1, None)])
  other = helper.make_graph([helper.make_node("Neg", ["x"], ["r"])], "else", [], [helper.make_tensor_value_info("r", 1, None)])
  m = model([N("ReduceSum", ["x"], ["sm"], keepdims=0), N("Less", ["sm", "zero"], ["c"]),
             N("If", ["c"], ["o"], then_branch=then, else_branch=other, name="if"), N("Relu", ["o"], ["y"])],
            {"x": f32(4)}, {"y": np.float32}, {"zero": np.float32(0).reshape(())})
  km = konnx.load(m)
  assert km.program is not None and compiles(km) == [2]
  before = cache_stats()["compiles"]
  for x in (np.array([1, 2, -1, 0.5], np.float32), np.array([-1, -2, 1, 0.5], np.float32)):
    got = km.run({"x": x})["y"]
    np.testing.assert_array_equal(got, np.zeros(0, np.float32) if x.sum() < 0 else np.maximum(-x, 0))
  assert cache_stats()["compiles"] == before


def test_a_slice_to_a_fixed_end_of_a_length_read_back_is_a_capped_variable() -> None:
  """[0:6] of NonZero's positions (torchvision's keep[:detections_per_img]) is min(6, count) rows: a capped variable each run
  binds from the count, so the rest is compiled once at load; counts below, at and above 6, and none. The same of a model
  input's symbolic dim."""
  m = model([N("NonZero", ["x"], ["y"]), N("Slice", ["y", "z", "e", "one"], ["s"]), N("Neg", ["s"], ["o"])],
            {"x": f32(4, 5)}, {"o": np.int64}, {"z": i64(0), "e": i64(6), "one": i64(1)})
  km = konnx.load(m)
  assert compiles(km) == [1] and km.program is not None and km.program.specialisations()[0].unbounded is None
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  before = cache_stats()["compiles"]
  for x in (f32(4, 5), np.zeros((4, 5), np.float32), np.eye(4, 5, dtype=np.float32), np.ones((4, 5), np.float32), np.eye(4, 5, 1, dtype=np.float32)):
    got, want = km.run({"x": x})["o"], sess.run(None, {"x": x})[0]
    assert got.shape == want.shape and (got == want).all()
  assert cache_stats()["compiles"] == before
  inits = [helper.make_tensor(k, 7, [1], v) for k, v in (("z", [0]), ("e", [3]), ("one", [0]))]
  g = helper.make_graph([N("Slice", ["x", "z", "e", "one"], ["s"]), N("Relu", ["s"], ["o"])], "g", [helper.make_tensor_value_info("x", 1, ["n", 2])],
                        [helper.make_tensor_value_info("o", 1, ["m", 2])], inits)
  km = konnx.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), dims={"n": (1, 8)})
  for n in (1, 3, 8):
    x = f32(n, 2, lo=-1)
    np.testing.assert_array_equal(km.run({"x": x})["o"], np.maximum(x[:3], 0))


def test_nms_over_boxes_of_a_length_read_back_compiles_once() -> None:
  """As torchvision's detectors: NonMaxSuppression over the boxes TopK keeps, k fed (a length each run binds): the host step
  reads this run's boxes, and the selection's bound is the boxes' bound; one compile at load for every k."""
  b, s = np.abs(f32(1, 40, 4)) * 3, f32(1, 40, lo=0, hi=1)
  b[..., 2:] += b[..., :2]
  m = model([N("TopK", ["s", "k"], ["v", "i"], axis=1), N("Gather", ["b", "i"], ["bk"], axis=1), N("Squeeze", ["bk", "zero"], ["bs"]),
             N("Unsqueeze", ["v", "one"], ["vs"]), N("NonMaxSuppression", ["bs", "vs", "mx", "iou"], ["sel"])],
            {"b": b, "s": s, "k": i64(10)}, {"sel": np.int64}, {"mx": i64(5), "iou": np.array([0.3], np.float32), "zero": i64(0), "one": i64(1)})
  km = konnx.load(m)
  assert km.program is not None and all(sp.unbounded is None for sp in km.program.specialisations())
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  before = cache_stats()["compiles"]
  for k in (10, 0, 40, 3):
    feeds = {"b": b, "s": s, "k": i64(k)}
    np.testing.assert_array_equal(km.run(feeds)["sel"], sess.run(None, feeds)[0])
  assert cache_stats()["compiles"] == before


@pytest.mark.parametrize("rank_max", [64, 1024])
def test_topk_over_rows_of_a_symbolic_batch(monkeypatch: pytest.MonkeyPatch, rank_max: int) -> None:
  """TopK along a fixed axis of rows whose batch is symbolic (yolo26n's head exported with a dynamic batch): by counting and
  by the bitonic sort (RANK_MAX_N = 64: the 100-wide axis padded to 128), at batches 1, 3 and 4 of one load."""
  monkeypatch.setattr(onnx_ops_select, "RANK_MAX_N", rank_max)
  g = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)], "g", [helper.make_tensor_value_info("x", 1, ["batch", 100])],
                        [helper.make_tensor_value_info("v", 1, ["batch", 7]), helper.make_tensor_value_info("i", 7, ["batch", 7])],
                        [helper.make_tensor("k", 7, [1], [7])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  km = konnx.load(m, dims={"batch": (1, 4)})
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for b in (1, 3, 4):
    x = RNG.integers(0, 20, (b, 100)).astype(np.float32)  # ties: the lower index first
    for got, want in zip(km.run({"x": x}).values(), sess.run(None, {"x": x})): np.testing.assert_array_equal(got, want)
