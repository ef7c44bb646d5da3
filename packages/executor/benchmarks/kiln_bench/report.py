"""kiln's benchmark: kiln beside numpy (and numba parallel, tinygrad CPU, torch and onnxruntime where importable) in ONE run, against the
performance targets of issues 7 and 14 and this machine's measured limits (memory bandwidth and FMA peak on the kiln threads).

Every kiln result is checked against numpy before it is timed: a wrong answer is a failure, never a fast number.
A row's contenders (kiln, numpy, the peers) are timed together in interleaved rounds, one warmed block each a round
(shared machines drift over seconds); a time is the median of all its calls, a ratio the median of the rounds' ratios,
and --json keeps every contender's median per round.
Exit code: 1 when a result is wrong, or a target is missed by more than 20% (unless --no-fail); else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kiln_bench.bench import Bench
from kiln_bench.harness import GB
from kiln_bench.isa import SETTINGS as ISA_SETTINGS
from kiln_bench.isa import describe as isa_held
from kiln_bench.limits import vector_lanes
from kiln_bench.table import SLACK, table


def blas_info() -> str:
  env = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
  envs = ", ".join(f"{k}={v}" for k, v in env.items())
  held = isa_held() is not None
  warn = f"  WARNING: {envs} is set: numpy's OpenBLAS may run a slower kernel (scripts/bench unsets it)" if env and not held else ""
  try:
    from threadpoolctl import threadpool_info
    libs = [f"{i.get('internal_api')} {i.get('version')} kernel {i.get('architecture') or '?'}, {i.get('num_threads')} threads"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return (f"numpy {np.__version__}, BLAS: {'; '.join(libs) or 'none found'}" + ("" if env else " (OPENBLAS_CORETYPE/L2_SIZE unset)")) + warn
  except ImportError: return f"numpy {np.__version__}, BLAS: unknown (threadpoolctl not installed)" + warn


def main(argv: list[str] | None, groups: Sequence[Callable[[Bench], None]]) -> int:
  """The benchmark's command line: run `groups` (each a row module's run(bench), in the order they print), print the
  machine, the peers, the limits and the table, and return the exit code."""
  ap = argparse.ArgumentParser(prog="kiln bench-suite", description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="a short run: fewer repetitions (noisier medians)")
  ap.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON")
  ap.add_argument("--no-fail", action="store_true", help="exit 0 even when a target is missed (wrong results still fail)")
  ap.add_argument("--only", metavar="PATTERN", help="run only the rows whose work matches PATTERN (a regular expression, any case)")
  ap.add_argument("--isa", choices=sorted(ISA_SETTINGS), help="hold kiln and its peers to this ISA (run.py applies it before any import)")
  ap.add_argument("--sizes-scale", type=float, default=1.0, help=argparse.SUPPRESS)  # tests: tiny sizes
  args = ap.parse_args(argv)
  if args.sizes_scale <= 0: ap.error("--sizes-scale must be positive")
  from kiln.codegen.threads import core_trip_ns
  from kiln.executor.cache import cpu_name
  b = Bench(args)
  t0, load0 = time.perf_counter(), os.getloadavg()[0]
  trips = [core_trip_ns()]
  b.run(groups)
  trips.append(core_trip_ns())
  lanes, isa = vector_lanes()
  print(f"kiln bench-suite{' --quick' if args.quick else ''}{f' (sizes x{args.sizes_scale:g})' if args.sizes_scale != 1 else ''}: "
        f"{cpu_name()}, {os.cpu_count()} cores, {isa}; kiln on {b.threads} threads (KILN_THREADS)")
  print(f"  {blas_info()}")
  if args.isa and isa_held() is None: print(f"  WARNING: --isa {args.isa} was not applied (run the bench through run.py or scripts/bench)")
  if (held := isa_held()) is not None: print(f"  {held}")
  load = max(load0, os.getloadavg()[0])
  if load > (os.cpu_count() or 1) * 0.75:
    print(f"  WARNING: load average {load:.1f} on {os.cpu_count()} cores: other work shares the CPU, so multi-threaded times (numpy's "
          "OpenBLAS, numba, kiln's threads) are unreliable; rerun on a quiet machine for numbers to quote")
  for k in ("numba", "tinygrad", "torch", "onnxruntime"): print(f"  {k}: {b.peers.notes.get(k, '?')}")
  print(f"  limit, memory read: {b.bw / GB:.1f} GB/s ({b.info['memory_bandwidth']['how']})")
  print(f"  limit, memory add: {b.bw_add / GB:.1f} GB/s ({b.info['add_bandwidth']['how']})")
  print(f"  limit, compute: {f'{b.peak / GB:.0f} GFLOP/s' if b.peak else '?'} float32 ({b.info['fma_peak']['how']})")
  print(f"  limit, hand-off between cores: {' and '.join('-' if t is None else f'{t:.0f} ns' for t in trips)} a cache line's round trip "
        "(before and after the rows; a VM placed on distant cores takes several times its usual, and split kernels slow with it)")
  rounds = f"{b.t.min_rounds}-{b.t.rounds}" if b.t.min_rounds < b.t.rounds else f"{b.t.rounds}"
  print(f"  times: medians of warm calls, every contender of a row timed in the same interleaved rounds ({rounds}; one "
        "warmed block each a round, the order rotating); kiln/numpy and the targets' ratios: the median over rounds of each round's ratio "
        "(numpy's time / kiln's, >1 is kiln faster); a status marked ~: the rounds one by one would judge differently (see notes)\n")
  print(table(b.rows))
  notes = [(r.work, r.note) for r in b.rows if r.note]
  if notes:
    print("\nnotes:")
    for w, n in notes: print(f"  {w}: {n}")
  wrong = [r for r in b.rows if r.status in ("WRONG", "ERROR")]
  missed = [r for r in b.rows if r.status == "MISS"]
  near = [r for r in b.rows if r.status == "NEAR"]
  passed = [r for r in b.rows if r.status == "PASS"]
  print(f"\n{len(passed)} targets passed, {len(near)} missed by <= {SLACK:.0%} (NEAR), {len(missed)} missed by more (MISS), "
        f"{len(wrong)} wrong or failed; {time.perf_counter() - t0:.0f} s")
  rc = 1 if wrong or (missed and not args.no_fail) else 0
  if args.json:
    Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "threads": b.threads, "quick": args.quick, "sizes_scale": args.sizes_scale,
                                           "blas": blas_info(), "isa": isa_held(), "peers": b.peers.notes, "limits": b.info,
                                           "rows": [asdict(r) for r in b.rows], "exit_code": rc}, indent=1))
  return rc

