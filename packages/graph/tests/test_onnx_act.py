import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import helper  # noqa: E402
from onnx_case import N, check, f32, model  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

# kiln.graph.onnx's activation and elementwise-maths operators (onnx_ops_act.py) against onnxruntime: defaults and non-default
# attributes, edge inputs (large |x|, exact .5 ties, negatives, NaN and inf, zeros), Clip's opset 6 attributes and opset 11/13
# inputs, PRelu's slope broadcast, integer and float Mod, load-time folding, one fused kernel for a chain, and refusals naming
# the node, the op and the attribute.

NAN, INF = np.float32(np.nan), np.float32(np.inf)
EDGES = np.array([-100, -88, -30, -20, -5, -1, -0.5, 0, 0.5, 1, 5, 20, 30, 88, 100], np.float32)
X = np.concatenate([EDGES, f32(49) * 4]).reshape(8, 8)
SPECIAL = np.array([NAN, INF, -INF, 0, -0.0, 1e30, -1e30, 3.4e38, -3.4e38], np.float32)
ACTS = [("LeakyRelu", {}), ("LeakyRelu", {"alpha": 0.3}), ("Elu", {}), ("Elu", {"alpha": 0.5}), ("Selu", {}),
        ("Selu", {"alpha": 1.2, "gamma": 2.0}), ("Celu", {}), ("Celu", {"alpha": 2.5}), ("ThresholdedRelu", {}),
        ("ThresholdedRelu", {"alpha": -0.7}), ("Softplus", {}), ("Softsign", {}), ("HardSigmoid", {}),
        ("HardSigmoid", {"alpha": 0.35, "beta": 0.25}), ("HardSwish", {}), ("Mish", {}), ("Sin", {}), ("Cos", {})]


def one(op: str, x: np.ndarray, out: type = np.float32, opset: int = 18, tol: float = 1e-5, **attrs) -> konnx.Model:
  return check(model([N(op, ["x"], ["y"], **attrs)], {"x": x}, {"y": out}, opset=opset), {"x": x}, tol, kernels=1)


@pytest.mark.parametrize("op,attrs", ACTS, ids=[f"{o}-{'-'.join(f'{k}{v}' for k, v in a.items()) or 'default'}" for o, a in ACTS])
def test_activation(op: str, attrs: dict) -> None:
  one(op, X, **attrs)


@pytest.mark.parametrize("op", ["LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Softplus", "HardSigmoid", "HardSwish", "Mish",
                                "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Clip"])
def test_nan_inf(op: str) -> None:
  """NaN stays NaN (ThresholdedRelu's x > alpha is false for it: 0), inf as onnxruntime gives it, extremes do not overflow."""
  one(op, SPECIAL)


def test_softplus_mish_tails() -> None:
  """The tails that log(1 + exp(x)) loses (x << 0: it gives 0) or overflows on (x >> 0), to 1e-5 relative against float64."""
  x = np.concatenate([np.linspace(-80, -10, 64), np.linspace(10, 1e4, 64)]).astype(np.float32)
  xd = x.astype(np.float64)
  sp = np.logaddexp(xd, 0)
  for op, want in (("Softplus", sp), ("Mish", xd * np.tanh(sp))):
    got = konnx.load(model([N(op, ["x"], ["y"])], {"x": x}, {"y": np.float32}, opset=18)).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)  # exp's own error at |x| ~ 80; log(1 + e^x) would give 0
    one(op, x)


def test_cos_accuracy() -> None:
  """Cos correctly rounded from float64's cos, also beside its zeros (where float32 1 - 2 sin^2(x/2) is ~1e-7 off) and for huge x."""
  x = np.concatenate([np.linspace(-10, 10, 4001), np.float32(np.pi / 2) * np.arange(-50, 51)]).astype(np.float32)
  got = konnx.load(model([N("Cos", ["x"], ["y"])], {"x": x}, {"y": np.float32})).run({"x": x})["y"]
  want = np.cos(x.astype(np.float64))
  assert (np.abs(got - want) <= 0.5 * np.spacing(np.abs(want).astype(np.float32))).all()
  one("Cos", x, tol=1e-6)
  big = np.array([1e30, -1e30, 3.4e38, 12345.678, 1e8 + 4, np.pi * 2**20], np.float32)  # range reduction of huge x
  one("Cos", big, tol=1e-6)


def test_prelu_broadcast() -> None:
  x = f32(2, 3, 4, 5)
  for slope in (f32(3, 1, 1), f32(5), f32(1), f32(4, 5), f32(2, 3, 4, 5)):
    check(model([N("PRelu", ["x", "s"], ["y"])], {"x": x}, {"y": np.float32}, {"s": slope}), {"x": x}, kernels=1)
  s = f32(3, 1, 1)  # the slope fed at run time
  check(model([N("PRelu", ["x", "s"], ["y"])], {"x": x, "s": s}, {"y": np.float32}), {"x": x, "s": s})
  xi = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
  check(model([N("PRelu", ["x", "s"], ["y"])], {"x": xi}, {"y": np.int32}, {"s": np.array([2, -3, 1, 0], np.int32)}), {"x": xi})
  with pytest.raises(ONNXError, match=r"node pr \(PRelu.*slope \(3, 4\) does not broadcast to the input \(3, 1\)"):
    konnx.load(model([N("PRelu", ["x", "s"], ["y"], name="pr")], {"x": f32(3, 1)}, {"y": np.float32}, {"s": f32(3, 4)}))


CLIP_X = np.concatenate([SPECIAL, f32(16) * 3]).reshape(5, 5)


@pytest.mark.parametrize("bounds", [(-1.0, 1.5), (-0.5, None), (None, 0.25), (None, None)])  # min > max: onnxruntime refuses Clip-6
def test_clip_opset6_attributes(bounds: tuple) -> None:
  lo, hi = bounds
  attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
  one("Clip", CLIP_X, opset=6, **attrs)


@pytest.mark.parametrize("bounds", [(-1.0, 1.5), (-0.5, None), (None, 0.25), (None, None), (1.0, -1.0)])
@pytest.mark.parametrize("opset", [11, 13])
def test_clip_inputs(bounds: tuple, opset: int) -> None:
  lo, hi = bounds
  names = ["x", "" if lo is None else "lo", "" if hi is None else "hi"]
  while names[-1] == "": names.pop()
  inits = {k: np.array(v, np.float32) for k, v in (("lo", lo), ("hi", hi)) if v is not None}
  check(model([N("Clip", names, ["y"])], {"x": CLIP_X}, {"y": np.float32}, inits, opset), {"x": CLIP_X}, kernels=1)
  feeds = {"x": CLIP_X, **inits}  # the bounds fed at run time
  check(model([N("Clip", names, ["y"])], feeds, {"y": np.float32}, opset=opset), feeds)


@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_clip_int(dt: type) -> None:
  x = np.array([[-2**31, -7, -1, 0, 3, 9, 2**31 - 1]], dt)
  m = model([N("Clip", ["x", "lo", "hi"], ["y"])], {"x": x}, {"y": dt}, {"lo": np.array(-3, dt), "hi": np.array(5, dt)}, 13)
  check(m, {"x": x}, kernels=1)
  check(model([N("Clip", ["x", "", "hi"], ["y"])], {"x": x}, {"y": dt}, {"hi": np.array(5, dt)}, 13), {"x": x})


ROUNDING_X = np.concatenate([np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -3.5, -0.4, 0.6, -1.7, 1.7, 0, -0.0, 2**22 + 0.5,
                                       -(2**22 + 1.5), 2**23 + 1, 1e30, -1e30, 1e-30, -1e-30], np.float32),
                             SPECIAL, f32(60) * 10, np.round(f32(40) * 8) + 0.5]).astype(np.float32)


@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round"])
def test_rounding(op: str) -> None:
  """Exact: ties round to even, negatives go the right way, values past 2^23 stay, NaN and inf pass."""
  km = one(op, ROUNDING_X, tol=0)
  assert op != "Round" or (km.run({"x": ROUNDING_X})["y"][:8] == [-2, -2, -0, 0, 2, 2, 4, -4]).all()


def test_sign() -> None:
  one("Sign", ROUNDING_X, tol=0)
  for dt in (np.int32, np.int64):
    x = np.array([-5, -1, 0, 1, 7, np.iinfo(dt).min, np.iinfo(dt).max], dt)
    one("Sign", x, dt)


@pytest.mark.parametrize("pos,neg", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_isinf_isnan(pos: int, neg: int) -> None:
  one("IsInf", SPECIAL, np.bool_, detect_positive=pos, detect_negative=neg)
  one("IsNaN", SPECIAL, np.bool_)


def test_xor() -> None:
  a, b = np.array([[True, False, True, False]] * 3), np.array([True, True, False, False])
  a[1] = ~a[1]
  check(model([N("Xor", ["a", "b"], ["y"])], {"a": a, "b": b}, {"y": np.bool_}), {"a": a, "b": b}, kernels=1)
  check(model([N("Xor", ["a", "b"], ["y"])], {"a": a}, {"y": np.bool_}, {"b": np.array(True)}), {"a": a})


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_mod_int(fmod: int, dt: type) -> None:
  """Python's modulo (the divisor's sign) for fmod=0, C's (the dividend's) for fmod=1, exactly, past 2^53 too."""
  info = np.iinfo(dt)
  a = np.array([7, -7, 7, -7, 0, 6, -6, 13, -13, info.max, info.min, info.max - 12345, info.min + 1, 5, -5], dt)
  b = np.array([3, 3, -3, -3, 5, 3, -3, 1, -1, 1000003, 7, -97, -2, 12, -12], dt)
  check(model([N("Mod", ["a", "b"], ["y"], fmod=fmod)], {"a": a, "b": b}, {"y": dt}), {"a": a, "b": b}, kernels=1)
  x = np.arange(-12, 12, dtype=dt).reshape(4, 6)  # broadcast against a per-column divisor
  check(model([N("Mod", ["x", "d"], ["y"], fmod=fmod)], {"x": x}, {"y": dt}, {"d": np.array([5, -5, 3, -3, 1, 7], dt)}), {"x": x})


def test_mod_float() -> None:
  """fmod=1 on floats is exact: quotients up to FLT_MAX / the smallest denormal, zeros, inf and NaN as C's fmod."""
  a = np.array([7.5, -7.5, 7.5, -7.5, 5.25, -0.0, 1e30, -1e30, 3.4e38, -3.3e38, 1e-38, 0.3, 5, INF, 3, NAN, 1, 16777217, 1e10],
               np.float32)
  b = np.array([2, 2, -2, -2, 0.1, 3, 3, 7, 1.4e-45, 4.2e-45, 3e-39, 0.1, 0, 2, INF, 1, NAN, 3, -0.7], np.float32)
  a = np.concatenate([a, f32(40) * 100, f32(40)]).astype(np.float32)
  b = np.concatenate([b, f32(40, lo=0.1, hi=3) * np.sign(f32(40)), f32(40, lo=1e-3, hi=1e-2)]).astype(np.float32)
  check(model([N("Mod", ["a", "b"], ["y"], fmod=1)], {"a": a, "b": b}, {"y": np.float32}), {"a": a, "b": b}, tol=0, kernels=1)


def test_mod_float_fmod_0_from_opset_28() -> None:
  """fmod=0 on floats (defined from opset 28): A - floor(A / B) * B, the divisor's sign, against numpy's mod (onnxruntime
  predates it), infinities and NaN as the spec lists them."""
  a = np.array([7.5, -7.5, 7.5, -7.5, 5.25, 1e30, -3.3e38, 0.3, 5, INF, 3, -3, NAN, 1, 1e10], np.float32)
  b = np.array([2, 2, -2, -2, 0.1, 3, 7, 0.1, 0, 2, INF, INF, 1, NAN, -0.7], np.float32)
  a = np.concatenate([a, f32(40) * 100]).astype(np.float32)
  b = np.concatenate([b, f32(40, lo=0.1, hi=3) * np.sign(f32(40))]).astype(np.float32)
  km = konnx.load(model([N("Mod", ["a", "b"], ["y"])], {"a": a, "b": b}, {"y": np.float32}, opset=28))
  with np.errstate(all="ignore"): want = np.mod(a, b)
  np.testing.assert_array_equal(km.run({"a": a, "b": b})["y"], want)


def test_mod_refusals() -> None:
  x = f32(2, 3)
  with pytest.raises(ONNXError, match=r"node md \(Mod.*fmod=0 on float inputs.*before opset 28"):
    konnx.load(model([N("Mod", ["x", "d"], ["y"], name="md")], {"x": x}, {"y": np.float32}, {"d": f32(3)}))
  g = helper.make_graph([N("Mod", ["a", "b"], ["y"], name="m64", fmod=1)], "g",
                        [helper.make_tensor_value_info(k, onnx.TensorProto.DOUBLE, [3]) for k in "ab"],
                        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, [3])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  with pytest.raises(ONNXError, match=r"node m64 \(Mod.*float64 Mod is not supported"): konnx.load(m)


def test_constants_fold() -> None:
  """Every input a constant: the nodes fold with numpy at load time (no kernel) and agree with onnxruntime."""
  c, ci = ROUNDING_X[:30].copy(), np.array([7, -7, 9, -9, 0], np.int64)
  nodes = [N(op, ["c"], [op.lower()]) for op in ("Floor", "Ceil", "Round", "Sign", "Cos", "Sin", "Softplus", "Mish", "HardSwish", "Elu")]
  nodes += [N("IsInf", ["c"], ["isinf"], detect_negative=0), N("IsNaN", ["c"], ["isnan"]), N("Clip", ["c", "lo", "hi"], ["clip"]),
            N("PRelu", ["c", "s"], ["prelu"]), N("Mod", ["ci", "di"], ["mod0"]), N("Mod", ["ci", "di"], ["mod1"], fmod=1),
            N("Mod", ["c", "s"], ["fmod"], fmod=1), N("Xor", ["t", "f"], ["xor"]), N("LeakyRelu", ["c"], ["leaky"], alpha=0.2)]
  outs = {o: (np.bool_ if o in ("isinf", "isnan", "xor") else np.int64 if o.startswith("mod") else np.float32)
          for nd in nodes for o in nd.output}
  inits = {"c": c, "ci": ci, "di": np.array([3, 3, -4, -4, 2], np.int64), "lo": np.array(-1, np.float32), "hi": np.array(2, np.float32),
           "s": np.float32(0.3) * np.ones(30, np.float32), "t": np.array([True, False, True]), "f": np.array([True, True, False])}
  km = check(model(nodes, {}, outs, inits, opset=18), {}, tol=1e-6)
  assert km.plan is None


def test_chain_one_kernel() -> None:
  """Several of these ops in a row fuse into one kernel."""
  x = np.concatenate([X.reshape(-1), ROUNDING_X[:36]]).reshape(10, 10)
  nodes = [N("LeakyRelu", ["x"], ["a"], alpha=0.1), N("Elu", ["a"], ["b"]), N("Clip", ["b", "lo", "hi"], ["c"]), N("HardSwish", ["c"], ["d"]),
           N("Softplus", ["d"], ["e"]), N("Mish", ["e"], ["f"]), N("Cos", ["f"], ["g"]), N("Sin", ["g"], ["h"]), N("Mul", ["h", "k"], ["i"]),
           N("Round", ["i"], ["j"]), N("Floor", ["f"], ["l"]), N("Add", ["j", "l"], ["y"])]
  inits = {"lo": np.array(-2, np.float32), "hi": np.array(6, np.float32), "k": np.array(10, np.float32)}
  check(model(nodes, {"x": x}, {"y": np.float32}, inits, opset=18), {"x": x}, kernels=1)


def test_unknown_attribute_refused() -> None:
  """An attribute an op's schema has (opset 1's consumed_inputs) but kiln does not take: the loader names node, op and
  attribute. One the schema lacks: onnx's checker refuses it, named with the op."""
  x = f32(2, 3)
  for op in ("LeakyRelu", "Elu", "HardSigmoid", "Floor"):
    m = model([N(op, ["x"], ["y"], name="n7", consumed_inputs=[0])], {"x": x}, {"y": np.float32}, opset=1)
    with pytest.raises(ONNXError, match=rf"node n7 \({op}, opset 1\): attribute consumed_inputs is not supported"): konnx.load(m)
  m = model([N("Softplus", ["x"], ["y"], name="sp")], {"x": x}, {"y": np.float32})
  m.graph.node[0].attribute.append(helper.make_attribute("beta", 2.0))
  with pytest.raises(ONNXError, match="attribute: beta for operator Softplus"): konnx.load(m)
  with pytest.raises(ONNXError, match=r"node fl \(Floor.*needs a float input, got int64"):
    konnx.load(model([N("Floor", ["x"], ["y"], name="fl")], {"x": np.ones(3, np.int64)}, {"y": np.int64}))
