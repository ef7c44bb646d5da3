"""kiln.graph.onnx's quantization operators (onnx_ops_quant.py) against onnxruntime: QuantizeLinear and DequantizeLinear per
tensor, per axis and blocked for every integer type kiln has (exact .5 ties both signs, NaN, inf, out of range), with the
parameters constant (numpy folds at load) or fed at run time; DynamicQuantizeLinear; MatMulInteger, ConvInteger, QLinearMatMul
and QLinearConv for each operand signedness, per-column and per-channel parameters, requantization ties and an int32 sum that
wraps; a QDQ conv net and a QDQ matmul (onnxruntime with its graph optimizations off, so that it runs the graph as written,
not its fused integer kernels), whose constant weights fold to float32; the ONNX project's node-test cases for these ops;
and refusals naming the node and what kiln lacks."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

R = np.random.default_rng(35)
N = helper.make_node
INTS = (np.int8, np.uint8, np.int16, np.uint16)


def ty(dt: type | np.dtype) -> int: return helper.np_dtype_to_tensor_dtype(np.dtype(dt))


def qints(dt: type, *shape: int, lo: int | None = None, hi: int | None = None) -> np.ndarray:
  i = np.iinfo(dt)
  return R.integers(i.min if lo is None else lo, (i.max if hi is None else hi) + 1, shape).astype(dt)


def qmodel(nodes: list, feeds: dict[str, np.ndarray], outs: dict[str, type], inits: dict[str, np.ndarray] | None = None,
           opset: int = 21) -> onnx.ModelProto:
  """A model of nodes; every output's type and shape from onnx's shape inference (the checker wants them)."""
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, ty(v.dtype), v.shape) for k, v in feeds.items()],
                        [helper.make_tensor_value_info(k, ty(d), None) for k, d in outs.items()],
                        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
  m.ir_version = 10
  inferred = onnx.shape_inference.infer_shapes(m).graph
  known = {v.name: v for v in [*inferred.value_info, *inferred.output] if v.type.tensor_type.HasField("shape")}
  for o in m.graph.output: o.CopyFrom(known[o.name])
  return m


def against_ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float = 1e-5, optimized: bool = True) -> konnx.Model:
  """kiln's outputs equal onnxruntime's: bit for bit for integers, within tol for floats. optimized=False: onnxruntime runs
  the graph node by node (its QDQ fusions would compute another function)."""
  so = ort.SessionOptions()
  if not optimized: so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  want = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
  km = konnx.load(m)
  got = km.run(feeds)
  for o, w in zip(m.graph.output, want):
    g = got[o.name]
    assert g.shape == w.shape and g.dtype == w.dtype, (o.name, g.shape, w.shape, g.dtype, w.dtype)
    if w.dtype.kind == "f": np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=o.name)
    else: np.testing.assert_array_equal(g, w, err_msg=o.name)
  return km


def split(where: str, data: dict[str, np.ndarray], params: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """(feeds, initializers): 'runtime' feeds everything, 'params' feeds the data only, 'folded' makes everything a constant."""
  if where == "runtime": return {**data, **params}, {}
  if where == "params": return data, params
  return {}, {**data, **params}


# ---- QuantizeLinear / DequantizeLinear ----
SPECIAL = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5], np.float32)
X_TIES = np.concatenate([SPECIAL, (R.integers(-1200, 1200, 96 - SPECIAL.size) * 0.125).astype(np.float32)]).reshape(2, 6, 8)
# onnxruntime 1.30's blocked QuantizeLinear gives NaN, inf and 1e30 other values than its per-tensor and per-axis kernels do
# (1.32's agree with kiln): the blocked case saturates finite values only
X_FINITE = np.where(np.isfinite(X_TIES) & (np.abs(X_TIES) < 1e6), X_TIES, np.float32(300) * np.sign(np.nan_to_num(X_TIES))).astype(np.float32)
SCALES = np.array([0.5, 0.25, 1.0, 0.125, 2.0, 0.0625], np.float32)  # x / scale lands on ties of .5, both signs


def grain_params(grain: str, dt: type) -> tuple[np.ndarray, np.ndarray, dict]:
  """(scale, zero point, attributes) for x of shape (2, 6, 8): per tensor, per axis 1, or blocks of 4 along axis 1 (a
  partial last block)."""
  if grain == "tensor": return np.float32(0.5), np.asarray(qints(dt, 1, lo=0 if dt in (np.uint8, np.uint16) else -20, hi=20)[0]), {}
  if grain == "axis": return SCALES, qints(dt, 6, lo=0 if dt in (np.uint8, np.uint16) else -20, hi=20), {"axis": 1}
  s = R.choice(SCALES, (2, 2, 8)).astype(np.float32)
  return s, qints(dt, 2, 2, 8, lo=0 if dt in (np.uint8, np.uint16) else -20, hi=20), {"axis": 1, "block_size": 4}


@pytest.mark.parametrize("where", ["params", "runtime", "folded"])
@pytest.mark.parametrize("grain", ["tensor", "axis", "block"])
def test_quantize_linear(grain: str, where: str) -> None:
  """x into each of int8, uint8, int16 and uint16 (a node each, in one model)."""
  params: dict[str, np.ndarray] = {}
  nodes, outs = [], {}
  for dt in INTS:
    k = dt.__name__
    sc, z, attrs = grain_params(grain, dt)
    params |= {f"s_{k}": np.asarray(sc), f"z_{k}": z}
    nodes.append(N("QuantizeLinear", ["x", f"s_{k}", f"z_{k}"], [f"y_{k}"], **attrs))
    outs[f"y_{k}"] = dt
  feeds, inits = split(where, {"x": X_FINITE if grain == "block" else X_TIES}, params)
  against_ort(qmodel(nodes, feeds, outs, inits), feeds)


@pytest.mark.parametrize("where", ["params", "folded"])
@pytest.mark.parametrize("grain", ["tensor", "axis", "block"])
def test_dequantize_linear(grain: str, where: str) -> None:
  """From each of int8, uint8, int16, uint16 and int32 (no zero point: ONNX's is 0)."""
  data: dict[str, np.ndarray] = {}
  params: dict[str, np.ndarray] = {}
  nodes, outs = [], {}
  for dt in (*INTS, np.int32):
    k = dt.__name__
    sc, z, attrs = grain_params(grain, np.int8 if dt == np.int32 else dt)
    data[f"x_{k}"], params[f"s_{k}"] = qints(dt, 2, 6, 8), np.asarray(sc) * np.float32(1.37)
    if dt != np.int32: params[f"z_{k}"] = z
    nodes.append(N("DequantizeLinear", [f"x_{k}", f"s_{k}", *([f"z_{k}"] if dt != np.int32 else [])], [f"y_{k}"], **attrs))
    outs[f"y_{k}"] = np.float32
  feeds, inits = split(where, data, params)
  against_ort(qmodel(nodes, feeds, outs, inits), feeds)


def test_quantize_float16_and_dequantize_to_float16() -> None:
  """float16 x is divided in float32 (as onnxruntime); a float16 scale gives float16 out, one rounding from float32."""
  with np.errstate(over="ignore"): x = X_TIES.astype(np.float16)  # 1e30: inf
  against_ort(qmodel([N("QuantizeLinear", ["x", "s", "z"], ["y"])], {"x": x}, {"y": np.int8}, {"s": np.float16(0.3), "z": np.int8(3)}), {"x": x})
  q = qints(np.int16, 2, 6, 8)
  m = qmodel([N("DequantizeLinear", ["q", "s", "z"], ["y"], axis=-2)], {"q": q}, {"y": np.float16},
             {"s": (SCALES * 3.3).astype(np.float16), "z": qints(np.int16, 6, lo=-99, hi=99)})
  against_ort(m, {"q": q}, tol=0)


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("kind", ["mixed", "positive", "negative", "zeros"])
def test_dynamic_quantize_linear(kind: str, folded: bool) -> None:
  x = {"mixed": R.uniform(-3, 5, (4, 7)), "positive": R.uniform(1, 5, (4, 7)), "negative": R.uniform(-5, -1, (4, 7)),
       "zeros": np.zeros((4, 7))}[kind].astype(np.float32)
  feeds, inits = ({}, {"x": x}) if folded else ({"x": x}, {})
  m = qmodel([N("DynamicQuantizeLinear", ["x"], ["y", "ys", "yz"])], feeds, {"y": np.uint8, "ys": np.float32, "yz": np.uint8}, inits, opset=11)
  against_ort(m, feeds, tol=0)


# ---- integer products ----
SIGNS = [(np.uint8, np.uint8), (np.uint8, np.int8), (np.int8, np.uint8), (np.int8, np.int8)]


@pytest.mark.parametrize("b_const", [True, False])
@pytest.mark.parametrize("adt,bdt", SIGNS, ids=lambda d: d.__name__)
def test_matmul_integer(adt: type, bdt: type, b_const: bool) -> None:
  """Per-tensor a zero point, per-column b zero points; a constant b is centered at load."""
  a, b = qints(adt, 7, 33), qints(bdt, 33, 5)
  params = {"b": b, "az": np.asarray(adt(3)), "bz": qints(bdt, 5)}
  feeds = {"a": a, **({} if b_const else {"b": b})}
  m = qmodel([N("MatMulInteger", ["a", "b", "az", "bz"], ["y"])], feeds, {"y": np.int32}, {k: v for k, v in params.items() if k not in feeds})
  against_ort(m, feeds)


def test_matmul_integer_batched_and_wrapping() -> None:
  """Broadcast batches with a (..., 1, N) b zero point; a sum past 2**31 wraps as onnxruntime's int32 accumulation does."""
  a, b = qints(np.uint8, 2, 3, 4, 9), qints(np.int8, 3, 9, 6)
  m = qmodel([N("MatMulInteger", ["a", "b", "az", "bz"], ["y"])], {"a": a, "b": b}, {"y": np.int32},
             {"az": np.uint8(128), "bz": qints(np.int8, 3, 1, 6)})
  against_ort(m, {"a": a, "b": b})
  big_a, big_b = np.full((1, 40000), 255, np.uint8), np.full((40000, 2), 255, np.uint8)
  km = against_ort(qmodel([N("MatMulInteger", ["a", "b"], ["y"])], {"a": big_a, "b": big_b}, {"y": np.int32}), {"a": big_a, "b": big_b})
  assert km.run({"a": big_a, "b": big_b})["y"][0, 0] == np.int64(255 * 255 * 40000) - (1 << 32)


def test_matmul_integer_per_row_zero_point() -> None:
  """ONNX allows one a zero point per row (onnxruntime refuses it): against numpy."""
  a, b, az, bz = qints(np.int8, 2, 5, 6), qints(np.uint8, 6, 4), qints(np.int8, 5), qints(np.uint8, 4)
  m = qmodel([N("MatMulInteger", ["a", "b", "az", "bz"], ["y"])], {"a": a}, {"y": np.int32}, {"b": b, "az": az, "bz": bz})
  want = (a.astype(np.int32) - az.astype(np.int32)[:, None]) @ (b.astype(np.int32) - bz.astype(np.int32))
  np.testing.assert_array_equal(konnx.load(m).run({"a": a})["y"], want)


def test_qlinear_matmul_per_row() -> None:
  """QLinearMatMul with a's scale and zero point per row ((M, 1)) and b's per column (onnxruntime refuses the rows): against
  ONNX's reference implementation."""
  from onnx.reference import ReferenceEvaluator
  a = qints(np.uint8, 5, 12)
  inits = {"as": R.uniform(0.01, 0.03, (5, 1)).astype(np.float32), "az": qints(np.uint8, 5, 1), "b": qints(np.int8, 12, 4),
           "bs": R.uniform(0.001, 0.01, 4).astype(np.float32), "bz": qints(np.int8, 4, lo=-5, hi=5), "ys": np.float32(0.05), "yz": np.uint8(120)}
  m = qmodel([N("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])], {"a": a}, {"y": np.uint8}, inits, opset=10)
  np.testing.assert_array_equal(konnx.load(m).run({"a": a})["y"], ReferenceEvaluator(m).run(None, {"a": a})[0])


def qlinear_matmul(adt: type, bdt: type, per_col: bool, a: np.ndarray, ys: float = 0.3, bscale: float = 0.005) -> onnx.ModelProto:
  bz = (np.zeros(8, bdt) if bdt == np.int8 else qints(bdt, 8)) if per_col else np.asarray(bdt(3))
  inits = {"as": np.float32(0.02), "az": np.asarray(adt(7)), "b": qints(bdt, a.shape[-1], 8),
           "bs": R.uniform(0.001, 0.01, 8).astype(np.float32) if per_col else np.float32(bscale), "bz": bz, "ys": np.float32(ys),
           "yz": np.asarray(adt(10))}
  return qmodel([N("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])], {"a": a}, {"y": adt}, inits, opset=10)


@pytest.mark.parametrize("per_col", [False, True])
@pytest.mark.parametrize("adt,bdt", [(np.uint8, np.uint8), (np.uint8, np.int8), (np.int8, np.int8)], ids=lambda d: d.__name__)
def test_qlinear_matmul(adt: type, bdt: type, per_col: bool) -> None:
  a = qints(adt, 2, 6, 40)
  against_ort(qlinear_matmul(adt, bdt, per_col, a), {"a": a})


def test_qlinear_matmul_requantization_ties() -> None:
  """A factor of exactly 0.5: every odd sum is a tie, which rounds to even, both signs."""
  a = qints(np.int8, 16, 3, lo=-3, hi=3)
  against_ort(m := qlinear_matmul(np.int8, np.int8, False, a, ys=0.01, bscale=0.25), {"a": a})
  acc = konnx.load(m).run({"a": a})["y"]
  assert acc.min() < 10 < acc.max()  # both signs of the sum reached the rounding


CONV_ATTRS = [{"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2], "group": 2}, {"auto_pad": "SAME_LOWER", "strides": [2, 2]},
              {"pads": [1, 1, 1, 1], "group": 4, "strides": [2, 2]}]  # the last one: depthwise


def conv_weights(wdt: type, attrs: dict) -> np.ndarray: return qints(wdt, 4 if attrs.get("group") == 4 else 6, 4 // attrs.get("group", 1), 3, 3)


def qlinear_conv_node(out: str, bias: bool) -> list:
  return ["x", "xs", "xz", "w", out + "ws", "wz", "ys", "yz", *([out + "B"] if bias else [])]


@pytest.mark.parametrize("attrs", CONV_ATTRS, ids=["pads-strides-dilated-group", "same", "depthwise"])
@pytest.mark.parametrize("xdt,wdt", [(np.uint8, np.uint8), (np.uint8, np.int8), (np.int8, np.int8)], ids=lambda d: d.__name__)
def test_conv_integer_and_qlinear_conv(xdt: type, wdt: type, attrs: dict) -> None:
  """ConvInteger, and QLinearConv with per-channel weight scales and a bias, and per tensor without."""
  x, w = qints(xdt, 2, 4, 9, 9), conv_weights(wdt, attrs)
  o = w.shape[0]
  inits = {"w": w, "xs": np.float32(0.05), "xz": np.asarray(xdt(5)), "wz": np.asarray(wdt(0) if wdt == np.int8 else wdt(9)), "ys": np.float32(0.2),
           "yz": np.asarray(xdt(3)), "cws": R.uniform(0.001, 0.01, o).astype(np.float32), "cB": R.integers(-2000, 2000, o).astype(np.int32),
           "tws": np.float32(0.004)}
  nodes = [N("ConvInteger", ["x", "w", "xz", "wz"], ["i"], **attrs), N("QLinearConv", qlinear_conv_node("c", True), ["c"], **attrs),
           N("QLinearConv", qlinear_conv_node("t", False), ["t"], **attrs)]
  against_ort(qmodel(nodes, {"x": x}, {"i": np.int32, "c": xdt, "t": xdt}, inits, opset=10), {"x": x})


def test_qlinear_conv_per_channel_zero_points_and_ties() -> None:
  """One weight zero point per output channel (onnxruntime wants them all equal): against onnxruntime's float Conv of the
  centered operands (exact: every sum < 2**24), requantized by a factor of 0.5 (ties to even)."""
  x, w, wz = qints(np.uint8, 1, 2, 6, 6), qints(np.uint8, 3, 2, 3, 3), np.array([3, 200, 77], np.uint8)
  ws = np.array([0.5, 0.5, 0.5], np.float32) * np.float32(0.2 / 0.05)  # x_scale * w_scale / y_scale = 0.5 per channel
  inits = {"xs": np.float32(0.05), "xz": np.uint8(5), "w": w, "ws": ws, "wz": wz, "ys": np.float32(0.2), "yz": np.uint8(3)}
  m = qmodel([N("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"], pads=[1, 1, 1, 1])], {"x": x}, {"y": np.uint8}, inits, opset=10)
  xc, wc = x.astype(np.float32) - 5, w.astype(np.float32) - wz.astype(np.float32)[:, None, None, None]
  acc = ort.InferenceSession(qmodel([N("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], {"x": xc, "w": wc}, {"y": np.float32}).SerializeToString(),
                             providers=["CPUExecutionProvider"]).run(None, {"x": xc, "w": wc})[0]
  assert (acc % 2 == 1).any()
  want = np.clip(np.rint(acc * np.float32(0.5)) + 3, 0, 255).astype(np.uint8)
  np.testing.assert_array_equal(konnx.load(m).run({"x": x})["y"], want)


# ---- QDQ models: what exporters write ----
def qdq_conv_net() -> tuple[onnx.ModelProto, onnx.ModelProto, np.ndarray]:
  """x -> Q/DQ (uint8) -> Conv(DQ(int8 weight, per channel)) + bias -> Relu -> Q/DQ -> Conv(DQ(int8 weight, per tensor)); and
  the same net with its weights dequantized beforehand."""
  x = R.uniform(-1, 1, (2, 3, 10, 10)).astype(np.float32)
  w1, s1, w2 = qints(np.int8, 8, 3, 3, 3, lo=-127), R.uniform(0.002, 0.01, 8).astype(np.float32), qints(np.int8, 4, 8, 1, 1, lo=-127)
  act = {"xs": np.float32(2 / 255), "xz": np.uint8(128), "b1": R.uniform(-0.1, 0.1, 8).astype(np.float32), "hs": np.float32(0.01), "hz": np.uint8(0)}
  tail = [N("Conv", ["xd", "w1d", "b1"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["r1"]), N("QuantizeLinear", ["r1", "hs", "hz"], ["hq"]),
          N("DequantizeLinear", ["hq", "hs", "hz"], ["hd"]), N("Conv", ["hd", "w2d"], ["y"])]
  head = [N("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), N("DequantizeLinear", ["xq", "xs", "xz"], ["xd"])]
  qdq = qmodel([*head, N("DequantizeLinear", ["w1", "s1", "z1"], ["w1d"], axis=0), N("DequantizeLinear", ["w2", "s2"], ["w2d"]), *tail],
               {"x": x}, {"y": np.float32}, {**act, "w1": w1, "s1": s1, "z1": np.zeros(8, np.int8), "w2": w2, "s2": np.float32(0.004)}, opset=13)
  floats = {"w1d": w1.astype(np.float32) * s1[:, None, None, None], "w2d": w2.astype(np.float32) * np.float32(0.004)}
  return qdq, qmodel([*head, *tail], {"x": x}, {"y": np.float32}, {**act, **floats}, opset=13), x


def test_qdq_conv_net() -> None:
  """The graph as written (onnxruntime unoptimized) to 1e-5; the weights fold at load, so the plan is the float-weight net's."""
  qdq, flt, x = qdq_conv_net()
  km = against_ort(qdq, {"x": x}, optimized=False)
  kf = konnx.load(flt)
  assert len(km.plan.kernels) == len(kf.plan.kernels), km.summary()
  assert sum(a.nbytes for a in km.export()[1].values()) == sum(a.nbytes for a in kf.export()[1].values())  # float32 weights, no int8 copies


def test_qdq_matmul() -> None:
  """x -> Q/DQ (int8) -> MatMul(DQ(int8 weight, per column)) + bias -> Q/DQ (uint8), and a blocked weight (opset 21)."""
  x = R.uniform(-2, 2, (2, 5, 16)).astype(np.float32)
  w, s = qints(np.int8, 16, 8, lo=-127), R.uniform(0.005, 0.02, 8).astype(np.float32)
  inits = {"xs": np.float32(4 / 255), "xz": np.int8(0), "w": w, "s": s, "b": R.uniform(-0.1, 0.1, 8).astype(np.float32), "ys": np.float32(0.03),
           "yz": np.uint8(100), "sb": R.uniform(0.005, 0.02, (4, 8)).astype(np.float32), "zb": qints(np.int8, 4, 8, lo=-3, hi=3)}
  nodes = [N("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), N("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
           N("DequantizeLinear", ["w", "s"], ["wd"], axis=1), N("MatMul", ["xd", "wd"], ["m"]), N("Add", ["m", "b"], ["a"]),
           N("QuantizeLinear", ["a", "ys", "yz"], ["aq"]), N("DequantizeLinear", ["aq", "ys", "yz"], ["y"]),
           N("DequantizeLinear", ["w", "sb", "zb"], ["wb"], axis=0, block_size=4), N("MatMul", ["xd", "wb"], ["yb"])]
  against_ort(qmodel(nodes, {"x": x}, {"y": np.float32, "yb": np.float32}, inits), {"x": x}, optimized=False)


# ---- the ONNX project's node-test cases ----
LACKING = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ, TensorProto.UINT4,
           TensorProto.INT4, TensorProto.FLOAT4E2M1, TensorProto.UINT2, TensorProto.INT2}  # element types kiln has no dtype for
NODE_MODULES = {"quantizelinear": "QuantizeLinear", "dequantizelinear": "DequantizeLinear", "dynamicquantizelinear": "DynamicQuantizeLinear",
                "matmulinteger": "MatMulInteger", "convinteger": "ConvInteger", "qlinearmatmul": "QLinearMatMul", "qlinearconv": "QLinearConv"}


def _node_cases() -> list:
  """What onnx/backend/test/data/node/test_quantizelinear*, test_dequantizelinear*, test_dynamicquantizelinear*,
  test_matmulinteger*, test_convinteger* and test_qlinear* hold (model, inputs, outputs; the _expanded function forms too),
  from the generators that write them, run afresh into empty case lists."""
  from onnx.backend.test.case import node
  # imported first: a module's first import runs its cases into the lists too
  classes = [getattr(importlib.import_module(f"onnx.backend.test.case.node.{mod}"), op) for mod, op in NODE_MODULES.items()]
  saved = list(node._NodeTestCases), dict(node._existing_names), node._TargetOpType
  node._NodeTestCases.clear(), node._existing_names.clear()
  node._TargetOpType = None
  try:
    for cls in classes:
      for a in sorted(dir(cls)):
        if a.startswith("export"):
          np.random.seed(0)
          getattr(cls, a)()
    return list(node._NodeTestCases)
  finally:
    node._NodeTestCases[:] = saved[0]
    node._existing_names.clear(), node._existing_names.update(saved[1])
    node._TargetOpType = saved[2]


NODE_CASES = _node_cases()


def _array(v: object) -> np.ndarray: return np.asarray(v) if isinstance(v, np.ndarray | np.generic) else numpy_helper.to_array(v)


@pytest.mark.parametrize("keep", [None, 0], ids=["inputs", "constants"])
@pytest.mark.parametrize("case", NODE_CASES, ids=[c.name for c in NODE_CASES])
def test_onnx_node_cases(case: object, keep: int | None) -> None:
  """Each case as written (every input fed), with all but its first input as initializers, and with all of them (folded):
  equal to the case's outputs, or, where it uses a type kiln lacks, refused with an ONNXError."""
  m = onnx.ModelProto()
  m.CopyFrom(case.model)
  ins, outs = ([_array(v) for v in vs] for vs in case.data_sets[0])
  names, given = [i.name for i in m.graph.input], list(m.graph.input)
  lacking = any(i.type.tensor_type.elem_type in LACKING for i in given)
  if keep is not None:
    del m.graph.input[:]
    m.graph.input.extend(given[:keep])
    m.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in list(zip(names, ins))[keep:])
  feeds = dict(list(zip(names, ins))[:len(m.graph.input)])
  if lacking:
    with pytest.raises(ONNXError): konnx.load(m).run(feeds)
    return
  got = konnx.load(m).run(feeds)
  for o, want in zip(m.graph.output, outs):
    g = got[o.name]
    assert g.shape == want.shape and g.dtype == want.dtype, (o.name, g.shape, want.shape, g.dtype, want.dtype)
    if want.dtype.kind == "f": np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)
    else: np.testing.assert_array_equal(g, want)


def test_every_node_case_was_found() -> None:
  """45 cases in onnx 1.23: 16 use float8, 4-bit, 2-bit or float4 types (refused); the 29 others pass."""
  lacking = [c for c in NODE_CASES if any(i.type.tensor_type.elem_type in LACKING for i in c.model.graph.input)]
  assert len(NODE_CASES) >= 45 and len(NODE_CASES) - len(lacking) >= 29, [c.name for c in NODE_CASES]


# ---- refusals ----
def _refusal(nodes: list, inits: dict, x: np.ndarray | None = None) -> onnx.ModelProto:
  x = np.zeros((2, 3), np.float32) if x is None else x
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", ty(x.dtype), x.shape)],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],  # never looked at: the load stops before
                        [v if isinstance(v, onnx.TensorProto) else numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
  return helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)])


ONE, F8_ZP = np.float32(1), helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])
I8_23, I8_32, I8_CONV, I8_W = np.zeros((2, 3), np.int8), np.zeros((3, 2), np.int8), np.zeros((1, 1, 2, 2), np.int8), np.zeros((2, 1, 1, 1), np.int8)
QL = N("QuantizeLinear", ["x", "s"], ["y"])
REFUSALS = [  # (name, nodes, initializers, x, what the message says after "(Op, opset 25): ")
  ("float8 zero point", [N("QuantizeLinear", ["x", "s", "z"], ["y"])], {"s": ONE, "z": F8_ZP}, None, "float8_e4m3fn.*no dtype"),
  ("output_dtype differs", [N("QuantizeLinear", ["x", "s", "z"], ["y"], output_dtype=TensorProto.UINT8)], {"s": ONE, "z": np.int8(0)}, None,
   "output_dtype uint8 differs"),
  ("output_dtype int4", [N("QuantizeLinear", ["x", "s"], ["y"], output_dtype=TensorProto.INT4)], {"s": ONE}, None, "output_dtype=22 .INT4."),
  ("precision bfloat16", [N("QuantizeLinear", ["x", "s"], ["y"], precision=TensorProto.BFLOAT16)], {"s": ONE}, None, "precision=16"),
  ("scale per nothing", [N("QuantizeLinear", ["x", "s"], ["y"], axis=1)], {"s": np.ones(2, np.float32)}, None, "neither a scalar nor one per"),
  ("zero point shape", [N("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1)], {"s": np.ones(3, np.float32), "z": np.zeros(2, np.uint8)}, None,
   "zero point's shape"),
  ("axis out of range", [N("QuantizeLinear", ["x", "s"], ["y"], axis=2)], {"s": np.ones(3, np.float32)}, None, "axis 2 is out of range"),
  ("block shape", [N("QuantizeLinear", ["x", "s"], ["y"], axis=1, block_size=2)], {"s": np.ones((2, 1), np.float32)}, None,
   r"needs a scale of shape \(2, 2\)"),
  ("negative block", [N("DequantizeLinear", ["x", "s"], ["y"], block_size=-1)], {"s": ONE}, I8_23, "negative"),
  ("int32 zero point", [N("DequantizeLinear", ["x", "s", "z"], ["y"])], {"s": ONE, "z": np.int32(4)}, np.zeros((2, 3), np.int32), "int32 x takes no"),
  ("dequantize int64", [N("DequantizeLinear", ["x", "s"], ["y"])], {"s": ONE}, np.zeros((2, 3), np.int64), "input x is int64"),
  ("integer scale", [QL], {"s": np.int32(1)}, None, "the scale is int32; it must be a float"),
  ("matmul int16", [N("MatMulInteger", ["x", "b"], ["y"])], {"b": np.zeros((3, 2), np.int16)}, I8_23, "B is int16"),
  ("matmul zero point type", [N("MatMulInteger", ["x", "b", "az"], ["y"])], {"b": I8_32, "az": np.uint8(1)}, I8_23, "A's zero point is uint8"),
  ("matmul zero point rows", [N("MatMulInteger", ["x", "b", "az"], ["y"])], {"b": I8_32, "az": np.zeros(3, np.int8)}, I8_23, "one per row"),
  ("y scale per column", [N("QLinearMatMul", ["x", "s", "z", "b", "s", "z", "ys", "z"], ["y"])],
   {"s": ONE, "z": np.int8(0), "b": I8_32, "ys": np.ones(2, np.float32)}, I8_23, "y_scale .* must be a scalar"),
  ("float bias", [N("QLinearConv", ["x", "s", "z", "w", "s", "z", "s", "z", "b"], ["y"])],
   {"s": ONE, "z": np.int8(0), "w": I8_W, "b": np.zeros(2, np.float32)}, I8_CONV, "the bias is float32"),
  ("channel zero points", [N("ConvInteger", ["x", "w", "xz", "wz"], ["y"])], {"w": I8_W, "xz": np.int8(0), "wz": np.zeros(3, np.int8)}, I8_CONV,
   "one per output channel"),
]


@pytest.mark.parametrize("nodes,inits,x,match", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals(nodes: list, inits: dict, x: np.ndarray | None, match: str) -> None:
  with pytest.raises(ONNXError, match=f"\\({nodes[0].op_type}, opset 25\\): .*{match}"): konnx.load(_refusal(nodes, inits, x))
