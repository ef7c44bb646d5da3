"""CPU emulation of rendered CUDA C kernels: proof of correctness without a GPU.

The kernel is built by the host C++ compiler under a shim (include/kiln_cuda_shim.h: blockIdx/threadIdx per host thread,
__syncthreads as a barrier, __shared__ per block, half/bfloat16 with round-to-nearest-even conversions), loaded with ctypes and
run over a grid on numpy arrays. Every CUDA thread of a block that uses __syncthreads has its own host stack, so the barrier and
shared memory behave: mode "fibers" (the default on x86-64: the block's threads are switched at each __syncthreads on one host
thread, blocks spread over host threads, fast) or mode "threads" (one OS thread per CUDA thread, a real barrier, blocks in
turn: slower, but real concurrency inside a block, so it can expose a missing __syncthreads differently). Kernels without
__syncthreads run each block's threads one after another on a pool of host threads. Warp shuffles (include/kiln_cuda_warp.h) are
a collective of the whole block over the same barrier, so every thread of the block must call them alike, as kiln's reduction
helpers do; atomicAdd is a host atomic, and __device__ variables are process globals (one launch of a kernel at a time). Built
libraries are cached by source hash in KILN_CACHE_DIR/cuda-emu as authenticated entries (kiln.codegen.diskcache: a forged or
foreign library is never loaded).

It checks what a kernel computes, not how a GPU schedules it: warps, memory coalescing, FMA contraction (nvcc fuses a*b+c by
default, the emulator does not) and out-of-bounds accesses (a crash here, not an error) are outside what it shows.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.codegen import diskcache
from kiln.codegen import settings as codegen_settings
from kiln.codegen.spec import CompiledSpec, ProgramSpec, sym_eval, upper_vals
from kiln.codegen.threads import thread_count
from kiln.ir.errors import CompileError, RuntimeLaunchError
from kiln.runtime.cuda import settings
from kiln.runtime.cuda.compiler import source_excerpt

INCLUDE_DIR = Path(__file__).parent / "include"
MAX_BLOCK_THREADS = 1024
_GXX_ERR = re.compile(r"\.cu:(\d+):\d+:\s*(?:fatal )?error")
_lock = threading.Lock()
_loaded: dict[str, EmulatedKernel] = {}
_building: dict[str, threading.Lock] = {}  # one lock a kernel being built (key as _loaded's)
_pch: dict[tuple[str, ...], Path] = {}  # flags -> the include folder with the shim precompiled for them (_headers)
_AREA = "cuda-emu"  # KILN_CACHE_DIR/cuda-emu


def _shim_hash() -> str:
  h = hashlib.sha256()
  for p in sorted(INCLUDE_DIR.iterdir()): h.update(p.name.encode() + p.read_bytes())
  return h.hexdigest()


def _debug(msg: str) -> None:
  if codegen_settings.DEBUG.get() >= 1: print(msg, file=sys.stderr, flush=True)


def _cxx() -> str:
  for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if c and shutil.which(c): return c
  raise CompileError("the CUDA emulation harness needs a host C++ compiler (g++ or clang++; set CXX)")


CXXFLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing", "-w")


MODES = settings.EMU_MODES


def default_mode() -> str:
  return settings.EMU_MODE.get() or ("fibers" if platform.machine().lower() in ("x86_64", "amd64") else "threads")


class EmulatedKernel:
  """One CUDA C kernel built for the host. Call with numpy arrays (or raw host addresses) in globals order and int vals."""

  def __init__(self, src: str, name: str, lib_path: str, mode: str):
    self.src, self.name, self.lib_path, self.mode = src, name, lib_path, mode
    self.lib = ctypes.CDLL(lib_path)
    self._fn = self.lib.kiln_emu_launch
    self._fn.argtypes = [ctypes.POINTER(ctypes.c_int64), *[ctypes.c_int] * 9]
    self._fn.restype = ctypes.c_int
    # without a barrier (a shuffle is one here: include/kiln_cuda_warp.h) a block's threads cannot wait for each other: run them in turn
    self.concurrent = "__syncthreads" in src or "__shfl_" in src

  def __call__(self, bufs: Sequence[np.ndarray | int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
               local_size: Sequence[int] | None = (1, 1, 1), workers: int | None = None) -> float:
    """Run the grid; arrays are written in place. Returns the wall time in seconds."""
    gs, ls = _dims(global_size, "global_size", 0), _dims(local_size or (1, 1, 1), "local_size")
    if 0 in gs: return 0.0  # an empty grid (a symbolic size bound to 0): nothing runs
    if (nt := ls[0] * ls[1] * ls[2]) > MAX_BLOCK_THREADS:
      raise RuntimeLaunchError(f"kernel {self.name}: block of {nt} threads exceeds {MAX_BLOCK_THREADS}")
    ptrs: list[int] = []
    for i, b in enumerate(bufs):
      if isinstance(b, np.ndarray):
        if not b.flags.c_contiguous: raise RuntimeLaunchError(f"kernel {self.name}: buffer {i} is not C-contiguous")
        ptrs.append(b.ctypes.data)
      else: ptrs.append(int(b))
    for v in vals:
      if not -(2**31) <= int(v) < 2**31: raise RuntimeLaunchError(f"kernel {self.name}: value {v} does not fit the kernel's int32 argument")
    argv = (ctypes.c_int64 * max(1, len(ptrs) + len(vals)))(*ptrs, *[int(v) for v in vals])
    w = workers or thread_count()
    st = time.perf_counter()
    rc = self._fn(argv, len(ptrs) + len(vals), *gs, *ls, int(self.concurrent), w)  # ctypes releases the GIL here
    et = time.perf_counter() - st
    if rc == -2: raise RuntimeLaunchError(f"kernel {self.name}: given {len(ptrs)} buffers and {len(vals)} vals, which is not its parameter count")
    if rc == -3: raise RuntimeLaunchError(f"kernel {self.name}: out of memory for {nt} fiber stacks (KILN_EMU_STACK_KB)")
    if rc != 0: raise RuntimeLaunchError(f"kernel {self.name}: could not start {nt} host threads for a block (rc {rc})")
    return et


def _dims(s: Sequence[int], what: str, least: int = 1) -> tuple[int, int, int]:
  d = tuple(int(x) for x in s) + (1,) * (3 - len(s))
  if len(d) != 3 or any(x < least for x in d): raise RuntimeLaunchError(f"{what} must be 1 to 3 ints >= {least}, got {tuple(s)}")
  return d  # type: ignore[return-value]


def compile_emulator(src: str, name: str, mode: str | None = None) -> EmulatedKernel:
  """Build (or fetch from the cache) the host library for kernel `name` of CUDA C `src` (mode: "fibers" or "threads")."""
  if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name): raise CompileError(f"kernel name {name!r} is not a C identifier")
  mode = mode or default_mode()
  if mode not in MODES: raise CompileError(f"emulation mode must be one of {MODES}, got {mode!r}")
  flags = (*CXXFLAGS, *(["-DKILN_EMU_OS_THREADS"] if mode == "threads" else []))
  key = hashlib.sha256(f"{_shim_hash()}|{flags}|{name}|{src}".encode()).hexdigest()[:32]
  with _lock:
    if (k := _loaded.get(key)) is not None: return k
    one = _building.setdefault(key, threading.Lock())
  with one:  # kernels build side by side (a plan's compile threads), each once
    if (k := _loaded.get(key)) is not None: return k
    # the built library is a disk-cache entry (authenticated, kiln.codegen.diskcache); it is loaded from a private scratch
    # copy of the bytes that were verified, never from a path anyone else could have written
    store, entry = diskcache.DiskCache(_AREA, "CUDA emulator cache"), f"{name}-{key}.so"
    lib = None
    if diskcache.enabled():
      try: lib = store.load(entry)
      except diskcache.BadEntry as e: _debug(f"kiln: CUDA emulator cache entry {entry} not used ({e}); building again")
    with store.scratch() as tmp:
      so = tmp / "k.so"
      if lib is not None: so.write_bytes(lib)
      else:
        _build(src, name, flags, tmp, so)
        if diskcache.enabled(): store.store(entry, so.read_bytes())
      k = _loaded[key] = EmulatedKernel(src, name, str(so), mode)  # dlopen keeps the mapping once the scratch is removed
    return k


def _headers(flags: tuple[str, ...]) -> Path:
  """The include folder kernels build against: a private copy of INCLUDE_DIR with the shim precompiled for these flags
  (what every kernel parses first: its standard headers are most of a small kernel's build), made once a process; the
  package's own folder where the compiler cannot precompile it (the build is then slower, not different)."""
  with _lock:
    if (d := _pch.get(flags)) is not None: return d
    tmp = Path(tempfile.mkdtemp(prefix="kiln-emu-pch-"))  # 0700: no one else writes what the compiler reads
    atexit.register(shutil.rmtree, tmp, True)
    for p in INCLUDE_DIR.iterdir(): shutil.copyfile(p, tmp / p.name)
    r = subprocess.run([_cxx(), *flags, "-x", "c++-header", str(tmp / "kiln_cuda_shim.h"), "-o", str(tmp / "kiln_cuda_shim.h.gch")],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0: _debug(f"kiln: the CUDA emulator's shim did not precompile ({r.stderr.strip()[:200]}); building without it")
    _pch[flags] = d = tmp if r.returncode == 0 else INCLUDE_DIR
    return d


def _build(src: str, name: str, flags: tuple[str, ...], tmp: Path, out: Path) -> None:
  cu = tmp / f"{name}.cu"
  cu.write_text(f'#line 1 "{name}.cu"\n{src}\n#define KILN_EMU_KERNEL {name}\n#include "kiln_cuda_launch.h"\n')
  cmd = [_cxx(), *flags, "-I", str(_headers(flags)), "-include", "kiln_cuda_shim.h", "-x", "c++", str(cu), "-o", str(out)]
  r = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if r.returncode != 0:
    log = r.stderr.replace(str(tmp) + os.sep, "").strip()
    raise CompileError(f"the host C++ compiler failed to build CUDA kernel {name} for emulation", log, source_excerpt(src, log, pattern=_GXX_ERR))


def emulate(src: str, name: str, bufs: Sequence[np.ndarray | int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
            local_size: Sequence[int] | None = (1, 1, 1), mode: str | None = None) -> float:
  """Run CUDA C kernel `name` of `src` on the CPU over the grid: `global_size` blocks of `local_size` threads (as CUDA's grid and
  block). bufs are C-contiguous numpy arrays (bfloat16 as uint16 bits) in globals order, written in place; vals are the int32
  variables in var_names order. Returns the wall time in seconds."""
  return compile_emulator(src, name, mode)(bufs, vals, global_size, local_size)


class EmulatedProgram:
  """A rendered CUDA kernel as a kiln Program over host memory: bufs are host addresses, vals follow var_names. Without explicit
  sizes the spec's (symbolic) global/local sizes are evaluated with the vals."""

  def __init__(self, spec: CompiledSpec | ProgramSpec, mode: str | None = None):
    if not spec.src: raise CompileError(f"kernel {spec.name}: emulation needs the CUDA C source (CompiledSpec.src)")
    self.spec, self.name = spec, spec.name
    self.kernel = compile_emulator(spec.src, spec.name, mode)

  def sizes(self, vals: Sequence[int], global_size: Sequence[Any] | None = None,
            local_size: Sequence[Any] | None = None) -> tuple[list[int], list[int]]:
    var_vals = dict(zip(self.spec.var_names, vals))
    gs = global_size if global_size is not None else (self.spec.global_size or (1, 1, 1))
    ls = local_size if local_size is not None else (self.spec.local_size or (1, 1, 1))
    return [sym_eval(x, var_vals) for x in gs], [sym_eval(x, var_vals) for x in ls]

  def __call__(self, bufs: Sequence[np.ndarray | int], vals: Sequence[int] = (), global_size: Sequence[int] | None = None,
               local_size: Sequence[int] | None = None, wait: bool = False) -> float | None:
    """Run it; a kernel that reads its variables from memory (spec.vars_in_memory) gets them as an int32 array after its
    buffers, on the grid of their upper bounds (what the CUDA runtime launches: kiln.runtime.cuda.device_vars)."""
    if self.spec.vars_in_memory:
      gs, ls = self.sizes(upper_vals(self.spec), None, local_size)
      t = self.kernel([*bufs, np.asarray([int(v) for v in vals], np.int32)], (), gs, ls)
    else:
      gs, ls = self.sizes(vals, global_size, local_size)
      t = self.kernel(bufs, vals, gs, ls)
    return t if wait else None


__all__ = ["EmulatedKernel", "EmulatedProgram", "compile_emulator", "emulate", "default_mode", "INCLUDE_DIR", "MODES"]
