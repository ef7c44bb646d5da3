"""Soak: 10,000 executions of a plan with resident memory that stays flat, and buffers released when plans are dropped."""
import gc
import os
import uuid
import weakref

import numpy as np

from kiln.executor.buffer import Buffer
from kiln.executor.plan import ExecutionPlanBuilder
from kiln.ir import AxisType, Ops, UOp, dtypes

N = 256
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
  with open("/proc/self/statm") as f: return int(f.read().split()[1]) * PAGE


def build(tag: str, symbolic: bool = False):
  """Three ops: y = relu(x * w); s = sum(y) (a reduction); a host copy of y; symbolic: the first kernel runs n elements."""
  x, w, y, s = (UOp.define_global(0, dtypes.float32.ptr(N)), UOp.define_global(1, dtypes.float32.ptr(N)),
                UOp.define_global(2, dtypes.float32.ptr(N)), UOp.define_global(0, dtypes.float32.ptr(1)))
  n = UOp.variable("n", 1, N) if symbolic else N
  i = UOp.range(n, 0)
  k1 = UOp.sink(y.index(i).store((x.index(i).load() * w.index(i).load()).maximum(0.0)), name=f"soak1_{tag}")
  j = UOp.range(N, 0, AxisType.REDUCE)
  k2 = UOp.sink(s.index(0).store(UOp.define_global(1, dtypes.float32.ptr(N)).index(j).load().reduce(Ops.ADD, j)), name=f"soak2_{tag}")
  b = ExecutionPlanBuilder("CPU")
  xb = b.add_buffer(Buffer.from_numpy(np.linspace(-1, 1, N, dtype=np.float32)))
  wb = b.add_buffer(Buffer.from_numpy(np.full(N, 2, np.float32)))
  yb, sb, cb = b.add_buffer(Buffer("CPU", N, "float32")), b.add_buffer(Buffer("CPU", 1, "float32")), b.add_buffer(Buffer("CPU", N, "float32"))
  b.add_kernel(k1, [xb, wb, yb])
  b.add_kernel(k2, [sb, yb])
  b.add_copy(cb, yb)
  b.set_outputs([sb, cb])
  return b.build()


def test_ten_thousand_executions_keep_memory_flat():
  plan = build(uuid.uuid4().hex[:8])
  symb = build(uuid.uuid4().hex[:8], symbolic=True)
  for _ in range(500): plan.execute(); symb.execute_with_vars({"n": 7})  # warm up: pools, caches, allocator
  gc.collect()
  base = rss()
  for r in range(10_000):
    plan.execute()
    if r % 10 == 0: symb.execute_with_vars({"n": 1 + r % N})
  gc.collect()
  grown = rss() - base
  want = np.float32(0)
  for v in np.maximum(np.linspace(-1, 1, N, dtype=np.float32) * 2, 0): want = np.float32(want + v)
  np.testing.assert_allclose(plan.output_buffer(0).numpy()[0], want, rtol=1e-5)  # the heuristic may vectorise the sum (another order)
  np.testing.assert_array_equal(plan.output_buffer(1).numpy(), np.maximum(np.linspace(-1, 1, N, dtype=np.float32) * 2, 0))
  assert grown < 4 << 20, f"RSS grew by {grown / 1e6:.1f} MB over 10,000 executions"


def test_buffers_are_released_when_a_plan_is_dropped():
  tag = uuid.uuid4().hex[:8]
  base = None
  for round_ in range(6):
    plan = build(tag)
    plan.execute()
    refs = [weakref.ref(b.storage) for b in plan.buffers] + [weakref.ref(b) for b in plan.buffers] + [weakref.ref(plan)]
    del plan
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"still alive after the plan was dropped: {alive[:4]}"
    if round_ == 1: base = rss()
  assert base is not None and rss() - base < 4 << 20
