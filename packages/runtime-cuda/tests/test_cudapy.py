"""KILN_CUDA_DRIVER=cuda-python: kiln's runtime over the cudapy adapter, over a stand-in for NVIDIA's cuda.bindings.driver
(no GPU here) that follows the CUDA driver's rules: (status, results...) tuples, a per-thread context stack, work without a
current context fails with CUDA_ERROR_INVALID_CONTEXT, a launch needs its module's context, a free needs its allocation's
context, memory is host memory so copies move real bytes, and the launch's parameter buffer is read back through the
pointers the adapter passes (CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE)."""
import ctypes
import enum
import struct
import sys
import threading
import types

import numpy as np
import pytest

from kiln.ir.errors import DeviceError, RuntimeLaunchError, SettingError
from kiln.runtime.cuda import driver as dmod
from kiln.runtime.cuda.driver import CUDARuntime

from .test_driver import _compiled, run_in_thread


class CUresult(enum.IntEnum):
  CUDA_SUCCESS = 0
  CUDA_ERROR_INVALID_VALUE = 1
  CUDA_ERROR_OUT_OF_MEMORY = 2
  CUDA_ERROR_INVALID_CONTEXT = 201
  CUDA_ERROR_INVALID_HANDLE = 400
  CUDA_ERROR_ILLEGAL_ADDRESS = 700


_TEXT = {1: "invalid argument", 2: "out of memory", 201: "invalid device context", 400: "invalid resource handle",
         700: "an illegal memory access was encountered"}


def make_fake_cu(calls: list, ndev: int = 2, mem_limit: int | None = None):
  cu = types.ModuleType("cuda.bindings.driver")
  tls = threading.local()
  state: dict = {"allocs": {}, "live": 0, "fault": False, "sticky": {}}
  ok = CUresult.CUDA_SUCCESS

  class Handle:
    def __init__(self, v): self.v = v
    def __int__(self): return self.v

  def stack() -> list:
    if not hasattr(tls, "s"): tls.s = []
    return tls.s

  def need():
    s = stack()
    if not s: return None, CUresult.CUDA_ERROR_INVALID_CONTEXT
    if state["sticky"].get(int(s[-1])): return None, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    return int(s[-1]), ok

  def owner(p, n):
    for a, (size, ctx, _mem) in state["allocs"].items():
      if a <= p and p + n <= a + size: return ctx
    return None

  class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76

  modules: dict = {}

  def cuInit(flags): return (ok,)
  def cuDeviceGetCount(): return (ok, ndev)
  def cuDeviceGet(i): return (ok, Handle(i)) if 0 <= i < ndev else (CUresult.CUDA_ERROR_INVALID_VALUE, None)
  def cuDeviceGetAttribute(a, d): return (ok, 9 if a == 75 else 0)
  def cuDevicePrimaryCtxRetain(d): return (ok, Handle(0xC0 + int(d)))
  def cuCtxPushCurrent(c): calls.append(("push", int(c) - 0xC0)); stack().append(c); return (ok,)
  def cuCtxPopCurrent():
    s = stack()
    if not s: return (CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
    c = s.pop()
    calls.append(("pop", int(c) - 0xC0))
    return (ok, c)
  def cuCtxGetCurrent(): return (ok, stack()[-1] if stack() else Handle(0))
  def cuCtxSynchronize():
    c, e = need()
    if e == ok: calls.append(("sync", c - 0xC0))
    return (e,)

  def cuMemAlloc(n):
    c, e = need()
    if e != ok: return (e, None)
    if mem_limit is not None and state["live"] + n > mem_limit: return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    mem = ctypes.create_string_buffer(n)
    state["allocs"][ctypes.addressof(mem)] = (n, c, mem)
    state["live"] += n
    return (ok, Handle(ctypes.addressof(mem)))

  def cuMemFree(p):
    c, e = need()
    if e != ok: return (e,)
    a = state["allocs"].get(int(p))
    if a is None or a[1] != c: return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # strict: only in its own context
    del state["allocs"][int(p)]
    state["live"] -= a[0]
    calls.append(("free", int(p)))
    return (ok,)

  def copy(d, s, n, dev_d, dev_s):
    c, e = need()
    if e != ok: return (e,)
    if (dev_d and owner(d, n) != c) or (dev_s and owner(s, n) != c): return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    ctypes.memmove(d, s, n)
    return (ok,)
  def cuMemcpyHtoD(d, s, n): return copy(int(d), int(s), n, True, False)
  def cuMemcpyDtoH(d, s, n): return copy(int(d), int(s), n, False, True)
  def cuMemcpyDtoD(d, s, n): return copy(int(d), int(s), n, True, True)

  def cuModuleLoadData(img):
    c, e = need()
    if e != ok: return (e, None)
    h = Handle(len(modules) + 1)
    modules[int(h)] = c
    calls.append(("load", ctypes.string_at(int(img), 4)))
    return (ok, h)
  def cuModuleUnload(m):
    c, e = need()
    if e == ok: calls.append(("unload", int(m)))
    return (e,)
  def cuModuleGetFunction(m, name): return (ok, (int(m), name.decode()))

  def cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    c, e = need()
    if e != ok: return (e,)
    if modules[f[0]] != c: return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    ex = (ctypes.c_void_p * 5).from_address(extra)
    assert ex[0] == 1 and ex[2] == 2 and ex[4] is None, list(ex)
    n = ctypes.c_size_t.from_address(ex[3]).value
    buf = ctypes.string_at(ex[1], n)
    calls.append(("launch", f[1], (gx, gy, gz), (bx, by, bz), buf))
    if f[1] == "scale2":  # (float *out, const float *in, int n): out = 2 * in
      out, inp, cnt = struct.unpack("=QQi", buf)
      if owner(out, 4 * cnt) != c or owner(inp, 4 * cnt) != c: state["sticky"][c] = True
      else:
        src = np.frombuffer((ctypes.c_char * (4 * cnt)).from_address(inp), np.float32)
        np.frombuffer((ctypes.c_char * (4 * cnt)).from_address(out), np.float32)[:] = 2 * src
    if state["fault"]: state["sticky"][c], state["fault"] = True, False
    return (ok,)

  def cuEventCreate(flags): return (ok, Handle(1))
  def cuEventRecord(e, s): return (need()[1],)
  def cuEventSynchronize(e): return (need()[1],)
  def cuEventElapsedTime(a, b): return (ok, 0.5)
  def cuEventDestroy(e): return (ok,)
  def cuGetErrorString(e): return (ok, _TEXT.get(int(e), "unknown error").encode())

  for k, v in list(locals().items()):
    if k.startswith("cu") or k in ("CUresult", "CUdevice_attribute"): setattr(cu, k, v)
  cu.CUresult = CUresult
  cu._state = state
  return cu


@pytest.fixture
def cupy_fake(monkeypatch):
  calls: list = []
  cu = make_fake_cu(calls)
  for name in ("cuda", "cuda.bindings"): monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
  monkeypatch.setitem(sys.modules, "cuda.bindings.driver", cu)
  monkeypatch.setenv("KILN_CUDA_DRIVER", "cuda-python")
  monkeypatch.delenv("KILN_CUDA_ARCH", raising=False)
  monkeypatch.setattr(dmod, "_cuda_python", None)
  yield calls, cu
  assert cu.cuCtxGetCurrent()[1].v == 0  # nothing left pushed on this thread


def _scale2():
  from kiln.codegen.spec import CompiledSpec, Variable
  from kiln.ir import UOp, dtypes
  g0, g1 = UOp.define_global(0, dtypes.float32.ptr()), UOp.define_global(1, dtypes.float32.ptr())
  n = UOp.variable("n", 1, 1 << 20)
  return CompiledSpec(name="scale2", bytes=b"FATB-fake", ast=UOp.sink(g0.index(0).store(g1.index(0).load())), var_names=["n"],
                      global_size=((n + 63) // 64, 1, 1), local_size=(64, 1, 1), buf_count=2, device="CUDA:0", globals=[0, 1],
                      outs=[0], ins=[1], vars=[Variable(name="n", min=1, max=1 << 20)])


def _roundtrip(rt: CUDARuntime, n: int = 100) -> None:
  prog = rt.load(_scale2())
  a, b = rt.allocator.alloc(4 * n), rt.allocator.alloc(4 * n)
  x = np.arange(n, dtype=np.float32)
  rt.allocator.copyin(b, memoryview(x).cast("B"))
  prog.bind([a.ptr, b.ptr], [n])()
  assert prog([a.ptr, b.ptr], [n], wait=True) == pytest.approx(0.5e-3)
  out = np.zeros(n, np.float32)
  rt.allocator.copyout(memoryview(out).cast("B"), a)
  assert (out == 2 * x).all()
  rt.synchronize()
  rt.allocator.free(a, 4 * n)
  rt.allocator.free(b, 4 * n)


def test_runtime_over_cuda_python(cupy_fake):
  calls, cu = cupy_fake
  rt = CUDARuntime("CUDA:0")
  assert rt.arch == "sm_90" and type(rt.drv).__name__ == "CudaPythonDriver"
  _roundtrip(rt)
  launches = [c for c in calls if c[0] == "launch"]
  assert len(launches) == 2 and launches[0][4] == struct.pack("=QQi", *struct.unpack("=QQi", launches[0][4]))
  assert launches[0][2:4] == ((2, 1, 1), (64, 1, 1))
  assert sum(c[0] == "push" for c in calls) == sum(c[0] == "pop" for c in calls)


def test_cuda_python_worker_threads_and_two_devices(cupy_fake):
  calls, cu = cupy_fake
  rt0, rt1 = CUDARuntime("CUDA:0"), CUDARuntime("CUDA:1")
  run_in_thread(_roundtrip, rt0)
  with rt0.current(): _roundtrip(rt1)
  rt0.allocator.cache_limit = 0
  bufs = [rt0.allocator.alloc(64) for _ in range(3)]
  run_in_thread(lambda: [rt0.allocator.free(b, 64) for b in bufs])  # frees (evictions) on another thread reach the context
  run_in_thread(rt1.allocator.free_cache)
  assert cu._state["live"] == 0 and ("free", bufs[0].ptr) in calls


def test_cuda_python_errors(cupy_fake, monkeypatch):
  calls, cu = cupy_fake
  rt = CUDARuntime("CUDA:0")
  with pytest.raises(DeviceError, match="out of memory"):
    monkeypatch.setattr(cu, "cuMemAlloc", lambda n: (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None))
    rt.allocator.alloc(64)
  monkeypatch.undo()
  monkeypatch.setitem(sys.modules, "cuda.bindings.driver", cu)
  monkeypatch.setenv("KILN_CUDA_DRIVER", "cuda-python")
  prog = rt.load(_compiled())
  b = rt.allocator.alloc(64)
  cu._state["fault"] = True
  prog([b.ptr, b.ptr, b.ptr], [1, 1])
  with pytest.raises(DeviceError, match="illegal memory access.*device context is dead"): rt.allocator.copyout(memoryview(bytearray(64)), b)
  with pytest.raises(DeviceError, match="device context is dead"): prog([b.ptr] * 3, [1, 1])
  with pytest.raises(RuntimeLaunchError, match="rendered for"): prog([b.ptr] * 3, [1, 1], local_size=(32, 1, 1))


def test_without_cuda_python_the_error_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "cuda", None)
  monkeypatch.setitem(sys.modules, "cuda.bindings", None)
  monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
  monkeypatch.setitem(sys.modules, "cuda.cuda", None)
  monkeypatch.setenv("KILN_CUDA_DRIVER", "cuda-python")
  monkeypatch.setattr(dmod, "_cuda_python", None)
  with pytest.raises(DeviceError, match=r"pip install \"kiln-runtime-cuda\[cuda-python\]\""): CUDARuntime("CUDA:0")
  monkeypatch.setenv("KILN_CUDA_DRIVER", "cupy")
  with pytest.raises(SettingError, match="KILN_CUDA_DRIVER must be one of pycuda, cuda-python, got 'cupy'"): CUDARuntime("CUDA:0")
