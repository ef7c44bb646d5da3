"""Many kernels compiled at once, before a plan is built (which then finds them in the kernel cache).

A runtime whose compile work holds the interpreter (the CPU's: the lowering is Python under the GIL, and llvmlite runs
every LLVM call under one process-wide lock) gets nothing from threads beyond overlapping one kernel's lowering with
another's LLVM work. Such a runtime says so (`compile_processes`), and the kernels of a load of many (JOBS_PER_PROCESS)
are rendered and compiled in forked worker processes, one per core it compiles on: a forked worker starts with the
parent's modules, runtimes and the kernels' ASTs, so a job is an index and a result the CompiledSpec without its AST (the
parent holds it), as the disk cache stores one. The parent loads each result and puts it in the memory and disk caches as compile_kernel would.

Fork is used only where it is safe: a POSIX fork start method, and no other Python thread alive (one could hold a lock
the child would then wait on for ever). Otherwise, and for runtimes that compile out of process (CUDA's nvcc) or must
not fork (a CUDA context does not survive one), kernels compile on threads as before. A kernel whose job fails, or a
pool that breaks (a worker killed), is left for the plan's build, which compiles it in-process and reports any error
with the kernel's place in the plan.
"""
from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import CompiledSpec
from kiln.executor import cache, debug
from kiln.ir.uop import UOp

Job = tuple[UOp, Any]  # (kernel AST, opts: None for the heuristic's)

# processes only where each worker gets at least this many jobs: forking costs about one kernel's compile (tens of ms per
# GB the process holds, and the pool's setup), which a model's tens or hundreds of kernels repay and a test graph's few do not
JOBS_PER_PROCESS = 4

# what forked workers read: set by the parent just before it forks them, cleared after (a job names an entry by index)
_JOBS: list[Job] = []
_DEVICE = ""


def can_fork() -> bool:
  """Whether worker processes may be forked from here now: the platform forks, this is the only Python thread, and this
  process may have children (a daemonic one, a multiprocessing pool's worker, may not: its pool would fail to start)."""
  return ("fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
          and not multiprocessing.current_process().daemon)


def largest_first(jobs: Sequence[Job]) -> list[int]:
  """The jobs' indices, the largest AST first: a kernel's compile time grows with its AST, and a few large kernels hold
  much of a model's compile time; one of them started last would leave the other workers idle while it finishes."""
  return sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0].toposort()))


def _compile_one(i: int) -> tuple[int, str | None]:
  """In a worker: render and compile job i; (i, its CompiledSpec as JSON without the AST), or (i, None) when it raised
  (the parent's build compiles it again and reports the error where it belongs)."""
  ast, opts = _JOBS[i]
  try:
    rt = get_runtime(_DEVICE)
    spec = rt.renderer.render(ast) if opts is None else rt.renderer.render(ast, opts)
    return i, rt.compiler.compile(spec).model_dump_json(exclude={"ast"})
  except Exception: return i, None


def _adopt(ast: UOp, opts: Any, device: str, payload: str) -> None:
  """Load a worker's result and put it in the caches under (ast, opts), as a compile here would."""
  rt = get_runtime(device)
  compiled = CompiledSpec.model_validate_json_with(payload, ast=ast)
  key = cache.kernel_key(ast, device, opts)
  ck = cache.CachedKernel.from_compiled(compiled, rt.load(compiled), rt, key, "compiled")
  if cache.get_or_compile_kernel(key, device, lambda: ck) is ck:  # not compiled meanwhile by another caller
    cache._stats["compiles"] += 1
    if cache.disk_cache_enabled(): cache.disk_store(cache.kernel_disk_key(ast, device, rt, opts), compiled)
    debug.on_compiled(ck, "compiled")


def precompile_kernels(jobs: Sequence[Job], device: str, workers: int, done: Callable[[], None] | None = None) -> None:
  """Compile every distinct job not yet in the kernel cache, `workers` at a time (processes where the runtime's compile
  work holds the interpreter and forking is safe, else threads); `done()` after each job, cached ones included. Never
  raises for a kernel: one that fails is left for the build."""
  global _JOBS, _DEVICE
  dev = str(cache._dev(device))
  todo: list[Job] = []
  for ast, opts in jobs:
    if cache.cached_kernel(ast, dev, opts) is None: todo.append((ast, opts))
    elif done is not None: done()
  if not todo: return
  rt = get_runtime(dev)
  procs = min(workers, len(todo) // JOBS_PER_PROCESS)
  if procs > 1 and getattr(rt, "compile_processes", False) and can_fork():
    _JOBS, _DEVICE = todo, dev
    try:
      with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as ex:
        futs = [ex.submit(_compile_one, i) for i in largest_first(todo)]
        for fut in as_completed(futs):
          try: i, payload = fut.result()
          except BrokenProcessPool: payload = None  # a worker died: this job (and the rest) are left for the build
          else:
            if payload is not None:
              try: _adopt(*todo[i], dev, payload)
              except Exception as e:  # noqa: BLE001 (left for the build, which reports it)
                if debug.DEBUG >= 1: debug.emit(f"kiln: a worker's kernel did not load ({type(e).__name__}: {e}); compiling it here")
          if done is not None: done()
    finally: _JOBS, _DEVICE = [], ""
    return

  def one(job: Job) -> None:
    try: cache.compile_kernel(job[0], dev, job[1])
    except Exception: pass  # noqa: S110 (the build compiles it again and raises with the kernel's label)
  if workers <= 1 or len(todo) <= 1:
    for job in todo:
      one(job)
      if done is not None: done()
    return
  with ThreadPoolExecutor(min(workers, len(todo))) as tx:
    ts: list[Future[None]] = [tx.submit(one, job) for job in todo]
    for _ in as_completed(ts):
      if done is not None: done()
