"""How far apart the cores this process runs on are: the round trip of one cache line between two threads.

A split kernel hands work between cores: the post, the chunk counter every claim bounces, the count of calls left, and
the data one kernel wrote on one core and the next reads on another. Its cost follows this number. On one die two cores
trade a line in well under 100 ns; across dies or sockets, or on a VM whose host places its vCPUs apart, it takes
several times that, and a small model's split kernels slow with it while one thread's work does not (a 2-vCPU VM
measured 67 ns and 330-530 ns in turns, and a small CNN's run on two threads went from 0.75 ms to 1.4 ms with it).
Benchmarks print it beside their timings (`kiln bench`'s header, the zoo's rounds) so that a slow run can be told from
a far placement."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from functools import cache

import llvmlite.binding as llvm

from kiln.runtime.cpu.compiler import jit_ir
from kiln.runtime.cpu.spin import cycles_per_us, spin_round_ir

# two threads take turns on one int32: `parity` 0 moves it from even to odd, 1 from odd to even, `trips` times each;
# a wait longer than `ticks` cycles (or rounds, where the counter does not run) gives up. Returns the turns taken.
_IR = """
{decl}
declare i64 @llvm.readcyclecounter()
define i32 @kiln_trade(ptr %cell, i32 %parity, i32 %trips, i64 %ticks) {{
entry:
  %t0 = call i64 @llvm.readcyclecounter()
  br label %turn
turn:
  %k = phi i32 [0, %entry], [%k1, %mine]
  %twice = shl i32 %k, 1
  %want = add i32 %twice, %parity
  br label %wait
wait:
  %i = phi i64 [0, %turn], [%i1, %late_check]
  %v = load atomic i32, ptr %cell acquire, align 4
  %ours = icmp eq i32 %v, %want
  br i1 %ours, label %mine, label %late_check
late_check:
{give_up}
  br i1 %stop, label %out, label %wait
mine:
  %next = add i32 %v, 1
  store atomic i32 %next, ptr %cell release, align 4
  %k1 = add i32 %k, 1
  %more = icmp ult i32 %k1, %trips
  br i1 %more, label %turn, label %out
out:
  %done = phi i32 [%k, %late_check], [%k1, %mine]
  ret i32 %done
}}
"""

TIMEOUT_US = 50_000  # a trade the other thread does not answer in this long (its CPU busy elsewhere) is no measurement


@cache
def _trade() -> tuple[llvm.ExecutionEngine, Callable[[int, int, int, int], int]]:
  decl, give_up = spin_round_ir()
  engine = jit_ir(_IR.format(decl=decl, give_up=give_up), 2)
  fn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64)(
    engine.get_function_address("kiln_trade"))
  return engine, fn


def round_trip_ns(trips: int = 10_000, tries: int = 3) -> float | None:
  """The best of `tries` measurements of one cache line's round trip between this thread and another, in nanoseconds
  (the OS places the two threads; with two CPUs free they run on two). None where this process may use one CPU only, or
  when the other thread did not answer within TIMEOUT_US (its CPU taken by other work)."""
  try: cpus = len(os.sched_getaffinity(0))
  except AttributeError: cpus = os.cpu_count() or 1
  if cpus < 2 or trips < 1: return None
  rate = cycles_per_us()
  ticks = int(TIMEOUT_US * rate) if rate > 0 else 1 << 40
  got = [t for _ in range(tries) if (t := _trade_once(trips, ticks)) is not None]
  return min(got) if got else None


def _trade_once(trips: int, ticks: int) -> float | None:
  """One measurement: this thread and a new one trade a fresh line `trips` times each; ns a round trip, None if either gave up."""
  fn = _trade()[1]
  cell = (ctypes.c_int32 * 16)()  # a line of its own
  addr, answered, ready = ctypes.addressof(cell), [0], threading.Event()

  def answer() -> None:
    ready.set()
    answered[0] = fn(addr, 1, trips, ticks)

  peer = threading.Thread(target=answer, daemon=True)
  peer.start()
  ready.wait()  # not the thread's start in the time
  t = time.perf_counter()
  mine = fn(addr, 0, trips, ticks)
  elapsed = time.perf_counter() - t
  peer.join()
  return elapsed / trips * 1e9 if mine == trips and answered[0] == trips else None
