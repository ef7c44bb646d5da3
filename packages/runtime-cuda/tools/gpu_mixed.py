"""A plan across devices on a real NVIDIA GPU (kiln issue 16): CPU matmul -> copy to CUDA -> CUDA relu -> copy back -> CPU
add, on random data, against numpy. Needs pycuda, an NVIDIA driver and a GPU; nothing here runs without one.

  python gpu_mixed.py        prints "ok ..." or raises

It also checks that a host function reading the CUDA output after the relu sees its result, and prints the plan's host
waits: the only one should be before that function (the copies order the other hand-overs, with no host wait)."""
from __future__ import annotations

import time

import numpy as np


def mixed_plan_check(m: int = 256, k: int = 512, n: int = 384, runs: int = 3, seed: int = 0) -> str:
  import pycuda.driver  # noqa: F401  (only on a GPU machine: fail here, plainly, without one)

  from kiln.executor import Buffer, ExecutionPlanBuilder
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  f32 = dtypes.float32
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  r = rng.standard_normal(m * n).astype(np.float32)
  b = ExecutionPlanBuilder("CPU")
  ba, bw, br = (b.add_buffer(Buffer.from_numpy(x)) for x in (a, w, r))
  h, g, y = (b.add_buffer(Buffer("CPU", m * n, f32)) for _ in range(3))
  dh, dg = (b.add_buffer(Buffer("CUDA:0", m * n, f32)) for _ in range(2))
  mm = b.add_kernel(kernels.matmul(m, n, k), [h, ba, bw])
  b.add_copy(dh, h)
  relu = b.add_kernel(kernels.elementwise(lambda v: v.maximum(0.0), f32, ((m * n,), f32), name="relu"), [dg, dh])
  seen: list[np.ndarray] = []
  b.add_custom(lambda buf: seen.append(buf.numpy().copy()), [dg], outputs=[])
  b.add_copy(g, dg)
  add = b.add_kernel(kernels.elementwise(lambda p, q: p + q, f32, ((m * n,), f32), ((m * n,), f32), name="add"), [y, g, br])
  b.set_outputs([y])
  plan = b.build()
  ops = {p.id: p for p in plan.prepared_ops}
  devices = [str(ops[i].device) for i in (mm, relu, add)]
  if devices != ["CPU", "CUDA:0", "CPU"]: raise AssertionError(f"kernels ran on {devices}")
  times = []
  for i in range(runs):
    a2 = rng.standard_normal((m, k)).astype(np.float32)
    plan.buffers[ba].copyin(a2)
    seen.clear()
    t0 = time.perf_counter()
    plan.execute()
    times.append(time.perf_counter() - t0)
    want_relu = np.maximum(a2.astype(np.float64) @ w.astype(np.float64), 0).reshape(-1)
    got = plan.output_buffer(0).numpy()
    err = float(np.max(np.abs(got - (want_relu + r))))
    if not np.allclose(got, want_relu + r, rtol=1e-3, atol=1e-3): raise AssertionError(f"run {i}: max abs error {err:.3g} against numpy")
    if not np.allclose(seen[0], want_relu, rtol=1e-3, atol=1e-3): raise AssertionError(f"run {i}: the host function read a stale relu")
  waits = {p.id: p.waits for p in plan.prepared_ops if getattr(p, "waits", None)}
  if list(waits.values()) != [["CUDA:0"]]: raise AssertionError(f"host waits {waits}: expected one, before the host function")
  msg = (f"ok mixed plan CPU matmul {m}x{k}x{n} -> CUDA relu -> CPU add: {runs} runs match numpy (max abs error {err:.2g}); "
         f"host waits {waits}; best run {min(times) * 1e3:.2f} ms")
  print(msg, flush=True)
  return msg


if __name__ == "__main__":
  mixed_plan_check()
