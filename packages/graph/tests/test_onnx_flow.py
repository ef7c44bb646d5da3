"""ONNX control flow (If, Loop, Scan) against onnxruntime: an If folded at load, an If chosen at run time from one load
(no recompile), outer-scope values, nesting, unrolled loops and scans, errors naming the node path, and the ONNX
project's own node tests for the three operators."""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest
from onnx_case import N, check, f32, helper, model, numpy_helper, onnx, ort  # (skips this module without onnx or onnxruntime)

from kiln.executor.cache import cache_stats
from kiln.graph import IndexOutOfRangeError, ONNXError, onnx_limits, onnx_scope
from kiln.graph import onnx as konnx
from kiln.graph.program import Switch

F, B, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL, onnx.TensorProto.INT64


def vi(name: str, t: int, shape: list | None) -> onnx.ValueInfoProto: return helper.make_tensor_value_info(name, t, shape)


def graph(nodes: list, outs: list[tuple[str, list | None]], name: str = "g", ins: list | None = None, t: int = F) -> onnx.GraphProto:
  return helper.make_graph(nodes, name, ins or [], [vi(o, t, s) for o, s in outs])


def ort_run(m: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  return dict(zip([o.name for o in m.graph.output], sess.run(None, feeds)))


def same(got: dict, want: dict) -> None:
  for k, w in want.items():
    assert got[k].shape == w.shape and got[k].dtype == w.dtype, (k, got[k].shape, w.shape)
    np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5)


# then: relu(x * w); else: the row sums of x - w, broadcast back. x is computed outside (Exp), w an initializer of the main graph
THEN = graph([N("Mul", ["x", "w"], ["t0"]), N("Relu", ["t0"], ["t"])], [("t", [2, 3])], "then")
ELSE = graph([N("Sub", ["x", "w"], ["e0"]), N("ReduceSum", ["e0", "ax"], ["e1"], keepdims=1), N("Expand", ["e1", "shp"], ["e"])],
             [("e", [2, 3])], "else")
INITS = {"w": f32(2, 3), "ax": np.array([1], np.int64), "shp": np.array([2, 3], np.int64)}


@pytest.mark.parametrize("cond", ["shape", "true", "false"])
def test_if_known_at_load_converts_the_branch_taken(cond: str) -> None:
  """torch's usual export: the condition folds from static shapes (or is a constant). Only the branch taken converts: the
  other holds an operator kiln refuses, and the plan is one plan."""
  bad = graph([N("Hardmax", ["x"], ["nz"]), N("Cast", ["nz"], ["e"], to=F)], [("e", None)], "bad")
  c = {"shape": [N("Shape", ["x0"], ["s"]), N("Gather", ["s", "zero"], ["d"], axis=0), N("Equal", ["d", "two"], ["c"])],
       "true": [N("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True)))],
       "false": [N("Constant", [], ["c"], value=numpy_helper.from_array(np.array([False])))]}[cond]
  br = (THEN, bad) if cond != "false" else (bad, THEN)
  nodes = [*c, N("Exp", ["x0"], ["x"]), N("If", ["c"], ["y"], then_branch=br[0], else_branch=br[1]), N("Add", ["y", "x"], ["z"])]
  km = check(model(nodes, {"x0": f32(2, 3)}, {"z": np.float32}, {**INITS, "zero": np.array(0, np.int64), "two": np.array(2, np.int64)}),
             {"x0": f32(2, 3)})
  assert km.program is None and km.plan is not None


def test_if_at_run_time_runs_either_branch_from_one_load() -> None:
  """cond is fed: both branches compile at load, each run picks one; nothing compiles again, no plan changes, and the
  segments share their buffers (the branch's output is one buffer both sides write and the next segment reads)."""
  nodes = [N("Exp", ["x0"], ["x"]), N("If", ["c"], ["y"], then_branch=THEN, else_branch=ELSE, name="if1"), N("Add", ["y", "x"], ["z"])]
  x = f32(2, 3)
  m = model(nodes, {"x0": x, "c": np.array(True)}, {"z": np.float32}, INITS)
  km = konnx.load(m)
  assert km.program is not None and km.plan is None and len(km.plans) == 4, km.summary()
  plans, before = list(km.plans), cache_stats()
  outs = {}
  for c in (True, False, True):
    f = {"x0": x, "c": np.array(c)}
    outs[c] = km.run(f)["z"]
    same({"z": outs[c]}, ort_run(m, f))
  assert not np.allclose(outs[True], outs[False])
  after = cache_stats()
  assert [after[k] - before[k] for k in ("compiles", "memory_hits", "disk_hits")] == [0, 0, 0]
  assert all(a is b for a, b in zip(plans, km.plans))
  sw = next(s for s in km.program.steps if isinstance(s, Switch))
  shared = {id(b) for b in sw.then[-1].plan.buffers} & {id(b) for b in sw.else_[-1].plan.buffers} & {id(b) for b in km.program.steps[-1].plan.buffers}
  assert shared, "the branch output is not one buffer"


def test_nested_if_reads_every_enclosing_scope() -> None:
  """An If inside a branch, both on fed conditions: the inner branches read a model input, a value computed in the main
  graph and one computed in the outer branch; all four paths from one load."""
  inner_t = graph([N("Mul", ["u", "x"], ["it"])], [("it", [2, 3])], "inner_then")
  inner_e = graph([N("Sub", ["u", "x0"], ["ie0"]), N("Neg", ["ie0"], ["ie"])], [("ie", [2, 3])], "inner_else")
  then = graph([N("Tanh", ["x"], ["u"]), N("If", ["c2"], ["v"], then_branch=inner_t, else_branch=inner_e, name="inner"),
                N("Add", ["v", "u"], ["t"])], [("t", [2, 3])], "then")
  els = graph([N("Sigmoid", ["x0"], ["e"])], [("e", [2, 3])], "else")
  nodes = [N("Exp", ["x0"], ["x"]), N("If", ["c1"], ["y"], then_branch=then, else_branch=els, name="outer"), N("Mul", ["y", "x"], ["z"])]
  x = f32(2, 3)
  m = model(nodes, {"x0": x, "c1": np.array(True), "c2": np.array(True)}, {"z": np.float32})
  km = konnx.load(m)
  for c1 in (True, False):
    for c2 in (True, False):
      f = {"x0": x, "c1": np.array(c1), "c2": np.array(c2)}
      same(km.run(f), ort_run(m, f))


def test_if_at_run_time_with_symbolic_dims_and_index_checks() -> None:
  """A batch dim given bounds reaches the branches' plans; a Gather's run-time index check inside a branch names the
  node's path, and the model runs on after it."""
  then = graph([N("Gather", ["x", "idx"], ["t"], axis=1, name="g")], [("t", ["b", 2])], "then")
  els = graph([N("ReduceMax", ["x", "ax"], ["e"], keepdims=1)], [("e", ["b", 1])], "else")
  els.output[0].type.tensor_type.shape.dim[1].dim_value = 2
  els.node[0].op_type = "Slice"
  els.node[0].ClearField("attribute")
  els.node[0].input[:] = ["x", "st", "en", "ax"]
  nodes = [N("If", ["c"], ["y"], then_branch=then, else_branch=els, name="if1"), N("Add", ["y", "y"], ["z"])]
  m = model(nodes, {"x": f32(3, 4), "c": np.array(True), "idx": np.array([0, 2], np.int64)}, {"z": np.float32},
            {"ax": np.array([1], np.int64), "st": np.array([1], np.int64), "en": np.array([3], np.int64)})
  m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "b"
  km = konnx.load(m, dims={"b": (1, 4)})
  for b in (3, 1):
    for c in (True, False):
      f = {"x": f32(b, 4), "c": np.array(c), "idx": np.array([0, -1], np.int64)}
      same(km.run(f), ort_run(m, f))
  with pytest.raises(IndexOutOfRangeError, match=r"node if1 > then_branch > node g \(Gather\).*index 4"):
    km.run({"x": f32(2, 4), "c": np.array(True), "idx": np.array([0, 4], np.int64)})
  f = {"x": f32(2, 4), "c": np.array(False), "idx": np.array([0, 4], np.int64)}  # the other branch reads no index
  same(km.run(f), ort_run(m, f))


def _loop_body(stop_after: int | None) -> onnx.GraphProto:
  """y += x * i, a scan output of y and one of i * 2; the condition out is cond_in, or i < stop_after (folds at load)."""
  cond = [N("Identity", ["cond_in"], ["cond_out"])] if stop_after is None else [N("Less", ["i", "lim"], ["cond_out"])]
  return helper.make_graph(
    [*cond, N("Cast", ["i"], ["fi"], to=F), N("Mul", ["x", "fi"], ["xi"]), N("Add", ["y_in", "xi"], ["y_out"]), N("Identity", ["y_out"], ["sy"]),
     N("Add", ["i", "i"], ["si"])], "body", [vi("i", I64, []), vi("cond_in", B, []), vi("y_in", F, [2, 3])],
    [vi("cond_out", B, []), vi("y_out", F, [2, 3]), vi("sy", F, [2, 3]), vi("si", I64, [])])


@pytest.mark.parametrize("kind", ["for", "for-while", "while", "no-cond"])
def test_loop_unrolled(kind: str) -> None:
  """A trip count and conditions known at load: carried values and scan outputs as onnxruntime gives them."""
  m_in, c_in, stop = {"for": ("M", "T", None), "for-while": ("M", "T", 2), "while": ("", "T", 3), "no-cond": ("M", "", 2)}[kind]
  nodes = [N("Exp", ["x0"], ["x"]), N("Loop", [m_in, c_in, "y0"], ["y", "sy", "si"], body=_loop_body(stop), name="lp")]
  inits = {"M": np.array(4, np.int64), "T": np.array(True), "lim": np.array(stop or 0, np.int64), "y0": f32(2, 3)}
  check(model(nodes, {"x0": f32(2, 3)}, {"y": np.float32, "sy": np.float32, "si": np.int64}, inits), {"x0": f32(2, 3)})


def _run_time_loop_model(trips: bool) -> onnx.ModelProto:
  """y += x * i while sum(y) < lim (a condition computed from data each iteration), x read from the outer graph (a
  capture), the body holding a run-time If (y doubled when i is odd); M fed (trips) or absent (a while loop)."""
  odd = [N("Mod", ["i", "two"], ["r"]), N("Cast", ["r"], ["rb"], to=B)]
  dbl = helper.make_graph([N("Add", ["y_out", "y_out"], ["d"])], "then", [], [vi("d", F, [2, 3])])
  same_ = helper.make_graph([N("Identity", ["y_out"], ["d"])], "else", [], [vi("d", F, [2, 3])])
  body = helper.make_graph([N("Cast", ["i"], ["fi"], to=F), N("Mul", ["x", "fi"], ["xi"]), N("Add", ["y_in", "xi"], ["y_out"]), *odd,
                            N("If", ["rb"], ["y2"], then_branch=dbl, else_branch=same_), N("ReduceSum", ["y2"], ["s"], keepdims=0),
                            N("Less", ["s", "lim"], ["cond_out"])], "body",
                           [vi("i", I64, []), vi("cond_in", B, []), vi("y_in", F, [2, 3])], [vi("cond_out", B, []), vi("y2", F, [2, 3])])
  feeds = {"x0": f32(2, 3), "y0": f32(2, 3), "lim": np.array(40.0, np.float32)} | ({"M": np.array(5, np.int64)} if trips else {})
  return model([N("Exp", ["x0"], ["x"]), N("Loop", ["M" if trips else "", "" if trips else "go", "y0"], ["y"], body=body, name="lp")], feeds,
               {"y": np.float32}, {"two": np.array(2, np.int64)} | ({} if trips else {"go": np.array(True)}))


@pytest.mark.parametrize("trips", [True, False])
def test_loop_at_run_time_compiles_once(trips: bool, monkeypatch: pytest.MonkeyPatch) -> None:
  """A trip count fed at run time, or none and a condition the body computes from data: the body is compiled once, at
  load (a LoopStep), and every run steps it as many times as the data says (0 to many), as onnxruntime; a condition that
  never turns false stops at MAX_LOOP_ITERATIONS with an error, never a hang."""
  from kiln.graph import program
  m = _run_time_loop_model(trips)
  km = konnx.load(m)
  assert km.program is not None and any(isinstance(s, program.LoopStep) for s in km.program.steps)
  before = cache_stats()["compiles"]
  for k, lim in enumerate((40.0, -1.0, 1e4, 5.0)):
    f = {"x0": f32(2, 3), "y0": f32(2, 3), "lim": np.array(lim, np.float32)} | ({"M": np.array((0, 1, 7, 3)[k], np.int64)} if trips else {})
    same(km.run(f), ort_run(m, f))
  assert cache_stats()["compiles"] == before
  monkeypatch.setattr(program, "MAX_LOOP_ITERATIONS", 4)
  f = {"x0": f32(2, 3), "y0": f32(2, 3), "lim": np.array(1e30, np.float32)} | ({"M": np.array(9, np.int64)} if trips else {})
  with pytest.raises(ONNXError, match=r"node lp \(Loop\) runs over MAX_LOOP_ITERATIONS = 4 iterations"): km.run(f)


@pytest.mark.parametrize("kind", ["fed M", "while", "M and a data condition"])
def test_loop_at_run_time_with_scan_outputs_compiles_once(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
  """Scan outputs of a loop run a number of times known only at run time (M fed, a condition from data, or both): the body
  is compiled once, each iteration writes its scan rows into slots with room for the bound, and the iterations run are a
  length read back after the loop, so the rest of the model (here a Relu of each scan output and a ReduceSum over the
  iterations) is compiled once too, at load: every run matches onnxruntime, 0 iterations included, and none compiles.
  A run past the rows there is room for is refused, naming the loop."""
  from kiln.graph import onnx_limits
  stop = None if kind == "fed M" else 0
  body = _loop_body(stop)
  if stop is not None:  # the condition from data: i < lim, lim fed
    body.node[0].input[:] = ["i", "lim_in"]
  nodes = [N("Exp", ["x0"], ["x"]), N("Loop", ["" if kind == "while" else "M", "T", "y0"], ["y", "sy", "si"], body=body, name="lp"),
           N("Relu", ["sy"], ["ry"]), N("ReduceSum", ["si"], ["ssum"], keepdims=0)]
  feeds = {"x0": f32(2, 3), "y0": f32(2, 3)} | ({} if kind == "while" else {"M": np.array(4, np.int64)}) | \
    ({} if stop is None else {"lim_in": np.array(3, np.int64)})
  m = model(nodes, feeds, {"y": np.float32, "ry": np.float32, "ssum": np.int64}, {"T": np.array(True)})
  km = konnx.load(m)
  assert km.program is not None and all(sp.unbounded is None for sp in km.program.specialisations())
  before = cache_stats()["compiles"]
  for trips, lim in ((4, 3), (0, 5), (7, 0), (2, 9)):
    f = {"x0": f32(2, 3), "y0": f32(2, 3)} | ({} if kind == "while" else {"M": np.array(trips, np.int64)}) | \
      ({} if stop is None else {"lim_in": np.array(lim, np.int64)})
    same(km.run(f), ort_run(m, f))
  assert cache_stats()["compiles"] == before
  monkeypatch.setattr(onnx_limits, "MAX_SCAN_BYTES", 5 * 2 * 3 * 4)  # room for 5 rows of the (2, 3) float32 scan output
  small = konnx.load(m)
  f = {"x0": f32(2, 3), "y0": f32(2, 3)} | ({} if kind == "while" else {"M": np.array(9, np.int64)}) | \
    ({} if stop is None else {"lim_in": np.array(9, np.int64)})
  with pytest.raises(ONNXError, match=r"node lp \(Loop\) runs more than the 5 iterations its scan outputs have room for"): small.run(f)


def test_a_carried_value_that_changes_shape_is_unrolled_per_trip_count() -> None:
  """A loop-carried value that doubles each iteration cannot be one run-time loop (each carried value keeps its shape): with
  M fed the loop is unrolled for each M read back instead (compiled per value), as onnxruntime computes it; with a
  condition from data it is refused, naming the value."""
  body = helper.make_graph([N("Identity", ["c_in"], ["c_out"]), N("Concat", ["v", "v"], ["w"], axis=0)], "body",
                           [vi("i", I64, []), vi("c_in", B, []), vi("v", F, [2])], [vi("c_out", B, []), vi("w", F, None)])
  m = model([N("Loop", ["M", "", "v0"], ["v"], body=body, name="lp")], {"M": np.array(3, np.int64), "v0": f32(2)}, {"v": np.float32})
  km = konnx.load(m)
  for trips in (3, 1, 3):
    f = {"M": np.array(trips, np.int64), "v0": f32(2)}
    same(km.run(f), ort_run(m, f))
  assert km.program is not None and km.program.specialisations()[0].compiles == 2
  wbody = helper.make_graph([N("ReduceSum", ["v"], ["s"], keepdims=0), N("Less", ["s", "lim"], ["c_out"]), N("Concat", ["v", "v"], ["w"], axis=0)],
                            "body", [vi("i", I64, []), vi("c_in", B, []), vi("v", F, [2])], [vi("c_out", B, []), vi("w", F, None)])
  w = model([N("Loop", ["", "go", "v0"], ["v"], body=wbody, name="lp")], {"v0": f32(2), "lim": np.array(5, np.float32)}, {"v": np.float32},
            {"go": np.array(True)})
  with pytest.raises(ONNXError, match=r"node lp \(Loop.*loop-carried value 0 is float32 \(2,\) before an iteration and float32 \(4,\) after"):
    konnx.load(w)


@pytest.mark.parametrize("dirs", [(0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 0, 1)])
def test_scan_unrolled(dirs: tuple[int, ...]) -> None:
  """Scan (opset 16): two states, two scan inputs (axes 0 and 1), two scan outputs (axes 0 and -1), each direction."""
  body = helper.make_graph(
    [N("Add", ["s_in", "a"], ["s_out"]), N("Mul", ["p_in", "b"], ["p_out"]), N("Sub", ["s_out", "p_out"], ["o1"]), N("Tanh", ["o1"], ["o2"])],
    "body", [vi("s_in", F, [3]), vi("p_in", F, [3]), vi("a", F, [3]), vi("b", F, [3])],
    [vi("s_out", F, [3]), vi("p_out", F, [3]), vi("o1", F, [3]), vi("o2", F, [3])])
  nodes = [N("Sigmoid", ["b0"], ["b"]), N("Scan", ["s0", "p0", "a", "b"], ["s", "p", "o1", "o2"], body=body, num_scan_inputs=2,
                                             scan_input_axes=[0, 1], scan_input_directions=list(dirs[:2]), scan_output_axes=[0, -1],
                                             scan_output_directions=list(dirs[2:]))]
  feeds = {"s0": f32(3), "p0": f32(3), "a": f32(4, 3), "b0": f32(3, 4)}
  check(model(nodes, feeds, {"s": np.float32, "p": np.float32, "o1": np.float32, "o2": np.float32}, opset=16), feeds)


def _if_model(then: onnx.GraphProto, els: onnx.GraphProto) -> onnx.ModelProto:
  return model([N("If", ["c"], ["y"], then_branch=then, else_branch=els, name="if1")], {"x": f32(2, 3), "c": np.array(True)}, {"y": np.float32})


def test_a_branch_that_does_not_convert_is_refused_when_taken() -> None:
  """One side of a run-time If that kiln cannot convert (it may fit only other inputs: Silero's 8 kHz branch fed 16 kHz
  frames, which onnxruntime fails on too) is refused, naming why, by the run that takes it; the other side runs."""
  nz = graph([N("Hardmax", ["x"], ["nz"], name="bad"), N("Cast", ["nz"], ["t"], to=F)], [("t", None)], "then")
  relu = graph([N("Relu", ["x"], ["e"])], [("e", [2, 3])], "else")
  nested = graph([N("If", ["c"], ["t"], then_branch=nz, else_branch=nz, name="in")], [("t", None)], "then")
  for then, path in ((nz, "node if1 > then_branch > node bad"), (nested, "node if1 > then_branch > node in > then_branch > node bad")):
    m = _if_model(then, relu)
    km = konnx.load(m)
    f = {"x": f32(2, 3), "c": np.array(False)}
    same(km.run(f), ort_run(m, f))
    with pytest.raises(ONNXError, match=rf"^node if1 \(If\) took its then_branch, which kiln could not convert at load: {path} \(Hardmax\)"):
      km.run({**f, "c": np.array(True)})
    same(km.run(f), ort_run(m, f))


def test_errors_name_the_node_path(monkeypatch) -> None:
  nz = graph([N("Hardmax", ["x"], ["nz"], name="bad"), N("Cast", ["nz"], ["t"], to=F)], [("t", None)], "then")
  with pytest.raises(ONNXError, match=r"^node if1 > then_branch > node bad \(Hardmax\): operator Hardmax is not supported"):
    konnx.load(_if_model(nz, nz))  # neither side converts: refused at load
  relu = graph([N("Relu", ["x"], ["e"])], [("e", [2, 3])], "else")
  wide = graph([N("Flatten", ["x"], ["e"], axis=0)], [("e", [1, 6])], "else")
  for c in (True, False):  # in the main graph: cut on the condition, each branch's shape its own (specialise.py)
    check(_if_model(relu, wide), {"x": f32(2, 3), "c": np.array(c)})
  inner = graph([N("If", ["c"], ["t"], then_branch=relu, else_branch=wide, name="in")], [("t", None)], "then")
  with pytest.raises(ONNXError, match=r"node if1 > then_branch > node in \(If.*output 0 is float32 \(2, 3\) in then_branch and float32 \(1, 6\)"):
    konnx.load(_if_model(inner, inner))  # in a run-time If's branch: no cut there
  def loop(approx: str, fed: bool = False) -> onnx.ModelProto:
    body = helper.make_graph([N("Identity", ["c_in"], ["c_out"]), N("Gelu", ["v"], ["w"], name="ge", approximate=approx)], "body",
                             [vi("i", I64, []), vi("c_in", B, []), vi("v", F, [2])], [vi("c_out", B, []), vi("w", F, [2])])
    m3 = {"M": np.array(3, np.int64)}
    return model([N("Loop", ["M", "", "v0"], ["v"], body=body, name="lp")], {**(m3 if fed else {}), "v0": f32(2)}, {"v": np.float32},
                 {} if fed else m3, opset=20)
  with pytest.raises(ONNXError, match=r"^node lp > body \(iteration 0\) > node ge \(Gelu, opset 20\): attribute approximate='fast'"):
    konnx.load(loop("fast"))
  check(loop("tanh"), {"v0": f32(2)})
  fed = konnx.load(loop("tanh", fed=True))  # a trip count fed at run time: a run-time loop, its body compiled once
  v0 = f32(2)
  np.testing.assert_allclose(fed.run({"M": np.array(3, np.int64), "v0": v0})["v"], konnx.load(loop("tanh")).run({"v0": v0})["v"], rtol=1e-6)
  monkeypatch.setattr(onnx_limits, "MAX_UNROLLED_STEPS", 2)
  with pytest.raises(ONNXError, match=r"node lp \(Loop\): the time steps .* is 3, over MAX_UNROLLED_STEPS = 2"): konnx.load(loop("tanh"))
  five = {"M": np.array(5, np.int64), "v0": v0}  # a run-time loop unrolls nothing: no MAX_UNROLLED_STEPS
  np.testing.assert_allclose(fed.run(five)["v"], ort_run(loop("tanh", fed=True), five)["v"], rtol=1e-5)


def test_subgraph_limits(monkeypatch) -> None:
  """onnx_limits' limits reach into subgraphs: nesting depth, and the node count with every subgraph's nodes."""
  g = leaf = graph([N("Relu", ["x"], ["y0"])], [("y0", [2, 3])], "leaf")
  for k in range(6):
    g = graph([N("If", ["c"], [f"y{k + 1}"], then_branch=g, else_branch=leaf, name=f"if{k}")], [(f"y{k + 1}", [2, 3])], f"g{k}")
  deep = model(list(g.node), {"x": f32(2, 3), "c": np.array(True)}, {g.output[0].name: np.float32})
  check(deep, {"x": f32(2, 3), "c": np.array(False)})
  monkeypatch.setattr(onnx_scope, "MAX_GRAPH_NESTING", 4)  # 32: protobuf's decoder itself stops near 33 (100 messages deep)
  with pytest.raises(ONNXError, match=r"^node if5 > then_branch > node if4 > then_branch > node if3 > then_branch > node if2 > then_branch > "
                     r"node if1 > else_branch: subgraphs nest 5 deep, over MAX_GRAPH_NESTING = 4"):
    konnx.load(deep)
  relu = graph([N("Relu", ["x"], ["e"]), N("Neg", ["e"], ["e2"])], [("e2", [2, 3])], "else")
  monkeypatch.setattr(onnx_limits, "MAX_NODES", 4)
  with pytest.raises(ONNXError, match=r"the number of nodes, every subgraph.s counted is 5, over MAX_NODES = 4"):
    konnx.load(_if_model(relu, relu))


def _node_cases() -> list:
  """The ONNX project's node tests for If, Loop and Scan (onnx.backend.test.case.node), made without touching its registry."""
  import onnx.backend.test.case.node as reg
  from onnx.backend.test.case.base import Base
  from onnx.backend.test.case.node import if_, loop, scan
  saved = reg._NodeTestCases, reg._existing_names
  reg._NodeTestCases, reg._existing_names = [], {}
  try:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
      warnings.simplefilter("ignore")
      for mod in (if_, loop, scan):
        for cls in vars(mod).values():
          if isinstance(cls, type) and issubclass(cls, Base) and cls is not Base:
            for k in vars(cls):
              if k.startswith("export"): getattr(cls, k)()
    return list(reg._NodeTestCases)
  finally: reg._NodeTestCases, reg._existing_names = saved


NODE_CASES = _node_cases()
PASSING = {"test_if", "test_scan9_sum", "test_scan9_multi_state", "test_scan9_scalar", "test_loop11"}  # loop11: a fed trip count


@pytest.mark.parametrize("case", NODE_CASES, ids=[c.name for c in NODE_CASES])
def test_onnx_node_tests(case) -> None:
  """Each case matches the expected outputs or is refused with an ONNXError (sequences, optionals, Scan-8)."""
  ins, want = case.data_sets[0]
  feeds = {v.name: np.asarray(a) for v, a in zip(case.model.graph.input, ins)}
  if case.name not in PASSING:
    with pytest.raises(ONNXError): konnx.load(case.model).run(feeds)
    return
  got = konnx.load(case.model).run(feeds)
  for v, w in zip(case.model.graph.output, want):
    assert got[v.name].dtype == np.asarray(w).dtype
    np.testing.assert_allclose(got[v.name], w, rtol=case.rtol, atol=case.atol)


def test_unnamed_input_dims() -> None:
  """silero_vad.onnx declares its input dims with no name at all: such a dim is given by its input's name and axis."""
  m = model([N("Relu", ["x"], ["y"])], {"x": f32(2, 3)}, {"y": np.float32})
  d = m.graph.input[0].type.tensor_type.shape.dim[0]
  d.Clear()
  with pytest.raises(ONNXError, match=r"input 'x' dim 0 is symbolic \(unnamed\): give its size with dims=\{'x:0': n\}"): konnx.load(m)
  for given, rows in ((2, 2), ((1, 4), 3)):
    x = f32(rows, 3)
    np.testing.assert_array_equal(konnx.load(m, dims={"x:0": given}).run({"x": x})["y"], np.maximum(x, 0))
