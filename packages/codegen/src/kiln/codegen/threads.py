"""The CPU thread split's two shared names: the `core_id` variable a threaded kernel takes last, and how many threads
kiln uses (KILN_THREADS, else the cores this process may run on). docs/architecture.md ("The thread split") follows a
THREAD option from the heuristic through lowering, rendering and the runtime's pool to the executor."""
from __future__ import annotations

import os

# the name of the hidden last argument of a threaded CPU kernel: calls 0..threads-1 each take a slice, and a threaded
# reduction adds a finishing call with core_id == threads that folds the partials in order
CORE_ID = "core_id"


def thread_count() -> int:
  """KILN_THREADS, else the number of cores this process may use. The one reader of KILN_THREADS."""
  env = os.environ.get("KILN_THREADS")
  if env:
    try: n = int(env)
    except ValueError: raise ValueError(f"KILN_THREADS must be a positive integer, got {env!r}") from None
    if n < 1: raise ValueError(f"KILN_THREADS must be a positive integer, got {env!r}")
    return n
  return available_cores()


def available_cores() -> int:
  """The cores this process may run on (its affinity mask), else all the OS reports."""
  try: return len(os.sched_getaffinity(0))
  except AttributeError: return os.cpu_count() or 1
