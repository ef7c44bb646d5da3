"""LLVMCompiler: LLVM IR text to object code for this host with llvmlite (O3, loop and SLP vectorisation, the host CPU's
features, or those of the CPU KILN_CPU names)."""
from __future__ import annotations

import hashlib
import platform
import re
import threading
from functools import cache

import llvmlite
import llvmlite.binding as llvm

from kiln.codegen.spec import CompiledSpec, ProgramSpec
from kiln.ir.errors import CompileError
from kiln.runtime.cpu import settings
from kiln.runtime.cpu.machine import CPUChoice, choose_cpu, isa_of

# LLVM's global context and the JIT engines are not thread-safe: every parse, optimisation, emission and engine change of
# the process (compiles, kernel loads, the pool's and the spin's own code) holds this one lock. Reentrant: a load may make
# the shared engine on first use.
LLVM_LOCK = threading.RLock()


@cache
def init_llvm() -> None:
  # initialize() is deprecated in llvmlite; the native target and printer are all we need
  llvm.initialize_native_target()
  llvm.initialize_native_asmprinter()
  llvm.initialize_native_asmparser()


def jit_ir(ir: str, opt: int) -> llvm.ExecutionEngine:
  """A small hand-written IR module (the pool's loop, the spin, the core-trip probe) compiled into an engine of its own
  at codegen level `opt`, under LLVM_LOCK; the engine owns the code, kept for the life of the process by its caller."""
  with LLVM_LOCK:
    init_llvm()
    mod = llvm.parse_assembly(ir)
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, llvm.Target.from_default_triple().create_target_machine(opt=opt))
    engine.finalize_object()
    return engine


@cache
def host_cpu() -> tuple[str, str]:
  """(cpu name, feature string) of this machine, as LLVM sees it."""
  init_llvm()
  return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def host_vector_bytes() -> int: return isa_of(host_cpu()[1], platform.machine())[0]


def target_cpu(name: str | None = None, runnable: bool = True) -> CPUChoice:
  """The CPU to compile for: `name`, else KILN_CPU, else the host (DeviceError for a name kiln cannot target, or, when
  `runnable`, whose code this host cannot run)."""
  return choose_cpu(host_cpu(), platform.machine(), name if name is not None else settings.CPU.get(), runnable)


def _error_lines(src: str, message: str) -> str:
  """The source lines an LLVM diagnostic points at (`<string>:LINE:COL: error: ...`), with a little context."""
  lines = src.splitlines()
  out = []
  for m in re.finditer(r":(\d+):(\d+):", message):
    ln = int(m.group(1))
    for i in range(max(ln - 2, 1), min(ln + 1, len(lines)) + 1): out.append(f"{i:5d}{'>' if i == ln else ' '} {lines[i - 1]}")
  return "\n".join(dict.fromkeys(out))


# LLVM's SLP vectoriser is skipped in a module of more than this many scalar loads (_SCALAR_LOAD); None: never skipped
SLP_MAX_SCALAR_LOADS: int | None = 256
_SCALAR_LOAD = re.compile(r"= load (?:float|double|half|bfloat|i\d+), ptr")


def slp_pays(src: str) -> bool:
  """Whether LLVM's SLP vectoriser runs on this module. kiln emits its vectors itself; what SLP finds left is scalar
  loads, and a kernel of many (a pool's vector of lanes gathered one by one, unrolled over a 4x4 map: 500 loads) kept
  it searching for seconds (2.5 s of a 2,300-line module's compile, 0.1 s without) to pack gathers that run no faster."""
  return SLP_MAX_SCALAR_LOADS is None or len(_SCALAR_LOAD.findall(src)) <= SLP_MAX_SCALAR_LOADS


class LLVMCompiler:
  """Compiles a ProgramSpec's LLVM IR to object code for this host, or for the CPU `cpu` (else KILN_CPU) names."""

  def __init__(self, opt_level: int = 3, cpu: str | None = None, runnable: bool = True):
    """runnable=False: a compiler for reading another CPU's code (assembly) that this host may not run; the runtime only
    ever loads code from a runnable one."""
    init_llvm()
    self.choice = target_cpu(cpu, runnable)
    cpu, features = self.choice.cpu, self.choice.features
    self.cpu, self.features, self.opt_level = cpu, features, opt_level
    target = llvm.Target.from_default_triple()
    self.triple = target.triple
    self.tm = target.create_target_machine(cpu=cpu, features=features, opt=opt_level, reloc="pic", codemodel="default")
    ver = ".".join(map(str, llvm.llvm_version_info))
    feat = hashlib.sha256(features.encode()).hexdigest()[:16]
    named = f"{'KILN_CPU=' if self.choice.from_env else ''}{cpu}"
    self.cache_key = f"llvm-{ver}|llvmlite-{llvmlite.__version__}|{self.triple}|{named}|{feat}|O{opt_level}|slp{SLP_MAX_SCALAR_LOADS}"
    # the CPU as LLVM targets it (a KILN_CPU name has features "", so it never shares a key with the host's full set):
    # the disk cache needs no /proc/cpuinfo read
    self.fingerprint = f"{named}|{feat}"

  def optimize(self, mod: llvm.ModuleRef, src: str) -> None:
    pto = llvm.PipelineTuningOptions(speed_level=self.opt_level)
    pto.loop_vectorization = True
    pto.slp_vectorization = slp_pays(src)
    # the lowering unrolls where it pays (register tiles, reduce bodies); LLVM's own unroller on top of the vectoriser
    # turned small byte-typed loops into 7,000-line modules (an int8 row product: 3.4 s to compile, 21 ms without it)
    pto.loop_unrolling = False
    pb = llvm.create_pass_builder(self.tm, pto)
    pm = pb.getModulePassManager()
    pm.run(mod, pb)

  def to_module(self, src: str) -> llvm.ModuleRef:
    try:
      mod = llvm.parse_assembly(src)
      mod.verify()
    except RuntimeError as e:
      raise CompileError("LLVM rejected the generated IR", log=str(e).strip(), source_lines=_error_lines(src, str(e))) from None
    mod.triple = self.triple
    mod.data_layout = str(self.tm.target_data)
    return mod

  def compile_module(self, src: str) -> bytes:
    with LLVM_LOCK:
      mod = self.to_module(src)
      self.optimize(mod, src)
      return bytes(self.tm.emit_object(mod))

  def assembly(self, src: str) -> str:
    """The optimised machine code as text (KILN_DEBUG and benchmarks look at it)."""
    with LLVM_LOCK:
      mod = self.to_module(src)
      self.optimize(mod, src)
      return str(self.tm.emit_assembly(mod))

  def compile(self, spec: ProgramSpec) -> CompiledSpec:
    return CompiledSpec.from_program(spec, src=spec.src, data=self.compile_module(spec.src), compiler=self.cache_key)
