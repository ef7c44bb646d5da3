"""A plan's stretch of CPU kernels run by one native call (kiln.codegen.protocols.SequenceCall).

Why: calling a kernel from Python through ctypes costs about a microsecond before the kernel starts, and a split
kernel's hand-off to the pool a few more. A language model's decode step runs some 1,100 kernels, most of them small:
the calls alone took more than a millisecond of a step of seven. Here the executor hands each stretch of bound calls
with nothing else between them to `sequence_calls`, and the stretch runs as one call of the native pool's
`kiln_pool_run_seq`, which calls each kernel's task entry (every kernel has one: render.llvm_claim.task_entry) with the
argument block its bound call keeps, and posts split kernels to the pool as the Python path does.

The steps hold the blocks' addresses: blocks never move, and new variable values and a shared scratch are written into
them in place (bound.py), so the sequence follows them without being rebuilt."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.runtime.cpu.native_pool import STEP_WORDS, NativePool, native_pool_supported, run_sequence
from kiln.runtime.cpu.threads import get_pool, pool_kind

if TYPE_CHECKING:
  from kiln.runtime.cpu.bound import CPUBoundCall


class CPUSequence:
  """Bound calls run in order by one native call. Like a bound call, one run at a time (the plan's lock sees to it)."""
  __slots__ = ("calls", "steps", "pooled", "_run", "_at", "_n")

  def __init__(self, calls: Sequence[CPUBoundCall]):
    self.calls = list(calls)  # keeps the blocks and chunk counters the steps point at alive
    self.steps = np.zeros((len(self.calls), STEP_WORDS), np.int64)
    for row, c in zip(self.steps, self.calls):
      row[:] = (c.prog.task, c.block_at, c.claim.ctypes.data if c.claim is not None else 0, step_word(c))
      if c.rule is not None: c.rows.append(row)  # its word of calls follows its values (bound.CPUBoundCall.retune)
    self.pooled = any(c.workers > 1 for c in self.calls)  # a kernel runs over the pool's workers
    self._run, self._at, self._n = run_sequence(), self.steps.ctypes.data, len(self.calls)

  def __call__(self) -> None: self._go(None)

  def timed(self) -> np.ndarray:
    """Run once, reading the cycle counter between steps: each step's cycles (len(calls),), without Python's overhead
    per kernel (spin.cycles_per_us converts). For profiling."""
    times = np.zeros(self._n + 1, np.int64)
    self._go(times.ctypes.data)
    return np.diff(times)

  def _go(self, times: int | None) -> None:
    if not self.pooled:
      self._run(0, self._at, self._n, 0, times)
      return
    pool = get_pool()  # at run time: a child made by fork() has a pool of its own
    if isinstance(pool, NativePool): self._run(pool.address, self._at, self._n, pool.wait_ticks, times)
    else:  # the process's pool was made as a Python one before KILN_POOL said native
      for c in self.calls: c()


def step_word(c: CPUBoundCall) -> int:
  """A step's word for c: the calls that claim its chunks (1 where it runs serially), the finishing call's flag above."""
  calls = 1 if c.claim is None or c.serial else c.workers
  return calls | (int(c.finish is not None) << 32)


def sequence_calls(calls: Sequence[Any]) -> CPUSequence | None:
  """One callable for a plan's stretch of CPU bound calls, or None where it would not pay or cannot be: fewer than two
  calls, no native pool on this platform or KILN_POOL=python, or a kernel without a task entry."""
  if len(calls) < 2 or not native_pool_supported() or pool_kind() != "native": return None
  if any(not c.prog.task or c.block is None for c in calls): return None
  return CPUSequence(calls)
