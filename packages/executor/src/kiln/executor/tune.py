"""Tuning: choosing a kernel's optimisation options by timing candidates (kiln.codegen.choose.search) on the plan's own buffers,
and remembering the choice per (kernel, device, compiler, machine) in the disk cache directory, so a later build of the
same plan compiles only the chosen options and searches nothing.

A build tunes the kernels added with `tune=True`, or all kernels (without explicit opts) while KILN_TUNE=1. Each search
runs within KILN_TUNE_BUDGET seconds (default 1.5; the candidate under way when it runs out finishes). The heuristic's
options are always timed first and win ties (a candidate must be TIE_MARGIN faster, confirmed by a second interleaved
timing), so tuning never makes a kernel slower than the default as measured. Every candidate's outputs are compared with
the heuristic's on the same inputs (ints exactly, floats within the fuzzer's reduction-order tolerance); one that
disagrees is discarded. Kernels whose variables are not fixed at build time keep the heuristic (no sizes to time).

Tuning writes the kernel's outputs (it runs before the plan's first execute). An output whose memory some op of the plan
reads (a read-write kernel such as x = x * 2, or a buffer an earlier op reads) is tuned on a copy, never on the original;
inputs are never written. KILN_CACHE=0 turns the stored choices off too (every build searches)."""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.codegen import diskcache
from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.choose.search import space
from kiln.codegen.registry import get_runtime, target_of
from kiln.executor import debug, settings
from kiln.executor.buffer import Buffer
from kiln.executor.cache import CachedKernel, Origin, adopt_kernel, build_kernel, cache_dir, compile_kernel_with_origin, disk_cache_enabled, disk_key
from kiln.executor.prepared import PreparedKernel
from kiln.ir.alu import from_storage
from kiln.ir.dtype import DType
from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

TIE_MARGIN = 0.03  # a candidate must be this much faster than the best so far to replace it (timing noise is ~1-2%)
_stats = {"searches": 0, "hits": 0, "timed": 0, "rejected": 0, "disagreed": 0, "entry_errors": 0, "compiles": 0}


def tune_stats() -> dict[str, int]: return dict(_stats)


def tune_enabled() -> bool: return settings.TUNE.get()


def tune_budget() -> float: return settings.TUNE_BUDGET.get()


# ---- stored choices: tuning/<sha256>.json beside the kernel entries, sealed as they are (kiln.codegen.diskcache) ----
_FORMAT = 2  # 2: a MAC over the entry (format 1 had a checksum anyone could recompute): older entries are tuned again


def _key(ast: UOp, device: str) -> str: return disk_key(ast.key, device, get_runtime(device), "tune:1")


def _area() -> diskcache.DiskCache: return diskcache.DiskCache("tuning", "tuning cache", cache_dir())


def _name(key: str) -> str: return hashlib.sha256(key.encode()).hexdigest() + ".json"


def _path(key: str) -> Path: return cache_dir() / "tuning" / _name(key)


def load_choice(ast: UOp, device: str) -> tuple[bool, list[Opt] | None]:
  """(found, options; None: the heuristic's). A missing, unsealed, forged, corrupt or foreign entry is not found (and a bad
  one removed). A forged choice could only pick options the lowering checks, but it is refused all the same."""
  if not disk_cache_enabled(): return False, None
  key = _key(ast, device)
  try:
    if (env := _area().load_json(_name(key))) is None: return False, None
    if env.get("format") != _FORMAT or env.get("key") != key: raise ValueError("key mismatch")
    if env["opts"] is None: return True, None
    return True, [Opt(OptOps[o], int(a), int(n)) for o, a, n in env["opts"]]
  except Exception as e:
    _stats["entry_errors"] += 1
    if debug.DEBUG >= 1: debug.emit(f"kiln: bad tuning entry {_name(key)} ({type(e).__name__}: {str(e)[:80]}); tuning again")
    try: _path(key).unlink()
    except OSError: pass
    return False, None


def store_choice(ast: UOp, device: str, opts: Sequence[Opt] | None) -> None:
  """Written sealed and atomically (temp file, fsync, rename); an unwritable directory only costs the next build a search."""
  if not disk_cache_enabled(): return
  key = _key(ast, device)
  body = None if opts is None else [[o.op.name, o.axis, o.amount] for o in opts]
  _area().store_json(_name(key), {"format": _FORMAT, "key": key, "opts": body})


def compile_choice(ast: UOp, device: str) -> tuple[CachedKernel, Origin, bool]:
  """The kernel with its stored choice: (kernel, origin, searched before). Without a usable choice: the heuristic's
  kernel and False (the caller searches once the plan's buffers exist). A stored list the codegen now rejects is dropped."""
  found, opts = load_choice(ast, device)
  if found and opts is not None:
    try:
      ck, origin = compile_kernel_with_origin(ast, device, opts)
      _stats["hits"] += 1
      return ck, origin, True
    except CodegenError:
      _stats["entry_errors"] += 1
      found = False
  ck, origin = compile_kernel_with_origin(ast, device)
  if found: _stats["hits"] += 1
  return ck, origin, found


# ---- the search ----
@dataclass
class TuneResult:
  opts: list[Opt] | None  # None: the heuristic's options won
  base_time: float  # seconds per call, heuristic
  best_time: float
  tried: int  # candidates timed, the heuristic included
  seconds: float  # wall time of the search


def _tolerance(ast: UOp, dt: DType) -> float:
  """The fuzzer's bound for a float store summed in another order or with FMA: eps * (16 + 4 * reduced elements)."""
  n = 1
  for u in ast.toposort():
    if u.op is Ops.REDUCE:
      n = max(n, math.prod(int(r.src[0].arg) if r.src[0].op is Ops.CONST else 1 << 16 for r in u.src[1:]))
  return dt.eps * (16 + 4 * n)  # 0 for ints: they are compared exactly anyway


def _agree(got: np.ndarray, want: np.ndarray, buf: Buffer, rtol: float) -> bool:
  dt = buf.dtype
  if not dt.is_float: return bool(np.array_equal(got, want))
  g, w = from_storage(dt, got).astype(np.float64), from_storage(dt, want).astype(np.float64)
  gn, wn, fin = np.isnan(g), np.isnan(w), np.isfinite(w)
  scale = float(np.max(np.abs(w[fin]), initial=0.0))
  with np.errstate(all="ignore"): close = np.abs(g - w) <= rtol * (np.abs(w) + scale) + 1e-30
  return bool(np.all(np.where(fin, close & np.isfinite(g), (gn & wn) | (g == w))))


def _time(call: Callable[[], Any], sync: Callable[[], Any], batches: int = 5) -> float:
  """Seconds per call: the best of a few batches of at least ~2 ms (the best, not the mean: other processes only add)."""
  t0 = time.perf_counter(); call(); sync()
  one = time.perf_counter() - t0
  n, best = max(1, min(1000, int(2e-3 / max(one, 1e-7)))), one
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(n): call()
    sync()
    best = min(best, (time.perf_counter() - t0) / n)
  return best


class _Bench:
  """One kernel's buffers for timing: the plan's own, except outputs whose contents the plan needs, which get copies
  at the same alignment (restored before each checked run, so a read-write kernel sees the same input every time)."""

  def __init__(self, pk: PreparedKernel, buffers: list[Buffer], keep: set[int]):
    self.pk = pk
    self.bufs = [buffers[i] for i in pk.buffer_indices]
    self.outs = [self.bufs[i] for i in pk.output_indices]
    self.copies: list[tuple[Buffer, Buffer]] = []
    for i in pk.output_indices:
      if pk.buffer_indices[i] not in keep: continue
      orig = self.bufs[i]
      pad = orig.ptr % 64
      scratch = Buffer(orig.device, orig.size + -(-pad // orig.dtype.itemsize) + 1, orig.dtype).view(pad, orig.size)
      scratch.copy_from(orig)
      self.copies.append((scratch, orig))
      self.bufs[i] = self.outs[pk.output_indices.index(i)] = scratch

  def restore(self) -> None:
    for scratch, orig in self.copies: scratch.copy_from(orig)

  def bind(self, ck: CachedKernel) -> Callable[[], Any]:
    p = replace(self.pk, kernel=ck, _sizes={}, bound=None)
    p.resize()
    return ck.program.bind([b.ptr for b in self.bufs], p.vals, p.global_size, p.local_size)

  def outputs(self, call: Callable[[], Any], sync: Callable[[], Any]) -> list[np.ndarray]:
    self.restore()
    call(); sync()
    return [b.numpy().copy() for b in self.outs]


def _compile(rt: Any, ast: UOp, opts: list[Opt], key: str) -> CachedKernel:
  """A candidate compiled outside the kernel cache (a loser must not fill the cache; the winner is adopted into it)."""
  ck = build_kernel(rt, ast, opts, key)
  _stats["compiles"] += 1
  return ck


def _combine(timed: dict[tuple[int, ...], float], origin: tuple[int, ...], n: int) -> tuple[int, ...]:
  """Each knob at its fastest single-change value (where that beat the heuristic)."""
  out = list(origin)
  for i in range(n):
    single = [c for c in timed if c[i] != origin[i] and all(c[j] == origin[j] for j in range(n) if j != i)]
    if single and timed[(b := min(single, key=lambda c: timed[c]))] < timed[origin]: out[i] = b[i]
  return tuple(out)


def search(pk: PreparedKernel, buffers: list[Buffer], keep: set[int], budget: float | None = None) -> TuneResult:
  """Time the kernel's candidates on its bound buffers (buffers: the plan's, allocated; keep: plan buffer indices whose
  contents must survive) and store the winner. Returns the choice; its kernel is in the kernel cache."""
  t_start = time.perf_counter()
  ast, dev = pk.ast, str(pk.device)
  rt = get_runtime(dev)
  target = target_of(dev)
  budget = tune_budget() if budget is None else budget
  deadline = t_start + budget
  if target is None or any(n not in pk.fixedvars for n in pk.kernel.var_names):
    return TuneResult(None, 0.0, 0.0, 0, 0.0)  # no space to search, or no fixed sizes to time it at
  _stats["searches"] += 1
  tiled = getattr(rt.renderer, "tiled_product", None)  # CUDA's tiled matrix product: its tiles are the space
  sp = space(ast, target, tiled(ast) if tiled is not None else None)
  order = sp.ordered()
  bench = _Bench(pk, buffers, keep)
  sync = rt.synchronize
  base_call = bench.bind(pk.kernel)
  want = bench.outputs(base_call, sync)
  rtols = [_tolerance(ast, b.dtype) for b in bench.outs]
  base_t = _time(base_call, sync)
  best: tuple[float, tuple[int, ...], CachedKernel | None] = (base_t, sp.origin, None)
  timed: dict[tuple[int, ...], float] = {sp.origin: base_t}
  queue, combined = [c for c in order if c != sp.origin], False
  while queue and time.perf_counter() < deadline:
    if not combined and sum(i != 0 for i in queue[0]) > 1:  # every single change tried: each knob's best value together next
      combined = True
      if (comb := _combine(timed, sp.origin, len(sp.knobs))) in queue: queue.remove(comb); queue.insert(0, comb)
    c = queue.pop(0)
    opts = sp.opts(c)
    try: ck = _compile(rt, ast, opts, ast.key + "|tune")
    except CodegenError: _stats["rejected"] += 1; continue
    except Exception as e:  # a backend failure on one candidate must not fail the build: the heuristic is still there
      _stats["rejected"] += 1
      if debug.DEBUG >= 1: debug.emit(f"kiln: tuning {pk.name}: {[str(o) for o in opts]} failed to compile ({type(e).__name__}: {str(e)[:80]})")
      continue
    if ck.var_names != pk.kernel.var_names or ck.globals != pk.kernel.globals or ck.outs != pk.kernel.outs: _stats["rejected"] += 1; continue
    call = bench.bind(ck)
    if not all(_agree(g, w, b, r) for g, w, b, r in zip(bench.outputs(call, sync), want, bench.outs, rtols)):
      _stats["disagreed"] += 1
      if debug.DEBUG >= 1: debug.emit(f"kiln: tuning {pk.name}: {[str(o) for o in opts]} disagrees with the heuristic's result; discarded")
      continue
    t = timed[c] = _time(call, sync)
    _stats["timed"] += 1
    if t < best[0] * (1 - TIE_MARGIN): best = (t, c, ck)
  best_t, best_c, best_ck = best
  if best_ck is not None:  # confirm against the heuristic, interleaved (a lucky batch must not win)
    win = bench.bind(best_ck)
    tb, tw = base_t, best_t
    for _ in range(3): tb, tw = min(tb, _time(base_call, sync, 2)), min(tw, _time(win, sync, 2))
    if tw < tb * (1 - TIE_MARGIN): best_t, base_t = tw, tb
    else: best_ck = None
  chosen = sp.opts(best_c) if best_ck is not None else None
  if best_ck is not None: adopt_kernel(ast, dev, chosen, best_ck)
  store_choice(ast, dev, chosen)
  res = TuneResult(chosen, base_t, best_t if chosen is not None else base_t, len(timed), time.perf_counter() - t_start)
  if debug.DEBUG >= 1:
    what = "the heuristic's options" if chosen is None else str([str(o) for o in chosen])
    debug.emit(f"kiln: tuned {pk.name}: {res.tried} candidates in {res.seconds:.2f} s, {base_t * 1e3:.3f} -> {res.best_time * 1e3:.3f} ms: {what}")
  return res
