"""The device array a kernel rendered with vars_in_memory reads its runtime variables from (kiln.codegen.render.cuda_vars).

Each bound call owns a slot of int32s (its var_names, in order) in pages of device memory with a host copy. set_vals writes
the host copy and marks the arena dirty; the next launch of any of this runtime's kernels, or CUDA graph, copies what was
written (a span per page) to the device first. kiln launches on the device's one (null) stream and the copy is a synchronous cuMemcpyHtoD
queued on it after every launch before it, so a kernel reads the values its call had when it was launched, and a later
write cannot reach a kernel still waiting to run.

A slot is never moved (its device address is in the call's arguments, and in the graphs that hold them); a call's slot goes
back to a free list when the call is dropped."""
from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.ir.errors import RuntimeLaunchError

PAGE_INTS = 1024  # int32 slots per device page (4 KB): a decode plan's variables fill a few


class VarSlot:
  """n int32s at device address `ptr`; `host` is their host copy (write it through VarArena.write)."""
  __slots__ = ("__weakref__", "host", "n", "page", "ptr", "start")

  def __init__(self, page: int, start: int, n: int, ptr: int, host: np.ndarray):
    self.page, self.start, self.n, self.ptr, self.host = page, start, n, ptr, host


class VarArena:
  """The pages of one runtime (allocator: its CUDAAllocator)."""

  def __init__(self, allocator: Any):
    self.allocator = allocator
    self._pages: list[tuple[Any, np.ndarray]] = []  # (device buffer, host copy)
    self._free: dict[int, list[tuple[int, int]]] = {}  # n -> free (page, start) slots of that size
    self._used = 0  # slots taken from the last page so far
    self._dirty: dict[int, tuple[int, int]] = {}  # page -> the span [lo, hi) of slots written since the last flush
    self.dirty = False  # any page to copy before the next launch (read without the lock on the launch path)
    self._lock = threading.Lock()

  def take(self, n: int, owner: object) -> VarSlot:
    """A slot of n int32s, given back when `owner` is collected."""
    if not 0 < n <= PAGE_INTS: raise RuntimeLaunchError(f"a kernel reads {n} variables from memory: 1 to {PAGE_INTS} fit a page")
    with self._lock:
      if (free := self._free.get(n)): page, start = free.pop()
      else:
        if not self._pages or self._used + n > PAGE_INTS:
          buf = self.allocator.alloc(4 * PAGE_INTS)
          self._pages.append((buf, np.zeros(PAGE_INTS, np.int32)))
          self._used = 0
        page, start = len(self._pages) - 1, self._used
        self._used += n
      buf, host = self._pages[page]
    slot = VarSlot(page, start, n, buf.ptr + 4 * start, host[start:start + n])
    weakref.finalize(owner, self._give_back, n, page, start)
    return slot

  def _give_back(self, n: int, page: int, start: int) -> None:
    with self._lock: self._free.setdefault(n, []).append((page, start))

  def write(self, slot: VarSlot, vals: Sequence[int], name: str) -> None:
    """The slot's values (int32 each, else a RuntimeLaunchError naming kernel `name`), copied at the next flush."""
    for v in vals: _int32(v, f"kernel {name}: ")
    slot.host[:] = vals
    with self._lock: self._mark(slot.page, slot.start, slot.start + slot.n)

  def _mark(self, page: int, lo: int, hi: int) -> None:
    """Widen the page's span written since the last flush by [lo, hi) (the lock held)."""
    was = self._dirty.get(page, (lo, hi))
    self._dirty[page] = (min(was[0], lo), max(was[1], hi))
    self.dirty = True

  def writer(self, sites: Sequence[tuple[VarSlot, int]]) -> Callable[[int], None]:
    """One callable that writes a value as variable `pos` of each (slot, pos) of `sites` (one assignment per page into
    the host copies, int32-checked), copied at the next flush: a plan's variable reaching every kernel at once."""
    by_page: dict[int, list[int]] = {}
    for slot, pos in sites:
      if not 0 <= pos < slot.n: raise RuntimeLaunchError(f"variable {pos} of a slot of {slot.n}")
      by_page.setdefault(slot.page, []).append(slot.start + pos)
    spans = [(p, self._pages[p][1], np.array(sorted(set(at)), np.intp), min(at), max(at) + 1) for p, at in sorted(by_page.items())]

    def write(value: int) -> None:
      _int32(value)
      for _, host, at, _, _ in spans: host[at] = value
      with self._lock:
        for p, _, _, lo, hi in spans: self._mark(p, lo, hi)
    return write

  def __del__(self) -> None:
    # the pages go back through the allocator (its cache is freed with the context current, not by pycuda's destructors
    # on whatever thread drops them); a finaliser has no caller to tell, so a failure is a warning
    try:
      for buf, _ in self._pages: self.allocator.free(buf, buf.size)
    except Exception as e:
      warnings.warn(f"freeing the runtime variables' pages failed: {e}", RuntimeWarning, stacklevel=2)
    self._pages = []

  def flush(self) -> None:
    """Copy the written span of every page written since the last flush to the device."""
    with self._lock:
      spans = [(self._pages[p], lo, hi) for p, (lo, hi) in sorted(self._dirty.items())]
      self._dirty.clear()
      self.dirty = False
    for (buf, host), lo, hi in spans: self.allocator.copyin(self.allocator.view(buf, 4 * lo, 4 * (hi - lo)), memoryview(host[lo:hi].data))


def _int32(v: int, who: str = "") -> None:
  """A RuntimeLaunchError (its message led by `who`) where v does not fit the int32 a kernel reads."""
  if not -(2**31) <= int(v) < 2**31: raise RuntimeLaunchError(f"{who}a variable's value {v} does not fit int32")


def calls_writer(sites: Sequence[tuple[Any, int]]) -> Callable[[int], None] | None:
  """CUDABoundCall.vals_writer (kiln.codegen.protocols.ValsWriter): one callable that writes a value as variable `pos` of
  each (call, pos) of `sites` into the calls' slots (each runtime's arena, copied before its next launch); None where a
  call takes its variables as arguments (no slot)."""
  if not sites or any(c.slot is None for c, _ in sites): return None
  arenas: dict[int, tuple[VarArena, list[tuple[VarSlot, int]]]] = {}
  for c, pos in sites: arenas.setdefault(id(c.vars), (c.vars, []))[1].append((c.slot, pos))
  writers = [arena.writer(slots) for arena, slots in arenas.values()]
  if len(writers) == 1: return writers[0]

  def write_all(value: int) -> None:
    for w in writers: w(value)
  return write_all
