"""KILN_GUARD=1: CPU buffers between inaccessible guard pages, so a kernel that reads or writes outside its buffers faults at
once instead of corrupting memory. The data ends exactly at the page after it (one element past the end faults); a page
before it catches underflow past the page boundary (the few bytes between that page and the data's start do not fault).

The verifier proves generated code stays inside its buffers; this shows it by running: the fuzzer allocates every buffer of
every case this way (tests/fuzz/kfuzz.py), and tests run kernels and the conformance table under it. Linux and other POSIX
systems (mmap, mprotect); elsewhere guard mode is refused with a clear error, never silently off."""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Any

import numpy as np

from kiln.ir.errors import KilnBufferError
from kiln.runtime.cpu import settings
from kiln.runtime.cpu.buffer import CpuBuffer, check_size, to_np_dtype

PAGE = mmap.PAGESIZE
_PROT_NONE = 0


def guard_enabled() -> bool:
  """KILN_GUARD is on."""
  return settings.GUARD.get()


@functools.cache
def _libc() -> Any:
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
  return libc


def _mprotect_none(addr: int, length: int) -> None:
  if _libc().mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(length), _PROT_NONE) != 0:
    raise KilnBufferError(f"KILN_GUARD: mprotect of a guard page failed: {os.strerror(ctypes.get_errno())}")


class GuardedBuffer(CpuBuffer):
  """`size` bytes of zeroed memory ending exactly at an inaccessible page, with another inaccessible page before it. Its
  start is aligned as far as `size` allows (a multiple of 64 bytes starts on a 64-byte boundary), which kernels do not
  rely on: they need each element aligned to its own size, and check a streaming store's alignment at run time."""

  def __init__(self, size: int):
    if not hasattr(mmap, "MAP_PRIVATE"): raise KilnBufferError("KILN_GUARD needs mmap and mprotect (a POSIX system)")
    self.size = check_size(size)
    body = -(-max(self.size, 1) // PAGE) * PAGE
    self._map = mmap.mmap(-1, body + 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(self._map, np.uint8)
    base = int(whole.ctypes.data)
    _mprotect_none(base, PAGE)
    _mprotect_none(base + PAGE + body, PAGE)
    start = PAGE + body - self.size
    self._mem = whole[start:start + self.size]
    self._ptr = base + start

  def __repr__(self) -> str: return f"GuardedBuffer(size={self.size}, ptr={self._ptr:#x}{', freed' if self._mem is None else ''})"


def guarded_array(count: int, dtype: Any) -> np.ndarray:
  """A zeroed 1-d numpy array of `count` elements in a GuardedBuffer (it keeps the mapping alive). An empty one points
  at the guard page itself: any access through it faults."""
  dt = to_np_dtype(dtype)
  if count == 0: return GuardedBuffer(dt.itemsize).as_numpy(dt, 0, dt.itemsize)
  return GuardedBuffer(count * dt.itemsize).as_numpy(dt, count)


def guarded_copy(a: np.ndarray) -> np.ndarray:
  """`a`'s values in a guarded array of the same shape and dtype."""
  out = guarded_array(a.size, a.dtype).reshape(a.shape)
  out[...] = a
  return out
