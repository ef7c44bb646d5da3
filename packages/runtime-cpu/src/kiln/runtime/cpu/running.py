"""The plans running now in this process, and when the last one ended, where the CPU pool's spinning workers read them
without the GIL: a worker spins for the next split kernel while a plan runs (more kernels are certain to follow) and
until KILN_SPIN_US after the last one ended (a next run soon after finds it awake), never longer (spin.py).
CPUProgram.plan_running is how an ExecutionPlan says it runs (kiln.codegen.protocols.PlanRunning)."""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.runtime.cpu.spin import ENDED_OFFSET, cycles

_PLANS = (ctypes.c_int32 * 16)()  # the count in element 0, on a 64-byte line of its own
_ENDED = ctypes.c_int64.from_buffer(_PLANS, ENDED_OFFSET)  # the cycle counter when the count last fell to 0
_lock = threading.Lock()


@contextmanager
def plan_running() -> Iterator[None]:
  with _lock: _PLANS[0] += 1
  try: yield
  finally:
    with _lock:
      if _PLANS[0] == 1:  # the time first: a worker that sees no plan running reads it next
        _ENDED.value = cycles()
      _PLANS[0] -= 1


def plans_running_address() -> int:
  """Where the count of running plans is (an int32), for native code that waits on it."""
  return ctypes.addressof(_PLANS)


def _reset_in_child() -> None:  # a plan that another thread was running at fork() does not run in the child
  _PLANS[0] = 0
  _ENDED.value = 0


os.register_at_fork(after_in_child=_reset_in_child)
