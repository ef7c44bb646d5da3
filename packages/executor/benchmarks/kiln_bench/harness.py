"""The benchmark's harness: timing (warm medians, per-call means), binding kiln kernels to numpy arrays, and checking every
kiln result against numpy before it is timed (a wrong answer is a failure, never a fast number)."""
from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir import dtypes, kernels
from kiln.ir.uop import UOp

F32 = dtypes.float32
MB, GB = 1e6, 1e9


@dataclass
class Timing:
  warmups: int = 2
  runs: int = 15  # per function; fewer when budget (seconds) runs out first, but never fewer than 3
  budget: float = 2.0
  warm_seconds: float = 0.3  # each function runs at least this long (and t.warmups calls) before it is timed


def warm(f: Callable[[], Any], t: Timing) -> None:
  """Run f busily for t.warm_seconds, and at least t.warmups times."""
  warm_until = time.perf_counter() + t.warm_seconds
  for i in itertools.count():
    f()
    if i + 1 >= t.warmups and time.perf_counter() >= warm_until: break


def medians(fns: list[Callable[[], Any]], t: Timing) -> list[float]:
  """Median wall time of each fn, each timed in its own block after a busy warm-up. Not round-robin: OpenBLAS's and
  numba's worker threads keep spinning for a while after a call, and on 2 cores they took one from whichever ran next
  (kiln's threaded matmul measured 150 GFLOP/s round-robin, 280-290 on its own). Not after a pause either: an idle
  spell puts this VM's vCPUs to sleep, and a 16M sum on 2 threads then took 2.4 ms a run instead of 1.3 for a while."""
  out = []
  for f in fns:
    warm(f, t)  # the previous library's workers settle while f warms the cores
    ts: list[float] = []
    end = time.perf_counter() + t.budget
    while len(ts) < t.runs and (len(ts) < 3 or time.perf_counter() < end):
      st = time.perf_counter()
      f()
      ts.append(time.perf_counter() - st)
    out.append(statistics.median(ts))
  return out


def per_call(fn: Callable[[], Any], calls: int, batches: int) -> float:
  """Median over batches of the mean time of `calls` back-to-back calls (for microsecond-scale work)."""
  fn()
  out = []
  for _ in range(batches):
    st = time.perf_counter()
    for _ in range(calls): fn()
    out.append((time.perf_counter() - st) / calls)
  return statistics.median(out)

def kiln_call(ast: UOp, bufs: list[np.ndarray]) -> Callable[[], None]:
  """Compile (through the kernel cache) and bind to numpy arrays in slot order: the call is one ctypes dispatch."""
  from kiln.executor import compile_kernel
  ck = compile_kernel(ast, "CPU")
  return ck.program.bind([b.ctypes.data for b in bufs], [], *launch_sizes(ck))


def aligned_empty(n: int, dtype: Any = np.float32, align: int = 64) -> np.ndarray:
  """An uninitialised 1-D array whose data starts on an `align`-byte boundary (kiln's CPU allocator's guarantee)."""
  itemsize = np.dtype(dtype).itemsize
  raw = np.empty(n + align // itemsize, dtype)
  off = (-raw.ctypes.data % align) // itemsize
  return raw[off:off + n]


def launch_sizes(k: Any) -> tuple[Any, Any]:
  """Launch sizes for bind: plain ints here (the bench's kernels have no symbolic sizes)."""
  return k.global_size or (1, 1, 1), k.local_size


def conformance_kernel(c: float, n: int = 256) -> UOp:
  """A conformance-test-sized kernel (one ALU expression over a few hundred elements); c makes each AST new (cold)."""
  return kernels.elementwise(lambda a, b: (a * b + c).maximum(a), F32, ((n,), F32), ((n,), F32), name="conf")


class WrongResult(Exception): pass


def check(name: str, got: Any, want: Any, rtol: float = 0.0, atol: float = 0.0) -> None:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.abs(got - want)
  bad = err > atol + rtol * np.abs(want)
  if got.shape != want.shape or bad.any():
    i = int(np.argmax(err)) if got.shape == want.shape else 0
    raise WrongResult(f"{name}: result differs from numpy (largest error {err.ravel()[i] if got.shape == want.shape else 'shape'}; "
                      f"{int(bad.sum()) if got.shape == want.shape else '?'} elements off)")
