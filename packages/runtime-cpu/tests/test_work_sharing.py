"""Dynamic work sharing (issue 21): a split kernel is cut into chunks that the pool's threads claim from a counter.
The chunk count is the kernel's, never the thread count's, so a split reduction gives the same bits on 1 to 8 threads;
chunk edges hold at any chunk count (more chunks than units leaves some empty); per-thread scratch (PACK panels, KEEP
rows) is one per claiming thread; a claimer that starts late finds the work done by the others; workers spin while
a plan runs and just after."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import kiln.runtime.cpu.bound as bound_mod
import kiln.runtime.cpu.threads as threads_mod
from kiln.codegen import threads as split
from kiln.codegen.choose import Opt, OptOps, Target, heuristic_opts
from kiln.codegen.lowering.prepare import prepare
from kiln.codegen.registry import get_runtime
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import AxisType, Ops, UOp, dtypes, kernels, reference
from kiln.runtime.cpu.program import CPUProgram
from kiln.runtime.cpu.settings import POOL_KINDS
from kiln.runtime.cpu.spin import ENDED_OFFSET, Spinner, cycles, spin_us
from kiln.runtime.cpu.threads import WorkerPool, new_pool, pool_kind

RT = get_runtime("CPU")
F32 = dtypes.float32
KINDS = POOL_KINDS if pool_kind() == "native" else ("python",)  # the native pool where this platform has it
POOLS = {k: {n: new_pool(n, kind=k) for n in range(1, 9)} for k in KINDS}


def load(ast: UOp, opts: list[Opt] | None = None, target: Target | None = None) -> CPUProgram:
  spec = (LLVMRenderer(target) if target is not None else RT.renderer).render(ast, opts=opts)
  return RT.load(RT.compiler.compile(spec))


def run_on(prog: CPUProgram, arrays: list[np.ndarray], pool: int, monkeypatch: pytest.MonkeyPatch, kind: str = KINDS[0]) -> None:
  monkeypatch.setattr(bound_mod, "get_pool", lambda: POOLS[kind][pool])
  prog([a.ctypes.data for a in arrays])


def test_the_chunk_count_is_the_kernels_not_the_thread_counts() -> None:
  ast = prepare(kernels.reduce_sum((1 << 22,), F32))[0]
  chunks = {t: next(o.amount for o in heuristic_opts(ast, Target(vector_bytes=64, threads=t, cores=2)) if o.op is OptOps.THREAD)
            for t in (1, 2, 8)}
  assert len(set(chunks.values())) == 1 and chunks[1] >= 8, chunks
  # sized from the machine: at most CHUNKS_PER_CORE a core (at least MIN_CHUNK_CAP), each worth 100 claims
  assert split.chunk_count(1 << 40, None, 64, 64) == min(8 * 64, split.MAX_CHUNKS)
  assert split.chunk_count(1 << 40, None, 32, 1) == split.MIN_CHUNK_CAP
  assert split.chunk_count(10 * split.min_chunk_work(32, False), None, 32, 8) == 8  # a whole number a core
  assert split.chunk_count(3 * split.min_chunk_work(32, False), None, 32, 2) == 2 and split.chunk_count(1 << 40, 7, 32, 2) == 6
  assert split.chunk_count(3 * split.min_chunk_work(32, False), None, 32, 4) == 3  # fewer than the cores: each its own
  assert split.chunk_count(1 << 40, 5, 32, 8) == 5  # one chunk a unit at most
  # a few more units than the cap: one a chunk (18 units in 16 chunks were 9 of 2, shared 5:4 by two cores), unless a
  # unit is not worth a claim or there are more than twice the cap
  assert split.chunk_count(1 << 40, 18, 64, 2) == 18 and split.chunk_count(1 << 40, 40, 64, 2) == split.MIN_CHUNK_CAP
  assert split.chunk_count(16 * split.min_chunk_work(64, False), 18, 64, 2) == 16
  assert split.chunk_count(1, None, 32, 8) == 2  # a kernel worth splitting at all gets two


def test_split_reduction_has_the_same_bits_on_1_to_8_threads(monkeypatch: pytest.MonkeyPatch) -> None:
  n = (1 << 23) + 4096
  x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
  prog = load(kernels.reduce_sum((n,), F32))
  assert prog.threads >= 8 and prog.finish_call, prog.spec.applied_opts
  got = set()
  for kind in KINDS:
    for pool in range(1, 9):
      for _ in range(3):
        out = np.zeros(1, np.float32)
        run_on(prog, [out, x], pool, monkeypatch, kind)
        got.add(out.tobytes())
  assert len(got) == 1, "a split reduction's bits changed with the thread count or the pool"
  np.testing.assert_allclose(np.frombuffer(got.pop(), np.float32)[0], x.astype(np.float64).sum(), rtol=1e-5)


@pytest.mark.parametrize("chunks", [2, 3, 24, 25, 26, 40, 100])
def test_chunk_edges_at_any_count(monkeypatch: pytest.MonkeyPatch, chunks: int) -> None:
  """25 vector units of 16 (400 floats) plus a peeled tail of 7: chunk counts below, at and past the units (empty chunks)."""
  n = 407
  ast = kernels.elementwise(lambda a, b: a * b + a, F32, ((n,), F32), ((n,), F32))
  a, b = (np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in (1, 2))
  want = reference.run(ast, np.zeros(n, np.float32), a, b)[0]
  prog = load(ast, [Opt(OptOps.UPCAST, 0, 16), Opt(OptOps.THREAD, 0, chunks)])
  for pool in (1, 2, 3, 8):
    out = np.full(n, np.nan, np.float32)
    run_on(prog, [out, a, b], pool, monkeypatch)
    assert out.tobytes() == want.tobytes(), (chunks, pool)
  r = UOp.range(1000, 0, AxisType.REDUCE)
  o, x = UOp.define_global(0, dtypes.int32.ptr(1)), UOp.define_global(1, dtypes.int32.ptr(1000))
  total = UOp.sink(o.index(0).store(x.index(r).load().reduce(Ops.ADD, r)), name="isum")
  xs = np.arange(1000, dtype=np.int32)
  out = np.zeros(1, np.int32)
  run_on(load(total, [Opt(OptOps.THREAD, 0, chunks)]), [out, xs], 3, monkeypatch)
  assert out[0] == xs.sum()


def test_each_claiming_thread_packs_into_its_own_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
  """A PACKed matmul compiled for 2 threads has 2 scratch slots: a pool of 8 runs 2 claimers, never a third in a slot."""
  m, k, c = 256, 256, 512
  ast = kernels.matmul(m, c, k)
  prog = load(ast, target=Target(vector_bytes=RT.target.vector_bytes, threads=2, cores=2, min_work_per_thread=1 << 10))
  assert prog.slots == 2 and prog.threads > 2 and any(o.startswith("PACK") for o in prog.spec.applied_opts), prog.spec
  def claimers(pool: int, arrays: list[np.ndarray]) -> None:
    assert len(prog.bind([x.ctypes.data for x in arrays]).args) == min(pool, 2)
  _products_on_pools(prog, m, k, c, (1, 2, 8), monkeypatch, claimers)


def _products_on_pools(prog: CPUProgram, m: int, k: int, c: int, pools: tuple[int, ...], monkeypatch: pytest.MonkeyPatch,
                       after: Callable[[int, list[np.ndarray]], None] | None = None) -> None:
  """prog, an m x k by k x c matmul, run on each pool size and checked against numpy; then after(pool, [out, a, b])."""
  a = np.random.default_rng(m + c).standard_normal((m, k)).astype(np.float32)
  b = np.random.default_rng(k).standard_normal((k, c)).astype(np.float32)
  for pool in pools:
    out = np.zeros((m, c), np.float32)
    run_on(prog, [out, a, b], pool, monkeypatch)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    if after is not None: after(pool, [out, a, b])


def test_a_product_of_few_column_tiles_splits_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
  """A product whose columns are a few register tiles (a 1x1 conv's 64 output channels over a 14x14 map: 2 tiles of 32)
  shares its row tiles over the threads instead (heuristic._thread_axis): 2 or 3 column chunks left one of two cores
  idle or doing twice the other's share. Same result on any pool."""
  m, k, c = 2048, 96, 64
  ast = kernels.matmul(m, c, k)
  target = Target(vector_bytes=RT.target.vector_bytes, threads=2, cores=2, min_work_per_thread=1 << 10)
  thread = [o for o in heuristic_opts(prepare(ast)[0], target) if o.op is OptOps.THREAD]
  assert len(thread) == 1 and thread[0].axis == 0 and thread[0].amount >= 8, thread
  _products_on_pools(load(ast, target=target), m, k, c, (1, 2, 3), monkeypatch)


@pytest.mark.parametrize("rows", [256, 1000, 2048])
def test_a_packed_product_split_along_its_rows_packs_each_panel_once_a_core(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
  """W (rows x 1024) @ X (1024x112), a 1x1 conv's product over few positions (ResNet-50's 14x14 maps, 196 columns, on
  AVX-512): its column tiles are too few to share on either ISA, so the threads split its rows, and every chunk packs
  every column panel again. It takes one chunk a core (32 chunks ran at half the speed of 2), or more only where each
  holds heuristic.PACKED_ROWS rows, a whole number a core (1000 rows: 2 chunks, not 3, of which one core would compute
  two); PACKED_ROWS 0: as many as any split. Same result on any pool."""
  from kiln.codegen.choose import heuristic
  k, c = 1024, 112  # 7 column tiles of AVX2's 16 lanes, 4 of AVX-512's 32 (196 columns: 12 AVX2 tiles, which share)
  ast = kernels.matmul(rows, c, k)
  target = Target(vector_bytes=RT.target.vector_bytes, threads=2, cores=2, min_work_per_thread=1 << 10)
  def split() -> Opt:
    opts = heuristic_opts(prepare(ast)[0], target)
    assert any(o.op is OptOps.PACK for o in opts), opts
    (thread,) = [o for o in opts if o.op is OptOps.THREAD]
    assert thread.axis == 0, opts
    return thread
  assert split().amount == {256: 2, 1000: 2, 2048: 8}[rows]
  monkeypatch.setattr(heuristic, "PACKED_ROWS", 0)
  assert split().amount >= 8
  monkeypatch.undo()
  _products_on_pools(load(ast, target=target), rows, k, c, (1, 2, 3), monkeypatch)


def test_a_claimer_that_starts_late_finds_the_work_done(monkeypatch: pytest.MonkeyPatch) -> None:
  """Slot 1 starts 0.2 s late (its core busy elsewhere): the caller claims every chunk meanwhile, so slot 1 finds none
  and the result is whole; with a static half each, the caller would have left half the output to slot 1."""
  n = 1 << 20
  ast = kernels.elementwise(lambda a: a * 2.0, F32, ((n,), F32))
  prog = load(ast)
  assert prog.threads >= 2
  x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
  out = np.zeros(n, np.float32)
  real, caller_done, seen = prog.task_fn, threading.Event(), {}
  def late(*args: object) -> None:
    slot = args[1]  # the task entry's (block, slot)
    if slot == 1:
      caller_done.wait(5)
      seen["before"] = out.copy()  # what the output held when the late claimer started
    real(*args)
    if slot == 0: caller_done.set()
  monkeypatch.setattr(prog, "task_fn", late)
  run_on(prog, [out, x], 2, monkeypatch, "python")  # the Python pool calls prog.task_fn, which this test replaces
  assert "before" in seen and np.array_equal(seen["before"], x * 2), "the caller left chunks for the late thread"
  assert np.array_equal(out, x * 2)


def test_spin_waits_while_a_plan_runs_and_just_after() -> None:
  """A worker spins for the next kernel while a plan runs, and after the last plan ended only until the spin time has
  passed since that end (a next run soon after finds it awake); with no plan lately it sleeps at once."""
  us = 200_000  # long beside a busy machine's scheduling delays (pytest-xdist runs another worker): "at once" is under half of it
  s = Spinner(us)
  if s.ticks == 0: pytest.skip("this machine's cycle counter does not run: workers never spin")
  gen, active = (ctypes.c_int32 * 16)(), (ctypes.c_int32 * 16)()
  ended = ctypes.c_int64.from_buffer(active, ENDED_OFFSET)
  t = time.perf_counter()
  assert not s.wait(ctypes.addressof(gen), 0, ctypes.addressof(active))  # no plan ever: back at once
  assert time.perf_counter() - t < us * 1e-6 * 0.5
  ended.value = cycles() - 2 * s.ticks
  t = time.perf_counter()
  assert not s.wait(ctypes.addressof(gen), 0, ctypes.addressof(active))  # the last plan ended long ago: back at once
  assert time.perf_counter() - t < us * 1e-6 * 0.5
  active[0] = 1
  t = time.perf_counter()
  assert not s.wait(ctypes.addressof(gen), 0, ctypes.addressof(active))  # a plan, nothing posted: the whole spin, then sleep
  assert time.perf_counter() - t >= us * 1e-6 * 0.5
  gen[0] = 7
  assert s.wait(ctypes.addressof(gen), 0, ctypes.addressof(active))  # work posted: back at once, to take it
  def end_plan() -> None:
    time.sleep(0.002)
    ended.value = cycles()
    active[0] = 0
  threading.Thread(target=end_plan).start()
  t = time.perf_counter()
  assert not s.wait(ctypes.addressof(gen), 7, ctypes.addressof(active))  # the plan ends while it spins: it spins on
  assert time.perf_counter() - t >= us * 1e-6 * 0.5
  def post() -> None:
    time.sleep(0.002)
    gen[0] = 8
  ended.value = cycles()
  threading.Thread(target=post).start()
  t = time.perf_counter()
  assert s.wait(ctypes.addressof(gen), 7, ctypes.addressof(active))  # just after a plan: the next run's kernel is taken
  assert time.perf_counter() - t < us * 1e-6 * 0.5


@pytest.mark.parametrize("value, ok", [("", 100), ("0", 0), ("250", 250), ("-1", None), ("ten", None), ("1.5", None)])
def test_spin_time_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, ok: int | None) -> None:
  monkeypatch.setenv("KILN_SPIN_US", value)
  if ok is None:
    with pytest.raises(ValueError, match="KILN_SPIN_US"): spin_us()
  else: assert spin_us() == ok


def _other_cpus() -> set[int]:
  return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


@pytest.mark.skipif(len(_other_cpus()) < 2 or threads_mod.current_cpu() < 0, reason="needs two CPUs this process may use and sched_getcpu")
def test_step_aside_leaves_the_callers_cpu_and_keeps_the_mask() -> None:
  """A thread on its caller's CPU moves off it at once; its affinity mask is what it was; on another CPU it stays put."""
  out: list = []
  def probe() -> None:
    mask = os.sched_getaffinity(0)
    here = threads_mod.current_cpu()
    out.append((threads_mod.step_aside(here), here, threads_mod.current_cpu(), os.sched_getaffinity(0) == mask))
    elsewhere = threads_mod.current_cpu()
    out.append((threads_mod.step_aside(elsewhere ^ 1 if elsewhere ^ 1 in mask else -1), elsewhere, threads_mod.current_cpu(), True))
  t = threading.Thread(target=probe)
  t.start()
  t.join(10)
  (moved, was, now, same_mask), (moved2, was2, now2, _) = out
  assert moved and now != was and same_mask
  assert not moved2  # not on that CPU: no move
  assert not threads_mod.step_aside(-1)


def test_a_woken_worker_is_asked_to_leave_its_callers_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
  """Every batch records its caller's CPU, and a worker that wakes while calls are left steps aside from it first."""
  asked: list[int] = []
  monkeypatch.setattr(threads_mod, "current_cpu", lambda: 7)  # the caller's CPU as the batch records it
  monkeypatch.setattr(threads_mod, "step_aside", lambda cpu: asked.append(cpu) or False)
  pool, done = WorkerPool(2), []
  pool.run(lambda i: (time.sleep(0.01), done.append(i)), [(i,) for i in range(6)])
  assert sorted(done) == list(range(6)) and asked == [7], asked
