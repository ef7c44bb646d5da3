"""The peers kiln is compared with, where importable: numba (parallel=True), tinygrad's CPU device, torch (CPU) and
onnxruntime (CPU provider), the last two held to kiln's thread count. A peer that is missing or does not run here is
skipped with a note, never fatal."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Peers:
  numba: Any = None
  tinygrad: Any = None  # (Tensor, Device, device name)
  torch: Any = None
  onnxruntime: Any = None
  threads: int = 1  # kiln's thread count, which torch and onnxruntime sessions are held to
  notes: dict[str, str] = field(default_factory=dict)


MISSING = "skipped: {} is not installed (scripts/bench installs it in the hatch bench env)"


def load_peers(threads: int = 1) -> Peers:
  p = Peers(threads=threads)
  _load_torch_ort(p)
  try:
    import numba
    p.numba = numba
    p.notes["numba"] = f"numba {numba.__version__}, parallel=True on {numba.get_num_threads()} threads"
  except ImportError: p.notes["numba"] = MISSING.format("numba")
  try:
    import tinygrad
  except ImportError:
    p.notes["tinygrad"] = MISSING.format("tinygrad")
    return p
  ver = getattr(tinygrad, "__version__", None)
  if ver is None:
    try:
      from importlib.metadata import version
      ver = version("tinygrad")
    except Exception: ver = "?"
  if shutil.which("clang") is None:
    p.notes["tinygrad"] = f"skipped: tinygrad {ver}'s CPU backend compiles its kernels with `clang`, which is not on PATH (Debian package `clang`)"
    return p
  try:
    from tinygrad import Device, Tensor
    dev = next((d for d in ("CPU", "CLANG") if _has_device(Device, d)), None)
    if dev is None: raise RuntimeError("no CPU or CLANG device")
    got = (Tensor(np.arange(4, dtype=np.float32), device=dev) + 1).numpy()
    if not np.array_equal(got, np.arange(4, dtype=np.float32) + 1): raise RuntimeError(f"smoke test gave {got}")
    p.tinygrad = (Tensor, Device, dev)
    p.notes["tinygrad"] = f"tinygrad {ver}, device {dev}"
  except Exception as e:
    why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    p.notes["tinygrad"] = f"skipped: tinygrad {ver}'s CPU device does not run here ({why})"
  return p


def _load_torch_ort(p: Peers) -> None:
  """torch on kiln's thread count (set_num_threads; interop threads are left alone) and onnxruntime, whose sessions get
  intra_op_num_threads = kiln's thread count (see ort_session)."""
  try:
    import torch
    torch.set_num_threads(p.threads)
    p.torch = torch
    cap = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    p.notes["torch"] = f"torch {torch.__version__} on the CPU ({cap}), {torch.get_num_threads()} threads (set_num_threads), no_grad, float32"
  except ImportError: p.notes["torch"] = MISSING.format("torch")
  try:
    import onnxruntime
    p.onnxruntime = onnxruntime
    p.notes["onnxruntime"] = (f"onnxruntime {onnxruntime.__version__}, CPUExecutionProvider, intra_op_num_threads={p.threads}, "
                              "inter_op_num_threads=1, graph optimisations all")
  except ImportError: p.notes["onnxruntime"] = MISSING.format("onnxruntime")


def ort_session(p: Peers, model_path: str) -> Any:
  ort = p.onnxruntime
  so = ort.SessionOptions()
  so.intra_op_num_threads, so.inter_op_num_threads = p.threads, 1
  so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
  return ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])


def _has_device(Device: Any, name: str) -> bool:
  try:
    Device[name]
    return True
  except Exception: return False


_numba_fns: dict[str, Any] = {}


def numba_fn(numba: Any, name: str) -> Any:
  """numba's best shot at each work: parallel=True, and fastmath for the reductions (else they cannot vectorise)."""
  if name in _numba_fns: return _numba_fns[name]
  prange, njit = numba.prange, numba.njit
  if name == "add":
    @njit(parallel=True, cache=False)
    def f(a, b, out):  # type: ignore[no-untyped-def]
      for i in prange(a.shape[0]): out[i] = a[i] + b[i]
  elif name == "sum":
    @njit(parallel=True, fastmath=True, cache=False)
    def f(a):  # type: ignore[no-untyped-def]
      s = np.float32(0)
      for i in prange(a.shape[0]): s += a[i]
      return s
  else:
    @njit(parallel=True, fastmath=True, cache=False)
    def f(a, b, c):  # type: ignore[no-untyped-def]
      m, k = a.shape
      n = b.shape[1]
      for i in prange(m):
        for j in range(n): c[i, j] = 0
        for p in range(k):
          x = a[i, p]
          for j in range(n): c[i, j] += x * b[p, j]
  _numba_fns[name] = f
  return f
