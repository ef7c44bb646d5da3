"""The benchmark's bench: the run's settings, the machine's limits, and how a row is run and timed.

A row checks kiln's answer (and numpy's where it is the reference) itself, then hands every contender to
`Bench.time_row`: kiln, numpy and the like, and the peers (numba, tinygrad, torch, onnxruntime) each with a verify
function that checks the peer's answer first (a peer that fails is noted, never fatal). time_row times them all
together in interleaved rounds (harness.interleaved: one warmed block per contender a round, the order rotating), so
kiln and each peer meet the same weather; a contender's time is the median of all its calls, and `Row.rounds` keeps its
median per round (in --json). The rows themselves live in row modules (rows.py, models.py, neighbour_rows.py here; the
rows spanning layers in the repository's benchmarks/); each has a `run(bench)` that adds its rows, and Bench.run takes
the list of them: no row module imports another's."""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln_bench.harness import GB, Timing, WrongResult, interleaved, medians, pooled
from kiln_bench.limits import add_bandwidth, ctypes_call_time, fma_peak, memory_bandwidth, read_bandwidth, thread_count, vector_lanes
from kiln_bench.peers import load_peers
from kiln_bench.table import COLUMNS, Row

Peer = tuple[Callable[[], Any], Callable[[Any], None]]  # (call, verify: checks call()'s answer, raises when wrong)


class Bench:
  def __init__(self, args: argparse.Namespace):
    self.args, self.scale = args, args.sizes_scale
    # per contender, over all its rounds (harness.Timing); peers are timed like kiln, in the same rounds
    # (the first warm-up makes one call at least: each contender has run once already, in its row's check)
    self.t = Timing(1, 3, 0.3, 0.15, rounds=3, settle_seconds=0.05) if args.quick else Timing(1, 15, 2.0, 0.3, rounds=5)
    self.rows: list[Row] = []
    self.info: dict[str, Any] = {}
    self.threads = thread_count()
    self.peers = load_peers(self.threads)
    self.rng = np.random.default_rng(0)
    self.only = re.compile(args.only, re.I) if getattr(args, "only", None) else None

  def wanted(self, work: str) -> bool: return self.only is None or bool(self.only.search(work))

  def size(self, n: int, lo: int = 8) -> int: return max(lo, int(round(n * self.scale)))

  def row(self, work: str, fn: Callable[[Row], None], unit: str) -> Row:
    r = Row(work, unit)
    if not self.wanted(work): return r  # --only: not run, not in the table
    try: fn(r)
    except WrongResult as e: r.status, r.note = "WRONG", str(e)
    except Exception as e: r.status, r.note = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    r.judge()
    self.rows.append(r)
    print(f"  measured: {work:<28} {r.status}", file=sys.stderr, flush=True)
    return r

  def time_row(self, r: Row, mine: dict[str, Callable[[], Any]], peers: dict[str, Peer] | None = None) -> dict[str, float]:
    """Time a row's contenders together, in interleaved rounds (harness.interleaved). `mine`: kiln's call and its
    references (numpy's, the heuristic's ...), whose answers the row has checked; an error there is the row's. `peers`:
    name -> (call, verify); verify(call()) checks the peer's answer before it is timed, and a peer that fails, then or
    while timed, is noted and dropped, never fatal. Each contender's time (the median of all its calls) goes to its
    column where the row has one, its median per round to r.rounds; returns the times by name."""
    fns = dict(mine)
    for who, (fn, verify) in (peers or {}).items():
      try:
        verify(fn())
        fns[who] = fn
      except Exception as e: self._peer_failed(r, who, e)
    calls = interleaved(fns, self.t, on_error=lambda who, e: self._peer_failed(r, who, e, mine))
    out = {}
    for who, c in calls.items():
      out[who] = pooled(c)
      r.rounds[who] = [statistics.median(block) for block in c]
      if who in COLUMNS: setattr(r, who, out[who])
    return out

  def _peer_failed(self, r: Row, who: str, e: Exception, mine: dict[str, Any] | None = None) -> None:
    if mine and who in mine: raise e  # kiln's or a reference's error: the row's, as before it was timed
    r.note += f"{'; ' if r.note else ''}{who}: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"

  def peer_alone(self, r: Row, who: str, fn: Callable[[], Any], verify: Callable[[Any], None]) -> None:
    """A peer timed on its own after checking its answer (failing: noted, never fatal), for a row whose kiln column is not
    timed by time_row (the dispatch chain's per-call means)."""
    try:
      verify(fn())
      setattr(r, who, medians([fn], self.t)[0])
    except Exception as e: self._peer_failed(r, who, e)

  # -- limits --
  def limits(self) -> None:
    n = self.size(1 << 24, 1 << 16)
    self.bw, how = memory_bandwidth(n, self.threads, self.t)
    try:  # numpy's threaded read (a sum) is bound by its own arithmetic, not by memory: a plain read kernel says more
      read, read_how = read_bandwidth(n, self.threads, self.t)
      how += f"; {read_how}: {read / GB:.1f} GB/s"
      self.bw = max(self.bw, read)
    except Exception as e: how += f"; read kernel not measured ({type(e).__name__}: {e})"
    self.info["memory_bandwidth"] = {"bytes_per_s": self.bw, "how": how}
    try:  # the limit for c = a + b: reads and streamed writes overlap, so it can pass the read-only rate
      self.bw_add, how = add_bandwidth(n, self.threads, self.t)
    except Exception as e: self.bw_add, how = self.bw, f"not measured ({type(e).__name__}: {e}); the read limit stands in"
    self.info["add_bandwidth"] = {"bytes_per_s": self.bw_add, "how": how}
    try:
      self.peak, how = fma_peak(self.threads, self.t, seconds=0.002 if self.scale < 0.2 else 0.005)
      self.info["fma_peak"] = {"flops_per_s": self.peak, "how": how}
    except Exception as e:
      lanes, isa = vector_lanes()
      self.peak, how = 0.0, f"not measured ({type(e).__name__}: {e})"
      self.info["fma_peak"] = {"flops_per_s": None, "how": how}
    self.ctypes_s = ctypes_call_time()
    self.info["ctypes_call_s"] = self.ctypes_s

  def tg(self, t: Any) -> Any:
    """A tinygrad result, its device synchronised (tinygrad runs asynchronously)."""
    T, D, dev = self.peers.tinygrad
    D[dev].synchronize()
    return t

  def run(self, groups: Sequence[Callable[[Bench], None]]) -> None:
    """Measure the machine's limits, then each group of rows in turn (each adds its rows, in the order they print)."""
    print("kiln bench-suite: measuring the machine's limits ...", file=sys.stderr, flush=True)
    self.limits()
    for group in groups: group(self)
