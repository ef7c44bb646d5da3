"""Tuning (kiln.executor.tune) against the real CPU runtime: search once, reuse after (also in a new process), the
switches, the budget, bad stored entries, read-write kernels, and results equal to the untuned plan's."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from kiln_executor_testrt import requires_cpu_runtime

from kiln.executor import Buffer, ExecutionPlanBuilder, cache, tune
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import PlanError, SettingError
from kiln.ir.uop import UOp

pytestmark = requires_cpu_runtime()


@pytest.fixture
def cpu(tmp_path, monkeypatch):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("KILN_TUNE_BUDGET", "0.4")
  for k in ("KILN_CACHE", "KILN_TUNE"): monkeypatch.delenv(k, raising=False)
  cache.clear_memory_cache()
  yield tmp_path / "cache"
  cache.clear_memory_cache()


def matmul_plan(m, n, k, seed=0, **kw):
  rng = np.random.default_rng(seed)
  A, B = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
  b = ExecutionPlanBuilder("CPU")
  ia, ib, ic = b.add_buffer(Buffer.from_numpy(A)), b.add_buffer(Buffer.from_numpy(B)), b.add_buffer(Buffer("CPU", m * n, dtypes.float32))
  b.add_kernel(kernels.matmul(m, n, k), [ic, ia, ib], **kw)
  b.set_outputs([ic])
  return b, A, B


def kernel_of(plan):
  (pk,) = plan.kernels
  return pk


def searches(): return tune.tune_stats()["searches"]


def test_search_once_then_reuse(cpu):
  s0 = searches()
  p1 = matmul_plan(64, 48, 32, tune=True)[0].build()
  assert searches() == s0 + 1 and len(list((cpu / "tuning").glob("*.json"))) == 1
  cache.clear_memory_cache()  # as a new process would: only the disk knows the choice
  before = cache.cache_stats()
  p2 = matmul_plan(64, 48, 32, tune=True)[0].build()
  after = cache.cache_stats()
  assert searches() == s0 + 1  # no second search
  assert kernel_of(p2).kernel.applied_opts == kernel_of(p1).kernel.applied_opts
  assert after["compiles"] == before["compiles"] and after["disk_hits"] == before["disk_hits"] + 1  # only the chosen kernel, from disk


def test_new_process_reuses_choice(tmp_path):
  code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from test_tune import matmul_plan, kernel_of\n"
          "from kiln.executor import cache, tune\n"
          "p = matmul_plan(96, 64, 48, tune=True)[0].build(); k = kernel_of(p).kernel\n"
          "print(json.dumps([k.applied_opts, tune.tune_stats()['searches'], cache.cache_stats()['compiles'], k.origin]))")
  env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "c"), "KILN_CACHE": "1", "KILN_TUNE_BUDGET": "0.5"}
  env.pop("KILN_TUNE", None)

  def run():
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
  opts1, s1, c1, _ = run()
  opts2, s2, c2, origin2 = run()
  assert s1 == 1 and c1 == 1  # searched; the kernel cache compiled only the heuristic's kernel (candidates compile outside it)
  assert s2 == 0 and c2 == 0 and origin2 == "disk" and opts2 == opts1


def test_switches(cpu, monkeypatch):
  s0 = searches()
  matmul_plan(32, 32, 32)[0].build()
  assert searches() == s0  # off by default
  monkeypatch.setenv("KILN_TUNE", "1")
  matmul_plan(32, 32, 16)[0].build()
  assert searches() == s0 + 1  # KILN_TUNE=1 tunes every kernel
  matmul_plan(32, 32, 8, tune=False)[0].build()
  b, _, _ = matmul_plan(32, 16, 8)
  b.ops[0].opts = []  # explicit options are the caller's, never tuned
  b.build()
  assert searches() == s0 + 1
  monkeypatch.setenv("KILN_TUNE", "0")
  matmul_plan(16, 32, 16, tune=True)[0].build()
  assert searches() == s0 + 2  # tune=True without the variable
  with pytest.raises(PlanError, match="opts or tune"): matmul_plan(16, 16, 16, tune=True, opts=[])
  monkeypatch.setenv("KILN_TUNE_BUDGET", "soon")
  with pytest.raises(SettingError, match="KILN_TUNE_BUDGET must be a positive number of seconds, got 'soon'"):
    matmul_plan(16, 16, 8, tune=True)[0].build()


def test_budget_respected(cpu, monkeypatch):
  """The budget is checked before each candidate: a spent budget times none, a generous one times some. Counted, not timed
  (wall-time bounds failed on a loaded machine: one candidate's compile can take longer than any small budget)."""
  monkeypatch.setenv("KILN_TUNE_BUDGET", "1e-9")
  t0 = tune.tune_stats()["timed"]
  matmul_plan(128, 128, 128, tune=True)[0].build()
  assert tune.tune_stats()["timed"] == t0  # spent before the first candidate
  monkeypatch.setenv("KILN_TUNE_BUDGET", "5")
  t0 = tune.tune_stats()["timed"]
  matmul_plan(128, 128, 64, tune=True)[0].build()
  assert tune.tune_stats()["timed"] > t0


def test_corrupt_or_foreign_entry_retuned(cpu):
  matmul_plan(48, 32, 16, tune=True)[0].build()
  (f,) = (cpu / "tuning").glob("*.json")
  good = f.read_text()
  for bad in ("{not json", json.dumps({**json.loads(good), "key": "someone else's"}), good.replace('"format": 2', '"format": 9'),
              json.dumps({**json.loads(good), "opts": [["NOPE", 0, 1]]})):
    cache.clear_memory_cache()
    f.write_text(bad)
    s0, e0 = searches(), tune.tune_stats()["entry_errors"]
    plan = matmul_plan(48, 32, 16, tune=True)[0].build()
    assert searches() == s0 + 1 and tune.tune_stats()["entry_errors"] == e0 + 1
    plan.execute()
  assert json.loads(f.read_text())["key"] == json.loads(good)["key"]  # written afresh


def test_cache_off_stores_nothing(cpu, monkeypatch):
  monkeypatch.setenv("KILN_CACHE", "0")
  s0 = searches()
  for _ in range(2): matmul_plan(32, 32, 32, tune=True)[0].build()
  assert searches() == s0 + 2 and not (cpu / "tuning").exists()


def test_read_write_kernel_keeps_its_buffer(cpu):
  n = 4096
  x = UOp.define_global(0, dtypes.float32.ptr(n))
  i = UOp.range(n, 0)
  ast = UOp.sink(x.index(i).store(x.index(i).load() * 2.0), name="x2")
  data = np.arange(n, dtype=np.float32)
  b = ExecutionPlanBuilder("CPU")
  ix = b.add_buffer(Buffer.from_numpy(data.copy()))
  b.add_kernel(ast, [ix], tune=True)
  b.set_outputs([ix])
  s0 = searches()
  plan = b.build()
  assert searches() == s0 + 1
  np.testing.assert_array_equal(plan.buffers[ix].numpy(), data)  # tuned on a copy
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), data * 2)


def test_buffer_read_earlier_is_not_clobbered(cpu):
  # op 0 reads y; op 1 then overwrites y: tuning op 1 before the first execute must not destroy what op 0 reads
  n = 2048
  b = ExecutionPlanBuilder("CPU")
  y0 = np.full(n, 3.0, np.float32)
  iy, iz = b.add_buffer(Buffer.from_numpy(y0.copy())), b.add_buffer(Buffer("CPU", n, dtypes.float32))
  iw = b.add_buffer(Buffer.from_numpy(np.ones(n, np.float32)))
  b.add_kernel(kernels.elementwise(lambda v: v + 1.0, dtypes.float32, ((n,), dtypes.float32), name="inc"), [iz, iy])
  b.add_kernel(kernels.elementwise(lambda v: v * 5.0, dtypes.float32, ((n,), dtypes.float32), name="x5"), [iy, iw], tune=True)
  b.set_outputs([iz, iy])
  plan = b.build()
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), y0 + 1)
  np.testing.assert_array_equal(plan.output_buffer(1).numpy(), np.full(n, 5.0, np.float32))


def test_tuned_results_equal_untuned(cpu):
  m, n, k = 96, 80, 64
  b, A, B = matmul_plan(m, n, k, seed=3)
  untuned = b.build()
  untuned.execute()
  b, _, _ = matmul_plan(m, n, k, seed=3, tune=True)
  tuned = b.build()
  tuned.execute()
  want = untuned.output_buffer(0).numpy().reshape(m, n)
  np.testing.assert_allclose(tuned.output_buffer(0).numpy().reshape(m, n), want, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(want, A @ B, rtol=1e-4, atol=1e-4)
  # integers: exact
  xs = np.arange(-5000, 5000, dtype=np.int32)
  outs = []
  for t in (False, True):
    b = ExecutionPlanBuilder("CPU")
    ix, io = b.add_buffer(Buffer.from_numpy(xs)), b.add_buffer(Buffer("CPU", xs.size, dtypes.int32))
    b.add_kernel(kernels.elementwise(lambda v: v * 7 + 3, dtypes.int32, ((xs.size,), dtypes.int32), name="i7"), [io, ix], tune=t)
    b.set_outputs([io])
    p = b.build()
    p.execute()
    outs.append(p.output_buffer(0).numpy().copy())
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_array_equal(outs[1], xs * 7 + 3)


def test_disagreeing_candidate_discarded(cpu, monkeypatch):
  n = 4096
  wrong = kernels.elementwise(lambda v: v * 3.0, dtypes.float32, ((n,), dtypes.float32), name="x2")
  real = tune._compile
  monkeypatch.setattr(tune, "_compile", lambda rt, ast, opts, key: real(rt, wrong, opts, key))  # every candidate computes x*3
  b = ExecutionPlanBuilder("CPU")
  ix, io = b.add_buffer(Buffer.from_numpy(np.arange(n, dtype=np.float32))), b.add_buffer(Buffer("CPU", n, dtypes.float32))
  b.add_kernel(kernels.elementwise(lambda v: v * 2.0, dtypes.float32, ((n,), dtypes.float32), name="x2"), [io, ix], tune=True)
  b.set_outputs([io])
  d0 = tune.tune_stats()["disagreed"]
  plan = b.build()
  assert tune.tune_stats()["disagreed"] > d0
  plan.execute()
  np.testing.assert_array_equal(plan.output_buffer(0).numpy(), np.arange(n, dtype=np.float32) * 2)
  (f,) = (cpu / "tuning").glob("*.json")
  assert json.loads(f.read_text())["opts"] is None  # the heuristic kept
