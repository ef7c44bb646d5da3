"""The engines `kiln bench --compare` times beside kiln on the same .onnx file and the same feeds: onnxruntime (its CPU
provider) and OpenVINO (CPU, INFERENCE_PRECISION_HINT f32, so it computes in float32 as kiln and onnxruntime do, not in
bfloat16 where the CPU has it). Each is imported only when asked for and only if installed: neither is a dependency of
kiln. Each peer runs on `threads` intra-op threads, as kiln runs on KILN_THREADS.

An Engine is loaded by `load()` (its time is the peer's load: parse, optimise, compile) and run by `run(feeds)`, which
returns the outputs in the model's order.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

Run = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


@dataclass
class Peer:
  """A peer engine: its name, the module that must be importable, and how to load a model into a run function."""
  name: str
  module: str
  load: Callable[[str, Mapping[str, tuple[int, ...]], int], Run]

  def installed(self) -> bool:
    try: return importlib.util.find_spec(self.module) is not None
    except (ImportError, ValueError): return False


def _onnxruntime(path: str, shapes: Mapping[str, tuple[int, ...]], threads: int) -> Run:
  import onnxruntime as ort
  so = ort.SessionOptions()
  so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
  so.log_severity_level = 3  # its warnings (unused initializers, ...) are not the benchmark's output
  sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
  names = [o.name for o in sess.get_outputs()]
  return lambda feeds: list(sess.run(names, dict(feeds)))


def _openvino(path: str, shapes: Mapping[str, tuple[int, ...]], threads: int) -> Run:
  import openvino as ov
  core = ov.Core()
  model = core.read_model(path)
  if shapes: model.reshape({name: ov.PartialShape(list(s)) for name, s in shapes.items()})  # the fed sizes, as kiln compiles them
  compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})
  req = compiled.create_infer_request()
  n = len(compiled.outputs)

  def run(feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    req.infer(dict(feeds))
    return [np.array(req.get_output_tensor(i).data, copy=True) for i in range(n)]
  return run


PEERS = [Peer("onnxruntime", "onnxruntime", _onnxruntime), Peer("openvino", "openvino", _openvino)]


def agreement(kiln: Mapping[str, np.ndarray], peer: list[np.ndarray]) -> str:
  """How far a peer's outputs are from kiln's: the largest difference relative to each output's largest magnitude."""
  worst = 0.0
  for a, b in zip(kiln.values(), peer):
    b = np.asarray(b)
    if a.shape != b.shape: return f"shape {b.shape} vs kiln's {a.shape}"
    if a.size == 0: continue
    if a.dtype.kind not in "fc" and b.dtype.kind not in "fc":
      if not np.array_equal(a, b): return f"{int((a != b).sum())} of {a.size} differ"
      continue
    x, y = a.astype(np.float64), b.astype(np.float64)
    worst = max(worst, float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(x))), 1e-30))
  return f"{worst:.1e}"

