"""CPUAllocator: aligned host buffers with an LRU cache of freed ones, so a plan that frees and re-allocates the same sizes
pays for allocation (and page faults) once."""
from __future__ import annotations

import dataclasses
import errno
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir.errors import KilnBufferError
from kiln.runtime.cpu.buffer import CpuBuffer, OutOfMemoryError, RawBuffer, check_size
from kiln.runtime.cpu.guard import GuardedBuffer, guard_enabled


@dataclass(frozen=True)
class BufferOptions:
  """How to allocate. nolru: never take from or give back to the LRU cache. zero: a buffer reused from the cache is re-zeroed
  (fresh memory is always zero); set False when the caller overwrites it anyway."""
  nolru: bool = False
  zero: bool = True

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      if not isinstance(v := getattr(self, f.name), bool): raise KilnBufferError(f"BufferOptions.{f.name} must be a bool, got {v!r}")

  @staticmethod
  def of(options: Any) -> BufferOptions:
    """None, a BufferOptions, a dict of its fields, or any object with some of its fields as attributes."""
    if options is None: return _DEFAULT
    if isinstance(options, BufferOptions): return options
    if isinstance(options, dict):
      if bad := set(options) - _FIELDS: raise KilnBufferError(f"unknown buffer options {sorted(bad)}; known: {sorted(_FIELDS)}")
      return BufferOptions(**options)
    if any(hasattr(options, f) for f in _FIELDS): return BufferOptions(**{f: getattr(options, f) for f in _FIELDS if hasattr(options, f)})
    raise KilnBufferError(f"buffer options must be BufferOptions, a dict or None, got {type(options).__name__} {options!r}")

  @property
  def cache_key(self) -> BufferOptions:
    # nolru and zero say how to serve a request, not what the memory is: buffers freed under any of them are interchangeable
    return _DEFAULT


_DEFAULT = BufferOptions()
_MAX_ALLOC = sys.maxsize - (1 << 20)  # room for ALIGN and a guarded buffer's pages
_FIELDS = frozenset(f.name for f in dataclasses.fields(BufferOptions))
CacheKey = tuple[int, BufferOptions]


class CPUAllocator:
  """The CPU `Allocator`: handles are `RawBuffer.Cpu`. Freed buffers wait in an LRU cache keyed by (size, options), at most
  `lru_per_key` per key and `lru_max_bytes` in all; a MemoryError flushes the cache and retries once. Thread-safe."""

  def __init__(self, lru_per_key: int = 8, lru_max_bytes: int = 1 << 30):
    if lru_per_key < 0 or lru_max_bytes < 0: raise KilnBufferError(f"LRU bounds must be >= 0, got per_key={lru_per_key} max_bytes={lru_max_bytes}")
    self.lru_per_key, self.lru_max_bytes = lru_per_key, lru_max_bytes
    self._lock = threading.Lock()
    self._cache: dict[CacheKey, list[CpuBuffer]] = {}  # per key, oldest first
    self._order: OrderedDict[int, tuple[CacheKey, CpuBuffer]] = OrderedDict()  # id -> entry, least recently freed first
    self.cached_bytes, self.hits, self.misses, self.flushes = 0, 0, 0, 0

  # ---- the Allocator protocol ----
  def alloc(self, size: int, options: Any = None) -> CpuBuffer:
    size, opts = check_size(size), BufferOptions.of(options)
    if not opts.nolru:
      with self._lock:
        buf = self._take((size, opts.cache_key))
        if buf is None: self.misses += 1
        else: self.hits += 1
      if buf is not None:
        if opts.zero: buf.zero()  # outside the lock: a big memset must not stall other threads' allocations
        return buf
    if size > _MAX_ALLOC:  # numpy would raise ValueError and mmap OverflowError: no address space holds it
      raise OutOfMemoryError(f"cannot allocate a CPU buffer of {size} bytes: larger than the address space")
    if (fresh := self._try_alloc(size, opts)) is not None: return fresh
    released = self.flush()  # cached buffers may be exactly what the OS is missing
    if (fresh := self._try_alloc(size, opts)) is not None: return fresh
    raise OutOfMemoryError(f"cannot allocate a CPU buffer of {size} bytes: out of memory even after flushing {released} cached bytes "
                           "and retrying once")

  def _try_alloc(self, size: int, opts: BufferOptions) -> CpuBuffer | None:
    """A fresh buffer, or None when the memory is not there (a guarded buffer's mapping refused with ENOMEM included)."""
    try: return self._alloc_raw(size, opts)
    except MemoryError: return None
    except OSError as e:
      if e.errno == errno.ENOMEM: return None
      raise

  def free(self, handle: RawBuffer, size: int | None = None, options: Any = None) -> None:
    buf, opts = self._check(handle), BufferOptions.of(options)
    if size is not None and size != buf.size: raise KilnBufferError(f"free of {buf!r} with size {size}: the buffer has {buf.size} bytes")
    if buf.freed: raise KilnBufferError(f"double free of {buf!r}")
    if opts.nolru or not isinstance(buf, CpuBuffer) or buf.size > self.lru_max_bytes or self.lru_per_key == 0: return buf.free()
    key, evicted = (buf.size, opts.cache_key), []
    with self._lock:
      if id(buf) in self._order: raise KilnBufferError(f"double free of {buf!r}: it is already in the allocator's cache")
      lst = self._cache.setdefault(key, [])
      lst.append(buf)
      self._order[id(buf)] = (key, buf)
      self.cached_bytes += buf.size
      if len(lst) > self.lru_per_key: evicted.append(self._remove(key, lst[0]))
      while self.cached_bytes > self.lru_max_bytes: evicted.append(self._remove(*next(iter(self._order.values()))))
    for b in evicted: b.free()  # release outside the lock

  def ptr(self, handle: RawBuffer) -> int: return self._check(handle).ptr
  def copyin(self, dest: RawBuffer, src: memoryview) -> None: self._check(dest).copyin(src)
  def copyout(self, dest: memoryview, src: RawBuffer) -> None: self._check(src).copyout(dest)
  def as_numpy(self, handle: RawBuffer, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
    return self._check(handle).as_numpy(dtype, count, offset)

  # ---- cache ----
  def flush(self) -> int:
    """Release every cached buffer; returns the bytes released."""
    with self._lock:
      bufs = [b for _, b in self._order.values()]
      self._cache.clear(); self._order.clear()
      released, self.cached_bytes = self.cached_bytes, 0
      if bufs: self.flushes += 1
    for b in bufs: b.free()
    return released

  def cached(self, size: int | None = None) -> int:
    """How many freed buffers wait in the cache (of `size` bytes, or in all)."""
    with self._lock: return len(self._order) if size is None else sum(len(v) for k, v in self._cache.items() if k[0] == size)

  def _alloc_raw(self, size: int, opts: BufferOptions) -> CpuBuffer:
    # the one place memory is made (tests patch it); KILN_GUARD=1 puts every buffer between inaccessible pages
    return GuardedBuffer(size) if guard_enabled() else RawBuffer.Cpu(size)

  def _take(self, key: CacheKey) -> CpuBuffer | None:
    if not (lst := self._cache.get(key)): return None
    return self._remove(key, lst[-1])  # the most recently freed: its pages are the likeliest to be warm

  def _remove(self, key: CacheKey, buf: CpuBuffer) -> CpuBuffer:
    lst = self._cache[key]
    lst.remove(buf)
    if not lst: del self._cache[key]
    del self._order[id(buf)]
    self.cached_bytes -= buf.size
    return buf

  @staticmethod
  def _check(handle: Any) -> RawBuffer:
    if not isinstance(handle, RawBuffer): raise KilnBufferError(f"expected a RawBuffer handle, got {type(handle).__name__} {handle!r}")
    return handle
