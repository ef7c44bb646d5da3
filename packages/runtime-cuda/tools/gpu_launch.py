"""Launch overhead of a CUDA plan on a real GPU (kiln issue 16): 200 tiny dependent elementwise kernels in one ExecutionPlan.

  python gpu_launch.py            prints one JSON object (see launch_overhead)

Needs a CUDA GPU and pycuda (or KILN_CUDA_DRIVER=cuda-python). torch is used only to synchronize the device when it is
importable (the runtime's own synchronize otherwise) and, when present, for an eager-torch chain of the same ops to compare
the host's speed with."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

KERNELS, SIZE = 200, 256


def chain_plan(device: str = "CUDA", kernels_n: int = KERNELS, size: int = SIZE, graphs: bool | None = None) -> tuple[Any, Any]:
  """(plan, output Buffer): kernels_n dependent `v + 1` kernels over two ping-pong float32 buffers of `size` elements (the
  plan gpu_bench.py's launch row times). graphs=False builds it with CUDA graphs off (KILN_CUDA_GRAPHS=0 while it is
  built), True with them on, None as the environment says."""
  if graphs is not None:
    old = os.environ.get("KILN_CUDA_GRAPHS")
    os.environ["KILN_CUDA_GRAPHS"] = "1" if graphs else "0"
    try: return chain_plan(device, kernels_n, size, None)
    finally:
      if old is None: os.environ.pop("KILN_CUDA_GRAPHS", None)
      else: os.environ["KILN_CUDA_GRAPHS"] = old
  import numpy as np

  from kiln.executor import Buffer, ExecutionPlanBuilder
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  b = ExecutionPlanBuilder(device)
  bufs = [b.add_buffer(Buffer(device, size, dtypes.float32)) for _ in range(2)]
  inc = kernels.elementwise(lambda v: v + 1.0, dtypes.float32, ((size,), dtypes.float32), name="inc")
  for i in range(kernels_n): b.add_kernel(inc, [bufs[(i + 1) % 2], bufs[i % 2]])
  b.set_outputs([bufs[kernels_n % 2]])
  plan = b.build()
  b.buffers[bufs[0]].copyin(np.zeros(size, np.float32))
  return plan, b.buffers[bufs[kernels_n % 2]]


def _interleaved(cases: dict[str, tuple[Callable[[], Any], int, bool]], sync: Callable[[], Any], rounds: int, per: int) -> dict[str, float]:
  """Median over rounds of seconds per `per` units of each case's fn, the cases taking turns in each round (so drift in the
  host's speed hits them alike). A case is (fn, batch, synced): a round times `batch` calls after a device sync; with
  synced the clock stops after another sync (wall time), without it right after the calls (the host's time)."""
  times: dict[str, list[float]] = {k: [] for k in cases}
  for _ in range(rounds):
    for name, (fn, batch, synced) in cases.items():
      sync()
      t0 = time.perf_counter()
      for _ in range(batch): fn()
      if synced: sync()
      times[name].append((time.perf_counter() - t0) / (batch * per))
  sync()
  return {k: statistics.median(v) for k, v in times.items()}


def launch_overhead(kernels_n: int = KERNELS, size: int = SIZE, batch: int = 20, rounds: int = 15) -> dict:
  """Per-kernel times of a kernels_n-kernel plan, in microseconds:
    wall_us       plan.execute() `batch` times between two device syncs, per kernel, the plan built with CUDA graphs off
                  (KILN_CUDA_GRAPHS=0: one launch per kernel; what issue 16 measured: 8.11 us, target 5)
    host_us       one plan.execute() right after a sync, no sync before the clock stops: the host's cost per launch (graphs off)
    graph_wall_us, graph_host_us   the same with the plan built with CUDA graphs on (one cuGraphLaunch per execute)
    launch_us     pycuda's Function._launch_kernel alone, the same bound launch repeated inside one current context (the floor)
    guarded_us    the bound call's own __call__ (context check, push/pop when not current) per launch, outside any context
    torch_us      eager torch `y = y + 1` per op on the same host, when torch is importable (wall, synced like wall_us)
  plus the output checks (every element equals kernels_n after one run from zeros: output_ok with graphs off,
  graph_output_ok with them on), graph_launches (graph launches the graph plan made: 0 means it fell back to plain
  launches) and the device's name."""
  import numpy as np

  from kiln.codegen import registry
  plan, out = chain_plan("CUDA", kernels_n, size, graphs=False)
  gplan, gout = chain_plan("CUDA", kernels_n, size, graphs=True)
  rt = registry.get_runtime("CUDA")
  try:
    import torch
    has_torch = bool(torch.cuda.is_available())
  except ImportError: has_torch = False
  sync: Callable[[], Any] = torch.cuda.synchronize if has_torch else rt.synchronize  # type: ignore[possibly-undefined]
  oks = []
  for p, o in ((plan, out), (gplan, gout)):
    p.execute()
    rt.synchronize()
    oks.append(bool(np.all(o.numpy() == float(kernels_n))))
    for _ in range(3): p.execute()  # warm
  sync()
  res: dict[str, Any] = {"device": _device_name(rt), "kernels": kernels_n, "size": size, "output_ok": oks[0], "graph_output_ok": oks[1]}
  bound = plan.kernels[0].bound
  fn, grid, block, arg = bound.prog.fn, bound.grid, bound.block, bound.arg_buf

  def raw() -> None:
    with rt.current():
      for _ in range(kernels_n): fn._launch_kernel(grid, block, arg, 0, None)

  def guarded() -> None:
    for _ in range(kernels_n): bound()
  cases: dict[str, tuple[Callable[[], Any], int, bool]] = {
    "wall_us": (plan.execute, batch, True), "host_us": (plan.execute, 1, False), "graph_wall_us": (gplan.execute, batch, True),
    "graph_host_us": (gplan.execute, 1, False), "launch_us": (raw, 1, False), "guarded_us": (guarded, 1, False)}
  if has_torch:
    x = torch.zeros(size, device="cuda")

    def torch_chain() -> None:
      y = x
      for _ in range(kernels_n): y = y + 1.0
    torch_chain()
    cases["torch_us"] = (torch_chain, batch, True)
  res.update({k: v * 1e6 for k, v in _interleaved(cases, sync, rounds, kernels_n).items()})
  res["graph_launches"] = sum(getattr(f, "launches", 0) for _, run in gplan._runs for f in run)
  return res


def _device_name(rt: Any) -> str:
  try: return f"{rt.dev.name()} ({rt.arch})"
  except Exception: return rt.device  # a stand-in driver


if __name__ == "__main__":
  r = launch_overhead()
  print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
  sys.exit(0 if r["output_ok"] and r["graph_output_ok"] else 1)
