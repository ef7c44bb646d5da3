"""CUDA graphs in plans (kiln issue 16): ExecutionPlan hands each stretch of a runtime's launches with nothing between them
to the runtime (GraphCall), and the CUDA runtime launches a stretch of 4 or more as one CUDA graph. Over the pycuda
stand-in of kiln-runtime-cuda's tests/test_driver.py and the libcuda graph stand-in of its tests/test_graph.py."""
from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
from kiln_executor_testrt import CUDA_TESTS, cuda_test_module

from kiln.codegen import registry
from kiln.executor import Buffer, ExecutionPlanBuilder, cache
from kiln.executor.execution import session_runs
from kiln.ir import UOp, kernels
from kiln.ir.dtype import dtypes


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
  drv_tests, graph_tests = cuda_test_module("test_driver.py"), cuda_test_module("test_graph.py")
  calls: list = []
  drv = drv_tests.make_fake_driver(calls, cc=(9, 0))
  drv_tests.install_standin(monkeypatch, tmp_path, drv)
  lib = graph_tests.install_fake_graphs(monkeypatch, drv, calls)
  registry.unregister_runtime("CUDA")
  cache.clear_memory_cache()
  yield calls, drv, lib
  registry.unregister_runtime("CUDA")
  cache.clear_memory_cache()
  gc.collect()
  assert drv._problems() == []  # no context left pushed; graphs and modules destroyed in their context


def _kinds(calls: list, *kinds: str) -> list[str]: return [c[0] for c in calls if c[0] in kinds]
def _launched(calls: list) -> list: return [c[1:] for c in calls if c[0] in ("launch", "graph_kernel")]


_INC = None


def _inc():
  global _INC
  if _INC is None: _INC = kernels.elementwise(lambda v: v + 1.0, dtypes.float32, ((256,), dtypes.float32), name="inc")
  return _INC


def _chain(n: int, copy_after: int | None = None):
  """n dependent `v + 1` kernels over two ping-pong CUDA buffers; with copy_after=i, a device copy of the latest output
  into a third buffer after the i-th kernel (which the next kernel then reads)."""
  b = ExecutionPlanBuilder("CUDA")
  bufs = [b.add_buffer(Buffer("CUDA", 256, dtypes.float32)) for _ in range(3)]
  cur, other = bufs[0], bufs[1]
  for i in range(n):
    b.add_kernel(_inc(), [other, cur])
    cur, other = other, cur
    if copy_after == i + 1:
      b.add_copy(bufs[2], cur)
      cur, other, bufs[2] = bufs[2], other, cur
  b.set_outputs([cur])
  plan = b.build()
  b.buffers[bufs[0]].copyin(np.zeros(256, np.float32))
  return plan


def _plain(plan, monkeypatch) -> None:
  """Regroup the plan's steps with graphs off (KILN_CUDA_GRAPHS is read when a plan groups its runs)."""
  monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")
  plan._steps = plan._steps
  monkeypatch.delenv("KILN_CUDA_GRAPHS")


def test_a_12_kernel_plan_is_one_graph_launch_per_execute(fake_cuda, monkeypatch) -> None:
  calls, drv, lib = fake_cuda
  plan = _chain(12)
  calls.clear()
  plan.execute()
  plan.execute()
  assert _kinds(calls, "launch", "graph_launch", "graph_instantiate") == ["graph_instantiate", "graph_launch", "graph_launch"]
  assert _kinds(calls, "push", "pop") == ["push", "pop"] * 2  # still one session per run
  graph = _launched(calls)
  assert len(graph) == 24 and drv.Context.get_current() is None
  _plain(plan, monkeypatch)
  calls.clear()
  plan.execute()
  assert _kinds(calls, "launch", "graph_launch") == ["launch"] * 12
  assert graph[:12] == _launched(calls)  # the same kernels in the same order, with the same grids, blocks and argument bytes
  monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")  # a plan built with graphs off launches one by one
  plan2 = _chain(12)
  calls.clear()
  plan2.execute()
  assert _kinds(calls, "launch", "graph_launch") == ["launch"] * 12


def test_without_the_graph_api_the_plan_launches_one_by_one(fake_cuda, monkeypatch) -> None:
  calls, drv, lib = fake_cuda
  from kiln.runtime.cuda import graph as cuda_graph
  monkeypatch.setattr(cuda_graph, "open_api", lambda d: None)  # a stand-in driver, no libcuda, cuda too old
  plan = _chain(12)
  calls.clear()
  plan.execute()
  assert _kinds(calls, "launch", "graph_launch") == ["launch"] * 12


def test_an_instantiate_error_runs_the_plan_plainly_with_the_same_launches(fake_cuda, monkeypatch) -> None:
  calls, drv, lib = fake_cuda
  plan = _chain(6)
  lib.fail["cuGraphInstantiateWithFlags"] = [801]
  calls.clear()
  with pytest.warns(RuntimeWarning, match="one by one"): plan.execute()
  assert _kinds(calls, "launch", "graph_launch") == ["launch"] * 6 and not plan.poisoned
  plan.execute()
  assert _kinds(calls, "launch", "graph_launch") == ["launch"] * 12


def test_a_runtime_variable_changes_what_the_graph_launches(fake_cuda, monkeypatch) -> None:
  calls, drv, lib = fake_cuda
  n = UOp.variable("n", 1, 1 << 21)  # too many idle blocks at the bound to read n from memory: an argument (cuda_vars.py)
  b = ExecutionPlanBuilder("CUDA")
  x, y = b.add_buffer(Buffer("CUDA", 1 << 21, dtypes.float32)), b.add_buffer(Buffer("CUDA", 1 << 21, dtypes.float32))
  k = kernels.elementwise(lambda v: v * 2.0, dtypes.float32, ((n,), dtypes.float32), name="dbl")
  for i in range(5): b.add_kernel(k, [y, x] if i % 2 == 0 else [x, y])
  b.set_outputs([y])
  plan = b.build()
  runs = []
  for v in (100, 1000, 1000, 7):
    calls.clear()
    plan.execute_with_vars({"n": v})
    assert _kinds(calls, "launch", "graph_launch") == ["graph_launch"]
    runs.append(_launched(calls))
  assert runs[0] != runs[1] == runs[2] != runs[3]  # args (n) and grids follow the variable
  _plain(plan, monkeypatch)
  calls.clear()
  plan.execute()  # n is still 7
  assert _launched(calls) == runs[3]
  monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
  plan._steps = plan._steps  # graphs again (a fresh graph): n=1000 matches the plain path at n=1000
  calls.clear()
  plan.execute_with_vars({"n": 1000})
  graph = _launched(calls)
  _plain(plan, monkeypatch)
  calls.clear()
  plan.execute()
  assert graph == _launched(calls) == runs[1]


def test_a_variable_read_from_memory_leaves_the_graph_as_built(fake_cuda) -> None:
  """n of at most 1024: the kernels read it from memory, so every run launches the same graph (same arguments, the bound's
  grid) after copying n's slots when n changed (kiln.runtime.cuda.device_vars)."""
  calls, drv, lib = fake_cuda
  n = UOp.variable("n", 1, 1024)
  b = ExecutionPlanBuilder("CUDA")
  x, y = b.add_buffer(Buffer("CUDA", 1024, dtypes.float32)), b.add_buffer(Buffer("CUDA", 1024, dtypes.float32))
  k = kernels.elementwise(lambda v: v * 2.0, dtypes.float32, ((n,), dtypes.float32), name="dbl")
  for i in range(5): b.add_kernel(k, [y, x] if i % 2 == 0 else [x, y])
  b.set_outputs([y])
  plan = b.build()
  runs, kinds = [], []
  for v in (100, 1000, 1000, 7):
    calls.clear()
    plan.execute_with_vars({"n": v})
    kinds.append(_kinds(calls, "launch", "graph_launch", "htod", "graph_set_params", "graph_instantiate"))
    runs.append(_launched(calls))
  assert runs[0] == runs[1] == runs[2] == runs[3]
  assert kinds[1:] == [["htod", "graph_launch"], ["graph_launch"], ["htod", "graph_launch"]], kinds  # n unchanged: no copy


def test_a_copy_in_the_middle_splits_the_run(fake_cuda) -> None:
  calls, drv, lib = fake_cuda
  plan = _chain(12, copy_after=6)
  calls.clear()
  plan.execute()
  assert _kinds(calls, "push", "launch", "graph_launch", "dtod", "pop") == ["push", "graph_launch", "dtod", "graph_launch", "pop"]
  assert [c[1] for c in calls if c[0] == "graph_launch"] == [6, 6]
  plan2 = _chain(12, copy_after=2)  # 2 launches, the copy, 10 launches: the short stretch launches one by one
  calls.clear()
  plan2.execute()
  assert _kinds(calls, "launch", "graph_launch", "dtod") == ["launch", "launch", "dtod", "graph_launch"]
  assert [c[1] for c in calls if c[0] == "graph_launch"] == [10]


def test_session_runs_offers_stretches_between_other_steps() -> None:
  log: list = []

  class Call:
    def __init__(self, name: str):
      self.name = name
    def session(self): raise AssertionError("not entered here")
    def __call__(self) -> None: log.append(("guarded", self.name))
    def in_session(self) -> None: log.append(("in", self.name))
    def graph_calls(self, calls):
      if len(calls) < 2: return None
      return lambda: log.append(("graph", [c.name for c in calls]))
  sess = Call.session
  calls = [Call(f"k{i}") for i in range(5)]
  for c in calls: c.session = sess  # type: ignore[method-assign]  # one runtime: equal sessions
  copy = lambda: log.append(("copy",))  # noqa: E731
  runs = session_runs([calls[0], calls[1], copy, calls[2], copy, calls[3], calls[4]])
  assert len(runs) == 1 and runs[0][0] is sess
  for s in runs[0][1]: s()
  assert log == [("graph", ["k0", "k1"]), ("copy",), ("in", "k2"), ("copy",), ("graph", ["k3", "k4"])]


def test_a_plans_graphs_are_destroyed_with_their_context_current(fake_cuda) -> None:
  calls, drv, lib = fake_cuda
  plan = _chain(8)
  plan.execute()
  assert lib.execs and lib.graphs
  calls.clear()
  del plan
  gc.collect()
  assert _kinds(calls, "push", "graph_exec_destroy", "graph_destroy", "pop")[:4] == ["push", "graph_exec_destroy", "graph_destroy", "pop"]
  assert not lib.execs and not lib.graphs and drv._problems() == []


def test_gpu_launch_tool_times_both_modes(fake_cuda, monkeypatch) -> None:
  """tools/gpu_launch.py runs over the stand-ins (its timings and output checks mean something only on a GPU: the stand-in
  moves no bytes): it reports graph_wall_us beside wall_us, and its graph plan made graph launches."""
  calls, drv, lib = fake_cuda
  monkeypatch.syspath_prepend(str(CUDA_TESTS.parent / "tools"))
  monkeypatch.setitem(sys.modules, "torch", None)  # no torch: the runtime's own synchronize
  import gpu_launch
  r = gpu_launch.launch_overhead(kernels_n=8, size=256, batch=1, rounds=1)
  assert {"wall_us", "host_us", "graph_wall_us", "graph_host_us", "output_ok", "graph_output_ok"} <= set(r)
  assert r["graph_launches"] > 0 and "KILN_CUDA_GRAPHS" not in __import__("os").environ
