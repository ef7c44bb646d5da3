"""CPUBoundCall: a CPU kernel bound to fixed buffer addresses, the executor's fast path."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.runtime.cpu import blocks
from kiln.runtime.cpu.guard import guard_enabled, guarded_array
from kiln.runtime.cpu.sequence import sequence_calls, step_word
from kiln.runtime.cpu.serial_rule import SerialRule
from kiln.runtime.cpu.threads import get_pool

if TYPE_CHECKING:
  from kiln.runtime.cpu.program import CPUProgram


class CPUBoundCall:
  """Arguments laid out once; calling runs the kernel (over the pool when split into chunks: each thread of the pool
  claims chunks from this call's counter until none is left, so a thread whose core is busy with other work takes
  fewer). A bound call owns its counter and, unless share_scratch gave it a plan's, its scratch, so two bound calls of
  one program may run at once; one bound call may not.

  The arguments live in one int64 block (blocks.py), which the kernel's task entry reads: Python calls the task entry
  with (block, slot), native code (the pool's workers, a plan's sequence) calls it the same way, and set_vals,
  share_scratch and a plan's vals_writer write the block in place. Object code without a task entry (from before every
  kernel had one) is called with its arguments as lists instead.

  A kernel split over a symbolic axis carries a SerialRule (serial_rule.py): whenever its values change, `serial` says
  whether the work at them is too small to hand to another core, and then the caller claims every chunk itself, here
  and in each sequence step that runs it (`rows`)."""
  __slots__ = ("prog", "bufs", "scratch", "claim", "workers", "block", "block_at", "fn", "args", "finish", "_vals", "rule",
               "serial", "rows")
  sequence_calls = staticmethod(sequence_calls)  # kiln.codegen.protocols.SequenceCall: a plan's stretch as one native call

  def __init__(self, prog: CPUProgram, bufs: list[int], vals: list[int]):
    self.prog, self.bufs = prog, bufs
    self._vals = list(vals)  # where there is no block (object code without a task entry); else the block holds them
    self.scratch: np.ndarray | None = None
    if prog.scratch_bytes:  # 64 bytes of slack to align it; under KILN_GUARD it ends at a guard page, 64-aligned as it is
      n = -(-prog.scratch_bytes // 64) * 64
      self.scratch = guarded_array(n, np.uint8) if guard_enabled() else np.zeros(prog.scratch_bytes + 64, np.uint8)
    # a split kernel's chunk counter, alone on its cache line (every claim writes it; a neighbour there would bounce)
    self.claim = _line() if prog.threads > 1 else None
    self.workers = min(get_pool().size, prog.threads, prog.slots or prog.threads) if self.claim is not None else 1  # claiming threads
    self.block: np.ndarray | None = None
    self.block_at = 0  # its address (0: none)
    self.rule = SerialRule.of(prog.spec.work, prog.spec.split_min, prog.user_vars) if self.workers > 1 else None
    self.serial = False
    self.rows: list[np.ndarray] = []  # the sequence steps that run it (sequence.py): their word of calls follows `serial`
    self._build()
    self.retune()

  @property
  def vals(self) -> list[int]:
    """The variable values bound now (a plan's vals_writer writes them into the block alone)."""
    if self.block is None: return list(self._vals)
    return [int(v) for v in self.block[len(self.bufs):len(self.bufs) + len(self.prog.user_vars)]]

  def _build(self) -> None:
    """The block (or the argument lists) from the buffers, the values, the counter and the scratch."""
    vals = self.vals
    extra = [(self.scratch.ctypes.data + 63) // 64 * 64] if self.scratch is not None else []
    claim = [self.claim.ctypes.data] if self.claim is not None else []
    self.finish: Any = None
    if self.prog.task_fn is not None:  # every argument but the slot, which each call passes
      words = [*self.bufs, *vals, *claim, *extra]
      if self.block is None: self.block = blocks.take(len(words))
      self.block[:] = words  # in place: native code holds its address
      self.block_at, self.fn = self.block.ctypes.data, self.prog.task_fn
      self.args: Any = [(self.block_at, w) for w in range(self.workers)] if claim else (self.block_at, 0)
      if claim and self.prog.finish_call: self.finish = (self.block_at, -1)
    else:
      base = [*self.bufs, *vals]
      self.fn = self.prog.fn
      self.args = [[*base, w, *claim, *extra] for w in range(self.workers)] if claim else [*base, *extra]
      if claim and self.prog.finish_call: self.finish = [*base, -1, *claim, *extra]

  def set_vals(self, vals: Sequence[int], global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None) -> None:
    """New variable values, checked against the kernel's bounds and written in place. The buffers were checked when the
    call was bound and do not change."""
    new = self.prog.check_vals(vals)
    at = len(self.bufs)
    if self.block is not None: self.block[at:at + len(new)] = new
    else:
      for i, v in enumerate(new):
        if self.claim is None: self.args[at + i] = v
        else:
          for a in self.args: a[at + i] = v
          if self.finish is not None: self.finish[at + i] = v
      self._vals = new
    self.retune()

  def retune(self) -> None:
    """`serial` from the values bound now, and each sequence step's word of calls (1: the caller alone) to match."""
    if self.rule is None: return
    at = len(self.bufs)
    vals = self.block[at:at + len(self.prog.user_vars)].tolist() if self.block is not None else self._vals
    if (serial := self.rule.serial(vals)) == self.serial: return
    self.serial = serial
    for row in self.rows: row[3] = step_word(self)

  @staticmethod
  def vals_writer(sites: Sequence[tuple[CPUBoundCall, int]]) -> Callable[[int], None] | None:
    """kiln.codegen.protocols.ValsWriter: one callable that writes a value, already checked against every one of these
    kernels' bounds, as variable `pos` of each (call, pos) of `sites` (None: a call without a block)."""
    if any(c.block is None for c, _ in sites): return None
    write = blocks.writer([(c.block, len(c.bufs) + pos) for c, pos in sites])  # type: ignore[misc]  # checked above
    ruled = list({id(c): c for c, _ in sites if c.rule is not None}.values())
    if not ruled: return write

    def write_and_retune(value: int) -> None:
      write(value)
      for c in ruled: c.retune()
    return write_and_retune

  @staticmethod
  def share_scratch(calls: Sequence[CPUBoundCall], together: Sequence[Sequence[object]] = ()) -> None:
    """One scratch for calls that never run at once (an ExecutionPlan's, which runs its steps one after another: kiln's
    executor asks), as large as the largest needs, instead of one each: a model's plan held a dequantised panel or a
    split sum's partials per kernel. The calls of each group in `together` run at once (a plan's kernels overlapped on
    threads): the j-th of a group takes the j-th arena, so no two of them pack panels into the same bytes. Not under
    KILN_GUARD, where each keeps its own, ending at its guard page."""
    own = [c for c in calls if c.scratch is not None]
    if len(own) < 2 or guard_enabled(): return
    lane = dict.fromkeys(map(id, own), 0)
    for group in together:
      for j, c in enumerate(c for c in group if id(c) in lane): lane[id(c)] = j
    need: dict[int, int] = {}
    for c in own: need[lane[id(c)]] = max(need.get(lane[id(c)], 0), c.scratch.nbytes)  # type: ignore[union-attr]  # each 64 bytes over its need
    arenas = {j: np.zeros(n, np.uint8) for j, n in need.items()}
    for c in own:
      c.scratch = arenas[lane[id(c)]]
      c._build()

  def __call__(self) -> None:
    if self.claim is None: self.fn(*self.args)
    else:
      self.claim[0] = 0
      # a pool of one thread, or work too small to share: this call claims every chunk itself, without the pool's round trip
      if len(self.args) == 1 or self.serial: self.fn(*self.args[0])
      else: get_pool().run_kernel(self.fn, self.args, self.prog.task, self.block_at)
    if self.finish is not None: self.fn(*self.finish)


def _line() -> np.ndarray:
  """An int32 counter alone on a 64-byte cache line."""
  raw = np.zeros(32, np.int32)
  skip = (-raw.ctypes.data % 64) // 4
  return raw[skip:skip + 16]
