"""Integration tests against the real CPU runtime (LLVM through llvmlite). Skipped when it is not installed."""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from kiln_executor_testrt import requires_cpu_runtime

from kiln.executor import Buffer, ExecutionPlanBuilder, cache, compile_kernel, compile_kernel_with_origin
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import VariableBoundsError
from kiln.ir.uop import UOp

pytestmark = requires_cpu_runtime()


def add1(n):
  return kernels.elementwise(lambda x: x + 1.0, dtypes.float32, ((n,), dtypes.float32), name="add1")


def scale_n(maxn):
  n = UOp.variable("n", 1, maxn)
  out, a = UOp.define_global(0, dtypes.float32.ptr(maxn)), UOp.define_global(1, dtypes.float32.ptr(maxn))
  i = UOp.range(n, 0)
  return UOp.sink(out.index(i).store(a.index(i).load() * 2.0), name="scale_n")


def test_matmul_plan_from_disk(cpu, tmp_path):
  M, N, K = 48, 40, 56
  A, B = np.random.rand(M, K).astype(np.float32), np.random.rand(K, N).astype(np.float32)
  np.save(tmp_path / "a.npy", A)
  b = ExecutionPlanBuilder("CPU")
  da = b.add_buffer(Buffer.from_npy(tmp_path / "a.npy"))
  ca, cb = b.add_buffer(Buffer("CPU", M * K, dtypes.float32)), b.add_buffer(Buffer.from_numpy(B))
  cc = b.add_buffer(Buffer("CPU", M * N, dtypes.float32))
  cp = b.add_copy(ca, da)
  mm = b.add_kernel(kernels.matmul(M, N, K), [cc, ca, cb])
  b.set_outputs([cc])
  plan = b.build()
  assert plan.op_levels == [[cp], [mm]]
  for _ in range(3): plan.execute()
  np.testing.assert_allclose(plan.output_buffer(0).numpy().reshape(M, N), A @ B, rtol=1e-5, atol=1e-5)
  prof = plan.execute_profiled()
  assert len(prof) == 1 and prof[0].name == "matmul" and prof[0].flops > 0 and prof[0].time > 0


def test_symbolic_n_one_compile(cpu):
  before = cache.cache_stats()["compiles"]
  b = ExecutionPlanBuilder("CPU")
  a = np.arange(64, dtype=np.float32)
  x0, x1 = b.add_buffer(Buffer("CPU", 64, dtypes.float32)), b.add_buffer(Buffer.from_numpy(a))
  b.add_kernel(scale_n(64), [x0, x1])
  b.set_outputs([x0])
  plan = b.build()
  for n in (1, 7, 64, 33):
    plan.buffers[x0].copyin(np.zeros(64, np.float32))
    plan.execute_with_vars({"n": n})
    out = plan.output_buffer(0).numpy()
    np.testing.assert_array_equal(out[:n], a[:n] * 2)
    assert not out[n:].any()
  with pytest.raises(VariableBoundsError) as e: plan.execute_with_vars({"n": 65})
  assert str(e.value) == "variable n=65 is outside bounds [1, 64]"
  assert cache.cache_stats()["compiles"] - before == 1


def test_fixedvars_real(cpu):
  b = ExecutionPlanBuilder("CPU")
  a = np.arange(64, dtype=np.float32)
  x0, x1 = b.add_buffer(Buffer("CPU", 64, dtypes.float32)), b.add_buffer(Buffer.from_numpy(a))
  b.add_kernel(scale_n(64), [x0, x1], fixedvars={"n": 10})
  b.set_outputs([x0])
  plan = b.build()
  plan.execute_with_vars({"n": 50})
  out = plan.output_buffer(0).numpy()
  np.testing.assert_array_equal(out[:10], a[:10] * 2)
  assert not out[10:].any()


def test_16_threads_one_compile_real(cpu):
  ast = add1(1000)
  before = cache.cache_stats()["compiles"]
  barrier, out = threading.Barrier(16), []

  def work():
    barrier.wait()
    out.append(compile_kernel(ast, "CPU"))
  ts = [threading.Thread(target=work) for _ in range(16)]
  for t in ts: t.start()
  for t in ts: t.join()
  assert len(out) == 16 and all(k is out[0] for k in out) and cache.cache_stats()["compiles"] - before == 1


def test_disk_cache_new_process_real(tmp_path):
  code = ("import json; from kiln.ir import kernels; from kiln.ir.dtype import dtypes; from kiln.executor import compile_kernel_with_origin\n"
          "k, o = compile_kernel_with_origin(kernels.elementwise(lambda x: x * 3.0, dtypes.float32, ((777,), dtypes.float32), name='x3'))\n"
          "print(json.dumps(o))")
  env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "c"), "KILN_CACHE": "1"}

  def run():
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
  assert run() == "compiled" and run() == "disk"
  (f,) = (tmp_path / "c" / "kernels").glob("*.json")
  f.write_text(f.read_text()[:-100])
  assert run() == "compiled" and run() == "disk"


def test_memory_reuse_chain_real(cpu):
  n = 4096
  b = ExecutionPlanBuilder("CPU")
  x = b.add_buffer(Buffer.from_numpy(np.ones(n, np.float32)))
  chain = [b.add_buffer(Buffer("CPU", n, dtypes.float32)) for _ in range(6)]
  prev = x
  for c in chain:
    b.add_kernel(add1(n), [c, prev])
    prev = c
  b.set_outputs([chain[-1]])
  plan = b.build()
  assert plan.memory_bytes < plan.memory_bytes_without_reuse
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(n, 7.0))


def test_dispatch_overhead_real(cpu):
  """Sanity bound only: the issue-7 targets (<= 2 us per kernel, <= 5 us per one-kernel execute) live in scripts/bench."""
  b = ExecutionPlanBuilder("CPU")
  xs = [b.add_buffer(Buffer("CPU", 16, dtypes.float32)) for _ in range(101)]
  for i in range(100): b.add_kernel(add1(16), [xs[i + 1], xs[i]])
  b.set_outputs([xs[-1]])
  plan = b.build()
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.full(16, 100.0))
  t0 = time.perf_counter()
  for _ in range(50): plan.execute()
  per_kernel = (time.perf_counter() - t0) / 50 / 100
  assert per_kernel < 20e-6, per_kernel


def test_origin_memory_then_disk(cpu):
  ast = add1(123)
  assert compile_kernel_with_origin(ast)[1] == "compiled"
  assert compile_kernel_with_origin(ast)[1] == "memory"
  cache.clear_memory_cache()
  assert compile_kernel_with_origin(ast)[1] == "disk"


def test_add_kernel_takes_the_callers_options(cpu):
  """opts= replaces the heuristic for that kernel: the compiled kernel applies exactly them, the same AST with other options
  is another cache entry, results stay right, and options that do not fit the kernel are an error naming the op."""
  from kiln.codegen.choose import Opt, OptOps
  from kiln.ir.errors import CodegenError, PlanError
  M, N, K = 32, 64, 48
  A, B = np.random.rand(M, K).astype(np.float32), np.random.rand(K, N).astype(np.float32)
  mine = [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UNROLL, 0, 2)]
  plans = {}
  for label, opts in (("heuristic", None), ("none", []), ("mine", mine)):
    b = ExecutionPlanBuilder("CPU")
    ca, cb, cc = b.add_buffer(Buffer.from_numpy(A)), b.add_buffer(Buffer.from_numpy(B)), b.add_buffer(Buffer("CPU", M * N, dtypes.float32))
    b.add_kernel(kernels.matmul(M, N, K), [cc, ca, cb], opts=opts)
    b.set_outputs([cc])
    plans[label] = plan = b.build()
    plan.execute()
    np.testing.assert_allclose(plan.output_buffer(0).numpy().reshape(M, N), A @ B, rtol=1e-5, atol=1e-5)
  applied = {k: p.prepared_ops[0].kernel.applied_opts for k, p in plans.items()}
  assert applied["none"] == [] and applied["mine"] == [str(o) for o in mine] and applied["heuristic"] != applied["mine"], applied
  assert len({id(p.prepared_ops[0].kernel) for p in plans.values()}) == 3, "each option set is its own cached kernel"
  b = ExecutionPlanBuilder("CPU")
  ca, cb, cc = b.add_buffer(Buffer.from_numpy(A)), b.add_buffer(Buffer.from_numpy(B)), b.add_buffer(Buffer("CPU", M * N, dtypes.float32))
  with pytest.raises(PlanError, match="opts must be a list of kiln.codegen.choose.Opt"):
    b.add_kernel(kernels.matmul(M, N, K), [cc, ca, cb], opts=["UPCAST"])
  b.add_kernel(kernels.matmul(M, N, K), [cc, ca, cb], opts=[Opt(OptOps.UPCAST, 7, 4)])
  b.set_outputs([cc])
  with pytest.raises(CodegenError, match=r"kernel 0 'matmul': its opts .* do not fit the kernel: .*axis 7"): b.build()


def test_a_plans_cpu_kernels_share_one_scratch(monkeypatch):
  """A plan runs its steps one after another, so its CPU kernels' scratch (here two softmaxes that keep their rows, of
  different sizes) is one array as large as the largest need, not one each; the results are unchanged. Under KILN_GUARD
  each keeps its own, ending at its guard page."""
  from kiln.codegen.choose import Opt, OptOps
  from kiln.executor import Buffer, ExecutionPlanBuilder
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  from kiln.ir.ops import Ops

  def keep(ast):  # noqa: ANN001, ANN202
    red = [u for u in ast.toposort() if u.op is Ops.REDUCE and u.arg is Ops.ADD][0].src[1].arg[0]
    return [Opt(OptOps.KEEP, red, 1)]
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 96)).astype(np.float32)
  def build():  # noqa: ANN202
    b = ExecutionPlanBuilder("CPU")
    bx, by, bz = (b.add_buffer(Buffer("CPU", 4 * 96, dtypes.float32)) for _ in range(3))
    bw = b.add_buffer(Buffer("CPU", 2 * 192, dtypes.float32))
    s1, s2 = kernels.softmax((4, 96), dtypes.float32), kernels.softmax((2, 192), dtypes.float32)
    b.add_kernel(s1, [by, bx], opts=keep(s1))
    b.add_kernel(s2, [bw, by], opts=keep(s2))
    b.add_kernel(kernels.softmax((4, 96), dtypes.float32), [bz, bw], opts=keep(s1))
    b.set_outputs([bz])
    plan = b.build()
    plan.buffers[bx].copyin(x)
    plan.execute()
    return plan, plan.buffers[bz].numpy().reshape(4, 96).copy()
  def sm(a):  # noqa: ANN001, ANN202
    e = np.exp(a.astype(np.float64) - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  want = sm(sm(sm(x).reshape(2, 192)).reshape(4, 96))
  plan, got = build()
  scratches = [p.bound.scratch for p in plan.kernels]
  assert all(s is not None for s in scratches) and len({id(s) for s in scratches}) == 1
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  monkeypatch.setenv("KILN_GUARD", "1")
  plan, guarded = build()
  assert len({id(p.bound.scratch) for p in plan.kernels}) == 3
  np.testing.assert_array_equal(guarded, got)


def test_kernels_overlapped_on_threads_keep_scratch_of_their_own():
  """Kernels of one level that the plan overlaps on threads run at once, so they may not share a scratch: two
  softmaxes that keep their rows, both reading x, each had the plan's one arena and wrote their rows into the same bytes
  (timm's mixnet_s gave a wrong first run on two threads: two grouped 1x1 convs packing panels into one scratch). The
  j-th kernel of an overlapped group takes the j-th arena; a later kernel, which runs alone, shares one."""
  from kiln.codegen.choose import Opt, OptOps
  from kiln.executor import Buffer, ExecutionPlanBuilder
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  from kiln.ir.ops import Ops

  def keep(ast):  # noqa: ANN001, ANN202
    red = [u for u in ast.toposort() if u.op is Ops.REDUCE and u.arg is Ops.ADD][0].src[1].arg[0]
    return [Opt(OptOps.KEEP, red, 1)]
  x = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32)
  b = ExecutionPlanBuilder("CPU", parallel=True)
  bx, by, bz, bw = (b.add_buffer(Buffer("CPU", 64 * 512, dtypes.float32)) for _ in range(4))
  s = kernels.softmax((64, 512), dtypes.float32)
  b.add_kernel(s, [by, bx], opts=keep(s))
  b.add_kernel(kernels.softmax((64, 512), dtypes.float32), [bz, bx], opts=keep(s))  # independent of the first: same level
  b.add_kernel(kernels.softmax((64, 512), dtypes.float32), [bw, by], opts=keep(s))
  b.set_outputs([bz, bw])
  plan = b.build()
  first, second, third = (p.bound.scratch for p in plan.kernels)
  assert first is not None and second is not None and third is not None
  assert first is not second, "two kernels that run at once share a scratch"
  assert third is first or third is second
  e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
  want = e / e.sum(-1, keepdims=True)
  plan.buffers[bx].copyin(x)
  for _ in range(5):
    plan.execute()
    np.testing.assert_allclose(plan.buffers[bz].numpy().reshape(64, 512), want, rtol=1e-5, atol=1e-7)


def test_a_stretch_of_cpu_kernels_runs_as_one_native_call(cpu):
  """ExecutionPlan hands each stretch of CPU bound calls to the runtime's sequence_calls (SequenceCall): a host function
  in the middle cuts it in two; the sequences follow a runtime variable set after the plan was built."""
  from kiln.runtime.cpu.native_pool import native_pool_supported
  from kiln.runtime.cpu.sequence import CPUSequence
  if not native_pool_supported(): pytest.skip("sequences run on the native pool: Linux on x86-64 or AArch64")
  b = ExecutionPlanBuilder("CPU")
  xs = [b.add_buffer(Buffer("CPU", 64, dtypes.float32)) for _ in range(8)]
  b.buffers[xs[0]].copyin(np.arange(64, dtype=np.float32))
  seen = []
  for i in range(3): b.add_kernel(add1(64), [xs[i + 1], xs[i]])
  b.add_custom(lambda src, dst: (seen.append(src.numpy()[0]), dst.copyin(src.numpy())), [xs[3], xs[4]], outputs=[1])
  b.add_kernel(scale_n(64), [xs[5], xs[4]])
  b.add_kernel(add1(64), [xs[6], xs[5]])
  b.set_outputs([xs[5], xs[6]])  # outputs: no other buffer shares their memory
  plan = b.build()
  (session, run), = plan._runs
  assert session is None and [type(s) is CPUSequence for s in run] == [True, False, True], run
  for n in (64, 5):
    plan.output_buffer(0).copyin(np.zeros(64, np.float32))
    plan.execute_with_vars({"n": n})
    want = np.where(np.arange(64) < n, (np.arange(64, dtype=np.float32) + 3) * 2, 0)
    np.testing.assert_array_equal(plan.output_buffer(0).numpy(), want)
    np.testing.assert_array_equal(plan.output_buffer(1).numpy(), want + 1)
  assert seen == [3.0, 3.0]


def test_a_variable_reaches_its_kernels_through_the_runtimes_writer(cpu):
  """set_vars writes a variable taken by many CPU kernels with the runtime's writer (ValsWriter), not call by call; a
  value outside the bounds is refused before anything is written."""
  b = ExecutionPlanBuilder("CPU")
  xs = [b.add_buffer(Buffer("CPU", 64, dtypes.float32)) for _ in range(5)]
  b.buffers[xs[0]].copyin(np.arange(64, dtype=np.float32))
  for i in range(4): b.add_kernel(scale_n(64), [xs[i + 1], xs[i]])
  b.set_outputs([xs[4]])
  plan = b.build()
  for n in (64, 9, 9, 40):
    plan.output_buffer(0).copyin(np.zeros(64, np.float32))
    plan.execute_with_vars({"n": n})
    write, rest = plan._writers["n"]
    assert write is not None and rest == []
    np.testing.assert_array_equal(plan.output_buffer(0).numpy()[:n], np.arange(n, dtype=np.float32) * 16)
    assert not plan.output_buffer(0).numpy()[n:].any()
    assert all(pk.bound.vals == [n] for pk in plan.kernels)
  with pytest.raises(VariableBoundsError): plan.set_vars({"n": 65})
  assert all(pk.bound.vals == [40] and pk.vals == [40] for pk in plan.kernels)
