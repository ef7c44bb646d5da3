"""The executor's kernel rows: add and sum (on aligned arrays and on numpy's own), matmul at four sizes, dispatch (a
100-kernel plan, one execute()), compiling (cold, memory-cache hit, disk hit in a new process) and scripts/demo's MLP
pass, each checked against numpy, then timed with numpy and the peers (Bench.time_row) and judged against its target and
this machine's limits (Bench.limits)."""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.ir import kernels
from kiln_bench.bench import Bench, Peer
from kiln_bench.harness import BENCH_ROOT, F32, GB, MB, WrongResult, aligned_empty, check, conformance_kernel, kiln_call, launch_sizes, per_call
from kiln_bench.peers import numba_fn
from kiln_bench.table import Row, rate

USER = ", numpy's arrays"  # the add and sum rows again on arrays as a user makes them (vec_add's docstring)


def _offsets(**arrays: np.ndarray) -> str:
  """Where numpy's arrays start, in bytes past a 64-byte boundary (kiln's streaming stores want 16 or 64)."""
  return "numpy's arrays start " + ", ".join(f"{k} +{v.ctypes.data % 64}" for k, v in arrays.items()) + " bytes past a 64-byte boundary"


# ---- elementwise and reductions ----
def vec_add(bench: Bench, r: Row, user: bool = False) -> None:
  """c = a + b. user=False: every library gets 64-byte-aligned arrays, as kiln's allocator makes them. user=True: the
  arrays a user has, numpy's own (its big allocations start 16 bytes past a 64-byte boundary, glibc's mmap header), so
  kiln's streaming stores take the 16-byte-aligned path; kiln and numpy only, the peers are on the aligned row."""
  n = bench.size(1 << 24, 1 << 10)
  if user:
    a, b = bench.rng.random(n, dtype=np.float32), bench.rng.random(n, dtype=np.float32)
    c, cn = np.empty(n, np.float32), np.empty(n, np.float32)
    r.note = _offsets(a=a, b=b, out=c)
  else:
    a, b, c, cn = (aligned_empty(n) for _ in range(4))
    a[:], b[:] = bench.rng.random(n, dtype=np.float32), bench.rng.random(n, dtype=np.float32)
  k = kiln_call(kernels.elementwise(lambda x, y: x + y, F32, ((n,), F32), ((n,), F32), name="bench_add"), [c, a, b])
  want = a + b
  k()
  check("add", c, want)
  peers: dict[str, Peer] = {}
  if bench.peers.numba is not None and not user:
    f, o = numba_fn(bench.peers.numba, "add"), aligned_empty(n)
    peers["numba"] = (lambda: f(a, b, o), lambda _: check("numba add", o, want))
  if bench.peers.tinygrad is not None and not user:
    T, D, dev = bench.peers.tinygrad
    ta, tb = T(a, device=dev).realize(), T(b, device=dev).realize()
    peers["tinygrad"] = (lambda: bench.tg((ta + tb).realize()), lambda out: check("tinygrad add", out.numpy(), want))
  bench.time_row(r, {"kiln": k, "numpy": lambda: np.add(a, b, out=cn)}, peers)
  _bw_row(bench, r, 12 * n, f"{n / (1 << 20):g}M float32 add{USER if user else ''}", 3.0, bench.bw_add, "add")


def vec_sum(bench: Bench, r: Row, user: bool = False) -> None:
  """The sum of a: 64-byte-aligned, or (user=True) numpy's own array, kiln and numpy only (as vec_add)."""
  n = bench.size(1 << 24, 1 << 10)
  if user:
    a = bench.rng.random(n, dtype=np.float32)
    r.note = _offsets(a=a)
  else:
    a = aligned_empty(n)
    a[:] = bench.rng.random(n, dtype=np.float32)
  out = np.zeros(1, np.float32)
  k = kiln_call(kernels.reduce_sum((n,), F32), [out, a])
  want = a.sum(dtype=np.float64)
  k()
  check("sum", out[0], want, rtol=1e-5)
  peers: dict[str, Peer] = {}
  if bench.peers.numba is not None and not user:
    f = numba_fn(bench.peers.numba, "sum")
    peers["numba"] = (lambda: f(a), lambda s: check("numba sum", s, want, rtol=1e-4))
  if bench.peers.tinygrad is not None and not user:
    T, D, dev = bench.peers.tinygrad
    ta = T(a, device=dev).realize()
    peers["tinygrad"] = (lambda: bench.tg(ta.sum().realize()), lambda s: check("tinygrad sum", s.numpy(), want, rtol=1e-4))
  bench.time_row(r, {"kiln": k, "numpy": lambda: a.sum()}, peers)
  _bw_row(bench, r, 4 * n, f"{n / (1 << 20):g}M float32 sum{USER if user else ''}", 4.0, bench.bw, "read")


def _bw_row(bench: Bench, r: Row, nbytes: int, work: str, target: float, limit: float, what: str) -> None:
  r.work = work
  r.ratio = r.paired("numpy")
  r.achieved = rate(nbytes / r.kiln, "GB/s", limit)  # type: ignore[operator]
  r.limit = f"{limit / GB:.1f} GB/s {what}"
  r.target, r.target_kind, r.target_value = f">= {target:g}x numpy", "ratio", target


def matmul(bench: Bench, r: Row, n0: int, gated: bool) -> None:
  n = max(8, round(n0 * bench.scale ** 0.5))  # sizes scale as elements, so dims by the square root
  r.work = f"matmul {n}x{n} float32"
  a, b = bench.rng.random((n, n), dtype=np.float32) * 2 - 1, bench.rng.random((n, n), dtype=np.float32) * 2 - 1
  c = np.empty((n, n), np.float32)
  k = kiln_call(kernels.matmul(n, n, n), [c, a, b])
  want = a.astype(np.float64) @ b.astype(np.float64)
  tol = 1e-6 * n + 1e-5  # float32 accumulation over n terms of magnitude <= 1
  k()
  check(f"matmul {n}", c, want, atol=tol)
  check(f"numpy matmul {n}", a @ b, want, atol=tol)
  peers: dict[str, Peer] = {}
  if bench.peers.numba is not None:
    f, o = numba_fn(bench.peers.numba, "matmul"), np.empty_like(c)
    peers["numba"] = (lambda: f(a, b, o), lambda _: check("numba matmul", o, want, atol=tol))
  if bench.peers.tinygrad is not None:
    T, D, dev = bench.peers.tinygrad
    ta, tb = T(a, device=dev).realize(), T(b, device=dev).realize()
    peers["tinygrad"] = (lambda: bench.tg((ta @ tb).realize()), lambda o: check("tinygrad matmul", o.numpy(), want, atol=tol))
  bench.time_row(r, {"kiln": k, "numpy": lambda: a @ b}, peers)
  r.ratio = r.paired("numpy")
  r.achieved = rate(2 * n ** 3 / r.kiln, "GFLOP/s", bench.peak or None)
  r.limit = f"{bench.peak / GB:.0f} GFLOP/s FMA" if bench.peak else "-"
  r.note = (r.note + "; " if r.note else "") + f"numpy {2 * n ** 3 / r.numpy / GB:.1f} GFLOP/s"
  if gated: r.target, r.target_kind, r.target_value = ">= 0.6x numpy", "ratio", 0.6
  else: r.target = "(report)"


# ---- dispatch ----
def dispatch_chain(bench: Bench, r: Row, count: int = 100, n: int = 64) -> None:
  """A prepared plan of `count` tiny dependent kernels (x[i+1] = x[i] + 1): replay time per kernel."""
  from kiln.executor import Buffer, ExecutionPlanBuilder
  x0 = bench.rng.random(n, dtype=np.float32)
  b = ExecutionPlanBuilder("CPU")
  ast = kernels.elementwise(lambda x: x + 1.0, F32, ((n,), F32), name="tiny_add1")
  ids = [b.add_buffer(Buffer.from_numpy(x0))] + [b.add_buffer(Buffer("CPU", n, F32)) for _ in range(count)]
  for i in range(count): b.add_kernel(ast, [ids[i + 1], ids[i]])
  b.set_outputs([ids[-1]])
  plan = b.build()
  plan.execute()
  xs = [x0] + [np.empty_like(x0) for _ in range(count)]
  def np_chain() -> None:
    for i in range(count): np.add(xs[i], 1.0, out=xs[i + 1])
  np_chain()
  check("dispatch chain", plan.output_buffer(0).numpy(), xs[-1])
  reps = 10 if bench.args.quick else 50
  tk = per_call(plan.execute, reps, 7 if bench.args.quick else 21)
  tn = per_call(np_chain, reps, 7 if bench.args.quick else 21)
  r.kiln, r.numpy, r.ratio = tk / count, tn / count, tn / tk
  if bench.peers.tinygrad is not None:  # tinygrad's prepared plan: a TinyJit replaying the same chain
    T, D, dev = bench.peers.tinygrad
    from tinygrad import TinyJit
    @TinyJit
    def chain(x: Any) -> Any:
      for _ in range(count): x = (x + 1.0).realize()
      return x
    tx = T(x0, device=dev).realize()
    def tg() -> Any:
      out = chain(tx)
      D[dev].synchronize()
      return out
    for _ in range(3): tg()  # TinyJit captures on the second call and replays from the third
    bench.peer_alone(r, "tinygrad", tg, lambda o: check("tinygrad dispatch chain", o.numpy(), xs[-1]))
    if r.tinygrad is not None: r.tinygrad /= count
  r.achieved, r.limit = f"{count} kernels/plan", f"{bench.ctypes_s * 1e6:.2f} us ctypes call"
  r.target, r.target_kind, r.target_value = "<= 2 us/kernel", "max", 2e-6
  r.note = f"numpy column: the same {count} ops as ufunc calls; plan memory {plan.memory_bytes} B"


def dispatch_one(bench: Bench, r: Row, n: int = 64) -> None:
  from kiln.executor import Buffer, ExecutionPlanBuilder
  x0 = bench.rng.random(n, dtype=np.float32)
  b = ExecutionPlanBuilder("CPU")
  i, o = b.add_buffer(Buffer.from_numpy(x0)), b.add_buffer(Buffer("CPU", n, F32))
  b.add_kernel(kernels.elementwise(lambda x: x + 1.0, F32, ((n,), F32), name="tiny_add1"), [o, i])
  b.set_outputs([o])
  plan = b.build()
  plan.execute()
  y = np.empty_like(x0)
  check("dispatch one", plan.output_buffer(0).numpy(), x0 + np.float32(1))
  tk = per_call(plan.execute, 200, 7 if bench.args.quick else 21)
  tn = per_call(lambda: np.add(x0, 1.0, out=y), 200, 7 if bench.args.quick else 21)
  r.kiln, r.numpy, r.ratio = tk, tn, tn / tk
  r.achieved, r.limit = "1 kernel/plan", f"{bench.ctypes_s * 1e6:.2f} us ctypes call"
  r.target, r.target_kind, r.target_value = "<= 5 us/execute", "max", 5e-6
  r.note = "numpy column: one ufunc call"


# ---- compiling and the kernel cache ----
def compile_cold(bench: Bench, r: Row) -> None:
  from kiln.executor import compile_kernel_with_origin
  from kiln.executor.cache import clear_memory_cache
  old = os.environ.get("KILN_CACHE")
  os.environ["KILN_CACHE"] = "0"
  try:
    compile_kernel_with_origin(conformance_kernel(-1.0))  # runtime and LLVM start-up happen once per process: not a compile
    ts = []
    for i in range(3 if bench.args.quick else 15):
      ast = conformance_kernel(0.5 + i)  # a new AST each time: nothing below the kernel cache can have seen it
      clear_memory_cache()
      st = time.perf_counter()
      ck, origin = compile_kernel_with_origin(ast)
      ts.append(time.perf_counter() - st)
      if origin != "compiled": raise RuntimeError(f"expected a cold compile, got a {origin} hit")
  finally:
    if old is None: os.environ.pop("KILN_CACHE", None)
    else: os.environ["KILN_CACHE"] = old
  a, b, out = bench.rng.random(256, dtype=np.float32), bench.rng.random(256, dtype=np.float32), np.empty(256, np.float32)
  ck.program.bind([out.ctypes.data, a.ctypes.data, b.ctypes.data], [], *launch_sizes(ck))()
  check("compiled conformance kernel", out, np.maximum(a * b + np.float32(0.5 + len(ts) - 1), a))
  r.kiln = statistics.median(ts)
  r.achieved, r.limit = f"median of {len(ts)}", "-"
  r.target, r.target_kind, r.target_value = "<= 30 ms", "max", 30e-3
  r.note = "render + LLVM O3 + load, KILN_CACHE=0"


def memory_hit(bench: Bench, r: Row) -> None:
  from kiln.executor import compile_kernel_with_origin
  ast = conformance_kernel(1e6)
  compile_kernel_with_origin(ast)
  if compile_kernel_with_origin(ast)[1] != "memory": raise RuntimeError("second lookup was not a memory-cache hit")
  r.kiln = per_call(lambda: compile_kernel_with_origin(ast), 1000, 15)
  r.achieved, r.limit = "compile_kernel_with_origin", "-"
  r.target, r.target_kind, r.target_value = "<= 20 us", "max", 20e-6


def disk_hit(bench: Bench, r: Row) -> None:
  """A disk-cache hit in a NEW process: a child imports kiln and makes the runtime (timed apart: start-up), then times the
  first compile_kernel_with_origin of a kernel this process compiled into a fresh cache directory, then runs it."""
  from kiln.executor import compile_kernel_with_origin
  from kiln.executor.cache import clear_memory_cache
  c = 4242.0
  child = textwrap.dedent(f"""
    import json, time
    t0 = time.perf_counter()
    import numpy as np
    from kiln.codegen.registry import get_runtime
    from kiln.executor import compile_kernel_with_origin
    from kiln_bench.harness import conformance_kernel, launch_sizes
    get_runtime("CPU")
    ast = conformance_kernel({c!r})
    t1 = time.perf_counter()
    ck, origin = compile_kernel_with_origin(ast)
    t2 = time.perf_counter()
    a, b, out = np.linspace(-2, 2, 256, dtype=np.float32), np.linspace(3, -1, 256, dtype=np.float32), np.empty(256, np.float32)
    ck.program.bind([out.ctypes.data, a.ctypes.data, b.ctypes.data], [], *launch_sizes(ck))()
    ok = bool(np.array_equal(out, np.maximum(a * b + np.float32({c!r}), a)))
    print(json.dumps({{"setup": t1 - t0, "hit": t2 - t1, "origin": origin, "ok": ok}}))
  """)
  with tempfile.TemporaryDirectory(prefix="kiln-bench-cache-") as d:
    path = os.pathsep.join([BENCH_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "KILN_CACHE_DIR": d, "KILN_CACHE": "1", "PYTHONPATH": path}
    old = {k: os.environ.get(k) for k in ("KILN_CACHE_DIR", "KILN_CACHE")}
    os.environ.update(KILN_CACHE_DIR=d, KILN_CACHE="1")
    try:
      clear_memory_cache()
      if compile_kernel_with_origin(conformance_kernel(c))[1] != "compiled": raise RuntimeError("the fresh disk cache was not empty")
    finally:
      for k, v in old.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v
      clear_memory_cache()
    hits, setups = [], []
    for _ in range(2 if bench.args.quick else 7):
      p = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
      if p.returncode != 0: raise RuntimeError(f"child process failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
      res = json.loads(p.stdout.strip().splitlines()[-1])
      if res["origin"] != "disk": raise RuntimeError(f"the new process got its kernel from {res['origin']}, not the disk cache")
      if not res["ok"]: raise WrongResult("kernel loaded from the disk cache computed a wrong result")
      hits.append(res["hit"])
      setups.append(res["setup"])
  r.kiln = statistics.median(hits)
  r.achieved, r.limit = f"median of {len(hits)} processes", "-"
  r.target, r.target_kind, r.target_value = "<= 2 ms", "max", 2e-3
  r.note = f"excludes interpreter start-up, imports and get_runtime ({statistics.median(setups) * 1e3:.0f} ms, apart)"


# ---- the main job ----
def mlp(bench: Bench, r: Row, mem: Row) -> None:
  from kiln.executor import demo
  sizes = [784, 512, 512, 10]
  batch = bench.size(256, 4)
  ws = demo.make_weights(sizes)
  x = np.random.default_rng(1).standard_normal((batch, sizes[0])).astype(np.float32)
  with tempfile.TemporaryDirectory(prefix="kiln-bench-mlp-") as d:
    wfile = Path(d) / "mlp_weights.npy"
    np.save(wfile, np.concatenate([w.ravel() for w in ws]))
    plan, out = demo.build(x, wfile, ws, sizes)
    plan.execute()
    check("MLP pass", out.numpy().reshape(batch, sizes[-1]), demo.numpy_forward(x, ws), atol=1e-4)
    tk = bench.time_row(r, {"kiln": plan.execute, "numpy": lambda: demo.numpy_forward(x, ws)})["kiln"]
  r.work = f"MLP {'-'.join(map(str, sizes))} b{batch}"
  r.ratio = r.paired("numpy")
  flops = sum(2 * batch * a * b for a, b in zip(sizes, sizes[1:]))
  r.achieved, r.limit = rate(flops / tk, "GFLOP/s", bench.peak or None), f"{bench.peak / GB:.0f} GFLOP/s FMA" if bench.peak else "-"
  r.target, r.target_kind, r.target_value = "<= numpy's time", "ratio", 1.0
  r.note = f"scripts/demo's forward plan ({len(plan.kernels)} kernels)"
  mem.work, mem.kiln = "MLP plan peak buffer memory", float(plan.memory_bytes)
  mem.achieved, mem.limit, mem.target = f"{plan.memory_bytes_without_reuse / MB:.2f} MB w/o reuse", "-", "(report)"
  mem.numpy = float(sum(w.nbytes for w in ws) + x.nbytes + 2 * batch * sizes[-1] * 4 + sum(batch * s * 4 for s in sizes[1:]))
  mem.note = "numpy column: weights + input + every intermediate of numpy_forward"

def run(bench: Bench) -> None:
  """The kernel rows, in the order they print."""
  bench.row("16M float32 add (out given)", functools.partial(vec_add, bench), "ms")
  bench.row(f"16M float32 add (out given){USER}", functools.partial(vec_add, bench, user=True), "ms")
  bench.row("16M float32 sum", functools.partial(vec_sum, bench), "ms")
  bench.row(f"16M float32 sum{USER}", functools.partial(vec_sum, bench, user=True), "ms")
  for n0 in (256, 1000, 1024, 2048): bench.row(f"matmul {n0}", functools.partial(matmul, bench, n0=n0, gated=n0 == 1024), "ms")
  bench.row("dispatch: 100-kernel plan", functools.partial(dispatch_chain, bench), "us")
  bench.row("dispatch: 1-kernel execute()", functools.partial(dispatch_one, bench), "us")
  bench.row("compile: cold, no disk cache", functools.partial(compile_cold, bench), "ms")
  bench.row("compile: memory-cache hit", functools.partial(memory_hit, bench), "us")
  bench.row("compile: disk hit, new process", functools.partial(disk_hit, bench), "ms")
  if bench.wanted("MLP pass"):
    mem = Row("MLP plan peak buffer memory", "MB")
    bench.row("MLP pass", functools.partial(mlp, bench, mem=mem), "ms")
    if mem.kiln is None: mem.status, mem.note = "ERROR", "the MLP plan was not built"
    else: mem.status = "-"
    bench.rows.append(mem)
