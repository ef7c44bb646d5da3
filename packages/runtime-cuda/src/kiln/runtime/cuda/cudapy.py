"""A `pycuda.driver`-shaped adapter over NVIDIA's cuda-python (`cuda.bindings.driver`), chosen with
KILN_CUDA_DRIVER=cuda-python; pycuda stays the default. It offers exactly what kiln's runtime (driver.py) uses: init, Device
(count, compute_capability, retain_primary_context), Context (push, pop, get_current, synchronize), mem_alloc and frees,
the three memcpys, module_from_buffer / get_function / Function._launch_kernel with a packed argument buffer, Event, and
pycuda's exception classes (Error, MemoryError, LogicError, LaunchError, RuntimeError) with pycuda's split of CUresult codes
and messages "cuXxx failed: <cuGetErrorString> (CUDA_ERROR_NAME)".

CUDA's own context stack is per thread too, but cuda-python adds no rules of its own (no abort at exit, no thread checks):
kiln's ContextGuard still pushes and pops around every call. Allocations, modules and events remember the context they were
made in and push it to be destroyed when it is not current.

NOTE: NOT run on a real GPU. Checked over the real cuda-bindings 13.5 with tools/fake_libcuda.c (a libcuda of host memory,
tools/check_real_pycuda.sh) and over a Python stand-in in tests/test_cudapy.py.
"""
from __future__ import annotations

import ctypes
import importlib
from typing import Any

import numpy as np

# pycuda's translate_cuda_error: which CUresult becomes which exception class
_LAUNCH = {719, 701, 702, 703}  # LAUNCH_FAILED, LAUNCH_OUT_OF_RESOURCES, LAUNCH_TIMEOUT, LAUNCH_INCOMPATIBLE_TEXTURING
_RUNTIME = {100, 209, 301, 600}  # NO_DEVICE, NO_BINARY_FOR_GPU, FILE_NOT_FOUND, NOT_READY
_OOM = 2
_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0  # CU_LAUNCH_PARAM_*


def _host_address(buf: Any) -> tuple[int, int, Any]:
  """(address, nbytes, keep-alive) of a host buffer (bytes, bytearray, memoryview, numpy array)."""
  a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
  return int(a.ctypes.data), int(a.nbytes), a


class CudaPythonDriver:
  """The adapter: an object with pycuda.driver's names, over a cuda.bindings.driver module `cu`."""

  def __init__(self, cu: Any):
    self.cu = cu
    drv = self

    class Error(Exception): pass
    class MemoryError(Error): pass  # noqa: A001 (pycuda's names)
    class LogicError(Error): pass
    class LaunchError(Error): pass
    class RuntimeError(Error): pass  # noqa: A001
    self.Error, self.MemoryError, self.LogicError, self.LaunchError, self.RuntimeError = Error, MemoryError, LogicError, LaunchError, RuntimeError
    self._contexts: dict[int, Any] = {}  # handle -> our Context object: get_current returns the same object each time

    class Context:
      def __init__(self, handle: Any, dev: int):
        self.handle, self.dev, self.h = handle, dev, int(handle)
      def __eq__(self, other: object) -> bool: return isinstance(other, Context) and other.h == self.h
      def __hash__(self) -> int: return hash(self.h)
      def push(self) -> None: drv.call("cuCtxPushCurrent", self.handle)
      @staticmethod
      def pop() -> None: drv.call("cuCtxPopCurrent")
      @staticmethod
      def get_current() -> Context | None:
        (h,) = drv.call("cuCtxGetCurrent")
        return None if h is None or int(h) == 0 else drv._contexts.get(int(h)) or Context(h, -1)
      @staticmethod
      def synchronize() -> None: drv.call("cuCtxSynchronize")

    class Device:
      def __init__(self, i: int): (self.handle,) = drv.call("cuDeviceGet", i); self.i = i
      @staticmethod
      def count() -> int: return int(drv.call("cuDeviceGetCount")[0])
      def compute_capability(self) -> tuple[int, int]:
        a = drv.cu.CUdevice_attribute
        return (int(drv.call("cuDeviceGetAttribute", a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle)[0]),
                int(drv.call("cuDeviceGetAttribute", a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle)[0]))
      def retain_primary_context(self) -> Context:
        (h,) = drv.call("cuDevicePrimaryCtxRetain", self.handle)
        return drv._contexts.setdefault(int(h), Context(h, self.i))

    class Event:
      def __init__(self) -> None:
        self.ctx = Context.get_current()
        (self.handle,) = drv.call("cuEventCreate", 0)
      def record(self) -> None: drv.call("cuEventRecord", self.handle, 0)
      def synchronize(self) -> None: drv.call("cuEventSynchronize", self.handle)
      def time_till(self, other: Event) -> float: return float(drv.call("cuEventElapsedTime", self.handle, other.handle)[0])
      def __del__(self) -> None: drv.destroy(self.ctx, "cuEventDestroy", self.handle)

    self.Context, self.Device, self.Event = Context, Device, Event

  # ---- calls and errors ----
  def error(self, name: str, err: Any) -> Exception:
    code = int(err)
    res = self.cu.cuGetErrorString(err)
    text = res[1].decode() if int(res[0]) == 0 and res[1] else "unknown error"
    msg = f"{name} failed: {text} ({getattr(err, 'name', code)})"
    cls = self.LaunchError if code in _LAUNCH else self.MemoryError if code == _OOM else self.RuntimeError if code in _RUNTIME else \
      self.Error if code == 999 else self.LogicError
    return cls(msg)

  def call(self, name: str, *args: Any) -> tuple:
    """cu.<name>(*args); its results after the status, or the status raised as a pycuda-style exception."""
    res = getattr(self.cu, name)(*args)
    if int(res[0]) != 0: raise self.error(name, res[0])
    return tuple(res[1:])

  def destroy(self, ctx: Any, name: str, handle: Any) -> None:
    """cu.<name>(handle) with ctx current (pushed for the call when it is not): for destructors, never raises."""
    try:
      pushed = ctx is not None and self.Context.get_current() != ctx
      if pushed: ctx.push()
      try: getattr(self.cu, name)(handle)
      finally:
        if pushed: self.Context.pop()
    except Exception:  # noqa: S110 (a destructor: the context may be dead or the driver torn down at exit)
      pass

  # ---- pycuda.driver's functions ----
  def init(self, flags: int = 0) -> None: self.call("cuInit", flags)

  def mem_alloc(self, size: int) -> DeviceAllocation:
    ctx = self.Context.get_current()
    (ptr,) = self.call("cuMemAlloc", size)
    return DeviceAllocation(self, int(ptr), ctx)

  def memcpy_htod(self, dest: Any, src: Any) -> None:
    addr, n, _keep = _host_address(src)
    self.call("cuMemcpyHtoD", int(dest), addr, n)

  def memcpy_dtoh(self, dest: Any, src: Any) -> None:
    addr, n, _keep = _host_address(dest)
    self.call("cuMemcpyDtoH", addr, int(src), n)

  def memcpy_dtod(self, dest: Any, src: Any, size: int) -> None: self.call("cuMemcpyDtoD", int(dest), int(src), size)

  def module_from_buffer(self, data: bytes) -> Module:
    img = np.frombuffer(bytes(data) + b"\0", dtype=np.uint8)  # NUL-terminated, so PTX text loads as well as a fatbin
    ctx = self.Context.get_current()
    (mod,) = self.call("cuModuleLoadData", int(img.ctypes.data))
    return Module(self, mod, ctx)


class DeviceAllocation:
  """pycuda's DeviceAllocation: int() is the device address; free() (or the destructor) gives it back in its context."""

  def __init__(self, drv: CudaPythonDriver, ptr: int, ctx: Any):
    self.drv, self.ptr, self.ctx, self.valid = drv, ptr, ctx, True

  def __int__(self) -> int: return self.ptr

  def free(self) -> None:
    if not self.valid: raise self.drv.LogicError("device_allocation::free failed: invalid resource handle")
    self.valid = False
    pushed = self.ctx is not None and self.drv.Context.get_current() != self.ctx
    if pushed: self.ctx.push()
    try: self.drv.call("cuMemFree", self.ptr)
    finally:
      if pushed: self.drv.Context.pop()

  def __del__(self) -> None:
    if getattr(self, "valid", False):
      self.valid = False
      self.drv.destroy(self.ctx, "cuMemFree", self.ptr)


class Module:
  def __init__(self, drv: CudaPythonDriver, handle: Any, ctx: Any):
    self.drv, self.handle, self.ctx = drv, handle, ctx

  def get_function(self, name: str) -> Function:
    (fn,) = self.drv.call("cuModuleGetFunction", self.handle, name.encode())
    return Function(self, fn, name)

  def __del__(self) -> None: self.drv.destroy(self.ctx, "cuModuleUnload", self.handle)


class Function:
  def __init__(self, module: Module, handle: Any, name: str):
    self.module, self.handle, self.name = module, handle, name  # the module stays loaded while a function of it lives

  def _launch_kernel(self, grid: Any, block: Any, arg_buf: bytes, shared: int, stream: Any) -> None:
    """cuLaunchKernel with the packed parameter buffer (CU_LAUNCH_PARAM_BUFFER_POINTER), as pycuda's _launch_kernel."""
    buf = ctypes.c_char_p(arg_buf)
    size = ctypes.c_size_t(len(arg_buf))
    extra = (ctypes.c_void_p * 5)(_PARAM_BUFFER_POINTER, ctypes.cast(buf, ctypes.c_void_p).value, _PARAM_BUFFER_SIZE,
                                   ctypes.addressof(size), _PARAM_END)
    g, b = (tuple(int(x) for x in t) + (1,) * (3 - len(t)) for t in (grid, block))
    self.module.drv.call("cuLaunchKernel", self.handle, *g, *b, shared, stream or 0, 0, ctypes.addressof(extra))


def load_cuda_python() -> CudaPythonDriver:
  """The adapter over cuda.bindings.driver (cuda-python >= 12.8), or ImportError."""
  try: cu = importlib.import_module("cuda.bindings.driver")
  except ImportError:
    cu = importlib.import_module("cuda.cuda")  # cuda-python before 12.8 (raises ImportError when absent too)
  return CudaPythonDriver(cu)
