"""An in-process Runtime over numpy for executor tests: it implements kiln.codegen.protocols without compiling anything.

Kernels are real kiln ASTs built by `elementwise(...)`: out[i] = sum(in_k[i]) + add for i < n (n an int or a variable).
The "program" runs that in numpy on the raw buffer addresses it is handed, records (name, start, end, vals, global_size)
for every run, and can sleep or fail on request (BEHAVIOR) so scheduling and poisoning can be observed.
"""
from __future__ import annotations

import ctypes
import importlib.util
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from kiln.codegen.spec import CompiledSpec, DeviceSpec, KernelArg, ProgramSpec, Variable
from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

try:
  from kiln.ir.reference import evaluate
except ImportError:
  evaluate = None  # type: ignore[assignment]

BEHAVIOR: dict[str, dict[str, Any]] = {}  # kernel name -> {"sleep": s, "fail": bool, "compile_sleep": s, "compile_fail": n}
EVENTS: list[tuple[str, float, float, tuple[int, ...], tuple[int, ...]]] = []
STATS = {"compiles": 0, "loads": 0, "allocs": 0, "frees": 0}
_lock = threading.Lock()


CUDA_TESTS = Path(__file__).resolve().parents[2] / "runtime-cuda" / "tests"  # kiln-runtime-cuda's tests, beside its tools/


def cuda_test_module(file: str) -> ModuleType:
  """kiln-runtime-cuda's tests/<file> (test_driver.py: its pycuda.driver stand-in; test_graph.py: libcuda's graph calls),
  loaded by path, as it is no installed module. Skips the calling test where kiln-runtime-cuda or nvcc is missing."""
  if importlib.util.find_spec("kiln.runtime.cuda") is None: pytest.skip("kiln-runtime-cuda is not installed")
  from kiln.runtime.cuda.compiler import find_nvcc
  if find_nvcc() is None: pytest.skip("nvcc (CUDA toolkit) is not installed")
  spec = importlib.util.spec_from_file_location(f"kiln_cuda_tests_{Path(file).stem}", CUDA_TESTS / file)
  assert spec is not None and spec.loader is not None
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def reset() -> None:
  BEHAVIOR.clear(); EVENTS.clear()
  for k in STATS: STATS[k] = 0


def elementwise(name: str, out: int, ins: Sequence[int], n: int | UOp, size: int | None = None, add: float = 1.0,
                dtype: DType = dtypes.float32) -> UOp:
  size = size if size is not None else (n if isinstance(n, int) else n.arg[2])
  c = UOp.define_global(out, dtype.ptr(size))
  i = UOp.range(n, 0)
  val: UOp = UOp.const(dtype, add)
  for s in ins: val = UOp.define_global(s, dtype.ptr(size)).index(i).load() + val
  return UOp.sink(c.index(i).store(val), name=name)


class TestRenderer:
  device = "CPU"

  def render(self, ast: UOp, opts: Any = None) -> ProgramSpec:
    nodes = ast.toposort()
    gl = {u.arg: u for u in nodes if u.op is Ops.DEFINE_GLOBAL}
    outs = sorted({u.src[0].src[0].arg for u in nodes if u.op is Ops.STORE})
    ins = sorted({u.src[0].src[0].arg for u in nodes if u.op is Ops.LOAD})
    dvars = sorted({u.arg for u in nodes if u.op is Ops.DEFINE_VAR})
    rng = [u for u in nodes if u.op is Ops.RANGE]
    gs0 = rng[0].src[0] if rng and rng[0].src[0].op is not Ops.CONST else (int(rng[0].src[0].arg) if rng else 1)
    spec = ProgramSpec.new(ast.arg or "kernel", f"; test kernel {ast.arg}\n; {ast.key}", "CPU", ast)
    for name, lo, hi in dvars: spec.add_var(Variable(name=name, min=lo, max=hi))
    spec.set_buffer_metadata(sorted(gl), outs, ins)
    spec.args = [KernelArg(slot=s, dtype=str(gl[s].dtype.base), size=gl[s].dtype.size) for s in sorted(gl)]
    spec.set_work_sizes((gs0, 1, 1), None)
    spec.flops, spec.mem_bytes = 1 << 12, 1 << 14
    return spec


class TestCompiler:
  cache_key = "testcc-1"

  def compile(self, spec: ProgramSpec) -> CompiledSpec:
    b = BEHAVIOR.get(spec.name, {})
    time.sleep(b.get("compile_sleep", 0))
    with _lock:
      STATS["compiles"] += 1
      if b.get("compile_fail", 0) > 0:
        b["compile_fail"] -= 1
        raise RuntimeError(f"injected compile failure for {spec.name}")
    return CompiledSpec.from_program(spec, src=spec.src, compiler=self.cache_key)


class TestAllocator:
  def alloc(self, size: int, options: Any = None) -> np.ndarray:
    STATS["allocs"] += 1
    raw = np.zeros(size + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + size]

  def free(self, handle: Any, size: int, options: Any = None) -> None: STATS["frees"] += 1
  def ptr(self, handle: np.ndarray) -> int: return int(handle.ctypes.data)
  def copyin(self, dest: np.ndarray, src: memoryview) -> None: dest[:] = np.frombuffer(src, np.uint8)
  def copyout(self, dest: memoryview, src: np.ndarray) -> None: np.frombuffer(dest, np.uint8)[:] = src
  def as_numpy(self, handle: np.ndarray, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
    dt = np.dtype(dtype)
    return handle[offset:offset + count * dt.itemsize].view(dt)


def _arr(ptr: int, dtype: str, size: int) -> np.ndarray:
  dt = np.dtype(dtype)
  return np.frombuffer((ctypes.c_uint8 * (size * dt.itemsize)).from_address(ptr), dtype=dt)


class TestProgram:
  def __init__(self, compiled: CompiledSpec):
    self.name, self.compiled = compiled.name, compiled
    self.nvar = {u.arg[0]: u for u in compiled.ast.toposort() if u.op is Ops.DEFINE_VAR}

  def __call__(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
               local_size: Sequence[int] | None = None, wait: bool = False) -> float | None:
    b = BEHAVIOR.get(self.name, {})
    st = time.perf_counter()
    if b.get("fail"): raise RuntimeError(f"injected launch failure in {self.name}")
    if b.get("sleep"): time.sleep(b["sleep"])
    arrs = {a.slot: _arr(p, a.dtype, a.size) for a, p in zip(self.compiled.args, bufs)}
    if evaluate is not None:  # the IR's reference evaluator is the oracle: run the real AST
      evaluate(self.compiled.ast, [arrs[s] for s in range(max(arrs) + 1)], dict(zip(self.compiled.var_names, vals)))
    else:  # fallback while kiln.ir.reference is missing: what elementwise() builds
      n, out = int(global_size[0]), self.compiled.outs[0]
      add = [u.arg for u in self.compiled.ast.toposort() if u.op is Ops.CONST and isinstance(u.arg, float)]
      acc = np.full(n, add[0] if add else 0.0, dtype=arrs[out].dtype)
      for s in self.compiled.ins: acc = arrs[s][:n] + acc
      arrs[out][:n] = acc
    en = time.perf_counter()
    with _lock: EVENTS.append((self.name, st, en, tuple(vals), tuple(global_size)))
    return en - st if wait else None

  def bind(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
           local_size: Sequence[int] | None = None) -> TestBound:
    return TestBound(self, list(bufs), list(vals), tuple(global_size), local_size)


class TestBound:
  def __init__(self, prg: TestProgram, bufs: list[int], vals: list[int], gs: tuple, ls: Any):
    self.prg, self.bufs, self.vals, self.gs, self.ls = prg, bufs, vals, gs, ls

  def __call__(self) -> None: self.prg(self.bufs, self.vals, self.gs, self.ls)

  def set_vals(self, vals: Sequence[int], global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None) -> None:
    self.vals = list(vals)
    if global_size is not None: self.gs = tuple(global_size)
    if local_size is not None: self.ls = tuple(local_size)


class TestRuntime:
  host_parallel_safe = True

  def __init__(self, spec: DeviceSpec | None = None):
    self.device = "CPU"
    self.renderer, self.compiler, self.allocator = TestRenderer(), TestCompiler(), TestAllocator()

  def load(self, compiled: CompiledSpec) -> TestProgram:
    with _lock: STATS["loads"] += 1
    return TestProgram(compiled)

  def synchronize(self) -> None: pass


def install() -> None:
  from kiln.codegen.registry import register_runtime
  register_runtime("CPU", TestRuntime)



def requires_cpu_runtime() -> pytest.MarkDecorator:
  """A skip mark for test modules that need the real CPU runtime (kiln-runtime-cpu). Call it at a module's import, before
  any test registers this module's stand-in as "CPU"."""
  from kiln.codegen.registry import get_runtime
  try:
    get_runtime("CPU")
    have = True
  except Exception: have = False
  return pytest.mark.skipif(not have, reason="kiln-runtime-cpu is not installed")
