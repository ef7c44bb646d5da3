"""Plans across devices (kiln issue 16) at the executor level, without a GPU: the numpy test runtime stands in for the CPU,
and a queueing copy of it is registered as "CUDA" the way a CUDA stream behaves: a launch (and a copy on the device) only
queues the work, which runs at the next synchronize, or before an allocator copy to or from the host (ordered after the
device's earlier work, returning when done: the contract Buffer.copyin/copyout already rely on). Its memory is not
host-visible, so the plan's copies go through the allocator. A host function that reads device memory directly sees stale
bytes unless the plan waited for the device first, so the tests fail when a wait is missing."""
from __future__ import annotations

from typing import Any

import kiln_executor_testrt as testrt
import numpy as np
import pytest

from kiln.codegen.registry import register_runtime, unregister_runtime
from kiln.codegen.spec import CompiledSpec, DeviceSpec
from kiln.executor import Buffer, ExecutionPlanBuilder, cache
from kiln.executor.builder import DeviceMismatchError
from kiln.executor.planspec import export
from kiln.ir.errors import PlanError, PlanSpecError

N = 64


class QueueAllocator(testrt.TestAllocator):
  def __init__(self, rt: QueueRuntime): self.rt = rt
  def as_numpy(self, handle: Any, dtype: Any, count: int, offset: int = 0) -> None: return None  # device memory
  def copyin(self, dest: np.ndarray, src: memoryview) -> None:
    self.rt.flush(); self.rt.log.append(("htod", dest.nbytes)); super().copyin(dest, src)  # noqa: E702
  def copyout(self, dest: memoryview, src: np.ndarray) -> None:
    self.rt.flush(); self.rt.log.append(("dtoh", src.nbytes)); super().copyout(dest, src)  # noqa: E702
  def copy(self, dest: np.ndarray, src: np.ndarray, size: int) -> None:
    self.rt.log.append(("dtod", size))
    self.rt.queue.append(lambda: dest.__setitem__(slice(0, size), src[:size]))
  def view(self, handle: np.ndarray, offset: int, size: int) -> np.ndarray: return handle[offset:offset + size]


class QueueBound:
  def __init__(self, rt: QueueRuntime, inner: Any, name: str): self.rt, self.inner, self.name = rt, inner, name
  def __call__(self) -> None:
    self.rt.log.append(("launch", self.name))
    self.rt.queue.append(self.inner)
  def set_vals(self, *a: Any) -> None: self.inner.set_vals(*a)


class QueueProgram:
  def __init__(self, rt: QueueRuntime, compiled: CompiledSpec):
    self.rt, self.plain, self.name = rt, testrt.TestProgram(compiled), compiled.name
  def __call__(self, bufs: Any, vals: Any = (), global_size: Any = (1, 1, 1), local_size: Any = None, wait: bool = False) -> float | None:
    if not wait: return self.bind(bufs, vals, global_size, local_size)()
    self.rt.flush()  # a timed launch waits for it, and so for the work queued before it
    self.rt.log.append(("launch", self.name))
    return self.plain(bufs, vals, global_size, local_size, wait=True)
  def bind(self, bufs: Any, vals: Any = (), global_size: Any = (1, 1, 1), local_size: Any = None) -> QueueBound:
    return QueueBound(self.rt, self.plain.bind(bufs, vals, global_size, local_size), self.name)


class QueueRuntime(testrt.TestRuntime):
  host_parallel_safe = False
  log: list[tuple] = []  # shared by the devices of a test: the order of launches, copies and waits across them

  def __init__(self, spec: DeviceSpec | None = None):
    super().__init__(spec)
    self.device = str(spec or "CUDA:0")
    self.allocator = QueueAllocator(self)
    self.queue: list[Any] = []
  def load(self, compiled: CompiledSpec) -> QueueProgram: return QueueProgram(self, compiled)
  def flush(self) -> None:
    q, self.queue = self.queue, []
    for f in q: f()
  def synchronize(self) -> None:
    self.log.append(("sync", self.device))
    self.flush()


@pytest.fixture
def dev(rt, monkeypatch):
  """The numpy test runtime as "CPU" (rt) and its queueing copy as "CUDA:N"; yields the shared log."""
  log: list[tuple] = []
  monkeypatch.setattr(QueueRuntime, "log", log)
  register_runtime("CUDA", QueueRuntime)
  cache.clear_memory_cache()
  yield log
  unregister_runtime("CUDA")
  cache.clear_memory_cache()


def ew(name: str, add: float, nin: int = 1, n: int = N) -> Any: return testrt.elementwise(name, 0, list(range(1, nin + 1)), n, add=add)


def host(b: ExecutionPlanBuilder, x: np.ndarray | None = None, device: str = "CPU") -> int:
  buf = Buffer(device, N, "float32")
  if x is not None: buf.copyin(x.astype(np.float32))
  return b.add_buffer(buf)


def kinds(log: list[tuple]) -> list[str]: return [e[0] for e in log]


def pipeline(b: ExecutionPlanBuilder, x: np.ndarray) -> tuple[int, dict[str, int]]:
  """CPU a = x + 1 -> copy to CUDA -> CUDA r = a + 2 -> copy back -> CPU y = r + x + 3 (the x read again on the CPU)."""
  bx, ba, br, by = host(b, x), host(b), host(b), host(b)
  da, dr = host(b, device="CUDA:0"), host(b, device="CUDA:0")
  ids = {"cpu1": b.add_kernel(ew("cpu1", 1.0), [ba, bx]), "htod": b.add_copy(da, ba),
         "gpu": b.add_kernel(ew("gpu", 2.0), [dr, da]), "dtoh": b.add_copy(br, dr),
         "cpu2": b.add_kernel(ew("cpu2", 3.0, nin=2), [by, br, bx])}
  b.set_outputs([by])
  return by, ids


def test_mixed_pipeline_runs_in_order_without_waits(dev) -> None:
  x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
  b = ExecutionPlanBuilder("CPU")
  by, ids = pipeline(b, x)
  plan = b.build()
  by_id = {p.id: p for p in plan.prepared_ops}
  assert str(by_id[ids["gpu"]].device) == "CUDA:0" and str(by_id[ids["cpu1"]].device) == "CPU"  # the buffers decided
  assert by_id[ids["dtoh"]].name.endswith("CUDA:0->CPU") and by_id[ids["htod"]].name.endswith("CPU->CUDA:0")
  assert by_id[ids["dtoh"]].dependencies == [ids["gpu"]] and by_id[ids["cpu2"]].dependencies == [ids["dtoh"]]  # hazards across devices
  assert all(not getattr(p, "waits", []) for p in plan.prepared_ops)  # every hand-over is a copy, ordered after the device
  for _ in range(2):
    dev.clear()
    plan.execute()
    # the launch only queues; the device->host copy runs after it (it flushes the queue), and cpu2 reads what it brought
    assert kinds(dev) == ["htod", "launch", "dtoh"]
    np.testing.assert_allclose(plan.output_buffer(0).numpy(), (x + 1 + 2) + x + 3, rtol=1e-6)


def test_a_host_function_on_device_memory_waits_for_the_device(dev) -> None:
  x = np.arange(N, dtype=np.float32)
  b = ExecutionPlanBuilder("CUDA")
  dx, dy = host(b, x, "CUDA:0"), host(b, device="CUDA:0")
  seen: list[np.ndarray] = []
  k = b.add_kernel(ew("gpu", 5.0), [dy, dx])
  f = b.add_custom(lambda y: seen.append(y.storage.handle.view(np.float32).copy()), [dy], outputs=[])  # reads the memory itself
  b.set_outputs([dy])
  plan = b.build()
  assert {p.id: p for p in plan.prepared_ops}[f].waits == ["CUDA:0"] and {p.id: p for p in plan.prepared_ops}[k].waits == []
  dev.clear()
  plan.execute()
  assert kinds(dev) == ["launch", "sync"]
  np.testing.assert_array_equal(seen[0], x + 5)  # without the wait it would read zeros: the launch is still queued


def test_an_explicit_dependency_across_devices_waits(dev) -> None:
  b = ExecutionPlanBuilder("CPU")
  dx, dy = host(b, np.ones(N), "CUDA:0"), host(b, device="CUDA:0")
  cx, cy, cz = host(b, np.ones(N)), host(b), host(b)
  g = b.add_kernel(ew("gpu", 1.0), [dy, dx])
  c1 = b.add_kernel(ew("cpu_after", 1.0), [cy, cx], deps=[g])  # the caller says it must follow the CUDA kernel
  c2 = b.add_kernel(ew("cpu_free", 1.0), [cz, cx])  # independent: no wait
  b.set_outputs([cy, cz, dy])
  plan = b.build()
  waits = {p.id: p.waits for p in plan.prepared_ops}
  assert waits[c1] == ["CUDA:0"] and waits[c2] == [] and waits[g] == []
  rt = testrt
  rt.EVENTS.clear()
  dev.clear()
  plan.execute()
  assert kinds(dev) == ["launch", "sync"]
  ran = [e[0] for e in rt.EVENTS]
  assert ran.index("gpu") < ran.index("cpu_after")  # the CUDA kernel really ran before it (the sync flushed it)


def test_a_copy_into_device_memory_a_queued_kernel_reads_follows_it(dev) -> None:
  """WAR across devices: the host->device copy overwrites the buffer the queued CUDA kernel still reads; it is ordered after
  the kernel (a dependency, and the allocator's copy runs after the device's queued work) and the kernel reads the old data."""
  b = ExecutionPlanBuilder("CPU")
  dx, dy = host(b, np.full(N, 1.0), "CUDA:0"), host(b, device="CUDA:0")
  cnew, cout = host(b, np.full(N, 100.0)), host(b)
  g = b.add_kernel(ew("gpu", 1.0), [dy, dx])
  c = b.add_copy(dx, cnew)
  back = b.add_copy(cout, dy)
  b.set_outputs([cout, dx])
  plan = b.build()
  by_id = {p.id: p for p in plan.prepared_ops}
  assert by_id[c].dependencies == [g] and by_id[c].level > by_id[g].level and by_id[back].dependencies == [g]
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 2.0))  # 1 + 1: the kernel read the old x
  np.testing.assert_array_equal(plan.output_buffer(1).numpy(), np.full(N, 100.0))


def test_a_cpu_kernel_overwriting_a_copys_host_side_does_not_wait(dev) -> None:
  b = ExecutionPlanBuilder("CPU")
  dx = host(b, np.full(N, 3.0), "CUDA:0")
  h, out = host(b), host(b)
  c = b.add_copy(h, dx)  # device -> host: returns with the data
  k = b.add_kernel(ew("cpu", 1.0), [out, h])
  w = b.add_kernel(ew("cpu_overwrite", 7.0), [h, out])  # overwrites the copy's destination after k read it
  b.set_outputs([h])
  plan = b.build()
  assert all(p.waits == [] for p in plan.prepared_ops if p.id in (c, k, w))  # type: ignore[union-attr]
  plan.execute()
  assert "sync" not in kinds(dev)
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 3.0 + 1 + 7))


def test_device_copies_on_one_device_and_between_two(dev) -> None:
  x = np.arange(N, dtype=np.float32)
  b = ExecutionPlanBuilder("CUDA")
  a0, b0 = host(b, x, "CUDA:0"), host(b, device="CUDA:0")
  c1, d1, out = host(b, device="CUDA:1"), host(b, device="CUDA:1"), host(b)
  b.add_copy(b0, a0)  # on CUDA:0: the device copies it, queued
  b.add_copy(c1, b0)  # CUDA:0 -> CUDA:1: through the host
  k = b.add_kernel(ew("gpu1", 1.0), [d1, c1])
  b.add_copy(out, d1)
  b.set_outputs([out])
  plan = b.build()
  assert str({p.id: p for p in plan.prepared_ops}[k].device) == "CUDA:1"
  dev.clear()
  plan.execute()
  assert kinds(dev) == ["dtod", "dtoh", "htod", "launch", "dtoh"]  # the queued device copy ran before CUDA:0's copy out
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), x + 1)


def test_a_kernel_whose_buffers_are_on_two_devices_is_refused(dev) -> None:
  b = ExecutionPlanBuilder("CPU")
  c, d = host(b), host(b, device="CUDA:0")
  b.add_kernel(ew("mixed", 1.0), [c, d])
  b.set_outputs([c])
  want = r"kernel 0 'mixed' runs on CPU .*slot 1: buffer 1 is on CUDA:0.*add_copy it first, to a buffer on CPU"
  with pytest.raises(DeviceMismatchError, match=want):
    b.build()
  assert issubclass(DeviceMismatchError, PlanError)
  b2 = ExecutionPlanBuilder("CPU")
  d0, d1 = host(b2, device="CUDA:0"), host(b2, device="CUDA:0")
  b2.add_kernel(ew("there", 1.0), [d0, d1], device="CPU")  # told where to run, buffers elsewhere
  b2.set_outputs([d0])
  with pytest.raises(DeviceMismatchError, match=r"kernel 0 'there' runs on CPU, but slot 0: buffer 0 is on CUDA:0"):
    b2.build()


def test_memory_reuse_never_aliases_across_devices(dev) -> None:
  """Intermediates on both devices, alive at the same levels: each device's intermediates share its own memory only."""
  x = np.ones(N, np.float32)
  b = ExecutionPlanBuilder("CPU")
  cx, dxx = host(b, x), host(b, x, "CUDA:0")
  cs = [host(b) for _ in range(4)]
  ds = [host(b, device="CUDA:0") for _ in range(4)]
  prev_c, prev_d = cx, dxx
  for i in range(4):
    b.add_kernel(ew(f"c{i}", 1.0), [cs[i], prev_c])
    b.add_kernel(ew(f"d{i}", 1.0), [ds[i], prev_d])
    prev_c, prev_d = cs[i], ds[i]
  out = host(b)
  b.add_copy(out, ds[-1])
  b.set_outputs([cs[-1], out])
  plan = b.build()
  assert plan.memory_bytes < plan.memory_bytes_without_reuse  # reuse happened
  for i in cs + ds:
    buf = plan.buffers[i]
    assert buf.storage.device == buf.device  # a buffer only ever lands in memory of its own device
  assert not {plan.buffers[i].storage_id for i in cs} & {plan.buffers[i].storage_id for i in ds}
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), x + 4)
  np.testing.assert_array_equal(plan.output_buffer(1).numpy(), x + 4)


def test_single_device_plans_get_no_waits_and_keep_their_order(dev) -> None:
  for device in ("CPU", "CUDA:0"):
    b = ExecutionPlanBuilder(device)
    xs = [host(b, np.ones(N), device)] + [host(b, device=device) for _ in range(3)]
    b.add_kernel(ew("k0", 1.0), [xs[1], xs[0]])
    b.add_kernel(ew("k1", 1.0), [xs[2], xs[0]])
    b.add_kernel(ew("k2", 1.0, nin=2), [xs[3], xs[1], xs[2]])
    b.set_outputs([xs[3]])
    plan = b.build()
    assert plan.op_levels == [[0, 1], [2]]
    assert all(not p.waits for p in plan.kernels)
    dev.clear()
    plan.execute()
    assert "sync" not in kinds(dev)
    np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 5.0))


def test_within_a_level_a_mixed_plan_launches_before_host_work(dev) -> None:
  b = ExecutionPlanBuilder("CPU")
  c = [host(b, np.ones(N)), host(b)]
  d = [host(b, np.ones(N), "CUDA:0"), host(b, device="CUDA:0")]
  kc = b.add_kernel(ew("cpu", 1.0), [c[1], c[0]])
  kd = b.add_kernel(ew("gpu", 1.0), [d[1], d[0]])
  b.set_outputs([c[1], d[1]])
  plan = b.build()
  assert plan.op_levels == [[kd, kc]]  # the device works while the host computes


def test_a_plan_across_devices_is_refused_by_export(dev) -> None:
  b = ExecutionPlanBuilder("CPU")
  by, _ = pipeline(b, np.ones(N, np.float32))
  plan = b.build()
  with pytest.raises(PlanSpecError, match=r"kernels run on 2 devices: CPU \(first: kernel op 0 'cpu1'\); CUDA:0 \(first: kernel op 2 'gpu'\)"):
    export(plan, {}, {"y": by})
