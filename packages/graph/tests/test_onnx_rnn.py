"""kiln.graph.onnx's recurrent operators (onnx_ops_rnn.py: LSTM, GRU, RNN, unrolled over a fixed sequence) against
onnxruntime: directions, layouts, biases, initial states (fed and constant), peepholes, clip, linear_before_reset,
input_forget, activation functions, omitted outputs, stacked layers as torch exports them, sequence_lens, a symbolic
batch, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import helper  # noqa: E402
from onnx_case import N, check, f32, model, ort  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
T, B, I, H = 5, 3, 4, 6


def rnn_model(op: str, direction: str = "forward", layout: int = 0, bias: bool = True, init: str | None = None, peep: bool = False,
              outs: list[str] | None = None, opset: int = 17, steps: int = T, scale: float = 0.5, lens: np.ndarray | None = None,
              **attrs: object) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
  """One recurrent node named rnn0: X fed; W, R, B, P as initializers; initial states fed (init="input") or constant
  (init="const"); sequence_lens a constant when given. outs: the node's output names, "" for an omitted one."""
  d, g = 2 if direction == "bidirectional" else 1, GATES[op]
  x = f32(*((steps, B, I) if layout == 0 else (B, steps, I)))
  state = (d, B, H) if layout == 0 else (B, d, H)
  inits = {"W": f32(d, g * H, I, lo=-scale, hi=scale), "R": f32(d, g * H, H, lo=-scale, hi=scale)}
  feeds = {"x": x}
  ins = ["x", "W", "R", "", "", "", "", ""]
  if bias: inits["B"], ins[3] = f32(d, 2 * g * H, lo=-scale, hi=scale), "B"
  if lens is not None: inits["lens"], ins[4] = lens, "lens"
  for i, name in ((5, "h0"), (6, "c0")) if op == "LSTM" else ((5, "h0"),):
    if init is None: continue
    ins[i] = name
    (feeds if init == "input" else inits)[name] = f32(*state)
  if peep: inits["P"], ins[7] = f32(d, 3 * H, lo=-scale, hi=scale), "P"
  while ins[-1] == "": ins.pop()
  outs = outs if outs is not None else ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
  if layout: attrs["layout"] = layout
  node = N(op, ins, outs, name="rnn0", hidden_size=H, direction=direction, **attrs)
  return model([node], feeds, {o: np.float32 for o in outs if o}, inits, opset=opset), feeds


def _layout0(m: onnx.ModelProto) -> onnx.ModelProto:
  """The reference for a layout=1 node, which onnxruntime's CPU provider refuses: the same node at layout 0 between
  Transposes of X, the initial states and the outputs (the spec's definition of layout 1)."""
  r = onnx.ModelProto()
  r.CopyFrom(m)
  nd = onnx.NodeProto()
  nd.CopyFrom(next(n for n in r.graph.node if n.name == "rnn0"))
  others = [n for n in r.graph.node if n.name != "rnn0"]
  kept = [a for a in nd.attribute if a.name != "layout"]
  del nd.attribute[:]
  nd.attribute.extend(kept)
  pre, post = [], []
  for i, name in enumerate(nd.input):
    if name and i in (0, 5, 6):
      nd.input[i] = name + "_t"
      pre.append(N("Transpose", [name], [name + "_t"], perm=[1, 0, 2]))
  for i, name in enumerate(nd.output):
    if name:
      nd.output[i] = name + "_t"
      post.append(N("Transpose", [name + "_t"], [name], perm=[2, 0, 1, 3] if i == 0 else [1, 0, 2]))
  del r.graph.node[:]
  r.graph.node.extend(pre + [nd] + post + others)
  return r


def _layout1(m: onnx.ModelProto) -> bool:
  return any(a.name == "layout" and a.i == 1 for n in m.graph.node for a in n.attribute)


def check_rnn(m: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float = 1e-5, kernels: int | None = None) -> konnx.Model:
  """onnx_case.check, or for a layout=1 node kiln on it against onnxruntime on its layout-0 equivalent."""
  if not _layout1(m): return check(m, feeds, tol, kernels)
  want = ort.InferenceSession(_layout0(m).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
  km = konnx.load(m)
  got = km.run(feeds)
  for o, w in zip(m.graph.output, want):
    assert got[o.name].shape == w.shape, (o.name, got[o.name].shape, w.shape)
    np.testing.assert_allclose(got[o.name], w, rtol=tol, atol=tol)
  return km


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
def test_directions_and_layouts(op: str, direction: str, layout: int) -> None:
  check_rnn(*rnn_model(op, direction, layout, opset=14))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("init", ["input", "const"])
@pytest.mark.parametrize("layout,bias", [(0, False), (1, True)])
def test_initial_states_with_and_without_bias(op: str, init: str, layout: int, bias: bool) -> None:
  check_rnn(*rnn_model(op, "bidirectional", layout, bias=bias, init=init, opset=14))
  check_rnn(*rnn_model(op, "reverse", layout, bias=bias, init=init, opset=14))


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("init", [None, "input", "const"])
def test_lstm_peepholes(direction: str, init: str | None) -> None:
  check(*rnn_model("LSTM", direction, init=init, peep=True))


def test_lstm_input_forget() -> None:
  check(*rnn_model("LSTM", "bidirectional", init="input", peep=True, input_forget=1))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_clip(op: str) -> None:
  # larger weights so the pre-activations pass the bound; kiln's own unclipped run must differ, or the test proves nothing
  m, feeds = rnn_model(op, "bidirectional", init="input", scale=2.0, clip=0.4)
  clipped = check(m, feeds).run(feeds)["Y"]
  for a in m.graph.node[0].attribute:
    if a.name == "clip": m.graph.node[0].attribute.remove(a)
  assert not np.allclose(konnx.load(m).run(feeds)["Y"], clipped, atol=1e-3)


@pytest.mark.parametrize("init", [None, "input"])
@pytest.mark.parametrize("bias", [False, True])
def test_gru_linear_before_reset(init: str | None, bias: bool) -> None:
  got = []
  for lbr in (0, 1):
    m, feeds = rnn_model("GRU", "bidirectional", bias=bias, init=init, scale=1.0, linear_before_reset=lbr)
    got.append(check(m, feeds).run(feeds)["Y"])
  assert not np.allclose(got[0], got[1], atol=1e-3)  # the two formulas do differ on these weights


@pytest.mark.parametrize("op,outs", [("LSTM", ["", "Y_h"]), ("LSTM", ["Y"]), ("LSTM", ["", "", "Y_c"]), ("LSTM", ["", "Y_h", "Y_c"]),
                                     ("GRU", ["", "Y_h"]), ("GRU", ["Y"]), ("RNN", ["", "Y_h"]), ("RNN", ["Y"])])
def test_omitted_outputs(op: str, outs: list[str]) -> None:
  check(*rnn_model(op, "bidirectional", init="input", outs=outs))


ACTIVATIONS = [
  ("RNN", "forward", ["Relu"], None, None), ("RNN", "forward", ["Sigmoid"], None, None),
  ("RNN", "forward", ["Affine"], [0.7], [0.2]), ("RNN", "forward", ["ThresholdedRelu"], [0.1], None),
  ("RNN", "forward", ["ScaledTanh"], [1.5], [0.6]), ("RNN", "forward", ["Elu"], None, None), ("RNN", "forward", ["Softplus"], None, None),
  ("RNN", "bidirectional", ["Tanh", "LeakyRelu"], [0.2], None), ("RNN", "bidirectional", ["LeakyRelu", "Tanh"], None, None),
  ("GRU", "forward", ["HardSigmoid", "Softsign"], None, None), ("GRU", "forward", ["HardSigmoid", "Elu"], [0.3, 0.5], [0.4]),
  ("GRU", "bidirectional", ["HardSigmoid", "LeakyRelu", "Sigmoid", "Affine"], [0.3, 0.05, 0.9], [0.4, 0.1]),
  ("LSTM", "forward", ["HardSigmoid", "LeakyRelu", "Affine"], [0.3, 0.05, 0.9], [0.4, 0.1]),
  ("LSTM", "forward", ["Sigmoid", "Relu", "Softsign"], None, None),
  ("LSTM", "bidirectional", ["Sigmoid", "Tanh", "Tanh", "HardSigmoid", "ScaledTanh", "Elu"], [0.25, 1.2, 0.8], [0.45, 0.9]),
]


@pytest.mark.parametrize("op,direction,acts,alpha,beta", ACTIVATIONS)
def test_activation_functions(op: str, direction: str, acts: list[str], alpha: list[float] | None, beta: list[float] | None) -> None:
  extra: dict[str, object] = {"activations": acts}
  if alpha: extra["activation_alpha"] = alpha
  if beta: extra["activation_beta"] = beta
  check(*rnn_model(op, direction, init="input", scale=1.0, **extra))


@pytest.mark.parametrize("opset", [7, 14, 22])
def test_opsets(opset: int) -> None:
  for op in GATES: check(*rnn_model(op, "bidirectional", init="input", opset=opset))


def test_lens_all_full_is_accepted() -> None:
  for op in GATES: check(*rnn_model(op, "bidirectional", init="input", lens=np.full(B, T, np.int32)))


def test_long_sequence() -> None:
  # 48 steps: the float32 rounding differences of each step's sums (kiln's order is not onnxruntime's) compound along the
  # recurrence, so 1e-4 here; the short sequences above hold 1e-5
  check(*rnn_model("LSTM", "bidirectional", init="input", steps=48, peep=True), tol=1e-4)
  check(*rnn_model("GRU", "forward", steps=48, linear_before_reset=1), tol=1e-4)


def test_kernels_per_step() -> None:
  # the input projection is one kernel for all steps; each step is H @ R^T with its gate maths (RNN: 1 kernel; LSTM: the
  # gates, then c and h together), the first step of a zero state has no matmul; both directions share every kernel (and
  # the projection of both reads X and X reversed in time, stacked by a kernel of its own: each step then reads one window;
  # and Y is stacked in step order before the reverse direction's half is read backwards: 2 kernels more)
  for direction in ("forward", "bidirectional"):
    rev = 2 * (direction == "bidirectional")
    check(*rnn_model("RNN", direction, outs=["Y", "Y_h"]), kernels=rev + 1 + T + 1)  # + Y's concat
    check(*rnn_model("LSTM", direction, outs=["Y"]), kernels=rev + 1 + 1 + 2 * (T - 1) + 1)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_steps_compile_once(monkeypatch, op) -> None:
  """Every step after the first reads its own window of the projection (windows.py), so the steps are one kernel to the
  cache: 48 steps compile no more kernels than 32 (a 200-step bidirectional LSTM loaded in 34 s when each compiled; both
  stack Y in groups of 16, _stack_tree)."""
  from kiln.executor import cache_stats
  from kiln.executor.cache import clear_memory_cache
  monkeypatch.setenv("KILN_CACHE", "0")
  counts = []
  for steps in (32, 48):
    clear_memory_cache()
    before = cache_stats()["compiles"]
    m, feeds = rnn_model(op, "bidirectional", steps=steps)
    check(m, feeds)
    counts.append(cache_stats()["compiles"] - before)
  assert counts[1] == counts[0], counts


def _stack_nodes(op: str, direction: str) -> list:
  """Two layers as torch exports them: layer 1's Y (T, D, B, H) back to (T, B, D*H) by Squeeze (D = 1) or by Transpose
  and Reshape (D = 2), then layer 2."""
  if direction == "forward": mid = [N("Squeeze", ["y1", "ax1"], ["x2"])]
  else: mid = [N("Transpose", ["y1"], ["y1t"], perm=[0, 2, 1, 3]), N("Reshape", ["y1t", "shp"], ["x2"])]
  return [N(op, ["x", "W1", "R1", "B1", "", "h0"], ["y1", "h1"], hidden_size=H, direction=direction), *mid,
          N(op, ["x2", "W2", "R2", "B2"], ["y", "h2"], hidden_size=H, direction=direction)]


def _stack_inits(op: str, direction: str) -> dict[str, np.ndarray]:
  d, g = 2 if direction == "bidirectional" else 1, GATES[op]
  return {"W1": f32(d, g * H, I, lo=-.5, hi=.5), "R1": f32(d, g * H, H, lo=-.5, hi=.5), "B1": f32(d, 2 * g * H, lo=-.5, hi=.5),
          "W2": f32(d, g * H, d * H, lo=-.5, hi=.5), "R2": f32(d, g * H, H, lo=-.5, hi=.5), "B2": f32(d, 2 * g * H, lo=-.5, hi=.5),
          "ax1": np.asarray([1], np.int64), "shp": np.asarray([0, 0, -1], np.int64)}


@pytest.mark.parametrize("op,direction", [("LSTM", "bidirectional"), ("GRU", "forward"), ("LSTM", "forward"), ("RNN", "bidirectional")])
def test_two_layer_stack(op: str, direction: str) -> None:
  d = 2 if direction == "bidirectional" else 1
  feeds = {"x": f32(T, B, I), "h0": f32(d, B, H)}
  check(model(_stack_nodes(op, direction), feeds, {"y": np.float32, "h1": np.float32, "h2": np.float32}, _stack_inits(op, direction)), feeds)


def _dyn(nodes: list, inputs: dict[str, tuple], outs: list[str], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
  """A model whose inputs have str (dim_param) dims."""
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, list(s)) for k, s in inputs.items()],
                        [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, None) for k in outs],
                        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  for o in m.graph.output: o.type.tensor_type.shape.SetInParent()  # the checker wants a shape, even an unknown one
  return m


def _at_sizes(m: onnx.ModelProto, feeds_list: list[dict[str, np.ndarray]]) -> None:
  """One load with a symbolic batch, run at each feed's size against onnxruntime."""
  km = konnx.load(m, dims={"batch": (1, 8)})
  sess = ort.InferenceSession((_layout0(m) if _layout1(m) else m).SerializeToString(), providers=["CPUExecutionProvider"])
  for feeds in feeds_list:
    got = km.run(feeds)
    for o, w in zip(m.graph.output, sess.run(None, feeds)):
      assert got[o.name].shape == w.shape, (o.name, got[o.name].shape, w.shape)
      np.testing.assert_allclose(got[o.name], w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,direction", [("LSTM", "bidirectional"), ("GRU", "forward")])
def test_symbolic_batch(op: str, direction: str) -> None:
  d = 2 if direction == "bidirectional" else 1
  m = _dyn(_stack_nodes(op, direction), {"x": (T, "batch", I), "h0": (d, "batch", H)}, ["y", "h1", "h2"], _stack_inits(op, direction))
  _at_sizes(m, [{"x": f32(T, b, I), "h0": f32(d, b, H)} for b in (2, 5)])


def test_symbolic_batch_layout_1_and_zero_state() -> None:
  d, g = 2, 4
  inits = {"W": f32(d, g * H, I, lo=-.5, hi=.5), "R": f32(d, g * H, H, lo=-.5, hi=.5), "P": f32(d, 3 * H, lo=-.5, hi=.5)}
  node = N("LSTM", ["x", "W", "R", "", "", "", "", "P"], ["y", "yh", "yc"], name="rnn0", hidden_size=H, direction="bidirectional", layout=1)
  _at_sizes(_dyn([node], {"x": ("batch", T, I)}, ["y", "yh", "yc"], inits), [{"x": f32(b, T, I)} for b in (1, 4, 8)])


def test_refusals() -> None:
  m, _ = rnn_model("LSTM", lens=np.asarray([T, T - 1, T], np.int32))
  with pytest.raises(ONNXError, match=r"rnn0 \(LSTM.*sequence_lens \('lens'\) = \[5, 4, 5\] is not the full length 5"): konnx.load(m)
  m, _ = rnn_model("GRU", "bidirectional", activations=["Sigmoid", "Tanh", "Sigmoid", "Gelu"])
  with pytest.raises(ONNXError, match=r"rnn0 \(GRU.*activation 'Gelu' is not supported"): konnx.load(m)
  m, _ = rnn_model("LSTM", "bidirectional", activations=["Sigmoid", "Tanh", "Tanh"])  # one set for two directions, as onnxruntime refuses
  with pytest.raises(ONNXError, match=r"activations has 3 names, LSTM takes 3 per direction \(6 here\)"): konnx.load(m)
  m, _ = rnn_model("RNN", activations=["Affine"])
  with pytest.raises(ONNXError, match=r"'Affine' needs its alpha"): konnx.load(m)
  m, _ = rnn_model("RNN", clip=-1.0)
  with pytest.raises(ONNXError, match=r"clip=-1.0 must be a positive number"): konnx.load(m)


def test_run_time_sequence_lens_is_refused() -> None:
  x, lens = f32(T, B, I), np.full(B, T, np.int32)
  inits = {"W": f32(1, 4 * H, I), "R": f32(1, 4 * H, H)}
  m = model([N("LSTM", ["x", "W", "R", "", "lens"], ["y"], name="lstm0", hidden_size=H)], {"x": x, "lens": lens}, {"y": np.float32}, inits)
  with pytest.raises(ONNXError, match=r"node lstm0 \(LSTM.*input 4 sequence_lens \('lens'\) is computed at run time"): konnx.load(m)


def test_symbolic_sequence_is_refused() -> None:
  inits = {"W": f32(1, 3 * H, I), "R": f32(1, 3 * H, H)}
  m = _dyn([N("GRU", ["x", "W", "R"], ["y"], name="gru0", hidden_size=H)], {"x": ("seq", "batch", I)}, ["y"], inits)
  with pytest.raises(ONNXError, match=r"node gru0 \(GRU.*axis 0 .* is symbolic \(seq\): the sequence length"):
    konnx.load(m, dims={"seq": (1, 8), "batch": (1, 4)})
