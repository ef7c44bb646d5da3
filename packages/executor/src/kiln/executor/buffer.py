"""Buffer: typed device memory, allocated lazily, with views sharing storage, exact-size copies, numpy and DLPack.

A Buffer is `size` elements of `dtype` on `device`. Its memory (a `Storage`) comes from the device runtime's allocator
the first time it is needed, or wraps a host numpy array (`from_numpy`, zero-copy on the CPU). A view has its own id and
shares its base's storage (and `storage_id`); hazard tracking works on storage byte ranges.
"""
from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import DeviceSpec
from kiln.ir.dtype import DType, DTypeLike, dtypes, to_dtype
from kiln.ir.errors import KilnBufferError
from kiln.ir.files import open_regular

_ids = itertools.count()
_ids_lock = threading.Lock()


def _next_id() -> int:
  with _ids_lock: return next(_ids)


def buffer_dtype(dt: DTypeLike) -> DType:
  """A buffer's dtype (kiln.ir.dtype.to_dtype's conversion): one scalar value, else a KilnBufferError."""
  d = to_dtype(dt)
  if d.kind in "vp" or d.count != 1: raise KilnBufferError(f"a buffer needs a scalar value dtype, got {dt!r}")
  return d


class Storage:
  """The memory behind one or more Buffers: a device allocation, or a wrapped host numpy array (zero-copy)."""
  __slots__ = ("id", "device", "nbytes", "options", "handle", "allocator", "external", "readonly", "_lock", "_host", "__weakref__")

  def __init__(self, device: str, nbytes: int, options: Any = None, external: np.ndarray | None = None, readonly: bool = False):
    self.id, self.device, self.nbytes, self.options = _next_id(), device, nbytes, options
    self.handle: Any = None
    self.allocator: Any = None
    self.external = external  # a 1-d uint8 host array we keep alive
    self.readonly = readonly or device.startswith("DISK")  # DISK is a read-only file mapping
    self._lock = threading.Lock()
    self._host: np.ndarray | None | bool = False  # False: not asked yet

  @property
  def allocated(self) -> bool: return self.handle is not None or self.external is not None

  def ensure(self) -> Storage:
    if self.handle is None and self.external is None:
      with self._lock:
        if self.handle is None:
          alloc = get_runtime(self.device).allocator
          self.handle, self.allocator = alloc.alloc(self.nbytes, self.options), alloc
    return self

  @property
  def ptr(self) -> int:
    self.ensure()
    if self.external is not None: return int(self.external.ctypes.data)
    return int(self.allocator.ptr(self.handle))

  def host_array(self) -> np.ndarray | None:
    """A zero-copy uint8 view of all of it, or None when the memory is not host-visible."""
    self.ensure()
    if self.external is not None: return self.external
    if self._host is False: self._host = self.allocator.as_numpy(self.handle, np.uint8, self.nbytes, 0)
    if (arr := self._host) is None: return None
    assert isinstance(arr, np.ndarray)
    return np.asarray(KeepAlive(arr, self))  # the array's base holds this storage, so it outlives every Buffer

  def __del__(self) -> None:
    if self.handle is not None and self.allocator is not None:
      try: self.allocator.free(self.handle, self.nbytes, self.options)
      except Exception: pass  # noqa: S110  (interpreter shutdown: the allocator may already be gone)
      self.handle, self._host = None, False


class KeepAlive:
  """Exposes an array's memory through __array_interface__ while holding a reference to the owning storage."""
  __slots__ = ("__array_interface__", "array", "_owner")

  def __init__(self, arr: np.ndarray, owner: Any):
    self.__array_interface__, self.array, self._owner = arr.__array_interface__, arr, owner


def base_chain(obj: Any) -> Iterator[Any]:
  """obj, then what its memory belongs to, outward: numpy bases, memoryview owners, a storage's KeepAlive and its array
  (at most 64 steps)."""
  for _ in range(64):
    if obj is None: return
    yield obj
    obj = obj.obj if isinstance(obj, memoryview) else obj.array if isinstance(obj, KeepAlive) else getattr(obj, "base", None)


def _bytes_of(data: Any, dtype: DType | None = None, what: str = "copyin") -> np.ndarray:
  """The raw bytes of host data. A numpy array must hold `dtype`'s storage type (or be raw uint8 bytes): a float64 array copied
  into a float32 buffer of the same byte size is a mistake, not a bit pattern to keep."""
  if isinstance(data, np.ndarray):
    if dtype is not None and data.dtype not in (np.dtype(np.uint8), dtype.np):
      raise KilnBufferError(f"{what} of a numpy {data.dtype} array into a {dtype.name} buffer (storage {dtype.np}): convert it first "
                            f"(arr.astype(np.{dtype.np})) or pass raw bytes (arr.view(np.uint8))")
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  try: return np.frombuffer(memoryview(data).cast("B"), np.uint8)
  except (TypeError, ValueError) as e:
    raise KilnBufferError(f"{what} needs a numpy array or a bytes-like object, got {type(data).__name__} ({e})") from None


def _mv(a: np.ndarray) -> memoryview: return memoryview(a)  # type: ignore[arg-type]


class Buffer:
  """`size` elements of `dtype` on `device`; memory is allocated on first use (`ensure_allocated`, `ptr`, copies)."""

  def __init__(self, device: str | DeviceSpec, size: int, dtype: DType | str | Any, *, options: Any = None,
               _storage: Storage | None = None, _offset: int = 0, _base: Buffer | None = None):
    if not isinstance(size, int) or isinstance(size, bool) or size < 1: raise KilnBufferError(f"buffer size must be a positive int, got {size!r}")
    self.device = str(DeviceSpec.parse(device))
    self.dtype, self.size, self.id = buffer_dtype(dtype), size, _next_id()
    self.offset = _offset  # bytes into the storage
    self.base: Buffer | None = _base
    self._storage = _storage if _storage is not None else Storage(self.device, self.nbytes, options)

  # ---- identity and shape ----
  @property
  def nbytes(self) -> int: return self.size * self.dtype.itemsize
  @property
  def storage(self) -> Storage: return self._storage
  @property
  def storage_id(self) -> int: return self._storage.id
  @property
  def byte_range(self) -> tuple[int, int]: return self.offset, self.offset + self.nbytes
  @property
  def is_allocated(self) -> bool: return self._storage.allocated
  @property
  def readonly(self) -> bool: return self._storage.readonly
  @property
  def is_view(self) -> bool: return self.base is not None
  def __len__(self) -> int: return self.size
  def __repr__(self) -> str:
    v = f", view of {self.base.id} at byte {self.offset}" if self.base is not None else ""
    return f"<Buffer {self.id} {self.device} {self.dtype.name}[{self.size}]{v}{', allocated' if self.is_allocated else ''}>"

  def ensure_allocated(self) -> Buffer:
    self._storage.ensure()
    return self

  @property
  def ptr(self) -> int:
    """The device address a kernel takes (allocates on first use)."""
    return self._storage.ptr + self.offset

  def view(self, offset: int, size: int, dtype: DType | str | Any = None) -> Buffer:
    """A Buffer of `size` elements (of `dtype`, default this buffer's) starting `offset` bytes in, sharing this storage."""
    dt = self.dtype if dtype is None else buffer_dtype(dtype)
    if not isinstance(offset, int) or offset < 0: raise KilnBufferError(f"view offset must be an int >= 0 bytes, got {offset!r}")
    if not isinstance(size, int) or size < 1: raise KilnBufferError(f"view size must be a positive int, got {size!r}")
    if offset + size * dt.itemsize > self.nbytes:
      raise KilnBufferError(f"view of {size} x {dt.name} ({size * dt.itemsize} bytes) at byte {offset} runs past the end of "
                            f"buffer {self.id} ({self.nbytes} bytes)")
    root = self.base if self.base is not None else self
    return Buffer(self.device, size, dt, _storage=self._storage, _offset=self.offset + offset, _base=root)

  def _rebind(self, storage: Storage, offset: int = 0) -> None:
    """Point this buffer at other storage (the plan's memory planner reuses intermediates' memory)."""
    self._storage, self.offset = storage, offset

  # ---- host access ----
  def _host_bytes(self) -> np.ndarray | None:
    arr = self._storage.host_array()
    return None if arr is None else arr[self.offset:self.offset + self.nbytes]

  def host_view(self) -> np.ndarray | None:
    """The contents as a zero-copy 1-d numpy array of its storage type (writes go to the buffer), or None when the memory is
    not host-visible (a device buffer: copyin/copyout then)."""
    raw = self._host_bytes()
    return None if raw is None else raw.view(self.dtype.np)

  def numpy(self) -> np.ndarray:
    """The contents as a 1-d numpy array: zero-copy (writes go to the buffer) when the memory is host-visible, else a copy."""
    raw = self._host_bytes()
    if raw is None: raw = self.copyout(np.empty(self.nbytes, dtype=np.uint8))
    return raw.view(self.dtype.np)

  def copyin(self, data: Any) -> Buffer:
    """Copy host data (numpy array, bytes, memoryview) in; it must be exactly `nbytes` bytes."""
    if self.readonly: raise KilnBufferError(f"buffer {self.id} is read-only (it wraps read-only memory)")
    src = _bytes_of(data, self.dtype)
    if src.nbytes != self.nbytes:
      raise KilnBufferError(f"copyin of {src.nbytes} bytes into buffer {self.id} of {self.nbytes} bytes ({self.size} x {self.dtype.name})")
    if (raw := self._host_bytes()) is not None: np.copyto(raw, src)
    elif self.offset == 0 and self.nbytes == self._storage.nbytes: self._storage.allocator.copyin(self._storage.handle, _mv(src))
    else:  # a view of device memory: read-modify-write the whole storage through the host
      whole = np.empty(self._storage.nbytes, np.uint8)
      self._storage.allocator.copyout(_mv(whole), self._storage.handle)
      whole[self.offset:self.offset + self.nbytes] = src
      self._storage.allocator.copyin(self._storage.handle, _mv(whole))
    return self

  def copyout(self, dest: Any) -> Any:
    """Copy the contents out into `dest` (a writable numpy array or buffer of exactly `nbytes` bytes); returns dest."""
    out = dest.reshape(-1).view(np.uint8) if isinstance(dest, np.ndarray) else np.frombuffer(memoryview(dest).cast("B"), np.uint8)  # type: ignore[arg-type]
    if out.nbytes != self.nbytes:
      raise KilnBufferError(f"copyout of buffer {self.id} ({self.nbytes} bytes, {self.size} x {self.dtype.name}) into {out.nbytes} bytes")
    if not out.flags.writeable: raise KilnBufferError("copyout destination is read-only")
    if (raw := self._host_bytes()) is not None: np.copyto(out, raw)
    elif self.offset == 0 and self.nbytes == self._storage.nbytes: self._storage.allocator.copyout(_mv(out), self._storage.ensure().handle)
    else:
      whole = np.empty(self._storage.nbytes, np.uint8)
      self._storage.allocator.copyout(_mv(whole), self._storage.ensure().handle)
      out[:] = whole[self.offset:self.offset + self.nbytes]
    return dest

  def copy_from(self, src: Buffer) -> Buffer:
    """Copy another buffer's bytes into this one (same byte size; across devices through the host)."""
    copy_buffer(self, src)
    return self

  # ---- construction from host data ----
  @staticmethod
  def from_numpy(arr: Any, device: str | DeviceSpec = "CPU", dtype: DType | str | None = None) -> Buffer:
    """A Buffer with arr's contents. On the CPU a C-contiguous array is wrapped without a copy (the buffer keeps it alive)."""
    a = np.asarray(arr)
    dt = buffer_dtype(dtype) if dtype is not None else dtypes.from_numpy(a.dtype)
    if a.dtype.itemsize != dt.itemsize: raise KilnBufferError(f"numpy dtype {a.dtype} does not store kiln dtype {dt.name}")
    n = a.size
    if n == 0: raise KilnBufferError("cannot make a buffer from an empty array")
    dev = str(DeviceSpec.parse(device))
    if dev == "CPU" and a.flags.c_contiguous and a.ctypes.data % dt.itemsize == 0:  # kernels assume element-aligned buffers
      raw = a.reshape(-1).view(np.uint8)
      return Buffer(dev, n, dt, _storage=Storage(dev, raw.nbytes, external=raw, readonly=not a.flags.writeable))
    return Buffer(dev, n, dt).copyin(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # a misaligned array is copied into aligned memory

  @staticmethod
  def from_npy(path: str | os.PathLike) -> Buffer:
    """The array in a .npy file as a read-only DISK buffer (mmap, no read until used); add_copy it to the CPU to compute on it."""
    p = os.fspath(path)
    with os.fdopen(open_regular(p, ".npy file", KilnBufferError), "rb") as f:
      try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dt = read(f, max_header_size=1 << 20)
      except (ValueError, OSError, SyntaxError, KeyError, TypeError) as e: raise KilnBufferError(f"{p} is not a readable .npy file: {e}") from None
      offset = f.tell()
    if fortran and len(shape) > 1: raise KilnBufferError(f"{p}: Fortran-ordered arrays are not supported; save it C-ordered")
    n = int(np.prod(shape)) if shape else 1
    return Buffer(f"DISK:{os.path.abspath(p)}", n, dtypes.from_numpy(dt), options={"offset": offset})

  @staticmethod
  def from_dlpack(x: Any, device: str | DeviceSpec = "CPU") -> Buffer:
    """Import any DLPack producer (numpy, PyTorch, JAX, ...) on the host without a copy."""
    return Buffer.from_numpy(np.from_dlpack(x), device)

  # ---- DLPack export (numpy does the capsule work) ----
  def __dlpack__(self, **kw: Any) -> Any:
    raw = self._host_bytes()
    if raw is None: raise KilnBufferError(f"buffer {self.id} on {self.device} is not host-visible; copy it to the CPU to export it with DLPack")
    return raw.view(self.dtype.np).__dlpack__(**{k: v for k, v in kw.items() if v is not None})

  def __dlpack_device__(self) -> tuple[int, int]:
    if self._host_bytes() is None: raise KilnBufferError(f"buffer {self.id} on {self.device} is not host-visible")
    return (1, 0)  # kDLCPU

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    a = self.numpy()
    return a.astype(dtype) if dtype is not None else (a.copy() if copy else a)


def copy_buffer(dst: Buffer, src: Buffer) -> None:
  """dst <- src, byte for byte. Sizes must match exactly; different devices go through the host."""
  if dst.nbytes != src.nbytes:
    raise KilnBufferError(f"copy between buffers of different sizes: dst {dst.id} has {dst.nbytes} bytes ({dst.size} x {dst.dtype.name}), "
                          f"src {src.id} has {src.nbytes} bytes ({src.size} x {src.dtype.name})")
  if dst.readonly: raise KilnBufferError(f"copy into read-only buffer {dst.id}")
  s = src._host_bytes()
  if s is not None: dst.copyin(s)
  else: dst.copyin(src.copyout(np.empty(src.nbytes, np.uint8)))
