"""Scenarios run over the REAL pycuda and tools/fake_libcuda.c (see check_real_pycuda.sh): each must end with exit status 0
and no "PyCUDA" complaint on stderr (pycuda aborts a process whose context stack is not empty at exit, and warns when it
cannot free memory out of its context's thread). Usage: python real_pycuda_probe.py SCENARIO."""
from __future__ import annotations

import sys
import threading

import numpy as np

from kiln.codegen.spec import CompiledSpec, Variable
from kiln.ir import UOp, dtypes
from kiln.ir.errors import DeviceError
from kiln.runtime.cuda.driver import CUDARuntime


def spec(name: str) -> CompiledSpec:
  g0, g1 = UOp.define_global(0, dtypes.float32.ptr()), UOp.define_global(1, dtypes.float32.ptr())
  ast = UOp.sink(g0.index(0).store(g1.index(0).load()))
  n = UOp.variable("n", 1, 1 << 20)
  return CompiledSpec(name=name, bytes=b"fake fatbin", ast=ast, var_names=["n"], global_size=((n + 63) // 64, 1, 1),
                      local_size=(64, 1, 1), buf_count=2, device="CUDA:0", globals=[0, 1], outs=[0], ins=[1],
                      vars=[Variable(name="n", min=1, max=1 << 20)])


def scale2(rt: CUDARuntime, n: int = 100) -> None:
  """alloc, copy in, one bound launch of the fake's scale2 kernel, copy out, check, free: all on this thread."""
  prog = rt.load(spec("scale2"))
  a, b = rt.allocator.alloc(4 * n), rt.allocator.alloc(4 * n)
  x = np.arange(n, dtype=np.float32)
  rt.allocator.copyin(b, memoryview(x).cast("B"))
  prog.bind([a.ptr, b.ptr], [n])()
  assert prog([a.ptr, b.ptr], [n], wait=True) is not None
  out = np.zeros(n, np.float32)
  rt.allocator.copyout(memoryview(out).cast("B"), a)
  assert (out == 2 * x).all(), out[:8]
  rt.synchronize()
  rt.allocator.free(a, 4 * n)
  rt.allocator.free(b, 4 * n)


def in_thread(fn, *args) -> None:
  err: list = []

  def body():
    try: fn(*args)
    except BaseException as e: err.append(e)
  t = threading.Thread(target=body)
  t.start()
  t.join()
  if err: raise err[0]


def main(what: str) -> None:
  rt = CUDARuntime("CUDA:0")
  if what == "main_thread":
    scale2(rt)
  elif what == "worker_threads":
    in_thread(scale2, rt)
    in_thread(scale2, rt)
    rt.allocator.cache_limit = 0  # every free evicts: the pycuda free runs on the thread that frees
    bufs = [rt.allocator.alloc(256) for _ in range(4)]
    in_thread(lambda: [rt.allocator.free(b, 256) for b in bufs])
  elif what == "two_devices":
    rt1 = CUDARuntime("CUDA:1")
    with rt.current():
      scale2(rt1)  # GPU 1's work while GPU 0's context is current
    in_thread(scale2, rt1)
    scale2(rt)
  elif what == "foreign_wrapper":  # the caller's own wrapper of the same primary context is current (pycuda.autoprimaryctx)
    theirs = rt.drv.Device(0).retain_primary_context()
    theirs.push()
    rt.allocator.cache_limit = 0
    bufs = [rt.allocator.alloc(256) for _ in range(2)]
    in_thread(lambda: [rt.allocator.free(b, 256) for b in bufs])
    in_thread(scale2, rt)
    rt.drv.Context.pop()
  elif what == "fault":
    prog = rt.load(spec("fault"))
    a = rt.allocator.alloc(64)
    prog([a.ptr, a.ptr], [16])
    try:
      rt.allocator.copyout(memoryview(bytearray(64)), a)
      raise AssertionError("the fault was not reported")
    except DeviceError as e: assert "device context is dead" in str(e) and "illegal memory access" in str(e), e
    for call in (lambda: rt.allocator.alloc(64), rt.synchronize, lambda: prog([a.ptr, a.ptr], [16])):
      try:
        call()
        raise AssertionError("a call on a dead context went through")
      except DeviceError as e: assert "device context is dead" in str(e), e
    rt.allocator.free(a, 64)
  else: raise SystemExit(f"unknown scenario {what}")
  print(f"{what}: ok")


if __name__ == "__main__": main(sys.argv[1])
