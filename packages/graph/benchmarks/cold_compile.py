"""Where a cold ONNX load's compile time goes, and what compiling in processes instead of threads gives (issue 37).

    python packages/graph/benchmarks/cold_compile.py MODEL.onnx [MODEL.onnx ...] [--rounds N] [--cores 2,4,16]

Every load runs in a fresh process with KILN_CACHE=0 (no kernel disk cache, no plan cache). Per model:

1. One load compiled serially in-process, each kernel's render (lowering + passes + IR text) and LLVM (parse, optimise,
   emit) timed in CPU time of its thread (time.thread_time), which other processes on a busy machine do not inflate;
   from those, the compile phase's makespan on an idle machine of each core count: threads (each job renders under the
   GIL, then compiles under llvmlite's one lock, as kiln did before kiln.executor.compile_pool) and forked processes
   (each job renders and compiles alone, the largest AST first), fork costs not included.
2. --rounds N > 0: the load's wall time with the CPU runtime compiling on threads and in processes, interleaved
   (threads, processes, then processes, threads, ...), each in its own process; on a machine other work shares, these
   move with its load: read them beside the CPU times.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, os, sys, time
os.environ["KILN_CACHE"] = "0"
path, mode = sys.argv[1], sys.argv[2]
from kiln.runtime.cpu import compiler as C, device as D
from kiln.codegen.render import llvm as R
if mode != "processes": D.CPURuntime.compile_processes = property(lambda self: False)
jobs = []
if mode == "serial":
  D.CPURuntime.compile_threads = property(lambda self: 1)
  render, compile_module = R.LLVMRenderer.render, C.LLVMCompiler.compile_module
  def timed_render(*a, **k):
    t = time.thread_time(); out = render(*a, **k); jobs.append([time.thread_time() - t, 0.0, len(a[1].toposort())]); return out
  def timed_compile(*a, **k):
    t = time.thread_time(); out = compile_module(*a, **k); jobs[-1][1] = time.thread_time() - t; return out
  R.LLVMRenderer.render, C.LLVMCompiler.compile_module = timed_render, timed_compile
from kiln.graph import onnx as konnx
data = open(path, "rb").read()
t0, c0 = time.perf_counter(), os.times()
m = konnx.load(data)
t1, c1 = time.perf_counter(), os.times()
print(json.dumps({"wall": t1 - t0, "cpu": c1.user + c1.system - c0.user - c0.system,
                  "children_cpu": c1.children_user + c1.children_system - c0.children_user - c0.children_system,
                  "kernels": len(m.plan.kernels), "jobs": jobs}))
"""


def _load(path: str, mode: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _CHILD, path, mode], capture_output=True, text=True)
  if out.returncode: raise RuntimeError(f"{path} ({mode}) failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def threads_makespan(jobs: list[tuple[float, float]], n: int) -> float:
  """n threads taking jobs in order; a job's render holds the GIL, its LLVM part llvmlite's lock (the GIL released)."""
  gil = lock = 0.0
  free = [0.0] * n
  for r, ll in jobs:
    i = min(range(n), key=free.__getitem__)
    gil = max(free[i], gil) + r
    lock = max(gil, lock) + ll
    free[i] = lock
  return max(free)


def processes_makespan(jobs: list[tuple[float, float]], n: int) -> float:
  """n workers taking jobs in order (compile_pool gives them the largest AST first), each rendered and compiled alone."""
  h = [0.0] * n
  for r, ll in jobs: heapq.heappush(h, heapq.heappop(h) + r + ll)
  return max(h)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("models", nargs="+")
  p.add_argument("--rounds", type=int, default=0, help="interleaved wall-time rounds of threads vs processes (0: none)")
  p.add_argument("--cores", default="2,4,16", help="core counts to model the compile phase on")
  a = p.parse_args()
  cores = [int(c) for c in a.cores.split(",")]
  for path in a.models:
    name = os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path)
    s = _load(path, "serial")
    jobs = [(r, ll) for r, ll, _ in s["jobs"]]
    largest = [(r, ll) for r, ll, _ in sorted(s["jobs"], key=lambda j: -j[2])]  # compile_pool.largest_first's order
    rs, ls = sum(r for r, _ in jobs), sum(ll for _, ll in jobs)
    top = sorted((r + ll for r, ll in jobs), reverse=True)
    print(f"{name}: {s['kernels']} kernels in the plan, {len(jobs)} compiled; serial load {s['wall']:.2f}s wall, {s['cpu']:.2f}s CPU: "
          f"render {rs:.2f}s + LLVM {ls:.2f}s CPU, the rest {s['cpu'] - rs - ls:.2f}s; the costliest tenth of the kernels "
          f"{sum(top[:max(1, len(top) // 10)]):.2f}s")
    print("  compile phase on an idle machine, modelled: " + ", ".join(
      f"{n} cores: threads {threads_makespan(jobs, n):.2f}s, processes {processes_makespan(largest, n):.2f}s" for n in cores))
    walls: dict[str, list[float]] = {"threads": [], "processes": []}
    for rnd in range(a.rounds):
      for mode in (("threads", "processes") if rnd % 2 == 0 else ("processes", "threads")):
        r = _load(path, mode)
        walls[mode].append(r["wall"])
        print(f"  round {rnd} {mode:9s} {r['wall']:.2f}s wall, {r['cpu']:.2f}s CPU here + {r['children_cpu']:.2f}s in workers", flush=True)
    if a.rounds:
      print("  " + ", ".join(f"{m} median {statistics.median(w):.2f}s (min {min(w):.2f}s)" for m, w in walls.items()))


if __name__ == "__main__": main()
