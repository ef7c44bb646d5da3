"""What the model zoo's dynamic exports still needed, each against onnxruntime at several sizes from one load:
ScatterND / ScatterElements on data of symbolic shape (bart's shift_tokens_right: input_ids[:, :-1] written into [:, 1:]
of a (batch, seq) table, its indices from a Range; the update count seq - 1 is 0 at seq 1), Tile by a Shape's symbolic
dims (xcit's positional encoding tiled by the batch), a truncated Div of Shape dims that is still a dim (RAFT's
torch.chunk of a doubled batch) and a Slice that selects nothing of a computed value (phi3's whole-head rotary)."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402
from onnx_case import N, check_exact, dyn_model  # noqa: E402

from kiln.graph import IndexOutOfRangeError, ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

RNG = np.random.default_rng(11)
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def f32(*shape: int) -> np.ndarray: return RNG.standard_normal(shape).astype(np.float32)


def _c(v: list[int] | int) -> np.ndarray: return np.array(v, np.int64)


# ---- scatters on symbolic data ----
def _shift_right(lo: int) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
  """bart's dynamo export: ScatterND of x[:, :-1].T into rows 1.. of x.T, the row numbers a Range to seq."""
  nodes = [N("Shape", ["x"], ["s"], start=1, end=2), N("Squeeze", ["s"], ["n"]), N("Range", ["one", "n", "one"], ["r"]),
           N("Unsqueeze", ["r", "ax1"], ["idx"]), N("Transpose", ["x"], ["data"], perm=[1, 0]),
           N("Slice", ["x", "zero1", "minus1", "ax1"], ["head"]), N("Transpose", ["head"], ["upd"], perm=[1, 0]),
           N("ScatterND", ["data", "idx", "upd"], ["y"])]
  inits = {"one": _c(1), "ax1": _c([1]), "zero1": _c([0]), "minus1": _c([-1])}
  return dyn_model(nodes, {"x": (F, ("batch", "seq"))}, {"y": F}, inits), {"batch": (1, 4), "seq": (lo, 9)}


@pytest.mark.parametrize("lo", [1, 2])  # seq - 1 updates: none at seq 1 (each row keeps its data), one or more from 2 (gathered)
def test_scatternd_of_a_shifted_sequence(lo: int) -> None:
  m, dims = _shift_right(lo)
  x = f32(3, 9)
  x[1, 2] = -0.0
  check_exact(m, dims, [{"x": x[:b, :s]} for b, s in ((3, 9), (1, lo), (2, 4))])


def test_scatternd_with_updates_over_several_axes_and_duplicates() -> None:
  # bart's script export: index pairs (batch, k, 2) into a (batch, seq) table; the updates (batch, k) do not flatten when k is
  # a sum, so every row reduces over them; fed pairs repeat rows (the last in row-major order wins)
  nodes = [N("Slice", ["ia", "zero1", "minus1", "ax1"], ["idx"]), N("Slice", ["u", "zero1", "minus1", "ax1"], ["upd"]),
           N("ScatterND", ["x", "idx", "upd"], ["y"])]
  m = dyn_model(nodes, {"x": (F, ("batch", "seq")), "ia": (I64, ("b2", "k", 2)), "u": (F, ("b2", "k"))}, {"y": F},
                {"ax1": _c([1]), "zero1": _c([0]), "minus1": _c([-1])})
  dims = {"batch": (1, 4), "seq": (1, 6), "b2": (1, 3), "k": (1, 5)}
  def feeds(b: int, s: int, b2: int, k: int) -> dict[str, np.ndarray]:
    u = f32(b2, k)
    u[0, 0] = -0.0
    return {"x": f32(b, s), "ia": np.stack([RNG.integers(-b, b, (b2, k)), RNG.integers(-s, s, (b2, k))], -1), "u": u}
  km = check_exact(m, dims, [feeds(3, 5, 3, 5), feeds(1, 1, 1, 1), feeds(4, 6, 2, 3)])
  with pytest.raises(IndexOutOfRangeError, match=r"indices\[\.\.\., 1\] on axis 1 of data \(batch, seq\): index 2 is out of range \[-seq, seq\)"):
    km.run({"x": f32(2, 2), "ia": np.array([[[0, 2], [0, 0]]]), "u": f32(1, 2)})


def test_scatterelements_on_symbolic_data_with_reductions() -> None:
  # fed indices along seq with reductions (max keeps onnxruntime's order with NaNs), and constant indices into (batch, seq)
  nodes = [N("ScatterElements", ["x", "ia", "u"], ["ya"], axis=1, reduction="add"), N("ScatterElements", ["x", "ia", "u"], ["yb"], axis=1,
           reduction="max"), N("ScatterElements", ["x", "ib", "v"], ["yc"], axis=0), N("ScatterElements", ["x", "ib", "v"], ["yd"], axis=1)]
  m = dyn_model(nodes, {"x": (F, ("batch", "seq")), "ia": (I64, ("batch", "k")), "u": (F, ("batch", "k"))}, {o: F for o in ("ya", "yb", "yc", "yd")},
                {"ib": _c([[-1, 0]]), "v": np.array([[5, 6]], np.float32)})
  dims = {"batch": (1, 4), "seq": (2, 6), "k": (1, 5)}
  def feeds(b: int, s: int, k: int) -> dict[str, np.ndarray]:  # small whole numbers: the add is exact in any order
    u = RNG.integers(-8, 8, (b, k)).astype(np.float32)
    u[0, 0] = np.nan
    return {"x": RNG.integers(-8, 8, (b, s)).astype(np.float32), "ia": RNG.integers(-s, s, (b, k)), "u": u}
  check_exact(m, dims, [feeds(3, 4, 5), feeds(1, 2, 1), feeds(4, 6, 3)])
  bad = dyn_model(nodes[2:3], {"x": (F, ("batch", "seq"))}, {"yc": F}, {"ib": _c([[4, 0]]), "v": np.array([[5, 6]], np.float32)})
  xdims = {"batch": dims["batch"], "seq": dims["seq"]}  # x's dims alone: load refuses a dims name the model does not have
  with pytest.raises(ONNXError, match=r"axis 0 of data \(batch, seq\): index 4 is out of range \[-batch, batch\) for every value up to 4"):
    konnx.load(bad, dims=xdims)
  km = konnx.load(dyn_model(nodes[2:3], {"x": (F, ("batch", "seq"))}, {"yc": F}, {"ib": _c([[3, 0]]), "v": np.array([[5, 6]], np.float32)}),
                  dims=xdims)
  with pytest.raises(IndexOutOfRangeError, match="index 3 is out of range"): km.run({"x": f32(2, 3)})  # in range only from batch 4


def test_bool_scatter_over_several_axes() -> None:
  m = dyn_model([N("ScatterND", ["x", "ia", "u"], ["y"])], {"x": (TensorProto.BOOL, ("batch", 3)), "ia": (I64, ("k", "j", 1)),
                "u": (TensorProto.BOOL, ("k", "j", 3))}, {"y": TensorProto.BOOL})
  dims = {"batch": (1, 5), "k": (1, 3), "j": (1, 2)}
  check_exact(m, dims, [{"x": RNG.random((b, 3)) < 0.5, "ia": RNG.integers(-b, b, (k, j, 1)), "u": RNG.random((k, j, 3)) < 0.5}
                   for b, k, j in ((5, 3, 2), (1, 1, 1), (3, 2, 1))])


def test_a_symbolic_scatter_past_the_dense_limit_is_refused() -> None:
  m = dyn_model([N("ScatterND", ["x", "ia", "u"], ["y"], reduction="add")], {"x": (F, ("n", 64)), "ia": (I64, ("k", 1)), "u": (F, ("k", 64))},
                {"y": F})
  with pytest.raises(ONNXError, match=r"each of the n rows compares itself with all k updates \(67108864 elements at the dims' upper bounds\)"):
    konnx.load(m, dims={"n": (1, 1024), "k": (1, 1024)})


# ---- Tile by a Shape's symbolic dims ----
SHAPE_PARTS = [N("Shape", ["x"], ["sh"]), N("Slice", ["sh", "zero1", "one1"], ["b"]), N("Slice", ["sh", "one1", "two1"], ["s"])]
PART_INITS = {"zero1": _c([0]), "one1": _c([1]), "two1": _c([2])}


def test_tile_by_symbolic_dims() -> None:
  # timm's xcit tiles its positional encoding (1, C, H, W) by (batch, 1, 1, 1); repeats that multiply dims (seq*batch)
  tail = N("Slice", ["x", "one1", "big", "one1"], ["tail"])  # x[:, 1:]: (batch, seq - 1)
  nodes = SHAPE_PARTS + [N("Concat", ["b", "one1", "one1"], ["ra"], axis=0), N("Tile", ["pos", "ra"], ["ya"]),
                         N("Concat", ["s", "b"], ["rb"], axis=0), N("Tile", ["x", "rb"], ["yb"]),
                         tail, N("Concat", ["two1", "one1"], ["rc"], axis=0), N("Tile", ["tail", "rc"], ["yc"])]
  inits = PART_INITS | {"big": _c([1 << 40])}
  m = dyn_model(nodes, {"x": (F, ("batch", "seq"))}, {"ya": F, "yb": F, "yc": F}, inits | {"pos": f32(1, 4, 2)})
  check_exact(m, {"batch": (1, 4), "seq": (1, 5)}, [{"x": f32(b, s)} for b, s in ((3, 5), (1, 1), (2, 3))])
  bad = dyn_model(SHAPE_PARTS + [tail, N("Concat", ["one1", "s"], ["r"], axis=0), N("Tile", ["tail", "r"], ["y"], name="tile")],
                  {"x": (F, ("batch", "seq"))}, {"y": F}, inits)
  with pytest.raises(ONNXError, match=r"tile \(Tile.*axis 1 \(seq - 1\) repeated seq times is -seq \+ seq\*seq: a sum times another dim"):
    konnx.load(bad, dims={"batch": (1, 4), "seq": (2, 5)})


# ---- a truncated Div of Shape dims that is still a dim ----
def test_chunk_of_a_doubled_batch() -> None:
  # RAFT runs both images through one encoder (Concat on the batch) and torch.chunk splits it: (2*batch + 1) / 2 is batch
  nodes = [N("Concat", ["x", "x2"], ["both"], axis=0), N("Shape", ["both"], ["sh"]), N("Slice", ["sh", "zero1", "one1"], ["n"]),
           N("Add", ["n", "one1"], ["n1"]), N("Div", ["n1", "two1"], ["half"]), N("Mul", ["half", "two1"], ["end"]),
           N("Slice", ["both", "zero1", "half", "zero1"], ["a"]), N("Slice", ["both", "half", "end", "zero1"], ["b"])]
  m = dyn_model(nodes, {"x": (F, ("batch", 3)), "x2": (F, ("batch", 3))}, {"a": F, "b": F}, PART_INITS)
  check_exact(m, {"batch": (1, 4)}, [{"x": f32(b, 3), "x2": f32(b, 3)} for b in (1, 4, 2)])
  odd = dyn_model(nodes[1:3] + [N("Div", ["n", "two1"], ["half"], name="half")] + nodes[5:7], {"both": (F, ("batch", 3))}, {"a": F}, PART_INITS)
  with pytest.raises(ONNXError, match=r"half \(Div.*batch / 2 is not a whole number"): konnx.load(odd, dims={"batch": (1, 4)})


# ---- an empty slice of a computed value ----
def test_slice_to_nothing_of_a_computed_value() -> None:
  # phi3's partial rotary with the whole head rotated: q[..., 16:] of a 16-wide head is empty, concatenated after q[..., :16]
  nodes = [N("Neg", ["x"], ["q"]), N("Slice", ["q", "zero1", "rot", "m1"], ["q_rot"]), N("Slice", ["q", "rot", "big", "m1"], ["q_pass"]),
           N("Concat", ["q_rot", "q_pass"], ["y"], axis=-1)]
  inits = {"zero1": _c([0]), "rot": _c([16]), "big": _c([1 << 62]), "m1": _c([-1])}
  check_exact(dyn_model(nodes, {"x": (F, (2, 3, 16))}, {"y": F}, inits), {}, [{"x": f32(2, 3, 16)}])
  # with a symbolic batch the empty piece is a SymbolicEmpty (no array holds (batch, 3, 0)): Concat drops it, Shape reads its dims
  shaped = nodes + [N("Shape", ["q_pass"], ["pass_shape"])]
  sym = dyn_model(shaped, {"x": (F, ("batch", 3, 16))}, {"y": F, "pass_shape": onnx.TensorProto.INT64}, inits)
  check_exact(sym, {"batch": (1, 4)}, [{"x": f32(b, 3, 16)} for b in (1, 4, 2)])
  other = dyn_model(nodes[:3] + [N("Relu", ["q_pass"], ["y"])], {"x": (F, ("batch", 3, 16))}, {"y": F}, inits)
  with pytest.raises(ONNXError, match=r"input 'q_pass' is empty \(a dim of 0\) beside symbolic dims \(batch, 3, 0\): only Concat and Shape"):
    konnx.load(other, dims={"batch": (1, 4)})
  out = dyn_model(nodes[:3], {"x": (F, ("batch", 3, 16))}, {"q_pass": F}, inits)
  with pytest.raises(ONNXError, match=r"graph output 'q_pass' is empty \(a dim of 0\) beside symbolic dims \(batch, 3, 0\)"):
    konnx.load(out, dims={"batch": (1, 4)})


# ---- reductions over a Shape's symbolic dims ----
def test_reductions_of_a_shape_stay_dims() -> None:
  """ReduceProd of (batch, 3, seq)'s Shape is batch*3*seq, a dim: a Reshape to it is the flatten, symbolic (not a cut);
  ReduceProd of its first two, and ReduceSum (opset 13, axes an input) fold the same way; ReduceMax (max(batch, 3) is no
  dim) stays data, computed at run time."""
  nodes = [N("Shape", ["x"], ["sh"]), N("ReduceProd", ["sh"], ["n"], keepdims=1), N("Reshape", ["x", "n"], ["flat"]),
           N("Slice", ["sh", "zero1", "two1"], ["bs"]), N("ReduceProd", ["bs"], ["mx0"], keepdims=1), N("ReduceMax", ["sh"], ["mx1"], keepdims=1),
           N("Add", ["mx0", "mx1"], ["mx"]), N("ReduceSum", ["sh", "zero1"], ["sm"], keepdims=1),
           N("Concat", ["mx", "sm"], ["both"], axis=0), N("Cast", ["both"], ["bf"], to=F), N("Mul", ["flat", "two_f"], ["y"])]
  inits = {"zero1": _c([0]), "two1": _c([2]), "two_f": np.array([2.0], np.float32)}
  m = dyn_model(nodes, {"x": (F, ("batch", 3, "seq"))}, {"y": F, "bf": F}, inits, opset=13)
  km = check_exact(m, {"batch": (1, 4), "seq": (1, 8)}, [{"x": f32(b, 3, s)} for b, s in ((1, 1), (4, 8), (2, 5))])
  assert km.program is None  # no cut: every dim stayed symbolic
