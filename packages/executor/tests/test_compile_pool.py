"""kiln.executor.compile_pool: a plan's kernels compiled in forked worker processes on the real CPU runtime, loaded and
cached by the parent; threads where forking is unsafe; a kernel a worker cannot compile is left for the caller."""
import threading
from typing import Any

import numpy as np
import pytest
from kiln_executor_testrt import requires_cpu_runtime

from kiln.executor import cache, compile_kernel_with_origin, compile_pool, precompile_kernels
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.runtime.cpu.compiler import LLVMCompiler

pytestmark = requires_cpu_runtime()


@pytest.fixture
def here(monkeypatch):
  """The LLVM compiles this process runs (a forked worker's count stays in the worker)."""
  calls: list[str] = []
  real = LLVMCompiler.compile_module
  monkeypatch.setattr(LLVMCompiler, "compile_module", lambda self, src: calls.append(src) or real(self, src))
  return calls


def _adds(n):
  """n distinct kernels: x + k for k = 1..n."""
  return [kernels.elementwise(lambda x, k=k: x + float(k), dtypes.float32, ((64,), dtypes.float32), name=f"add{k}") for k in range(1, n + 1)]


def _run(ck, x):
  out = np.zeros_like(x)
  ck.program([out.ctypes.data, x.ctypes.data])
  return out


def test_kernels_compile_in_workers(cpu, here):
  if not compile_pool.can_fork(): pytest.skip("this process cannot fork workers safely")
  asts, seen = _adds(2 * compile_pool.JOBS_PER_PROCESS), []
  precompile_kernels([(a, None) for a in asts] + [(asts[0], None)], "CPU", 2, lambda: seen.append(1))
  assert here == [] and len(seen) == len(asts) + 1  # none compiled in this process; every job reported, the repeat too
  x = np.arange(64, dtype=np.float32)
  for k, a in enumerate(asts, 1):
    ck, origin = compile_kernel_with_origin(a, "CPU")
    assert origin == "memory" and ck.origin == "compiled" and ck.compiled is not None and ck.compiled.ast is a
    np.testing.assert_array_equal(_run(ck, x), x + k)
  assert cache.cached_kernel(asts[1], "CPU") is not None  # and on disk: a new memory cache finds it there
  cache.clear_memory_cache()
  assert cache.cached_kernel(asts[1], "CPU").origin == "disk"


def test_few_jobs_compile_here(cpu, here):
  precompile_kernels([(a, None) for a in _adds(2 * compile_pool.JOBS_PER_PROCESS - 1)], "CPU", 2)
  assert len(here) == 2 * compile_pool.JOBS_PER_PROCESS - 1  # too few to pay for forking: threads


def test_threads_while_another_thread_lives(cpu, here):
  stop = threading.Event()
  t = threading.Thread(target=stop.wait)
  t.start()
  try:
    assert not compile_pool.can_fork()
    precompile_kernels([(a, None) for a in _adds(2 * compile_pool.JOBS_PER_PROCESS)], "CPU", 2)
  finally:
    stop.set(); t.join()
  assert len(here) == 2 * compile_pool.JOBS_PER_PROCESS  # compiled here, on threads


def test_cached_kernels_are_not_compiled_again(cpu, here):
  a, b = _adds(2)
  compile_kernel_with_origin(a, "CPU")
  here.clear()
  seen = []
  precompile_kernels([(a, None), (b, None)], "CPU", 1, lambda: seen.append(1))
  assert len(here) == 1 and len(seen) == 2  # only b: a was in the memory cache


def test_a_failing_job_is_left_for_the_caller(cpu, monkeypatch):
  if not compile_pool.can_fork(): pytest.skip("this process cannot fork workers safely")
  bad, *good = _adds(2 * compile_pool.JOBS_PER_PROCESS)
  real = LLVMCompiler.compile_module
  monkeypatch.setattr(LLVMCompiler, "compile_module", lambda self, src: (_ for _ in ()).throw(RuntimeError("no")) if "@add1_" in src
                      else real(self, src))
  precompile_kernels([(bad, None)] + [(g, None) for g in good], "CPU", 2)
  assert all(cache.cached_kernel(g, "CPU") is not None for g in good) and cache.cached_kernel(bad, "CPU") is None


def test_largest_first():
  small, big = _adds(1)[0], kernels.elementwise(lambda x: (x * 2.0 + 1.0) * x, dtypes.float32, ((64,), dtypes.float32), name="big")
  assert compile_pool.largest_first([(small, None), (big, None), (small, None)]) == [1, 0, 2]


def _report_can_fork(q: Any) -> None: q.put(compile_pool.can_fork())


def test_a_daemonic_process_compiles_on_threads() -> None:
  """A multiprocessing pool's worker is daemonic and may not have children: there kernels compile on threads (the ONNX
  node-test runner, which loads each case in such a worker, crashed with 'daemonic processes are not allowed to have
  children')."""
  import multiprocessing
  ctx = multiprocessing.get_context("fork")
  q = ctx.Queue()
  p = ctx.Process(target=_report_can_fork, args=(q,), daemon=True)
  p.start()
  got = q.get(timeout=60)
  p.join(60)
  assert got is False
