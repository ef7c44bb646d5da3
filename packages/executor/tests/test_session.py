"""Sessions (kiln issue 16, launch overhead): ExecutionPlan enters a runtime's session once around a run of its launches and
calls them through in_session, instead of each launch making its device's context current (for CUDA: a context check, push
and pop per kernel). The CUDA plan runs over the recording stand-in for pycuda.driver from kiln-runtime-cuda's tests."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from kiln_executor_testrt import cuda_test_module

from kiln.codegen import registry
from kiln.executor import Buffer, ExecutionPlanBuilder, cache
from kiln.executor.execution import session_runs
from kiln.ir.dtype import dtypes


class _Call:
  """A bound call with a session: records what runs, and whether its session was open."""
  def __init__(self, log: list, name: str, sess):
    self.log, self.name, self.session = log, name, sess
  def __call__(self) -> None: self.log.append(("guarded", self.name))
  def in_session(self) -> None: self.log.append(("in", self.name))


def _session(log: list, name: str):
  @contextmanager
  def session() -> Iterator[None]:
    log.append(("enter", name))
    try: yield
    finally: log.append(("exit", name))
  return session


def test_session_runs_groups_by_runtime_and_keeps_user_code_outside() -> None:
  log: list = []
  sa, sb = _session(log, "A"), _session(log, "B")
  copy, user = (lambda: log.append(("copy",))), (lambda: log.append(("user",)))
  steps = [copy, _Call(log, "a1", sa), copy, _Call(log, "a2", sa), _Call(log, "b1", sb), user, _Call(log, "b2", sb)]
  runs = session_runs(steps, frozenset({id(user)}))
  assert [r[0] for r in runs] == [sa, sb, None, sb]  # the leading copy joins A's run; a user function breaks B's
  for sess, run in runs:
    if sess is None:
      for s in run: s()
    else:
      with sess():
        for s in run: s()
  assert log == [("enter", "A"), ("copy",), ("in", "a1"), ("copy",), ("in", "a2"), ("exit", "A"), ("enter", "B"), ("in", "b1"),
                 ("exit", "B"), ("user",), ("enter", "B"), ("in", "b2"), ("exit", "B")]
  plain = [copy, user]  # no sessions at all (a CPU plan): one sessionless run, the steps themselves
  assert session_runs(plain, frozenset({id(user)})) == [(None, plain)]


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
  mod = cuda_test_module("test_driver.py")
  calls: list = []
  drv = mod.make_fake_driver(calls, cc=(9, 0))
  mod.install_standin(monkeypatch, tmp_path, drv)
  cache.clear_memory_cache()
  yield calls, drv
  registry.unregister_runtime("CUDA")
  cache.clear_memory_cache()
  assert drv._problems() == []  # pycuda's context rules held: no context left pushed, no frees refused


def _kinds(calls: list, *kinds: str) -> list[str]: return [c[0] for c in calls if c[0] in kinds]


def test_a_cuda_plan_pushes_its_context_once_per_run(fake_cuda) -> None:
  from kiln.ir import kernels
  calls, drv = fake_cuda
  n_kernels, seen = 12, []
  b = ExecutionPlanBuilder("CUDA")
  bufs = [b.add_buffer(Buffer("CUDA", 256, dtypes.float32)) for _ in range(2)]
  inc = kernels.elementwise(lambda v: v + 1.0, dtypes.float32, ((256,), dtypes.float32), name="inc")
  for i in range(n_kernels): b.add_kernel(inc, [bufs[(i + 1) % 2], bufs[i % 2]])
  b.set_outputs([bufs[0]])
  plan = b.build()
  b.buffers[bufs[0]].copyin(np.zeros(256, np.float32))
  calls.clear()
  plan.execute()
  assert _kinds(calls, "push", "launch", "pop") == ["push"] + ["launch"] * n_kernels + ["pop"]  # not a push and pop per launch
  assert drv.Context.get_current() is None
  rt = registry.get_runtime("CUDA")
  calls.clear()
  with rt.current(): plan.execute()  # already current: the run pushes nothing
  assert _kinds(calls, "push", "launch", "pop") == ["push"] + ["launch"] * n_kernels + ["pop"]  # the outer with's own
  calls.clear()
  t = threading.Thread(target=plan.execute, name="worker")  # from another thread: that thread's stack, left empty
  t.start()
  t.join()
  assert _kinds(calls, "push", "launch", "pop") == ["push"] + ["launch"] * n_kernels + ["pop"]
  # a user function between kernels runs outside the session, with no context of ours current
  b2 = ExecutionPlanBuilder("CUDA")
  x, y = b2.add_buffer(Buffer("CUDA", 256, dtypes.float32)), b2.add_buffer(Buffer("CUDA", 256, dtypes.float32))
  k1 = b2.add_kernel(inc, [y, x])
  f = b2.add_custom(lambda *a: seen.append(drv.Context.get_current()), [y], [], deps=[k1])
  b2.add_kernel(inc, [x, y], deps=[f])
  b2.set_outputs([x])
  plan2 = b2.build()
  calls.clear()
  plan2.execute()
  kinds = _kinds(calls, "push", "launch", "pop")
  i, j = (k for k, c in enumerate(kinds) if c == "launch")
  assert seen == [None] and kinds[0] == "push" and "pop" in kinds[i:j] and kinds.count("push") == kinds.count("pop")
