"""kiln.graph.onnx against onnxruntime: each operator alone (edge attributes: negative axes, broadcasting, opset
differences), an MLP and a 2-layer BERT-style encoder built with onnx.helper, kernel counts, and refusals."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402
from onnx_case import RNG, N, check, f32, model  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

X34, Y4, Y34 = f32(3, 4), f32(4, lo=0.5), f32(3, 4, lo=0.5)
UNARY_OPS = ["Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Relu", "Sigmoid", "Neg", "Abs", "Identity"]


@pytest.mark.parametrize("op", UNARY_OPS)
def test_unary(op: str) -> None:
  x = f32(3, 4, lo=0.1) if op in ("Sqrt", "Log", "Reciprocal") else X34
  check(model([N(op, ["x"], ["y"])], {"x": x}, {"y": np.float32}), {"x": x}, 2e-5)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])
def test_binary_broadcast(op: str) -> None:
  x = f32(2, 3, 4, lo=0.2)
  check(model([N(op, ["x", "y"], ["z"])], {"x": x}, {"z": np.float32}, {"y": Y4}), {"x": x}, 2e-5)
  check(model([N(op, ["x", "y"], ["z"])], {"x": x, "y": f32(3, 1, lo=0.5)}, {"z": np.float32}), {"x": x, "y": f32(3, 1, lo=0.5)}, 2e-5)


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater"])
def test_compare_where_not(op: str) -> None:
  x = np.round(X34)
  m = model([N(op, ["x", "y"], ["c"]), N("Not", ["c"], ["nc"]), N("Where", ["nc", "x", "y"], ["z"])], {"x": x}, {"z": np.float32, "c": np.bool_},
            {"y": np.round(Y4)})
  check(m, {"x": x})


def test_matmul_gemm() -> None:
  a, b = f32(2, 3, 5, 6), f32(6, 4)
  check(model([N("MatMul", ["a", "b"], ["y"])], {"a": a}, {"y": np.float32}, {"b": b}), {"a": a}, 1e-5, kernels=1)
  check(model([N("MatMul", ["a", "b"], ["y"])], {"a": a, "b": f32(3, 6, 2)}, {"y": np.float32}), {"a": a, "b": f32(3, 6, 2)}, 1e-5)
  x, w, c = f32(5, 6), f32(4, 6), f32(4)
  m = model([N("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0)], {"x": x}, {"y": np.float32}, {"w": w, "c": c})
  check(m, {"x": x}, 1e-5, kernels=1)
  m = model([N("Gemm", ["x", "w"], ["y"], transA=1)], {"x": f32(6, 5)}, {"y": np.float32}, {"w": f32(6, 3)})
  check(m, {"x": f32(6, 5)}, 1e-5)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax(opset: int, axis: int) -> None:
  x = f32(2, 3, 5) * 3
  for op in ("Softmax", "LogSoftmax"):
    # over the last axis one kernel; over a middle one the reductions run inside the loop of the axes after it, so they get
    # kernels of their own (the scheduler does not reorder loops yet)
    check(model([N(op, ["x"], ["y"], axis=axis)], {"x": x}, {"y": np.float32}, opset=opset), {"x": x}, 1e-5,
          kernels=1 if axis == -1 or opset < 13 else None)


def test_layernorm_gelu() -> None:
  x, g, b = f32(2, 5, 8), f32(8), f32(8)
  check(model([N("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-6)], {"x": x}, {"y": np.float32}, {"g": g, "b": b}),
        {"x": x}, 1e-5, kernels=1)
  check(model([N("LayerNormalization", ["x", "g"], ["y"], axis=1)], {"x": x}, {"y": np.float32}, {"g": f32(5, 8)}), {"x": x}, 1e-5)
  for approx in ("none", "tanh"):
    check(model([N("Gelu", ["x"], ["y"], approximate=approx)], {"x": x}, {"y": np.float32}, opset=20), {"x": x}, 1e-5)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax"])
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce(op: str, opset: int, keepdims: int) -> None:
  x = f32(2, 3, 4)
  axes = np.array([-1, 0], np.int64)
  as_input = opset >= 18 or (op == "ReduceSum" and opset >= 13)
  if as_input: m = model([N(op, ["x", "axes"], ["y"], keepdims=keepdims)], {"x": x}, {"y": np.float32}, {"axes": axes}, opset)
  else: m = model([N(op, ["x"], ["y"], keepdims=keepdims, axes=[-1, 0])], {"x": x}, {"y": np.float32}, opset=opset)
  check(m, {"x": x}, 1e-5)


def test_movement() -> None:
  x = f32(2, 3, 4)
  i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
  cases = [
    ([N("Reshape", ["x", "s"], ["y"])], {"s": i64(0, -1)}), ([N("Transpose", ["x"], ["y"], perm=[2, 0, 1])], {}),
    ([N("Transpose", ["x"], ["y"])], {}), ([N("Unsqueeze", ["x", "a"], ["y"])], {"a": i64(-1, 1)}),
    ([N("Unsqueeze", ["x", "a"], ["u"]), N("Squeeze", ["u", "a"], ["y"])], {"a": i64(0)}),
    ([N("Concat", ["x", "x"], ["y"], axis=-2)], {}), ([N("Flatten", ["x"], ["y"], axis=2)], {}),
    ([N("Slice", ["x", "st", "en", "ax", "sp"], ["y"])], {"st": i64(-1, 0), "en": i64(-1000, 3), "ax": i64(2, 1), "sp": i64(-2, 2)}),
    ([N("Slice", ["x", "st", "en"], ["y"])], {"st": i64(1), "en": i64(9999)}),
    ([N("Expand", ["x", "s"], ["y"])], {"s": i64(2, 1, 1, 1)}), ([N("Dropout", ["x"], ["y"])], {}),
  ]
  for nodes, inits in cases: check(model(nodes, {"x": x}, {"y": np.float32}, inits), {"x": x})
  m = model([N("Split", ["x", "sp"], ["a", "b"], axis=2)], {"x": x}, {"a": np.float32, "b": np.float32}, {"sp": i64(1, 3)})
  check(m, {"x": x})
  m = model([N("Split", ["x"], ["a", "b"], axis=-1, split=[3, 1])], {"x": x}, {"a": np.float32, "b": np.float32}, opset=11)
  check(m, {"x": x})
  m = model([N("Slice", ["x"], ["y"], starts=[1], ends=[3], axes=[2])], {"x": x}, {"y": np.float32}, opset=9)
  check(m, {"x": x})


def test_gather_cast_shape_folding() -> None:
  table, ids = f32(10, 6), np.array([[1, 9, -1], [0, 3, 3]], np.int64)
  check(model([N("Gather", ["t", "i"], ["y"])], {"i": ids}, {"y": np.float32}, {"t": table}), {"i": ids})
  x = f32(2, 3, 4)
  check(model([N("Gather", ["x", "i"], ["y"], axis=1)], {"x": x}, {"y": np.float32}, {"i": np.array(2, np.int64)}), {"x": x})
  # Shape -> Gather -> Unsqueeze -> Concat -> Reshape: the shape arithmetic of exported models, folded at load
  nodes = [N("Shape", ["x"], ["s"]), N("Gather", ["s", "zero"], ["b"], axis=0), N("Unsqueeze", ["b", "ax0"], ["b1"]),
           N("Concat", ["b1", "m1"], ["ns"], axis=0), N("Reshape", ["x", "ns"], ["r"]), N("Cast", ["r"], ["y"], to=TensorProto.INT64),
           N("Shape", ["r"], ["rs"]), N("ConstantOfShape", ["rs"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [2.5])),
           N("Add", ["c", "r"], ["z"]),
           N("Constant", [], ["k"], value_float=3.0), N("Mul", ["z", "k"], ["w"]),
           N("Range", ["r0", "r1", "r2"], ["rg"]), N("Cast", ["rg"], ["rgf"], to=TensorProto.FLOAT), N("Add", ["w", "rgf"], ["out"])]
  inits = {"zero": np.array(0, np.int64), "ax0": np.array([0], np.int64), "m1": np.array([-1], np.int64),
           "r0": np.array(0, np.int64), "r1": np.array(12, np.int64), "r2": np.array(1, np.int64)}
  km = check(model(nodes, {"x": x}, {"y": np.int64, "out": np.float32}, inits), {"x": x * 3})
  assert len(km.plan.kernels) == 2  # the cast output, and one elementwise kernel for the rest


def test_refusals_name_node_op_attribute(tmp_path) -> None:
  x = f32(2, 3)
  with pytest.raises(ONNXError, match=r"node n1 \(Compress\).*operator Compress is not supported"):  # a data-dependent shape
    konnx.load(model([N("Compress", ["x", "c"], ["y"], name="n1")], {"x": x, "c": np.array([True, False])}, {"y": np.float32}))
  with pytest.raises(ONNXError, match=r"node ge \(Gelu.*attribute approximate='fast' is not supported"):
    konnx.load(model([N("Gelu", ["x"], ["y"], name="ge", approximate="fast")], {"x": x}, {"y": np.float32}, opset=20))
  with pytest.raises(ONNXError, match=r"node ln \(LayerNormalization.*stash_type=11 is not supported"):
    konnx.load(model([N("LayerNormalization", ["x", "g"], ["y"], name="ln", stash_type=11)], {"x": x}, {"y": np.float32}, {"g": f32(3)}))
  with pytest.raises(ONNXError, match="not a valid ONNX model.*bogus"):  # the checker refuses attributes the op does not have
    m = model([N("Softmax", ["x"], ["y"], name="sm")], {"x": x}, {"y": np.float32})
    m.graph.node[0].attribute.append(helper.make_attribute("bogus", 1))
    konnx.load(m)
  with pytest.raises(ONNXError, match="not a valid ONNX model"): konnx.load(b"\x08\x07garbage")
  bad = tmp_path / "bad.onnx"
  bad.write_bytes(b"not a protobuf at all" * 10)
  with pytest.raises(ONNXError, match="not a valid ONNX model"): konnx.load(str(bad))
  with pytest.raises(ONNXError, match="the model file does not exist"): konnx.load(str(tmp_path / "missing.onnx"))
  m = model([N("Relu", ["x"], ["y"])], {"x": x}, {"y": np.float32})
  m.graph.node[0].input[0] = "nope"
  with pytest.raises(ONNXError): konnx.load(m)
  sym = model([N("Relu", ["x"], ["y"])], {"x": x}, {"y": np.float32})
  sym.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
  with pytest.raises(ONNXError, match="symbolic.*batch"): konnx.load(sym)
  km = konnx.load(sym, dims={"batch": 2})
  np.testing.assert_array_equal(km.run({"x": x})["y"], np.maximum(x, 0))
  with pytest.raises(ONNXError, match="was not fed"): km.run({})
  assert "kernels" in km.summary() and "peak buffer memory" in str(km)


# ---- whole models ----
def _linear(nodes: list, inits: dict, x: str, name: str, n_in: int, n_out: int, gemm: bool = False) -> str:
  inits[f"{name}_w"] = (RNG.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
  inits[f"{name}_b"] = (RNG.standard_normal(n_out) * 0.02).astype(np.float32)
  nodes += [N("MatMul", [x, f"{name}_w"], [f"{name}_mm"]), N("Add", [f"{name}_mm", f"{name}_b"], [f"{name}_y"])]
  return f"{name}_y"


def test_mlp() -> None:
  nodes: list = []
  inits: dict = {}
  h = _linear(nodes, inits, "x", "l1", 32, 64)
  nodes.append(N("Relu", [h], ["h1"]))
  h = _linear(nodes, inits, "h1", "l2", 64, 64)
  nodes.append(N("Gelu", [h], ["h2"]))
  h = _linear(nodes, inits, "h2", "l3", 64, 10)
  nodes.append(N("Softmax", [h], ["y"], axis=-1))
  x = f32(16, 32)
  check(model(nodes, {"x": x}, {"y": np.float32}, inits, opset=20), {"x": x}, 1e-5, kernels=4)  # 3 linears (+act), softmax


def bert(layers: int, bs: int, s: int, hid: int, heads: int, ffn: int, vocab: int = 50) -> onnx.ModelProto:
  """A post-LN BERT-style encoder as a torch export would write it: embedding gather + positions + layernorm, per layer a
  fused qkv projection split into heads, scaled scores plus an additive mask from the int64 attention mask, softmax,
  context, output projection + residual + layernorm, GELU FFN + residual + layernorm; masked mean pooling."""
  dh = hid // heads
  i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
  inits: dict = {"emb": (RNG.standard_normal((vocab, hid)) * 0.5).astype(np.float32), "pos": (RNG.standard_normal((s, hid)) * 0.1).astype(np.float32),
                 "heads_shape": i64(bs, s, heads, dh), "ctx_shape": i64(bs, s, hid), "scale": np.array(1 / np.sqrt(dh), np.float32),
                 "one": np.array(1.0, np.float32), "neg": np.array(-10000.0, np.float32), "ax12": i64(1, 2), "ax_last": i64(-1),
                 "split3": i64(hid, hid, hid), "ax1": i64(1)}
  def ln(x: str, name: str) -> list:
    inits[f"{name}_g"] = (1 + RNG.standard_normal(hid) * 0.1).astype(np.float32)
    inits[f"{name}_b"] = (RNG.standard_normal(hid) * 0.1).astype(np.float32)
    return [N("LayerNormalization", [x, f"{name}_g", f"{name}_b"], [name], axis=-1, epsilon=1e-12)]
  nodes = [N("Gather", ["emb", "ids"], ["e0"]), N("Add", ["e0", "pos"], ["e1"]), *ln("e1", "h0"),
           N("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT), N("Unsqueeze", ["mf", "ax12"], ["m4"]), N("Sub", ["one", "m4"], ["m5"]),
           N("Mul", ["m5", "neg"], ["addmask"])]
  h = "h0"
  for li in range(layers):
    p = f"L{li}_"
    qkv = _linear(nodes, inits, h, p + "qkv", hid, 3 * hid)
    nodes.append(N("Split", [qkv, "split3"], [p + "q", p + "k", p + "v"], axis=-1))
    for t, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
      nodes += [N("Reshape", [p + t, "heads_shape"], [p + t + "r"]), N("Transpose", [p + t + "r"], [p + t + "t"], perm=perm)]
    nodes += [N("MatMul", [p + "qt", p + "kt"], [p + "s0"]), N("Mul", [p + "s0", "scale"], [p + "s1"]), N("Add", [p + "s1", "addmask"], [p + "s2"]),
              N("Softmax", [p + "s2"], [p + "pr"], axis=-1), N("MatMul", [p + "pr", p + "vt"], [p + "c0"]),
              N("Transpose", [p + "c0"], [p + "c1"], perm=[0, 2, 1, 3]), N("Reshape", [p + "c1", "ctx_shape"], [p + "c2"])]
    o = _linear(nodes, inits, p + "c2", p + "out", hid, hid)
    nodes += [N("Add", [o, h], [p + "r1"]), *ln(p + "r1", p + "h1")]
    f = _linear(nodes, inits, p + "h1", p + "up", hid, ffn)
    nodes.append(N("Gelu", [f], [p + "g"]))
    d = _linear(nodes, inits, p + "g", p + "down", ffn, hid)
    nodes += [N("Add", [d, p + "h1"], [p + "r2"]), *ln(p + "r2", p + "h2")]
    h = p + "h2"
  nodes += [N("Unsqueeze", ["mf", "ax_last"], ["mf3"]), N("Mul", [h, "mf3"], ["hm"]), N("ReduceSum", ["hm", "ax1"], ["hs"], keepdims=0),
            N("ReduceSum", ["mf", "ax1"], ["cnt"], keepdims=1), N("Div", ["hs", "cnt"], ["pooled"])]
  feeds = {"ids": np.zeros((bs, s), np.int64), "mask": np.zeros((bs, s), np.int64)}
  return model(nodes, feeds, {"pooled": np.float32, h: np.float32}, inits, opset=20)


@pytest.mark.parametrize("hid,heads", [(64, 4), (384, 12)])
def test_bert_encoder(hid: int, heads: int) -> None:
  bs, s, layers = 2, 16, 2
  m = bert(layers, bs, s, hid, heads, 4 * hid)
  ids = RNG.integers(0, 50, (bs, s)).astype(np.int64)
  mask = np.ones((bs, s), np.int64)
  mask[1, 11:] = 0
  km = check(m, {"ids": ids, "mask": mask}, 2e-4)
  # embedding + layernorm, the additive mask, 9 per layer (the hand-fused plan's count), the masked mean pooling, the ids' range check
  assert len(km.plan.kernels) == 1 + 1 + 9 * layers + 1 + 1, km.summary()


# ---- convolutions and pooling ----
@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 1, 1, 1]}, {"strides": [2, 2], "pads": [1, 0, 1, 2]}, {"dilations": [2, 1]},
                                   {"group": 2}, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}])
def test_conv(attrs: dict) -> None:
  x = f32(2, 4, 9, 8)
  w, b = f32(6, 4 // attrs.get("group", 1), 3, 3), f32(6)
  # the product (test_conv.py: a tiled matmul, reading a padded input in place), the bias; strided along its rows, a padded
  # copy of the input first (conv.py: its panel copy is then one masked load, not gated scalar loads)
  check(model([N("Conv", ["x", "w", "b"], ["y"], **attrs)], {"x": x}, {"y": np.float32}, {"w": w, "b": b}), {"x": x}, 1e-4,
        kernels=3 if attrs.get("strides") else 2)


@pytest.mark.parametrize("op,attrs", [("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
                                      ("MaxPool", {"kernel_shape": [2, 2]}), ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
                                      ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
                                      ("AveragePool", {"kernel_shape": [2, 3], "strides": [2, 1]}), ("GlobalAveragePool", {}),
                                      ("GlobalMaxPool", {})])
def test_pool(op: str, attrs: dict) -> None:
  x = f32(2, 3, 7, 6)
  check(model([N(op, ["x"], ["y"], **attrs)], {"x": x}, {"y": np.float32}), {"x": x}, 1e-5, kernels=1)


def test_small_cnn() -> None:
  """conv + batch norm + relu, max pool, conv + batch norm + relu, global average pool, flatten, linear (Gemm)."""
  def bn(c: int, name: str) -> dict:
    return {f"{name}_s": f32(c, lo=0.5, hi=1.5), f"{name}_b": f32(c, lo=-0.2, hi=0.2), f"{name}_m": f32(c, lo=-0.2, hi=0.2),
            f"{name}_v": f32(c, lo=0.5, hi=2)}
  inits = {"w1": f32(8, 3, 3, 3, lo=-0.3, hi=0.3), "w2": f32(16, 8, 3, 3, lo=-0.2, hi=0.2), "fc_w": f32(10, 16), "fc_b": f32(10),
           **bn(8, "bn1"), **bn(16, "bn2")}
  nodes = [N("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), N("BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"], ["b1"]),
           N("Relu", ["b1"], ["r1"]), N("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
           N("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]), N("BatchNormalization", ["c2", "bn2_s", "bn2_b", "bn2_m", "bn2_v"], ["b2"]),
           N("Relu", ["b2"], ["r2"]), N("GlobalAveragePool", ["r2"], ["g"]), N("Flatten", ["g"], ["f"]),
           N("Gemm", ["f", "fc_w", "fc_b"], ["y"], transB=1)]
  x = f32(4, 3, 16, 16)
  # conv 1's product with bn+relu as its epilogue, the max pool, conv 2's product with bn+relu (each conv reads its
  # padding in place), the global pool (a reduction feeding the linear layer's), the linear layer
  check(model(nodes, {"x": x}, {"y": np.float32}, inits), {"x": x}, 1e-4, kernels=5)


def _conv3x3_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
  """A 3x3, pad 1, stride 1 convolution in float64."""
  xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
  win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # (N, C, H, W, 3, 3)
  y = np.einsum("nchwij,ocij->nohw", win, w.astype(np.float64))
  return y if b is None else y + b.reshape(1, -1, 1, 1)


def _bn_ref(y: np.ndarray, s: np.ndarray, b: np.ndarray, m: np.ndarray, v: np.ndarray, eps: float = 1e-5) -> np.ndarray:
  r = lambda a: a.astype(np.float64).reshape(1, -1, 1, 1)  # noqa: E731
  return (y - r(m)) / np.sqrt(r(v) + eps) * r(s) + r(b)


def test_batchnorm_folds_into_conv() -> None:
  """A batch norm folds into the weights of the conv it reads (a negative scale included), unless the conv's output has
  another reader: same results as onnxruntime and as the unfolded maths in float64, one multiply fewer per element."""
  from kiln.ir.ops import Ops
  bn = {"s1": np.array([1.3, -0.7, 0.9, -1.6, 0.5, 1.1], np.float32), "b1": f32(6, lo=-0.2, hi=0.2), "m1": f32(6, lo=-0.3, hi=0.3),
        "v1": f32(6, lo=0.5, hi=2), "s2": f32(8, lo=-1.5, hi=1.5), "b2": f32(8, lo=-0.2, hi=0.2), "m2": f32(8, lo=-0.2, hi=0.2),
        "v2": f32(8, lo=0.5, hi=2)}
  inits = {"w1": f32(6, 3, 3, 3, lo=-0.4, hi=0.4), "cb1": f32(6, lo=-0.3, hi=0.3), "w2": f32(8, 6, 3, 3, lo=-0.3, hi=0.3), **bn}
  nodes = [N("Conv", ["x", "w1", "cb1"], ["c1"], pads=[1, 1, 1, 1]), N("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1"]),
           N("Relu", ["n1"], ["r1"]), N("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
           N("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]), N("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"]),
           N("Relu", ["n2"], ["r2"]), N("Add", ["r2", "c2"], ["y"])]  # c2 has two readers: its batch norm stays
  x = f32(2, 3, 10, 10)
  km = check(model(nodes, {"x": x}, {"y": np.float32}, inits), {"x": x}, 1e-5)
  r1 = np.maximum(_bn_ref(_conv3x3_ref(x, inits["w1"], inits["cb1"]), bn["s1"], bn["b1"], bn["m1"], bn["v1"]), 0)
  c2 = _conv3x3_ref(r1.reshape(2, 6, 5, 2, 5, 2).max((3, 5)), inits["w2"])
  want = np.maximum(_bn_ref(c2, bn["s2"], bn["b2"], bn["m2"], bn["v2"]), 0) + c2
  np.testing.assert_allclose(km.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
  assert km.compiled is not None
  nodes_ = {n for k in km.compiled.kernels for n in k.node.toposort()}
  scales = [n for n in nodes_ if n.op == "ALU" and n.arg is Ops.MUL and len(n.shape) == 4]  # the products' multiplies are 5-d
  assert len(scales) == 1 and scales[0].shape == (2, 8, 5, 5), scales  # only the second batch norm's scale is left


def test_global_average_pool_reads_its_maps_as_vectors() -> None:
  """A global average pool over NCHW maps sums each map along its contiguous run (the graph's sums may take another
  order: its kernel vectorises the reduce axis, not the channels, whose loads would be a gather), within float tolerance."""
  from kiln.ir.ops import AxisType, Ops
  x = f32(4, 32, 8, 8)
  km = check(model([N("GlobalAveragePool", ["x"], ["y"])], {"x": x}, {"y": np.float32}), {"x": x}, 1e-5, kernels=1)
  np.testing.assert_allclose(km.run({"x": x})["y"], x.astype(np.float64).mean((2, 3), keepdims=True), rtol=1e-5, atol=1e-6)
  k = km.plan.kernels[0]
  reduce_axes = {u.arg[0] for u in k.ast.toposort() if u.op is Ops.RANGE and u.arg[1] is AxisType.REDUCE}
  upcast = [o for o in k.kernel.compiled.applied_opts if o.startswith("UPCAST")]
  assert len(reduce_axes) == 1 and upcast == [f"UPCAST(axis={next(iter(reduce_axes))}, 64)"], (reduce_axes, upcast)


def test_mean_over_rows_and_columns_reads_its_maps_as_vectors() -> None:
  """ReduceMean over a map's rows and columns (torch's dynamo export of an adaptive pool; a squeeze-and-excitation block's
  pool of a SiLU) vectorises its innermost reduce axis, the columns, not the channels (a gather per load), within tolerance."""
  from kiln.ir.ops import AxisType, Ops
  x = f32(2, 24, 6, 32)
  nodes = [N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["m"]), N("ReduceMean", ["m", "axes"], ["y"], keepdims=1)]
  km = check(model(nodes, {"x": x}, {"y": np.float32}, {"axes": np.asarray([2, 3], np.int64)}, opset=18), {"x": x}, 1e-5, kernels=1)
  xd = x.astype(np.float64)
  np.testing.assert_allclose(km.run({"x": x})["y"], (xd / (1 + np.exp(-xd))).mean((2, 3), keepdims=True), rtol=1e-5, atol=1e-6)
  k = km.plan.kernels[0]
  inner = max(u.arg[0] for u in k.ast.toposort() if u.op is Ops.RANGE and u.arg[1] is AxisType.REDUCE)
  upcast = [o for o in k.kernel.compiled.applied_opts if o.startswith("UPCAST")]
  assert upcast and all(o.startswith(f"UPCAST(axis={inner},") for o in upcast), (inner, upcast)


def test_static_shape_arithmetic_through_a_scalar_gather() -> None:
  # torch's LSTM export before its LSTM node: Shape -> Gather(scalar index) -> Unsqueeze -> Concat -> Expand, every dim
  # fixed. A scalar Gather of a plain shape once became an object array, which Expand then refused with an AttributeError
  x = f32(2, 5, 8)
  nodes = [N("Shape", ["x"], ["s"]), N("Gather", ["s", "i0"], ["b"], axis=0), N("Unsqueeze", ["b", "ax0"], ["bu"]),
           N("Concat", ["one", "bu", "h"], ["shape"], axis=0), N("Expand", ["z", "shape"], ["e"]), N("Add", ["e", "zz"], ["y"])]
  inits = {"i0": np.asarray(0, np.int64), "ax0": np.asarray([0], np.int64), "one": np.asarray([1], np.int64), "h": np.asarray([16], np.int64),
           "z": np.zeros((1, 1, 1), np.float32), "zz": np.ones((1, 2, 16), np.float32)}
  check(model(nodes, {"x": x}, {"y": np.float32}, inits), {"x": x})


def test_every_unsupported_node_is_named_in_one_error() -> None:
  x = f32(2, 3)
  m = model([N("Hardmax", ["x"], ["a"], name="nz"), N("Relu", ["x"], ["r"], name="ok"), N("Elu", ["r"], ["g"], name="el", consumed_inputs=[0]),
             N("RandomUniformLike", ["x"], ["u"], name="uq")], {"x": x}, {"a": np.float32, "g": np.float32, "u": np.float32}, opset=1)
  with pytest.raises(ONNXError) as e: konnx.load(m)
  msg = str(e.value)
  assert msg.startswith("3 nodes use what kiln does not support"), msg
  for part in ("node nz (Hardmax): operator Hardmax", "node el (Elu, opset 1): attribute consumed_inputs",
               "node uq (RandomUniformLike): operator RandomUniformLike"):
    assert part in msg
  assert "node ok" not in msg


def test_ir3_initializer_not_declared_as_input() -> None:
  """Before IR 4 an initializer had to be a graph input too; onnxruntime runs a model whose is not (its mul_1.onnx) with it as a
  constant, and so does kiln. Only that checker complaint is let through: the model stays as it was, and one from IR 4 on
  with a broken node is still refused."""
  x, w = f32(3, 2), f32(3, 2)
  m = model([N("Mul", ["x", "w"], ["y"])], {"x": x}, {"y": np.float32}, {"w": w}, opset=7)
  m.ir_version = 3
  with pytest.raises(onnx.checker.ValidationError, match="w in initializer but not in graph input"): onnx.checker.check_model(m)
  km = check(m, {"x": x})
  assert [n for n, _, _ in km.inputs] == ["x"] and [i.name for i in m.graph.input] == ["x"]
  m.graph.node[0].op_type = "Bogus"
  with pytest.raises(ONNXError, match="not a valid ONNX model"): konnx.load(m)
