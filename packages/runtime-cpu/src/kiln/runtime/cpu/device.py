"""The CPU and DISK runtimes, registered under the `kiln.devices` entry points."""
from __future__ import annotations

import platform
from typing import Any

from kiln.codegen.choose import Target
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.codegen.spec import CompiledSpec, DeviceSpec
from kiln.codegen.threads import available_cores
from kiln.ir.errors import DeviceError
from kiln.runtime.cpu.allocator import CPUAllocator
from kiln.runtime.cpu.compiler import LLVMCompiler, target_cpu
from kiln.runtime.cpu.disk import DiskAllocator
from kiln.runtime.cpu.machine import CPUChoice, is_x86, read_caches, stream_store_bytes
from kiln.runtime.cpu.program import CPUProgram, shared_engine

# outputs from this size up are written with streaming (non-temporal) stores on x86: far past the L2, they would only
# evict what the caches hold and cost a read-for-ownership each line; from this host's caches (machine.stream_store_bytes)
HOST_CACHES = read_caches()  # read once per process: the caches do not change under it
STREAM_STORE_BYTES = stream_store_bytes(HOST_CACHES)


def cpu_target(choice: CPUChoice | None = None) -> Target:
  """The machine model: vector width and registers of the CPU compiled for (the host, or KILN_CPU), the caches sysfs
  reports, the physical cores this process may use. Its `threads` are those cores, never KILN_THREADS: a split kernel's chunks
  are claimed by however many threads run it, so the code is the same for any thread count and KILN_THREADS=1 shares
  the disk cache's entries with the default (issue 39)."""
  c, caches, cores = choice or target_cpu(), HOST_CACHES, available_cores()
  return Target(device="CPU", vector_bytes=c.vector_bytes, vector_registers=c.vector_registers, fma=c.fma, round=c.round,
                dot_bytes=c.dot_bytes, threads=cores,
                stream_store_bytes=stream_store_bytes(caches) if is_x86(platform.machine()) else 0, l1d_bytes=caches[1], l2_bytes=caches[2],
                l3_bytes=caches[3], cores=cores)


class CPURuntime:
  """The embedded default device: LLVM IR through llvmlite, run in-process."""
  host_parallel_safe = True

  def __init__(self, spec: DeviceSpec | str = "CPU"):
    self.spec = DeviceSpec.parse(spec)
    self.device = str(self.spec)
    self.compiler = LLVMCompiler()
    self.target = cpu_target(self.compiler.choice)
    self.renderer = LLVMRenderer(self.target)
    t = self.target  # the render choices live in the code too
    self.compiler.cache_key += (f"|vec{t.vector_bytes}|regs{t.vector_registers}|cores{t.cores}|stream{t.stream_store_bytes}"
                                f"|dot{t.dot_bytes}|fma{int(t.fma)}|round{int(t.round)}")
    self.allocator = CPUAllocator()
    shared_engine()  # the JIT engine every program loads into: made once, here, not on a first cache hit

  def core_trip_ns(self) -> float | None:
    """A cache line's round trip between two of this process's cores, measured now (kiln.runtime.cpu.core_trip): what a
    split kernel's hand-offs cost. Benchmarks print it beside their times. None where it cannot be measured (one CPU)."""
    from kiln.runtime.cpu.core_trip import round_trip_ns
    return round_trip_ns()

  @property
  def compile_threads(self) -> int:
    """How many kernels a plan's builder compiles at once (kiln.graph.schedule.precompile): one per core. LLVM's part runs
    under one lock (its global context), with the GIL released, so a second thread renders the next kernel meanwhile."""
    return self.target.cores

  @property
  def compile_processes(self) -> bool:
    """Whether a plan's kernels compile in worker processes (kiln.executor.compile_pool): yes, as threads cannot compile two
    at once here: the lowering is Python (the GIL), and llvmlite runs every LLVM call under one process-wide lock."""
    return True

  def load(self, compiled: CompiledSpec) -> CPUProgram: return CPUProgram(compiled)
  def synchronize(self) -> None: pass


class DiskRuntime:
  """DISK:/path: read-only file regions mapped into memory. It holds data; it runs no kernels."""
  host_parallel_safe = True

  def __init__(self, spec: DeviceSpec | str):
    self.spec = DeviceSpec.parse(spec)
    self.device = str(self.spec)
    self.allocator = DiskAllocator(self.spec.path)

  @property
  def renderer(self) -> Any: raise DeviceError(f"{self.device} holds data only; kernels run on CPU (copy the buffer there first)")
  @property
  def compiler(self) -> Any: raise DeviceError(f"{self.device} holds data only; it compiles nothing")
  def load(self, compiled: CompiledSpec) -> Any: raise DeviceError(f"{self.device} holds data only; it runs no kernels")
  def synchronize(self) -> None: pass
