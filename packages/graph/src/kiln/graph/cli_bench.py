"""`kiln bench model.onnx [--runs N | --time S] [--warmup N] [--threads N] [--input NAME=FILE.npy] [--dims name=N]
[--compare] [--no-cold]`: how fast kiln loads and runs a model, and with --compare how fast onnxruntime and OpenVINO do
on the same file.

Inputs not given are made from the declared shapes and dtypes (random_feeds.py: token ids within the embedding's range,
attention masks all ones). Load time is measured twice: cold, the first load in this process into a fresh, empty kernel
cache directory (every kernel compiled), and warm, again from the kernel cache that load filled, its in-memory copy
dropped first (what a second process finds on disk); --no-cold loads once from the caches as they are. The runs use the
warm model: `--warmup` runs first (not counted), then `--runs` runs, or runs for `--time` seconds (default DEFAULT_TIME),
each timed alone: latency p50, p90 and p99 (of fewer than 100 runs, p99 is about the slowest run), and the throughput
(runs a second, one run after another) and items a second: runs/s times the batch, taken as the leading dim of the
model's first input (the line above the table names it).

With --compare the peers (bench_peers.py) that are installed load the same file and run the same feeds on the same
thread count; the engines take turns in ROUNDS interleaved rounds (kiln, onnxruntime, openvino, kiln, ...), so a change
in the machine's load hits them alike, and `vs kiln` is the median over the rounds of the peer's median over kiln's (above
1: kiln is faster). `agrees` is the largest difference of the peer's outputs from kiln's, relative to each output's
largest magnitude. Benchmarks from a kiln checkout (the kernel rows, against numpy, torch, ...) are `kiln bench-suite`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.codegen import settings
from kiln.graph import bench_peers, cli_args

DEFAULT_TIME = 5.0  # seconds each engine runs when neither --runs nor --time is given
ROUNDS = 5


@dataclass
class Engine:
  name: str
  run: Callable[[Mapping[str, np.ndarray]], Any] | None = None
  cold: float | None = None
  warm: float | None = None
  why: str = ""  # why it did not run (not installed, failed to load)
  times: list[float] = field(default_factory=list)
  rounds: list[float] = field(default_factory=list)  # each round's median
  agrees: str = ""


def _kiln(args: argparse.Namespace, proto: Any, directory: str | None, dims: dict[str, int]) -> tuple[Engine, Any]:
  """kiln's engine, loaded cold into a fresh kernel cache directory, then warm from it; the warm model runs. With --no-cold,
  loaded once from the caches as they are (KILN_CACHE_DIR's kernels, a kept plan): its time is the warm column."""
  from kiln.executor.cache import cache_stats, clear_memory_cache
  from kiln.graph import onnx as konnx
  e = Engine("kiln")
  if args.no_cold:
    c0, t = cache_stats()["compiles"], time.perf_counter()
    model = konnx.load(proto, device=args.device, dims=dims, directory=directory, progress=True)
    e.warm, e.why = time.perf_counter() - t, f"kernels compiled: {cache_stats()['compiles'] - c0} (--no-cold: the caches as they are)"
    e.run = model.run
    return e, model
  with tempfile.TemporaryDirectory(prefix="kiln-bench-cache-") as cache_dir, settings.CACHE_DIR.temporarily(cache_dir):
    times, compiles = [], []
    for _ in range(2):
      clear_memory_cache()
      c0, t = cache_stats()["compiles"], time.perf_counter()
      model = konnx.load(proto, device=args.device, dims=dims, directory=directory, progress=True)
      times.append(time.perf_counter() - t)
      compiles.append(cache_stats()["compiles"] - c0)
  e.cold, e.warm = times
  e.why = f"kernels compiled: {compiles[0]} cold, {compiles[1]} warm"
  e.run = model.run
  return e, model


def _peers(path: str, feeds: Mapping[str, np.ndarray], threads: int) -> list[Engine]:
  out = []
  shapes = {k: tuple(v.shape) for k, v in feeds.items()}
  for p in bench_peers.PEERS:
    e = Engine(p.name)
    out.append(e)
    if not p.installed():
      e.why = "not installed"
      continue
    try:
      for i in range(2):  # the second load is the warm one: the library is imported and initialised
        t = time.perf_counter()
        e.run = p.load(path, shapes, threads)
        if i == 0: e.cold = time.perf_counter() - t
        else: e.warm = time.perf_counter() - t
    except Exception as err:  # a peer that cannot load the model is a row saying why, not the end of the benchmark
      e.run, e.why = None, f"failed to load: {type(err).__name__}: {str(err).strip().splitlines()[0][:100] if str(err).strip() else ''}"
  return out


def _measure(engines: list[Engine], feeds: Mapping[str, np.ndarray], args: argparse.Namespace) -> None:
  """Warm-up runs, then ROUNDS interleaved rounds of timed runs of every engine that loaded."""
  live = [e for e in engines if e.run is not None]
  for e in live:
    for _ in range(args.warmup): e.run(feeds)  # type: ignore[misc]
  runs = args.runs
  rounds = min(ROUNDS, runs) if runs else ROUNDS
  for r in range(rounds):
    for e in live:
      got: list[float] = []
      n = (runs // rounds + (r < runs % rounds)) if runs else None
      end = time.perf_counter() + (args.time or DEFAULT_TIME) / rounds
      while (len(got) < n) if n is not None else (not got or time.perf_counter() < end):
        t = time.perf_counter()
        e.run(feeds)  # type: ignore[misc]
        got.append(time.perf_counter() - t)
      e.times += got
      e.rounds.append(statistics.median(got))


def _core_trip(threads: int) -> str:
  """', core trip N ns' (the CPU runtime's measure of what handing work between cores costs now) when kiln runs on
  several threads: a run on cores placed far apart is slower for it, and this says so beside the times."""
  from kiln.codegen.threads import core_trip_ns
  trip = core_trip_ns() if threads > 1 else None
  return "" if trip is None else f", core trip {trip:.0f} ns"


def _ms(s: float | None) -> str: return "-" if s is None else f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:.0f}"


def batch_of(inputs: Sequence[Any], feeds: Mapping[str, np.ndarray]) -> tuple[str, int] | None:
  """(the first input's name, its leading dim): the batch items/s counts; None for a model with no input or a scalar first one."""
  if not inputs or (a := feeds.get(inputs[0].name)) is None or a.ndim == 0: return None
  return inputs[0].name, int(a.shape[0])


def table(engines: list[Engine], batch: int | None = None) -> str:
  """One row per engine; items/s is runs/s times `batch` ('-' where it is unknown)."""
  kiln = engines[0]
  lines = [f"{'engine':<12} {'load cold':>10} {'load warm':>10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'runs/s':>9} {'items/s':>9} {'runs':>5} "
           f"{'vs kiln':>8}  agrees"]
  for e in engines:
    if not e.times:
      lines.append(f"{e.name:<12} {e.why}")
      continue
    p50, p90, p99 = (float(np.percentile(e.times, q)) for q in (50, 90, 99))
    vs = "-" if e is kiln else f"{statistics.median(a / b for a, b in zip(e.rounds, kiln.rounds)):.2f}x"
    per_s = len(e.times) / sum(e.times)
    items = "-" if batch is None else f"{per_s * batch:.1f}"
    lines.append(f"{e.name:<12} {_ms(e.cold):>7} ms {_ms(e.warm):>7} ms {p50 * 1e3:>9.3f} {p90 * 1e3:>9.3f} {p99 * 1e3:>9.3f} "
                 f"{per_s:>9.1f} {items:>9} {len(e.times):>5} {vs:>8}  {e.agrees or '-'}")
  return "\n".join(lines)


def bench(args: argparse.Namespace) -> int:
  from kiln.codegen.threads import thread_count
  from kiln.graph import onnx as konnx
  if args.runs is not None and args.runs < 1: raise cli_args.UsageError(f"--runs {args.runs}: must be >= 1")
  if args.time is not None and args.time <= 0: raise cli_args.UsageError(f"--time {args.time}: must be > 0")
  if args.warmup < 0: raise cli_args.UsageError(f"--warmup {args.warmup}: must be >= 0")
  cli_args.set_threads(args.threads)
  cli_args.probe_device(args.device)
  proto, directory = konnx.read(args.model)
  feeds, dims, notes = cli_args.feeds(konnx._onnx(), proto, args, True)
  threads = thread_count()
  load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
  print(f"kiln bench {args.model}: {args.device}, {threads} threads ({os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        f"{_core_trip(threads)})")
  for line in notes: print(f"  made up: {line}")
  kiln, model = _kiln(args, proto, directory, dims)
  engines = [kiln]
  print(f"  {engines[0].why}")
  engines[0].why = ""
  if args.compare: engines += _peers(args.model, feeds, threads)
  ref = engines[0].run(feeds)  # type: ignore[misc]
  for e in engines[1:]:
    if e.run is not None: e.agrees = bench_peers.agreement(ref, e.run(feeds))
  _measure(engines, feeds, args)
  how = f"{args.runs} runs" if args.runs else f"{args.time or DEFAULT_TIME:g} s"
  print(f"  {how} each after {args.warmup} warm-up runs{f', in {ROUNDS} interleaved rounds' if len(engines) > 1 else ''}")
  if len(engines) > 1:
    print("  vs kiln: a peer's time over kiln's (the median of the rounds'; above 1: kiln is faster); agrees: the largest difference\n"
          "  from kiln's outputs, relative to each output's largest magnitude. The peers run on the CPU.")
  batch = batch_of(model.inputs, feeds)
  print(f"  items/s: runs/s x {batch[1]}, the leading dim of input {batch[0]!r}" if batch else
        "  items/s: - (the model's first input has no leading dim)")
  if any(0 < len(e.times) < 100 for e in engines): print("  p99 of fewer than 100 runs is about the slowest run")
  print()
  print(table(engines, batch[1] if batch else None))
  return 0


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="kiln bench", description="Time an ONNX model on kiln (load cold and warm, latency percentiles, "
                                                                "throughput: runs/s, and items/s = runs/s x the leading dim of the first "
                                                                "input); --compare: onnxruntime and OpenVINO beside it.",
                               epilog="p50/p90/p99: percentiles of the single runs' times; of fewer than 100 runs, p99 is about the slowest.")
  cli_args.add_model_args(ap)
  how = ap.add_mutually_exclusive_group()
  how.add_argument("--runs", "-n", type=int, metavar="N", help="timed runs per engine (p99 of fewer than 100 runs is about the slowest)")
  how.add_argument("--time", type=float, metavar="S", help=f"seconds each engine runs (default {DEFAULT_TIME:g})")
  ap.add_argument("--warmup", "-w", type=int, default=3, metavar="N", help="untimed runs first (default 3)")
  ap.add_argument("--compare", "-c", action="store_true", help="also onnxruntime and OpenVINO (f32), where installed, in interleaved rounds")
  ap.add_argument("--no-cold", action="store_true", help="skip the cold load (every kernel compiled into an empty cache): load once from the "
                                                         "kernel and plan caches as they are, the time in the warm column")
  return ap


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  return cli_args.guarded("kiln bench", lambda: bench(args))
