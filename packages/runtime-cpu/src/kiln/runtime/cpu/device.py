"""The CPU and DISK runtimes, registered under the `kiln.devices` entry points."""
from __future__ import annotations

from typing import Any

from kiln.codegen.device import DeviceSpec
from kiln.codegen.opt import Target
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.codegen.spec import CompiledSpec
from kiln.ir.errors import DeviceError
from kiln.runtime.cpu.allocator import CPUAllocator
from kiln.runtime.cpu.compiler import LLVMCompiler, host_vector_bytes
from kiln.runtime.cpu.disk import DiskAllocator
from kiln.runtime.cpu.program import CPUProgram, shared_engine
from kiln.runtime.cpu.threads import thread_count


def cpu_target() -> Target:
  return Target(device="CPU", vector_bytes=host_vector_bytes(), threads=thread_count())


class CPURuntime:
  """The embedded default device: LLVM IR through llvmlite, run in-process."""
  host_parallel_safe = True

  def __init__(self, spec: DeviceSpec | str = "CPU"):
    self.spec = DeviceSpec.parse(spec)
    self.device = str(self.spec)
    self.target = cpu_target()
    self.renderer = LLVMRenderer(self.target)
    self.compiler = LLVMCompiler()
    self.compiler.cache_key += f"|vec{self.target.vector_bytes}|threads{self.target.threads}"  # the render choices live in the code too
    self.allocator = CPUAllocator()
    shared_engine()  # the JIT engine every program loads into: made once, here, not on a first cache hit

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
