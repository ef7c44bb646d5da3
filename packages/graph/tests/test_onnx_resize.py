"""kiln.graph.onnx's Resize and Upsample (onnx_ops_resize.py) against onnxruntime: every mode x coordinate transform x
up/down x scales/sizes (many Resize nodes in one model, one load each), the layouts and opset forms, torch's
F.interpolate exports, the ONNX node tests for Resize and Upsample, and the refusals."""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx_case import N, check, f32, model  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

ort.set_default_logger_severity(3)  # the models leave their outputs' shapes to inference: no warnings about that
CTMS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize", "tf_half_pixel_for_nn"]
KINDS = [("nearest", {"nearest_mode": m}) for m in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")] + [
  ("linear", {}), ("cubic", {}), ("cubic", {"exclude_outside": 1, "cubic_coeff_a": -0.5}), ("linear", {"antialias": 1}),
  ("cubic", {"antialias": 1}), ("linear", {"antialias": 1, "exclude_outside": 1})]


def f32a(*v: float) -> np.ndarray: return np.asarray(v, np.float32)
def i64(*v: int) -> np.ndarray: return np.asarray(v, np.int64)


@pytest.mark.parametrize("ctm", CTMS)
def test_every_mode_up_and_down_by_scales_and_sizes(ctm: str) -> None:
  """Each kind of Resize two ways, each scaling one axis down and the other up (fractionally): by scales, and by sizes;
  tf_crop_and_resize with a roi reaching past the input, where extrapolation_value shows."""
  x = f32(2, 3, 9, 11)
  inits = {"roi": f32a(0, 0, -0.1, 0.2, 1, 1, 0.8, 1.15), "mix": f32a(1, 1, 0.6, 1.7), "mixsz": i64(2, 3, 14, 4)}
  nodes, outs = [], {}
  for mode, attrs in KINDS:
    for ins in (["x", "roi", "mix"], ["x", "roi", "", "mixsz"]):
      name = f"y{len(nodes)}"
      nodes.append(N("Resize", ins, [name], mode=mode, coordinate_transformation_mode=ctm, extrapolation_value=-3.0, **attrs))
      outs[name] = np.float32
  check(model(nodes, {"x": x}, outs, inits, opset=19), {"x": x})


def test_torch_interpolate_exports() -> None:
  """F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False / True) and size=(h, w) at fractional ratios,
  as torch exports them: each a single fused kernel."""
  x = f32(1, 4, 10, 13)
  up2 = f32a(1, 1, 2, 2)
  check(model([N("Resize", ["x", "", "s"], ["y"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel", nearest_mode="floor")],
              {"x": x}, {"y": np.float32}, {"s": up2}, opset=13), {"x": x}, kernels=1)
  check(model([N("Resize", ["x", "", "s"], ["y"], mode="linear", coordinate_transformation_mode="align_corners")],
              {"x": x}, {"y": np.float32}, {"s": up2}, opset=13), {"x": x}, kernels=1)
  # size=(h, w): torch takes N, C from Shape and concatenates the size; kiln folds that at load
  nodes = [N("Shape", ["x"], ["sh"]), N("Slice", ["sh", "z", "two"], ["nc"]), N("Concat", ["nc", "hw"], ["sz"], axis=0),
           N("Resize", ["x", "", "", "sz"], ["y"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel")]
  for hw in ((17, 9), (7, 29), (1, 5)):
    check(model(nodes, {"x": x}, {"y": np.float32}, {"z": i64(0), "two": i64(2), "hw": i64(*hw)}, opset=13), {"x": x}, kernels=1)
  # nearest at a whole factor stays a repeat: one copy kernel, no gather
  km = check(model([N("Resize", ["x", "", "s"], ["y"], mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
                   {"x": x}, {"y": np.float32}, {"s": up2}, opset=13), {"x": x}, kernels=1)
  assert "gather" not in km.summary()


def test_onnxruntime_rules_at_the_edges() -> None:
  """Where onnxruntime's result is not the formula's in float32: nearest coordinates within 1e-6 of a half are ties
  (14.499999 from half_pixel at scale 0.3 rounds up under round_prefer_ceil), and its antialias code leaves an axis whose
  length stays (scale 1.08 on 10) as it is, though tf_crop_and_resize still extrapolates there."""
  x = f32(1, 2, 42, 10)
  nodes = [N("Resize", ["x", "", "s"], ["y0"], mode="nearest", nearest_mode="round_prefer_ceil"),
           N("Resize", ["x", "", "s"], ["y1"], mode="nearest", nearest_mode="round_prefer_floor",
             coordinate_transformation_mode="pytorch_half_pixel"),
           N("Resize", ["x", "", "t"], ["y2"], mode="linear", antialias=1), N("Resize", ["x", "", "t"], ["y3"], mode="cubic", antialias=1),
           N("Resize", ["x", "r", "t"], ["y4"], mode="linear", antialias=1, coordinate_transformation_mode="tf_crop_and_resize")]
  inits = {"s": f32a(1, 1, 0.3, 2.1), "t": f32a(1, 1, 0.5, 1.08), "r": f32a(0, 0, 0.1, 0.1, 1, 1, 0.9, 1.2)}
  check(model(nodes, {"x": x}, {f"y{i}": np.float32 for i in range(5)}, inits, opset=19), {"x": x})


def test_linear_without_a_gather() -> None:
  """Bilinear at a whole factor whose taps repeat (half_pixel, pytorch_half_pixel, asymmetric at 2 and 4) is shifted slices
  interleaved, and a short axis (align_corners on 8) a product with the taps' matrix: one kernel, or two, and no gather.
  An inf reaches only the outputs whose taps read it, as onnxruntime's on that row (a product's 0 * inf would be NaN across
  it); onnxruntime also spreads NaN to the next row through its weight 0 on H at scale 1, which kiln does not resize."""
  x = f32(1, 3, 12, 20)
  for ctm, s in (("half_pixel", 4), ("pytorch_half_pixel", 2), ("asymmetric", 2)):
    km = check(model([N("Resize", ["x", "", "s"], ["y"], mode="linear", coordinate_transformation_mode=ctm)], {"x": x}, {"y": np.float32},
                     {"s": f32a(1, 1, s, s)}, opset=13), {"x": x}, kernels=1)
    assert "gather" not in km.summary(), (ctm, km.summary())
  x = f32(1, 2, 5, 8)
  x[0, 1, 2, 3] = np.inf
  m = model([N("Resize", ["x", "", "s"], ["y"], mode="linear", coordinate_transformation_mode="align_corners")], {"x": x},
            {"y": np.float32}, {"s": f32a(1, 1, 1, 4)}, opset=13)
  km = konnx.load(m)
  assert "gather" not in km.summary(), km.summary()
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  got = km.run({"x": x})["y"]
  np.testing.assert_allclose(got[0, 1, 2], want[0, 1, 2], rtol=1e-5, atol=1e-5)  # inf and NaN where onnxruntime has them
  rest = np.ones(got.shape, bool)
  rest[0, 1, 2] = False
  assert np.isfinite(got[rest]).all()
  np.testing.assert_allclose(got[rest & np.isfinite(want)], want[rest & np.isfinite(want)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_layouts_and_ranks_onnxruntime_takes(mode: str) -> None:
  """2-D, NHWC (the scales on H and W of N, H, W, C), 3-D and 5-D (trilinear), and an axis left alone between two resized."""
  cases = [(f32(7, 9), f32a(1.5, 0.7)), (f32(2, 6, 7, 3), f32a(1, 1.4, 1.6, 1)), (f32(1, 2, 4, 5), f32a(1, 1, 2.5, 0.8))]
  if mode != "cubic":  # onnxruntime's cubic takes 2-D and 4-D, and NHWC upscaled only
    cases += [(f32(2, 6, 7, 3), f32a(1, 0.6, 0.8, 1)), (f32(5, 4, 6), f32a(1.6, 0.5, 2)), (f32(1, 2, 3, 4, 5), f32a(1, 1, 2, 0.8, 1.5))]
  for x, s in cases:
    check(model([N("Resize", ["x", "", "s"], ["y"], mode=mode)], {"x": x}, {"y": np.float32}, {"s": s}, opset=13), {"x": x})


def test_ranks_onnxruntime_refuses_against_the_onnx_reference() -> None:
  """1-D linear, 3-D cubic and linear on a batch axis: onnxruntime refuses these; onnx's reference implementation checks them."""
  from onnx.reference import ReferenceEvaluator
  for x, s, mode in [(f32(9), f32a(1.7), "linear"), (f32(4, 5, 6), f32a(1.5, 0.8, 2.2), "cubic"), (f32(3, 2, 5, 4), f32a(2, 1, 1, 1), "linear")]:
    m = model([N("Resize", ["x", "", "s"], ["y"], mode=mode)], {"x": x}, {"y": np.float32}, {"s": s}, opset=13)
    want = ReferenceEvaluator(m).run(None, {"x": x})[0]
    np.testing.assert_allclose(konnx.load(m).run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


def test_opset_forms_axes_and_aspect_ratio() -> None:
  x = f32(1, 2, 6, 8)
  cases = [  # (nodes, inits, opset)
    ([N("Upsample", ["x"], ["y"], mode="nearest", scales=[1.0, 1.0, 2.0, 3.0])], {}, 7),
    ([N("Upsample", ["x", "s"], ["y"], mode="linear")], {"s": f32a(1, 1, 1.5, 2)}, 9),
    ([N("Resize", ["x", "s"], ["y"], mode="nearest")], {"s": f32a(1, 1, 0.6, 0.7)}, 10),  # Resize-10 rounds a downscale up
    ([N("Resize", ["x", "s"], ["y"], mode="linear")], {"s": f32a(1, 1, 1.5, 0.5)}, 10),
    ([N("Resize", ["x", "r", "s"], ["y"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize")],
     {"r": f32a(0, 0, 0.2, 0.1, 1, 1, 0.9, 0.7), "s": f32a(1, 1, 2, 1.5)}, 11),
    ([N("Resize", ["x", "", "s"], ["y"], mode="cubic", axes=[3, 2])], {"s": f32a(1.5, 0.8)}, 18),
    ([N("Resize", ["x", "r", "", "sz"], ["y"], mode="linear", axes=[2, 3], coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=7.0)], {"r": f32a(-0.2, 0.1, 1.2, 0.8), "sz": i64(9, 5)}, 18),
    ([N("Resize", ["x", "", "", "sz"], ["y"], mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_larger")], {"sz": i64(9, 20)}, 18),
    ([N("Resize", ["x", "", "", "sz"], ["y"], mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_smaller")], {"sz": i64(9, 5)}, 18),
    ([N("Resize", ["x", "", "", "sz"], ["y"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize")],  # as onnxruntime:
     {"sz": i64(1, 2, 6, 8)}, 13),  # an unchanged shape is the input itself, roi or not
  ]
  for nodes, inits, opset in cases:
    check(model(nodes, {"x": x}, {"y": np.float32}, inits, opset=opset), {"x": x})
  xi = np.arange(2 * 3 * 5, dtype=np.int32).reshape(1, 2, 3, 5)  # nearest on integers
  check(model([N("Resize", ["x", "", "s"], ["y"], mode="nearest")], {"x": xi}, {"y": np.int32}, {"s": f32a(1, 1, 2.5, 0.6)}, opset=13), {"x": xi})


def test_onnx_node_tests() -> None:
  """The ONNX backend's node tests for Resize and Upsample (onnx.backend.test.case.node: the cases its
  data/node/test_resize_* files hold), roi, scales and sizes made constants of the model as a converter leaves them
  (fed at run time, node_tests.py runs them: specialise.py). Two expect an output onnxruntime does not give:
  align_corners onto an output length the reference takes unrounded (scale * length); kiln gives onnxruntime's."""
  import onnx.backend.test.case.node as cases
  results: dict[str, bool] = {}
  for op, module in (("Resize", "resize"), ("Upsample", "upsample")):
    cases._NodeTestCases.clear()
    cases._existing_names.clear()
    cases._TargetOpType = op
    name = f"onnx.backend.test.case.node.{module}"  # its classes export their cases as they are made: importing it collects them
    if name in sys.modules: importlib.reload(sys.modules[name])
    else: importlib.import_module(name)
    for case in list(cases._NodeTestCases):
      (ins, outs), = case.data_sets
      m = onnx.ModelProto()
      m.CopyFrom(case.model)
      g = m.graph
      g.initializer.extend(onnx.numpy_helper.from_array(a, vi.name) for vi, a in list(zip(g.input, ins))[1:])
      del g.input[1:]
      got = konnx.load(m).run({g.input[0].name: ins[0]})[g.output[0].name]
      results[case.name] = got.shape == outs[0].shape and np.allclose(got, outs[0], rtol=case.rtol, atol=case.atol)
      if not results[case.name]:
        want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {g.input[0].name: ins[0]})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=case.name)
  cases._TargetOpType = None
  failed = sorted(k for k, ok in results.items() if not ok)
  assert len(results) >= 40 and failed == ["test_resize_downsample_scales_cubic_align_corners",
                                           "test_resize_downsample_scales_linear_align_corners"], failed


def test_refusals() -> None:
  x = f32(1, 2, 6, 8)
  def load(node: object, inits: dict, opset: int = 13, feeds: dict | None = None, dtype: type = np.float32) -> None:
    konnx.load(model([node], feeds or {"x": x}, {"y": dtype}, inits, opset=opset))
  for node, inits, why in [
    (N("Resize", ["x", "", "s"], ["y"], mode="area"), {"s": f32a(1, 1, 2, 2)}, "mode='area'"),
    (N("Resize", ["x", "", "s"], ["y"], nearest_mode="up"), {"s": f32a(1, 1, 2, 2)}, "nearest_mode='up'"),
    (N("Resize", ["x", "", "s"], ["y"], coordinate_transformation_mode="corners"), {"s": f32a(1, 1, 2, 2)}, "coordinate_transformation_mode"),
    (N("Resize", ["x", "", "s", "sz"], ["y"]), {"s": f32a(1, 1, 2, 2), "sz": i64(1, 2, 3, 3)}, "both scales and sizes"),
    (N("Resize", ["x", "", "s"], ["y"]), {"s": f32a(1, 2, 2)}, "3 scales for 4 axes"),
    (N("Resize", ["x", "", "s"], ["y"]), {"s": f32a(1, 1, -2, 2)}, "must be finite and > 0"),
    (N("Resize", ["x", "", "s"], ["y"]), {"s": f32a(1, 1, np.nan, 2)}, "must be finite and > 0"),
    (N("Resize", ["x", "", "s"], ["y"]), {"s": f32a(1, 1, 0.1, 1)}, "empty axis"),
    (N("Resize", ["x", "", "s"], ["y"]), {"s": f32a(1, 1, 3e9, 3e9)}, "MAX_"),
    (N("Resize", ["x", "", "s"], ["y"]), {"s": f32a(1, 1, 3e38, 3e38)}, "overflow"),
    (N("Resize", ["x", "", "", "sz"], ["y"]), {"sz": i64(1, 2, 0, 4)}, "integers >= 1"),
    (N("Resize", ["x", "r", "s"], ["y"], coordinate_transformation_mode="tf_crop_and_resize"), {"r": f32a(0, 1), "s": f32a(1, 1, 2, 2)},
     "roi has 2 values"),
  ]:
    with pytest.raises(ONNXError, match=rf"Resize.*{why}"): load(node, inits)
  with pytest.raises(ONNXError, match=r"axes=\[2, -2\] names an axis twice"):
    load(N("Resize", ["x", "", "s"], ["y"], axes=[2, -2]), {"s": f32a(2, 2)}, opset=18)
  with pytest.raises(ONNXError, match=r"keep_aspect_ratio_policy='fit'"):
    load(N("Resize", ["x", "", "", "sz"], ["y"], keep_aspect_ratio_policy="fit"), {"sz": i64(1, 2, 3, 3)}, opset=18)
  with pytest.raises(ONNXError, match=r"Upsample.*>= 1 for Upsample"):
    load(N("Upsample", ["x", "s"], ["y"]), {"s": f32a(1, 1, 0.5, 1)}, opset=9)
  with pytest.raises(ONNXError, match=r"mode 'linear' on int32 data is not supported"):
    load(N("Resize", ["x", "", "s"], ["y"], mode="linear"), {"s": f32a(1, 1, 2, 2)}, feeds={"x": np.zeros((1, 2, 6, 8), np.int32)},
         dtype=np.int32)
  with pytest.raises(ONNXError, match=r"N, H, W, C data of more than one channel with antialias"):  # onnxruntime fills part of it
    load(N("Resize", ["x", "r", "s"], ["y"], mode="linear", antialias=1, coordinate_transformation_mode="tf_crop_and_resize"),
         {"r": f32a(0, 0, 0, 0, 1, 1, 1.2, 1), "s": f32a(1, 0.5, 2, 1)}, opset=19)
  fed = konnx.load(model([N("Resize", ["x", "", "", "sz"], ["y"])], {"x": x, "sz": i64(1, 2, 3, 3)}, {"y": np.float32}))
  with pytest.raises(ONNXError, match=r"sizes \[1, 2, 0, 3\] must be integers >= 1"):  # fed: read back by the run (specialise.py)
    fed.run({"x": x, "sz": i64(1, 2, 0, 3)})
