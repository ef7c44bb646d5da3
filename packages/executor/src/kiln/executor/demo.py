"""The main job: an MLP inference pass (784-512-512-10, batch 256) end to end on the CPU.

Weights are saved to one .npy file, mapped back read-only through DISK buffers (views into the one file), copied to
CPU buffers by a load plan, then the forward pass (three fused matmul+bias(+ReLU) kernels and a softmax built from
max and sum reductions) runs as one ExecutionPlan many times. Prints the plan, a per-kernel profile, kiln's time per
pass beside numpy's, the largest difference from numpy, and where every kernel came from (compiled or cache).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kiln.codegen import settings
from kiln.executor.buffer import Buffer
from kiln.executor.builder import ExecutionPlanBuilder
from kiln.executor.execution import ExecutionPlan
from kiln.ir import AxisType, Ops, UOp, dtypes

F32 = dtypes.float32


def linear_kernel(m: int, k: int, n: int, relu: bool, name: str) -> UOp:
  """out[m, n] = x[m, k] @ w[k, n] + b[n], then ReLU: slots out, x, w, b."""
  out, x = UOp.define_global(0, F32.ptr(m * n)), UOp.define_global(1, F32.ptr(m * k))
  w, b = UOp.define_global(2, F32.ptr(k * n)), UOp.define_global(3, F32.ptr(n))
  i, j, r = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  y = (x.index(i * k + r).load() * w.index(r * n + j).load()).reduce(Ops.ADD, r) + b.index(j).load()
  return UOp.sink(out.index(i * n + j).store(y.maximum(0.0) if relu else y), name=name)


def row_reduce_kernel(m: int, n: int, op: Ops, name: str) -> UOp:
  """out[m] = reduce_op over x[m, n]: slots out, x."""
  out, x = UOp.define_global(0, F32.ptr(m)), UOp.define_global(1, F32.ptr(m * n))
  i, j = UOp.range(m, 0), UOp.range(n, 1, AxisType.REDUCE)
  return UOp.sink(out.index(i).store(x.index(i * n + j).load().reduce(op, j)), name=name)


def exp_sub_kernel(m: int, n: int) -> UOp:
  """e[m, n] = exp(x[m, n] - mx[m]): slots e, x, mx."""
  e, x, mx = UOp.define_global(0, F32.ptr(m * n)), UOp.define_global(1, F32.ptr(m * n)), UOp.define_global(2, F32.ptr(m))
  i, j = UOp.range(m, 0), UOp.range(n, 1)
  return UOp.sink(e.index(i * n + j).store(((x.index(i * n + j).load() - mx.index(i).load()) * (1 / math.log(2))).exp2()), name="softmax_exp")


def div_kernel(m: int, n: int) -> UOp:
  """p[m, n] = e[m, n] / s[m]: slots p, e, s."""
  p, e, s = UOp.define_global(0, F32.ptr(m * n)), UOp.define_global(1, F32.ptr(m * n)), UOp.define_global(2, F32.ptr(m))
  i, j = UOp.range(m, 0), UOp.range(n, 1)
  return UOp.sink(p.index(i * n + j).store(e.index(i * n + j).load() / s.index(i).load()), name="softmax_div")


def make_weights(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  ws: list[np.ndarray] = []
  for a, b in zip(sizes, sizes[1:]):
    ws += [(rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32), (rng.standard_normal(b) * 0.1).astype(np.float32)]
  return ws


def numpy_forward(x: np.ndarray, ws: list[np.ndarray]) -> np.ndarray:
  h = x
  for li in range(0, len(ws), 2):
    h = h @ ws[li] + ws[li + 1]
    if li + 2 < len(ws): h = np.maximum(h, 0)
  e = np.exp(h - h.max(axis=1, keepdims=True))
  return e / e.sum(axis=1, keepdims=True)


def build(x: np.ndarray, weight_file: Path, ws: list[np.ndarray], sizes: list[int]) -> tuple[ExecutionPlan, Buffer]:
  """Map the weights through DISK, copy them to the CPU with a load plan, and build the forward plan."""
  batch = x.shape[0]
  disk = Buffer.from_npy(weight_file)  # one read-only mapping of the whole file
  load = ExecutionPlanBuilder("CPU")
  dsrc, cpu_w, off = load.add_buffer(disk), [], 0
  for w in ws:
    view = load.add_buffer(disk.view(off * w.itemsize, w.size))  # byte offset
    dst = Buffer("CPU", w.size, F32)
    cpu_w.append(dst)
    load.add_copy(load.add_buffer(dst), view)
    off += w.size
  del dsrc
  load.set_outputs(list(range(1, len(load.buffers))))
  load.build().execute()

  b = ExecutionPlanBuilder("CPU")
  xb = b.add_buffer(Buffer.from_numpy(x))
  wi = [b.add_buffer(w) for w in cpu_w]
  h = xb
  for li, (din, dout) in enumerate(zip(sizes, sizes[1:])):
    last = li == len(sizes) - 2
    out = b.add_buffer(Buffer("CPU", batch * dout, F32))
    b.add_kernel(linear_kernel(batch, din, dout, relu=not last, name=f"linear{li}" + ("" if last else "_relu")), [out, h, wi[2 * li], wi[2 * li + 1]])
    h = out
  n = sizes[-1]
  mx, e, s, p = (b.add_buffer(Buffer("CPU", sz, F32)) for sz in (batch, batch * n, batch, batch * n))
  b.add_kernel(row_reduce_kernel(batch, n, Ops.MAX, "softmax_max"), [mx, h])
  b.add_kernel(exp_sub_kernel(batch, n), [e, h, mx])
  b.add_kernel(row_reduce_kernel(batch, n, Ops.ADD, "softmax_sum"), [s, e])
  b.add_kernel(div_kernel(batch, n), [p, e, s])
  b.set_outputs([p])
  plan = b.build()
  return plan, plan.output_buffer(0)


def median_time(fn, runs: int) -> float:  # type: ignore[no-untyped-def]
  fn()
  ts = []
  for _ in range(runs):
    st = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - st)
  return float(np.median(ts))


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="kiln demo", description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--sizes", type=str, default="784,512,512,10", help="layer widths, comma separated")
  ap.add_argument("--runs", type=int, default=50, help="timed passes")
  ap.add_argument("--dir", type=str, default=None, help="where the weight file goes (default: a temporary directory)")
  args = ap.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",")]
  ws = make_weights(sizes)
  x = np.random.default_rng(1).standard_normal((args.batch, sizes[0])).astype(np.float32)
  with tempfile.TemporaryDirectory() as tmp:
    wdir = Path(args.dir) if args.dir else Path(tmp)
    wdir.mkdir(parents=True, exist_ok=True)
    wfile = wdir / "mlp_weights.npy"
    np.save(wfile, np.concatenate([w.ravel() for w in ws]))
    mb = wfile.stat().st_size / 1e6
    print(f"kiln demo: MLP {'-'.join(map(str, sizes))}, batch {args.batch}; weights in {wfile} ({mb:.2f} MB, read through DISK)")
    t0 = time.perf_counter()
    plan, out = build(x, wfile, ws, sizes)
    print(f"plan built in {(time.perf_counter() - t0) * 1e3:.1f} ms\n")
    print(plan.describe())
    plan.execute()
    got = out.numpy().reshape(args.batch, sizes[-1]).copy()
  ref = numpy_forward(x, ws)
  err = float(np.abs(got - ref).max())
  prof = plan.execute_profiled()
  print("\nper-kernel profile (one pass):")
  print(prof.table())
  t_kiln = median_time(plan.execute, args.runs)
  t_np = median_time(lambda: numpy_forward(x, ws), args.runs)
  flops = sum(2 * args.batch * a * b for a, b in zip(sizes, sizes[1:]))
  print(f"\nper pass (median of {args.runs}): kiln {t_kiln * 1e3:.3f} ms ({flops / t_kiln * 1e-9:.1f} GFLOP/s), "
        f"numpy {t_np * 1e3:.3f} ms ({flops / t_np * 1e-9:.1f} GFLOP/s); kiln/numpy speed {t_np / t_kiln:.2f}x")
  print(f"largest difference from numpy: {err:.3e}")
  origins = [k.origin for k in plan.kernels]
  counts = {o: origins.count(o) for o in ("compiled", "disk", "memory")}
  print(f"kernels: {counts['compiled']} compiled, {counts['disk']} from the disk cache, {counts['memory']} from the memory cache"
        + (" - every kernel came from the cache" if counts["compiled"] == 0 else ""))
  if settings.CACHE.get() and counts["compiled"]: print("(run it again: every kernel then comes from the disk cache)")
  ok = err < 1e-4
  print("result: OK" if ok else "result: MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
