"""kiln against torch on one NVIDIA GPU (gpu_check.py bench; needs torch there, never in kiln's own environments).

Each row builds a kiln plan on CUDA with random inputs, checks it against torch (relative error in float64), then times
kiln and torch in interleaved rounds (median of rounds; each round syncs the device before and after a batch of calls).
Ceilings measured first: device-to-device copy bandwidth (bytes read + written) and torch's matmul rate."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.executor import Buffer, ExecutionPlanBuilder
from kiln.ir import kernels
from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import Ops

ROUNDS, TARGET_S = 7, 0.05
_NP = {"float32": np.float32, "float16": np.float16}
_TORCH = {"float32": torch.float32, "float16": torch.float16}


def sync() -> None: torch.cuda.synchronize()


def per_call(fn: Callable[[], Any], n: int) -> float:
  sync()
  t0 = time.perf_counter()
  for _ in range(n): fn()
  sync()
  return (time.perf_counter() - t0) / n


def interleaved(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
  """Median seconds per call of each, timed in alternating rounds after a warm-up that sizes each round."""
  reps = {}
  for k, f in fns.items():
    f(); f()
    t = per_call(f, 3)
    reps[k] = max(3, min(2000, int(TARGET_S / max(t, 1e-7))))
  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(ROUNDS):
    for k, f in fns.items(): times[k].append(per_call(f, reps[k]))
  return {k: statistics.median(v) for k, v in times.items()}


class KilnRun:
  """One kernel as a plan on CUDA: buffers in slot order (slot 0 the output), inputs copied in once."""

  def __init__(self, ast: Any, dtype: DType, shapes: list[tuple[int, ...]], inputs: list[np.ndarray]):
    b = ExecutionPlanBuilder("CUDA")
    ids = [b.add_buffer(Buffer("CUDA", int(np.prod(s)), dtype)) for s in shapes]
    b.add_kernel(ast, ids)
    b.set_outputs([ids[0]])
    self.plan = b.build()
    for i, x in zip(ids[1:], inputs): b.buffers[i].copyin(x)
    self.out, self.shape = b.buffers[ids[0]], shapes[0]

  def __call__(self) -> None: self.plan.execute()

  def result(self) -> np.ndarray:
    self.plan.execute()
    return self.out.numpy().reshape(self.shape)


def rel_err(got: np.ndarray, want: Any) -> float:
  w = want.double().cpu().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, np.float64)
  g = got.astype(np.float64)
  if not np.isfinite(g).all(): return float("inf")
  return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


ROWS: list[dict] = []


def row(name: str, kiln: KilnRun, torch_fn: Callable[[], Any], ref: Any, tol: float, work: float, unit: str) -> None:
  err = rel_err(kiln.result(), ref)
  t = interleaved({"kiln": kiln, "torch": torch_fn})
  alone = per_call(kiln, max(3, int(TARGET_S / max(t["kiln"], 1e-7))))  # kiln's rounds with no torch before them: clocks
  rate = {k: work / v / 1e9 for k, v in t.items()}
  r = {"row": name, "kiln_us": t["kiln"] * 1e6, "torch_us": t["torch"] * 1e6, "ratio": t["torch"] / t["kiln"],
       f"kiln_{unit}": rate["kiln"], f"torch_{unit}": rate["torch"], "rel_err": err, "ok": err <= tol, "kiln_alone_us": alone * 1e6}
  ROWS.append(r)
  print(f"{name:34s} kiln {t['kiln'] * 1e6:10.1f} us ({rate['kiln']:8.1f} {unit})  torch {t['torch'] * 1e6:10.1f} us"
        f" ({rate['torch']:8.1f} {unit})  torch/kiln {r['ratio']:5.2f}x  err {err:.1e}  (kiln alone {alone * 1e6:.1f} us)"
        f"{'' if r['ok'] else '  WRONG'}", flush=True)


def main(argv: list[str]) -> None:
  only = argv[0] if argv else ""
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  rng = np.random.default_rng(0)
  dev = torch.device("cuda")
  print(f"== bench on {torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)

  n = 1 << 26
  src = torch.randn(n, device=dev)
  dst = torch.empty_like(src)
  t = interleaved({"copy": lambda: dst.copy_(src)})["copy"]
  copy_bw = 2 * 4 * n / t / 1e9
  print(f"device copy: {copy_bw:.0f} GB/s (bytes read + written, 256 MiB)", flush=True)

  if "add" in only or not only:
    a, b = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
    k = KilnRun(kernels.elementwise(lambda x, y: x + y, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32), name="add"),
                dtypes.float32, [(n,), (n,), (n,)], [a, b])
    row("add 64M f32", k, lambda: torch.add(ta, tb), ta.double() + tb.double(), 1e-6, 12 * n, "GB/s")
    print(f"  add at {ROWS[-1]['kiln_GB/s'] / copy_bw:.0%} of copy bandwidth (target 85%)")
    k = KilnRun(kernels.reduce(Ops.ADD, (n,), dtypes.float32), dtypes.float32, [(1,), (n,)], [a])
    row("sum 64M f32", k, lambda: ta.sum(), ta.double().sum().reshape(1), 1e-5, 4 * n, "GB/s")
  for rows, cols in ((8192, 1024), (65536, 128), (4096, 4096)):
    if only and "soft" not in only and "row" not in only: break
    x = rng.standard_normal((rows, cols), np.float32)
    tx = torch.from_numpy(x).to(dev)
    k = KilnRun(kernels.reduce(Ops.ADD, (rows, cols), dtypes.float32, axes=1), dtypes.float32, [(rows,), (rows, cols)], [x])
    row(f"row sum {rows}x{cols}", k, lambda tx=tx: tx.sum(1), tx.double().sum(1), 1e-5, 4 * rows * cols, "GB/s")
    k = KilnRun(kernels.softmax((rows, cols), dtypes.float32), dtypes.float32, [(rows, cols), (rows, cols)], [x])
    row(f"softmax {rows}x{cols}", k, lambda tx=tx: torch.softmax(tx, -1), torch.softmax(tx.double(), -1), 1e-5, 8 * rows * cols, "GB/s")
  for dt, acc in (("float32", dtypes.float32), ("float16", dtypes.float32)):
    for s in (1024, 2048, 4096):
      if only and "mm" not in only: break
      a = rng.standard_normal((s, s)).astype(_NP[dt])
      b = rng.standard_normal((s, s)).astype(_NP[dt])
      ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
      kdt = getattr(dtypes, dt)
      k = KilnRun(kernels.matmul(s, s, s, kdt, acc_dtype=acc), kdt, [(s, s), (s, s), (s, s)], [a, b])
      row(f"matmul {s} {dt}", k, lambda ta=ta, tb=tb: ta @ tb, ta.double() @ tb.double(), 1e-5 if dt == "float32" else 2e-3, 2 * s ** 3, "GFLOP/s")

  if not only or "mm" in only:  # opt-in TF32 on both sides (kiln: KILN_CUDA_TF32=1; torch: allow_tf32)
    s = 4096
    a, b = rng.standard_normal((s, s)).astype(np.float32), rng.standard_normal((s, s)).astype(np.float32)
    ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
    os.environ["KILN_CUDA_TF32"] = "1"
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
      k = KilnRun(kernels.matmul(s, s, s), dtypes.float32, [(s, s), (s, s), (s, s)], [a, b])
      row(f"matmul {s} tf32", k, lambda: ta @ tb, ta.double() @ tb.double(), 2e-3, 2 * s ** 3, "GFLOP/s")
    finally:
      os.environ.pop("KILN_CUDA_TF32", None)
      torch.backends.cuda.matmul.allow_tf32 = False

  if not only or "launch" in only:  # launch overhead per kernel in a plan: 200 tiny dependent kernels
    b = ExecutionPlanBuilder("CUDA")
    bufs = [b.add_buffer(Buffer("CUDA", 256, dtypes.float32)) for _ in range(2)]
    for i in range(200):
      b.add_kernel(kernels.elementwise(lambda v: v + 1.0, dtypes.float32, ((256,), dtypes.float32), name="inc"), [bufs[(i + 1) % 2], bufs[i % 2]])
    b.set_outputs([bufs[0]])
    plan = b.build()
    b.buffers[bufs[0]].copyin(np.zeros(256, np.float32))
    x = torch.zeros(256, device=dev)
    def torch_chain() -> None:
      y = x
      for _ in range(200): y = y + 1.0
    t = interleaved({"kiln": plan.execute, "torch": torch_chain})
    print(f"launch overhead: kiln {t['kiln'] / 200 * 1e6:.2f} us per kernel in a 200-kernel plan, torch eager {t['torch'] / 200 * 1e6:.2f} us"
          " per op (target 5 us)", flush=True)
    ROWS.append({"row": "launch per kernel", "kiln_us": t["kiln"] / 200 * 1e6, "torch_us": t["torch"] / 200 * 1e6})
  if (out := os.environ.get("OUT")):
    with open(os.path.join(out, "gpu_bench.json"), "w") as f: json.dump({"copy_GBps": copy_bw, "rows": ROWS}, f, indent=1)


if __name__ == "__main__": main(sys.argv[1:])
