"""The DISK:/path device: read-only maps of file regions, and the data region of a .npy file read with no copy."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir.errors import KilnBufferError
from kiln.ir.files import open_regular
from kiln.ir.npy import read_header
from kiln.runtime.cpu.buffer import MmapBuffer, RawBuffer, check_size


def disk_path(path: Any) -> str:
  """A file path from a path, a "DISK:/path" device string, or a DeviceSpec-like object with a `.path`."""
  if hasattr(path, "path") and not isinstance(path, (str, os.PathLike)): path = path.path
  if path is None: raise KilnBufferError("DISK device needs a file path: DISK:/some/file")
  p = os.fspath(path)
  if p.upper().startswith("DISK:"): p = p[5:]
  if not p: raise KilnBufferError("DISK device needs a file path: DISK:/some/file")
  return p


def open_disk(path: Any, offset: int = 0, size: int | None = None) -> MmapBuffer:
  """Map bytes [offset, offset+size) of a file read-only (size=None: to the end of the file)."""
  return RawBuffer.Mmap(disk_path(path), offset, size)


def npy_region(path: Any) -> tuple[int, int, np.dtype, tuple[int, ...]]:
  """(data offset, data nbytes, dtype, shape) of a C-order .npy file, from its header alone."""
  p = disk_path(path)
  with os.fdopen(open_regular(p, ".npy file", KilnBufferError), "rb") as f:
    try: shape, fortran, dtype = read_header(f)
    except (ValueError, OSError) as e: raise KilnBufferError(f"{p} is not a readable .npy file: {e}") from None
    offset, flen = f.tell(), os.fstat(f.fileno()).st_size
  if dtype.hasobject: raise KilnBufferError(f"{p}: dtype {dtype} holds Python objects, which have no raw bytes to map")
  if fortran and len(shape) > 1:
    raise KilnBufferError(f"{p}: Fortran-order (column-major) arrays are not supported; save it with np.save(path, np.ascontiguousarray(a))")
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if offset + nbytes > flen: raise KilnBufferError(f"{p} is truncated: header says {nbytes} data bytes at offset {offset}, file length is {flen}")
  return offset, nbytes, dtype, tuple(int(s) for s in shape)


def open_npy(path: Any) -> tuple[MmapBuffer, np.dtype, tuple[int, ...]]:
  """The data region of a .npy file as a read-only DISK buffer, with its dtype and shape."""
  offset, nbytes, dtype, shape = npy_region(path)
  if nbytes == 0: raise KilnBufferError(f"{disk_path(path)}: array of shape {shape} has no data to map")
  return open_disk(path, offset, nbytes), dtype, shape


def load_npy(path: Any) -> np.ndarray:
  """A read-only numpy array over a .npy file's mapped data (no copy; the map lives as long as the array)."""
  buf, dtype, shape = open_npy(path)
  return buf.as_numpy(dtype).reshape(shape)


@dataclass(frozen=True)
class DiskOptions:
  """Where a DISK buffer lies in its file: byte `offset` (its size is the alloc size); `path` overrides the allocator's file."""
  offset: int = 0
  path: str | None = None


class DiskAllocator:
  """The DISK device's `Allocator`: `alloc(size, options)` maps a read-only region of the file; writes are errors."""

  def __init__(self, path: Any = None):
    self.path = None if path is None else disk_path(path)

  def alloc(self, size: int, options: Any = None) -> MmapBuffer:
    size = check_size(size, "DISK buffer size")
    if options is None or isinstance(options, int): offset, path = options or 0, self.path
    elif isinstance(options, dict): offset, path = options.get("offset", 0), options.get("path", self.path)
    else: offset, path = getattr(options, "offset", 0), getattr(options, "path", None) or self.path
    if path is None: raise KilnBufferError("DiskAllocator has no file: give DiskAllocator(path) or options with a path")
    return open_disk(path, offset, size)

  def free(self, handle: RawBuffer, size: int | None = None, options: Any = None) -> None:
    if not isinstance(handle, RawBuffer): raise KilnBufferError(f"expected a RawBuffer handle, got {type(handle).__name__}")
    handle.free()

  def ptr(self, handle: RawBuffer) -> int: return handle.ptr
  def copyin(self, dest: RawBuffer, src: memoryview) -> None:
    raise KilnBufferError(f"cannot copy into {dest!r}: the DISK device is read-only")
  def copyout(self, dest: memoryview, src: RawBuffer) -> None: src.copyout(dest)
  def as_numpy(self, handle: RawBuffer, dtype: Any, count: int, offset: int = 0) -> np.ndarray: return handle.as_numpy(dtype, count, offset)
