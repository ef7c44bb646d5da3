"""device_vars.VarArena's writer: a plan's variable written into many kernels' slots at once (host copies, one span per
page copied at the next flush), over an allocator of host memory."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kiln.ir.errors import RuntimeLaunchError
from kiln.runtime.cuda.device_vars import PAGE_INTS, VarArena
from kiln.runtime.cuda.driver import CUDABoundCall


class HostAllocator:
  """Pages in host memory; copyin records (page index, first int, ints) and copies."""
  def __init__(self) -> None: self.pages: list[np.ndarray] = []; self.copies: list[tuple[int, int, int]] = []  # noqa: E702

  def alloc(self, size: int) -> SimpleNamespace:
    self.pages.append(np.zeros(size // 4, np.int32))
    return SimpleNamespace(ptr=len(self.pages) << 20, size=size, i=len(self.pages) - 1)

  def view(self, buf: SimpleNamespace, off: int, n: int) -> tuple[int, int, int]: return (buf.i, off // 4, n // 4)

  def copyin(self, view: tuple[int, int, int], mem: memoryview) -> None:
    i, lo, n = view
    self.pages[i][lo:lo + n] = np.frombuffer(mem, np.int32)
    self.copies.append(view)

  def free(self, buf: SimpleNamespace, size: int) -> None: pass


class Owner:
  pass


def test_a_writer_sets_its_sites_in_every_page_and_one_flush_copies_each_pages_span() -> None:
  alloc = HostAllocator()
  arena = VarArena(alloc)
  owners = [Owner() for _ in range(PAGE_INTS // 2 + 1)]  # a slot goes back when its owner is collected: kept here
  slots = [arena.take(2, o) for o in owners]  # 513 slots of two: the last on a second page
  assert slots[-1].page == 1 and slots[0].page == 0
  sites = [(slots[0], 1), (slots[10], 0), (slots[-1], 1)]
  write = arena.writer(sites)
  arena.write(slots[5], [7, 8], "k")  # a slot written alone, in the same flush
  write(42)
  assert arena.dirty
  arena.flush()
  assert not arena.dirty and sorted(alloc.copies) == [(0, 1, 20), (1, 1, 1)]  # page 0: ints 1-20 (slots 0-10), page 1: int 1
  assert alloc.pages[0][1] == 42 and alloc.pages[0][20] == 42 and alloc.pages[1][1] == 42
  assert list(alloc.pages[0][10:12]) == [7, 8] and alloc.pages[0][0] == 0 and alloc.pages[0][21] == 0
  with pytest.raises(RuntimeLaunchError, match="int32"): write(1 << 31)


def test_the_calls_writer_spans_runtimes_and_refuses_a_call_with_its_variables_as_arguments() -> None:
  arenas = [VarArena(HostAllocator()), VarArena(HostAllocator())]
  owner = Owner()
  calls = [SimpleNamespace(vars=a, slot=a.take(3, owner)) for a in arenas]
  write = CUDABoundCall.vals_writer([(calls[0], 2), (calls[1], 0)])
  assert write is not None
  write(9)
  assert calls[0].slot.host[2] == 9 and calls[1].slot.host[0] == 9 and all(a.dirty for a in arenas)
  assert CUDABoundCall.vals_writer([(calls[0], 0), (SimpleNamespace(vars=arenas[0], slot=None), 0)]) is None
