"""kiln.graph.onnx's padding, tiling, masking, index-reduction, normalisation and extra reduction operators
(onnx_ops_shape.py) against onnxruntime: each alone with its attributes and opset forms, edge cases, and refusals."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx_case import RNG, N, check, f32, model  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

X = f32(2, 3, 5, 4)


def i64(*v: int) -> np.ndarray: return np.asarray(v, np.int64)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect"])
@pytest.mark.parametrize("pads", [(0, 1, 2, 1, 0, 2, 1, 0), (0, 0, 1, 0, 0, 0, 2, 3), (0, -1, 1, -2, 0, 1, -2, 1)])
def test_pad_modes_and_negative_pads(mode: str, pads: tuple[int, ...]) -> None:
  check(model([N("Pad", ["x", "p", "c"], ["y"], mode=mode)], {"x": X}, {"y": np.float32},
              {"p": i64(*pads), "c": np.asarray(1.5, np.float32)}, opset=13), {"x": X})


def test_pad_axes_input_and_old_opset() -> None:
  check(model([N("Pad", ["x", "p", "", "ax"], ["y"], mode="reflect")], {"x": X}, {"y": np.float32},
              {"p": i64(2, 1, 1, 3), "ax": i64(-1, 2)}, opset=18), {"x": X})
  check(model([N("Pad", ["x"], ["y"], pads=[0, 0, 1, 2, 0, 0, 3, 0], value=-2.0)], {"x": X}, {"y": np.float32}, opset=10), {"x": X})


def test_pad_refusals() -> None:  # mode wrap: test_onnx_ops_misc.py
  with pytest.raises(ONNXError, match=r"reflect.*longer than the pad"):
    konnx.load(model([N("Pad", ["x", "p"], ["y"], mode="reflect")], {"x": X}, {"y": np.float32}, {"p": i64(0, 0, 0, 5, 0, 0, 0, 0)}, opset=13))


@pytest.mark.parametrize("reps", [(1, 2, 1, 3), (2, 1, 1, 1), (3, 2, 2, 1)])
def test_tile(reps: tuple[int, ...]) -> None:
  check(model([N("Tile", ["x", "r"], ["y"])], {"x": X}, {"y": np.float32}, {"r": i64(*reps)}), {"x": X})


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1, -7])
def test_trilu(upper: int, k: int | None) -> None:
  inits = {} if k is None else {"k": i64(k)}
  check(model([N("Trilu", ["x"] + ([] if k is None else ["k"]), ["y"], upper=upper)], {"x": X}, {"y": np.float32}, inits, opset=14), {"x": X})


def test_trilu_causal_mask_in_attention_scores() -> None:
  # the way exported decoders build a causal mask: Trilu over a constant of ones, then Where on the scores
  s = f32(2, 6, 6)
  nodes = [N("Trilu", ["ones", "k"], ["tri"], upper=1), N("Cast", ["tri"], ["m"], to=onnx.TensorProto.BOOL),
           N("Where", ["m", "ninf", "s"], ["masked"]), N("Softmax", ["masked"], ["y"], axis=-1)]
  check(model(nodes, {"s": s}, {"y": np.float32}, {"ones": np.ones((6, 6), np.float32), "k": i64(1), "ninf": np.asarray(-1e9, np.float32)},
              opset=14), {"s": s})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims,last", [(0, 1, 0), (-1, 0, 0), (2, 1, 1), (1, 0, 1)])
def test_argmax_argmin(op: str, axis: int, keepdims: int, last: int) -> None:
  x = RNG.integers(-3, 4, (2, 3, 5, 4)).astype(np.float32)  # small integers: ties, where first and last index differ
  check(model([N(op, ["x"], ["y"], axis=axis, keepdims=keepdims, select_last_index=last)], {"x": x}, {"y": np.int64}), {"x": x})


def test_instance_and_lp_normalization() -> None:
  sc, b = f32(3), f32(3)
  check(model([N("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-3)], {"x": X}, {"y": np.float32}, {"s": sc, "b": b}), {"x": X}, tol=1e-4)
  z = X.copy()
  z[0, :, 1] = 0  # an all-zero slice along axis 1 normalises to 0, as onnxruntime gives (not 0 / 0)
  for p in (1, 2):
    check(model([N("LpNormalization", ["x"], ["y"], axis=1, p=p)], {"x": X}, {"y": np.float32}), {"x": X})
    check(model([N("LpNormalization", ["x"], ["y"], axis=1, p=p)], {"x": z}, {"y": np.float32}), {"x": z})


@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"])
@pytest.mark.parametrize("opset,keepdims", [(13, 1), (13, 0), (18, 1)])
def test_extra_reductions(op: str, opset: int, keepdims: int) -> None:
  x = f32(2, 3, 5, lo=0.1, hi=3) if op == "ReduceLogSum" else f32(2, 3, 5, lo=-3, hi=3)
  if opset < 18: m = model([N(op, ["x"], ["y"], axes=[1, -1], keepdims=keepdims)], {"x": x}, {"y": np.float32}, opset=opset)
  else: m = model([N(op, ["x", "ax"], ["y"], keepdims=keepdims)], {"x": x}, {"y": np.float32}, {"ax": i64(1, -1)}, opset=opset)
  check(m, {"x": x}, tol=1e-5)


def test_reduce_log_sum_exp_large_and_all_reduced() -> None:
  x = f32(4, 6, lo=-2, hi=2) * 100  # exp of these would overflow float32 without the max taken out
  check(model([N("ReduceLogSumExp", ["x"], ["y"], axes=[1], keepdims=0)], {"x": x}, {"y": np.float32}, opset=13), {"x": x}, tol=1e-5)
  check(model([N("ReduceL2", ["x"], ["y"], keepdims=0)], {"x": x}, {"y": np.float32}, opset=13), {"x": x}, tol=1e-5)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("axis", [0, -1])
def test_cumsum(exclusive: int, reverse: int, axis: int) -> None:
  x = f32(3, 7)
  check(model([N("CumSum", ["x", "a"], ["y"], exclusive=exclusive, reverse=reverse)], {"x": x}, {"y": np.float32}, {"a": i64(axis)}), {"x": x})


def test_cumsum_position_ids_from_an_attention_mask() -> None:
  # HF-style position ids: cumsum(mask, -1) * mask - 1, all int64
  mask = np.asarray([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], np.int64)
  nodes = [N("CumSum", ["m", "a"], ["c"]), N("Mul", ["c", "m"], ["cm"]), N("Sub", ["cm", "one"], ["y"])]
  check(model(nodes, {"m": mask}, {"y": np.int64}, {"a": i64(-1), "one": i64(1)}), {"m": mask})


def test_size_folds_and_feeds_arithmetic() -> None:
  nodes = [N("Size", ["x"], ["n"]), N("Cast", ["n"], ["nf"], to=onnx.TensorProto.FLOAT), N("Div", ["x", "nf"], ["y"])]
  km = check(model(nodes, {"x": X}, {"y": np.float32}), {"x": X})
  assert km.plan is not None and len(km.plan.kernels) == 1


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_back(mode: str) -> None:
  x = f32(2, 8, 3, 4)
  check(model([N("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)], {"x": x}, {"y": np.float32}), {"x": x})
  check(model([N("SpaceToDepth", ["x"], ["y"], blocksize=2)], {"x": X[:, :, :4]}, {"y": np.float32}), {"x": X[:, :, :4].copy()})
  from onnx.reference import ReferenceEvaluator
  for mode in ("DCR", "CRD"):  # SpaceToDepth's mode (opset 28): onnxruntime predates it, onnx's reference is the check
    xs = X[:, :, :4].copy()
    m = model([N("SpaceToDepth", ["x"], ["y"], blocksize=2, mode=mode)], {"x": xs}, {"y": np.float32}, opset=28)
    np.testing.assert_array_equal(konnx.load(m).run({"x": xs})["y"], ReferenceEvaluator(m).run(None, {"x": xs})[0])


def test_refusals_name_the_node() -> None:
  with pytest.raises(ONNXError, match=r"node t \(Tile.*repeats"):
    konnx.load(model([N("Tile", ["x", "r"], ["y"], name="t")], {"x": X}, {"y": np.float32}, {"r": i64(1, 2)}))
  with pytest.raises(ONNXError, match=r"LpNormalization.*p=3"):
    konnx.load(model([N("LpNormalization", ["x"], ["y"], p=3)], {"x": X}, {"y": np.float32}))
  with pytest.raises(ONNXError, match=r"Trilu.*rank >= 2"):
    konnx.load(model([N("Trilu", ["x"], ["y"])], {"x": f32(5)}, {"y": np.float32}, opset=14))
  fed = konnx.load(model([N("Tile", ["x", "r"], ["y"], name="t")], {"x": X, "r": i64(1, 1, 1, 2)}, {"y": np.float32}))
  with pytest.raises(ONNXError, match=r"node t \(Tile.*repeats \[1, -1, 1, 2\] do not fit"):  # fed: read back by the run
    fed.run({"x": X, "r": i64(1, -1, 1, 2)})


EINSUMS = {"ij,jk->ik": [(3, 4), (4, 5)], "bij,bjk->bik": [(2, 3, 4), (2, 4, 5)], "bhqd,bhkd->bhqk": [(2, 3, 5, 4), (2, 3, 6, 4)],
           "i,i->": [(7,), (7,)], "ij->ji": [(3, 4)], "ij->": [(3, 4)], "...ij,...jk->...ik": [(2, 1, 3, 4), (1, 5, 4, 2)],
           "...j,...j->...": [(2, 3, 4), (2, 3, 4)],
           "ij,jk": [(3, 4), (4, 5)], "i,j->ij": [(3,), (4,)], "ij,jk,kl->il": [(2, 3), (3, 4), (4, 5)], "bid,bjd->bij": [(2, 5, 3), (2, 4, 3)],
           "abc->ca": [(2, 3, 4)], "ik,kj->ji": [(3, 4), (4, 2)],
           # diagonals (a letter twice in a term): the trace, a batch of diagonals, non-adjacent axes, beside a product
           "ii->": [(4, 4)], "ii->i": [(4, 4)], "bii->bi": [(2, 3, 3)], "iji->j": [(3, 5, 3)], "ij,jj->i": [(2, 3), (3, 3)]}


@pytest.mark.parametrize("eq", list(EINSUMS))
def test_einsum(eq: str) -> None:
  feeds = {f"x{i}": f32(*s) for i, s in enumerate(EINSUMS[eq])}
  check(model([N("Einsum", list(feeds), ["y"], equation=eq)], feeds, {"y": np.float32}), feeds, tol=1e-5)


def test_einsum_two_operands_is_one_kernel_and_refusals() -> None:
  feeds = {"a": f32(2, 3, 8, 4), "b": f32(2, 3, 8, 4)}
  check(model([N("Einsum", ["a", "b"], ["y"], equation="bhqd,bhkd->bhqk")], feeds, {"y": np.float32}), feeds, kernels=1)
  with pytest.raises(ONNXError, match=r"letter 'i' of term 'ii' has sizes 3 and 4"):
    konnx.load(model([N("Einsum", ["x"], ["y"], equation="ii->i")], {"x": f32(3, 4)}, {"y": np.float32}))


def test_einsum_of_scalars() -> None:
  feeds = {"a": np.array(3, np.float32), "b": np.array(-2, np.float32)}
  check(model([N("Einsum", ["a", "b"], ["y"], equation=",->")], feeds, {"y": np.float32}), feeds)


@pytest.mark.parametrize("ctm,near", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"), ("pytorch_half_pixel", "round_prefer_ceil")])
@pytest.mark.parametrize("scales", [(1, 1, 2, 2), (1, 1, 3, 1), (1, 2, 1, 4)])
def test_resize_nearest_whole_scales(ctm: str, near: str, scales: tuple[int, ...]) -> None:
  check(model([N("Resize", ["x", "", "s"], ["y"], mode="nearest", coordinate_transformation_mode=ctm, nearest_mode=near)], {"x": X},
              {"y": np.float32}, {"s": np.asarray(scales, np.float32)}, opset=13), {"x": X})


def test_resize_sizes_and_axes() -> None:  # every other mode, and the refusals: test_onnx_resize.py
  check(model([N("Resize", ["x", "", "", "sz"], ["y"], mode="nearest")], {"x": X}, {"y": np.float32}, {"sz": i64(2, 3, 10, 12)}, opset=13), {"x": X})
  check(model([N("Resize", ["x", "", "s"], ["y"], mode="nearest", axes=[2, 3])], {"x": X}, {"y": np.float32},
              {"s": np.asarray([2, 3], np.float32)}, opset=18), {"x": X})


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu_with_k_fed_at_run_time(upper) -> None:
  x = f32(2, 4, 5)
  m = model([N("Trilu", ["x", "k"], ["y"], upper=upper)], {"x": x, "k": np.array(0, np.int64)}, {"y": np.float32})
  km = konnx.load(m)
  for k in (-2, 0, 1, 7):  # one load serves every k
    feeds = {"x": x, "k": np.array(k, np.int64)}
    np.testing.assert_array_equal(km.run(feeds)["y"], np.triu(x, k) if upper else np.tril(x, k))
