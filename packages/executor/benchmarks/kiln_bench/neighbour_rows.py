"""The benchmark's neighbour rows (issue 21, "parallel speed that holds in a real process"): kiln's threaded plans timed
the way a program meets them, not in a quiet loop of their own.

- in turn with numpy's A @ B: a matmul 1024 plan (and a one-kernel softmax 8192x128 plan) executed alternately with
  numpy's own float32 1024 A @ B, each call timed in that pattern (per-call medians over the rounds), beside the plan's
  time in a busy loop of its own. OpenBLAS's workers keep spinning for a while after numpy's call, on the cores kiln's
  threads want next.
- after 100 ms idle: the matmul plan executed after sleeping 100 ms (kiln's workers asleep, the VM's vCPUs maybe too),
  against its time in a loop.
- two Python threads: two threads each executing their own matmul plan at once, wall time against the same calls made
  one after another on one thread; both plans' results are checked after every concurrent round.
- CPU time after execute() returns: the process's CPU time (time.process_time, every thread) burnt in the 100 ms after
  the matmul plan's execute() returns, and what numpy's A @ B leaves behind in its 100 ms (OpenBLAS's spinners).

Every plan here is an ExecutionPlan of one kernel (kernels.matmul as rows.py's matmul rows, kernels.softmax as
models.py's softmax rows) over the numpy arrays (Buffer.from_numpy, no copy), and every result is checked against numpy
before it is timed. Row names never start with "matmul " or "softmax " followed by a size alone, so --only patterns
written for the plain rows do not pick these up.
"""
from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.ir import kernels
from kiln_bench.bench import Bench
from kiln_bench.harness import F32, GB, check, medians
from kiln_bench.models import np_softmax
from kiln_bench.table import Row

IDLE_S = 0.1  # the pause before an idle call, and the window CPU time is counted in after a call
SETTLE_S = 0.3  # quiet time before counting kiln's CPU time, so numpy's spinners from the checks are asleep again

MATMUL_TURN = "matmul 1024 float32, in turn with numpy A@B"
SOFTMAX_TURN = "1-kernel softmax 8192x128, in turn with numpy A@B"
THREADS2 = "two Python threads, a matmul 1024 plan each"
IDLE = "matmul 1024 plan after 100 ms idle"
CPU_AFTER = "CPU time after execute() returns (100 ms)"


# ---- plans and references ----

def _one_kernel_plan(ast: Any, out_size: int, *inputs: np.ndarray) -> Any:
  """An ExecutionPlan of one kernel: out (a plan buffer of out_size float32), inputs wrapped without a copy."""
  from kiln.executor import Buffer, ExecutionPlanBuilder
  pb = ExecutionPlanBuilder("CPU")
  o = pb.add_buffer(Buffer("CPU", out_size, F32))
  ids = [pb.add_buffer(Buffer.from_numpy(x)) for x in inputs]
  pb.add_kernel(ast, [o, *ids])
  pb.set_outputs([o])
  return pb.build()


def _split(plan: Any) -> str:
  """How the plan's kernel is cut up, as the executor's cache records it."""
  k = plan.kernels[0].kernel
  return f"{getattr(k, 'threads', '?')}-way split"


class _Matmul:
  """A float32 n x n x n matmul plan over fresh inputs in [-1, 1), with its float64 reference and tolerance."""

  def __init__(self, b: Bench, swap: bool = False):
    self.n = n = max(8, round(1024 * b.scale ** 0.5))  # sizes scale as elements, so dims by the square root (as rows.py)
    self.a, self.b = b.rng.random((n, n), dtype=np.float32) * 2 - 1, b.rng.random((n, n), dtype=np.float32) * 2 - 1
    self.want = self.a.astype(np.float64) @ self.b.astype(np.float64)
    self.tol = 1e-6 * n + 1e-5  # float32 accumulation over n terms of magnitude <= 1
    self.plan = _one_kernel_plan(kernels.matmul(n, n, n), n * n, self.a, self.b)
    self.flops = 2 * n ** 3

  def out(self) -> np.ndarray: return self.plan.output_buffer(0).numpy().reshape(self.n, self.n)

  def check(self, what: str) -> None: check(f"matmul {self.n} plan ({what})", self.out(), self.want, atol=self.tol)

  def first_run(self) -> Callable[[], Any]:
    """Run the plan once and check it; returns numpy's call of the same product (checked too)."""
    self.plan.execute()
    self.check("first run")
    return self.numpy_call()

  def numpy_call(self) -> Callable[[], Any]:
    """numpy's own A @ B of the same size (a new array each call, as a program writes it), checked once."""
    a, bb = self.a, self.b
    check(f"numpy matmul {self.n}", a @ bb, self.want, atol=self.tol)
    return lambda: a @ bb


# ---- timing patterns ----

def in_turn(first: Callable[[], Any], second: Callable[[], Any], rounds: int, warm_rounds: int = 2) -> tuple[float, float]:
  """first() and second() called alternately, each call timed: the median of each over `rounds` rounds."""
  for _ in range(warm_rounds):
    first()
    second()
  t1: list[float] = []
  t2: list[float] = []
  for _ in range(rounds):
    st = time.perf_counter()
    first()
    mid = time.perf_counter()
    second()
    t1.append(mid - st)
    t2.append(time.perf_counter() - mid)
  return statistics.median(t1), statistics.median(t2)


def after_idle(fn: Callable[[], Any], calls: int, idle: float = IDLE_S) -> float:
  """The median time of fn() called after sleeping `idle` seconds each time."""
  ts = []
  for _ in range(calls):
    time.sleep(idle)
    st = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - st)
  return statistics.median(ts)


def cpu_after(fn: Callable[[], Any], calls: int, window: float = IDLE_S) -> tuple[float, float]:
  """Process CPU time (every thread) burnt in the `window` seconds after fn() returns, the caller asleep: (median, max)."""
  ds = []
  for _ in range(calls):
    fn()
    c0 = time.process_time()
    time.sleep(window)
    ds.append(time.process_time() - c0)
  return statistics.median(ds), max(ds)


def concurrent(fns: list[Callable[[], Any]], calls: int) -> float:
  """Wall time of len(fns) Python threads, thread i calling fns[i]() `calls` times, started together; re-raises a thread's error."""
  bar = threading.Barrier(len(fns) + 1)
  errors: list[BaseException] = []

  def work(f: Callable[[], Any]) -> None:
    try:
      bar.wait()
      for _ in range(calls): f()
    except BaseException as e: errors.append(e)  # handed to the caller below
  ts = [threading.Thread(target=work, args=(f,), name=f"bench-neighbour-{i}") for i, f in enumerate(fns)]
  for t in ts: t.start()
  bar.wait()
  st = time.perf_counter()
  for t in ts: t.join()
  dt = time.perf_counter() - st
  if errors: raise errors[0]
  return dt


def sequential(fns: list[Callable[[], Any]], calls: int) -> float:
  """Wall time of the same calls as concurrent(), one thread: fns[0] `calls` times, then fns[1], ..."""
  st = time.perf_counter()
  for f in fns:
    for _ in range(calls): f()
  return time.perf_counter() - st


# ---- the rows ----

def _rounds(b: Bench, full: int, quick: int) -> int: return quick if b.args.quick else full


def matmul_in_turn(b: Bench, r: Row) -> None:
  m = _Matmul(b)
  r.work = f"matmul {m.n} float32, in turn with numpy A@B"
  npc = m.first_run()
  alone, np_alone = medians([m.plan.execute, npc], b.t)
  r.kiln, r.numpy = in_turn(m.plan.execute, npc, _rounds(b, 21, 7))
  m.check("after the rounds")
  r.ratio = r.numpy / r.kiln
  r.achieved = f"alone {alone * 1e3:.3g} ms, in turn {r.kiln / alone:.2f}x it ({m.flops / r.kiln / GB:.0f} GFLOP/s)"
  r.limit = f"{b.peak / GB:.0f} GFLOP/s FMA" if b.peak else "-"
  r.target, r.target_kind, r.target_value = ">= 0.75x numpy, in turn", "ratio", 0.75
  r.note = (f"each round: the plan's execute() then numpy's a @ b, each call timed; medians of {_rounds(b, 21, 7)} rounds; "
            f"alone = busy loop of its own (kiln {alone * 1e3:.3g} ms, numpy {np_alone * 1e3:.3g} ms: "
            f"{np_alone / alone:.2f}x alone); kernel {_split(m.plan)}")


def softmax_in_turn(b: Bench, r: Row) -> None:
  rows, cols = b.size(8192, 8), 128
  r.work = f"1-kernel softmax {rows}x{cols}, in turn with numpy A@B"
  x = (b.rng.standard_normal((rows, cols)) * 3).astype(np.float32)
  plan = _one_kernel_plan(kernels.softmax((rows, cols), F32), rows * cols, x)
  plan.execute()
  want = np_softmax(x.astype(np.float64))
  out = plan.output_buffer(0).numpy().reshape(rows, cols)
  check("softmax plan", out, want, rtol=1e-5, atol=1e-7)
  m = _Matmul(b)
  npc = m.numpy_call()
  (alone,) = medians([plan.execute], b.t)
  r.kiln, r.numpy = in_turn(plan.execute, npc, _rounds(b, 21, 7))
  check("softmax plan (after the rounds)", out, want, rtol=1e-5, atol=1e-7)
  nbytes = 8 * rows * cols
  r.achieved = f"alone {alone * 1e3:.3g} ms, in turn {r.kiln / alone:.2f}x it ({nbytes / r.kiln / GB:.1f} GB/s)"
  r.limit = f"{b.bw / GB:.1f} GB/s read"
  r.target = "(report)"  # issue 21 sets a target for the matmul only; this row shows the cost for a memory-bound kernel
  r.note = (f"each round: the softmax plan's execute() then numpy's {m.n} a @ b (the numpy column: its per-call time, "
            f"different work, so no ratio); medians of {_rounds(b, 21, 7)} rounds; alone = busy loop of its own; kernel {_split(plan)}")


def two_threads(b: Bench, r: Row) -> None:
  ms = [_Matmul(b), _Matmul(b)]
  r.work = f"two Python threads, a matmul {ms[0].n} plan each"
  for i, m in enumerate(ms):
    m.plan.execute()
    m.check(f"plan {i}, first run")
  npcs = [m.numpy_call() for m in ms]
  calls, rounds = _rounds(b, 4, 2), _rounds(b, 5, 3)
  fns = [m.plan.execute for m in ms]
  for f in fns: f()  # warm (and numpy's spinners from the checks settle while kiln works)
  seq, conc = [], []
  for _ in range(rounds):  # sequential and concurrent rounds alternate (a shared machine drifts)
    seq.append(sequential(fns, calls))
    for m in ms: m.out()[:] = np.nan  # a wrong or missing write by either thread shows in the check below
    conc.append(concurrent(fns, calls))
    for i, m in enumerate(ms): m.check(f"plan {i}, after a concurrent round")
  np_seq, np_conc = [], []
  for _ in range(rounds):
    np_seq.append(sequential(npcs, calls))
    np_conc.append(concurrent(npcs, calls))
  t_seq, t_conc = statistics.median(seq), statistics.median(conc)
  n_seq, n_conc = statistics.median(np_seq), statistics.median(np_conc)
  r.kiln, r.numpy, r.ratio = t_conc, n_conc, n_conc / t_conc
  flops = 2 * calls * ms[0].flops
  r.achieved = f"{t_conc / t_seq:.2f}x sequential ({t_seq * 1e3:.3g} ms), {flops / t_conc / GB:.0f} GFLOP/s"
  r.limit = f"{b.peak / GB:.0f} GFLOP/s FMA" if b.peak else "-"
  r.target, r.target_kind, r.target_value = "<= 1.0x sequential", "max", t_seq
  r.note = (f"wall time of 2 threads each executing its own plan {calls} times at once, vs the same {2 * calls} calls on one "
            f"thread; medians of {rounds} rounds, alternating; both outputs checked after every concurrent round; "
            f"numpy column: two threads each calling a @ b {calls} times (numpy {n_conc / n_seq:.2f}x its sequential "
            f"{n_seq * 1e3:.3g} ms); kernel {_split(ms[0].plan)}")


def idle(b: Bench, r: Row) -> None:
  m = _Matmul(b)
  r.work = f"matmul {m.n} plan after 100 ms idle"
  npc = m.first_run()
  calls = _rounds(b, 15, 5)
  (loop,) = medians([m.plan.execute], b.t)
  r.kiln = after_idle(m.plan.execute, calls)
  m.check("after idle calls")
  r.numpy = after_idle(npc, calls)
  (np_loop,) = medians([npc], b.t)
  r.ratio = r.numpy / r.kiln
  r.achieved = f"{r.kiln / loop:.2f}x its loop time ({loop * 1e3:.3g} ms)"
  r.limit = f"{b.peak / GB:.0f} GFLOP/s FMA" if b.peak else "-"
  r.target, r.target_kind, r.target_value = f"<= 1.2x loop ({1.2 * loop * 1e3:.3g} ms)", "max", 1.2 * loop
  r.note = (f"median of {calls} calls, each after time.sleep({IDLE_S:g}); loop = busy loop of its own; numpy column: a @ b "
            f"the same way ({r.numpy / np_loop:.2f}x its loop time, {np_loop * 1e3:.3g} ms); kernel {_split(m.plan)}")


def cpu_after_return(b: Bench, r: Row) -> None:
  m = _Matmul(b)
  npc = m.first_run()
  calls = _rounds(b, 7, 3)
  for _ in range(3): m.plan.execute()  # warm, and the numpy check's spinners go on the same cores
  time.sleep(SETTLE_S)
  c0 = time.process_time()
  time.sleep(IDLE_S)
  quiet = time.process_time() - c0  # nothing called: the floor (other libraries' threads, the interpreter)
  r.kiln, k_max = cpu_after(m.plan.execute, calls)
  m.check("after the windows")
  r.numpy, n_max = cpu_after(npc, calls)
  threads = b.threads
  r.achieved = f"max {k_max * 1e3:.2g} ms (numpy max {n_max * 1e3:.3g} ms)"
  r.limit = f"{IDLE_S * threads * 1e3:.0f} ms ({threads} threads x {IDLE_S * 1e3:.0f} ms)"
  r.target, r.target_kind, r.target_value = "<= 5 ms", "max", 5e-3
  r.note = (f"process CPU time (time.process_time, all threads) in the {IDLE_S * 1e3:.0f} ms after the matmul {m.n} plan's execute() "
            f"returns, the caller asleep; median of {calls}; numpy column: the same after numpy's a @ b; with nothing called "
            f"({SETTLE_S * 1e3:.0f} ms after the last call) the process burnt {quiet * 1e3:.2g} ms; kernel {_split(m.plan)}")


def run(b: Bench) -> None:
  """The neighbour rows, last: busy patterns first, then the ones that sleep (an idle spell slows whatever runs next)."""
  b.row(MATMUL_TURN, functools.partial(matmul_in_turn, b), "ms")
  b.row(SOFTMAX_TURN, functools.partial(softmax_in_turn, b), "ms")
  b.row(THREADS2, functools.partial(two_threads, b), "ms")
  b.row(IDLE, functools.partial(idle, b), "ms")
  b.row(CPU_AFTER, functools.partial(cpu_after_return, b), "ms")
