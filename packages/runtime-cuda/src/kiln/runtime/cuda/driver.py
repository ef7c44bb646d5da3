"""The CUDA runtime over pycuda.driver (the `driver` extra), imported lazily: without pycuda or a CUDA driver this module still
imports, and constructing the runtime or launching raises a DeviceError that says what to install.

NOTE: nothing here has run on a real GPU yet; the launch path is tested against a recording stand-in for pycuda.driver.
"""
from __future__ import annotations

import importlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.codegen.spec import CompiledSpec, DeviceSpec, sym_eval
from kiln.ir.errors import DeviceError, RuntimeLaunchError
from kiln.runtime.cuda.compiler import CUDACompiler

INSTALL_HINT = 'pip install "kiln-runtime-cuda[driver]"'
MAX_BLOCK_THREADS = 1024
_drv_lock = threading.Lock()


def load_driver() -> Any:
  """pycuda.driver, initialised; a DeviceError naming the fix when pycuda or the CUDA driver is missing."""
  with _drv_lock:
    try: drv = importlib.import_module("pycuda.driver")
    except ImportError as e:
      missing = getattr(e, "name", None) in ("pycuda", "pycuda.driver") and "libcuda" not in str(e)
      why = "pycuda is not installed" if missing else f"pycuda could not load the CUDA driver ({e})"
      raise DeviceError(f"CUDA launch needs pycuda and an NVIDIA driver: {why}. Install it with {INSTALL_HINT} on a machine with a "
                        "CUDA driver (libcuda.so); compiling to PTX/cubin and the CPU emulation harness work without it") from None
    try: drv.init()
    except Exception as e:
      raise DeviceError(f"no CUDA driver was found or it failed to initialise ({e}); {INSTALL_HINT} needs an NVIDIA GPU and driver") from None
    return drv


# ---- memory ----
@dataclass(frozen=True)
class CUDABuffer:
  """Device memory: `base` keeps the pycuda allocation alive (shared by views), `ptr` is the address a kernel takes."""
  base: Any
  ptr: int
  size: int

  def __int__(self) -> int: return self.ptr


class CUDAAllocator:
  """Device allocations with an LRU cache of freed blocks (reused by exact size; flushed when memory runs out)."""

  def __init__(self, drv: Any, ctx: Any = None, cache_bytes: int | None = None):
    self.drv, self.ctx = drv, ctx
    self.cache_limit = cache_bytes if cache_bytes is not None else int(os.environ.get("KILN_CUDA_LRU_BYTES", 1 << 30))
    self._cache: OrderedDict[int, list[Any]] = OrderedDict()  # size -> freed allocations, least recently freed first
    self.cached_bytes = 0
    self._lock = threading.Lock()

  def alloc(self, size: int, options: Any = None) -> CUDABuffer:
    if size <= 0: raise DeviceError(f"cannot allocate {size} bytes on the GPU")
    with self._lock:
      if (lst := self._cache.get(size)):
        mem = lst.pop()
        if not lst: del self._cache[size]
        self.cached_bytes -= size
        return CUDABuffer(mem, int(mem), size)
    try: mem = self.drv.mem_alloc(size)
    except Exception:  # out of memory (pycuda.driver.MemoryError): give the cached blocks back and retry once
      self.free_cache()
      try: mem = self.drv.mem_alloc(size)
      except Exception as e: raise DeviceError(f"GPU out of memory allocating {size} bytes: {e}") from e
    return CUDABuffer(mem, int(mem), size)

  def free(self, handle: CUDABuffer, size: int, options: Any = None) -> None:
    if handle.base is None or handle.ptr != int(handle.base): return  # a view owns nothing
    with self._lock:
      self._cache.setdefault(size, []).append(handle.base)
      self._cache.move_to_end(size)
      self.cached_bytes += size
      while self.cached_bytes > self.cache_limit and self._cache:
        sz, lst = next(iter(self._cache.items()))
        lst.pop(0).free()
        self.cached_bytes -= sz
        if not lst: del self._cache[sz]

  def free_cache(self) -> None:
    with self._lock:
      for lst in self._cache.values():
        for m in lst: m.free()
      self._cache.clear()
      self.cached_bytes = 0

  def ptr(self, handle: CUDABuffer) -> int: return handle.ptr
  def view(self, handle: CUDABuffer, offset: int, size: int) -> CUDABuffer:
    if offset < 0 or offset + size > handle.size: raise DeviceError(f"view [{offset}, {offset + size}) is outside a {handle.size}-byte buffer")
    return CUDABuffer(handle.base, handle.ptr + offset, size)
  def copyin(self, dest: CUDABuffer, src: memoryview) -> None: self.drv.memcpy_htod(dest.ptr, src)
  def copyout(self, dest: memoryview, src: CUDABuffer) -> None: self.drv.memcpy_dtoh(dest, src.ptr)
  def copy(self, dest: CUDABuffer, src: CUDABuffer, size: int) -> None: self.drv.memcpy_dtod(dest.ptr, src.ptr, size)
  def as_numpy(self, handle: Any, dtype: Any, count: int, offset: int = 0) -> None: return None  # device memory is not host-visible


# ---- programs ----
def launch_dims(spec: CompiledSpec, vals: Sequence[int], global_size: Sequence[Any] | None = None,
                local_size: Sequence[Any] | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
  """(grid, block): the given sizes, or the spec's (symbolic) sizes, evaluated with vals in var_names order."""
  var_vals = dict(zip(spec.var_names, (int(v) for v in vals)))
  gs = global_size if global_size is not None else (spec.global_size or (1, 1, 1))
  ls = local_size if local_size is not None else (spec.local_size or (1, 1, 1))
  grid, block = (tuple(sym_eval(x, var_vals) for x in s) + (1,) * (3 - len(s)) for s in (gs, ls))
  if len(grid) != 3 or len(block) != 3 or min(grid) < 0 or min(block) < 1:  # a grid dim of 0 (a symbolic size bound to 0): nothing runs
    raise RuntimeLaunchError(f"kernel {spec.name}: launch sizes must be 3 ints, the grid's >= 0 and the block's >= 1, got grid {grid} block {block}")
  if block[0] * block[1] * block[2] > MAX_BLOCK_THREADS:
    raise RuntimeLaunchError(f"kernel {spec.name}: block {block} has more than {MAX_BLOCK_THREADS} threads")
  return grid, block  # type: ignore[return-value]


class CUDABoundCall:
  """A launch with fixed buffers: argument array and sizes computed once; set_vals swaps the variables (and sizes)."""

  def __init__(self, prog: CUDAProgram, bufs: Sequence[int], vals: Sequence[int], global_size: Sequence[Any] | None,
               local_size: Sequence[Any] | None):
    self.prog, self.bufs = prog, [int(b) for b in bufs]
    self.set_vals(vals, global_size, local_size)

  def set_vals(self, vals: Sequence[int], global_size: Sequence[Any] | None = None, local_size: Sequence[Any] | None = None) -> None:
    self.args = self.prog.args(self.bufs, vals)
    self.grid, self.block = launch_dims(self.prog.spec, vals, global_size, local_size)

  def __call__(self) -> None:
    if 0 not in self.grid: self.prog.fn.prepared_call(self.grid, self.block, *self.args)


class CUDAProgram:
  """A kernel loaded from cubin bytes. bufs are device addresses in globals order, vals int32 in var_names order."""

  def __init__(self, runtime: CUDARuntime, spec: CompiledSpec):
    if not spec.bytes: raise RuntimeLaunchError(f"kernel {spec.name}: no cubin in the CompiledSpec (compile it with CUDACompiler)")
    self.runtime, self.spec, self.name, self.drv = runtime, spec, spec.name, runtime.drv
    runtime.make_current()
    self.module = self.drv.module_from_buffer(spec.bytes)
    self.fn = self.module.get_function(spec.name)
    self.fn.prepare("P" * spec.buf_count + "i" * len(spec.var_names))  # pointers, then int32 variables

  def args(self, bufs: Sequence[int], vals: Sequence[int]) -> tuple:
    if len(bufs) != self.spec.buf_count: raise RuntimeLaunchError(f"kernel {self.name} takes {self.spec.buf_count} buffers, got {len(bufs)}")
    if len(vals) != len(self.spec.var_names):
      raise RuntimeLaunchError(f"kernel {self.name} takes vals for {self.spec.var_names}, got {len(vals)} values")
    for n, v in zip(self.spec.var_names, vals):
      if not -(2**31) <= int(v) < 2**31: raise RuntimeLaunchError(f"kernel {self.name}: variable {n}={v} does not fit int32")
    return (*[np.uintp(int(b)) for b in bufs], *[np.int32(int(v)) for v in vals])

  def __call__(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[Any] | None = None,
               local_size: Sequence[Any] | None = None, wait: bool = False) -> float | None:
    """Launch; global_size/local_size default to the spec's sizes evaluated with vals. With wait=True, the kernel's time in
    seconds (CUDA events)."""
    args = self.args(bufs, vals)
    grid, block = launch_dims(self.spec, vals, global_size, local_size)
    if 0 in grid: return 0.0 if wait else None  # an empty grid: nothing to run (CUDA rejects a launch of 0 blocks)
    self.runtime.make_current()
    if not wait:
      self.fn.prepared_call(grid, block, *args)
      return None
    start, end = self.drv.Event(), self.drv.Event()
    start.record()
    self.fn.prepared_call(grid, block, *args)
    end.record()
    end.synchronize()
    return start.time_till(end) * 1e-3

  def bind(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[Any] | None = None,
           local_size: Sequence[Any] | None = None) -> CUDABoundCall:
    return CUDABoundCall(self, bufs, vals, global_size, local_size)


class CUDARuntime:
  """One NVIDIA GPU: renderer (kiln.codegen.render.cuda.CUDARenderer), CUDACompiler for its architecture, allocator, loader."""
  host_parallel_safe = False  # one stream: kernels are ordered by the device, not overlapped from host threads

  def __init__(self, device: DeviceSpec | str = "CUDA:0"):
    spec = DeviceSpec.parse(device)
    if spec.kind != "CUDA": raise DeviceError(f"CUDARuntime runs CUDA devices, not {spec}")
    self.device_spec, self.device = spec, str(spec)
    self.drv = load_driver()
    if spec.index >= (n := self.drv.Device.count()): raise DeviceError(f"no device {spec}: this machine has {n} CUDA device(s)")
    self.dev = self.drv.Device(spec.index)
    self.ctx = self.dev.retain_primary_context()
    self.ctx.push()
    major, minor = self.dev.compute_capability()
    self.arch = os.environ.get("KILN_CUDA_ARCH") or f"sm_{major}{minor}"  # cubin for this GPU unless told otherwise
    self.compiler = CUDACompiler(self.arch)
    self.allocator = CUDAAllocator(self.drv, self.ctx)
    self._renderer: Any = None

  @property
  def renderer(self) -> Any:
    if self._renderer is None:
      # imported when first needed (a runtime that only runs compiled specs never renders); kiln-codegen is a hard dependency
      self._renderer = importlib.import_module("kiln.codegen.render.cuda").CUDARenderer()
    return self._renderer

  def make_current(self) -> None:
    # pycuda contexts are per host thread: push ours on a thread that has none
    if self.drv.Context.get_current() is None: self.ctx.push()

  def load(self, compiled: CompiledSpec) -> CUDAProgram: return CUDAProgram(self, compiled)

  def synchronize(self) -> None:
    self.make_current()
    self.drv.Context.synchronize()
