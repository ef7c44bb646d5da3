"""Concurrency: many threads compiling through the kernel cache and building and running plans at once (each kernel compiled
exactly once, every answer right), and one plan executed from several threads (runs serialised, each run consistent)."""
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kiln.executor import cache
from kiln.executor.buffer import Buffer
from kiln.executor.plan import ExecutionPlanBuilder
from kiln.ir import AxisType, Ops, UOp, dtypes

THREADS = 32
N = 64


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  yield
  cache.clear_memory_cache()


def kernel(k: int, tag: str) -> UOp:
  """Kernel k of a family: out[i] = a[i] * (k + 1) + sum_j a[j] (a reduction and an elementwise part)."""
  a, out = UOp.define_global(1, dtypes.float32.ptr(N)), UOp.define_global(0, dtypes.float32.ptr(N))
  i, j = UOp.range(N, 0), UOp.range(N, 1, AxisType.REDUCE)
  v = a.index(i).load() * float(k + 1) + a.index(j).load().reduce(Ops.ADD, j)
  return UOp.sink(out.index(i).store(v), name=f"conc_{tag}_{k}")


def expected(k: int, a: np.ndarray) -> np.ndarray:
  s = np.float32(0)
  for x in a: s = np.float32(s + x)  # loop order, float32 rounding at each step
  return a * np.float32(k + 1) + s


def test_32_threads_hammer_the_cache_and_plans(fresh_cache):
  tag, kinds = uuid.uuid4().hex[:8], 6
  asts = [kernel(k, tag) for k in range(kinds)]
  before = cache.cache_stats()["compiles"]
  start = threading.Barrier(THREADS)
  seen: dict[int, set[int]] = {k: set() for k in range(kinds)}
  lock = threading.Lock()

  def work(t: int) -> int:
    rng = np.random.default_rng(t)
    start.wait()
    for it in range(4):
      k = (t + it) % kinds
      ck = cache.compile_kernel(asts[k], "CPU")
      with lock: seen[k].add(id(ck))
      a = (rng.integers(-8, 8, N) / 4).astype(np.float32)
      b = ExecutionPlanBuilder("CPU")
      x, out = b.add_buffer(Buffer.from_numpy(a.copy())), b.add_buffer(Buffer("CPU", N, "float32"))
      b.add_kernel(asts[k], [out, x])
      b.set_outputs([out])
      plan = b.build()
      for _ in range(3):
        plan.execute()
        np.testing.assert_array_equal(plan.output_buffer(0).numpy(), expected(k, a))
    return t

  with ThreadPoolExecutor(THREADS) as ex: assert sorted(ex.map(work, range(THREADS))) == list(range(THREADS))
  assert cache.cache_stats()["compiles"] - before == kinds, "each kernel compiled exactly once"
  assert all(len(v) == 1 for v in seen.values()), "every caller got the same CachedKernel"


def test_a_failed_compile_is_not_cached_under_concurrency(fresh_cache):
  calls = []
  key = "conc-fail-" + uuid.uuid4().hex

  def bad():
    calls.append(1)
    time.sleep(0.05)
    raise RuntimeError("compiler exploded")

  def go(_):
    try: cache.get_or_compile_kernel(key, "CPU", bad)
    except RuntimeError as e: return str(e)
    return "no error"

  with ThreadPoolExecutor(8) as ex: assert set(ex.map(go, range(8))) == {"compiler exploded"}
  assert 1 <= len(calls) < 8  # waiters share the one failure; it is not cached, so a later call compiles again
  n = len(calls)
  assert go(0) == "compiler exploded" and len(calls) == n + 1


def test_one_plan_executed_from_several_threads_is_serialised(fresh_cache):
  """8 threads run one plan (a symbolic kernel, then a host op that checks it is alone and snapshots the output); every
  snapshot must be one whole run: out[i] = 2*a[i] + n for i < n, for a single n."""
  n = UOp.variable("n", 1, N)
  a, out = UOp.define_global(1, dtypes.float32.ptr(N)), UOp.define_global(0, dtypes.float32.ptr(N))
  i = UOp.range(n, 0)
  ast = UOp.sink(out.index(i).store(a.index(i).load() * 2.0 + n.cast(dtypes.float32)), name=f"conc_plan_{uuid.uuid4().hex[:8]}")
  av = np.arange(N, dtype=np.float32)
  inside, overlaps, snaps = [0], [0], []
  guard = threading.Lock()

  def check(out_buf: Buffer) -> None:
    with guard:
      inside[0] += 1
      if inside[0] > 1: overlaps[0] += 1
    time.sleep(0.0005)
    snaps.append(out_buf.numpy().copy())
    with guard: inside[0] -= 1

  b = ExecutionPlanBuilder("CPU")
  x, o = b.add_buffer(Buffer.from_numpy(av.copy())), b.add_buffer(Buffer("CPU", N, "float32"))
  b.add_kernel(ast, [o, x])
  b.add_custom(check, [o], outputs=[])
  b.set_outputs([o])
  plan = b.build()

  def run(t: int) -> None:
    for r in range(25): plan.execute_with_vars({"n": 1 + (t * 7 + r * 13) % N})

  with ThreadPoolExecutor(8) as ex: list(ex.map(run, range(8)))
  assert overlaps[0] == 0, f"{overlaps[0]} runs of one plan overlapped: execute() is not serialised"
  assert len(snaps) == 200
  for s in snaps:
    k = int(s[0])  # out[0] = 2*0 + n
    assert 1 <= k <= N and np.array_equal(s[:k], av[:k] * 2 + k), "a snapshot mixes two runs' variables"
