"""RawBuffer: opaque handles to host memory. `RawBuffer.Cpu` is 64-byte aligned zeroed memory, `RawBuffer.Mmap` a read-only file region
(the DISK device). Both give zero-copy numpy views; kernels take `ptr`."""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, ClassVar

import numpy as np

from kiln.ir.errors import KilnBufferError
from kiln.ir.files import open_regular

ALIGN = 64  # cache line and AVX-512 vector width: every Cpu buffer starts on this boundary


class OutOfMemoryError(KilnBufferError, MemoryError):
  """Host memory could not be allocated even after the allocator flushed its cache."""


def to_np_dtype(dtype: Any) -> np.dtype:
  """A numpy dtype from a kiln DType (bfloat16 -> its uint16 storage), a numpy dtype or type, or a name of either."""
  # a pointer dtype has an `np` that raises (hasattr would pass the error on): it falls through to numpy, which rejects it
  if getattr(dtype, "kind", None) != "p" and hasattr(dtype, "np") and not isinstance(dtype, np.dtype): return np.dtype(dtype.np)
  if isinstance(dtype, str):
    try:
      from kiln.ir.dtype import parse_dtype
      d = parse_dtype(dtype)
      if d.kind not in "vp": return d.np
    except Exception: pass  # noqa: S110  # not a kiln name: let numpy try it
  try: return np.dtype(dtype)
  except TypeError: raise KilnBufferError(f"cannot view a buffer as dtype {dtype!r}: not a kiln or numpy dtype") from None


def check_size(size: Any, what: str = "buffer size") -> int:
  # bool is an int subclass but never a size; numpy integers are fine
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
    raise KilnBufferError(f"{what} must be a positive int of bytes, got {type(size).__name__} {size!r}")
  if size <= 0: raise KilnBufferError(f"{what} must be positive, got {size}")
  return int(size)


def _src_bytes(src: Any, what: str) -> memoryview:
  """A flat byte memoryview of a C-contiguous buffer-protocol object."""
  try: mv = src if isinstance(src, memoryview) else memoryview(src)
  except TypeError: raise KilnBufferError(f"{what} must support the buffer protocol, got {type(src).__name__}") from None
  if not mv.c_contiguous: raise KilnBufferError(f"{what} must be C-contiguous (shape {mv.shape}, strides {mv.strides})")
  return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def _addr(mv: memoryview) -> int: return int(np.frombuffer(mv, np.uint8).ctypes.data) if mv.nbytes else 0


class RawBuffer:
  """Opaque handle to host-visible memory. `size` is in bytes; `ptr` the address kernels take (stable for the buffer's life)."""
  Cpu: ClassVar[type[CpuBuffer]]
  Mmap: ClassVar[type[MmapBuffer]]
  size: int
  cpu_accessible: bool
  device: str
  _ptr: int
  _mem: np.ndarray | None  # flat uint8 array over exactly this buffer's bytes; None once freed

  @property
  def freed(self) -> bool: return self._mem is None
  @property
  def mem(self) -> np.ndarray:
    if self._mem is None: raise KilnBufferError(f"{self!r} was freed and cannot be used")
    return self._mem
  @property
  def ptr(self) -> int:
    if self._mem is None: raise KilnBufferError(f"{self!r} was freed and has no address")
    return self._ptr
  @property
  def nbytes(self) -> int: return self.size
  @property
  def readonly(self) -> bool: return False

  def as_numpy(self, dtype: Any = np.uint8, count: int | None = None, offset: int = 0) -> np.ndarray:
    """A zero-copy 1-d view of `count` elements (default: as many as fit) of `dtype` starting at byte `offset`."""
    dt, mem = to_np_dtype(dtype), self.mem
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0 or offset > self.size:
      raise KilnBufferError(f"view offset {offset!r} is outside {self!r} (size {self.size} bytes)")
    if count is None: count = (self.size - offset) // dt.itemsize
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
      raise KilnBufferError(f"view count must be a non-negative int, got {count!r}")
    if offset + count * dt.itemsize > self.size:
      raise KilnBufferError(f"view of {count} x {dt} ({count * dt.itemsize} bytes) at offset {offset} overruns {self!r} (size {self.size} bytes)")
    return np.frombuffer(mem, dt, int(count), int(offset))

  def memoryview(self) -> memoryview: return self.mem.data

  def copyin(self, src: Any) -> None:
    """Copy exactly `size` bytes from a buffer-protocol object into this buffer."""
    if self.readonly: raise KilnBufferError(f"cannot write to {self!r}: the DISK device is read-only")
    mv = _src_bytes(src, "copyin source")
    if mv.nbytes != self.size: raise KilnBufferError(f"copyin size mismatch: source has {mv.nbytes} bytes, {self!r} has {self.size}")
    ctypes.memmove(self.ptr, _addr(mv), self.size)  # a ctypes call drops the GIL: big copies don't stall other threads

  def copyout(self, dest: Any) -> None:
    """Copy exactly `size` bytes from this buffer into a writable buffer-protocol object."""
    mv = _src_bytes(dest, "copyout destination")
    if mv.readonly: raise KilnBufferError(f"copyout destination is read-only ({mv.nbytes} bytes)")
    if mv.nbytes != self.size: raise KilnBufferError(f"copyout size mismatch: destination has {mv.nbytes} bytes, {self!r} has {self.size}")
    ctypes.memmove(_addr(mv), self.ptr, self.size)

  def free(self) -> None:
    """Drop this handle's hold on the memory. It is released now unless a numpy view still holds it (then when the view dies)."""
    self._mem = None


class CpuBuffer(RawBuffer):
  """`RawBuffer.Cpu`: `size` bytes of zeroed host memory whose address is a multiple of 64 and never moves."""
  cpu_accessible = True
  device = "CPU"

  def __init__(self, size: int):
    self.size = check_size(size)
    # over-allocate by ALIGN and slice: np.zeros is calloc, so big buffers come as fresh zero pages with no memset and no copy;
    # freeing drops the last ref to the base array, which returns the memory to the OS/malloc
    base = np.zeros(self.size + ALIGN, np.uint8)
    off = -base.ctypes.data % ALIGN
    self._mem = base[off:off + self.size]
    self._ptr = int(self._mem.ctypes.data)

  def zero(self) -> None: ctypes.memset(self.ptr, 0, self.size)
  def __repr__(self) -> str: return f"RawBuffer.Cpu(size={self.size}, ptr={self._ptr:#x}{', freed' if self._mem is None else ''})"


class MmapBuffer(RawBuffer):
  """`RawBuffer.Mmap`: a read-only map of bytes [offset, offset+size) of a file (the DISK:/path device). size=None maps to the end."""
  cpu_accessible = True

  def __init__(self, path: str | os.PathLike[str], offset: int = 0, size: int | None = None):
    self.path, self.device = os.fspath(path), f"DISK:{os.fspath(path)}"
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
      raise KilnBufferError(f"{self.device}: offset must be a non-negative int, got {offset!r}")
    fd = open_regular(self.path, f"{self.device}: the file to map", KilnBufferError)
    try:
      flen = os.fstat(fd).st_size
      if size is None:
        if offset >= flen: raise KilnBufferError(f"{self.device}: nothing to map at offset {offset}: file length is {flen} bytes")
        size = flen - offset
      self.offset, self.size, self.file_length = int(offset), check_size(size, f"{self.device}: region size"), flen
      if self.offset + self.size > flen:
        raise KilnBufferError(f"{self.device}: region offset={self.offset} size={self.size} (end {self.offset + self.size}) "
                              f"is larger than the file (length {flen} bytes)")
      # mmap offsets must sit on the allocation granularity: map from the boundary below and skip `delta` bytes
      delta = self.offset % mmap.ALLOCATIONGRANULARITY
      self._map = mmap.mmap(fd, delta + self.size, access=mmap.ACCESS_READ, offset=self.offset - delta)
    finally: os.close(fd)  # mmap keeps its own duplicate of the descriptor
    self._mem = np.frombuffer(self._map, np.uint8, self.size, delta)  # read-only: the map is PROT_READ
    self._ptr = int(self._mem.ctypes.data)

  @property
  def readonly(self) -> bool: return True
  def memoryview(self) -> memoryview: return self.mem.data.toreadonly()
  def free(self) -> None:
    # the map unmaps when its last user goes: views made by as_numpy keep it alive, so close only when nothing else holds it
    self._mem, m = None, getattr(self, "_map", None)
    if m is not None:
      try: m.close()
      except BufferError: pass  # a numpy view still references the map; it unmaps when that view dies
  def __repr__(self) -> str: return f"RawBuffer.Mmap({self.device}, offset={self.offset}, size={self.size}{', freed' if self._mem is None else ''})"


RawBuffer.Cpu, RawBuffer.Mmap = CpuBuffer, MmapBuffer
