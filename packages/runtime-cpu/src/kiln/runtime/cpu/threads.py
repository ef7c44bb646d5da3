"""The process's worker pool (`get_pool`): a split kernel's calls (one per thread, each claiming chunks) run over it with
the GIL released, the caller working too. KILN_POOL picks its kind: `native` (native_pool.py, the default where it
builds: workers that never take the GIL) or `python`, the queue-based `WorkerPool` below.

The policy (docs/architecture.md, "The thread split"): a worker that has finished its part of a kernel spins briefly
(KILN_SPIN_US, native code, GIL released) only while a plan is running, since the plan's next kernel is certain to
follow; then, and always outside a plan, it sleeps on the queue. The caller never waits for a worker to wake: it claims
chunks itself, and a worker that wakes late finds none left.

A worker woken onto the CPU its caller runs on steps aside (`step_aside`): Linux's wake-affine placement does that when the
other CPUs look busy, or, in a VM, when an idle vCPU is halted (it then counts as preempted), and the two threads then share
one core until the load balancer moves one, milliseconds later (a 10 ms matmul after 1-10 ms idle measured 15-17 ms on a
2-vCPU VM, both threads on one CPU)."""
from __future__ import annotations

import ctypes
import os
import platform
import queue
import threading
from collections.abc import Callable, Sequence

from kiln.codegen.threads import thread_count
from kiln.ir.errors import SettingError
from kiln.runtime.cpu import settings
from kiln.runtime.cpu.native_pool import NativePool, native_pool_supported
from kiln.runtime.cpu.running import plans_running_address
from kiln.runtime.cpu.spin import Spinner, spin_us


def _libc_getcpu() -> Callable[[], int] | None:
  try: f = ctypes.CDLL(None).sched_getcpu  # glibc and musl; not on macOS
  except (AttributeError, OSError): return None
  f.restype, f.argtypes = ctypes.c_int, []
  return f  # type: ignore[no-any-return]


_getcpu = _libc_getcpu()


def current_cpu() -> int:
  """The CPU this thread runs on now (-1 where the OS cannot say)."""
  return _getcpu() if _getcpu is not None else -1


def step_aside(cpu: int) -> bool:
  """When this thread runs on `cpu` (its caller's), move it to another CPU it may run on: narrowing its affinity past `cpu`
  migrates it at once, and the old mask is put back so it stays free to move later. Returns whether it moved."""
  if cpu < 0 or current_cpu() != cpu or not hasattr(os, "sched_setaffinity"): return False
  allowed = os.sched_getaffinity(0)
  if not (others := allowed - {cpu}): return False
  try:
    os.sched_setaffinity(0, others)
    os.sched_setaffinity(0, allowed)
  except OSError: return False  # a mask the OS refuses (cpuset changed under us): stay put
  return True


class _Batch:
  __slots__ = ("fn", "args", "next", "left", "lock", "done", "error", "cpu")

  def __init__(self, fn: Callable[..., object], args: Sequence[tuple]):
    self.fn, self.args, self.next, self.left = fn, args, 0, len(args)
    self.cpu = current_cpu()  # the caller's: a worker woken onto it steps aside
    self.lock, self.done = threading.Lock(), threading.Event()
    self.error: BaseException | None = None

  def work(self) -> None:
    """Take calls from the batch until none is left; whoever finishes the last one wakes the caller."""
    while True:
      with self.lock:
        if self.next >= len(self.args): return
        i = self.next
        self.next += 1
      try: self.fn(*self.args[i])
      except BaseException as e:  # handed to the caller, who raises it
        self.error = e
      with self.lock:
        self.left -= 1
        if self.left == 0: self.done.set()


class WorkerPool:
  """`size - 1` daemon workers; the calling thread works too, so a pool of 1 runs everything in place. `spin` is how long
  (microseconds) a worker spins for the next batch while a plan runs (0: it sleeps at once)."""

  def __init__(self, size: int, spin: int = 0):
    self.size = size
    self.q: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
    self._gen = (ctypes.c_int32 * 16)()  # batches posted (wrapping), where a spinning worker watches it
    self._gen_lock = threading.Lock()
    self.spinner = Spinner(spin) if spin > 0 and size > 1 else None
    self.workers = [threading.Thread(target=self._loop, name=f"kiln-cpu-{i}", daemon=True) for i in range(size - 1)]
    for w in self.workers: w.start()

  def _loop(self) -> None:
    gen, plans = ctypes.addressof(self._gen), plans_running_address()
    while True:
      b = self.q.get()
      seen = self._gen[0]  # bumped before b was put: a later batch changes it
      if b.next < len(b.args): step_aside(b.cpu)  # only with work left: a worker that finds none need not move
      b.work()
      # inside a plan the next kernel follows within microseconds: wait for it awake, not asleep
      if self.spinner is not None: self.spinner.wait(gen, seen, plans)

  def run_kernel(self, fn: Callable[..., object], args: Sequence[tuple], task: int, block: int) -> None:
    """A split kernel's calls, fn(*a) for every a in args, over the pool (the native pool's task entry and block unused)."""
    self.run(fn, args)

  def run(self, fn: Callable[..., object], args: Sequence[tuple]) -> None:
    """Call fn(*a) for every a in args, spread over the pool; returns when all are done; re-raises a call's error."""
    if len(args) == 1 or self.size == 1:
      for a in args: fn(*a)
      return
    b = _Batch(fn, args)
    # before the put: a spinner that sees the change takes the batch from the queue (waiting there a moment at most)
    with self._gen_lock: self._gen[0] = (self._gen[0] + 1) & 0x7FFFFFFF
    for _ in range(min(self.size - 1, len(args) - 1)): self.q.put(b)
    b.work()
    b.done.wait()
    if b.error is not None: raise b.error


_pool: WorkerPool | NativePool | None = None
_pool_lock = threading.Lock()


def pool_kind() -> str:
  """KILN_POOL: `native` (the default where native_pool_supported(): workers that never take the GIL) or `python`."""
  kind = settings.POOL.get() or ("native" if native_pool_supported() else "python")
  if kind == "native" and not native_pool_supported():
    raise SettingError(f"KILN_POOL=native needs Linux on x86-64 or AArch64 (this is {platform.system()} on {platform.machine()})")
  return kind


def new_pool(size: int, spin: int = 0, kind: str | None = None) -> WorkerPool | NativePool:
  """A pool of `size` threads (the caller one of them) of `kind` (default: KILN_POOL's)."""
  return (NativePool if (kind or pool_kind()) == "native" else WorkerPool)(size, spin)


def get_pool() -> WorkerPool | NativePool:
  """The process's pool (KILN_THREADS threads, KILN_SPIN_US, KILN_POOL), made on first use; a child made by fork() makes
  its own."""
  global _pool
  if (p := _pool) is not None: return p
  with _pool_lock:
    if _pool is None: _pool = new_pool(thread_count(), spin_us())
    return _pool


def _forget_in_child() -> None:  # the parent's workers do not exist in a forked child
  global _pool, _pool_lock
  _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
