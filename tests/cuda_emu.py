"""A GPU on the CPU for the suite's cross-layer CUDA tests: kiln-runtime-cuda's recording stand-in for pycuda.driver (its
context rules and records kept), given memory and kernels that run.

- every allocation has host memory behind it (256-byte aligned, as cuMemAlloc's), and the copies move bytes;
- CUDACompiler.compile is replaced: the binary is a token naming the rendered CUDA C (no nvcc, which costs a second or more a
  kernel), or, with nvcc=True, nvcc's real fatbin (checked against the device's architecture by the stand-in) remembered
  beside its source;
- a launch runs that source under kiln.runtime.cuda.emulate (the host C++ compiler) on the grid and block CUDA was asked
  for, with the argument buffer's device pointers turned into host addresses, there and then: the stand-in's one stream
  runs in order, so every copy and launch sees the work queued before it.

What this cannot show is listed in emulate's docstring (warps, FMA contraction, out-of-bounds accesses); what it does
show is that a plan's kernels, buffers, views and copies compute the right values through the CUDA runtime's own code."""
from __future__ import annotations

import bisect
import hashlib
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


def emulating(drv: Any, monkeypatch: Any, nvcc: bool = False) -> EmulatedGPU:
  """Turn the stand-in `drv` (test_driver.make_fake_driver) into an emulated GPU in place; patches CUDACompiler.compile."""
  gpu = EmulatedGPU()
  alloc, htod, dtoh, dtod, load = drv.mem_alloc, drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod, drv.module_from_buffer
  real_compile = CUDACompiler.compile

  def compile_(self: CUDACompiler, spec: ProgramSpec) -> CompiledSpec:
    if nvcc: data = real_compile(self, spec).bytes
    else: data = _TOKEN + hashlib.sha256(f"{spec.name}|{spec.src}".encode()).hexdigest().encode()
    gpu.kernels[bytes(data)] = (spec.src, spec.name, spec.buf_count, len(spec.var_names))
    return CompiledSpec.from_program(spec, src=spec.src, data=data, compiler=self.cache_key)

  def mem_alloc(size: int) -> Any:
    a = alloc(-size % _ALIGN + size)  # the stand-in lays allocations end to end: whole multiples keep each one aligned
    bisect.insort(gpu.bases, int(a))
    gpu.host[int(a)] = _host_bytes(size)
    free = a.free
    def freed() -> None:
      free()
      gpu.bases.remove(int(a))
      del gpu.host[int(a)]
    a.free = freed
    return a

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

  def module_from_buffer(b: bytes) -> Any:
    m = load(b)
    src, name, nbufs, nvals = gpu.kernels[bytes(b)]
    kernel = compile_emulator(src, name)  # built at load, as a GPU's module: a plan's loads run on the builder's threads
    get = m.get_function
    def get_function(fname: str) -> Any:
      assert fname == name, (fname, name)
      fn = get(fname)
      launch = fn._launch_kernel
      def launched(grid: Any, block: Any, buf: bytes, shared: int, stream: Any) -> None:
        launch(grid, block, buf, shared, stream)  # the stand-in's checks: context, module, pending faults
        args = struct.unpack("=" + "Q" * nbufs + "i" * nvals, bytes(buf))
        kernel([gpu.addr(p) for p in args[:nbufs]], list(args[nbufs:]), tuple(grid), tuple(block))
        gpu.stats["launches"] += 1
      fn._launch_kernel = launched
      return fn
    m.get_function = get_function
    return m

  drv.mem_alloc, drv.module_from_buffer = mem_alloc, module_from_buffer
  drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod = memcpy_htod, memcpy_dtoh, memcpy_dtod
  monkeypatch.setattr(CUDACompiler, "compile", compile_)
  return gpu


@contextmanager
def emulated_gpu(monkeypatch: Any, tmp_path: Path, cc: tuple[int, int] = (9, 0), nvcc: bool = False) -> Iterator[tuple[EmulatedGPU, list]]:
  """An emulated CUDA:0 of compute capability cc installed as pycuda.driver for the block: (gpu, the stand-in's call log).
  Afterwards the runtime is dropped and pycuda's context rules must have held."""
  mod = driver_tests()
  calls: list = []
  drv = mod.make_fake_driver(calls, cc=cc)
  gpu = emulating(drv, monkeypatch, nvcc)
  with installed(mod, monkeypatch, tmp_path, drv): yield gpu, calls
