"""The worker pool's native loop: workers that wait for, claim and run a split kernel's calls without ever taking the
GIL, and a caller that posts a kernel, works on it and waits for it in one native call.

Why: the Python pool (`threads.WorkerPool`) hands each kernel to its workers through a queue, and every hand-off is a
GIL hand-off: a worker started 30-60 us after the post and the caller woke ~17 us after the last call (a 256 matmul, 2
threads: 213-232 us through the Python pool against 148-160 us from two plain threads). Here a worker's thread enters
`kiln_pool_worker` once and stays there: it spins on the pool's generation word while a plan runs (KILN_SPIN_US, as
`spin.py` does), else sleeps on it with a futex; a post bumps the word and wakes sleepers. Linux only (futex); where
this module cannot build its loop (`native_pool_supported()` is False) the Python pool is used.

A kernel's calls (one per claiming thread: `slot` 0..n-1) are claimed from one 64-bit word holding the post's
generation and the next call, with a compare-and-swap. A post first closes the word (its new generation, nothing to
claim), then writes its fields, then opens it: a worker that read the last post's word or fields fails its swap, and
none claims a call of a post whose fields are half written (a test of 3000 back-to-back posts caught a call run twice
before the word was closed first). The caller takes calls too and returns only when every taken call has returned
(`left` reaches 0: spin a little, then futex-wait). One kernel at a time: a second Python thread that calls while the pool
is busy sleeps until it is free (two Python threads each running a matmul plan: 88-91 ms when the second ran its
calls in place beside the pool, 3 threads on 2 cores, against 86 ms for the same calls one after another).

A call is made through the kernel's task entry, which the LLVM renderer emits beside the entry of every kernel
(`render.llvm_claim`): `NAME.task(ptr args, i32 slot)` unpacks an int64 argument block (buffers, variables, the
chunk counter, the scratch) into the entry's own argument types and calls it with `slot`. `kiln_pool_run_seq` runs a
plan's stretch of kernels through their task entries in one call (sequence.py)."""
from __future__ import annotations

import ctypes
import os
import platform
import re
import threading
from collections.abc import Callable, Sequence
from functools import cache

import llvmlite.binding as llvm
import numpy as np

from kiln.runtime.cpu.compiler import init_llvm, jit_ir
from kiln.runtime.cpu.spin import spin_address

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_LIBC_SYMBOLS = ("syscall", "sched_getcpu", "sched_getaffinity", "sched_setaffinity")

# the pool's shared words, each group on a 64-byte line of its own (every claim writes WORD, every call's end LEFT)
GEN, SLEEPERS, STOP = 0, 4, 8  # posts so far (the workers' futex word), workers asleep, 1: workers return
TASK, ARGS, NCALLS, CPU = 64, 72, 80, 84  # the post: the kernel's task entry, its argument block, calls, the caller's CPU
WORD = 128  # (generation << 32) | next call to claim
LEFT, WAITING = 192, 196  # calls not yet returned (the caller's futex word), 1: the caller sleeps on LEFT
BUSY = 256  # 0 free, 1 while a caller's post runs, 2 with another caller asleep for it
# each word's name in the IR below (a pointer to it in the pool) and its offset
_FIELDS = {"gen": ("genp", GEN), "sleepers": ("sleepp", SLEEPERS), "stop": ("stopp", STOP), "task": ("taskp", TASK),
           "args": ("argsp", ARGS), "ncalls": ("ncp", NCALLS), "cpu": ("cpup", CPU), "word": ("wordp", WORD), "left": ("leftp", LEFT),
           "waiting": ("waitp", WAITING), "busy": ("busyp", BUSY)}
POOL_BYTES = 320

_IR = """
declare i32 @kiln_spin(ptr, i32, ptr, i64)
declare i64 @syscall(i64, ...)
declare i32 @sched_getcpu()
declare i32 @sched_getaffinity(i32, i64, ptr)
declare i32 @sched_setaffinity(i32, i64, ptr)
declare i64 @llvm.vector.reduce.or.v16i64(<16 x i64>)
declare i64 @llvm.readcyclecounter()

define private void @futex_wait(ptr %a, i32 %v) {{
  %v64 = zext i32 %v to i64
  %r = call i64 (i64, ...) @syscall(i64 {futex}, ptr %a, i64 128, i64 %v64, ptr null)
  ret void
}}
define private void @futex_wake(ptr %a, i32 %n) {{
  %n64 = zext i32 %n to i64
  %r = call i64 (i64, ...) @syscall(i64 {futex}, ptr %a, i64 129, i64 %n64)
  ret void
}}

; a worker woken onto its caller's CPU moves off it (threads.step_aside says why): narrow the mask past that CPU, then
; put the mask back, so the thread stays free to move later
define private void @step_aside(ptr %pool) {{
entry:
{geps:cpu}
  %cpu = load atomic i32, ptr %cpup seq_cst, align 4
  %here = call i32 @sched_getcpu()
  %same = icmp eq i32 %here, %cpu
  %inmask = icmp ult i32 %cpu, 1024
  %both = and i1 %same, %inmask
  br i1 %both, label %move, label %stay
move:
  %allowed = alloca <16 x i64>, align 64
  %rc = call i32 @sched_getaffinity(i32 0, i64 128, ptr %allowed)
  %failed = icmp ne i32 %rc, 0
  br i1 %failed, label %stay, label %narrow
narrow:
  %mask = load <16 x i64>, ptr %allowed, align 64
  %word = lshr i32 %cpu, 6
  %bit = and i32 %cpu, 63
  %bit64 = zext i32 %bit to i64
  %one = shl i64 1, %bit64
  %w = extractelement <16 x i64> %mask, i32 %word
  %cleared = xor i64 %one, -1
  %w1 = and i64 %w, %cleared
  %others = insertelement <16 x i64> %mask, i64 %w1, i32 %word
  %any = call i64 @llvm.vector.reduce.or.v16i64(<16 x i64> %others)
  %none = icmp eq i64 %any, 0
  br i1 %none, label %stay, label %set
set:
  %omask = alloca <16 x i64>, align 64
  store <16 x i64> %others, ptr %omask, align 64
  %r1 = call i32 @sched_setaffinity(i32 0, i64 128, ptr %omask)
  %r2 = call i32 @sched_setaffinity(i32 0, i64 128, ptr %allowed)
  br label %stay
stay:
  ret void
}}

; take calls of post %g until none is left or a newer post replaced it
define private void @claim_calls(ptr %pool, i32 %g) {{
entry:
{geps:word,task,args,ncalls,left,waiting}
  br label %loop
loop:
  %w = load atomic i64, ptr %wordp seq_cst, align 8
  %wg64 = lshr i64 %w, 32
  %wg = trunc i64 %wg64 to i32
  %same = icmp eq i32 %wg, %g
  br i1 %same, label %check, label %done
check:
  %next = trunc i64 %w to i32
  %nc = load atomic i32, ptr %ncp seq_cst, align 4
  %more = icmp slt i32 %next, %nc
  br i1 %more, label %take, label %done
take:
  %task = load atomic ptr, ptr %taskp seq_cst, align 8
  %args = load atomic ptr, ptr %argsp seq_cst, align 8
  %w1 = add i64 %w, 1
  %cx = cmpxchg ptr %wordp, i64 %w, i64 %w1 seq_cst seq_cst
  %ok = extractvalue {{ i64, i1 }} %cx, 1
  br i1 %ok, label %call, label %loop
call:
  call void %task(ptr %args, i32 %next)
  %old = atomicrmw sub ptr %leftp, i32 1 seq_cst
  %last = icmp eq i32 %old, 1
  br i1 %last, label %last_call, label %loop
last_call:
  %wt = load atomic i32, ptr %waitp seq_cst, align 4
  %asleep = icmp ne i32 %wt, 0
  br i1 %asleep, label %wake, label %loop
wake:
  call void @futex_wake(ptr %leftp, i32 1)
  br label %loop
done:
  ret void
}}

; a worker's whole life: run posts as they come; spin for the next one only while a plan runs (*plans != 0), for at most
; %ticks of the cycle counter (and %ticks rounds, should the counter not run), else sleep on the generation word
define void @kiln_pool_worker(ptr %pool, ptr %plans, i64 %ticks, i32 %seen0) {{
entry:
{geps:gen,sleepers,stop}
  br label %top
top:
  %seen = phi i32 [ %seen0, %entry ], [ %seen, %slept ], [ %gw, %worked ]
  %woke = phi i1 [ true, %entry ], [ true, %slept ], [ false, %worked ]
  %stop = load atomic i32, ptr %stopp seq_cst, align 4
  %stopping = icmp ne i32 %stop, 0
  br i1 %stopping, label %exit, label %look
look:
  %g = load atomic i32, ptr %genp seq_cst, align 4
  %posted = icmp ne i32 %g, %seen
  br i1 %posted, label %work, label %spin
spin:
  %came = call i32 @kiln_spin(ptr %genp, i32 %seen, ptr %plans, i64 %ticks)
  %now = icmp ne i32 %came, 0
  br i1 %now, label %spun, label %sleep
spun:
  %g2 = load atomic i32, ptr %genp seq_cst, align 4
  br label %work
sleep:
  %s0 = atomicrmw add ptr %sleepp, i32 1 seq_cst
  %g3 = load atomic i32, ptr %genp seq_cst, align 4
  %stop3 = load atomic i32, ptr %stopp seq_cst, align 4
  %quiet = icmp eq i32 %g3, %seen
  %run = icmp eq i32 %stop3, 0
  %wait = and i1 %quiet, %run
  br i1 %wait, label %do_sleep, label %awake
do_sleep:
  call void @futex_wait(ptr %genp, i32 %seen)
  br label %awake
awake:
  %s1 = atomicrmw sub ptr %sleepp, i32 1 seq_cst
  br label %slept
slept:
  br label %top
work:
  %gw = phi i32 [ %g, %look ], [ %g2, %spun ]
  br i1 %woke, label %aside, label %claim
aside:
  call void @step_aside(ptr %pool)
  br label %claim
claim:
  call void @claim_calls(ptr %pool, i32 %gw)
  br label %worked
worked:
  br label %top
exit:
  ret void
}}

; post a kernel's %n calls, take calls too, return when all have returned. One post at a time: a caller that finds the
; pool busy (another Python thread's kernel) sleeps until it is free (%busy: 0 free, 1 held, 2 held with sleepers: a
; futex mutex as in Drepper's "Futexes Are Tricky")
define void @kiln_pool_run(ptr %pool, ptr %task, ptr %args, i32 %n, i64 %ticks) {{
entry:
{geps:gen,sleepers,busy,left,waiting}
  %cx = cmpxchg ptr %busyp, i32 0, i32 1 seq_cst seq_cst
  %c0 = extractvalue {{ i32, i1 }} %cx, 0
  %free = icmp eq i32 %c0, 0
  br i1 %free, label %post, label %contend
contend:
  %is2 = icmp eq i32 %c0, 2
  br i1 %is2, label %lock_wait, label %lock_xchg
lock_xchg:
  %c1 = atomicrmw xchg ptr %busyp, i32 2 seq_cst
  %got1 = icmp eq i32 %c1, 0
  br i1 %got1, label %post, label %lock_wait
lock_wait:
  call void @futex_wait(ptr %busyp, i32 2)
  %c2 = atomicrmw xchg ptr %busyp, i32 2 seq_cst
  %got2 = icmp eq i32 %c2, 0
  br i1 %got2, label %post, label %lock_wait
post:
{geps:task,args,ncalls,cpu,word}
  %g0 = load atomic i32, ptr %genp seq_cst, align 4
  %g = add i32 %g0, 1
  %g64 = zext i32 %g to i64
  %w = shl i64 %g64, 32
  ; closed first (no call to claim): a worker that read the last post's word cannot claim once it changes, and none
  ; can claim this post's calls before its fields are written
  %closed = or i64 %w, 2147483647
  store atomic i64 %closed, ptr %wordp seq_cst, align 8
  %cpu = call i32 @sched_getcpu()
  store atomic ptr %task, ptr %taskp seq_cst, align 8
  store atomic ptr %args, ptr %argsp seq_cst, align 8
  store atomic i32 %n, ptr %ncp seq_cst, align 4
  store atomic i32 %cpu, ptr %cpup seq_cst, align 4
  store atomic i32 %n, ptr %leftp seq_cst, align 4
  store atomic i32 0, ptr %waitp seq_cst, align 4
  store atomic i64 %w, ptr %wordp seq_cst, align 8
  store atomic i32 %g, ptr %genp seq_cst, align 4
  %s = load atomic i32, ptr %sleepp seq_cst, align 4
  %any = icmp sgt i32 %s, 0
  br i1 %any, label %wake, label %work
wake:
  %others = sub i32 %n, 1
  call void @futex_wake(ptr %genp, i32 %others)
  br label %work
work:
  call void @claim_calls(ptr %pool, i32 %g)
  br label %spin
spin:
  ; the last calls end soon: spin while `left` keeps changing (%busyp, ours and non-zero, keeps kiln_spin going), then sleep
  %l = load atomic i32, ptr %leftp seq_cst, align 4
  %done = icmp eq i32 %l, 0
  br i1 %done, label %finish, label %spin_wait
spin_wait:
  %moved = call i32 @kiln_spin(ptr %leftp, i32 %l, ptr %busyp, i64 %ticks)
  %again = icmp ne i32 %moved, 0
  br i1 %again, label %spin, label %block
block:
  store atomic i32 1, ptr %waitp seq_cst, align 4
  br label %block_loop
block_loop:
  %l2 = load atomic i32, ptr %leftp seq_cst, align 4
  %done2 = icmp eq i32 %l2, 0
  br i1 %done2, label %finish, label %block_wait
block_wait:
  call void @futex_wait(ptr %leftp, i32 %l2)
  br label %block_loop
finish:
  %u = atomicrmw sub ptr %busyp, i32 1 seq_cst
  %contended = icmp ne i32 %u, 1
  br i1 %contended, label %unlock_wake, label %out
unlock_wake:
  store atomic i32 0, ptr %busyp seq_cst, align 4
  call void @futex_wake(ptr %busyp, i32 1)
  br label %out
out:
  ret void
}}

; a plan's stretch of kernels, one after another, in one call from Python: %n steps of STEP_WORDS int64 words each (the
; kernel's task entry, its argument block, its chunk counter or 0 for an unsplit kernel, its calls | finish << 32). A
; split kernel's counter is zeroed, its calls run over the pool (the caller alone when there is one), then its
; finishing call (slot -1) when it has one. %pool is only read for a kernel of more than one call. %times, unless null,
; gets the cycle counter before the first step and after each (n + 1 words): a profile without Python's overhead.
define void @kiln_pool_run_seq(ptr %pool, ptr %steps, i32 %n, i64 %ticks, ptr %times) {{
entry:
  %timed = icmp ne ptr %times, null
  call void @stamp(i1 %timed, ptr %times, i32 0)
  br label %loop
loop:
  %i = phi i32 [ 0, %entry ], [ %i1, %next ]
  %more = icmp slt i32 %i, %n
  br i1 %more, label %body, label %out
body:
  %i64 = zext i32 %i to i64
  %at = mul i64 %i64, {step_words}
  %taskp = getelementptr i64, ptr %steps, i64 %at
  %task = load ptr, ptr %taskp, align 8
  %blockp = getelementptr i64, ptr %taskp, i64 1
  %block = load ptr, ptr %blockp, align 8
  %claimp = getelementptr i64, ptr %taskp, i64 2
  %claim = load ptr, ptr %claimp, align 8
  %wordp = getelementptr i64, ptr %taskp, i64 3
  %word = load i64, ptr %wordp, align 8
  %calls = trunc i64 %word to i32
  %fin64 = lshr i64 %word, 32
  %split = icmp ne ptr %claim, null
  br i1 %split, label %reset, label %alone
reset:
  store atomic i32 0, ptr %claim seq_cst, align 4
  %many = icmp sgt i32 %calls, 1
  br i1 %many, label %pooled, label %alone
pooled:
  call void @kiln_pool_run(ptr %pool, ptr %task, ptr %block, i32 %calls, i64 %ticks)
  br label %finish
alone:
  call void %task(ptr %block, i32 0)
  br label %finish
finish:
  %fin = icmp ne i64 %fin64, 0
  br i1 %fin, label %last, label %next
last:
  call void %task(ptr %block, i32 -1)
  br label %next
next:
  %i1 = add i32 %i, 1
  call void @stamp(i1 %timed, ptr %times, i32 %i1)
  br label %loop
out:
  ret void
}}

define private void @stamp(i1 %timed, ptr %times, i32 %at) {{
entry:
  br i1 %timed, label %write, label %out
write:
  %c = call i64 @llvm.readcyclecounter()
  %at64 = zext i32 %at to i64
  %p = getelementptr i64, ptr %times, i64 %at64
  store i64 %c, ptr %p, align 8
  br label %out
out:
  ret void
}}
"""
STEP_WORDS = 4  # a sequence step's int64 words (kiln_pool_run_seq)


def native_pool_supported() -> bool:
  """Whether this platform gets the native loop: Linux (futex, sched_getcpu) on x86-64 or AArch64."""
  return os.name == "posix" and platform.system() == "Linux" and platform.machine().lower() in _SYS_FUTEX


@cache
def _loop_code() -> tuple[llvm.ExecutionEngine, int, int, int]:
  """The compiled worker loop and run calls, once per process: (engine, kiln_pool_worker, kiln_pool_run,
  kiln_pool_run_seq)."""
  init_llvm()
  libc = ctypes.CDLL(None)
  for name in _LIBC_SYMBOLS: llvm.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
  llvm.add_symbol("kiln_spin", spin_address())  # spin.py's, compiled once (the pool measures the cycle rate with it anyway)
  arch = platform.machine().lower()
  # {geps:a,b}: the pointers to those words, as the function that holds it names them
  geps = lambda m: "\n".join(f"  %{_FIELDS[f][0]} = getelementptr i8, ptr %pool, i64 {_FIELDS[f][1]}" for f in m.group(1).split(","))  # noqa: E731
  # codegen level 0: the loop is atomics, calls and a futex; O2 spent 25-35 ms generating it, O0 8-10 ms, paid by the
  # first split kernel of every process
  engine = jit_ir(re.sub(r"\{geps:([\w,]+)\}", geps, _IR).format(futex=_SYS_FUTEX[arch], step_words=STEP_WORDS), 0)
  return engine, *(engine.get_function_address(f"kiln_pool_{f}") for f in ("worker", "run", "run_seq"))  # type: ignore[return-value]


_WORKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32)
_RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64)
_RUN_SEQ = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p)


@cache
def run_sequence() -> Callable[[int, int, int, int, int | None], None]:
  """kiln_pool_run_seq(pool, steps, n, ticks, times): a plan's stretch of kernels in one native call (sequence.py builds
  the steps)."""
  return _RUN_SEQ(_loop_code()[3])


class NativePool:
  """`size - 1` workers in the native loop, the caller working too. `spin` as for the Python pool: microseconds a
  worker spins for the next post while a plan runs (0: it sleeps at once). `wait_us`: how long the caller spins for its
  last calls to return before it sleeps."""

  def __init__(self, size: int, spin: int = 0, plans_address: int | None = None, wait_us: int = 200):
    from kiln.runtime.cpu.running import plans_running_address
    from kiln.runtime.cpu.spin import cycles_per_us
    self.size = size
    raw = np.zeros(POOL_BYTES + 64, np.uint8)
    self._raw = raw  # the shared words; kept alive as long as the pool (its workers read them for ever)
    self.address = raw.ctypes.data + (-raw.ctypes.data % 64)
    _, worker, run, _ = _loop_code()
    self._run = _RUN(run)
    rate = cycles_per_us()
    self._spin_ticks, self.wait_ticks = int(spin * rate), max(int(wait_us * rate), 1)
    plans = plans_address if plans_address is not None else plans_running_address()
    loop = _WORKER(worker)
    self.workers = [threading.Thread(target=loop, args=(self.address, plans, self._spin_ticks, 0), name=f"kiln-cpu-{i}",
                                     daemon=True) for i in range(size - 1)]
    for w in self.workers: w.start()

  def run_task(self, task: int, args: int, calls: int) -> None:
    """Run `task(args, slot)` for slots 0..calls-1 over the pool; returns when every call has returned. `task` is a split
    kernel's task entry, `args` its int64 argument block. While another Python thread's kernel has the pool, this one
    waits its turn (GIL released): two kernels at once would put more threads than cores on the kernels' chunks."""
    self._run(self.address, task, args, calls, self.wait_ticks)

  def run_kernel(self, fn: Callable[..., object], args: Sequence[tuple], task: int, block: int) -> None:
    """A split kernel's calls: through its task entry over the pool; without one (object code from before there was
    one) fn(*a) for every a in args, here, one after another (the first call then claims every chunk)."""
    if task: self.run_task(task, block, len(args))
    else:
      for a in args: fn(*a)

  def close(self, timeout: float = 5.0) -> None:
    """Let the workers return (they must be idle: no run in progress) and wait for them."""
    ctypes.c_int32.from_address(self.address + STOP).value = 1
    gen = ctypes.c_int32.from_address(self.address + GEN)
    gen.value = (gen.value + 1) & 0x7FFFFFFF  # a worker about to sleep on the old value then finds it changed
    libc = ctypes.CDLL(None)
    futex = _SYS_FUTEX[platform.machine().lower()]
    libc.syscall(ctypes.c_long(futex), ctypes.c_void_p(self.address + GEN), ctypes.c_long(129), ctypes.c_long(1 << 30))
    for w in self.workers: w.join(timeout)
