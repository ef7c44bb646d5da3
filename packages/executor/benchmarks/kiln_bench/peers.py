"""The peers kiln is compared with, where importable: numba (parallel=True) and tinygrad's CPU device. A peer that is
missing or does not run here is skipped with a note, never fatal."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Peers:
  numba: Any = None
  tinygrad: Any = None  # (Tensor, Device, device name)
  notes: dict[str, str] = field(default_factory=dict)


def load_peers() -> Peers:
  p = Peers()
  try:
    import numba
    p.numba = numba
    p.notes["numba"] = f"numba {numba.__version__}, parallel=True on {numba.get_num_threads()} threads"
  except ImportError: p.notes["numba"] = "skipped: numba is not installed (scripts/bench installs it in the hatch bench env)"
  try:
    import tinygrad
  except ImportError:
    p.notes["tinygrad"] = "skipped: tinygrad is not installed (scripts/bench installs it in the hatch bench env)"
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
