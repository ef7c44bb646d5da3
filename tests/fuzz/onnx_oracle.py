"""What the ONNX edge cases (gather_cases.py, extdata_cases.py, boundary_cases.py) share: onnxruntime as the oracle,
kiln run under guard pages, a watchdog for loads that must not hang, and the exact comparison of outputs.

Guard pages on the ONNX path: with KILN_GUARD=1 kiln's allocator puts every plan buffer (fed inputs are copied into
them, intermediates, outputs, a threaded reduction's scratch) between inaccessible pages. A model's constants are not
allocated: kiln wraps their numpy arrays (an initializer's copy, a file map for external data) in place, where a stray
read meets whatever lies next to them. So under `guarded()` Buffer.from_numpy first copies a CPU array between guard
pages too; the cases that test the mapped path itself run with `map_constants=True` and leave it alone."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

OPSET = 18


def make_model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any]) -> Any:
  from onnx import helper
  return helper.make_model(helper.make_graph(nodes, "edge", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def ort_run(model: Any, feeds: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray] | None, str]:
  """onnxruntime's outputs of a ModelProto or a path, graph optimisations off (so a refusal comes from the node at run
  time, not from a fold); (None, its error) where it refuses."""
  import onnxruntime as ort
  so = ort.SessionOptions()
  so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  so.log_severity_level = 4  # a refusal is an expected answer here: keep its log line off the fuzzer's output
  src = model if isinstance(model, str) else model.SerializeToString()
  try: return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, dict(feeds)), ""
  except Exception as e: return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def same(got: np.ndarray, want: np.ndarray) -> str:
  """'' when kiln's output is onnxruntime's exactly (shape, dtype kind and every value; NaN equals NaN), else what differs."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape: return f"shape {got.shape}, expected {want.shape}"
  if got.dtype.kind != want.dtype.kind: return f"dtype {got.dtype}, expected {want.dtype}"
  ne = got != want
  if got.dtype.kind == "f": ne &= ~(np.isnan(got) & np.isnan(want))
  if not ne.any(): return ""
  at = [tuple(i) for i in np.argwhere(ne)[:3].tolist()]
  return f"{int(ne.sum())} of {ne.size} values differ, e.g. at {at}: got {[got[i].item() for i in at]}, expected {[want[i].item() for i in at]}"


@contextlib.contextmanager
def guarded(on: bool = True, map_constants: bool = False) -> Iterator[None]:
  """kiln's CPU buffers between guard pages while the block runs (KILN_GUARD=1, the allocator's cache emptied before and
  after so no unguarded buffer is handed out again), and a model's constants copied between guard pages unless
  map_constants (see the module docstring)."""
  if not on:
    yield
    return
  from kiln.codegen.registry import get_runtime
  from kiln.executor.buffer import Buffer
  from kiln.runtime.cpu.guard import guarded_copy
  alloc: Any = get_runtime("CPU").allocator
  old_env, old_from = os.environ.get("KILN_GUARD"), Buffer.__dict__["from_numpy"]

  def from_numpy(arr: Any, device: Any = "CPU", dtype: Any = None) -> Buffer:
    a = np.asarray(arr)
    if str(device) == "CPU" and a.size: a = guarded_copy(np.ascontiguousarray(a))
    return old_from.__func__(a, device, dtype)  # type: ignore[no-any-return]
  os.environ["KILN_GUARD"] = "1"
  alloc.flush()
  if not map_constants: Buffer.from_numpy = staticmethod(from_numpy)  # type: ignore[method-assign,assignment]
  try: yield
  finally:
    Buffer.from_numpy = old_from  # type: ignore[method-assign]
    if old_env is None: os.environ.pop("KILN_GUARD", None)
    else: os.environ["KILN_GUARD"] = old_env
    alloc.flush()


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
  """TimeoutError in the block after `seconds` (a load that blocks on a FIFO, say). Main thread only (SIGALRM); an alarm set
  before (pytest-timeout's) is put back with what was left of it."""
  if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
    yield
    return

  def fire(*_: Any) -> None: raise TimeoutError(f"no answer after {seconds} s (blocked?)")
  old = signal.signal(signal.SIGALRM, fire)
  left, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
  t0 = time.monotonic()
  try: yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)
    if left: signal.setitimer(signal.ITIMER_REAL, max(0.001, left - (time.monotonic() - t0)), interval)
