"""ONNX models on kiln's CUDA runtime against torch on the same GPU (issue 40; scripts/gpu-models runs it there). Needs torch
and onnx: never in kiln's own environments.

  python gpu_models.py [--models resnet50,bert] [--batches 1,32] [--dtypes float32,float16] [--budget SECONDS]
                       [--torch-compile] [--dynamic] [--sanitize-dir DIR] [--small] [--kiln-device CUDA] [--torch-device cuda] [--emulate]
  python gpu_models.py --check-dir DIR      (what compute-sanitizer runs: the small models saved in DIR, on kiln only)

ResNet-50 and a BERT-base-shaped encoder (12 layers, hidden 768, 12 heads, seq 128) are written in plain torch
(gpu_torch_models.py) with random weights, exported with torch.onnx.export(dynamo=False) once each (a named batch dim), and
loaded with kiln.graph.onnx.load(path, device="CUDA", dims={"batch": n}) for each batch. A row: the load (read, schedule,
compile: nvcc side by side, weights uploaded), kiln's device time (plan.execute between device syncs, the input already
there), kiln's run() (copy in, execute, copy out), torch eager's device time, torch.compile's where asked and the budget
allows, and kiln's largest error against torch eager (float32: TF32 off on both sides). float16 rows export the model in
half precision. --dynamic: after a model's rows, its export loaded once with dims={"batch": (smallest, largest)} and
run at every batch from that one plan (rows with "dynamic"). Every step is guarded: a failure prints FAIL with its
traceback and the next step runs; steps that would start past --budget seconds are skipped and say so. Rows go to
$OUT/gpu_models.json when OUT is set.

--sanitize-dir DIR: small twins of both models exported into DIR with an input and torch's output each, run once here on
kiln (their kernels then sit in kiln's disk cache) for --check-dir to run again under compute-sanitizer.
--small: the small twins instead of the full models (a dry run). --emulate: kiln's CUDA runs on the CPU emulation (the
checkout's tests/cuda_emu.py; a dry run without a GPU, torch on the CPU)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_torch_models as tm  # noqa: E402

ROWS: list[dict[str, Any]] = []
FAILS: list[str] = []
T0 = time.perf_counter()
SMALL = {"resnet50": {"layers": (1, 1, 1, 1), "width": 16, "classes": 10, "image": 64},
         "bert": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq": 16}}
FULL = {"resnet50": {"image": 224}, "bert": {"seq": 128, "vocab": 30522}}


def step(name: str, fn: Callable[[], Any]) -> Any:
  """fn(), or None after printing FAIL and its traceback (the script goes on)."""
  t = time.perf_counter()
  try:
    out = fn()
    print(f"ok    {name} ({time.perf_counter() - t:.1f} s)", flush=True)
    return out
  except BaseException as e:  # a step's failure is reported, the others still run
    if isinstance(e, KeyboardInterrupt): raise
    FAILS.append(name)
    print(f"FAIL  {name} ({time.perf_counter() - t:.1f} s): {type(e).__name__}: {str(e)[:1500]}\n{traceback.format_exc(limit=6)}", flush=True)
    return None


def left(budget: float) -> float: return budget - (time.perf_counter() - T0)


class Sync:
  def __init__(self, torch: Any, dev: str): self.torch, self.dev = torch, dev
  def __call__(self) -> None:
    if self.dev.startswith("cuda"): self.torch.cuda.synchronize()


def per_call(fn: Callable[[], Any], sync: Sync, target_s: float = 0.25, rounds: int = 5) -> float:
  """Median seconds per call over `rounds` rounds of about target_s each (after two warm-up calls), synced around each round."""
  fn(); fn()
  sync()
  t = time.perf_counter()
  fn()
  sync()
  one = time.perf_counter() - t
  reps = max(1, min(200, int(target_s / max(one, 1e-6))))
  times: list[float] = []
  start = time.perf_counter()
  for _ in range(rounds if one < 1 else 2):  # a slow call (a second or more) is timed twice, not five times
    if times and time.perf_counter() - start > 4 * target_s * rounds: break  # calls much slower than the first: enough
    sync()
    t = time.perf_counter()
    for _ in range(reps): fn()
    sync()
    times.append((time.perf_counter() - t) / reps)
  return statistics.median(times)


def build(torch: Any, model: str, small: bool) -> tuple[Any, dict[str, Any]]:
  cfg = dict(SMALL[model] if small else FULL[model])
  if model == "resnet50":
    m = tm.resnet(torch, **{k: cfg[k] for k in ("layers", "width", "classes") if k in cfg})
  else:
    m = tm.bert(torch, **{k: cfg[k] for k in ("layers", "hidden", "heads", "vocab") if k in cfg})
  return m, cfg


def example(torch: Any, model: str, cfg: dict[str, Any], batch: int) -> Any:
  if model == "resnet50": return tm.example(torch, "resnet", batch, image=cfg["image"])
  return tm.example(torch, "bert", batch, seq=cfg["seq"], vocab=cfg["vocab"])


def _err(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
  g, w = got.astype(np.float64), want.astype(np.float64)
  if g.shape != w.shape: raise AssertionError(f"kiln's output has shape {g.shape}, torch's {w.shape}")
  if not np.isfinite(g).all(): return float("inf"), float("inf")
  d = float(np.abs(g - w).max())
  return d, d / max(float(np.abs(w).max()), 1e-30)


def model_rows(torch: Any, konnx: Any, args: argparse.Namespace, model: str, dtype: str, sync: Sync, compiled: dict) -> None:
  """Export `model` once, then a row per batch (batch_row)."""
  dev, tdt = args.torch_device, getattr(torch, dtype)
  m, cfg = build(torch, model, args.small)
  m = m.to(dev).to(tdt)
  path = os.path.join(args.work, f"{model}-{dtype}{'-small' if args.small else ''}.onnx")
  x0 = example(torch, model, cfg, 1)
  x0 = x0.to(dev).to(tdt) if x0.is_floating_point() else x0.to(dev)
  t = time.perf_counter()
  if step(f"{model} {dtype}: export to ONNX", lambda: tm.export(torch, m, x0, path) or path) is None: return
  export_s = time.perf_counter() - t
  for batch in args.batch_list:
    if left(args.budget) < 20:
      print(f"skip  {model} {dtype} batch {batch}: {left(args.budget):.0f} s of the budget left", flush=True)
      continue
    x = example(torch, model, cfg, batch)
    r = batch_row(torch, konnx, args, m, x.to(tdt) if x.is_floating_point() else x, path, sync)
    r.update(model=model, dtype=dtype, batch=batch, export_s=export_s, small=args.small)
    compiled.setdefault(model, []).append((r, m, x.to(tdt).to(dev) if x.is_floating_point() else x.to(dev)))
  if args.dynamic and len(args.batch_list) > 1 and left(args.budget) >= 20:
    step(f"{model} {dtype}: one plan for batches {min(args.batch_list)}-{max(args.batch_list)}",
         lambda: dynamic_rows(torch, konnx, args, m, model, dtype, cfg, path, sync))


def dynamic_rows(torch: Any, konnx: Any, args: argparse.Namespace, m: Any, model: str, dtype: str, cfg: dict[str, Any], path: str,
                 sync: Sync) -> None:
  """The same export loaded once for every batch from the smallest to the largest asked (dims={"batch": (lo, hi)}: a
  symbolic batch, tiled products over it), then a row per batch from that one plan: kiln vs torch, device time, run()."""
  lo, hi = min(args.batch_list), max(args.batch_list)
  t = time.perf_counter()
  km = konnx.load(path, device=args.kiln_device, dims={"batch": (lo, hi)})
  load_s = time.perf_counter() - t
  tiled = _tiled(km)
  for batch in args.batch_list:
    name = f"{os.path.basename(path)[:-5]} batches {lo}-{hi} at {batch}"
    r: dict[str, Any] = {"model": model, "dtype": dtype, "batch": batch, "dynamic": [lo, hi], "load_s": load_s, "tiled": tiled, "small": args.small}
    ROWS.append(r)
    x = example(torch, model, cfg, batch)
    x = x.to(getattr(torch, dtype)) if x.is_floating_point() else x
    feed = {"x": x.cpu().numpy()}
    with torch.no_grad(): want = m(x.to(args.torch_device)).float().cpu().numpy()
    kiln_steps(km, feed, want, r, name, sync)  # the device time at this batch: its variable stays as the check's run set it
    nan = float("nan")
    print(f"row   {name}: load {load_s:.1f} s ({tiled} tiled matmuls), kiln {r.get('kiln_ms', nan):.2f} ms (run() "
          f"{r.get('kiln_run_ms', nan):.2f} ms), err {r.get('max_rel_err', nan):.1e}", flush=True)


def _tiled(km: Any) -> int:
  """How many of a loaded model's kernels are tiled matrix products."""
  return sum(1 for p in km.plan.prepared_ops if str(getattr(getattr(p, "kernel", None), "applied_opts", [""])[:1]).startswith("['TILED"))


def kiln_steps(km: Any, feed: dict[str, np.ndarray], want: np.ndarray, r: dict[str, Any], name: str, sync: Sync) -> None:
  """Into row r: kiln's error against torch's output `want`, its device time (plan.execute between syncs) and run()."""
  def check() -> str:
    r["max_abs_err"], r["max_rel_err"] = _err(np.asarray(km.run(feed)["y"], np.float32), want)
    return f"max |kiln - torch| {r['max_abs_err']:.2e} ({r['max_rel_err']:.2e} of max |torch|)"
  if (msg := step(f"{name}: kiln vs torch", check)) is not None: print(f"      {msg}", flush=True)
  if km.plan is not None: step(f"{name}: kiln device time", lambda: r.__setitem__("kiln_ms", 1e3 * per_call(km.plan.execute, sync)))
  step(f"{name}: kiln run()", lambda: r.__setitem__("kiln_run_ms", 1e3 * per_call(lambda: km.run(feed), sync)))


def batch_row(torch: Any, konnx: Any, args: argparse.Namespace, m: Any, x: Any, path: str, sync: Sync) -> dict[str, Any]:
  """One row (see the module docstring) of model m at input x, from the ONNX file at path; kept in ROWS."""
  from kiln.executor import cache
  batch = int(x.shape[0])
  name = f"{os.path.basename(path)[:-5]} batch {batch}"
  xd = x.to(args.torch_device)
  r: dict[str, Any] = {}
  ROWS.append(r)
  before = cache.cache_stats()["compiles"]
  t = time.perf_counter()
  km = step(f"{name}: kiln load", lambda: konnx.load(path, device=args.kiln_device, dims={"batch": batch}))
  if km is None: return r
  r["load_s"] = time.perf_counter() - t
  r["kernels"] = len(km.plan.kernels) if km.plan is not None else 0
  r["compiles"] = cache.cache_stats()["compiles"] - before
  r["tiled"] = _tiled(km)
  feed = {"x": x.cpu().numpy()}
  with torch.no_grad(): want = m(xd).float().cpu().numpy()
  kiln_steps(km, feed, want, r, name, sync)
  def eager() -> None:
    with torch.no_grad(): r["torch_eager_ms"] = 1e3 * per_call(lambda: m(xd), sync)
  step(f"{name}: torch eager", eager)
  if km.plan is not None and (top := step(f"{name}: kiln profile", lambda: profile(km, feed, name))): print(top, flush=True)
  nan = float("nan")
  print(f"row   {name}: load {r.get('load_s', 0):.1f} s ({r.get('compiles', 0)} compiles, {r.get('kernels', 0)} kernels, {r.get('tiled', 0)} tiled "
        f"matmuls), kiln {r.get('kiln_ms', nan):.2f} ms (run() {r.get('kiln_run_ms', nan):.2f} ms), torch eager "
        f"{r.get('torch_eager_ms', nan):.2f} ms, err {r.get('max_rel_err', nan):.1e}", flush=True)
  return r


def profile(km: Any, feed: dict[str, np.ndarray], name: str, top: int = 8) -> str:
  """One run kernel by kernel (each timed alone): the kernels that took longest, summed by name and tiling; the whole table
  to $OUT/profile-<name>.txt."""
  _, prof = km.run_profiled(feed)
  opts = {p.id: (p.kernel.applied_opts or ["-"])[0] for p in km.plan.prepared_ops if hasattr(p, "kernel")}
  by: dict[tuple[str, str], list[float]] = {}
  for rec in prof:
    t = by.setdefault((rec.name, opts.get(rec.op_id, "-")), [0.0, 0, 0.0])
    t[0] += rec.time; t[1] += 1; t[2] += rec.flops  # noqa: E702
  if (out := os.environ.get("OUT")):
    with open(os.path.join(out, f"profile-{name.replace(' ', '-')}.txt"), "w") as f: f.write(prof.table())
  total = max(prof.total_time, 1e-12)
  lines = [f"      kernels one by one: {total * 1e3:.2f} ms in all; the longest:"]
  for (k, o), (t, n, fl) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
    lines.append(f"        {t * 1e3:8.3f} ms {t / total:6.1%}  x{n:<3d} {fl / max(t, 1e-12) / 1e12:6.2f} TFLOP/s  {k}  {o}")
  return "\n".join(lines)


def torch_compile_rows(torch: Any, args: argparse.Namespace, compiled: dict, sync: Sync) -> None:
  """torch.compile's device time for the rows kept, largest batch first, while the budget lasts (a compile takes a minute)."""
  jobs = sorted(((r, m, x) for rows in compiled.values() for r, m, x in rows), key=lambda j: (-j[0]["batch"], j[0]["model"] != "bert"))
  cache: dict[int, Any] = {}
  for r, m, x in jobs:
    if left(args.budget) < args.compile_reserve:
      print(f"skip  torch.compile {r['model']} {r['dtype']} batch {r['batch']}: {left(args.budget):.0f} s of the budget left", flush=True)
      continue
    def one(r: dict = r, m: Any = m, x: Any = x) -> None:
      cm = cache.setdefault(id(m), torch.compile(m))
      t = time.perf_counter()
      with torch.no_grad():
        cm(x)
        sync()
        r["torch_compile_first_s"] = time.perf_counter() - t
        r["torch_compile_ms"] = 1e3 * per_call(lambda: cm(x), sync)
      print(f"      torch.compile {r['model']} {r['dtype']} batch {r['batch']}: {r['torch_compile_ms']:.2f} ms "
            f"(first call {r['torch_compile_first_s']:.0f} s)", flush=True)
    step(f"torch.compile {r['model']} {r['dtype']} batch {r['batch']}", one)


def sanitize_prep(torch: Any, konnx: Any, args: argparse.Namespace) -> None:
  """The small twins into args.sanitize_dir (model, input, torch's output), each run once on kiln here."""
  os.makedirs(args.sanitize_dir, exist_ok=True)
  for model in ("resnet50", "bert"):
    def one(model: str = model) -> str:
      m, cfg = build(torch, model, True)
      x = example(torch, model, cfg, 2)
      path = os.path.join(args.sanitize_dir, f"{model}.onnx")
      tm.export(torch, m, x[:1], path)
      with torch.no_grad(): want = m(x).numpy()
      np.savez(os.path.join(args.sanitize_dir, f"{model}.npz"), x=x.numpy(), y=want)
      got = konnx.load(path, device=args.kiln_device, dims={"batch": 2}).run({"x": x.numpy()})["y"]
      d, rel = _err(got, want)
      if rel > 1e-4: raise AssertionError(f"small {model}: max |kiln - torch| {d:.2e} ({rel:.2e} of max |torch|)")
      return f"{rel:.1e}"
    step(f"small {model} for the sanitizer: kiln vs torch (CPU)", one)


def check_dir(d: str, device: str) -> int:
  """Run every model saved by sanitize_prep on kiln and compare with torch's saved output: 0 when all match."""
  from kiln.graph import onnx as konnx
  bad = 0
  for f in sorted(os.listdir(d)):
    if not f.endswith(".onnx"): continue
    data = np.load(os.path.join(d, f[:-5] + ".npz"))
    try:
      km = konnx.load(os.path.join(d, f), device=device, dims={"batch": int(data["x"].shape[0])})
      for _ in range(2): got = km.run({"x": data["x"]})["y"]
      dd, rel = _err(got, data["y"])
      ok = rel <= 1e-4
      print(f"{'ok  ' if ok else 'FAIL'}  {f} under the sanitizer: max |kiln - torch| {dd:.2e} ({rel:.2e})", flush=True)
    except Exception:
      ok = False
      print(f"FAIL  {f}: {traceback.format_exc(limit=6)}", flush=True)
    bad += not ok
  return 1 if bad else 0


def _emulate() -> None:
  """kiln's CUDA on the CPU emulation (tests/cuda_emu.py of this checkout): a dry run of the CUDA path without a GPU."""
  import pytest
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests")
  sys.path.insert(0, root)
  from cuda_emu import driver_tests, emulating

  from kiln.codegen import registry
  mp = pytest.MonkeyPatch()
  drv = (mod := driver_tests()).make_fake_driver([], cc=(9, 0))
  emulating(drv, mp)
  mod.install_standin(mp, __import__("pathlib").Path(os.environ.get("TMPDIR", "/tmp")), drv)
  mp.setenv("KILN_CACHE", "1")
  registry.unregister_runtime("CUDA")


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="gpu_models.py")
  ap.add_argument("--models", default="resnet50,bert")
  ap.add_argument("--batches", default="1,32")
  ap.add_argument("--dtypes", default="float32")
  ap.add_argument("--budget", type=float, default=200.0, help="seconds from the start: later steps are skipped")
  ap.add_argument("--torch-compile", action="store_true", help="also time torch.compile (about a minute of compile each)")
  ap.add_argument("--dynamic", action="store_true", help="also load each export once for all the batches (a symbolic batch)")
  ap.add_argument("--compile-reserve", type=float, default=60.0, help="seconds a torch.compile row needs left to start")
  ap.add_argument("--sanitize-dir", default="")
  ap.add_argument("--check-dir", default="")
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--kiln-device", default="CUDA")
  ap.add_argument("--torch-device", default="cuda")
  ap.add_argument("--emulate", action="store_true")
  ap.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp"), help="where the exported models go")
  args = ap.parse_args(argv)
  if args.emulate: _emulate()
  if args.check_dir: return check_dir(args.check_dir, args.kiln_device)
  args.batch_list = [int(b) for b in args.batches.split(",") if b]
  import torch

  from kiln.graph import onnx as konnx
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  torch.set_grad_enabled(False)
  sync = Sync(torch, args.torch_device)
  where = torch.cuda.get_device_name() if args.torch_device.startswith("cuda") else "the CPU"
  print(f"== models on {where}: torch {torch.__version__}, kiln device {args.kiln_device}, budget {args.budget:.0f} s", flush=True)
  if args.sanitize_dir: sanitize_prep(torch, konnx, args)
  compiled: dict = {}
  for dtype in args.dtypes.split(","):
    for model in args.models.split(","):
      if left(args.budget) < 30:
        print(f"skip  {model} {dtype}: {left(args.budget):.0f} s of the budget left", flush=True)
        continue
      step(f"{model} {dtype}", lambda model=model, dtype=dtype: model_rows(torch, konnx, args, model, dtype, sync, compiled))
      if (out := os.environ.get("OUT")):
        with open(os.path.join(out, "gpu_models.json"), "w") as f: json.dump(ROWS, f, indent=1)
  if args.torch_compile: torch_compile_rows(torch, args, compiled, sync)
  if (out := os.environ.get("OUT")):
    with open(os.path.join(out, "gpu_models.json"), "w") as f: json.dump(ROWS, f, indent=1)
  print(f"== models done in {time.perf_counter() - T0:.0f} s; {len(FAILS)} failed steps{': ' + ', '.join(FAILS) if FAILS else ''}", flush=True)
  return 1 if FAILS else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
