"""The ONNX tests' shared pieces: a one-graph model from onnx.helper nodes, and the check of kiln.graph.onnx against
onnxruntime on it (onnxruntime is the reference, as numpy is for kernels). Importing this module skips the test module
that imports it where onnx or onnxruntime is missing."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper, numpy_helper  # noqa: E402

from kiln.graph import onnx as konnx  # noqa: E402

RNG = np.random.default_rng(3)
NP2ONNX = {np.dtype(t): helper.np_dtype_to_tensor_dtype(np.dtype(t)) for t in (np.float32, np.float64, np.float16, np.bool_, np.int8, np.uint8,
                                                                                  np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)}
N = helper.make_node


def f32(*shape: int, lo: float = -2, hi: float = 2) -> np.ndarray: return RNG.uniform(lo, hi, shape).astype(np.float32)


def model(nodes: list, feeds: dict[str, np.ndarray], outs: dict[str, np.dtype], inits: dict[str, np.ndarray] | None = None,
          opset: int = 17) -> onnx.ModelProto:
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, NP2ONNX[v.dtype], v.shape) for k, v in feeds.items()],
                        [helper.make_tensor_value_info(k, NP2ONNX[np.dtype(d)], None) for k, d in outs.items()],
                        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
  m.ir_version = 8
  inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
  for o in m.graph.output:  # the checker wants an output's shape: take the inferred one
    if o.name in inferred: o.CopyFrom(inferred[o.name])
    else: o.type.tensor_type.shape.SetInParent()
  return m


def check(m: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float = 1e-5, kernels: int | None = None) -> konnx.Model:
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
  km = konnx.load(m)
  got = km.run(feeds)
  for name, w in zip([o.name for o in m.graph.output], want):
    g = got[name]
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    if w.dtype.kind == "f": np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    else: np.testing.assert_array_equal(g, w)
  if kernels is not None: assert km.plan is not None and len(km.plan.kernels) == kernels, km.summary()
  return km


def check_exact(m: onnx.ModelProto, dims: dict[str, tuple[int, int]], feeds_list: list[dict[str, np.ndarray]]) -> konnx.Model:
  """One load with symbolic dims, run at each feed: every output equal to onnxruntime's, bit for bit (a -0.0 kept)."""
  km = konnx.load(m, dims=dims)
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  for feeds in feeds_list:
    for w, g in zip(sess.run(None, feeds), km.run(feeds).values()):
      assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape)
      np.testing.assert_array_equal(g, w)
      if w.dtype.kind == "f": np.testing.assert_array_equal(np.signbit(g), np.signbit(w))
  return km


def named_dims(m: onnx.ModelProto, dims: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
  """The entries of a test module's shared dims that m's inputs name (load refuses a dims name that is no dim of the model)."""
  names = {d.dim_param for i in m.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
  return {k: v for k, v in dims.items() if k in names}


def dyn_model(nodes: list, inputs: dict[str, tuple[int, tuple]], outs: dict[str, int], inits: dict[str, np.ndarray] | None = None,
              opset: int = 17) -> onnx.ModelProto:
  """inputs: name -> (TensorProto type, shape with str dims for the symbolic ones)."""
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, t, list(s)) for k, (t, s) in inputs.items()],
                        [helper.make_tensor_value_info(k, t, None) for k, t in outs.items()],
                        [onnx.numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
  m.ir_version = 8
  for o in m.graph.output: o.type.tensor_type.shape.SetInParent()  # the checker wants a shape, even an unknown one
  return m
