"""kiln.graph's run-time branches (an ONNX If on a value computed at run time) on the emulated GPU of cuda_emu.py, checked
against onnxruntime: the segments hand their values to each other in device memory (no copy between them), and each run
moves only its inputs in, the condition's one byte and the outputs out."""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "graph", "tests"))
from cuda_emu import emulated_gpu  # noqa: E402
from onnx_case import N, f32, helper, model, onnx, ort  # noqa: E402

from kiln.graph import onnx as konnx  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no host C++ compiler to emulate CUDA")


def test_if_at_run_time_keeps_values_on_the_device(monkeypatch, tmp_path) -> None:
  """then: a matmul (tiled on CUDA) of a value the main graph computed; else: a row softmax of it. One load, both ways."""
  F = onnx.TensorProto.FLOAT
  then = helper.make_graph([N("MatMul", ["h", "w"], ["t0"]), N("Relu", ["t0"], ["t"])], "then", [], [helper.make_tensor_value_info("t", F, [16, 32])])
  els = helper.make_graph([N("Softmax", ["h"], ["e"], axis=-1)], "else", [], [helper.make_tensor_value_info("e", F, [16, 32])])
  nodes = [N("Tanh", ["x"], ["h"]), N("Greater", ["s", "zero"], ["c"]), N("If", ["c"], ["y"], then_branch=then, else_branch=els),
           N("Add", ["y", "h"], ["z"])]
  m = model(nodes, {"x": f32(16, 32), "s": np.array([1.0], np.float32)}, {"z": np.float32},
            {"w": f32(32, 32, lo=-.3, hi=.3), "zero": np.array([0.0], np.float32)})
  sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
  with emulated_gpu(monkeypatch, tmp_path) as (gpu, _):
    km = konnx.load(m, device="CUDA")
    assert km.program is not None, km.summary()
    for s in (1.0, -1.0, 2.0):
      before = dict(gpu.stats)
      f = {"x": f32(16, 32), "s": np.array([s], np.float32)}
      np.testing.assert_allclose(km.run(f)["z"], sess.run(None, f)[0], rtol=1e-4, atol=1e-4)
      moved = {k: gpu.stats[k] - before[k] for k in ("htod", "dtoh", "dtod")}
      assert moved == {"htod": 2, "dtoh": 2, "dtod": 0}, moved  # x and s in; the condition and z out
