"""CPUProgram: loads object code in-process and calls it through ctypes (the GIL is released during the call)."""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import operator
import time
from collections.abc import Sequence
from functools import cache

import llvmlite.binding as llvm

from kiln.codegen.spec import CompiledSpec
from kiln.codegen.threads import CORE_ID
from kiln.ir.errors import CompileError, RuntimeLaunchError, VariableBoundsError
from kiln.runtime.cpu import running
from kiln.runtime.cpu.bound import CPUBoundCall
from kiln.runtime.cpu.compiler import LLVM_LOCK, init_llvm

# math the generated code may call (LLVM lowers exp2/log2/sin intrinsics on vectors and scalars to libm)
_LIBM_SYMBOLS = ("exp2f", "exp2", "log2f", "log2", "sinf", "sin", "sqrtf", "sqrt", "truncf", "trunc", "fmaxf", "fmax",
                 "erff", "erf", "tanhf", "tanh")  # called directly: LLVM has no erf/tanh intrinsic
_LIBGCC_SYMBOLS = ("__truncsfhf2", "__extendhfsf2", "__truncdfhf2", "__truncsfbf2", "__truncdfbf2")


def _open_lib(soname: str, short: str) -> ctypes.CDLL | None:
  # the usual soname first: find_library runs ldconfig in a subprocess, which costs milliseconds per new process
  try: return ctypes.CDLL(soname)
  except OSError: pass
  if (path := ctypes.util.find_library(short)) is None: return None
  try: return ctypes.CDLL(path)
  except OSError: return None


@cache
def _register_symbols() -> None:
  init_llvm()
  for soname, short, names in (("libm.so.6", "m", _LIBM_SYMBOLS), ("libgcc_s.so.1", "gcc_s", _LIBGCC_SYMBOLS)):
    if (lib := _open_lib(soname, short)) is None: continue
    for n in names:
      try: llvm.add_symbol(n, ctypes.cast(getattr(lib, n), ctypes.c_void_p).value)
      except AttributeError: pass  # this libm/libgcc lacks it; LLVM only asks for what the code uses


_TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)  # NAME.task(ptr args, i32 slot)


def _new_engine() -> llvm.ExecutionEngine:
  # the engine owns its target machine (llvmlite frees it with the engine), so each engine gets its own. MCJIT must be
  # made with a module, but is given back that empty one at once: left in, the first finalize_object() would run the
  # whole codegen pipeline on it (0.6 ms per engine, 1.7 ms for the process's first), and only object files go in here.
  empty = llvm.parse_assembly("")
  engine = llvm.create_mcjit_compiler(empty, llvm.Target.from_default_triple().create_target_machine())
  engine.remove_module(empty)
  return engine


class _SharedEngine:
  """One MCJIT engine for every program of the process: adding an object to a warm engine costs ~0.06 ms, a new
  engine ~0.3 ms. Code stays loaded for the life of the process (kernels are few and small). A symbol already taken by
  other code (same name, different bytes) is refused; that program gets an engine of its own."""

  def __init__(self) -> None:
    self.engine = _new_engine()
    self.symbols: dict[str, tuple[bytes, int]] = {}
    self.added: set[bytes] = set()  # digests of the objects in the engine: the same code is never added twice

  def address(self, symbol: str) -> int:
    """A symbol of an object already loaded here (0: none)."""
    return self.engine.get_function_address(symbol)

  def load(self, symbol: str, obj: bytes) -> int | None:
    digest = hashlib.sha256(obj).digest()
    if (hit := self.symbols.get(symbol)) is not None: return hit[1] if hit[0] == digest else None
    if digest not in self.added:
      self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
      self.engine.finalize_object()
      self.added.add(digest)
    addr = self.engine.get_function_address(symbol)
    if addr: self.symbols[symbol] = (digest, addr)
    return addr


@cache
def shared_engine() -> _SharedEngine:
  init_llvm()
  _register_symbols()  # libm/libgcc addresses, once, before any object needs them
  return _SharedEngine()


class CPUProgram:
  """One compiled kernel. Thread-safe: concurrent calls share only immutable state. `plan_running` (PlanRunning): a plan
  holding a split kernel tells the pool it runs, so its workers spin between kernels."""

  plan_running = staticmethod(running.plan_running)

  def __init__(self, compiled: CompiledSpec):
    if not compiled.bytes: raise CompileError(f"kernel {compiled.name}: no object code to load (was it compiled for the CPU?)")
    self.name, self.spec = compiled.name, compiled
    self.threads = compiled.threads
    self.user_vars = [v for v in compiled.var_names if v != CORE_ID]
    if self.threads > 1 and CORE_ID not in compiled.var_names:
      raise RuntimeLaunchError(f"kernel {self.name} is split over {self.threads} threads but takes no core_id variable")
    self.bounds = {v.name: (v.min, v.max) for v in compiled.vars}
    _register_symbols()
    self.entry = compiled.entry_point or compiled.name
    self._engine: llvm.ExecutionEngine | None = None
    with LLVM_LOCK:  # an engine change beside a compile in another thread aborted inside LLVM
      addr = shared_engine().load(self.entry, compiled.bytes)
      if addr is None:  # its symbol is taken by other code: an engine of its own
        self._engine = _new_engine()
        self._engine.add_object_file(llvm.ObjectFileRef.from_data(compiled.bytes))
        self._engine.finalize_object()
        addr = self._engine.get_function_address(self.entry)
      # the task entry, for native callers: the pool's workers, a plan's sequence (0 in object code from before every
      # kernel had one: Python calls the entry)
      lookup = self._engine.get_function_address if self._engine is not None else shared_engine().address
      self.task = lookup(self.entry + ".task") if addr else 0
    if not addr: raise CompileError(f"kernel {self.name}: symbol {self.entry} not found in its object code")
    self.scratch_bytes = compiled.scratch_bytes  # per-call scratch: a threaded reduction's partials, packed panels
    self.finish_call = compiled.finish  # a threaded reduction's finishing call (core_id == threads)
    self.slots = compiled.slots  # a split kernel's threads with scratch of their own (0: any number of threads)
    self.task_fn = _TASK(self.task) if self.task else None  # Python's way in through the task entry (bound.py)
    argtypes = [ctypes.c_void_p] * compiled.buf_count + [ctypes.c_int32] * len(self.user_vars)
    if self.threads > 1: argtypes += [ctypes.c_int32, ctypes.c_void_p]  # the thread's slot, the chunk counter
    if self.scratch_bytes: argtypes.append(ctypes.c_void_p)
    self.fn = ctypes.CFUNCTYPE(None, *argtypes)(addr)

  def check(self, bufs: Sequence[int], vals: Sequence[int]) -> tuple[list[int], list[int]]:
    """Validate addresses and values; returns them as Python ints (numpy integers are welcome)."""
    if len(bufs) != self.spec.buf_count:
      raise RuntimeLaunchError(f"kernel {self.name} takes {self.spec.buf_count} buffers (slots {self.spec.globals}), got {len(bufs)}")
    ptrs = [_as_int(p) for p in bufs]
    for slot, p, raw in zip(self.spec.globals, ptrs, bufs):
      if p is None or p <= 0: raise RuntimeLaunchError(f"kernel {self.name}: buffer for slot {slot} is not a valid address ({raw!r})")
    return ptrs, self.check_vals(vals)  # type: ignore[return-value]  # the loop above refused a None

  def check_vals(self, vals: Sequence[int]) -> list[int]:
    """Validate variable values against the kernel's bounds; returns them as Python ints."""
    if len(vals) != len(self.user_vars):
      raise RuntimeLaunchError(f"kernel {self.name} takes {len(self.user_vars)} variable values {self.user_vars}, got {len(vals)}")
    ivals = [_as_int(v) for v in vals]
    for n, v, raw in zip(self.user_vars, ivals, vals):
      lo, hi = self.bounds.get(n, (-(2**31), 2**31 - 1))
      if v is None: raise VariableBoundsError(f"variable {n} must be an integer, got {raw!r}")
      if not lo <= v <= hi: raise VariableBoundsError(f"variable {n}={v} is outside bounds [{lo}, {hi}]")
    return ivals  # type: ignore[return-value]

  def __call__(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
               local_size: Sequence[int] | None = None, wait: bool = False) -> float | None:
    call = self.bind(bufs, vals)
    st = time.perf_counter()
    call()
    return time.perf_counter() - st if wait else None

  def bind(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[int] | None = None,
           local_size: Sequence[int] | None = None) -> CPUBoundCall:
    ptrs, ivals = self.check(bufs, vals)
    return CPUBoundCall(self, ptrs, ivals)


def _as_int(x: object) -> int | None:
  if isinstance(x, bool): return None
  try: return operator.index(x)  # type: ignore[arg-type]
  except TypeError: return None
