"""Plans across devices (kiln issue 16): CPU kernels (the real CPU runtime) and CUDA kernels (compiled by nvcc, launched
through the real CUDA runtime over the recording stand-in for pycuda.driver) in one ExecutionPlan, with copies between them.

The stand-in records launches and copies but runs no kernel and moves no bytes. Here it is wrapped (its rules and records
kept) so that it models a GPU's stream: every allocation gets host memory behind it, a launch queues the test's numpy
model of that kernel, cuMemcpyDtoD queues the move, and the queue runs at cuCtxSynchronize, at an event's synchronize, and
before a cuMemcpyHtoD or cuMemcpyDtoH (which CUDA orders after the stream's earlier work, returning when their host side is
done). So results flow as on a GPU, and a host read of device memory that skipped a wait sees stale bytes."""
from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cuda_standin import driver_tests, installed  # noqa: E402

from kiln.executor import Buffer, ExecutionPlanBuilder
from kiln.executor.builder import DeviceMismatchError
from kiln.executor.planspec import export
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import PlanSpecError
from kiln.runtime.cuda.compiler import find_nvcc

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
M, K, N = 8, 16, 32
f32 = dtypes.float32


def _streamed(drv: Any, models: dict[str, Callable[[Callable[[int, int], np.ndarray], bytes], None]]) -> dict[str, Any]:
  """Wrap the stand-in `drv` in place into the stream model above. models: kernel name -> fn(mem, arg_buf), where
  mem(ptr, nbytes) is a writable uint8 view of device memory. Returns the model's state (memory, queues)."""
  st: dict[str, Any] = {"mem": {}, "queue": {}}

  def mem(ptr: int, n: int) -> np.ndarray:
    for base, raw in st["mem"].items():
      if base <= ptr and ptr + n <= base + len(raw): return np.frombuffer(raw, np.uint8)[ptr - base:ptr - base + n]
    raise AssertionError(f"no device allocation holds [{ptr:#x}, {ptr + n:#x})")

  def dev() -> int: return drv.Context.get_current().dev
  def flush() -> None:
    q, st["queue"][dev()] = st["queue"].get(dev(), []), []
    for f in q: f()
  def enqueue(f: Callable[[], None]) -> None: st["queue"].setdefault(dev(), []).append(f)

  alloc, htod, dtoh, dtod, load = drv.mem_alloc, drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod, drv.module_from_buffer
  ctx_sync, ev_sync = drv.Context.synchronize, drv.Event.synchronize

  def mem_alloc(size: int) -> Any:
    a = alloc(size)
    st["mem"][int(a)] = bytearray(size)
    return a

  def memcpy_htod(d: Any, s: Any) -> None:
    htod(d, s)
    flush()
    src = np.frombuffer(memoryview(s).cast("B"), np.uint8)
    mem(int(d), src.nbytes)[:] = src

  def memcpy_dtoh(d: Any, s: Any) -> None:
    dtoh(d, s)
    flush()
    out = np.frombuffer(memoryview(d).cast("B"), np.uint8)
    out[:] = mem(int(s), out.nbytes)

  def memcpy_dtod(d: Any, s: Any, n: int) -> None:
    dtod(d, s, n)
    enqueue(lambda: mem(int(d), n).__setitem__(slice(None), mem(int(s), n).copy()))

  def synchronize() -> None:
    ctx_sync()
    flush()

  def event_sync(self: Any) -> None:
    ev_sync(self)
    flush()

  def module_from_buffer(b: bytes) -> Any:
    m = load(b)
    get = m.get_function
    def get_function(name: str) -> Any:
      fn = get(name)
      launch = fn._launch_kernel
      def launched(grid: Any, block: Any, buf: bytes, shared: int, stream: Any) -> None:
        launch(grid, block, buf, shared, stream)
        if name in models: enqueue(lambda: models[name](mem, bytes(buf)))
      fn._launch_kernel = launched
      return fn
    m.get_function = get_function
    return m

  drv.mem_alloc, drv.module_from_buffer = mem_alloc, module_from_buffer
  drv.memcpy_htod, drv.memcpy_dtoh, drv.memcpy_dtod = memcpy_htod, memcpy_dtoh, memcpy_dtod
  drv.Context.synchronize, drv.Event.synchronize = staticmethod(synchronize), event_sync
  st["mem_of"] = mem
  return st


def _add_model(n: int) -> Callable[[Callable[[int, int], np.ndarray], bytes], None]:
  def run(mem: Callable[[int, int], np.ndarray], buf: bytes) -> None:
    out, a, b = struct.unpack_from("=QQQ", buf)
    mem(out, 4 * n).view(np.float32)[:] = mem(a, 4 * n).view(np.float32) + mem(b, 4 * n).view(np.float32)
  return run


def _relu_model(n: int) -> Callable[[Callable[[int, int], np.ndarray], bytes], None]:
  def run(mem: Callable[[int, int], np.ndarray], buf: bytes) -> None:
    out, inp = struct.unpack_from("=QQ", buf)
    mem(out, 4 * n).view(np.float32)[:] = np.maximum(mem(inp, 4 * n).view(np.float32), 0)
  return run


@pytest.fixture
def gpu(monkeypatch, tmp_path):
  mod = driver_tests()
  calls: list = []
  drv = mod.make_fake_driver(calls, cc=(9, 0), ndev=2)
  state = _streamed(drv, {"relu": _relu_model(M * N), "add": _add_model(M * N)})
  with installed(mod, monkeypatch, tmp_path, drv): yield calls, state


def _events(calls: list) -> list[str]:
  """Launches (by kernel), copies and synchronisations, in order."""
  names = {"launch": lambda c: f"launch {c[1]}", "htod": lambda c: "htod", "dtoh": lambda c: "dtoh", "dtod": lambda c: "dtod",
           "ctx_sync": lambda c: "sync", "event_sync": lambda c: "event_sync"}
  return [names[c[0]](c) for c in calls if c[0] in names]


def _relu() -> Any: return kernels.elementwise(lambda v: v.maximum(0.0), f32, ((M * N,), f32), name="relu")
def _add() -> Any: return kernels.elementwise(lambda a, b: a + b, f32, ((M * N,), f32), ((M * N,), f32), name="add")


def _pipeline(a: np.ndarray, w: np.ndarray, r: np.ndarray) -> tuple[ExecutionPlanBuilder, dict[str, int]]:
  """CPU h = a @ w -> copy to CUDA -> CUDA g = relu(h) -> copy back -> CPU y = g + r."""
  b = ExecutionPlanBuilder("CPU")
  ba, bw, br = (b.add_buffer(Buffer.from_numpy(x)) for x in (a, w, r))
  h, g, y = (b.add_buffer(Buffer("CPU", M * N, f32)) for _ in range(3))
  dh, dg = (b.add_buffer(Buffer("CUDA:0", M * N, f32)) for _ in range(2))
  ids = {"matmul": b.add_kernel(kernels.matmul(M, N, K), [h, ba, bw]), "htod": b.add_copy(dh, h),
         "relu": b.add_kernel(_relu(), [dg, dh]), "dtoh": b.add_copy(g, dg), "add": b.add_kernel(_add(), [y, g, br])}
  b.set_outputs([y])
  return b, ids


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32),
          rng.standard_normal(M * N).astype(np.float32))


def test_cpu_matmul_cuda_relu_cpu_add(gpu) -> None:
  calls, _ = gpu
  a, w, r = _data()
  b, ids = _pipeline(a, w, r)
  plan = b.build()
  ops = {p.id: p for p in plan.prepared_ops}
  assert [str(ops[ids[k]].device) for k in ("matmul", "relu", "add")] == ["CPU", "CUDA:0", "CPU"]
  assert ops[ids["dtoh"]].dependencies == [ids["relu"]] and ops[ids["add"]].dependencies == [ids["dtoh"]]
  assert plan.op_levels == [[ids["matmul"]], [ids["htod"]], [ids["relu"]], [ids["dtoh"]], [ids["add"]]]
  for seed in (0, 1):
    a2, w2, r2 = _data(seed)
    for i, x in ((0, a2), (1, w2), (2, r2)): plan.buffers[i].copyin(x)
    calls.clear()
    plan.execute()
    # the CUDA kernel's output reaches the CPU through the copy, which the stream orders after the launch: no host wait
    assert _events(calls) == ["htod", "launch relu", "dtoh"]
    np.testing.assert_allclose(plan.output_buffer(0).numpy(), np.maximum(a2 @ w2, 0).reshape(-1) + r2, rtol=1e-5, atol=1e-5)


def test_a_host_function_reading_cuda_memory_waits(gpu) -> None:
  """A host function handed a CUDA buffer may read its memory itself (here through the stand-in's memory, as another
  library would through the pointer): the plan synchronises the device before it, else it reads before relu ran."""
  calls, state = gpu
  x = np.linspace(-1, 1, M * N, dtype=np.float32)
  b = ExecutionPlanBuilder("CUDA")
  dx, dy = b.add_buffer(Buffer("CUDA:0", M * N, f32).copyin(x)), b.add_buffer(Buffer("CUDA:0", M * N, f32))
  seen: list[np.ndarray] = []
  k = b.add_kernel(_relu(), [dy, dx])
  f = b.add_custom(lambda y: seen.append(state["mem_of"](y.ptr, y.nbytes).view(np.float32).copy()), [dy], outputs=[])
  b.set_outputs([dy])
  plan = b.build()
  ops = {p.id: p for p in plan.prepared_ops}
  assert ops[f].waits == ["CUDA:0"] and ops[k].waits == []
  calls.clear()
  plan.execute()
  assert _events(calls) == ["launch relu", "sync"]
  np.testing.assert_array_equal(seen[0], np.maximum(x, 0))


def test_a_cpu_kernel_told_to_follow_a_cuda_kernel_waits_for_it(gpu) -> None:
  calls, _ = gpu
  b = ExecutionPlanBuilder("CPU")
  dx, dy = b.add_buffer(Buffer("CUDA:0", M * N, f32)), b.add_buffer(Buffer("CUDA:0", M * N, f32))
  cx, cy = b.add_buffer(Buffer.from_numpy(np.ones(M * N, np.float32))), b.add_buffer(Buffer("CPU", M * N, f32))
  g = b.add_kernel(_relu(), [dy, dx])
  c = b.add_kernel(_relu(), [cy, cx], deps=[g])
  b.set_outputs([cy, dy])
  plan = b.build()
  assert {p.id: p for p in plan.prepared_ops}[c].waits == ["CUDA:0"]
  calls.clear()
  plan.execute()
  assert _events(calls) == ["launch relu", "sync"]  # the CPU relu (not in the driver's record) ran after the sync


def test_single_device_plans_add_no_synchronisation(gpu) -> None:
  calls, _ = gpu
  x = np.linspace(-1, 1, M * N, dtype=np.float32)
  b = ExecutionPlanBuilder("CUDA")
  dx, dh, dy = (b.add_buffer(Buffer("CUDA:0", M * N, f32)) for _ in range(3))
  hx, hy = b.add_buffer(Buffer.from_numpy(x)), b.add_buffer(Buffer("CPU", M * N, f32))
  b.add_copy(dx, hx)
  b.add_kernel(_relu(), [dh, dx])
  b.add_kernel(_add(), [dy, dh, dx])
  b.add_copy(hy, dy)
  b.set_outputs([hy])
  plan = b.build()
  assert plan.op_levels == [[0], [1], [2], [3]] and not any(p.waits for p in plan.kernels)
  calls.clear()
  plan.execute()
  assert _events(calls) == ["htod", "launch relu", "launch add", "dtoh"]
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.maximum(x, 0) + x)


def test_device_to_device_copies(gpu) -> None:
  """On one GPU the device copies (cuMemcpyDtoD, queued in order); between two GPUs through the host."""
  calls, _ = gpu
  x = np.linspace(-1, 1, M * N, dtype=np.float32)
  b = ExecutionPlanBuilder("CUDA")
  a0, b0 = b.add_buffer(Buffer("CUDA:0", M * N, f32).copyin(x)), b.add_buffer(Buffer("CUDA:0", M * N, f32))
  c1, d1 = b.add_buffer(Buffer("CUDA:1", M * N, f32)), b.add_buffer(Buffer("CUDA:1", M * N, f32))
  out = b.add_buffer(Buffer("CPU", M * N, f32))
  b.add_copy(b0, a0)
  b.add_copy(c1, b0)
  k = b.add_kernel(_relu(), [d1, c1])
  b.add_copy(out, d1)
  b.set_outputs([out])
  plan = b.build()
  assert str({p.id: p for p in plan.prepared_ops}[k].device) == "CUDA:1"
  calls.clear()
  plan.execute()
  assert _events(calls) == ["dtod", "dtoh", "htod", "launch relu", "dtoh"]
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.maximum(x, 0))


def test_mismatched_devices_and_export(gpu) -> None:
  b = ExecutionPlanBuilder("CPU")
  c, d = b.add_buffer(Buffer("CPU", M * N, f32)), b.add_buffer(Buffer("CUDA:0", M * N, f32))
  b.add_kernel(_relu(), [c, d])
  b.set_outputs([c])
  with pytest.raises(DeviceMismatchError, match=r"kernel 0 'relu' runs on CPU .*slot 1: buffer 1 is on CUDA:0"):
    b.build()
  a, w, r = _data()
  plan = _pipeline(a, w, r)[0].build()
  with pytest.raises(PlanSpecError, match=r"kernels run on 2 devices: CPU .*CUDA:0 \(first: kernel op 2 'relu'\)"):
    export(plan, {"r": 2}, {"y": 5})
