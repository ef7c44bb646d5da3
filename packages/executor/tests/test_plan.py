import json

import numpy as np
import pytest

from kiln.executor import Buffer, ExecutionPlanBuilder, PreparedBufferView, PreparedCopy, PreparedCustomFunction, PreparedKernel
from kiln.ir.dtype import dtypes
from kiln.ir.errors import KilnBufferError, PlanError, PlanPoisoned, VariableBoundsError
from kiln.ir.uop import UOp

N = 16


def bufs(b, n, size=N, fill=None):
  out = []
  for i in range(n):
    buf = Buffer("CPU", size, dtypes.float32)
    if fill is not None: buf.copyin(np.full(size, fill + i, np.float32))
    out.append(b.add_buffer(buf))
  return out


def test_an_op_reading_no_ops_output_runs_just_before_its_reader(rt):
  """W reads only a weight: run in level 0 its output would live through A and B (a dequantised matrix waiting for its
  product); it runs in the level before C, its reader, and the results are the same."""
  b = ExecutionPlanBuilder("CPU")
  x0, x1, x2, x3, x4, x5 = bufs(b, 6, fill=1.0)
  A = b.add_kernel(rt.elementwise("A", 0, [1], N), [x0, x1])  # x0 = x1 + 1
  B = b.add_kernel(rt.elementwise("B", 0, [1], N), [x2, x0])  # x2 = x0 + 1
  W = b.add_kernel(rt.elementwise("W", 0, [1], N), [x3, x4])  # x3 = x4 + 1: a weight-only op
  C = b.add_kernel(rt.elementwise("C", 0, [1, 2], N), [x5, x2, x3])  # x5 = x2 + x3 + 1
  b.set_outputs([x5])
  plan = b.build()
  assert plan.op_levels == [[A], [B, W], [C]]
  plan.execute()
  np.testing.assert_array_equal(plan.buffers[x5].numpy(), np.full(N, (2 + 1 + 1) + (5 + 1) + 1, np.float32))  # bufs fill 1 + i


def test_op_levels_and_results(rt):
  b = ExecutionPlanBuilder("CPU")
  x0, x1, x2, x3, x4 = bufs(b, 5, fill=1.0)
  A = b.add_kernel(rt.elementwise("A", 0, [1], N), [x0, x1])  # x0 = x1 + 1
  B = b.add_kernel(rt.elementwise("B", 0, [1], N), [x2, x0])  # x2 = x0 + 1 (reads A's output)
  C = b.add_kernel(rt.elementwise("C", 0, [1], N), [x3, x4])  # independent
  b.set_outputs([x2, x3])
  plan = b.build()
  assert plan.op_levels == [[A, C], [B]]
  assert [k.name for k in plan.kernels] == ["A", "C", "B"]
  pk = plan.prepared_ops[B]
  assert isinstance(pk, PreparedKernel) and pk.dependencies == [A] and pk.buffer_indices == [x2, x0] and pk.output_indices == [0]
  assert pk.buffer_ptrs == [plan.buffers[x2].ptr, plan.buffers[x0].ptr] and pk.vals == [] and pk.origin == "compiled"
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 4.0))  # x1=2 -> x0=3 -> x2=4
  np.testing.assert_array_equal(plan.output_buffer(1).numpy(), np.full(N, 6.0))  # x4=5 -> x3=6
  assert "A" in plan.describe() and "L1" in plan.describe()


def test_war_and_waw_hazards(rt):
  b = ExecutionPlanBuilder("CPU")
  x0, x1, x2 = bufs(b, 3, fill=0.0)
  r = b.add_kernel(rt.elementwise("reader", 0, [1], N), [x0, x1])  # reads x1
  w = b.add_kernel(rt.elementwise("writer", 0, [], N), [x1])  # writes x1: WAR on reader
  w2 = b.add_kernel(rt.elementwise("writer2", 0, [1], N, add=2.0), [x1, x2])  # writes x1 again: WAW
  b.set_outputs([x0, x1])
  plan = b.build()
  assert plan.op_levels == [[r], [w], [w2]]


def test_view_hazards_by_byte_range(rt):
  b = ExecutionPlanBuilder("CPU")
  base = b.add_buffer(Buffer("CPU", 2 * N, dtypes.float32))
  lo, hi, lo2 = (b.add_buffer(Buffer("CPU", N, dtypes.float32)) for _ in range(3))
  src = bufs(b, 1, fill=1.0)[0]
  v1 = b.add_view(lo, base, 0, N * 4)
  b.add_view(hi, base, N * 4, N * 4)
  b.add_view(lo2, base, 8, N * 4)  # overlaps both halves
  ka = b.add_kernel(rt.elementwise("wlo", 0, [1], N), [lo, src])
  kb = b.add_kernel(rt.elementwise("whi", 0, [1], N), [hi, src])
  kc = b.add_kernel(rt.elementwise("rlo2", 0, [1], N), [bufs(b, 1)[0], lo2])
  b.set_outputs([base])
  plan = b.build()
  assert plan.op_levels == [[ka, kb], [kc]]  # the halves do not overlap; the middle view reads both
  assert isinstance(plan.prepared_ops[v1], PreparedBufferView)
  assert plan.buffers[lo].storage_id == plan.buffers[base].storage_id == plan.buffers[hi].storage_id
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(2 * N, 2.0))


def test_unknown_dependency_and_cycle(rt):
  b = ExecutionPlanBuilder("CPU")
  x0, x1 = bufs(b, 2)
  b.add_kernel(rt.elementwise("A", 0, [], N), [x0], deps=[7])
  b.set_outputs([x0])
  with pytest.raises(PlanError, match="kernel 0 'A' depends on unknown op 7"): b.build()
  b = ExecutionPlanBuilder("CPU")
  x0, x1 = bufs(b, 2)
  a = b.add_kernel(rt.elementwise("A", 0, [], N), [x0], deps=[1])
  c = b.add_kernel(rt.elementwise("C", 0, [], N), [x1], deps=[a])
  b.set_outputs([x0, x1])
  with pytest.raises(PlanError, match="dependency cycle") as e: b.build()
  assert "kernel 0 'A'" in str(e.value) and "kernel 1 'C'" in str(e.value) and c == 1


def test_build_errors(rt):
  def base():
    b = ExecutionPlanBuilder("CPU")
    return b, bufs(b, 2)
  b, (x0, x1) = base()
  b.add_kernel(rt.elementwise("A", 0, [], N), [x0])
  with pytest.raises(PlanError, match="no outputs"): b.build()
  b, (x0, x1) = base()
  b.add_kernel(rt.elementwise("A", 0, [1], N), [x0, 9])
  b.set_outputs([x0])
  with pytest.raises(PlanError, match="out of range"): b.build()
  b, (x0, x1) = base()
  b.set_outputs([5])
  with pytest.raises(PlanError, match="out of range"): b.build()
  b, (x0, x1) = base()
  b.add_kernel(rt.elementwise("A", 0, [1], N), [x0])
  b.set_outputs([x0])
  with pytest.raises(PlanError, match="takes 2 buffers"): b.build()
  b, (x0, x1) = base()
  g = UOp.define_global(0, dtypes.float32.ptr(N))
  b.add_kernel(UOp.sink(g.index(0).load(), name="noout"), [x0])
  b.set_outputs([x0])
  with pytest.raises(PlanError, match="'noout' has no outputs"): b.build()
  b, (x0, x1) = base()
  i32 = b.add_buffer(Buffer("CPU", N, dtypes.int32))
  b.add_kernel(rt.elementwise("A", 0, [1], N), [x0, i32])
  b.set_outputs([x0])
  with pytest.raises(PlanError, match="slot 1 wants float32, buffer 2 is int32"): b.build()
  b, (x0, x1) = base()
  small = b.add_buffer(Buffer("CPU", N - 1, dtypes.float32))
  b.add_kernel(rt.elementwise("A", 0, [1], N), [x0, small])
  b.set_outputs([x0])
  with pytest.raises(PlanError, match="has only 15"): b.build()


def test_copy_size_mismatch_and_copies(rt):
  b = ExecutionPlanBuilder("CPU")
  x0 = bufs(b, 1, fill=3.0)[0]
  small = b.add_buffer(Buffer("CPU", N - 1, dtypes.float32))
  with pytest.raises(KilnBufferError, match="different sizes"): b.add_copy(small, x0)
  b = ExecutionPlanBuilder("CPU")
  x0, x1, x2 = bufs(b, 3, fill=3.0)
  c = b.add_copy(x1, x0)
  k = b.add_kernel(rt.elementwise("after_copy", 0, [1], N), [x2, x1])
  b.set_outputs([x2])
  plan = b.build()
  assert plan.op_levels == [[c], [k]] and isinstance(plan.prepared_ops[c], PreparedCopy)
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 4.0))


def test_custom_function(rt):
  b = ExecutionPlanBuilder("CPU")
  x0, x1 = bufs(b, 2, fill=1.0)
  seen = []

  def double(buf):
    seen.append(buf.numpy().copy())
    buf.numpy()[:] *= 2
  k = b.add_kernel(rt.elementwise("K", 0, [1], N), [x0, x1])
  c = b.add_custom(double, [x0])
  b.set_outputs([x0])
  plan = b.build()
  assert plan.op_levels == [[k], [c]] and isinstance(plan.prepared_ops[c], PreparedCustomFunction)
  plan.execute()
  np.testing.assert_array_equal(seen[0], np.full(N, 3.0))
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 6.0))


def _var_plan(rt, fixed=None, lo=1, hi=N):
  n = UOp.variable("n", lo, hi)
  b = ExecutionPlanBuilder("CPU")
  x0, x1 = bufs(b, 2, fill=1.0)
  b.add_kernel(rt.elementwise("vk", 0, [1], n), [x0, x1], fixedvars=fixed)
  b.set_outputs([x0])
  return b.build()


def test_execute_with_vars_bounds(rt):
  plan = _var_plan(rt)
  with pytest.raises(VariableBoundsError, match="unbound"): plan.execute()
  plan.execute_with_vars({"n": 5})
  assert rt.EVENTS[-1][3:] == ((5,), (5, 1, 1))
  runs = len(rt.EVENTS)
  for bad in (0, 17, -3):
    with pytest.raises(VariableBoundsError) as e: plan.execute_with_vars({"n": bad})
    assert str(e.value) == f"variable n={bad} is outside bounds [1, {N}]"
  assert len(rt.EVENTS) == runs and plan.kernels[0].vals == [5] and not plan.poisoned  # nothing ran, nothing changed
  plan.execute()
  assert rt.EVENTS[-1][3:] == ((5,), (5, 1, 1))
  plan.execute_with_vars({"n": 7, "unused": 99, "core_id": 3})  # unknown names and core_id are ignored
  assert rt.EVENTS[-1][3:] == ((7,), (7, 1, 1))
  with pytest.raises(VariableBoundsError, match="must be an int"): plan.execute_with_vars({"n": 2.5})


def test_bounds_checked_before_anything(rt):
  n, m = UOp.variable("n", 1, N), UOp.variable("m", 1, 8)
  b = ExecutionPlanBuilder("CPU")
  x0, x1, x2 = bufs(b, 3, fill=1.0)
  b.add_kernel(rt.elementwise("kn", 0, [1], n), [x0, x1])
  b.add_kernel(rt.elementwise("km", 0, [1], m, size=N), [x2, x1])
  b.set_outputs([x0, x2])
  plan = b.build()
  plan.execute_with_vars({"n": 3, "m": 2})
  runs = len(rt.EVENTS)
  with pytest.raises(VariableBoundsError, match=r"variable m=9 is outside bounds \[1, 8\]"): plan.execute_with_vars({"n": 4, "m": 9})
  assert len(rt.EVENTS) == runs and [k.vals for k in plan.kernels] == [[3], [2]]


def test_fixedvars_kept(rt):
  plan = _var_plan(rt, fixed={"n": 4})
  plan.execute()  # fixed: nothing left unbound
  plan.execute_with_vars({"n": 9})
  assert plan.kernels[0].vals == [4] and plan.kernels[0].fixedvars == {"n": 4}
  assert all(ev[3] == (4,) and ev[4][0] == 4 for ev in rt.EVENTS)
  with pytest.raises(VariableBoundsError, match="fixed variable n=99"): _var_plan(rt, fixed={"n": 99})


def test_symbolic_size_several_n_one_compile(rt):
  plan = _var_plan(rt)
  x1 = plan.buffers[1].numpy()
  for n in (1, 5, 16, 3):
    plan.buffers[0].copyin(np.zeros(N, np.float32))
    plan.execute_with_vars({"n": n})
    out = plan.output_buffer(0).numpy()
    np.testing.assert_array_equal(out[:n], x1[:n] + 1)
    assert not out[n:].any()
  assert rt.STATS["compiles"] == 1


def test_overlap_and_conflicts(rt):
  b = ExecutionPlanBuilder("CPU", parallel=True)
  x0, x1, x2, x3, x4 = bufs(b, 5, fill=1.0)
  for name in ("P", "Q", "R"): rt.BEHAVIOR[name] = {"sleep": 0.15}
  b.add_kernel(rt.elementwise("P", 0, [1], N), [x0, x1])
  b.add_kernel(rt.elementwise("Q", 0, [1], N), [x2, x1])  # independent of P (both only read x1)
  b.add_kernel(rt.elementwise("R", 0, [1], N), [x3, x0])  # reads what P writes
  b.set_outputs([x2, x3])
  plan = b.build()
  plan.execute()
  ev = {e[0]: e for e in rt.EVENTS}
  assert ev["P"][1] < ev["Q"][2] and ev["Q"][1] < ev["P"][2], "independent kernels should overlap"
  assert ev["R"][1] >= ev["P"][2], "a reader of a written buffer must start after the writer ends"
  np.testing.assert_array_equal(plan.output_buffer(1).numpy(), np.full(N, 4.0))


@pytest.mark.parametrize("threads", [1, 2])
def test_overlap_only_when_more_than_one_thread_is_asked_for(rt, monkeypatch, threads):
  """By default (parallel=None) independent kernels overlap on the plan's pool only when kiln may use more than one
  thread: KILN_THREADS=1 means one thread, the pool's second worker included."""
  from kiln.executor import builder
  monkeypatch.setattr(builder, "PARALLEL_MIN_COST", 0)
  monkeypatch.setattr(builder, "thread_count", lambda: threads)
  assert _two_independent_kernels_in_turn(rt, ExecutionPlanBuilder("CPU"), 0.1) == (threads == 1)


@pytest.mark.parametrize("parallel", [None, True])
def test_kernels_sized_by_a_run_time_variable_overlap_only_when_asked(rt, monkeypatch, parallel):
  """A kernel's cost estimate is at its variables' upper bounds, which a run may be far below: parallel=None never hands
  such kernels to the overlap pool (however large the bound makes them look); parallel=True still overlaps them."""
  from kiln.executor import builder
  monkeypatch.setattr(builder, "thread_count", lambda: 2)
  n = UOp.variable("n", 1, N)
  b = ExecutionPlanBuilder("CPU", parallel=parallel)
  x0, x1, x2 = bufs(b, 3, fill=1.0)
  for name in ("P", "Q"): rt.BEHAVIOR[name] = {"sleep": 0.1}
  b.add_kernel(rt.elementwise("P", 0, [1], n), [x0, x1])
  b.add_kernel(rt.elementwise("Q", 0, [1], n), [x2, x1])
  b.set_outputs([x0, x2])
  monkeypatch.setattr(builder, "PARALLEL_MIN_COST", 0)  # a threshold every kernel passes
  plan = b.build()
  plan.execute_with_vars({"n": 4})
  (_, s1, e1, *_), (_, s2, e2, *_) = rt.EVENTS[-2:]
  assert (e1 <= s2 or e2 <= s1) == (parallel is None)


def _two_independent_kernels_in_turn(rt, b: ExecutionPlanBuilder, sleep: float) -> bool:
  """Builds and runs two kernels that only share an input (each sleeping `sleep` s); whether one ran after the other."""
  x0, x1, x2 = bufs(b, 3, fill=1.0)
  for name in ("P", "Q"): rt.BEHAVIOR[name] = {"sleep": sleep}
  b.add_kernel(rt.elementwise("P", 0, [1], N), [x0, x1])
  b.add_kernel(rt.elementwise("Q", 0, [1], N), [x2, x1])
  b.set_outputs([x0, x2])
  b.build().execute()
  (_, s1, e1, *_), (_, s2, e2, *_) = rt.EVENTS
  return e1 <= s2 or e2 <= s1


def test_no_overlap_when_serial(rt):
  assert _two_independent_kernels_in_turn(rt, ExecutionPlanBuilder("CPU", parallel=False), 0.05)


def test_poisoned_plan(rt):
  b = ExecutionPlanBuilder("CPU")
  x0, x1 = bufs(b, 2)
  b.add_kernel(rt.elementwise("boom", 0, [1], N), [x0, x1])
  b.set_outputs([x0])
  plan = b.build()
  plan.execute()
  rt.BEHAVIOR["boom"] = {"fail": True}
  with pytest.raises(RuntimeError, match="injected launch failure"): plan.execute()
  rt.BEHAVIOR["boom"] = {}
  assert plan.poisoned
  for call in (plan.execute, lambda: plan.execute_with_vars({}), plan.execute_profiled):
    with pytest.raises(PlanPoisoned, match="rebuild"): call()
  b.build().execute()  # rebuilding gives a working plan


def test_profile_one_record_per_kernel(rt, tmp_path):
  b = ExecutionPlanBuilder("CPU")
  x0, x1, x2, x3 = bufs(b, 4, fill=1.0)
  b.add_kernel(rt.elementwise("A", 0, [1], N), [x0, x1])
  b.add_copy(x2, x0)
  b.add_kernel(rt.elementwise("B", 0, [1], N), [x3, x2])
  b.set_outputs([x3])
  plan = b.build()
  prof = plan.execute_profiled(trace_path=tmp_path / "trace.json")
  assert [r.name for r in prof] == ["A", "B"] and all(r.time > 0 and r.device == "CPU" for r in prof)
  assert prof[0].bytes == 1 << 14 and prof[0].flops == 1 << 12 and prof[0].gbs > 0 and prof[0].gflops > 0
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert [e["name"] for e in trace["traceEvents"]] == ["A", "B"] and all(e["ph"] == "X" for e in trace["traceEvents"])
  assert "A" in prof.table()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 4.0))


def test_debug_level1_lines(rt, capsys):
  from kiln.executor import debug
  b = ExecutionPlanBuilder("CPU")
  x0, x1 = bufs(b, 2)
  b.add_kernel(rt.elementwise("dbgk", 0, [1], N), [x0, x1])
  b.set_outputs([x0])
  plan = b.build()
  debug.set_level(1)
  plan.execute()
  err = capsys.readouterr().err
  assert "dbgk" in err and ("GB/s" in err or "GFLOP/s" in err)


def test_memory_reuse(rt):
  b = ExecutionPlanBuilder("CPU")
  inp = bufs(b, 1, fill=1.0)[0]
  chain = [b.add_buffer(Buffer("CPU", N, dtypes.float32)) for _ in range(5)]
  prev = inp
  for i, c in enumerate(chain):
    b.add_kernel(rt.elementwise(f"chain{i}", 0, [1], N), [c, prev])
    prev = c
  b.set_outputs([chain[-1]])
  plan = b.build()
  assert plan.memory_bytes < plan.memory_bytes_without_reuse
  sids = [plan.buffers[c].storage_id for c in chain]
  assert sids[0] == sids[2] and sids[1] == sids[3] and len(set(sids)) == 3  # intermediates ping-pong; the output keeps its own
  plan.execute()
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 6.0))
  b2 = ExecutionPlanBuilder("CPU", reuse_memory=False)
  x = bufs(b2, 3, fill=1.0)
  b2.add_kernel(rt.elementwise("chain0", 0, [1], N), [x[1], x[0]])
  b2.add_kernel(rt.elementwise("chain1", 0, [1], N), [x[2], x[1]])
  b2.set_outputs([x[2]])
  p2 = b2.build()
  assert p2.memory_bytes == p2.memory_bytes_without_reuse == 3 * N * 4


def test_memory_reuse_through_views(rt):
  """Intermediates read and written through views of part of them (kiln.graph's read windows) still share memory: every
  buffer on a storage moves with it, at its offset, and the storage lives while any of them is used."""
  b = ExecutionPlanBuilder("CPU")
  inp = bufs(b, 1, size=2 * N, fill=1.0)[0]
  chain = [b.add_buffer(Buffer("CPU", 2 * N, dtypes.float32)) for _ in range(5)]
  def upper(base: int) -> int:
    v = b.add_buffer(Buffer("CPU", N, dtypes.float32))
    b.add_view(v, base, N * 4, N * 4)
    return v
  prev = upper(inp)
  for i, c in enumerate(chain):
    up = upper(c)
    b.add_kernel(rt.elementwise(f"vchain{i}", 0, [1], N), [up, prev])
    prev = up
  b.set_outputs([prev])
  plan = b.build()
  sids = [plan.buffers[c].storage_id for c in chain]
  assert sids[0] == sids[2] and sids[1] == sids[3] and len(set(sids)) == 3, sids  # as without views
  assert plan.memory_bytes < plan.memory_bytes_without_reuse
  for _ in range(2):
    plan.execute()
    np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(N, 6.0))


def test_dispatch_overhead_is_small(rt):
  # the real target (<= 2 us per kernel) is measured by scripts/bench against the CPU runtime; this guards the loop itself
  import time
  b = ExecutionPlanBuilder("CPU")
  xs = bufs(b, 101, size=4)
  for i in range(100): b.add_kernel(rt.elementwise("tiny", 0, [1], 4, size=4), [xs[i + 1], xs[i]])
  b.set_outputs([xs[-1]])
  plan = b.build()
  assert len(plan.op_levels) == 100 and rt.STATS["compiles"] == 1
  calls = []
  plan._steps = [lambda: calls.append(1)] * 100  # a no-op program isolates the executor's own cost
  t0 = time.perf_counter()
  for _ in range(100): plan.execute()
  per_kernel = (time.perf_counter() - t0) / 100 / 100
  assert len(calls) == 10000 and per_kernel < 2e-6, per_kernel


def test_a_plan_counts_as_running_only_inside_execute():
  """The CPU pool's workers spin between kernels while a plan runs (and just after): execute() and execute_profiled() raise
  the count of running plans (kiln.runtime.cpu.running, through PlanRunning) for their run and lower it again when the run
  ends, failed or not, noting when it ended."""
  import ctypes

  from kiln.runtime.cpu.running import plans_running_address
  from kiln.runtime.cpu.spin import ENDED_OFFSET
  running = ctypes.c_int32.from_address(plans_running_address())
  ended = ctypes.c_int64.from_address(plans_running_address() + ENDED_OFFSET)
  n = 1 << 22  # split into chunks (a plan of whole kernels never tells the pool)
  from kiln.ir import kernels
  ast = kernels.elementwise(lambda a: a + 1.0, dtypes.float32, ((n,), dtypes.float32))
  seen: list[int] = []
  for profiled in (False, True):  # a profiled run too: its times are the plan's, workers awake
    for fn in (lambda y: seen.append(running.value), lambda y: 1 / 0):
      b = ExecutionPlanBuilder()
      x, y = b.add_buffer(Buffer("CPU", n, dtypes.float32).copyin(np.ones(n, np.float32))), b.add_buffer(Buffer("CPU", n, dtypes.float32))
      b.add_kernel(ast, [y, x])
      b.add_custom(fn, [y], outputs=[])
      b.set_outputs([y])
      plan = b.build()
      assert running.value == 0 and plan.kernels[0].kernel.threads > 1
      before = ended.value
      try: plan.execute_profiled() if profiled else plan.execute()
      except ZeroDivisionError: pass
      assert running.value == 0 and ended.value > before  # the workers spin on from this end, then sleep
  assert seen == [1, 1]
