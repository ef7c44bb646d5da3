"""Overlapping independent kernels on threads: one process-wide pool, and the step that runs a group of kernels on it."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from kiln.codegen.threads import thread_count

PARALLEL_MIN_COST = 1 << 20  # bytes + flops under which overlapping kernels on threads costs more than it saves
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool() -> ThreadPoolExecutor:
  global _pool
  if _pool is None:
    with _pool_lock:
      if _pool is None:
        n = thread_count()
        _pool = ThreadPoolExecutor(max_workers=max(2, n), thread_name_prefix="kiln-plan")
  return _pool


def parallel(calls: list[Callable[[], Any]]) -> Callable[[], None]:
  """One step that runs every call at once: the first on this thread, the rest on the pool; the first failure is raised."""
  first, rest = calls[0], calls[1:]

  def run() -> None:
    futs = [_get_pool().submit(c) for c in rest]
    try: first()
    finally: wait_futures(futs)
    for f in futs: f.result()  # re-raise the first failure
  return run
