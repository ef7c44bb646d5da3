"""This machine's limits, measured: memory bandwidth (numpy STREAM-like, and hand-written LLVM IR read and add kernels), FMA
peak (a hand-written LLVM IR kernel) and a bare ctypes call. The hand-written kernels are compiled and run by kiln's CPU
runtime, found through the device registry, on its threads."""
from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kiln.ir import kernels
from kiln_bench.harness import F32, GB, MB, Timing, aligned_empty, launch_sizes, per_call, warm


def thread_count() -> int:
  """The CPU runtime's thread count, asked through the device registry (the executor never imports a runtime)."""
  try:
    from kiln.codegen.registry import get_runtime
    return int(get_runtime("CPU").target.threads)  # type: ignore[attr-defined]
  except Exception: return os.cpu_count() or 1


def memory_bandwidth(n: int, threads: int, t: Timing) -> tuple[float, str]:
  """STREAM-like copy, add and read (a sum) on `threads` threads (numpy releases the GIL in its loops), counting the bytes
  read and written (no write-allocate), best of runs like STREAM; the limit is the best of the three. Returns (bytes/s, how)."""
  a, b, c = (np.random.default_rng(9).random(n, dtype=np.float32) for _ in range(3))
  parts = [slice(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
  best = {}
  with ThreadPoolExecutor(threads) as ex:
    for name, op, nbytes in (("copy", lambda s: np.copyto(c[s], a[s]), 8 * n), ("add", lambda s: np.add(a[s], b[s], out=c[s]), 12 * n),
                             ("read", lambda s: np.add.reduce(a[s]), 4 * n)):
      def run(op=op) -> None: list(ex.map(op, parts))
      best[name] = nbytes / _best(run, t)
  k = max(best, key=lambda x: best[x])
  each = ", ".join(f"{x} {v / GB:.1f}" for x, v in best.items())
  return best[k], f"STREAM-like {k} of {n * 4 / MB:.0f} MB arrays on {threads} threads, best of runs ({each} GB/s)"


def vector_lanes() -> tuple[int, str]:
  """float32 lanes of the CPU kiln compiles for (KILN_CPU, else the host: the runtime's Target), so the limit kernels use the
  same vectors as the kernels they are compared with; the host's flags only when no CPU runtime answers."""
  names = {64: "AVX-512", 32: "AVX2", 16: "128-bit SIMD"}
  try:
    from kiln.codegen.registry import get_runtime
    from kiln.runtime.cpu import settings as cpu_settings
    vb = int(get_runtime("CPU").target.vector_bytes)  # type: ignore[attr-defined]
    if vb in names: return vb // 4, names[vb] + (f" (KILN_CPU={cpu})" if (cpu := cpu_settings.CPU.get()) else "")
  except Exception: pass  # noqa: S110  (fall back to the host's flags below)
  from kiln.executor.cache import cpu_fingerprint
  flags = set(cpu_fingerprint().partition("|")[2].split())
  if "avx512f" in flags: return 16, "AVX-512"
  if "avx2" in flags or "avx" in flags: return 8, "AVX2" if "avx2" in flags else "AVX"
  return 4, "128-bit SIMD"


def _handwritten(name: str, body: list[str], decls: str, lanes: int, n: int, threads: int, inputs: int = 1) -> Any:
  """Compile a hand-written LLVM IR chunk (data0 out, data1.. in, core_id: the chunk) with kiln's CPU runtime, one chunk
  per thread, claimed as kiln's split kernels claim theirs (render.llvm_claim.claim_loop's ABI: slot, claim counter), reusing
  the signature of a template elementwise kernel of n elements cut into `threads` chunks. The bench's machine limits are
  measured this way."""
  from kiln.codegen.choose import Opt, OptOps
  from kiln.codegen.registry import get_runtime
  from kiln.codegen.render.llvm_claim import claim_loop
  params = [f"ptr noalias align 4 %data{i}" for i in range(inputs + 1)]
  attrs = f'nounwind "prefer-vector-width"="{lanes * 32}" "min-legal-vector-width"="{lanes * 32}"'
  src = "\n".join([decls, "", f"define internal void @{name}.chunk({', '.join(params)}, i32 %core_id) #1 {{", *body, "}",
                   *claim_loop(name, params, threads),
                   f"attributes #0 = {{ {attrs} }}", f"attributes #1 = {{ noinline {attrs} }}", ""])
  rt = get_runtime("CPU")
  fn = (lambda x: x * 2.0) if inputs == 1 else (lambda x, y: x + y)
  spec = rt.renderer.render(kernels.elementwise(fn, F32, *[((n,), F32)] * inputs, name=name), [Opt(OptOps.THREAD, 0, threads)])
  if spec.threads != threads or spec.scratch_bytes: raise RuntimeError(f"template kernel has {spec.threads} chunks, not {threads}")
  return rt.load(rt.compiler.compile(spec.model_copy(update={"src": src, "name": name, "entry_point": name})))


def _chunk_loop(per: int, phis: list[str], body: list[str]) -> list[str]:
  """IR for a loop of %i over this core's `per` steps (core_id * per onwards): the entry block to the exit label."""
  return (["entry:", f"  %start = mul i32 %core_id, {per}", f"  %end = add i32 %start, {per}", "  br label %loop", "loop:",
           "  %i = phi i32 [%start, %entry], [%i.next, %loop]", *phis, *body,
           "  %i.next = add nsw i32 %i, 1", "  %go = icmp slt i32 %i.next, %end", "  br i1 %go, label %loop, label %exit", "exit:"])


def _fold_store(vt: str, lanes: int, names: list[str]) -> list[str]:
  """IR adding the vectors `names` in order and storing the sum at data0[core_id * lanes], then returning."""
  lines = [f"  %s0 = fadd {vt} %{names[0]}, %{names[1]}"] + [f"  %s{c - 1} = fadd {vt} %s{c - 2}, %{names[c]}" for c in range(2, len(names))]
  return lines + [f"  %o = mul i32 %core_id, {lanes}", "  %op = getelementptr inbounds float, ptr %data0, i32 %o",
                  f"  store {vt} %s{len(names) - 2}, ptr %op, align 4", "  ret void"]


def _best(call: Callable[[], Any], t: Timing, runs: int = 0) -> float:
  """The best time of a few runs (`runs`, else from t), like STREAM: a limit, not a typical time. Warmed like medians()
  (busy, not paused)."""
  warm(call, t)
  ts = []
  for _ in range(runs or max(5, t.runs // 2)):
    st = time.perf_counter()
    call()
    ts.append(time.perf_counter() - st)
  return min(ts)


# A vector FMA's latency (cycles) and the FMA pipes a core issues to each cycle, the slowest x86 kiln targets with FMA:
# 5 on Haswell, Broadwell and Zen 1-2 (4 from Skylake and Zen 3 on), 2 pipes. latency x pipes independent chains keep
# every pipe busy; the kernel runs half as many again, so a late issue never leaves a pipe idle, as far as the
# registers allow (AVX2: 14 chains in 16 registers; 16 spilled and measured half the rate).
FMA_LATENCY, FMA_PIPES = 5, 2


def fma_chains(registers: int) -> int:
  """Independent accumulator chains for the FMA limit kernel on a CPU with `registers` vector registers (two hold the
  operands, the rest can hold chains without spilling)."""
  need = FMA_LATENCY * FMA_PIPES
  return min(need + need // 2, registers - 2)


def vector_registers(lanes: int) -> int:
  """Vector registers of the CPU kiln compiles for (the runtime's Target); 32 for 16 float lanes, else 16, without one."""
  try:
    from kiln.codegen.registry import get_runtime
    return int(get_runtime("CPU").target.vector_registers)  # type: ignore[attr-defined]
  except Exception: return 32 if lanes == 16 else 16


def fma_peak(threads: int, t: Timing, seconds: float = 0.005) -> tuple[float, str]:
  """Peak float32 FMA rate, measured: a hand-written kernel of independent vector FMA chains (no memory traffic) compiled
  and run by kiln's CPU runtime on its threads, one chunk per core_id, every thread running the same count. The count
  is read from the input at entry and calibrated so one call runs about `seconds`, best of at least 10 calls: on a
  2-core Zen 3 the old fixed count (half a millisecond a call) measured 95-160 GFLOP/s where calls of 2 ms and more
  measured 190-196, 2 x 32 flop/cycle at its 3.05 GHz (thread wake-up and the clock ramp were counted against the
  FMAs). Longer calls do not help on a shared machine: another process's time slice then lands in every call.
  Returns (flop/s, how)."""
  lanes, isa = vector_lanes()
  chains = fma_chains(vector_registers(lanes))
  vt = f"<{lanes} x float>"
  lines = ["entry:", f"  %a = load {vt}, ptr %data1, align 4", f"  %bp = getelementptr inbounds float, ptr %data1, i32 {lanes}",
           f"  %b = load {vt}, ptr %bp, align 4", f"  %np = getelementptr inbounds float, ptr %data1, i32 {2 * lanes}",
           "  %iters = load i32, ptr %np, align 4", "  br label %loop", "loop:", "  %i = phi i32 [0, %entry], [%i.next, %loop]"]
  lines += [f"  %x{c} = phi {vt} [%a, %entry], [%y{c}, %loop]" for c in range(chains)]
  lines += [f"  %y{c} = call {vt} @llvm.fma.v{lanes}f32({vt} %x{c}, {vt} %b, {vt} %a)" for c in range(chains)]
  lines += ["  %i.next = add nsw i32 %i, 1", "  %go = icmp slt i32 %i.next, %iters", "  br i1 %go, label %loop, label %exit", "exit:"]
  lines += _fold_store(vt, lanes, [f"y{c}" for c in range(chains)])
  n = 1 << 20  # big enough that the template kernel is split over every thread
  prog = _handwritten("kiln_fma_peak", lines, f"declare {vt} @llvm.fma.v{lanes}f32({vt}, {vt}, {vt})", lanes, n, threads)
  out, inp = np.zeros(n, np.float32), np.full(n, 0.5, np.float32)
  inp[lanes:2 * lanes] = 0.25  # x' = 0.25 x + 0.5 converges to 2/3: no overflow, no denormals
  count = inp[2 * lanes:2 * lanes + 1].view(np.int32)  # the loop's trip count, read once on entry
  call = prog.bind([out.ctypes.data, inp.ctypes.data], [], *launch_sizes(prog.spec))
  count[0] = 1 << 14
  warm(call, t)
  probe = min(_timed(call) for _ in range(3))
  count[0] = iters = int(min(max(count[0] * seconds / probe, 1 << 14), 1 << 30))
  dt = _best(call, t, max(10, t.runs))
  if not np.allclose(out[:lanes * threads], (chains * 2 / 3), rtol=1e-3): raise RuntimeError(f"FMA kernel computed {out[:4]}")
  flops = 2 * lanes * chains * iters * threads
  return flops / dt, f"{isa} FMA kernel ({chains} chains of {lanes} lanes, {dt * 1e3:.0f} ms a call) run by kiln on {threads} threads"


def _timed(call: Callable[[], Any]) -> float:
  st = time.perf_counter()
  call()
  return time.perf_counter() - st


def add_bandwidth(n: int, threads: int, t: Timing) -> tuple[float, str]:
  """STREAM add (c = a + b, counting 12 bytes an element), measured: a hand-written kernel of aligned vector loads and
  streaming stores (no read-for-ownership of c), run by kiln's CPU runtime on its threads. Returns (bytes/s, how)."""
  lanes, isa = vector_lanes()
  vt = f"<{lanes} x float>"
  n = max(1, n // (threads * lanes)) * threads * lanes
  per = n // threads // lanes
  lines = _chunk_loop(per, [], [f"  %o = mul i32 %i, {lanes}",
                               "  %pa = getelementptr inbounds float, ptr %data1, i32 %o", f"  %va = load {vt}, ptr %pa, align 64",
                               "  %pb = getelementptr inbounds float, ptr %data2, i32 %o", f"  %vb = load {vt}, ptr %pb, align 64",
                               f"  %vc = fadd {vt} %va, %vb", "  %pc = getelementptr inbounds float, ptr %data0, i32 %o",
                               f"  store {vt} %vc, ptr %pc, align 64, !nontemporal !{{i32 1}}"])
  lines += ["  call void @llvm.x86.sse.sfence()", "  ret void"]
  prog = _handwritten("kiln_add_bw", lines, "declare void @llvm.x86.sse.sfence()", lanes, n, threads, inputs=2)
  c, a, b = aligned_empty(n), aligned_empty(n), aligned_empty(n)
  a[:], b[:] = 1.0, 2.0
  dt = _best(prog.bind([c.ctypes.data, a.ctypes.data, b.ctypes.data], [], *launch_sizes(prog.spec)), t)
  if not (c == 3.0).all(): raise RuntimeError("the STREAM add kernel computed a wrong result")
  return 12 * n / dt, f"STREAM add with streaming stores of {4 * n / MB:.0f} MB arrays run by kiln on {threads} threads"


def read_bandwidth(n: int, threads: int, t: Timing) -> tuple[float, str]:
  """Read bandwidth, measured: a hand-written kernel summing its core's share of n float32 into 8 independent vector
  accumulators (no stores in the loop), run by kiln's CPU runtime on its threads. Returns (bytes/s, how)."""
  lanes, isa = vector_lanes()
  accs, vt = 8, f"<{lanes} x float>"
  step = accs * lanes
  n = max(1, n // (threads * step)) * threads * step  # whole steps on every thread
  per = n // threads // step
  body = [f"  %base = mul i32 %i, {step}"]
  for c in range(accs):
    body += [f"  %o{c} = add i32 %base, {c * lanes}", f"  %p{c} = getelementptr inbounds float, ptr %data1, i32 %o{c}",
             f"  %v{c} = load {vt}, ptr %p{c}, align 4", f"  %b{c} = fadd {vt} %a{c}, %v{c}"]
  lines = _chunk_loop(per, [f"  %a{c} = phi {vt} [zeroinitializer, %entry], [%b{c}, %loop]" for c in range(accs)], body)
  lines += _fold_store(vt, lanes, [f"b{c}" for c in range(accs)])
  prog = _handwritten("kiln_read_bw", lines, "", lanes, n, threads)
  out, inp = np.zeros(n, np.float32), np.ones(n, np.float32)
  dt = _best(prog.bind([out.ctypes.data, inp.ctypes.data], [], *launch_sizes(prog.spec)), t)
  if not np.allclose(out[:lanes * threads].sum(), n): raise RuntimeError(f"read kernel summed {out[:lanes * threads].sum()}, not {n}")
  return 4 * n / dt, f"read: {isa} {accs}-accumulator sum of {4 * n / MB:.0f} MB run by kiln on {threads} threads"


def ctypes_call_time() -> float:
  """A bare ctypes call to a C function with one int argument: the floor under any dispatch."""
  f = ctypes.CDLL(None).abs
  f.argtypes, f.restype = [ctypes.c_int], ctypes.c_int
  return per_call(lambda: f(-1), 2000, 15)
