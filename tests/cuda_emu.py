"""A GPU on the CPU for the suite's cross-layer CUDA tests: kiln-runtime-cuda's recording stand-in for pycuda.driver (its
context rules and records kept), given memory and kernels that run.

- every allocation has host memory behind it (256-byte aligned, as cuMemAlloc's), and the copies move bytes;
- CUDACompiler.compile is replaced: the binary is a token holding the rendered CUDA C (no nvcc, which costs a second or more
  a kernel; a token from kiln's disk cache loads in a later process too), or, with nvcc=True, nvcc's real fatbin (checked
  against the device's architecture by the stand-in) remembered beside its source;
- a launch runs that source under kiln.runtime.cuda.emulate (the host C++ compiler) on the grid and block CUDA was asked
  for, with the argument buffer's device pointers turned into host addresses, there and then: the stand-in's one stream
  runs in order, so every copy and launch sees the work queued before it.

What this cannot show is listed in emulate's docstring (warps, FMA contraction, out-of-bounds accesses); what it does
show is that a plan's kernels, buffers, views and copies compute the right values through the CUDA runtime's own code."""
from __future__ import annotations

import bisect
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from cuda_standin import driver_tests, installed

from kiln.codegen.spec import CompiledSpec, ProgramSpec
from kiln.runtime.cuda.compiler import CUDACompiler
from kiln.runtime.cuda.emulate import compile_emulator

_TOKEN = b"KILN-EMU-CUDA:"
_ALIGN = 256


class EmulatedGPU:
  """The memory and the kernels of one emulated device; `stats` counts what crossed the bus and what ran."""

  def __init__(self) -> None:
    self.bases: list[int] = []  # sorted device addresses of live allocations
    self.host: dict[int, np.ndarray] = {}  # device address -> its host bytes
    self.kernels: dict[bytes, tuple[str, str, int, int]] = {}  # binary -> (source, name, buffer count, int32 count)
    self.built: dict[bytes, Any] = {}  # binary -> its host build (an EmulatedKernel; None where kernels do not run)
    self.stats = {"htod": 0, "dtoh": 0, "dtod": 0, "htod_bytes": 0, "dtoh_bytes": 0, "launches": 0}

  def _find(self, ptr: int, n: int) -> tuple[int, np.ndarray]:
    i = bisect.bisect_right(self.bases, ptr) - 1
    if i >= 0 and ptr + n <= (base := self.bases[i]) + self.host[base].size: return base, self.host[base]
    raise AssertionError(f"no device allocation holds [{ptr:#x}, {ptr + n:#x})")

  def span(self, ptr: int, n: int) -> np.ndarray:
    """The host bytes of device range [ptr, ptr + n): inside one allocation, or an AssertionError (what a GPU would fault on)."""
    base, raw = self._find(ptr, n)
    return raw[ptr - base:ptr - base + n]

  def addr(self, ptr: int) -> int:
    """The host address of device address ptr (a kernel argument: it may point anywhere in its allocation)."""
    base, raw = self._find(ptr, 0)
    return int(raw.ctypes.data) + ptr - base


def _host_bytes(size: int) -> np.ndarray:
  raw = np.zeros(size + _ALIGN, np.uint8)
  off = -raw.ctypes.data % _ALIGN
  return raw[off:off + size]


def emulating(drv: Any, monkeypatch: Any, nvcc: bool = False, run: bool = True) -> EmulatedGPU:
  """Turn the stand-in `drv` (test_driver.make_fake_driver) into an emulated GPU in place; patches CUDACompiler.compile.
  run=False: kernels are compiled and loaded but never built for the host, and a launch is an AssertionError (to time
  what a plan's build costs, nvcc included)."""
  gpu = EmulatedGPU()
  alloc, htod, dtoh, dtod, load = drv.mem_alloc, drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod, drv.module_from_buffer
  real_compile = CUDACompiler.compile

  def compile_(self: CUDACompiler, spec: ProgramSpec) -> CompiledSpec:
    # a kernel that reads its variables from memory takes their device array as one more pointer (kiln.codegen.render.cuda_vars)
    meta = (spec.src, spec.name, spec.buf_count + spec.vars_in_memory, 0 if spec.vars_in_memory else len(spec.var_names))
    data = real_compile(self, spec).bytes if nvcc else _TOKEN + json.dumps(meta).encode()  # a token that says what it runs
    gpu.kernels[bytes(data)] = meta
    if run: compile_emulator(spec.src, spec.name)  # built here, on the plan's compile threads, so the loads find it built
    return CompiledSpec.from_program(spec, src=spec.src, data=data, compiler=self.cache_key)

  def mem_alloc(size: int) -> Any:
    a = alloc(-size % _ALIGN + size)  # the stand-in lays allocations end to end: whole multiples keep each one aligned
    bisect.insort(gpu.bases, int(a))
    gpu.host[int(a)] = _host_bytes(size)
    return a

  # the stand-in's classes are patched, not its objects: a closure on an object would hold it in a reference cycle, and
  # the garbage collector would then free it on whatever thread it runs (a leak the stand-in records, as pycuda would)
  free = drv.DeviceAllocation.free
  def freed(self: Any) -> None:
    live = self.valid
    free(self)
    if live and int(self) in gpu.host:
      gpu.bases.remove(int(self))
      del gpu.host[int(self)]
  drv.DeviceAllocation.free = freed

  def memcpy_htod(d: Any, s: Any) -> None:
    htod(d, s)
    src = np.frombuffer(memoryview(s).cast("B"), np.uint8)
    gpu.span(int(d), src.nbytes)[:] = src
    gpu.stats["htod"] += 1; gpu.stats["htod_bytes"] += src.nbytes  # noqa: E702

  def memcpy_dtoh(d: Any, s: Any) -> None:
    dtoh(d, s)
    out = np.frombuffer(memoryview(d).cast("B"), np.uint8)
    out[:] = gpu.span(int(s), out.nbytes)
    gpu.stats["dtoh"] += 1; gpu.stats["dtoh_bytes"] += out.nbytes  # noqa: E702

  def memcpy_dtod(d: Any, s: Any, n: int) -> None:
    dtod(d, s, n)
    gpu.span(int(d), n)[:] = gpu.span(int(s), n).copy()
    gpu.stats["dtod"] += 1

  def launched(fn: Any, launch: Any, grid: Any, block: Any, buf: bytes, shared: int, stream: Any) -> None:
    launch(fn, grid, block, buf, shared, stream)  # the stand-in's checks: context, module, pending faults
    src, name, nbufs, nvals = gpu.kernels[fn.module.kiln_binary]
    kernel = gpu.built[fn.module.kiln_binary]
    assert kernel is not None, f"kernel {name} launched on a GPU made with run=False"
    args = struct.unpack("=" + "Q" * nbufs + "i" * nvals, bytes(buf))
    kernel([gpu.addr(p) for p in args[:nbufs]], list(args[nbufs:]), tuple(grid), tuple(block))
    gpu.stats["launches"] += 1

  def module_from_buffer(b: bytes) -> Any:
    key = bytes(b)
    if key not in gpu.kernels and key.startswith(_TOKEN): gpu.kernels[key] = tuple(json.loads(key[len(_TOKEN):]))  # from the disk cache
    if key not in gpu.kernels: raise drv.RuntimeError("cuModuleLoadDataEx failed: a binary this emulated GPU did not compile")
    m = load(b)
    m.kiln_binary = key
    src, name, _, _ = gpu.kernels[key]
    if key not in gpu.built: gpu.built[key] = compile_emulator(src, name) if run else None  # at load, as a GPU's module
    cls = type(m)
    if not getattr(cls, "kiln_emulated", False):  # the stand-in's Module and Function classes, patched once
      get = cls.get_function
      def get_function(self: Any, fname: str) -> Any:
        fn = get(self, fname)
        fcls = type(fn)
        if not getattr(fcls, "kiln_emulated", False):
          launch = fcls._launch_kernel
          fcls._launch_kernel = lambda f, *a: launched(f, launch, *a)
          fcls.kiln_emulated = True
        return fn
      cls.get_function, cls.kiln_emulated = get_function, True
    return m

  drv.mem_alloc, drv.module_from_buffer = mem_alloc, module_from_buffer
  drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod = memcpy_htod, memcpy_dtoh, memcpy_dtod
  monkeypatch.setattr(CUDACompiler, "compile", compile_)
  return gpu


@contextmanager
def emulated_gpu(monkeypatch: Any, tmp_path: Path, cc: tuple[int, int] = (9, 0), nvcc: bool = False,
                 run: bool = True) -> Iterator[tuple[EmulatedGPU, list]]:
  """An emulated CUDA:0 of compute capability cc installed as pycuda.driver for the block: (gpu, the stand-in's call log).
  Afterwards the runtime is dropped and pycuda's context rules must have held."""
  mod = driver_tests()
  calls: list = []
  drv = mod.make_fake_driver(calls, cc=cc)
  gpu = emulating(drv, monkeypatch, nvcc, run)
  from kiln.runtime.cuda import emulate  # the tests' kernels are tiny: the host compiler's time is what counts
  monkeypatch.setattr(emulate, "CXXFLAGS", tuple("-O0" if f == "-O2" else f for f in emulate.CXXFLAGS))
  with installed(mod, monkeypatch, tmp_path, drv): yield gpu, calls
