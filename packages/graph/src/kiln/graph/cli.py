"""`kiln run model.onnx [--input NAME=FILE.npy ...] [--random] [--dims name=N] [--runs N] [--threads N] [--profile]
[--trace FILE.json] [--out DIR]`: an ONNX model on kiln from the command line. Registered with the `kiln` command through
the entry-point group `kiln.commands` (kiln-executor's CLI finds it installed; the executor never imports kiln.graph), beside
`kiln bench` (cli_bench.py) and `kiln inspect` (cli_inspect.py).

Prints each output's shape, dtype and statistics (min, max, mean); `--out DIR` also writes each output as DIR/NAME.npy.
`--random` makes the inputs not given from their declared shapes and dtypes (random_feeds.py: the same feeds as `kiln
bench`). `--runs N` runs N times and prints the first run's time and the median and best of the others. `--profile`
runs once more kernel by kernel and prints each kernel with the ONNX nodes it covers, then the time per ONNX operator type
(onnx_profile.py); `--trace FILE.json` writes that run as a Chrome trace (chrome://tracing, Perfetto), each event named
by its ONNX node. A model with a run-time If runs several plans (kiln.graph.program): the kernel count sums them all, the
profile lists the kernels of the branches taken, without ONNX nodes; so does one with a shape computed at run time,
compiled from there on for each value (kiln.graph.specialise). A symbolic dim with no name is given as INPUT:AXIS
(`--dims x:0=4`), as kiln.graph.onnx.load takes it. Bad input (a missing or unreadable file, an unknown input name, a
wrong shape or dtype, a model kiln cannot load) is one line on stderr and exit code 2, no traceback.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.graph import cli_args, onnx_profile
from kiln.graph.cli_args import UsageError


def _stats(a: np.ndarray) -> str:
  if a.size == 0: return "empty"
  v = a.astype(np.float64) if a.dtype.kind in "biuf" else None
  if v is None: return f"dtype {a.dtype} (no statistics)"
  fin = np.isfinite(v)
  extra = "" if fin.all() else f", {int((~fin).sum())} not finite"
  v = v[fin] if not fin.all() and fin.any() else v
  return f"min {v.min():.6g}  max {v.max():.6g}  mean {v.mean():.6g}{extra}"


def _file_name(name: str) -> str:
  """An output name as a safe file name (ONNX names may hold '/', ':' or be '..')."""
  safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")
  return (safe or "output") + ".npy"


def _timed_runs(model: Any, feeds: dict[str, np.ndarray], runs: int) -> tuple[dict[str, np.ndarray], list[float]]:
  """The outputs of the last of `runs` runs, and each run's seconds."""
  times, outs = [], {}
  for _ in range(runs):
    t = time.perf_counter()
    outs = model.run(feeds)
    times.append(time.perf_counter() - t)
  return outs, times


def _write(out: str, outs: dict[str, np.ndarray]) -> None:
  d = Path(out)
  d.mkdir(parents=True, exist_ok=True)
  used: set[str] = set()
  for name, a in outs.items():
    fn = _file_name(name)
    while fn in used: fn = fn[:-4] + "_.npy"
    used.add(fn)
    np.save(d / fn, a)
    print(f"  wrote {d / fn}")


def _profile(args: argparse.Namespace, model: Any, feeds: dict[str, np.ndarray]) -> None:
  plans = model.plans
  prof = model.run_profiled(feeds)[1] if plans else None
  if not plans: print("profile: every output is a constant, no kernels ran")
  elif not prof: print("profile: the branches these inputs take run no kernels")
  else:
    nodes = onnx_profile.nodes_of(model)
    taken = ", the branches these inputs take" if len(plans) > 1 else ""
    print(f"\nper-kernel profile (one run, kernel by kernel{taken}; {prof.total_time * 1e3:.2f} ms in kernels):")
    print(onnx_profile.table(prof, nodes))
    if nodes is None: print("(a model of several plans: its kernels are not mapped to ONNX nodes)")
    else: print("\ntime per ONNX operator (a kernel is charged to the node whose reduction it computes, else the first it computes):\n"
                + onnx_profile.totals_table(prof, nodes))
    if args.trace:
      Path(args.trace).write_text(json.dumps(onnx_profile.chrome_trace(prof, nodes)))
      print(f"\nwrote the Chrome trace {args.trace}")


def run(args: argparse.Namespace) -> int:
  from kiln.graph import onnx as konnx
  if args.runs < 1: raise UsageError(f"--runs {args.runs}: must be >= 1")
  cli_args.set_threads(args.threads)
  cli_args.probe_device(args.device)
  proto, directory = konnx.read(args.model)  # read once, through every size and file check
  feeds, dims, notes = cli_args.feeds(konnx._onnx(), proto, args, args.random)
  for line in notes: print(f"made up: {line}")
  t0 = time.perf_counter()
  model = konnx.load(proto, device=args.device, dims=dims, directory=directory, progress=True)  # a line on stderr for a load over a second
  t1 = time.perf_counter()
  outs, times = _timed_runs(model, feeds, args.runs)
  plans = model.plans  # one, or a program's segments (a run-time If: both sides of each branch; a specialisation: those compiled so far)
  counts = [len(p.kernels) for p in plans]
  what = "both sides of its run-time branches" if model.program is None or not model.program.specialisations() else \
    "its segments, and the rest of the model compiled for the values this run computed"
  where = f" in {len(plans)} plans ({' + '.join(map(str, counts))}: {what})" if len(plans) > 1 else ""
  rest = f"; {len(times) - 1} more: median {statistics.median(times[1:]) * 1e3:.2f} ms, best {min(times[1:]) * 1e3:.2f} ms" if len(times) > 1 else ""
  print(f"{args.model}: {sum(counts)} kernels{where}, load + compile {(t1 - t0) * 1e3:.0f} ms, run {times[0] * 1e3:.1f} ms{rest}")
  w = max(len(n) for n in outs) if outs else 0
  for name, a in outs.items(): print(f"  {name:<{w}}  {str(a.shape):<16} {a.dtype!s:<8} {_stats(a)}")
  if args.out: _write(args.out, outs)
  if args.profile or args.trace: _profile(args, model, feeds)
  return 0


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="kiln run", description="Run an ONNX model on kiln: load, fuse, compile, run; print the outputs.")
  cli_args.add_model_args(ap)
  ap.add_argument("--random", "-r", action="store_true", help="make up the inputs not given, from their declared shapes and dtypes (as kiln bench)")
  ap.add_argument("--runs", "-n", type=int, default=1, metavar="N", help="run N times (default 1): the first run's time, the others' median and best")
  ap.add_argument("--profile", action="store_true", help="profile one more run: each kernel and the ONNX nodes it covers, time per operator type")
  ap.add_argument("--trace", metavar="FILE.json", help="write the profiled run as a Chrome trace, its events named by ONNX node (implies --profile)")
  ap.add_argument("--out", "-o", metavar="DIR", help="write each output to DIR/NAME.npy")
  return ap


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)  # argparse errors exit 2 with a usage line
  return cli_args.guarded("kiln run", lambda: run(args))
