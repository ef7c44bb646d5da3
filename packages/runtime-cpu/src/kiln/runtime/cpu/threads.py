"""A persistent worker pool: a threaded kernel's N calls (core_id 0..N-1) run over it with the GIL released."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from functools import cache

from kiln.codegen.threads import thread_count


class _Batch:
  __slots__ = ("fn", "args", "next", "left", "lock", "done", "error")

  def __init__(self, fn: Callable[..., object], args: Sequence[tuple]):
    self.fn, self.args, self.next, self.left = fn, args, 0, len(args)
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
  """`size - 1` daemon workers; the calling thread works too, so a pool of 1 runs everything in place."""

  def __init__(self, size: int):
    self.size = size
    self.q: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
    self.workers = [threading.Thread(target=self._loop, name=f"kiln-cpu-{i}", daemon=True) for i in range(size - 1)]
    for w in self.workers: w.start()

  def _loop(self) -> None:
    while True: self.q.get().work()

  def run(self, fn: Callable[..., object], args: Sequence[tuple]) -> None:
    """Call fn(*a) for every a in args, spread over the pool; returns when all are done; re-raises a call's error."""
    if len(args) == 1 or self.size == 1:
      for a in args: fn(*a)
      return
    b = _Batch(fn, args)
    for _ in range(min(self.size - 1, len(args) - 1)): self.q.put(b)
    b.work()
    b.done.wait()
    if b.error is not None: raise b.error


@cache
def get_pool() -> WorkerPool: return WorkerPool(thread_count())
