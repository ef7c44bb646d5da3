"""The CUDA runtime over pycuda.driver (the `driver` extra), imported lazily: without pycuda or a CUDA driver this module still
imports, and constructing the runtime or launching raises a DeviceError that says what to install.

Context discipline (pycuda keeps one context stack per host thread, and aborts the process when a thread or the process ends
with that stack not empty): a runtime never leaves its context pushed. Every piece of driver work -- loading a module, a
launch, an allocation, a free, a copy, a synchronize -- runs inside `with runtime.current():` (`ContextGuard`), which pushes
the runtime's own primary context only when it is not already the current one on this thread and pops exactly what it pushed.
So work from executor worker threads, storage finalisers and LRU eviction on any thread runs in the right context, two GPUs
(one runtime per CUDA:N, each with its own primary context) never share one, and no thread ends with a pushed context. A
caller that issues many calls can wrap them in one `with runtime.current():` so the inner ones cost one comparison; an
ExecutionPlan enters `runtime.session()` (the same guard) once around a run and launches through CUDABoundCall.in_session,
which skips even that comparison (no context check, push or pop per kernel).

pycuda's exceptions are mapped to kiln's: out of memory (pycuda.driver.MemoryError / CUDA_ERROR_OUT_OF_MEMORY) to a
DeviceError saying so, a failed launch to RuntimeLaunchError, anything else to DeviceError naming what was being done. The
sticky errors (an illegal address, an unspecified launch failure, a misaligned address, an illegal instruction, a device-side
assert, a launch time-out) leave the CUDA context unusable: the runtime is marked dead, and every later call raises a
DeviceError saying that the device context is dead and why, instead of a raw pycuda LogicError at some later copy.

NOTE: NONE of this has run on a real GPU. It is written against pycuda 2026.1's source (src/cpp/cuda.hpp,
src/wrapper/wrap_cudadrv.cpp, pycuda/driver.py) and tested against a recording stand-in for pycuda.driver
(tests/test_driver.py) that enforces pycuda's context rules as read from that source.
"""
from __future__ import annotations

import importlib
import os
import struct
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kiln.codegen.spec import CompiledSpec, DeviceSpec, sym_eval, upper_vals
from kiln.ir.errors import DeviceError, KilnError, RuntimeLaunchError
from kiln.runtime.cuda import graph as cuda_graph
from kiln.runtime.cuda import settings
from kiln.runtime.cuda.compiler import CUDACompiler
from kiln.runtime.cuda.device_vars import VarArena, VarSlot, calls_writer
from kiln.runtime.cuda.sticky import is_sticky

INSTALL_HINT = 'pip install "kiln-runtime-cuda[driver]"'
MAX_BLOCK_THREADS = 1024
_drv_lock = threading.Lock()

_NO_BINARY = ("no kernel image is available", "no binary for gpu", "CUDA_ERROR_NO_BINARY_FOR_GPU")


def load_driver() -> Any:
  """pycuda.driver (or, with KILN_CUDA_DRIVER=cuda-python, kiln.runtime.cuda.cudapy's adapter of the same shape over NVIDIA's
  cuda-python), initialised; a DeviceError naming the fix when the binding or the CUDA driver is missing."""
  which = settings.DRIVER.get()
  with _drv_lock:
    if which == "cuda-python": drv = _load_cuda_python()
    else:
      try: drv = importlib.import_module("pycuda.driver")
      except ImportError as e:
        missing = getattr(e, "name", None) in ("pycuda", "pycuda.driver") and "libcuda" not in str(e)
        why = "pycuda is not installed" if missing else f"pycuda could not load the CUDA driver ({e})"
        raise DeviceError(f"CUDA launch needs pycuda and an NVIDIA driver: {why}. Install it with {INSTALL_HINT} on a machine with a "
                          "CUDA driver (libcuda.so), or use NVIDIA's cuda-python (KILN_CUDA_DRIVER=cuda-python); compiling to "
                          "PTX/cubin and the CPU emulation harness work without it") from None
    try: drv.init()
    except Exception as e:
      raise DeviceError(f"no CUDA driver was found or it failed to initialise ({e}); {INSTALL_HINT} needs an NVIDIA GPU and driver") from None
    return drv


_cuda_python: Any = None


def _load_cuda_python() -> Any:
  global _cuda_python
  if _cuda_python is None:
    from kiln.runtime.cuda.cudapy import load_cuda_python
    try: _cuda_python = load_cuda_python()
    except ImportError as e:
      raise DeviceError(f"KILN_CUDA_DRIVER=cuda-python needs NVIDIA's cuda-python: {e}. Install it with "
                        "`pip install \"kiln-runtime-cuda[cuda-python]\"` (or unset KILN_CUDA_DRIVER to use pycuda)") from None
  return _cuda_python


def is_out_of_memory(drv: Any, e: BaseException) -> bool:
  """pycuda.driver.MemoryError (CUDA_ERROR_OUT_OF_MEMORY) only: not any failure of an allocation."""
  mem_err = getattr(drv, "MemoryError", None)
  if isinstance(mem_err, type) and isinstance(e, mem_err): return True
  return "CUDA_ERROR_OUT_OF_MEMORY" in str(e)


class ContextGuard:
  """Makes one CUDA context current around driver work on whichever host thread runs it, and maps pycuda's errors.

  `with guard():` pushes the context when another one (or none) is current on this thread and pops it on the way out; when
  it is already current nothing is pushed, so nesting is cheap. ctx=None (an allocator used on its own) manages nothing:
  the caller's current context is used. Once a sticky error was seen the guard is dead: entering raises a DeviceError that
  says so and why (frees and cache flushes are then dropped instead: the context's memory went with it)."""

  def __init__(self, drv: Any, ctx: Any = None, device: str = "CUDA"):
    self.drv, self.ctx, self.device = drv, ctx, device
    self.errors: tuple[type[BaseException], ...] = tuple(t for t in (getattr(drv, "Error", None),) if isinstance(t, type)) or (Exception,)
    self.dead: str | None = None

  def is_current(self) -> bool:
    """Our context object is on top of this thread's stack. pycuda's == compares CUcontext handles, but its frees compare the
    context objects (another wrapper of the same primary context, e.g. pycuda.autoprimaryctx's, is not ours: memory
    allocated under it cannot be freed under ours out of its thread); its hash mixes in the object's address, so both."""
    cur = self.drv.Context.get_current()
    return cur is not None and cur == self.ctx and hash(cur) == hash(self.ctx)

  def check_alive(self) -> None:
    if self.dead is not None:
      raise DeviceError(f"{self.device}: the device context is dead and cannot be used again ({self.dead}); every buffer and "
                        "kernel on it is lost: start a new process to use this GPU")

  @contextmanager
  def __call__(self) -> Iterator[None]:
    self.check_alive()
    if self.ctx is None or self.is_current():
      yield
      return
    self.ctx.push()
    try: yield
    finally: self.drv.Context.pop()

  @contextmanager
  def for_free(self) -> Iterator[bool]:
    """Like __call__ but never raises for a dead context: yields False then (the caller drops the memory instead)."""
    if self.dead is not None:
      yield False
      return
    with self(): yield True

  def failure(self, e: BaseException, what: str, launch: bool = False) -> KilnError:
    """The kiln error for pycuda error e raised while doing `what`; a sticky error marks this context dead."""
    if isinstance(e, KilnError): return e
    if is_sticky(e):
      if self.dead is None: self.dead = f"{what} failed: {e}"
      cls: type[KilnError] = RuntimeLaunchError if launch else DeviceError
      return cls(f"{self.device}: {what} failed: {e}. The device context is dead now (a sticky CUDA error): every later call on "
                 f"{self.device} raises; start a new process to use this GPU")
    if is_out_of_memory(self.drv, e): return DeviceError(f"{self.device}: GPU out of memory {what}: {e}")
    if any(k.lower() in str(e).lower() for k in _NO_BINARY):
      return RuntimeLaunchError(f"{self.device}: {what} failed: {e}. The binary has no code for this GPU's architecture (compile a "
                                "fatbin with PTX, or set KILN_CUDA_ARCH to this GPU's sm_XX)")
    cls = RuntimeLaunchError if launch or isinstance(e, getattr(self.drv, "LaunchError", ())) else DeviceError
    return cls(f"{self.device}: {what} failed: {type(e).__name__}: {e}")


def _drop_in_context(guard: ContextGuard, d: dict[str, Any], names: tuple[str, ...]) -> None:
  """Drop d's pycuda objects (their destructors free device resources) with guard's context current. For finalisers: never
  raises (at interpreter exit the driver may be half torn down; a dead context's resources went with it)."""
  try:
    with guard.for_free():
      for n in names: d.pop(n, None)
  except Exception as e:  # a finaliser has no caller to tell: say so, never raise
    warnings.warn(f"{guard.device}: releasing {', '.join(names)} failed: {e}", RuntimeWarning, stacklevel=2)


# ---- memory ----
@dataclass(frozen=True)
class CUDABuffer:
  """Device memory: `base` keeps the pycuda allocation alive (shared by views), `ptr` is the address a kernel takes."""
  base: Any
  ptr: int
  size: int

  def __int__(self) -> int: return self.ptr


class CUDAAllocator:
  """Device allocations with an LRU cache of freed blocks (reused by exact size; flushed when memory runs out).

  Every driver call (allocate, free, copy) runs with `ctx` current (ContextGuard), so frees from finalisers or eviction on any
  thread reach the context that owns the memory; ctx=None uses whatever context the caller made current."""

  def __init__(self, drv: Any, ctx: Any = None, cache_bytes: int | None = None, guard: ContextGuard | None = None):
    self.drv, self.ctx = drv, ctx
    self.guard = guard if guard is not None else ContextGuard(drv, ctx)
    self.cache_limit = cache_bytes if cache_bytes is not None else settings.LRU_BYTES.get()
    self._cache: OrderedDict[int, list[Any]] = OrderedDict()  # size -> freed allocations, least recently freed first
    self.cached_bytes = 0
    self._lock = threading.RLock()

  def alloc(self, size: int, options: Any = None) -> CUDABuffer:
    if size <= 0: raise DeviceError(f"cannot allocate {size} bytes on the GPU")
    self.guard.check_alive()
    with self._lock:
      if (lst := self._cache.get(size)):
        mem = lst.pop()
        if not lst: del self._cache[size]
        self.cached_bytes -= size
        return CUDABuffer(mem, int(mem), size)
    g = self.guard
    with g():
      try: mem = self.drv.mem_alloc(size)
      except g.errors as e:
        if not is_out_of_memory(self.drv, e): raise g.failure(e, f"allocating {size} bytes") from e
        self.free_cache()  # out of memory: give the cached blocks back and retry once
        try: mem = self.drv.mem_alloc(size)
        except g.errors as e2: raise g.failure(e2, f"allocating {size} bytes") from e2
    return CUDABuffer(mem, int(mem), size)

  def _release(self, mems: list[Any]) -> None:
    if not mems: return
    with self.guard.for_free() as alive:
      if not alive: return  # the context died: its memory is gone with it
      for m in mems:
        try: m.free()
        except self.guard.errors as e: raise self.guard.failure(e, "freeing device memory") from e

  def free(self, handle: CUDABuffer, size: int, options: Any = None) -> None:
    if handle.base is None or handle.ptr != int(handle.base): return  # a view owns nothing
    evict: list[Any] = []
    with self._lock:
      self._cache.setdefault(size, []).append(handle.base)
      self._cache.move_to_end(size)
      self.cached_bytes += size
      while self.cached_bytes > self.cache_limit and self._cache:
        sz, lst = next(iter(self._cache.items()))
        evict.append(lst.pop(0))
        self.cached_bytes -= sz
        if not lst: del self._cache[sz]
    self._release(evict)

  def _take_cache(self) -> list[Any]:
    """Every cached block, the cache left empty (the caller frees them)."""
    mems = [m for lst in self._cache.values() for m in lst]
    self._cache.clear()
    self.cached_bytes = 0
    return mems

  def free_cache(self) -> None:
    with self._lock: mems = self._take_cache()
    self._release(mems)

  def __del__(self) -> None:
    # the cached blocks are freed here, with our context current, not by pycuda's destructors on whatever thread drops them
    # (no lock: a finaliser may run inside a locked section of this very thread)
    try:
      if self.guard.ctx is None or not self._cache: return
      self._release(self._take_cache())
    except Exception as e:  # a finaliser has no caller to tell (at interpreter exit the driver may be half torn down): say so
      warnings.warn(f"{self.guard.device}: freeing the allocator's cached blocks failed: {e}", RuntimeWarning, stacklevel=2)

  def ptr(self, handle: CUDABuffer) -> int: return handle.ptr
  def view(self, handle: CUDABuffer, offset: int, size: int) -> CUDABuffer:
    if offset < 0 or offset + size > handle.size: raise DeviceError(f"view [{offset}, {offset + size}) is outside a {handle.size}-byte buffer")
    return CUDABuffer(handle.base, handle.ptr + offset, size)

  def _copy(self, what: str, fn: Any, *args: Any) -> None:
    g = self.guard
    with g():
      try: fn(*args)
      except g.errors as e: raise g.failure(e, what) from e

  def copyin(self, dest: CUDABuffer, src: memoryview) -> None:
    self._copy(f"copying {src.nbytes} bytes to the device", self.drv.memcpy_htod, dest.ptr, src)
  def copyout(self, dest: memoryview, src: CUDABuffer) -> None:
    self._copy(f"copying {dest.nbytes} bytes from the device", self.drv.memcpy_dtoh, dest, src.ptr)
  def copy(self, dest: CUDABuffer, src: CUDABuffer, size: int) -> None:
    self._copy(f"copying {size} bytes on the device", self.drv.memcpy_dtod, dest.ptr, src.ptr, size)
  def as_numpy(self, handle: Any, dtype: Any, count: int, offset: int = 0) -> None: return None  # device memory is not host-visible


# ---- programs ----
def _sizes(spec: CompiledSpec, s: Sequence[Any] | None, var_vals: dict[str, int]) -> tuple[int, ...]:
  return tuple(sym_eval(x, var_vals) for x in (s or (1, 1, 1))) + (1,) * (3 - len(s or (1, 1, 1)))


def launch_dims(spec: CompiledSpec, vals: Sequence[int], global_size: Sequence[Any] | None = None,
                local_size: Sequence[Any] | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
  """(grid, block): the given sizes, or the spec's (symbolic) sizes, evaluated with vals in var_names order.

  The block must be the one the kernel was rendered for (its indexing, shared memory and __launch_bounds__ assume it): another
  local_size would leave outputs unwritten, so it is refused."""
  var_vals = dict(zip(spec.var_names, (int(v) for v in vals)))
  grid = _sizes(spec, global_size if global_size is not None else spec.global_size, var_vals)
  block = _sizes(spec, spec.local_size, var_vals)
  if local_size is not None and (given := _sizes(spec, local_size, var_vals)) != block:
    raise RuntimeLaunchError(f"kernel {spec.name}: local_size {given} differs from the block {block} it was rendered for; its "
                             "indexing assumes that block, so another would leave outputs unwritten (render it again for that size)")
  if len(grid) != 3 or len(block) != 3 or min(grid) < 0 or min(block) < 1:  # a grid dim of 0 (a symbolic size bound to 0): nothing runs
    raise RuntimeLaunchError(f"kernel {spec.name}: launch sizes must be 3 ints, the grid's >= 0 and the block's >= 1, got grid {grid} block {block}")
  if block[0] * block[1] * block[2] > MAX_BLOCK_THREADS:
    raise RuntimeLaunchError(f"kernel {spec.name}: block {block} has more than {MAX_BLOCK_THREADS} threads")
  return grid, block  # type: ignore[return-value]


_STATIC_SHARED = 48 << 10  # shared memory a block gets without asking (cuFuncSetAttribute raises it)


def tf32_allowed() -> bool:
  """KILN_CUDA_TF32=1: float32 matrix products may use TF32 tensor cores (inputs rounded to 10 mantissa bits, float32 sums;
  about 3e-4 relative error instead of float32's 1e-6). Off by default, as torch's allow_tf32."""
  return settings.TF32.get()


def buffer_alignments(spec: CompiledSpec) -> list[int]:
  """Per buffer argument (globals order), the byte alignment its loads and stores need: its element's size, or more where
  the kernel says so (KernelArg.align: the tiled matmul's 16-byte loads)."""
  by_slot = {u.arg: max(1, int(getattr(u.dtype, "base", u.dtype).nbytes)) for u in spec.ast.toposort() if u.op.name == "DEFINE_GLOBAL"}
  for a in spec.args: by_slot[a.slot] = max(by_slot.get(a.slot, 1), a.align)
  return [by_slot.get(s, 1) for s in (spec.globals or range(spec.buf_count))]


class CUDABoundCall:
  """A launch with fixed buffers: the argument buffer (pointers then int32 variables, as the kernel's parameter struct) and the
  sizes are packed once, here and in set_vals; a call is one cuLaunchKernel of that buffer.

  Two ways to call it (kiln.codegen.protocols.SessionCall): `bound()` on its own makes the context current around the launch
  (ContextGuard); `bound.in_session()` inside `with bound.session():` (the runtime's session(), which ExecutionPlan enters
  once around a whole run) launches with no context check, push or pop."""

  def __init__(self, prog: CUDAProgram, bufs: Sequence[int], vals: Sequence[int], global_size: Sequence[Any] | None,
               local_size: Sequence[Any] | None):
    self.prog, self.bufs = prog, [int(b) for b in bufs]
    self.session = prog.runtime.session  # equal for every call of one runtime: the executor groups them under one session
    self.graph_calls = prog.runtime.graph_calls  # kiln.codegen.protocols.GraphCall: a run of these as one CUDA graph
    self.graph_runs: weakref.WeakSet[cuda_graph.GraphRun] = weakref.WeakSet()  # the graphs holding this launch (told of set_vals)
    self._errors = prog.runtime.guard.errors
    self.vars = prog.runtime.vars
    self.slot: VarSlot | None = None  # where a kernel that reads its variables from memory finds them (device_vars.py)
    if prog.spec.vars_in_memory:  # arguments and grid fixed for every value: a graph holding this launch never changes
      self.slot = self.vars.take(len(prog.spec.var_names), self)
      self.grid, self.block = prog.fixed_dims(local_size)
      self.arg_buf = prog.pack(self.bufs, (), self.slot.ptr)
      self.empty = 0 in self.grid
    self.set_vals(vals, global_size, local_size)

  def set_vals(self, vals: Sequence[int], global_size: Sequence[Any] | None = None, local_size: Sequence[Any] | None = None) -> None:
    if self.slot is not None:
      self.vars.write(self.slot, vals, self.prog.name)
      return
    self.grid, self.block = self.prog.dims(vals, global_size, local_size)
    self.arg_buf = self.prog.pack(self.bufs, vals)
    self.empty = 0 in self.grid  # an empty grid runs nothing (CUDA rejects a launch of 0 blocks)
    for g in self.graph_runs: g.note_change(self)  # its node is updated before the graph's next launch

  @property
  def fixed_launch(self) -> bool:
    """kiln.codegen.protocols.ValsWriter: a kernel that reads its variables from memory launches the same way whatever
    their values."""
    return self.slot is not None

  vals_writer = staticmethod(calls_writer)  # kiln.codegen.protocols.ValsWriter: a variable into every call's slot at once

  def __call__(self) -> None:
    if self.vars.dirty: self.vars.flush()
    if not self.empty: self.prog.launch(self.grid, self.block, self.arg_buf)

  def in_session(self) -> None:
    """The launch, with this runtime's context already current on this thread: only inside `with self.session():`."""
    if self.vars.dirty: self.vars.flush()
    if self.empty: return
    # prog.fn looked up here, not kept: the function holds its module, which must be unloaded with the program (in context)
    try: self.prog.fn._launch_kernel(self.grid, self.block, self.arg_buf, self.prog.shared, None)
    except self._errors as e: raise self.prog.runtime.guard.failure(e, f"launching kernel {self.prog.name}", launch=True) from e


class CUDAProgram:
  """A kernel loaded from a fatbin or cubin. bufs are device addresses in globals order, vals int32 in var_names order."""

  def __init__(self, runtime: CUDARuntime, spec: CompiledSpec):
    if not spec.bytes: raise RuntimeLaunchError(f"kernel {spec.name}: no cubin in the CompiledSpec (compile it with CUDACompiler)")
    self.runtime, self.spec, self.name, self.drv = runtime, spec, spec.name, runtime.drv
    # the kernel's parameters: 8-byte pointers, then int32s (or the pointer to them, device_vars.py)
    self.fmt = "=" + "Q" * spec.buf_count + ("Q" if spec.vars_in_memory else "i" * len(spec.var_names))
    self.align = buffer_alignments(spec)
    self.shared = int(spec.shared_bytes)  # dynamic shared memory each launch gives a block
    self._dims: dict[tuple, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}
    g = runtime.guard
    with g():
      try:
        self.module = self.drv.module_from_buffer(spec.bytes)
        self.fn = self.module.get_function(spec.name)
        if self.shared > _STATIC_SHARED:  # a block may take more than 48 KB of (dynamic) shared memory only once allowed to
          self.fn.set_attribute(self.drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, self.shared)
      except g.errors as e: raise g.failure(e, f"loading kernel {spec.name}") from e

  def pack(self, bufs: Sequence[int], vals: Sequence[int], vars_ptr: int | None = None) -> bytes:
    """The kernel's argument buffer, checked: buffer count, alignment of each pointer, int32 range of each value; for a
    kernel that reads its variables from memory, the buffers and vars_ptr (their device array) instead of vals."""
    if len(bufs) != self.spec.buf_count: raise RuntimeLaunchError(f"kernel {self.name} takes {self.spec.buf_count} buffers, got {len(bufs)}")
    if self.spec.vars_in_memory:
      if vars_ptr is None: raise RuntimeLaunchError(f"kernel {self.name} reads its variables from device memory: it needs their address")
      vals = (int(vars_ptr),)
    elif len(vals) != len(self.spec.var_names):
      raise RuntimeLaunchError(f"kernel {self.name} takes vals for {self.spec.var_names}, got {len(vals)} values")
    for i, (b, a) in enumerate(zip(bufs, self.align)):
      if int(b) % a: raise RuntimeLaunchError(f"kernel {self.name}: buffer {i} at {int(b):#x} is not aligned to {a} bytes (a view at an "
                                              f"offset that is not a multiple of {a} bytes, which the kernel's loads need); CUDA would "
                                              "fault on a misaligned address")
    for n, v in zip(self.spec.var_names, vals):
      if not self.spec.vars_in_memory and not -(2**31) <= int(v) < 2**31:
        raise RuntimeLaunchError(f"kernel {self.name}: variable {n}={v} does not fit int32")
    return struct.pack(self.fmt, *(int(b) for b in bufs), *(int(v) for v in vals))

  def fixed_dims(self, local_size: Sequence[Any] | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of a kernel that reads its variables from memory: at their upper bounds (its blocks past the grid the
    values give return at once; kiln.codegen.render.cuda_vars)."""
    return self.dims(upper_vals(self.spec), None, local_size)

  def dims(self, vals: Sequence[int], global_size: Sequence[Any] | None = None,
           local_size: Sequence[Any] | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """launch_dims, memoised per (vals, sizes): evaluating symbolic sizes costs tens of microseconds, a lookup well under one."""
    try: key = (tuple(int(v) for v in vals), None if global_size is None else tuple(global_size),
                None if local_size is None else tuple(local_size))
    except TypeError: return launch_dims(self.spec, vals, global_size, local_size)
    if (hit := self._dims.get(key)) is None:
      hit = launch_dims(self.spec, vals, global_size, local_size)
      if len(self._dims) < 4096: self._dims[key] = hit
    return hit

  def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], arg_buf: bytes) -> None:
    """One cuLaunchKernel (pycuda's Function._launch_kernel, what its own __call__ and prepared_call end in) in our context."""
    g = self.runtime.guard  # ContextGuard.__call__ inlined: this is the per-launch fast path
    if g.dead is not None: g.check_alive()
    pushed = not g.is_current()
    if pushed: g.ctx.push()
    try: self.fn._launch_kernel(grid, block, arg_buf, self.shared, None)
    except g.errors as e: raise g.failure(e, f"launching kernel {self.name}", launch=True) from e
    finally:
      if pushed: g.drv.Context.pop()

  def __call__(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[Any] | None = None,
               local_size: Sequence[Any] | None = None, wait: bool = False) -> float | None:
    """Launch; global_size/local_size default to the spec's sizes evaluated with vals. With wait=True, the kernel's time in
    seconds (CUDA events)."""
    if self.spec.vars_in_memory:  # one slot for this program's own launches (ordered on the stream: device_vars.py)
      if (slot := self.__dict__.get("_slot")) is None: slot = self._slot = self.runtime.vars.take(len(self.spec.var_names), self)
      self.runtime.vars.write(slot, vals, self.name)
      arg_buf = self.pack(bufs, (), slot.ptr)
      grid, block = self.fixed_dims(local_size)
    else:
      arg_buf = self.pack(bufs, vals)
      grid, block = self.dims(vals, global_size, local_size)
    if self.runtime.vars.dirty: self.runtime.vars.flush()
    if 0 in grid: return 0.0 if wait else None  # an empty grid: nothing to run (CUDA rejects a launch of 0 blocks)
    if not wait:
      self.launch(grid, block, arg_buf)
      return None
    g = self.runtime.guard
    with g():
      try: start, end = self.drv.Event(), self.drv.Event()
      except g.errors as e: raise g.failure(e, "creating CUDA events") from e
      try:
        try: start.record()
        except g.errors as e: raise g.failure(e, "recording a CUDA event") from e
        self.launch(grid, block, arg_buf)
        try:
          end.record()
          end.synchronize()
          return float(start.time_till(end)) * 1e-3
        except g.errors as e: raise g.failure(e, f"waiting for kernel {self.name}", launch=True) from e
      finally: del start, end  # destroyed here, with the context current (pycuda cannot destroy them out of its thread later)

  def bind(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[Any] | None = None,
           local_size: Sequence[Any] | None = None) -> CUDABoundCall:
    return CUDABoundCall(self, bufs, vals, global_size, local_size)

  def graph_function(self, api: cuda_graph.GraphAPI) -> int:
    """The CUfunction graph nodes of this kernel launch: pycuda's Function does not expose its handle, so the first graph
    loads a second copy of the binary through `api` (cuModuleLoadData, in the caller's current context: inside the session),
    unloaded with this program."""
    if (hit := self.__dict__.get("_graph_mod")) is None:
      mod, fn = api.load_function(self.spec.bytes, self.spec.name, self.shared)
      hit = self._graph_mod = (api, mod, fn)
    return int(hit[2])

  def __del__(self) -> None:
    # unload the module with our context current: pycuda's own destructor, run later on another thread without it, cannot
    # ("module in out-of-thread context could not be cleaned up") and leaks it
    if (gm := self.__dict__.pop("_graph_mod", None)) is not None:  # the graphs' copy (graphs using it hold this program)
      try:
        with self.runtime.guard.for_free() as alive:
          if alive: gm[0].unload_module(gm[1])
      except Exception as e:  # a finaliser has no caller to tell: say so
        warnings.warn(f"{self.runtime.device}: unloading kernel {self.name}'s graph module failed: {e}", RuntimeWarning, stacklevel=2)
    if "module" in self.__dict__: _drop_in_context(self.runtime.guard, self.__dict__, ("fn", "module"))


class CUDARuntime:
  """One NVIDIA GPU (one runtime per CUDA:N, each with that device's primary context): renderer
  (kiln.codegen.render.cuda.CUDARenderer), CUDACompiler for its architecture, allocator, loader.

  The primary context is retained here but never left pushed: `current()` makes it current around each piece of work."""
  host_parallel_safe = False  # one stream: kernels are ordered by the device, not overlapped from host threads
  # a view handed to a kernel starts on this many bytes (the tiled matmul's float4 loads and cp.async chunks): kiln.graph
  # places its read windows so (a kernel given a misaligned pointer is refused at bind, CUDA would fault)
  view_align = 16

  @property
  def compile_threads(self) -> int:
    """How many kernels a plan's builder may compile at once: nvcc is a process a kernel, so one per host core
    (KILN_COMPILE_THREADS overrides)."""
    if (n := settings.COMPILE_THREADS.get()) is not None: return n
    return min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)  # the cores this process may use

  def __init__(self, device: DeviceSpec | str = "CUDA:0"):
    spec = DeviceSpec.parse(device)
    if spec.kind != "CUDA": raise DeviceError(f"CUDARuntime runs CUDA devices, not {spec}")
    self.device_spec, self.device = spec, str(spec)
    self.drv = load_driver()
    if spec.index >= (n := self.drv.Device.count()): raise DeviceError(f"no device {spec}: this machine has {n} CUDA device(s)")
    errors: tuple[type[BaseException], ...] = tuple(t for t in (getattr(self.drv, "Error", None),) if isinstance(t, type)) or (Exception,)
    try:
      self.dev = self.drv.Device(spec.index)
      self.ctx = self.dev.retain_primary_context()
      major, minor = self.cc = tuple(self.dev.compute_capability())
    except errors as e: raise DeviceError(f"{self.device}: opening the device failed: {e}") from e
    self.guard = ContextGuard(self.drv, self.ctx, self.device)
    try: self.sms = int(self.dev.get_attribute(self.drv.device_attribute.MULTIPROCESSOR_COUNT))  # read once: it never changes
    except Exception: self.sms = 0  # the attribute API is missing (a stand-in driver): the renderer assumes nothing
    self.arch = settings.ARCH.get() or f"sm_{major}{minor}"  # SASS for this GPU (plus PTX) unless told otherwise
    self.compiler = CUDACompiler(self.arch)
    self.allocator = CUDAAllocator(self.drv, self.ctx, guard=self.guard)
    self.vars = VarArena(self.allocator)  # variables kernels read from memory (device_vars.py)
    self._renderer: Any = None
    self._graph_api: Any = False  # the GraphAPI over libcuda, None where graphs are unavailable; False: not looked up yet

  @property
  def renderer(self) -> Any:
    t = self.target()
    if self._renderer is None or getattr(self._renderer, "target", t) != t:  # KILN_CUDA_TF32 changed: render for the new target
      # imported when first needed (a runtime that only runs compiled specs never renders); kiln-codegen is a hard dependency
      self._renderer = importlib.import_module("kiln.codegen.render.cuda").CUDARenderer(t)
    return self._renderer

  def target(self) -> Any:
    """The codegen Target of this GPU: its compute capability (tensor-core kernels from sm_80) and multiprocessor count (the
    tiled matmul's tile size), read from the device; a driver that cannot say leaves them unknown (0)."""
    opt = importlib.import_module("kiln.codegen.choose")
    major, minor = self.cc
    return opt.Target(device="CUDA", vector_bytes=0, threads=1, gpu_arch=major * 10 + minor, gpu_sms=self.sms, allow_tf32=tf32_allowed())

  @property
  def cache_variant(self) -> str:
    """What this runtime renders differently within one process: float32 matmuls under KILN_CUDA_TF32 (the executor's memory
    cache keys kernels by it, so switching TF32 on mid-process does not reuse the float32 kernels, nor off the TF32 ones)."""
    return "|tf32" if tf32_allowed() else ""

  @property
  def fingerprint(self) -> str:
    """What code rendered for this GPU depends on beyond the compiler's arch (part of the kernel cache's keys): the tile
    choices follow the SM count, and KILN_CUDA_TF32 changes float32 matmuls."""
    t = self.target()
    return f"{self.device}|sm_{t.gpu_arch}|{t.gpu_sms} SMs|tf32={int(t.allow_tf32)}"

  @property
  def dead(self) -> str | None:
    """Why the device context is unusable (a sticky CUDA error), or None."""
    return self.guard.dead

  def current(self) -> Any:
    """`with runtime.current():` this device's context is current on this thread inside (pushed and popped only if needed)."""
    return self.guard()

  def session(self) -> Any:
    """The executor's hook (kiln.codegen.protocols.SessionCall): `with runtime.session():` around a run of a plan's launches on
    this thread, which then call their bound calls' in_session (no context check, push or pop each). It is current(): this
    device's context pushed on entry only when not already current, and popped on exit, so nothing is left pushed when the
    run returns or raises, and it works from any thread. Inside it, work for another CUDA device pushes and pops its own
    context (its guard), so this one is on top again after each such call."""
    return self.guard()

  def load(self, compiled: CompiledSpec) -> CUDAProgram: return CUDAProgram(self, compiled)

  @property
  def graph_api(self) -> cuda_graph.GraphAPI | None:
    """libcuda's graph calls (kiln.runtime.cuda.graph), or None: no libcuda in this process, or a stand-in driver."""
    if self._graph_api is False: self._graph_api = cuda_graph.open_api(self.drv)
    return self._graph_api  # type: ignore[no-any-return]

  def graph_calls(self, calls: Sequence[Any]) -> cuda_graph.GraphRun | None:
    """kiln.codegen.protocols.GraphCall: one callable that launches `calls` (this runtime's bound calls, a run of a plan
    with nothing else between them, in order) as one CUDA graph inside this runtime's session, or None (launch them one by
    one): graphs off (KILN_CUDA_GRAPHS=0), unavailable, or fewer than GRAPH_MIN_KERNELS launches. The graph is built at its
    first call, so a plan built with graphs on needs no GPU work until it runs."""
    if len(calls) < cuda_graph.GRAPH_MIN_KERNELS or not cuda_graph.enabled(): return None
    if any(getattr(c, "prog", None) is None or c.prog.runtime is not self for c in calls): return None
    if (api := self.graph_api) is None: return None
    return cuda_graph.GraphRun(self, api, calls)

  def synchronize(self) -> None:
    g = self.guard
    with g():
      try: self.drv.Context.synchronize()
      except g.errors as e: raise g.failure(e, "synchronizing") from e
