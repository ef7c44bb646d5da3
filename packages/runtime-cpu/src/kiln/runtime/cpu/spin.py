"""The worker pool's brief spin: a few lines of native code that wait, with the GIL released, until new work is posted,
the spin time is up, or no plan has run for that long. Inside a plan the next kernel is certain to come within
microseconds, and a spinning worker picks it up at once instead of being woken through the kernel's scheduler; after
the last plan ends a worker spins on only until the spin time has passed since that end, so a next `execute()` soon
after (a serving loop, a benchmark's next run) finds it awake, and kiln burns at most that much CPU a worker after a run
(docs/architecture.md, "The thread split"). Outside plans (a bare bound call) a worker sleeps at once.

KILN_SPIN_US (default 100) is how long a worker spins after a kernel, and after the last plan ends; 0 turns spinning off."""
from __future__ import annotations

import ctypes
import platform
import time
from collections.abc import Callable
from functools import cache

import llvmlite.binding as llvm

from kiln.runtime.cpu import settings
from kiln.runtime.cpu.compiler import jit_ir

ENDED_OFFSET = 8  # bytes past the running-plans count (running.py): the cycle counter when the last plan ended

# a pause on x86 (eases the core's pipeline and its sibling hyperthread), a yield hint on arm64, nothing elsewhere
_RELAX = {"x86_64": ("declare void @llvm.x86.sse2.pause()", "call void @llvm.x86.sse2.pause()"),
          "aarch64": ("declare void @llvm.aarch64.hint(i32)", "call void @llvm.aarch64.hint(i32 1)")}

_IR = """
{decl}
declare i64 @llvm.readcyclecounter()
; spin until *gen != seen (1), no plan runs and the last one ended `ticks` ago (0: *active == 0 and the cycle counter
; passed the int64 at active + ENDED_OFFSET by `ticks`), or `ticks` of the cycle counter have passed (0); at most `ticks` rounds
; too, so a counter that does not run cannot make it spin for ever
define i32 @kiln_spin(ptr %gen, i32 %seen, ptr %active, i64 %ticks) {{
entry:
  %t0 = call i64 @llvm.readcyclecounter()
  %endp = getelementptr i8, ptr %active, i64 {ended}
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i1, %wait]
  %g = load atomic i32, ptr %gen monotonic, align 4
  %posted = icmp ne i32 %g, %seen
  br i1 %posted, label %work, label %plan
plan:
  %a = load atomic i32, ptr %active monotonic, align 4
  %idle = icmp eq i32 %a, 0
  br i1 %idle, label %ended, label %wait
ended:
  %e = load atomic i64, ptr %endp monotonic, align 8
  %tn = call i64 @llvm.readcyclecounter()
  %since = sub i64 %tn, %e
  %long = icmp uge i64 %since, %ticks
  br i1 %long, label %sleep, label %wait
wait:
{give_up}
  br i1 %stop, label %sleep, label %loop
work:
  ret i32 1
sleep:
  ret i32 0
}}
define i64 @kiln_cycles() {{
  %t = call i64 @llvm.readcyclecounter()
  ret i64 %t
}}
"""


def spin_us() -> int:
  """KILN_SPIN_US: microseconds a worker spins after a kernel inside a plan (0: never)."""
  return settings.SPIN_US.get()


# one round of a bounded spin: the hint, then %stop once `ticks` cycles since %t0 (or `ticks` rounds, %i counting them,
# should the counter not run) have passed; %i1 is the next round's count
_GIVE_UP = """  {relax}
  %t = call i64 @llvm.readcyclecounter()
  %spent = sub i64 %t, %t0
  %i1 = add i64 %i, 1
  %late = icmp uge i64 %spent, %ticks
  %many = icmp uge i64 %i1, %ticks
  %stop = or i1 %late, %many"""


def spin_round_ir() -> tuple[str, str]:
  """(declaration of this machine's spin-wait hint, one bounded spin round's IR: _GIVE_UP); ("", plain rounds) where the
  machine has no hint."""
  arch = platform.machine().lower()
  decl, relax = _RELAX.get("aarch64" if arch == "arm64" else arch, ("", ""))
  return decl, _GIVE_UP.format(relax=relax)


def spin_ir() -> str:
  """The IR of kiln_spin and kiln_cycles for this machine."""
  decl, give_up = spin_round_ir()
  return _IR.format(decl=decl, give_up=give_up, ended=ENDED_OFFSET)


@cache
def _cycle_code() -> tuple[llvm.ExecutionEngine, Callable[[int, int, int, int], int], Callable[[], int]]:
  # codegen level 0: these few lines are loads, pauses and a counter read, and O2's 15-25 ms of code generation came
  # straight out of the first split kernel's call in every process
  engine = jit_ir(spin_ir(), 0)
  spin = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64)(
    engine.get_function_address("kiln_spin"))
  cycles = ctypes.CFUNCTYPE(ctypes.c_int64)(engine.get_function_address("kiln_cycles"))
  return engine, spin, cycles


def spin_address() -> int:
  """Where the compiled kiln_spin is: the native pool's waits call this one, not a copy of their own."""
  return _cycle_code()[0].get_function_address("kiln_spin")  # type: ignore[no-any-return]


def cycles() -> int:
  """The cycle counter now (what kiln_spin compares with)."""
  return _cycle_code()[2]()  # type: ignore[no-any-return]


@cache
def cycles_per_us() -> float:
  """The cycle counter's rate, measured once against the monotonic clock over 2 ms (0 where the counter does not run)."""
  cycles = _cycle_code()[2]
  t0, c0 = time.perf_counter(), cycles()
  time.sleep(0.002)
  t1, c1 = time.perf_counter(), cycles()
  return max(c1 - c0, 0) / max((t1 - t0) * 1e6, 1e-9)


class Spinner:
  """The compiled spin and the cycle counter's rate (measured once, against the monotonic clock over 2 ms):
  `wait(gen, seen, active)` returns True when new work was posted while it spun."""

  def __init__(self, us: int):
    self.fn = _cycle_code()[1]
    self.ticks = int(us * cycles_per_us())  # 0 where the counter does not run: no spin

  def wait(self, gen: int, seen: int, active: int) -> bool:
    """Spin (GIL released) until the int32 at `gen` is no longer `seen` (True), or time is up, or the int32 at `active`
    is 0 and the cycle counter is `ticks` past the int64 at active + ENDED_OFFSET (when the last plan ended)."""
    return self.ticks > 0 and bool(self.fn(gen, seen, active, self.ticks))
