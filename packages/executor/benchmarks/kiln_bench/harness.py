"""The benchmark's harness: timing (interleaved rounds of warm blocks, per-call means), binding kiln kernels to numpy
arrays, and checking every kiln result against numpy before it is timed (a wrong answer is a failure, never a fast number).

How a row is timed (`interleaved`): the machine this was tuned on (a 2-core VM) swings 1.5-2x over seconds, so
contenders timed one after the other, each in one long block, were measured in different weather (layernorm 8192x384
took 0.38-0.73 ms within minutes, and kiln-vs-torch verdicts flipped from run to run). So every contender of a row
(kiln, numpy, each peer) is timed in rounds (5, down to 3 where the slowest call takes over 0.2 s; 3 with --quick); a
round is one block per contender, in an order that rotates by one each round; a block is a short busy warm-up, then a
few timed calls (the contender's runs and budget split over the rounds). A contender's time is the median of all its
timed calls; its per-round medians are kept, and a ratio between two contenders is the median over rounds of the two's
quotient in each round (both measured within seconds of each other, so a drift between rounds cancels). Blocks, not
calls in turn: see `interleaved`."""
from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.ir import dtypes, kernels
from kiln.ir.uop import UOp

F32 = dtypes.float32
MB, GB = 1e6, 1e9
BENCH_ROOT = str(Path(__file__).resolve().parents[1])  # on a child process's PYTHONPATH, so it imports kiln_bench too


@dataclass
class Timing:
  """How contenders are warmed and timed. runs and budget are per contender over all its rounds, each round's block
  getting its share (the runs and seconds left over the rounds left; a later block's settling counts in its seconds)
  and at least one timed call. One contender alone is timed in one block (nothing to interleave)."""
  warmups: int = 2
  runs: int = 15  # per contender over all rounds; fewer when the budget (seconds) runs out first
  budget: float = 2.0
  warm_seconds: float = 0.3  # a contender's first block: busy at least this long (and t.warmups calls) before it is timed
  rounds: int = 5  # at most; fewer (down to min_rounds) when the slowest contender's calls would not fit (interleaved)
  # each later block: busy this long (and one call) first, so the last contender's spinners settle. OpenBLAS's worker spins
  # for 100 ms after a call: a 1024 matmul took 13.3-14.4 ms (kiln; AVX2 build 14.8-16.5) in the 100 ms after numpy's
  # a @ b, 9.8-10.9 from then on (2-core Zen 4), so 0.1 s left the first timed calls on its edge
  settle_seconds: float = 0.15
  min_rounds: int = 3


def warm(f: Callable[[], Any], t: Timing, seconds: float | None = None, calls: int | None = None) -> None:
  """Run f busily for t.warm_seconds (or `seconds`), and at least t.warmups (or `calls`) times."""
  warm_until = time.perf_counter() + (t.warm_seconds if seconds is None else seconds)
  least = t.warmups if calls is None else calls
  for i in itertools.count():
    f()
    if i + 1 >= least and time.perf_counter() >= warm_until: break


def _block(f: Callable[[], Any], runs: int, least: int, end: float) -> list[float]:
  """Up to `runs` timed calls of f, stopping early once the clock passes `end` and `least` calls are made."""
  ts: list[float] = []
  while len(ts) < runs and (len(ts) < least or time.perf_counter() < end):
    st = time.perf_counter()
    f()
    ts.append(time.perf_counter() - st)
  return ts


def interleaved(fns: dict[str, Callable[[], Any]], t: Timing,
                on_error: Callable[[str, Exception], None] | None = None) -> dict[str, list[list[float]]]:
  """Each fn's timed calls, one list per round: up to t.rounds rounds (one when there is a single fn), each round one
  block per fn, in an order rotated by one from the last round's. A fn's first block warms it busily (t.warm_seconds
  and t.warmups calls) and then times its share of t.runs within its share of t.budget; a later block first settles
  (busy for t.settle_seconds, at least one call), then times its share, the settling inside its share of the budget.
  After the first round the row keeps t.rounds rounds only if two calls of its slowest fn a round fit in t.budget;
  else fewer, down to t.min_rounds (a 1.6 s numba matmul would otherwise cost 10 calls instead of 4). A fn that raises
  drops out of the remaining rounds, its calls discarded, when on_error is given (called with its name and the
  error); else the error propagates.

  Blocks, not calls round-robin: OpenBLAS's and numba's worker threads keep spinning for a while (0.1 s) after a
  call, and on 2 cores they took one from whichever ran next (kiln's threaded matmul measured 150 GFLOP/s round-robin,
  280-290 on its own); the busy start of each block is where they settle. Not after a pause either: an idle spell
  puts this VM's vCPUs to sleep, and a 16M sum on 2 threads then took 2.4 ms a run instead of 1.3 for a while. The
  order rotates so that no contender always follows the same one."""
  names = list(fns)
  rounds = t.rounds if len(names) > 1 else 1
  calls: dict[str, list[list[float]]] = {k: [] for k in names}
  runs_left, budget_left, i = t.runs, t.budget, 0
  while i < rounds:
    least = -(-3 // rounds)  # at least 3 timed calls in all, as one block always made
    runs, budget = max(least, -(-runs_left // (rounds - i))), budget_left / (rounds - i)
    for k in names[i % len(names):] + names[:i % len(names)]:
      if k not in calls: continue  # dropped
      f = fns[k]
      try:
        st = time.perf_counter()
        if i == 0: warm(f, t)
        else: warm(f, t, t.settle_seconds, 1)
        calls[k].append(_block(f, runs, least, (time.perf_counter() if i == 0 else st) + budget))
      except Exception as e:
        if on_error is None: raise
        del calls[k]
        on_error(k, e)
    runs_left, budget_left, i = runs_left - runs, budget_left - budget, i + 1
    if i == 1 and rounds > 1 and calls:
      slowest = max(statistics.median(c[0]) for c in calls.values())
      rounds = max(min(t.min_rounds, rounds), min(rounds, int(t.budget / (2 * slowest))))
  return calls


def pooled(calls: list[list[float]]) -> float:
  """A contender's time: the median of all its timed calls, every round's."""
  return statistics.median([c for block in calls for c in block])


def medians(fns: list[Callable[[], Any]], t: Timing) -> list[float]:
  """Each fn's time (the median of all its timed calls), the fns timed together in interleaved rounds (`interleaved`)."""
  calls = interleaved(dict(zip(map(str, range(len(fns))), fns)), t)
  return [pooled(calls[str(i)]) for i in range(len(fns))]


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
