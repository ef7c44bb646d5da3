"""Shape values with symbolic dims (kiln.graph.shape_values) through the node sequences torch's exporters write for a
dynamic batch and sequence: Expand to a (batch, 1, 1, seq) mask, the legacy exporter's cls_token.expand(batch, -1, -1),
arithmetic that stays a dim (batch * seq, comparisons decided from the bounds), a dim read as data (Cast to float),
position ids cut to the sequence (Slice to a symbolic end), Resize to (batch, C, H, W). Each model is loaded once and run
at several sizes against onnxruntime; what kiln cannot hold exactly is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402
from onnx_case import N, dyn_model, named_dims, ort  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import dims as sym  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402
from kiln.graph import shape_values as sv  # noqa: E402

RNG = np.random.default_rng(35)
DIMS = {"batch": (1, 6), "seq": (1, 12)}
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def i64(*v: int) -> np.ndarray: return np.asarray(v, np.int64)


def _sizes(m: onnx.ModelProto, make: object, sizes: list[tuple[int, int]], tol: float = 1e-5) -> konnx.Model:
  """One load, run at each (batch, seq) against onnxruntime."""
  km = konnx.load(m, dims=named_dims(m, DIMS))
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for b, s in sizes:
    feeds = make(b, s)  # type: ignore[operator]
    for name, w, g in zip([o.name for o in m.graph.output], sess.run(None, feeds), km.run(feeds).values()):
      assert g.shape == w.shape and g.dtype == w.dtype, (name, b, s, g.shape, w.shape, g.dtype, w.dtype)
      np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
  return km


def _dims(x: str, *which: tuple[int, str]) -> list:
  """Shape(x) -> Gather(i) -> Unsqueeze: each named dim as a 1-element shape value (torch's sym_size)."""
  nodes = [N("Shape", [x], [f"{x}_sh"])]
  for i, name in which:
    nodes += [N("Gather", [f"{x}_sh", f"i{i}"], [f"{name}0"], axis=0), N("Unsqueeze", [f"{name}0", "ax0"], [name])]
  return nodes


IDX = {f"i{i}": np.asarray(i, np.int64) for i in range(4)} | {"ax0": i64(0), "one": i64(1), "m1": i64(-1), "zero": i64(0)}


def test_expand_to_a_mask_of_batch_1_1_seq() -> None:
  """llama's causal mask: Range(seq) unsqueezed to (1, 1, 1, seq), expanded to Concat(batch, 1, 1, seq); a key mask
  (batch, seq) expanded to (batch, 1, seq, seq) (its target read off the scores' Shape)."""
  nodes = _dims("ids", (0, "b"), (1, "s")) + [
    N("Range", ["zero0", "s0", "one0"], ["r"]), N("Unsqueeze", ["r", "ax012"], ["r4"]),
    N("Concat", ["b", "one", "one", "s"], ["tgt"], axis=0), N("Expand", ["r4", "tgt"], ["pos"]),
    N("Cast", ["pos"], ["posf"], to=F),
    N("Unsqueeze", ["mask", "ax12"], ["m4"]), N("Concat", ["b", "one", "s", "s"], ["tgt2"], axis=0),
    N("Expand", ["m4", "tgt2"], ["mm"]), N("Add", ["mm", "posf"], ["y"])]
  inits = IDX | {"zero0": np.asarray(0, np.int64), "one0": np.asarray(1, np.int64), "ax012": i64(0, 1, 2), "ax12": i64(1, 2)}
  m = dyn_model(nodes, {"ids": (I64, ("batch", "seq")), "mask": (F, ("batch", "seq"))}, {"y": F, "pos": I64}, inits)
  _sizes(m, lambda b, s: {"ids": np.zeros((b, s), np.int64), "mask": RNG.standard_normal((b, s)).astype(np.float32)}, [(2, 5), (1, 12), (6, 1)])


def test_legacy_cls_token_expand() -> None:
  """torch.onnx.export (legacy) of cls_token.expand(batch, -1, -1): Concat(batch, -1, -1) -> Reshape([-1]) ->
  ConstantOfShape(Shape) -> Mul(-1) -> Equal -> Where -> Expand, then the Concat with the patch tokens."""
  d = 4
  nodes = _dims("x", (0, "b")) + [
    N("Concat", ["b", "m1", "m1"], ["c"], axis=0), N("Reshape", ["c", "m1"], ["r"]), N("Shape", ["r"], ["rs"]),
    N("ConstantOfShape", ["rs"], ["ones"], value=helper.make_tensor("v", I64, [1], [1])),
    N("Mul", ["ones", "m1"], ["neg"]), N("Equal", ["r", "neg"], ["eq"]), N("Where", ["eq", "ones", "r"], ["shape"]),
    N("Expand", ["cls", "shape"], ["tok"]), N("Concat", ["tok", "x"], ["y"], axis=1)]
  m = dyn_model(nodes, {"x": (F, ("batch", 3, d))}, {"y": F}, IDX | {"cls": RNG.standard_normal((1, 1, d)).astype(np.float32)})
  _sizes(m, lambda b, s: {"x": RNG.standard_normal((b, 3, d)).astype(np.float32)}, [(1, 1), (4, 1), (6, 1)])


def test_arithmetic_that_stays_a_dim() -> None:
  """batch * seq, (4 * seq) / 4, Max(seq, 1), Min(seq, 99), Add(seq, 0), Sub(seq, 0), Cast to int32 and back, and a Where
  on Greater(seq, 0) (decided from the bounds): the shapes of Reshapes that merge and split (batch, seq, 2)."""
  nodes = _dims("x", (0, "b"), (1, "s")) + [
    N("Mul", ["b", "s"], ["bs"]), N("Concat", ["bs", "two"], ["flat"], axis=0), N("Reshape", ["x", "flat"], ["f"]),
    N("Mul", ["s", "four"], ["s4"]), N("Div", ["s4", "four"], ["s1"]), N("Max", ["s1", "one"], ["s2"]), N("Min", ["s2", "big"], ["s3"]),
    N("Add", ["s3", "zero"], ["s5"]), N("Sub", ["s5", "zero"], ["s6"]), N("Cast", ["s6"], ["s7"], to=TensorProto.INT32),
    N("Cast", ["s7"], ["s8"], to=I64), N("Greater", ["s8", "zero"], ["pos"]), N("Where", ["pos", "s8", "m1"], ["s9"]),
    N("Concat", ["b", "s9", "two"], ["back"], axis=0), N("Reshape", ["f", "back"], ["y"])]
  m = dyn_model(nodes, {"x": (F, ("batch", "seq", 2))}, {"y": F, "f": F}, IDX | {"two": i64(2), "four": i64(4), "big": i64(99)})
  _sizes(m, lambda b, s: {"x": RNG.standard_normal((b, s, 2)).astype(np.float32)}, [(3, 5), (1, 12), (6, 1)])


def test_a_dim_read_as_data() -> None:
  """seq as a float (a mean's divisor), batch * seq added into int data, and a Shape concatenated with computed data: the
  dims' run-time values as tensors."""
  nodes = _dims("x", (0, "b"), (1, "s")) + [
    N("Cast", ["s0"], ["sf"], to=F), N("ReduceSum", ["x", "ax1"], ["sum"], keepdims=0), N("Div", ["sum", "sf"], ["mean"]),
    N("Mul", ["b0", "s0"], ["bs"]), N("Add", ["ids", "bs"], ["ab"]),
    N("ReduceSum", ["ids", "ax01"], ["tot"], keepdims=1), N("Reshape", ["tot", "m1"], ["tot1"]), N("Shape", ["x"], ["sh"]),
    N("Concat", ["sh", "tot1"], ["cat"], axis=0)]
  m = dyn_model(nodes, {"x": (F, ("batch", "seq")), "ids": (I64, ("batch", "seq"))}, {"mean": F, "ab": I64, "cat": I64},
             IDX | {"ax1": i64(1), "ax01": i64(0, 1)})
  _sizes(m, lambda b, s: {"x": RNG.standard_normal((b, s)).astype(np.float32), "ids": RNG.integers(-9, 9, (b, s)).astype(np.int64)},
         [(3, 5), (1, 12), (6, 1)])


def test_slice_to_a_symbolic_end() -> None:
  """BERT's position_ids[:, :seq] of a (1, 16) buffer (a view of symbolic length), then the embedding gather; and the
  same slice of the input's own seq axis (the identity)."""
  nodes = _dims("ids", (1, "s")) + [
    N("Slice", ["pos_ids", "zero", "s", "one"], ["pos"]), N("Gather", ["emb", "pos"], ["pe"], axis=0),
    N("Gather", ["emb", "ids"], ["te"], axis=0), N("Add", ["te", "pe"], ["y"]),
    N("Slice", ["ids", "zero", "s", "one"], ["same"])]
  inits = IDX | {"pos_ids": np.arange(16, dtype=np.int64)[None], "emb": RNG.standard_normal((16, 3)).astype(np.float32)}
  m = dyn_model(nodes, {"ids": (I64, ("batch", "seq"))}, {"y": F, "same": I64}, inits)
  km = _sizes(m, lambda b, s: {"ids": RNG.integers(0, 16, (b, s)).astype(np.int64)}, [(2, 5), (1, 12), (6, 1)])
  assert km.plan is not None


def test_resize_to_its_own_batch_and_channels() -> None:
  """torch's interpolate(size=(8, 8)) with a dynamic batch: sizes Concat(Shape(x)[0:2], [8, 8]); the batch is not resized."""
  nodes = [N("Shape", ["x"], ["sh"]), N("Slice", ["sh", "zero", "two"], ["nc"]), N("Concat", ["nc", "hw"], ["sz"], axis=0),
           N("Resize", ["x", "", "", "sz"], ["y"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel")]
  m = dyn_model(nodes, {"x": (F, ("batch", 3, 4, 5))}, {"y": F}, IDX | {"two": i64(2), "hw": i64(8, 8)}, opset=13)
  _sizes(m, lambda b, s: {"x": RNG.standard_normal((b, 3, 4, 5)).astype(np.float32)}, [(1, 1), (4, 1), (6, 1)])


def _refused(nodes: list, outs: dict[str, int], match: str, inputs: dict | None = None, inits: dict | None = None, dims: dict | None = None) -> None:
  m = dyn_model(nodes, inputs or {"x": (F, ("batch", "seq"))}, outs, IDX | (inits or {}))
  with pytest.raises(ONNXError, match=match): konnx.load(m, dims=dims or DIMS)


@pytest.mark.parametrize("case", ["sum", "inexact_div", "undecided", "wrap", "const", "bart", "past_bound", "resize", "expand"])
def test_refusals_name_the_node_and_the_dims(case: str) -> None:
  d = _dims("x", (0, "b"), (1, "s"))
  reshape = [N("Concat", ["b", "r"], ["shp"], axis=0), N("Reshape", ["x", "shp"], ["y"])]
  if case == "sum": _refused(d + [N("Add", ["s", "one"], ["r"], name="plus")] + reshape, {"y": F},
                             r"Reshape.*cannot reshape \(batch, seq\) to \(batch, seq \+ 1\)")
  if case == "inexact_div": _refused(d + [N("Div", ["s", "two"], ["r"], name="half")] + reshape, {"y": F}, r"half \(Div.*seq / 2 is not a whole",
                                     inits={"two": i64(2)})
  if case == "undecided": _refused(d + [N("Equal", ["b", "s"], ["e"], name="eq"), N("Where", ["e", "b", "s"], ["r"])] + reshape, {"y": F},
                                   r"eq \(Equal.*Equal\(batch, seq\) depends on the sizes fed \(bounds \[1, 6\] and \[1, 12\]\)")
  if case == "wrap": _refused(d + [N("Cast", ["s"], ["r"], name="narrow", to=TensorProto.INT8)] + reshape, {"y": F},
                              r"narrow \(Cast.*seq \(up to 300\) to int8 would wrap", dims={"batch": (1, 6), "seq": (1, 300)})
  if case == "const": _refused(d + [N("Concat", ["one", "s", "one", "one"], ["p"], axis=0), N("Pad", ["x", "p"], ["y"], name="pad")], {"y": F},
                               r"pad \(Pad.*input 1 .*constant.*symbolic dims of a Shape \(1, seq, 1, 1\)")
  if case == "bart": _refused([N("Slice", ["x", "zero", "m1", "one", "two"], ["y"], name="drop_last")], {"y": F},  # a step of 2
                              r"drop_last \(Slice.*\[0:-1:2\] of axis 1 of \(batch, seq\).*a strided slice of a symbolic axis", inits={"two": i64(2)})
  if case == "past_bound": _refused(d + [N("Slice", ["buf", "zero", "s", "one"], ["y"], name="pos")], {"y": F},
                                    r"pos \(Slice.*the end seq lies past the axis' 8 .* min\(seq, 8\)", inits={"buf": np.zeros((1, 8), np.float32)})
  if case == "resize": _refused([N("Shape", ["x"], ["sh"]), N("Gather", ["sh", "swap"], ["sz"]), N("Resize", ["x", "", "", "sz"], ["y"], name="rs")],
                                {"y": F}, r"rs \(Resize.*axis 0 of \(batch, seq\) the symbolic size seq.*own dim", inits={"swap": i64(1, 0)})
  if case == "expand": _refused(d + [N("Concat", ["s", "one"], ["t"], axis=0), N("Expand", ["c3", "t"], ["y"], name="ex")], {"y": F},
                                r"ex \(Expand.*axis 0 \(3 to seq\) broadcasts only for some sizes", inits={"c3": np.zeros((3, 1), np.float32)})


def test_rules_decide_from_bounds_never_by_building_uops() -> None:
  b, s = sym.variable("batch", 1, 6), sym.variable("seq", 3, 12)
  assert sv.BINARY["Equal"](s, -1) is False and sv.BINARY["Equal"](s, s) is True and sv.BINARY["Equal"](sym.mul(b, s), sym.mul(s, b)) is True
  assert sv.BINARY["Less"](s, 13) is True and sv.BINARY["GreaterOrEqual"](s, 3) is True and sv.BINARY["Greater"](s, 12) is False
  assert sv.BINARY["LessOrEqual"](s, s) is True and sv.BINARY["Max"](s, 2) is s and sv.BINARY["Min"](1, b) == 1
  assert sv.BINARY["Mul"](s, 0) == 0 and sv.BINARY["Div"](sym.mul(s, 6), 3) is sym.mul(s, 2) and sv.BINARY["Div"](-7, 2) == -3
  assert sv.BINARY["Sub"](s, s) == 0 and sv.BINARY["Add"](0, b) is b
  assert sv.BINARY["Add"](s, b) is sv.BINARY["Add"](b, s) and sym.fmt(sv.BINARY["Sub"](12, s)) == "-seq + 12"  # polynomials, one form each
  for op, a, c in (("Less", s, 5), ("Equal", b, 4), ("Max", b, s), ("Mul", s, -1), ("Div", s, b), ("Div", sym.add(s, b), b)):
    with pytest.raises(sv.Refused): sv.BINARY[op](a, c)
