"""The launch path over a recording stand-in for pycuda.driver (no GPU here), and the clear error without pycuda."""
import sys
import types
from importlib.metadata import entry_points

import numpy as np
import pytest

from kiln.codegen import registry as devmod
from kiln.codegen.spec import CompiledSpec, Variable
from kiln.ir import UOp, dtypes
from kiln.ir.errors import DeviceError, RuntimeLaunchError
from kiln.runtime.cuda.driver import CUDAAllocator, CUDARuntime, launch_dims


def make_fake_driver(calls: list, cc=(8, 6), ndev=1, mem_limit=None):
  """A stand-in for pycuda.driver that records every call."""
  drv = types.ModuleType("pycuda.driver")
  state = {"next": 0x10000, "live": 0, "ctx": None}

  class Alloc:
    def __init__(self, size): self.ptr, self.size = state["next"], size; state["next"] += size + 256
    def __int__(self): return self.ptr
    def free(self): calls.append(("free", self.ptr)); state["live"] -= self.size

  def mem_alloc(size):
    if mem_limit is not None and state["live"] + size > mem_limit: raise MemoryError("out of memory")
    state["live"] += size
    calls.append(("mem_alloc", size))
    return Alloc(size)

  class Function:
    def __init__(self, name): self.name = name
    def prepare(self, fmt): calls.append(("prepare", self.name, fmt))
    def prepared_call(self, grid, block, *args): calls.append(("launch", self.name, grid, block, args))

  class Module:
    def get_function(self, name): calls.append(("get_function", name)); return Function(name)

  class Event:
    def record(self): calls.append(("record",))
    def synchronize(self): calls.append(("event_sync",))
    def time_till(self, other): return 2.5  # milliseconds

  class Context:
    @staticmethod
    def get_current(): return state["ctx"]
    @staticmethod
    def synchronize(): calls.append(("ctx_sync",))
    def push(self): calls.append(("push",)); state["ctx"] = self

  class Device:
    @staticmethod
    def count(): return ndev
    def __init__(self, i): calls.append(("device", i))
    def compute_capability(self): return cc
    def retain_primary_context(self): return Context()

  drv.init = lambda: calls.append(("init",))
  drv.mem_alloc, drv.Device, drv.Context, drv.Event = mem_alloc, Device, Context, Event
  drv.module_from_buffer = lambda b: calls.append(("module_from_buffer", bytes(b))) or Module()
  drv.memcpy_htod = lambda d, s: calls.append(("htod", d, bytes(s)))
  drv.memcpy_dtoh = lambda d, s: calls.append(("dtoh", s, len(d)))
  drv.memcpy_dtod = lambda d, s, n: calls.append(("dtod", d, s, n))
  return drv


@pytest.fixture
def fake(monkeypatch):
  calls: list = []
  drv = make_fake_driver(calls)
  pkg = types.ModuleType("pycuda")
  pkg.driver = drv  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, "pycuda", pkg)
  monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
  monkeypatch.delenv("KILN_CUDA_ARCH", raising=False)
  return calls


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
  assert ("init",) in fake and ("device", 0) in fake and ("push",) in fake
  rt.synchronize()
  assert fake[-1] == ("ctx_sync",)
  with pytest.raises(DeviceError, match="1 CUDA device"): CUDARuntime("CUDA:3")


def test_arch_override(fake, monkeypatch):
  monkeypatch.setenv("KILN_CUDA_ARCH", "sm_90")
  assert CUDARuntime("CUDA:0").compiler.arch == "sm_90"


def test_launch_marshalling_and_symbolic_sizes(fake):
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_compiled())
  assert ("module_from_buffer", b"\x7fELF-cubin") in fake and ("get_function", "k") in fake and ("prepare", "k", "PPPii") in fake
  assert prog(bufs=[0x1000, 0x2000, 0x3000], vals=[5, 1000]) is None
  name, grid, block, args = fake[-1][1:]
  assert (name, grid, block) == ("k", (8, 5, 1), (128, 1, 1))  # grid = ((n+127)//128, m, 1) with m=5, n=1000
  assert [type(a) for a in args] == [np.uintp] * 3 + [np.int32] * 2 and [int(a) for a in args] == [0x1000, 0x2000, 0x3000, 5, 1000]
  prog([1, 2, 3], [1, 1], global_size=(2, 3, 4), local_size=(32, 2, 1))  # explicit sizes win
  assert fake[-1][2:4] == ((2, 3, 4), (32, 2, 1))


def test_event_timing(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  t = prog([1, 2, 3], [2, 300], wait=True)
  assert t == pytest.approx(2.5e-3)
  assert [c[0] for c in fake[-4:]] == ["record", "launch", "record", "event_sync"]


def test_bind_and_set_vals(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  bound = prog.bind([7, 8, 9], [1, 128])
  n_launch = sum(c[0] == "launch" for c in fake)
  bound()
  assert fake[-1][2:4] == ((1, 1, 1), (128, 1, 1)) and [int(a) for a in fake[-1][4]] == [7, 8, 9, 1, 128]
  bound.set_vals([3, 129])
  bound()
  assert fake[-1][2:4] == ((2, 3, 1), (128, 1, 1)) and [int(a) for a in fake[-1][4]][3:] == [3, 129]
  assert sum(c[0] == "launch" for c in fake) == n_launch + 2


def test_launch_errors(fake):
  prog = CUDARuntime("CUDA:0").load(_compiled())
  with pytest.raises(RuntimeLaunchError, match="3 buffers"): prog([1, 2], [1, 1])
  with pytest.raises(RuntimeLaunchError, match=r"\['m', 'n'\]"): prog([1, 2, 3], [1])
  with pytest.raises(RuntimeLaunchError, match="int32"): prog([1, 2, 3], [1, 2**31])
  with pytest.raises(RuntimeLaunchError, match="1024"): prog([1, 2, 3], [1, 1], local_size=(64, 32, 1))
  with pytest.raises(RuntimeLaunchError, match="no cubin"): CUDARuntime("CUDA:0").load(_compiled(bytes=b"", src="x"))


def test_launch_dims_defaults():
  c = _compiled(global_size=None, local_size=None)
  assert launch_dims(c, [1, 1]) == ((1, 1, 1), (1, 1, 1))
  assert launch_dims(_compiled(), [4, 129], None, (64,)) == ((2, 4, 1), (64, 1, 1))


def test_allocator_lru_and_copies(fake):
  drv = sys.modules["pycuda.driver"]
  al = CUDAAllocator(drv, cache_bytes=3000)
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
  assert fake[-1] == ("htod", c.ptr, b"x" * 64)
  out = bytearray(64)
  al.copyout(memoryview(out), c)
  assert fake[-1] == ("dtoh", c.ptr, 64)
  v = al.view(c, 16, 32)
  assert v.ptr == c.ptr + 16 and al.ptr(v) == c.ptr + 16
  al.copy(v, c, 32)
  assert fake[-1] == ("dtod", c.ptr + 16, c.ptr, 32)
  with pytest.raises(DeviceError): al.view(c, 40, 32)
  assert al.as_numpy(c, np.float32, 16) is None
  with pytest.raises(DeviceError): al.alloc(0)


def test_allocator_flushes_cache_when_out_of_memory():
  calls: list = []
  drv = make_fake_driver(calls, mem_limit=2500)
  al = CUDAAllocator(drv)
  a, b = al.alloc(1000), al.alloc(1000)
  al.free(a, 1000)
  al.free(b, 1000)
  al.alloc(2000)  # fails first, succeeds after the cached 2000 bytes are freed
  assert sum(c[0] == "free" for c in calls) == 2
  with pytest.raises(DeviceError, match="out of memory"): al.alloc(5000)


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
  mod.CUDARenderer = CUDARenderer  # type: ignore[attr-defined]
  monkeypatch.setitem(sys.modules, "kiln.codegen.render.cuda", mod)
  assert isinstance(rt.renderer, CUDARenderer) and rt.renderer is rt.renderer
