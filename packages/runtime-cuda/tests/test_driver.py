"""The launch path over a recording stand-in for pycuda.driver (no GPU here), and the clear error without pycuda."""
import gc
import struct
import sys
import threading
import types
import warnings
from importlib.metadata import entry_points

import numpy as np
import pytest

from kiln.codegen import registry as devmod
from kiln.codegen.spec import CompiledSpec, Variable
from kiln.ir import UOp, dtypes
from kiln.ir.errors import DeviceError, RuntimeLaunchError
from kiln.runtime.cuda.compiler import CUDACompiler, find_nvcc
from kiln.runtime.cuda.driver import CUDAAllocator, CUDARuntime, launch_dims

# no relative imports: tests/test_planspec_cuda.py loads this file on its own for make_fake_driver
requires_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
EW_F32 = """extern "C" __global__ void __launch_bounds__(64) ew_f32(float* __restrict__ data0, const float* __restrict__ data1) {
  int i = blockIdx.x * 64 + threadIdx.x;
  data0[i] = data1[i] * 2.0f;
}"""


class FakeFault:
  """Make the stand-in's next launch in a context fail the way a real kernel fault does: asynchronously (the launch returns;
  the error shows at the next call in that context) and stickily (every later call in that context fails the same way)."""
  ILLEGAL_ADDRESS = "an illegal memory access was encountered"


def install_standin(monkeypatch, tmp_path, drv) -> None:
  """Make `drv` (a make_fake_driver stand-in) the pycuda.driver this process imports, with kiln's disk cache off and private
  and the CUDA runtime registered afresh. Tests elsewhere load this file by path and call it from their fixtures (clearing
  the executor's memory cache themselves: this layer does not import the executor)."""
  pkg = types.ModuleType("pycuda")
  pkg.driver = drv  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, "pycuda", pkg)
  monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
  monkeypatch.delenv("KILN_CUDA_ARCH", raising=False)
  monkeypatch.setenv("KILN_CACHE", "0")
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  devmod.unregister_runtime("CUDA")


def make_fake_driver(calls: list, cc=(8, 6), ndev=1, mem_limit=None):
  """A stand-in for pycuda.driver that records every call and enforces pycuda's context rules (read from pycuda 2026.1's
  src/cpp/cuda.hpp): a context stack per host thread (threading.local); a thread, or the process, that ends with a context
  still on its stack aborts ("The context stack was not empty"): recorded in drv._problems(), which the tests' fixture fails
  on; allocations, module loads, copies, events, synchronize and launches need a current context (LogicError "invalid device
  context" otherwise); a launch needs its module's context current; freeing an allocation from a thread other than the one
  its context was created on, without that context current, is refused (pycuda warns and leaks it: recorded as a problem);
  device addresses belong to one device, and a copy or launch in another device's context fails. Sticky faults
  (drv._fault_next_launch) poison the context as an illegal address does on a GPU. cc is each device's compute capability;
  module_from_buffer refuses a real cubin for another architecture and a fatbin with neither matching SASS nor PTX it can JIT."""
  drv = types.ModuleType("pycuda.driver")
  problems: list[str] = []
  state: dict = {"next": {}, "live": 0, "owners": [], "sticky": {}, "fault": None, "allocs": {}}
  tls = threading.local()

  class Error(Exception): pass
  class MemoryError(Error): pass  # noqa: A001 (pycuda's names)
  class LogicError(Error): pass
  class LaunchError(Error): pass
  class RuntimeError(Error): pass  # noqa: A001

  class _Stack:  # one per host thread; pycuda aborts when it is destroyed non-empty (the thread ends)
    def __init__(self):
      self.items: list = []
      self.thread = threading.current_thread()
      state["owners"].append(self)
    def __del__(self):
      if self.items: problems.append(f"abort: thread {self.thread.name} ended with a non-empty context stack")

  def stack() -> list:
    if not hasattr(tls, "stack"): tls.stack = _Stack()
    return tls.stack.items

  def current(what: str):
    s = stack()
    if not s: raise LogicError(f"{what} failed: invalid device context - no currently active context?")
    ctx = s[-1]
    if (why := state["sticky"].get(ctx.dev)) is not None: raise LogicError(f"{what} failed: {why}")
    return ctx

  def launched(ctx) -> None:
    """Work was queued in ctx (a launch, or a CUDA graph's: tests/test_graph.py's stand-in libcuda): a pending fault strikes."""
    if state["fault"] is not None: state["sticky"][ctx.dev], state["fault"] = state["fault"], None

  def owner(ptr: int):
    for a in state["allocs"].values():
      if a.valid and a.ptr <= ptr < a.ptr + a.size: return a
    return None

  def released(ctx, what: str) -> bool:
    """pycuda's scoped_context_activation in a destructor or free: False (and a recorded leak) when ctx is not current and
    this is not the thread ctx was created on."""
    s = stack()
    if (not s or s[-1] is not ctx) and threading.current_thread() is not ctx.thread:
      problems.append(f"leak: {what} cleaned up on thread {threading.current_thread().name} without its context current")
      warnings.warn(f"{what} in out-of-thread context could not be cleaned up", UserWarning, stacklevel=3)
      return False
    return True

  def on_device(ctx, ptr: int, what: str) -> None:
    a = owner(ptr)
    if a is not None and a.ctx.dev != ctx.dev: raise LogicError(f"{what} failed: invalid argument (address of device {a.ctx.dev})")

  class DeviceAllocation:
    def __init__(self, size, ctx):
      base = state["next"].setdefault(ctx.dev, 0x10000 + (ctx.dev << 40))
      self.ptr, self.size, self.ctx, self.valid = base, size, ctx, True
      state["next"][ctx.dev] = base + size + 256
      state["allocs"][self.ptr] = self
    def __int__(self): return self.ptr
    def free(self):
      if not self.valid: raise LogicError("device_allocation::free failed: invalid resource handle")
      self.valid = False
      if not released(self.ctx, f"device_allocation {self.ptr:#x}"): return
      calls.append(("free", self.ptr))
      state["live"] -= self.size
    def __del__(self):  # pycuda frees a live allocation in its destructor, on whichever thread drops the last reference
      if self.valid: self.free()

  def mem_alloc(size):
    ctx = current("cuMemAlloc")
    if mem_limit is not None and state["live"] + size > mem_limit: raise MemoryError("cuMemAlloc failed: out of memory")
    state["live"] += size
    calls.append(("mem_alloc", size))
    return DeviceAllocation(size, ctx)

  def binary_ok(data: bytes, dev: int) -> str | None:
    """Why a real binary cannot run on the device (None: it can, or it is not a real cubin/fatbin)."""
    major, minor = cc if isinstance(cc, tuple) else cc[dev]
    if (arches := fatbin_entries(data)) is not None:
      ok = any((k == "elf" and a // 10 == major and a % 10 <= minor) or (k == "ptx" and a <= major * 10 + minor) for k, a in arches)
      return None if ok else f"fatbin has {arches}"
    if (a := cubin_arch(data)) is not None and not (a // 10 == major and a % 10 <= minor): return f"cubin for sm_{a}"
    return None

  class Function:
    def __init__(self, name, module): self.name, self.module = name, module
    def _launch_kernel(self, grid, block, buf, shared, stream):
      ctx = current("cuLaunchKernel")
      if ctx != self.module.ctx: raise LogicError("cuLaunchKernel failed: invalid resource handle (a function of another context)")
      calls.append(("launch", self.name, tuple(grid), tuple(block), buf))
      launched(ctx)
    def prepare(self, fmt): calls.append(("prepare", self.name, fmt))  # pycuda's deprecated block-shape interface
    def set_attribute(self, attr, value): current("cuFuncSetAttribute"); calls.append(("set_attribute", self.name, attr, value))
    def prepared_call(self, grid, block, *args):
      calls.append(("prepared_call", self.name))
      self._launch_kernel(grid, block, args, 0, None)

  class Module:
    def __init__(self, ctx): self.ctx = ctx
    def __del__(self): released(self.ctx, "module")  # cuModuleUnload in pycuda's destructor
    def get_function(self, name): calls.append(("get_function", name)); return Function(name, self)

  def module_from_buffer(b):
    ctx = current("cuModuleLoadDataEx")
    calls.append(("module_from_buffer", bytes(b)))
    if (why := binary_ok(bytes(b), ctx.dev)) is not None:
      raise RuntimeError(f"cuModuleLoadDataEx failed: no kernel image is available for execution on the device ({why})")
    return Module(ctx)

  class Event:
    def __init__(self): self.ctx = current("cuEventCreate")
    def __del__(self): released(self.ctx, "event")  # cuEventDestroy in pycuda's destructor
    def record(self): current("cuEventRecord"); calls.append(("record",))
    def synchronize(self): current("cuEventSynchronize"); calls.append(("event_sync",))
    def time_till(self, other): return 2.5  # milliseconds

  class Context:
    def __init__(self, dev): self.dev, self.thread = dev, threading.current_thread()
    def __eq__(self, other): return isinstance(other, Context) and other.dev == self.dev  # pycuda: same CUcontext handle
    def __hash__(self): return hash(self.dev) ^ id(self)  # pycuda: hash(m_context) ^ hash(this)
    @staticmethod
    def get_current():
      s = stack()
      return s[-1] if s else None
    @staticmethod
    def synchronize(): calls.append(("ctx_sync", current("cuCtxSynchronize").dev))
    def push(self): calls.append(("push", self.dev)); stack().append(self)
    @staticmethod
    def pop():
      s = stack()
      if not s: raise LogicError("context::pop failed: invalid device context - cannot pop non-current context")
      calls.append(("pop", s.pop().dev))

  class Device:
    @staticmethod
    def count(): return ndev
    def __init__(self, i): calls.append(("device", i)); self.i = i
    def compute_capability(self): return cc
    def retain_primary_context(self): return Context(self.i)  # a new wrapper each time, equal to the others of the device

  def memcpy_htod(d, s):
    on_device(current("cuMemcpyHtoD"), int(d), "cuMemcpyHtoD")
    calls.append(("htod", d, bytes(s)))

  def memcpy_dtoh(d, s):
    on_device(current("cuMemcpyDtoH"), int(s), "cuMemcpyDtoH")
    calls.append(("dtoh", s, len(d)))

  def memcpy_dtod(d, s, n):
    ctx = current("cuMemcpyDtoD")
    on_device(ctx, int(d), "cuMemcpyDtoD"); on_device(ctx, int(s), "cuMemcpyDtoD")  # noqa: E702
    calls.append(("dtod", d, s, n))

  def check() -> list[str]:
    """Every breach of pycuda's rules so far, plus (at the end of a test: the process ending) every non-empty stack."""
    out = list(problems)
    for st in state["owners"]:
      if st.items: out.append(f"abort: thread {st.thread.name} has {len(st.items)} context(s) on its stack at exit")
    return out

  def fault(why: str = FakeFault.ILLEGAL_ADDRESS) -> None: state["fault"] = why

  drv.init = lambda: calls.append(("init",))
  drv.function_attribute = types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=8)
  drv.Error, drv.MemoryError, drv.LogicError, drv.LaunchError, drv.RuntimeError = Error, MemoryError, LogicError, LaunchError, RuntimeError
  drv.mem_alloc, drv.Device, drv.Context, drv.Event, drv.DeviceAllocation = mem_alloc, Device, Context, Event, DeviceAllocation
  drv.module_from_buffer, drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod = module_from_buffer, memcpy_htod, memcpy_dtoh, memcpy_dtod
  drv._problems, drv._fault_next_launch = check, fault
  drv._current, drv._launched, drv._problem = current, launched, problems.append  # for the stand-in libcuda of CUDA graphs
  return drv


def fatbin_entries(data: bytes) -> list[tuple[str, int]] | None:
  """[(kind 'elf' | 'ptx', sm number)] of a fatbin (magic 0xBA55ED50), or None when data is not one."""
  if len(data) < 16 or struct.unpack_from("<I", data)[0] != 0xBA55ED50: return None
  _, _, hsize, fat = struct.unpack_from("<IHHQ", data)
  out, off = [], hsize
  while off < hsize + fat and off + 32 <= len(data):
    kind, _, ehsize, payload = struct.unpack_from("<HHIQ", data, off)
    arch = struct.unpack_from("<I", data, off + 28)[0]
    out.append(({1: "ptx", 2: "elf"}.get(kind, str(kind)), arch))
    off += ehsize + payload
  return out


def cubin_arch(data: bytes) -> int | None:
  """The sm number a real CUDA ELF (cubin) was built for, or None when data is not one."""
  if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] != 2 or struct.unpack_from("<H", data, 18)[0] != 190: return None  # EM_CUDA
  flags = struct.unpack_from("<I", data, 48)[0]
  return (flags >> 8) & 0xFF if data[7] == 0x41 else flags & 0xFF  # ELFOSABI_CUDA v2 (CUDA 12.8+) moved the arch up a byte


def run_in_thread(fn, *args):
  """fn(*args) on a new host thread (as the executor's workers and finalisers do); its exception re-raised here."""
  box: dict = {}

  def body():
    try: box["out"] = fn(*args)
    except BaseException as e: box["err"] = e
  t = threading.Thread(target=body, name="worker")
  t.start()
  t.join()
  if "err" in box: raise box["err"]
  return box.get("out")


def install_fake(monkeypatch, calls: list, **kw):
  drv = make_fake_driver(calls, **kw)
  pkg = types.ModuleType("pycuda")
  pkg.driver = drv  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, "pycuda", pkg)
  monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
  monkeypatch.delenv("KILN_CUDA_ARCH", raising=False)
  return drv


@pytest.fixture
def fake(monkeypatch):
  calls: list = []
  drv = install_fake(monkeypatch, calls)
  yield calls
  gc.collect()
  assert drv._problems() == []  # type: ignore[attr-defined]  # pycuda would have aborted or leaked


@pytest.fixture
def fake2(monkeypatch):
  """Two GPUs."""
  calls: list = []
  drv = install_fake(monkeypatch, calls, ndev=2)
  yield calls
  gc.collect()
  assert drv._problems() == []  # type: ignore[attr-defined]


def unpack(buf: bytes) -> tuple:
  """A launch's argument buffer read back as the kernel's parameters (3 pointers, 2 int32s)."""
  return struct.unpack("=QQQii", bytes(buf))


N, M = UOp.variable("n", 1, 1 << 20), UOp.variable("m", 1, 64)


def _compiled(**kw) -> CompiledSpec:
  ast = UOp.sink(UOp.define_global(0, dtypes.float32.ptr()).index(0).store(1.0))
  base = dict(name="k", src="// cuda", bytes=b"\x7fELF-cubin", ast=ast, var_names=["m", "n"], global_size=((N + 127) // 128, M, 1),
              local_size=(128, 1, 1), buf_count=3, device="CUDA:0", globals=[0, 1, 2], outs=[0], ins=[1, 2],
              vars=[Variable(name="m", min=1, max=64), Variable(name="n", min=1, max=1 << 20)])
  return CompiledSpec(**{**base, **kw})


def test_runtime_setup(fake):
  rt = CUDARuntime("GPU")
  assert rt.device == "CUDA:0" and rt.arch == "sm_86" and rt.compiler.arch == "sm_86" and rt.host_parallel_safe is False
  assert ("init",) in fake and ("device", 0) in fake and ("push", 0) not in fake  # nothing left pushed
  rt.synchronize()
  assert fake[-3:] == [("push", 0), ("ctx_sync", 0), ("pop", 0)]
  with pytest.raises(DeviceError, match="1 CUDA device"): CUDARuntime("CUDA:3")


def test_arch_override(fake, monkeypatch):
  monkeypatch.setenv("KILN_CUDA_ARCH", "sm_90")
  assert CUDARuntime("CUDA:0").compiler.arch == "sm_90"


def test_launch_marshalling_and_symbolic_sizes(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())
  assert ("module_from_buffer", b"\x7fELF-cubin") in fake and ("get_function", "k") in fake
  assert prog(bufs=[0x1000, 0x2000, 0x3000], vals=[5, 1000]) is None
  name, grid, block, buf = fake[-2][1:]
  assert (name, grid, block) == ("k", (8, 5, 1), (128, 1, 1))  # grid = ((n+127)//128, m, 1) with m=5, n=1000
  assert unpack(buf) == (0x1000, 0x2000, 0x3000, 5, 1000)  # the kernel's parameter struct: 3 pointers, 2 int32
  prog([4, 8, 12], [1, 1], global_size=(2, 3, 4), local_size=(128, 1, 1))  # an explicit grid wins
  assert fake[-2][2:4] == ((2, 3, 4), (128, 1, 1))


def test_event_timing(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  t = prog([4, 8, 12], [2, 300], wait=True)
  assert t == pytest.approx(2.5e-3)
  assert [c[0] for c in fake[-6:]] == ["push", "record", "launch", "record", "event_sync", "pop"]


def test_bind_and_set_vals(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  bound = prog.bind([8, 16, 24], [1, 128])
  n_launch = sum(c[0] == "launch" for c in fake)
  bound()
  assert fake[-2][2:4] == ((1, 1, 1), (128, 1, 1)) and unpack(fake[-2][4]) == (8, 16, 24, 1, 128)
  bound.set_vals([3, 129])
  bound()
  assert fake[-2][2:4] == ((2, 3, 1), (128, 1, 1)) and unpack(fake[-2][4])[3:] == (3, 129)
  assert sum(c[0] == "launch" for c in fake) == n_launch + 2


def test_launch_errors(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  with pytest.raises(RuntimeLaunchError, match="3 buffers"): prog([1, 2], [1, 1])
  with pytest.raises(RuntimeLaunchError, match=r"\['m', 'n'\]"): prog([4, 8, 12], [1])
  with pytest.raises(RuntimeLaunchError, match="int32"): prog([4, 8, 12], [1, 2**31])
  with pytest.raises(RuntimeLaunchError, match="1024"): CUDARuntime("CUDA:0").load(_compiled(local_size=(64, 32, 1)))([4, 8, 12], [1, 1])
  with pytest.raises(RuntimeLaunchError, match="no cubin"): CUDARuntime("CUDA:0").load(_compiled(bytes=b"", src="x"))


def test_launch_dims_defaults():
  c = _compiled(global_size=None, local_size=None)
  assert launch_dims(c, [1, 1]) == ((1, 1, 1), (1, 1, 1))
  assert launch_dims(_compiled(), [4, 129], None, (128,)) == ((2, 4, 1), (128, 1, 1))


def test_allocator_lru_and_copies(fake):
  drv = sys.modules["pycuda.driver"]
  al = CUDAAllocator(drv, drv.Device(0).retain_primary_context(), cache_bytes=3000)
  a = al.alloc(1000)
  assert ("mem_alloc", 1000) in fake and al.ptr(a) == int(a.base)
  al.free(a, 1000)
  b = al.alloc(1000)
  assert b.base is a.base and sum(c == ("mem_alloc", 1000) for c in fake) == 1  # reused from the cache
  bufs = [al.alloc(1000) for _ in range(4)]
  for x in [b, *bufs]: al.free(x, 1000)
  assert al.cached_bytes == 3000 and [c for c in fake if c[0] == "free"] == [("free", b.ptr), ("free", bufs[0].ptr)]  # oldest go first
  c = al.alloc(64)
  al.copyin(c, memoryview(b"x" * 64))
  assert fake[-2] == ("htod", c.ptr, b"x" * 64)
  out = bytearray(64)
  al.copyout(memoryview(out), c)
  assert fake[-2] == ("dtoh", c.ptr, 64)
  v = al.view(c, 16, 32)
  assert v.ptr == c.ptr + 16 and al.ptr(v) == c.ptr + 16
  al.copy(v, c, 32)
  assert fake[-2] == ("dtod", c.ptr + 16, c.ptr, 32)
  with pytest.raises(DeviceError): al.view(c, 40, 32)
  assert al.as_numpy(c, np.float32, 16) is None
  with pytest.raises(DeviceError): al.alloc(0)


def test_allocator_flushes_cache_when_out_of_memory():
  calls: list = []
  drv = make_fake_driver(calls, mem_limit=2500)
  al = CUDAAllocator(drv, drv.Device(0).retain_primary_context())
  a, b = al.alloc(1000), al.alloc(1000)
  al.free(a, 1000)
  al.free(b, 1000)
  al.alloc(2000)  # fails first, succeeds after the cached 2000 bytes are freed
  assert sum(c[0] == "free" for c in calls) == 2
  with pytest.raises(DeviceError, match="out of memory"): al.alloc(5000)
  assert drv._problems() == []  # type: ignore[attr-defined]


def test_without_pycuda_the_error_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "pycuda", None)
  monkeypatch.setitem(sys.modules, "pycuda.driver", None)
  with pytest.raises(DeviceError) as ei: CUDARuntime("CUDA:0")
  assert 'pip install "kiln-runtime-cuda[driver]"' in str(ei.value) and "driver" in str(ei.value)


def test_without_a_cuda_driver(monkeypatch):
  calls: list = []
  drv = make_fake_driver(calls)

  def init(): raise RuntimeError("cuInit failed: no CUDA-capable device is detected")
  drv.init = init  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, "pycuda", types.ModuleType("pycuda"))
  monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
  with pytest.raises(DeviceError, match="no CUDA driver was found") as ei: CUDARuntime("CUDA:0")
  assert 'pip install "kiln-runtime-cuda[driver]"' in str(ei.value)


def test_entry_point_and_registry(fake):
  eps = {ep.name: ep.value for ep in entry_points(group="kiln.devices")}
  assert eps.get("CUDA") == "kiln.runtime.cuda.device:CUDARuntime"
  devmod.unregister_runtime("CUDA")  # drop any cached instance
  try:
    rt = devmod.get_runtime("GPU:0")
    assert isinstance(rt, CUDARuntime) and rt.device == "CUDA:0"
  finally: devmod.unregister_runtime("CUDA")


def test_renderer_is_imported_lazily(fake, monkeypatch):
  rt = CUDARuntime("CUDA:0")
  mod = types.ModuleType("kiln.codegen.render.cuda")

  class CUDARenderer:
    device = "CUDA"

    def __init__(self, target=None): self.target = target
  mod.CUDARenderer = CUDARenderer  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, "kiln.codegen.render.cuda", mod)
  assert isinstance(rt.renderer, CUDARenderer) and rt.renderer is rt.renderer
  assert rt.renderer.target.gpu_arch == 10 * rt.cc[0] + rt.cc[1]  # the GPU's own compute capability reaches the renderer


# ---- the stand-in itself enforces pycuda's rules (so the tests below can fail) ----
def test_stand_in_records_a_thread_ending_with_a_pushed_context():
  calls: list = []
  drv = make_fake_driver(calls)
  ctx = drv.Device(0).retain_primary_context()
  run_in_thread(ctx.push)
  gc.collect()
  assert any("worker" in p and "abort" in p for p in drv._problems())
  with pytest.raises(drv.LogicError, match="no currently active context"): drv.mem_alloc(16)
  ctx.push()
  mem = drv.mem_alloc(16)
  drv.Context.pop()
  with pytest.warns(UserWarning, match="out-of-thread"):  # out of its context's thread, without it current: refused and leaked
    run_in_thread(mem.free)
  assert any("leak" in p for p in drv._problems()) and ("free", int(mem)) not in calls


def test_modules_events_and_cached_blocks_die_in_their_context(fake):
  rt = CUDARuntime("CUDA:0")  # its context belongs to this thread; the work below runs on others
  al = CUDAAllocator(rt.drv, rt.ctx, guard=rt.guard)

  def work():
    prog = rt.load(_compiled())
    prog([4, 8, 12], [1, 1], wait=True)  # two events, destroyed before the context is popped
    al.free(al.alloc(512), 512)  # cached, not freed
    return prog
  holder = [run_in_thread(work)]
  run_in_thread(holder.clear)  # the last reference to the program (and its module) dropped on another thread
  run_in_thread(lambda: al.__del__())  # the allocator's finaliser on another thread frees its cached blocks in context
  assert [c[0] for c in fake].count("free") == 1


# ---- issue 16: each numbered defect ----
def test_1_no_context_is_left_pushed(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())
  prog([4, 8, 12], [1, 1])
  b = rt.allocator.alloc(64)
  rt.allocator.copyin(b, memoryview(b"x" * 64))
  rt.synchronize()
  drv = sys.modules["pycuda.driver"]
  assert drv.Context.get_current() is None and drv._problems() == []  # type: ignore[attr-defined]
  assert sum(c[0] == "push" for c in fake) == sum(c[0] == "pop" for c in fake) > 0
  with rt.current():  # nested work pushes nothing more
    n = len(fake)
    prog([4, 8, 12], [1, 1])
    rt.allocator.copyin(b, memoryview(b"y" * 64))
    assert [c[0] for c in fake[n:]] == ["launch", "htod"]


def test_2_worker_threads_get_the_context(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())

  def work():
    b = rt.allocator.alloc(256)
    rt.allocator.copyin(b, memoryview(bytes(256)))
    prog.bind([b.ptr] * 3, [1, 1])()
    prog([b.ptr] * 3, [1, 1], wait=True)
    rt.allocator.copyout(memoryview(bytearray(256)), b)
    rt.synchronize()
    rt.allocator.free(b, 256)
  run_in_thread(work)
  run_in_thread(work)
  assert sum(c[0] == "launch" for c in fake) == 4


def test_3_frees_on_other_threads_reach_the_context(fake):
  rt = CUDARuntime("CUDA:0")
  al = rt.allocator
  al.cache_limit = 0  # every free evicts at once
  bufs = [al.alloc(1024) for _ in range(3)]
  run_in_thread(lambda: [al.free(b, 1024) for b in bufs[:2]])  # a storage finaliser / LRU eviction on a worker thread
  assert [c for c in fake if c[0] == "free"] == [("free", bufs[0].ptr), ("free", bufs[1].ptr)]
  al.cache_limit = 1 << 20
  al.free(bufs[2], 1024)
  run_in_thread(al.free_cache)
  assert ("free", bufs[2].ptr) in fake and al.cached_bytes == 0


def test_4_another_wrapper_of_our_primary_context_is_not_ours(fake):
  drv = sys.modules["pycuda.driver"]
  theirs = drv.Device(0).retain_primary_context()  # e.g. pycuda.autoprimaryctx's: equal to ours (same CUcontext), not ours
  theirs.push()
  try:
    rt = CUDARuntime("CUDA:0")
    rt.allocator.cache_limit = 0
    b = rt.allocator.alloc(256)
    assert b.base.ctx is rt.ctx  # allocated under our own context object, so our pushes can free it
    run_in_thread(rt.allocator.free, b, 256)
    assert ("free", b.ptr) in fake
  finally: drv.Context.pop()


def test_4_two_gpus_have_their_own_contexts(fake2):
  rt0, rt1 = CUDARuntime("CUDA:0"), CUDARuntime("CUDA:1")
  p0, p1 = rt0.load(_compiled()), rt1.load(_compiled())
  b0, b1 = rt0.allocator.alloc(64), rt1.allocator.alloc(64)
  assert (b0.base.ctx.dev, b1.base.ctx.dev) == (0, 1)
  with rt0.current():  # work for GPU 1 while GPU 0's context is current: GPU 1's is pushed on top
    p1([b1.ptr] * 3, [1, 1])
    rt1.allocator.copyin(b1, memoryview(bytes(64)))
    rt1.synchronize()
    p0([b0.ptr] * 3, [1, 1])
  assert ("ctx_sync", 1) in fake2

  def other_thread():
    rt1.synchronize()
    p0([b0.ptr] * 3, [1, 1])
    rt0.allocator.copyout(memoryview(bytearray(64)), b0)
    rt1.allocator.free(b1, 64)
    rt1.allocator.free_cache()
  run_in_thread(other_thread)
  assert ("free", b1.ptr) in fake2


def test_5_errors_are_mapped(fake, monkeypatch):
  rt = CUDARuntime("CUDA:0")
  drv = sys.modules["pycuda.driver"]

  def bad_alloc(size): raise drv.LogicError("cuMemAlloc failed: invalid argument")  # type: ignore[attr-defined]
  monkeypatch.setattr(drv, "mem_alloc", bad_alloc)
  with pytest.raises(DeviceError) as ei: rt.allocator.alloc(64)
  assert "out of memory" not in str(ei.value) and "invalid argument" in str(ei.value)
  monkeypatch.undo()
  install_fake(monkeypatch, [], mem_limit=100)
  rt2 = CUDARuntime("CUDA:0")
  with pytest.raises(DeviceError, match="out of memory"): rt2.allocator.alloc(1000)
  with pytest.raises(RuntimeLaunchError, match="no kernel image"):  # a real cubin for another architecture
    rt2.load(_compiled(bytes=_fake_cubin(75)))


def _fake_cubin(sm: int) -> bytes:
  """The 52-byte ELF header of a CUDA cubin for sm_<sm> (enough for the stand-in's architecture check)."""
  h = bytearray(64)
  h[:8] = b"\x7fELF\x02\x01\x01\x41"
  struct.pack_into("<H", h, 18, 190)
  struct.pack_into("<I", h, 48, 0x6000004 | (sm << 8))
  return bytes(h)


def test_5_a_sticky_fault_kills_the_context_and_says_so(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())
  b = rt.allocator.alloc(64)
  sys.modules["pycuda.driver"]._fault_next_launch()  # type: ignore[attr-defined]
  prog([b.ptr] * 3, [1, 1])  # returns: a kernel's fault shows at the next call
  with pytest.raises(DeviceError, match="illegal memory access.*device context is dead") as ei:
    rt.allocator.copyout(memoryview(bytearray(64)), b)
  assert not isinstance(ei.value.__cause__, DeviceError) and rt.dead is not None and "illegal memory access" in rt.dead
  for call in (lambda: rt.allocator.alloc(128), lambda: prog([b.ptr] * 3, [1, 1]), rt.synchronize, lambda: rt.load(_compiled()),
               lambda: rt.allocator.copyin(b, memoryview(bytes(64)))):
    with pytest.raises(DeviceError, match="device context is dead.*illegal memory access"): call()
  rt.allocator.free(b, 64)  # frees on a dead context drop the memory quietly (finalisers must not raise)
  rt.allocator.free_cache()


def test_6_load_refuses_another_architecture_in_the_stand_in(fake):
  rt = CUDARuntime("CUDA:0")  # sm_86
  rt.load(_compiled(bytes=_fake_cubin(80)))  # same major, lower minor: runs
  with pytest.raises(RuntimeLaunchError, match="architecture"): rt.load(_compiled(bytes=_fake_cubin(90)))


@requires_nvcc
def test_6_fatbin_with_sass_and_ptx_loads_on_a_newer_gpu(monkeypatch):
  calls: list = []
  drv = install_fake(monkeypatch, calls, cc=(9, 0))
  fatbin = CUDACompiler("sm_80", backend="nvcc").compile_src(EW_F32, "ew_f32")[1]
  assert sorted(fatbin_entries(fatbin) or []) == [("elf", 80), ("ptx", 80)]  # SASS for sm_80 and its PTX
  rt = CUDARuntime("CUDA:0")
  rt.load(_compiled(name="ew_f32", bytes=fatbin))  # a GPU of 9.0 JITs the PTX
  assert drv._problems() == []  # type: ignore[attr-defined]


def test_7_a_different_local_size_or_a_misaligned_buffer_is_refused(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())  # rendered for a block of (128, 1, 1)
  with pytest.raises(RuntimeLaunchError, match="rendered for"): prog([4, 8, 12], [1, 1], local_size=(64, 1, 1))
  with pytest.raises(RuntimeLaunchError, match="rendered for"): prog.bind([4, 8, 12], [1, 1], None, (128, 2, 1))
  with pytest.raises(RuntimeLaunchError, match="aligned to 4"): prog([4 + 2, 8, 12], [1, 1])  # float32 data0 at an odd address
  assert not [c for c in fake if c[0] == "launch"]
  prog([4, 8, 12], [1, 1], local_size=(128, 1, 1))  # the rendered block, given explicitly, is fine


def test_8_arguments_are_packed_once_per_bind(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  bound = prog.bind([8, 16, 24], [2, 300])
  bound()
  bound()
  l1, l2 = [c for c in fake if c[0] == "launch"]
  assert l1[4] is l2[4] and unpack(l1[4]) == (8, 16, 24, 2, 300)  # the very buffer packed at bind time
  assert not [c for c in fake if c[0] in ("prepare", "prepared_call")]  # no deprecated block-shape interface


@requires_nvcc
def test_8_one_nvcc_process_per_kernel(monkeypatch):
  from kiln.runtime.cuda import compiler as cmod
  runs: list = []
  real = cmod.subprocess.run

  def counting(cmd, *a, **kw):
    if "--version" not in cmd: runs.append(cmd)
    return real(cmd, *a, **kw)
  monkeypatch.setattr(cmod.subprocess, "run", counting)
  ptx, binary = CUDACompiler("sm_90", backend="nvcc").compile_src(EW_F32 + "\n// one process\n", "ew_f32")
  assert len(runs) == 1 and ".entry ew_f32(" in ptx and binary[:4] == struct.pack("<I", 0xBA55ED50)


# ---- issue 16 (launch overhead): a plan's run makes the context current once, its launches push nothing ----
def test_9_in_session_launches_push_nothing(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())
  a, b = prog.bind([8, 16, 24], [1, 128]), prog.bind([32, 40, 48], [2, 300])
  assert a.session == b.session == rt.session  # one session per runtime: the executor enters it once for both
  n = len(fake)
  with a.session():
    a.in_session()
    b.in_session()
    b.in_session()
  assert [c[0] for c in fake[n:]] == ["push", "launch", "launch", "launch", "pop"]
  assert unpack(fake[n + 1][4]) == (8, 16, 24, 1, 128) and fake[n + 3][2:4] == ((3, 2, 1), (128, 1, 1))
  drv = sys.modules["pycuda.driver"]
  assert drv.Context.get_current() is None  # type: ignore[attr-defined]
  with rt.current():  # a session inside a current context pushes nothing either
    n = len(fake)
    with rt.session(): a.in_session()
    assert [c[0] for c in fake[n:]] == ["launch"]
  a.set_vals([1, 0])  # an empty grid (n = 0): nothing is launched, in a session or not
  n = len(fake)
  with rt.session(): a.in_session()
  a()
  assert [c[0] for c in fake[n:]] == ["push", "pop"]

  def worker():  # a session on another thread: that thread's own stack, left empty
    with b.session(): b.in_session()
  n = len(fake)
  run_in_thread(worker)
  assert [c[0] for c in fake[n:]] == ["push", "launch", "pop"]
  assert drv._problems() == []  # type: ignore[attr-defined]


def test_9_a_fault_in_a_session_is_mapped_and_pops_the_context(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())
  a = prog.bind([8, 16, 24], [1, 128])
  sys.modules["pycuda.driver"]._fault_next_launch()  # type: ignore[attr-defined]
  with pytest.raises(RuntimeLaunchError, match="launching kernel k.*device context is dead"):
    with rt.session():
      a.in_session()  # the fault shows at the next call, as on a GPU
      a.in_session()
  assert sys.modules["pycuda.driver"].Context.get_current() is None and rt.dead is not None  # type: ignore[attr-defined]
  with pytest.raises(DeviceError, match="device context is dead"):
    with rt.session(): pass
