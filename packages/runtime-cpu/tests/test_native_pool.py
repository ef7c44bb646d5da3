"""The native worker loop (issue 21): workers that claim and run a split kernel's calls without the GIL. Every post's
calls run exactly once however fast posts follow each other; workers run beside the caller while another Python thread
holds the GIL; a second caller while the pool is busy waits its turn; the task entry the renderer emits runs the
kernel as its entry does; KILN_POOL picks the pool; close() lets the workers go.

The tasks below are a few lines of LLVM IR with the task signature (`void task(ptr args, i32 slot)`), so each test sees
exactly which slot ran, and every wait in them is bounded (a broken pool fails, never hangs)."""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator

import llvmlite.binding as llvm
import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import dtypes, kernels, reference
from kiln.runtime.cpu import threads as threads_mod
from kiln.runtime.cpu.compiler import init_llvm
from kiln.runtime.cpu.native_pool import BUSY, NativePool, native_pool_supported

pytestmark = pytest.mark.skipif(not native_pool_supported(), reason="the native pool is Linux on x86-64 or AArch64 only")

RT = get_runtime("CPU")
BOUND = 1 << 28  # rounds a test task waits at most (about a second with pause): a missing thread fails the test, never hangs it

_TASKS = f"""
; args[slot] += 1: which slots ran, and how often
define void @count(ptr %args, i32 %slot) {{
  %s = sext i32 %slot to i64
  %p = getelementptr i64, ptr %args, i64 %s
  %o = atomicrmw add ptr %p, i64 1 seq_cst
  ret void
}}
; args[0..n): a flag per slot (n = args[8]); set mine, wait (bounded) until every slot's is set; args[9 + slot] = 1 if they were
define void @meet(ptr %args, i32 %slot) {{
  %s = sext i32 %slot to i64
  %mine = getelementptr i64, ptr %args, i64 %s
  store atomic i64 1, ptr %mine seq_cst, align 8
  %np = getelementptr i64, ptr %args, i64 8
  %n = load i64, ptr %np, align 8
  %all = call i1 @scan(ptr %args, i64 %n, i64 0)
  %res = zext i1 %all to i64
  %at = add i64 %s, 9
  %rp = getelementptr i64, ptr %args, i64 %at
  store atomic i64 %res, ptr %rp seq_cst, align 8
  ret void
}}
; scan the n flags until all are set (true) or {BOUND} rounds have passed (false)
define i1 @scan(ptr %args, i64 %n, i64 %start) {{
entry:
  br label %round
round:
  %i = phi i64 [ %start, %entry ], [ %i1, %next ]
  br label %flags
flags:
  %j = phi i64 [ 0, %round ], [ %j1, %flags ]
  %all = phi i1 [ true, %round ], [ %all1, %flags ]
  %fp = getelementptr i64, ptr %args, i64 %j
  %f = load atomic i64, ptr %fp seq_cst, align 8
  %set = icmp ne i64 %f, 0
  %all1 = and i1 %all, %set
  %j1 = add i64 %j, 1
  %end = icmp eq i64 %j1, %n
  br i1 %end, label %next, label %flags
next:
  %i1 = add i64 %i, 1
  %late = icmp uge i64 %i1, {BOUND}
  %stop = or i1 %all1, %late
  br i1 %stop, label %out, label %round
out:
  ret i1 %all1
}}
; hold the pool until args[0] is set (bounded), then args[1] = 1
define void @hold(ptr %args, i32 %slot) {{
entry:
  br label %wait
wait:
  %i = phi i64 [ 0, %entry ], [ %i1, %wait ]
  %f = load atomic i64, ptr %args seq_cst, align 8
  %i1 = add i64 %i, 1
  %go = icmp ne i64 %f, 0
  %late = icmp uge i64 %i1, {BOUND}
  %stop = or i1 %go, %late
  br i1 %stop, label %out, label %wait
out:
  %p = getelementptr i64, ptr %args, i64 1
  store atomic i64 1, ptr %p seq_cst, align 8
  ret void
}}
"""


@pytest.fixture(scope="module")
def tasks() -> Iterator[dict[str, int]]:
  init_llvm()
  mod = llvm.parse_assembly(_TASKS)
  mod.verify()
  engine = llvm.create_mcjit_compiler(mod, llvm.Target.from_default_triple().create_target_machine())
  engine.finalize_object()
  yield {n: engine.get_function_address(n) for n in ("count", "meet", "hold")}
  del engine


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, NativePool]]:
  made = {n: NativePool(n, spin=50) for n in (1, 2, 3, 4)}
  yield made
  for p in made.values(): p.close()
  assert not any(w.is_alive() for p in made.values() for w in p.workers), "close() left a worker running"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_call_of_every_post_runs_once(tasks: dict[str, int], pools: dict[int, NativePool], size: int) -> None:
  """Posts back to back, with call counts from 1 to 4: a worker that read an old post can never run its calls again."""
  pool, posts = pools[size], 3000
  counts = np.zeros(8, np.int64)
  want = np.zeros(8, np.int64)
  for i in range(posts):
    calls = 1 + i % 4
    pool.run_task(tasks["count"], counts.ctypes.data, calls)
    want[:calls] += 1
  assert counts.tolist() == want.tolist()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_workers_run_beside_the_caller_while_python_holds_the_gil(tasks: dict[str, int], pools: dict[int, NativePool], size: int) -> None:
  """Every slot waits for every other: only a pool whose workers run at once, without the GIL (a Python thread spins on
  it meanwhile), lets all of them see all the flags."""
  stop = threading.Event()
  def hog() -> None:
    while not stop.is_set(): pass
  t = threading.Thread(target=hog)
  t.start()
  try:
    for _ in range(20):
      block = np.zeros(16, np.int64)
      block[8] = size
      pools[size].run_task(tasks["meet"], block.ctypes.data, size)
      assert block[9:9 + size].tolist() == [1] * size, block
  finally:
    stop.set()
    t.join()


def test_a_second_caller_waits_its_turn(tasks: dict[str, int], pools: dict[int, NativePool]) -> None:
  """While one Python thread's kernel has the pool, another's waits (GIL released) and then runs, all its calls once."""
  pool, hold, counts = pools[2], np.zeros(8, np.int64), np.zeros(8, np.int64)
  first = threading.Thread(target=pool.run_task, args=(tasks["hold"], hold.ctypes.data, 1))
  first.start()
  deadline = time.monotonic() + 5
  while ctypes.c_int32.from_address(pool.address + BUSY).value == 0 and time.monotonic() < deadline: time.sleep(0.001)
  second = threading.Thread(target=pool.run_task, args=(tasks["count"], counts.ctypes.data, 3))
  second.start()
  time.sleep(0.05)  # the GIL is free meanwhile (this thread runs), and the second kernel has not started
  try: assert counts[:3].tolist() == [0, 0, 0] and second.is_alive()
  finally: hold[0] = 1
  first.join(10)
  second.join(10)
  assert not second.is_alive() and counts[:3].tolist() == [1, 1, 1] and hold[1] == 1
  assert ctypes.c_int32.from_address(pool.address + BUSY).value == 0  # free again, no sleeper left marked


def test_python_threads_posting_at_once_each_get_every_call(tasks: dict[str, int], pools: dict[int, NativePool]) -> None:
  """Four Python threads post 500 kernels each on one pool: every call of every post runs once, and nobody is left
  asleep (a lost wake-up would hang a thread: the join's deadline fails it instead)."""
  pool, posts = pools[3], 500
  counts = [np.zeros(8, np.int64) for _ in range(4)]
  def poster(c: np.ndarray) -> None:
    for i in range(posts): pool.run_task(tasks["count"], c.ctypes.data, 1 + i % 3)
  ts = [threading.Thread(target=poster, args=(c,)) for c in counts]
  for t in ts: t.start()
  for t in ts: t.join(60)
  assert not any(t.is_alive() for t in ts), "a poster never finished"
  want = [sum(1 for i in range(posts) if 1 + i % 3 > s) for s in range(3)]
  assert all(c[:3].tolist() == want for c in counts), [c[:3] for c in counts]


def test_the_task_entry_runs_the_kernel_as_its_entry_does() -> None:
  """Slot 0 of a split kernel's task, called alone, claims every chunk: the whole result, bit for bit the reference's."""
  n = 1 << 20
  ast = kernels.elementwise(lambda a, b: a * b + a, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32))
  prog = RT.load(RT.compiler.compile(RT.renderer.render(ast)))
  assert prog.threads > 1 and prog.task, prog.spec.applied_opts
  a, b = (np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in (1, 2))
  out = np.zeros(n, np.float32)
  claim = np.zeros(16, np.int32)
  block = np.array([out.ctypes.data, a.ctypes.data, b.ctypes.data, claim.ctypes.data], np.int64)
  ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(prog.task)(block.ctypes.data, 0)
  assert out.tobytes() == reference.run(ast, np.zeros(n, np.float32), a, b)[0].tobytes()
  assert claim[0] >= prog.threads  # every chunk was claimed through the counter in the block


def test_a_kernel_without_a_task_entry_runs_on_the_caller(pools: dict[int, NativePool], monkeypatch: pytest.MonkeyPatch) -> None:
  """Object code from before the task entry existed (task 0): the native pool runs its calls on the caller, whole."""
  import kiln.runtime.cpu.bound as bound_mod
  n = 1 << 20
  ast = kernels.elementwise(lambda a: a * 3.0 + 1.0, dtypes.float32, ((n,), dtypes.float32))
  prog = RT.load(RT.compiler.compile(RT.renderer.render(ast)))
  assert prog.threads > 1 and prog.task
  monkeypatch.setattr(prog, "task", 0)
  monkeypatch.setattr(prog, "task_fn", None)
  monkeypatch.setattr(bound_mod, "get_pool", lambda: pools[2])
  x, out = np.random.default_rng(3).standard_normal(n).astype(np.float32), np.zeros(n, np.float32)
  prog([out.ctypes.data, x.ctypes.data])
  assert out.tobytes() == reference.run(ast, np.zeros(n, np.float32), x)[0].tobytes()


@pytest.mark.parametrize("value, kind", [("", "native"), ("native", "native"), ("python", "python"), ("threads", None)])
def test_kiln_pool_picks_the_pool(monkeypatch: pytest.MonkeyPatch, value: str, kind: str | None) -> None:
  monkeypatch.setenv("KILN_POOL", value)
  if kind is None:
    with pytest.raises(ValueError, match="KILN_POOL must be one of native, python"): threads_mod.pool_kind()
  else: assert threads_mod.pool_kind() == kind
