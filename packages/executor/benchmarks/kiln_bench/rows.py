"""The benchmark's rows: each work measured (kiln, numpy and the peers), judged against its target and this machine's
limits, and the table the rows print as.

A row checks kiln's answer (and numpy's where it is the reference) itself, then hands every contender to
`Bench.time_row`: kiln, numpy and the like, and the peers (numba, tinygrad, torch, onnxruntime) each with a verify
function that checks the peer's answer first (a peer that fails is noted, never fatal). time_row times them all
together in interleaved rounds (harness.interleaved: one warmed block per contender a round, the order rotating), so
kiln and each peer meet the same weather; a contender's time is the median of all its calls, and `Row.rounds` keeps its
median per round (in --json). A ratio between two contenders (`Row.paired`) is the median over rounds of their quotient
in each round, and the target is judged on it; when the rounds alone would give different verdicts, `Row.judge` says
so in the note ("kiln/numpy 0.94-1.07x over 5 rounds") and the table marks the status with `~`, so a reader sees noise
rather than a flipped verdict."""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kiln.ir import kernels
from kiln_bench.harness import (
  F32,
  GB,
  MB,
  Timing,
  WrongResult,
  aligned_empty,
  check,
  conformance_kernel,
  interleaved,
  kiln_call,
  launch_sizes,
  medians,
  per_call,
  pooled,
)
from kiln_bench.limits import add_bandwidth, ctypes_call_time, fma_peak, memory_bandwidth, read_bandwidth, thread_count, vector_lanes
from kiln_bench.peers import load_peers, numba_fn

SLACK = 0.2  # a target missed by more than this fails the run
BENCH_ROOT = str(Path(__file__).resolve().parents[1])  # on a child process's PYTHONPATH, so it imports kiln_bench too


@dataclass
class Row:
  work: str
  unit: str  # how kiln/numpy/numba/tinygrad print: "ms", "us", "MB"
  kiln: float | None = None  # seconds (bytes for "MB")
  numpy: float | None = None
  numba: float | None = None
  tinygrad: float | None = None
  torch: float | None = None
  onnxruntime: float | None = None
  heuristic: float | None = None  # the tuned row: the same plan with the heuristic's options (a check's "peer")
  ratio: float | None = None  # kiln's throughput over numpy's (numpy time / kiln time)
  achieved: str = ""
  limit: str = ""
  target: str = ""
  target_kind: str = ""  # "ratio" (ratio >= target_value), "max" (kiln <= target_value), "" (report only)
  target_value: float = 0.0
  # targets that all must hold (the model rows): (peer, x) wants the peer's time >= x * kiln's, ("limit", f) wants frac >= f;
  # one whose number is missing (peer not installed) is not judged
  checks: list[tuple[str, float]] = field(default_factory=list)
  frac: float | None = None  # achieved / limit, for ("limit", f)
  status: str = ""  # PASS, NEAR (missed by <= 20%), MISS, WRONG, ERROR or "-" (report only)
  note: str = ""
  # each contender's median per round (seconds), the contenders timed in the same interleaved rounds (Bench.time_row)
  rounds: dict[str, list[float]] = field(default_factory=dict)
  spread: str = ""  # set by judge when the rounds, judged one by one, disagree on the verdict: the judged ratios' ranges

  def per_round(self, who: str) -> list[float] | None:
    """who's time over kiln's in each round (kiln's throughput over who's), or None without both in the same rounds."""
    k, o = self.rounds.get("kiln"), self.rounds.get(who)
    return [ov / kv for ov, kv in zip(o, k)] if k and o and len(k) == len(o) else None

  def paired(self, who: str) -> float | None:
    """who's time over kiln's: the median over rounds of each round's quotient (both timed in the same rounds, so a
    drift between rounds cancels); without rounds, the quotient of the two columns."""
    q = self.per_round(who)
    if q: return statistics.median(q)
    other = getattr(self, who, None)
    return other / self.kiln if other is not None and self.kiln else None

  def judge(self) -> None:
    if self.status in ("WRONG", "ERROR"): return
    self.status = self._verdict(None)
    n = len(self.rounds.get("kiln", []))
    if n < 2 or self.status not in ("PASS", "NEAR", "MISS"): return
    each = [self._verdict(i) for i in range(n)]
    if len(set(each)) < 2: return
    counts = ", ".join(f"{s} {each.count(s)}" for s in ("PASS", "NEAR", "MISS") if s in each)
    ranges = [f"{j.label} {_span(j.fmt, min(j.rounds), max(j.rounds))} (median {j.fmt(j.value)})"
              for j in self._judged() if j.rounds and j.value is not None]
    self.spread = f"{'; '.join(ranges)} over {n} rounds, which one by one would judge {counts}; judged on the median"
    self.note = (self.note + "; " if self.note else "") + "rounds disagree: " + self.spread

  def _judged(self) -> list[Judged]:
    """What the target is judged on, in the order of checks (or the one target)."""
    k = self.rounds.get("kiln")
    if self.checks:
      out = []
      for kind, want in self.checks:
        if kind == "limit":
          each = [self.frac * self.kiln / kv for kv in k] if k and self.frac is not None and self.kiln else None
          out.append(Judged("limit", want, self.frac, each, _pct))
        else: out.append(Judged(f"vs {kind}", want, self.paired(kind), self.per_round(kind), _times))
      return out
    if self.target_kind == "ratio": return [Judged("kiln/numpy", self.target_value, self.ratio, self.per_round("numpy"), _times)]
    if self.target_kind == "max":
      return [Judged("kiln", self.target_value, self.kiln, k, lambda v: _fmt(v, self.unit), lower=True)]
    return []

  def _verdict(self, i: int | None) -> str:
    """The row's verdict on its own values (i None), or on round i's alone; the worst of its targets."""
    if self.kiln is None: return "-"
    got = []
    for j in self._judged():
      v = j.value if i is None else (j.rounds[i] if j.rounds else None)
      if v is None: continue  # a peer not installed (or failed), a ratio not measured: not judged
      ok, near = (v <= j.want, v <= j.want * (1 + SLACK)) if j.lower else (v >= j.want, v >= j.want * (1 - SLACK))
      got.append("PASS" if ok else "NEAR" if near else "MISS")
    return max(got, key=("PASS", "NEAR", "MISS").index) if got else "-"


class Judged(NamedTuple):
  """One quantity a row's target is judged on: the row's value and each round's (None without rounds)."""
  label: str
  want: float
  value: float | None
  rounds: list[float] | None
  fmt: Callable[[float], str]
  lower: bool = False  # the value must be at most `want` (a time), else at least (a ratio, a fraction of a limit)


def _times(v: float) -> str: return f"{v:.2f}x"
def _pct(v: float) -> str: return f"{v:.0%}"


def _span(fmt: Callable[[float], str], lo: float, hi: float) -> str:
  """lo-hi with the unit once: "0.94-1.07x", "65-72%", "0.38-0.73 ms"."""
  a, b = fmt(lo), fmt(hi)
  unit = b[len(b.rstrip(" %xmunsMB")):]
  return f"{a.removesuffix(unit) if unit and a.endswith(unit) else a}-{b}"


def _fmt(v: float | None, unit: str) -> str:
  if v is None: return "-"
  if unit == "MB": return f"{v / MB:.2f} MB"
  s = v * (1e3 if unit == "ms" else 1e6)
  return f"{s:.3g} {unit}" if s < 100 else f"{s:.0f} {unit}"


Peer = tuple[Callable[[], Any], Callable[[Any], None]]  # (call, verify: checks call()'s answer, raises when wrong)
COLUMNS = ("kiln", "numpy", "numba", "tinygrad", "torch", "onnxruntime", "heuristic")  # contenders with a Row field
USER = ", numpy's arrays"  # the add and sum rows again on arrays as a user makes them (Bench.add's docstring)


def _offsets(**arrays: np.ndarray) -> str:
  """Where numpy's arrays start, in bytes past a 64-byte boundary (kiln's streaming stores want 16 or 64)."""
  return "numpy's arrays start " + ", ".join(f"{k} +{v.ctypes.data % 64}" for k, v in arrays.items()) + " bytes past a 64-byte boundary"


def _rate(x: float, unit: str, limit: float | None) -> str:
  pct = f" ({x / limit:.0%})" if limit else ""
  return f"{x / GB:.1f} {unit}{pct}"


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

  # -- elementwise and reductions --
  def add(self, r: Row, user: bool = False) -> None:
    """c = a + b. user=False: every library gets 64-byte-aligned arrays, as kiln's allocator makes them. user=True: the
    arrays a user has, numpy's own (its big allocations start 16 bytes past a 64-byte boundary, glibc's mmap header), so
    kiln's streaming stores take the 16-byte-aligned path; kiln and numpy only, the peers are on the aligned row."""
    n = self.size(1 << 24, 1 << 10)
    if user:
      a, b = self.rng.random(n, dtype=np.float32), self.rng.random(n, dtype=np.float32)
      c, cn = np.empty(n, np.float32), np.empty(n, np.float32)
      r.note = _offsets(a=a, b=b, out=c)
    else:
      a, b, c, cn = (aligned_empty(n) for _ in range(4))
      a[:], b[:] = self.rng.random(n, dtype=np.float32), self.rng.random(n, dtype=np.float32)
    k = kiln_call(kernels.elementwise(lambda x, y: x + y, F32, ((n,), F32), ((n,), F32), name="bench_add"), [c, a, b])
    want = a + b
    k()
    check("add", c, want)
    peers: dict[str, Peer] = {}
    if self.peers.numba is not None and not user:
      f, o = numba_fn(self.peers.numba, "add"), aligned_empty(n)
      peers["numba"] = (lambda: f(a, b, o), lambda _: check("numba add", o, want))
    if self.peers.tinygrad is not None and not user:
      T, D, dev = self.peers.tinygrad
      ta, tb = T(a, device=dev).realize(), T(b, device=dev).realize()
      peers["tinygrad"] = (lambda: self._tg((ta + tb).realize()), lambda out: check("tinygrad add", out.numpy(), want))
    self.time_row(r, {"kiln": k, "numpy": lambda: np.add(a, b, out=cn)}, peers)
    self._bw_row(r, 12 * n, f"{n / (1 << 20):g}M float32 add{USER if user else ''}", 3.0, self.bw_add, "add")

  def sum(self, r: Row, user: bool = False) -> None:
    """The sum of a: 64-byte-aligned, or (user=True) numpy's own array, kiln and numpy only (as add)."""
    n = self.size(1 << 24, 1 << 10)
    if user:
      a = self.rng.random(n, dtype=np.float32)
      r.note = _offsets(a=a)
    else:
      a = aligned_empty(n)
      a[:] = self.rng.random(n, dtype=np.float32)
    out = np.zeros(1, np.float32)
    k = kiln_call(kernels.reduce_sum((n,), F32), [out, a])
    want = a.sum(dtype=np.float64)
    k()
    check("sum", out[0], want, rtol=1e-5)
    peers: dict[str, Peer] = {}
    if self.peers.numba is not None and not user:
      f = numba_fn(self.peers.numba, "sum")
      peers["numba"] = (lambda: f(a), lambda s: check("numba sum", s, want, rtol=1e-4))
    if self.peers.tinygrad is not None and not user:
      T, D, dev = self.peers.tinygrad
      ta = T(a, device=dev).realize()
      peers["tinygrad"] = (lambda: self._tg(ta.sum().realize()), lambda s: check("tinygrad sum", s.numpy(), want, rtol=1e-4))
    self.time_row(r, {"kiln": k, "numpy": lambda: a.sum()}, peers)
    self._bw_row(r, 4 * n, f"{n / (1 << 20):g}M float32 sum{USER if user else ''}", 4.0, self.bw, "read")

  def _tg(self, t: Any) -> Any:
    T, D, dev = self.peers.tinygrad
    D[dev].synchronize()
    return t

  def _bw_row(self, r: Row, nbytes: int, work: str, target: float, limit: float, what: str) -> None:
    r.work = work
    r.ratio = r.paired("numpy")
    r.achieved = _rate(nbytes / r.kiln, "GB/s", limit)  # type: ignore[operator]
    r.limit = f"{limit / GB:.1f} GB/s {what}"
    r.target, r.target_kind, r.target_value = f">= {target:g}x numpy", "ratio", target

  def matmul(self, r: Row, n0: int, gated: bool) -> None:
    n = max(8, round(n0 * self.scale ** 0.5))  # sizes scale as elements, so dims by the square root
    r.work = f"matmul {n}x{n} float32"
    a, b = self.rng.random((n, n), dtype=np.float32) * 2 - 1, self.rng.random((n, n), dtype=np.float32) * 2 - 1
    c = np.empty((n, n), np.float32)
    k = kiln_call(kernels.matmul(n, n, n), [c, a, b])
    want = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-6 * n + 1e-5  # float32 accumulation over n terms of magnitude <= 1
    k()
    check(f"matmul {n}", c, want, atol=tol)
    check(f"numpy matmul {n}", a @ b, want, atol=tol)
    peers: dict[str, Peer] = {}
    if self.peers.numba is not None:
      f, o = numba_fn(self.peers.numba, "matmul"), np.empty_like(c)
      peers["numba"] = (lambda: f(a, b, o), lambda _: check("numba matmul", o, want, atol=tol))
    if self.peers.tinygrad is not None:
      T, D, dev = self.peers.tinygrad
      ta, tb = T(a, device=dev).realize(), T(b, device=dev).realize()
      peers["tinygrad"] = (lambda: self._tg((ta @ tb).realize()), lambda o: check("tinygrad matmul", o.numpy(), want, atol=tol))
    self.time_row(r, {"kiln": k, "numpy": lambda: a @ b}, peers)
    r.ratio = r.paired("numpy")
    r.achieved = _rate(2 * n ** 3 / r.kiln, "GFLOP/s", self.peak or None)
    r.limit = f"{self.peak / GB:.0f} GFLOP/s FMA" if self.peak else "-"
    r.note = (r.note + "; " if r.note else "") + f"numpy {2 * n ** 3 / r.numpy / GB:.1f} GFLOP/s"
    if gated: r.target, r.target_kind, r.target_value = ">= 0.6x numpy", "ratio", 0.6
    else: r.target = "(report)"

  # -- dispatch --
  def dispatch_chain(self, r: Row, count: int = 100, n: int = 64) -> None:
    """A prepared plan of `count` tiny dependent kernels (x[i+1] = x[i] + 1): replay time per kernel."""
    from kiln.executor import Buffer, ExecutionPlanBuilder
    x0 = self.rng.random(n, dtype=np.float32)
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
    reps = 10 if self.args.quick else 50
    tk = per_call(plan.execute, reps, 7 if self.args.quick else 21)
    tn = per_call(np_chain, reps, 7 if self.args.quick else 21)
    r.kiln, r.numpy, r.ratio = tk / count, tn / count, tn / tk
    if self.peers.tinygrad is not None:  # tinygrad's prepared plan: a TinyJit replaying the same chain
      T, D, dev = self.peers.tinygrad
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
      self.peer_alone(r, "tinygrad", tg, lambda o: check("tinygrad dispatch chain", o.numpy(), xs[-1]))
      if r.tinygrad is not None: r.tinygrad /= count
    r.achieved, r.limit = f"{count} kernels/plan", f"{self.ctypes_s * 1e6:.2f} us ctypes call"
    r.target, r.target_kind, r.target_value = "<= 2 us/kernel", "max", 2e-6
    r.note = f"numpy column: the same {count} ops as ufunc calls; plan memory {plan.memory_bytes} B"

  def dispatch_one(self, r: Row, n: int = 64) -> None:
    from kiln.executor import Buffer, ExecutionPlanBuilder
    x0 = self.rng.random(n, dtype=np.float32)
    b = ExecutionPlanBuilder("CPU")
    i, o = b.add_buffer(Buffer.from_numpy(x0)), b.add_buffer(Buffer("CPU", n, F32))
    b.add_kernel(kernels.elementwise(lambda x: x + 1.0, F32, ((n,), F32), name="tiny_add1"), [o, i])
    b.set_outputs([o])
    plan = b.build()
    plan.execute()
    y = np.empty_like(x0)
    check("dispatch one", plan.output_buffer(0).numpy(), x0 + np.float32(1))
    tk = per_call(plan.execute, 200, 7 if self.args.quick else 21)
    tn = per_call(lambda: np.add(x0, 1.0, out=y), 200, 7 if self.args.quick else 21)
    r.kiln, r.numpy, r.ratio = tk, tn, tn / tk
    r.achieved, r.limit = "1 kernel/plan", f"{self.ctypes_s * 1e6:.2f} us ctypes call"
    r.target, r.target_kind, r.target_value = "<= 5 us/execute", "max", 5e-6
    r.note = "numpy column: one ufunc call"

  # -- compiling and the kernel cache --
  def compile_cold(self, r: Row) -> None:
    from kiln.executor import compile_kernel_with_origin
    from kiln.executor.cache import clear_memory_cache
    old = os.environ.get("KILN_CACHE")
    os.environ["KILN_CACHE"] = "0"
    try:
      compile_kernel_with_origin(conformance_kernel(-1.0))  # runtime and LLVM start-up happen once per process: not a compile
      ts = []
      for i in range(3 if self.args.quick else 15):
        ast = conformance_kernel(0.5 + i)  # a new AST each time: nothing below the kernel cache can have seen it
        clear_memory_cache()
        st = time.perf_counter()
        ck, origin = compile_kernel_with_origin(ast)
        ts.append(time.perf_counter() - st)
        if origin != "compiled": raise RuntimeError(f"expected a cold compile, got a {origin} hit")
    finally:
      if old is None: os.environ.pop("KILN_CACHE", None)
      else: os.environ["KILN_CACHE"] = old
    a, b, out = self.rng.random(256, dtype=np.float32), self.rng.random(256, dtype=np.float32), np.empty(256, np.float32)
    ck.program.bind([out.ctypes.data, a.ctypes.data, b.ctypes.data], [], *launch_sizes(ck))()
    check("compiled conformance kernel", out, np.maximum(a * b + np.float32(0.5 + len(ts) - 1), a))
    r.kiln = statistics.median(ts)
    r.achieved, r.limit = f"median of {len(ts)}", "-"
    r.target, r.target_kind, r.target_value = "<= 30 ms", "max", 30e-3
    r.note = "render + LLVM O3 + load, KILN_CACHE=0"

  def memory_hit(self, r: Row) -> None:
    from kiln.executor import compile_kernel_with_origin
    ast = conformance_kernel(1e6)
    compile_kernel_with_origin(ast)
    if compile_kernel_with_origin(ast)[1] != "memory": raise RuntimeError("second lookup was not a memory-cache hit")
    r.kiln = per_call(lambda: compile_kernel_with_origin(ast), 1000, 15)
    r.achieved, r.limit = "compile_kernel_with_origin", "-"
    r.target, r.target_kind, r.target_value = "<= 20 us", "max", 20e-6

  def disk_hit(self, r: Row) -> None:
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
      for _ in range(2 if self.args.quick else 7):
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

  # -- the main job --
  def mlp(self, r: Row, mem: Row) -> None:
    from kiln.executor import demo
    sizes = [784, 512, 512, 10]
    batch = self.size(256, 4)
    ws = demo.make_weights(sizes)
    x = np.random.default_rng(1).standard_normal((batch, sizes[0])).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-mlp-") as d:
      wfile = Path(d) / "mlp_weights.npy"
      np.save(wfile, np.concatenate([w.ravel() for w in ws]))
      plan, out = demo.build(x, wfile, ws, sizes)
      plan.execute()
      check("MLP pass", out.numpy().reshape(batch, sizes[-1]), demo.numpy_forward(x, ws), atol=1e-4)
      tk = self.time_row(r, {"kiln": plan.execute, "numpy": lambda: demo.numpy_forward(x, ws)})["kiln"]
    r.work = f"MLP {'-'.join(map(str, sizes))} b{batch}"
    r.ratio = r.paired("numpy")
    flops = sum(2 * batch * a * b for a, b in zip(sizes, sizes[1:]))
    r.achieved, r.limit = _rate(flops / tk, "GFLOP/s", self.peak or None), f"{self.peak / GB:.0f} GFLOP/s FMA" if self.peak else "-"
    r.target, r.target_kind, r.target_value = "<= numpy's time", "ratio", 1.0
    r.note = f"scripts/demo's forward plan ({len(plan.kernels)} kernels)"
    mem.work, mem.kiln = "MLP plan peak buffer memory", float(plan.memory_bytes)
    mem.achieved, mem.limit, mem.target = f"{plan.memory_bytes_without_reuse / MB:.2f} MB w/o reuse", "-", "(report)"
    mem.numpy = float(sum(w.nbytes for w in ws) + x.nbytes + 2 * batch * sizes[-1] * 4 + sum(batch * s * 4 for s in sizes[1:]))
    mem.note = "numpy column: weights + input + every intermediate of numpy_forward"

  def run(self) -> None:
    print("kiln bench: measuring the machine's limits ...", file=sys.stderr, flush=True)
    self.limits()
    self.row("16M float32 add (out given)", self.add, "ms")
    self.row(f"16M float32 add (out given){USER}", functools.partial(self.add, user=True), "ms")
    self.row("16M float32 sum", self.sum, "ms")
    self.row(f"16M float32 sum{USER}", functools.partial(self.sum, user=True), "ms")
    for n0 in (256, 1000, 1024, 2048): self.row(f"matmul {n0}", functools.partial(self.matmul, n0=n0, gated=n0 == 1024), "ms")
    self.row("dispatch: 100-kernel plan", self.dispatch_chain, "us")
    self.row("dispatch: 1-kernel execute()", self.dispatch_one, "us")
    self.row("compile: cold, no disk cache", self.compile_cold, "ms")
    self.row("compile: memory-cache hit", self.memory_hit, "us")
    self.row("compile: disk hit, new process", self.disk_hit, "ms")
    if self.wanted("MLP pass"):
      mem = Row("MLP plan peak buffer memory", "MB")
      self.row("MLP pass", functools.partial(self.mlp, mem=mem), "ms")
      if mem.kiln is None: mem.status, mem.note = "ERROR", "the MLP plan was not built"
      else: mem.status = "-"
      self.rows.append(mem)
    from kiln_bench import graph_rows, load_rows, models, neighbour_rows, ray_rows
    models.run(self)
    graph_rows.run(self)  # imports kiln.graph inside its rows only
    load_rows.run(self)  # a safetensors file > the LLC, mapped: load time, bytes mapped and resident
    neighbour_rows.run(self)  # issue 21: plans beside numpy's A @ B, after idle, from two threads; CPU burnt after a call
    ray_rows.run(self)  # issue 18: replicas on a local Ray cluster (where kiln-distributed is installed)

# ---- the table ----
COLS = ("work", "kiln", "numpy", "numba", "tinygrad", "torch", "onnxruntime", "kiln/numpy", "achieved", "limit", "target", "status")


def table(rows: list[Row]) -> str:
  cells = [list(COLS)]
  for r in rows:
    cells.append([r.work, _fmt(r.kiln, r.unit), _fmt(r.numpy, r.unit), _fmt(r.numba, r.unit), _fmt(r.tinygrad, r.unit),
                  _fmt(r.torch, r.unit), _fmt(r.onnxruntime, r.unit),
                  f"{r.ratio:.2f}x" if r.ratio is not None else "-", r.achieved or "-", r.limit or "-", r.target or "-",
                  r.status + ("~" if r.spread else "")])
  w = [max(len(c[i]) for c in cells) for i in range(len(COLS))]
  lines = ["  ".join(c[i].ljust(w[i]) if i in (0, 9, 10) else c[i].rjust(w[i]) for i in range(len(COLS))) for c in cells]
  lines.insert(1, "  ".join("-" * x for x in w))
  return "\n".join(lines)
