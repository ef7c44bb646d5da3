"""Values that set a shape or axes but are computed at run time (kiln.graph.specialise): the rest of the model is converted
and compiled for each value a run reads back, cached by it. Every result is checked against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_case import N, check, f32, helper, model, ort

from kiln.graph import onnx as konnx
from kiln.graph import specialise
from kiln.graph.lazy import ONNXError


def i64(*v: int) -> np.ndarray: return np.array(v, np.int64)


def compare(m: object, km: konnx.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # type: ignore[attr-defined]
  got = km.run(feeds)
  for name, w in zip(got, want):
    assert got[name].shape == w.shape and got[name].dtype == w.dtype, (name, got[name].shape, w.shape)
    np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5)
  return got


def compiles(km: konnx.Model) -> list[int]:
  assert km.program is not None
  return [s.compiles for s in km.program.specialisations()]


def test_reshape_to_a_fed_shape_compiles_once_per_value() -> None:
  """x*x is computed before the cut and read in place by the continuation, the shape is computed at run time (s + 0): a
  second shape compiles once more, the first one again compiles nothing."""
  x = f32(2, 3, 4)
  m = model([N("Mul", ["x", "x"], ["x2"]), N("Add", ["s", "zero"], ["s2"]), N("Reshape", ["x2", "s2"], ["r"]), N("Relu", ["r"], ["y"])],
            {"x": x, "s": i64(4, 3, 2)}, {"y": np.float32}, {"zero": i64(0, 0, 0)})
  km = konnx.load(m)
  assert km.plan is None and compiles(km) == [0]
  for shape, n in (((4, 3, 2), 1), ((6, -1, 1), 2), ((4, 3, 2), 2), ((0, 12, 1), 3)):
    assert compare(m, km, {"x": x, "s": i64(*shape)})["y"].ndim == 3
    assert compiles(km) == [n]
  assert len(km.plans) == 1 + 3  # the prefix (x*x, s + 0) and one plan per shape
  out, prof = km.run_profiled({"x": x, "s": i64(6, 4, 1)})
  assert out["y"].shape == (6, 4, 1) and prof is not None and len(prof.table()) > 0
  assert "compiled at run time for each value of s2" in km.summary()
  with pytest.raises(ONNXError, match=r"compiled at run time from node .*Reshape.*PlanSpec"): km.export()


def test_reduce_over_fed_axes() -> None:
  x = f32(3, 4, 5)
  for keepdims in (0, 1):
    m = model([N("ReduceSum", ["x", "a"], ["y"], keepdims=keepdims)], {"x": x, "a": i64(1, 2)}, {"y": np.float32}, opset=13)
    km = konnx.load(m)
    for axes in ((1, 2), (0, -1), (2, 0)): compare(m, km, {"x": x, "a": i64(*axes)})


def test_resize_to_fed_sizes() -> None:
  x = f32(1, 2, 4, 6)
  m = model([N("Resize", ["x", "", "", "sz"], ["y"], mode="linear")], {"x": x, "sz": i64(1, 2, 8, 9)}, {"y": np.float32}, opset=13)
  km = konnx.load(m)
  for sz in ((1, 2, 8, 9), (1, 2, 3, 5)): compare(m, km, {"x": x, "sz": i64(*sz)})


def test_a_fed_window_and_a_branch_before_the_cut() -> None:
  """A Slice with starts and ends both fed is one window (a start and a length per axis, runtime variables a host step binds:
  compiled once at load); the If before it is a run-time branch of the prefix."""
  x = f32(6, 5)
  then = helper.make_graph([N("Neg", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", 1, [6, 5])])
  other = helper.make_graph([N("Exp", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, [6, 5])])
  feeds = {"x": x, "c": np.array(True), "starts": i64(1, 0), "ends": i64(5, 4)}
  m = model([N("If", ["c"], ["z"], then_branch=then, else_branch=other), N("Slice", ["z", "starts", "ends"], ["y"])], feeds, {"y": np.float32})
  km = konnx.load(m)
  for c, b, e in ((True, (1, 0), (5, 4)), (False, (1, 0), (5, 4)), (False, (0, 2), (-1, 5)), (True, (1, 0), (5, 4))):
    compare(m, km, {**feeds, "c": np.array(c), "starts": i64(*b), "ends": i64(*e)})
  assert compiles(km) == [1]  # the window's continuation, at load


@pytest.mark.parametrize("symbolic", [False, True])
def test_a_slice_window_computed_from_data_compiles_once(symbolic: bool) -> None:
  """x[:, s:e] and x[a:b, s:e] with the bounds computed from data (an ArgMax and a count, fed ints), Python's clamping:
  negative starts, ends past the axis, an empty window, the whole axis; over a fixed or a symbolic batch. One compile at
  load, none in any run, each result onnxruntime's."""
  g = helper.make_graph([N("Add", ["st", "zero"], ["s2"]), N("Slice", ["x", "s2", "en", "ax"], ["y"]), N("Relu", ["y"], ["o"])], "g",
                        [helper.make_tensor_value_info("x", 1, ["b" if symbolic else 4, 10]), helper.make_tensor_value_info("st", 7, [2]),
                         helper.make_tensor_value_info("en", 7, [2])], [helper.make_tensor_value_info("o", 1, ["r", "c"])],
                        [helper.make_tensor("zero", 7, [2], [0, 0]), helper.make_tensor("ax", 7, [2], [0, 1])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  km = konnx.load(m, dims={"b": (1, 6)} if symbolic else None)
  assert compiles(km) == [1] and all(sp.unbounded is None for sp in km.program.specialisations())  # type: ignore[union-attr]
  from kiln.executor import cache_stats
  before = cache_stats()["compiles"]
  for rows, st, en in ((4, (1, 2), (3, 7)), (4, (-3, -12), (100, -1)), (3 if symbolic else 4, (2, 6), (1, 6)), (4, (0, 0), (4, 10)),
                       (6 if symbolic else 4, (-1, 9), (2**62, 2**62))):
    compare(m, km, {"x": f32(rows, 10), "st": i64(*st), "en": i64(*en)})
  assert cache_stats()["compiles"] == before


def test_a_bad_value_is_a_typed_error_at_run_time_naming_the_node() -> None:
  x = f32(2, 6)
  m = model([N("Reshape", ["x", "s"], ["y"], name="rs")], {"x": x, "s": i64(3, 4)}, {"y": np.float32})
  km = konnx.load(m)
  for _ in range(2):  # the refusal is cached: the second run converts nothing
    with pytest.raises(ONNXError, match=r"node rs \(Reshape.*cannot reshape.*for s = \[5, 5\]"): km.run({"x": x, "s": i64(5, 5)})
  assert compiles(km) == [1]
  compare(m, km, {"x": x, "s": i64(4, 3)})  # the model still runs
  m = model([N("ReduceMax", ["x", "a"], ["y"], name="rm")], {"x": x, "a": i64(1)}, {"y": np.float32}, opset=18)
  with pytest.raises(ONNXError, match=r"node rm \(ReduceMax.*axis 2 is out of range for rank 2"): konnx.load(m).run({"x": x, "a": i64(2)})
  m = model([N("ConstantOfShape", ["s"], ["y"], name="cs")], {"s": i64(2, 3)}, {"y": np.float32})
  with pytest.raises(ONNXError, match=r"node cs \(ConstantOfShape"): konnx.load(m).run({"s": i64(2, -3)})
  f = {k: np.array(v, np.float32) for k, v in (("a", 0), ("b", 5), ("c", 0))}  # three links: the message gives every value read
  m = model([N("Range", ["a", "b", "c"], ["y"], name="rg")], f, {"y": np.float32}, opset=11)
  with pytest.raises(ONNXError, match=r"node rg \(Range.*non-zero delta.*for a = 0.0, b = 5.0, c = 0.0"): konnx.load(m).run(f)


def test_out_of_memory_is_raised_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
  """A machine's failure while compiling a continuation is an ONNXError naming the cut, and the next run tries again."""
  from kiln.runtime.cpu.buffer import OutOfMemoryError
  x = f32(2, 6)
  m = model([N("Reshape", ["x", "s"], ["y"], name="rs")], {"x": x, "s": i64(3, 4)}, {"y": np.float32})
  km = konnx.load(m)
  real = specialise.Builder.tail
  def fail(*a: object, **k: object) -> None: raise OutOfMemoryError("no memory left (test)")
  monkeypatch.setattr(specialise.Builder, "tail", fail)
  with pytest.raises(ONNXError, match=r"compiling the model from node rs \(Reshape\) on.*s = \[3, 4\] failed: OutOfMemoryError"):
    km.run({"x": x, "s": i64(3, 4)})
  monkeypatch.setattr(specialise.Builder, "tail", real)
  compare(m, km, {"x": x, "s": i64(3, 4)})
  assert compiles(km) == [1]


def test_only_the_most_recent_values_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(specialise, "MAX_SPECIALISATIONS", 2)
  x = f32(12)
  m = model([N("Reshape", ["x", "s"], ["y"])], {"x": x, "s": i64(3, 4)}, {"y": np.float32})
  km = konnx.load(m)
  for shape in ((3, 4), (4, 3), (2, 6), (4, 3)): compare(m, km, {"x": x, "s": i64(*shape)})
  assert compiles(km) == [3] and len(km.plans) == 2
  compare(m, km, {"x": x, "s": i64(3, 4)})  # dropped: compiled again
  assert compiles(km) == [4]


def test_a_fed_pad_value_is_a_kernel_input_not_a_specialisation() -> None:
  x = f32(3, 4)
  m = model([N("Pad", ["x", "p", "v"], ["y"])], {"x": x, "v": np.array(2.5, np.float32)}, {"y": np.float32}, {"p": i64(1, 0, -1, 2)}, opset=18)
  km = konnx.load(m)
  assert km.program is None and km.plan is not None
  for v in (2.5, -1.0): compare(m, km, {"x": x, "v": np.array(v, np.float32)})


def test_fed_dropout_training_mode() -> None:
  x = f32(4)
  m = model([N("Dropout", ["x", "r", "t"], ["y"])], {"x": x, "t": np.array(False)}, {"y": np.float32}, {"r": np.array(0.5, np.float32)}, opset=13)
  km = konnx.load(m)
  compare(m, km, {"x": x, "t": np.array(False)})
  with pytest.raises(ONNXError, match="training_mode is true"): km.run({"x": x, "t": np.array(True)})


def test_where_kiln_does_not_specialise_it_refuses_at_load() -> None:
  """Over MAX_SPECIALISED_ELEMENTS, or inside a Loop body, a value computed at run time is refused at load; in a run-time If
  of the main graph the If is cut on its condition first, so its branch may cut again."""
  x = f32(2, 6)
  big = model([N("Reshape", ["x", "s"], ["y"], name="rs")], {"x": x, "s": np.ones(65, np.int64)}, {"y": np.float32})
  with pytest.raises(ONNXError, match=r"node rs \(Reshape.*up to 65 elements.*MAX_SPECIALISED_ELEMENTS = 64"): konnx.load(big)
  then = helper.make_graph([N("Reshape", ["x", "s"], ["t"])], "then", [], [helper.make_tensor_value_info("t", 1, None)])
  other = helper.make_graph([N("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, None)])
  sub = model([N("If", ["c"], ["y"], then_branch=then, else_branch=other)], {"x": x, "c": np.array(True), "s": i64(6, 2)}, {"y": np.float32})
  for c in (True, False):  # in the main graph the If is cut on its condition, and its then branch on the shape
    check(sub, {"x": x, "c": np.array(c), "s": i64(6, 2)})
  loop_body = helper.make_graph([N("Identity", ["c_in"], ["c_out"]), N("If", ["c"], ["w"], then_branch=then, else_branch=other)], "body",
                                [helper.make_tensor_value_info("i", 7, []), helper.make_tensor_value_info("c_in", 9, []),
                                 helper.make_tensor_value_info("v", 1, None)],
                                [helper.make_tensor_value_info("c_out", 9, []), helper.make_tensor_value_info("w", 1, None)])
  looped = model([N("Loop", ["m", "", "x"], ["y"], body=loop_body)], {"x": x, "c": np.array(True), "s": i64(6, 2)}, {"y": np.float32},
                 {"m": np.array(2, np.int64)})
  with pytest.raises(ONNXError, match=r"input 1 \(shape\) is computed at run time: kiln specialises .* only in its main graph"):
    konnx.load(looped).run({"x": x, "c": np.array(True), "s": i64(6, 2)})
