"""kiln on a real NVIDIA GPU: what scripts/gpu-check runs there (nothing here runs without one).

  python gpu_check.py info         the device, driver, toolkit
  python gpu_check.py conformance  every conformance kernel compiled for this GPU, run, compared with the reference evaluator
  python gpu_check.py plans        executor plans on CUDA: matmul + relu, softmax, reductions, against numpy
  python gpu_check.py probes       driver probes, each in its own process: exit status 0 at process end with no pycuda
                                   complaint, plans run from worker threads, two runtimes' contexts, a fault's report
  python gpu_check.py tiled        the tiled matmul kernels (SIMT and tensor cores) at edge shapes, against float64
  python gpu_check.py sass         nvcc's registers/spills and the instructions in the tiled matmuls (cuobjdump)
  python gpu_check.py mixed        a plan with CPU and CUDA kernels and copies between them (gpu_mixed.py)
  python gpu_check.py launch       per-kernel cost of a 200-kernel plan (gpu_launch.py)
  python gpu_check.py mmatune      tensor-core tilings timed against each other and torch (what kiln.codegen.choose.tiling follows)
  python gpu_check.py bench[:ROWS] kiln against torch on this GPU (see gpu_bench.py)

scripts/gpu-check runs them all, and compute-sanitizer's memcheck and racecheck over conformance and tiled.

Each section prints one line per check ("ok"/"FAIL ...") and exits non-zero when any check failed."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

FAILS: list[str] = []


def check(name: str, fn: Callable[[], str | None]) -> None:
  t0 = time.perf_counter()
  try:
    msg = fn()
    print(f"ok    {name} ({time.perf_counter() - t0:.2f} s){': ' + msg if msg else ''}", flush=True)
  except BaseException as e:  # a check's failure is reported, and the others still run
    FAILS.append(name)
    print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)


def info() -> None:
  from kiln.runtime.cuda.compiler import find_nvcc, nvcc_version
  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")
  d = rt.dev
  print(f"device: {d.name()} cc {d.compute_capability()} arch {rt.arch}, {d.total_memory() >> 20} MiB,"
        f" driver {rt.drv.get_driver_version()}, nvcc {nvcc_version(find_nvcc() or 'nvcc')}")
  attrs = rt.drv.device_attribute
  print(f"  SMs {d.get_attribute(attrs.MULTIPROCESSOR_COUNT)}, L2 {d.get_attribute(attrs.L2_CACHE_SIZE) >> 20} MiB,"
        f" smem/block optin {d.get_attribute(attrs.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) >> 10} KiB")


def _run_spec(rt, spec, bufs: dict[int, np.ndarray], vals: list[int] | None = None) -> float:
  """Compile and load spec, run it once on copies of bufs (slot -> host array) and copy every buffer back into its array;
  the kernel's seconds (CUDA events)."""
  prog = rt.load(rt.compiler.compile(spec))
  order = list(spec.globals) if spec.globals else sorted(bufs)
  dev = {s: rt.allocator.alloc(max(1, bufs[s].nbytes)) for s in order}
  try:
    for s in order: rt.allocator.copyin(dev[s], memoryview(np.ascontiguousarray(bufs[s])).cast("B"))
    t = prog([dev[s].ptr for s in order], vals or [], wait=True)
    for s in order: rt.allocator.copyout(memoryview(bufs[s]).cast("B"), dev[s])
  finally:
    for s in order: rt.allocator.free(dev[s], max(1, bufs[s].nbytes))
  return float(t or 0.0)


def conformance() -> None:
  from kiln.codegen.conformance import cases, for_spec, mismatches
  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")
  for case in cases():
    def one(case=case) -> str | None:
      spec = rt.renderer.render(case.ast, case.opts)
      bufs = case.fresh()
      _run_spec(rt, spec, dict(enumerate(bufs)), [case.var_vals[n] for n in spec.var_names])
      if errs := mismatches(for_spec(case, spec.applied_opts), bufs): raise AssertionError("\n".join(errs[:8]))
      return None
    check(f"conformance {case.name}", one)
  rt.synchronize()


def _plan(build: Callable, feeds: dict, want: Callable) -> Callable[[], str]:
  def run() -> str:
    plan, ins, out = build()
    for k, v in feeds.items(): ins[k].copyin(v)
    plan.execute()
    got = out.numpy()
    ref = want(**feeds)
    err = float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
    if not err < 1e-5 or not np.isfinite(got).all(): raise AssertionError(f"relative error {err:.3g}")
    return f"rel err {err:.2g}"
  return run


def _f32_out(ast):
  """A float16 matmul whose float32 sum is stored as float32 (no rounding to half: the check sees the sum's own error)."""
  from kiln.ir import UOp
  from kiln.ir.dtype import dtypes
  from kiln.ir.ops import Ops
  st = ast.src[0]
  g = st.src[0].src[0]
  g32 = UOp(Ops.DEFINE_GLOBAL, dtypes.float32.ptr(g.dtype.size), (), g.arg)
  red = st.src[1].src[0]
  return UOp.sink(g32.index(st.src[0].src[1]).store(red), name="matmul16")


def plans() -> None:
  from kiln.executor import Buffer, ExecutionPlanBuilder
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  from kiln.ir.ops import Ops
  rng = np.random.default_rng(0)

  def mm(m: int, n: int, k: int) -> Callable:
    def build():
      b = ExecutionPlanBuilder("CUDA")
      x, w = b.add_buffer(Buffer("CUDA", m * k, dtypes.float32)), b.add_buffer(Buffer("CUDA", k * n, dtypes.float32))
      h, y = b.add_buffer(Buffer("CUDA", m * n, dtypes.float32)), b.add_buffer(Buffer("CUDA", m * n, dtypes.float32))
      b.add_kernel(kernels.matmul(m, n, k), [h, x, w])
      b.add_kernel(kernels.elementwise(lambda v: v.maximum(0.0), dtypes.float32, ((m * n,), dtypes.float32), name="relu"), [y, h])
      b.set_outputs([y])
      plan = b.build()
      return plan, {"a": plan_buf(plan, b, x), "b": plan_buf(plan, b, w)}, plan_buf(plan, b, y)
    return build

  def plan_buf(plan, b, i):  # the Buffer the builder holds for id i
    return b.buffers[i]

  for m, n, k in ((64, 64, 64), (1000, 300, 700), (1024, 1024, 1024), (129, 67, 250)):
    a, bb = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    check(f"plan matmul+relu {m}x{n}x{k}", _plan(mm(m, n, k), {"a": a, "b": bb},
                                                  lambda a, b: np.maximum(a.astype(np.float64) @ b, 0).reshape(-1)))
  for m, n, k, batch in ((256, 128, 64, ()), (1000, 136, 520, ()), (64, 64, 64, (3,)), (4096, 4096, 4096, ())):
    a16 = rng.standard_normal((*batch, m, k)).astype(np.float16)
    b16 = rng.standard_normal((*batch, k, n)).astype(np.float16)
    def build16(m=m, n=n, k=k, batch=batch):
      b = ExecutionPlanBuilder("CUDA")
      nb = int(np.prod(batch)) if batch else 1
      x, w = b.add_buffer(Buffer("CUDA", nb * m * k, dtypes.float16)), b.add_buffer(Buffer("CUDA", nb * k * n, dtypes.float16))
      y = b.add_buffer(Buffer("CUDA", nb * m * n, dtypes.float32))
      ast = kernels.matmul(m, n, k, dtypes.float16, batch=batch, acc_dtype=dtypes.float32)
      b.add_kernel(_f32_out(ast), [y, x, w])
      b.set_outputs([y])
      return b.build(), {"a": b.buffers[x], "b": b.buffers[w]}, b.buffers[y]
    check(f"plan matmul f16->f32 {batch}{m}x{n}x{k}", _plan(build16, {"a": a16, "b": b16},
                                                            lambda a, b: (a.astype(np.float64) @ b.astype(np.float64)).reshape(-1)))

  def single(ast, shape_in, shape_out, ref, name):
    x = rng.standard_normal(shape_in).astype(np.float32)
    def build():
      b = ExecutionPlanBuilder("CUDA")
      i = b.add_buffer(Buffer("CUDA", int(np.prod(shape_in)), dtypes.float32))
      o = b.add_buffer(Buffer("CUDA", int(np.prod(shape_out)), dtypes.float32))
      b.add_kernel(ast, [o, i])
      b.set_outputs([o])
      return b.build(), {"x": b.buffers[i]}, b.buffers[o]
    check(name, _plan(build, {"x": x}, lambda x: ref(x.astype(np.float64)).reshape(-1)))

  def sm(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  for rows, cols in ((8192, 128), (4096, 1024), (100, 3000)):
    single(kernels.softmax((rows, cols), dtypes.float32), (rows, cols), (rows, cols), sm, f"plan softmax {rows}x{cols}")
    single(kernels.reduce(Ops.ADD, (rows, cols), dtypes.float32, axes=1), (rows, cols), (rows,), lambda x: x.sum(1),
           f"plan row sum {rows}x{cols}")
  for n in (1 << 24, 1000003):
    single(kernels.reduce(Ops.ADD, (n,), dtypes.float32), (n,), (1,), lambda x: x.sum(keepdims=True), f"plan full sum {n}")
  single(kernels.elementwise(lambda v: v.exp2(), dtypes.float32, ((1 << 22,), dtypes.float32), name="exp2"), (1 << 22,),
         (1 << 22,), np.exp2, "plan exp2 4M")


def _tiled_cases():
  """(name, m, n, k, batch, dtype) of the tiled matmul shapes checked on the device: edges off every tile size, batches,
  each input dtype."""
  return [("simt-odd", 129, 67, 250, (), "float32"), ("simt-small", 16, 16, 16, (), "float32"), ("simt-batch", 100, 96, 72, (2, 3), "float32"),
          ("simt-big", 1024, 1024, 1024, (), "float32"), ("mma-f16", 1000, 136, 520, (), "float16"), ("mma-f16-batch", 64, 64, 64, (3,), "float16"),
          ("mma-bf16", 256, 256, 256, (), "bfloat16"), ("mma-f16-edge", 130, 264, 40, (), "float16"), ("simt-f16-odd", 33, 45, 27, (), "float16"),
          ("tf32", 520, 264, 200, (), "float32-tf32"), ("tf32-big", 4096, 4096, 4096, (), "float32-tf32")]


def tiled() -> None:
  """The tiled matmul kernels (render/cuda_matmul.py) straight through the runtime, outputs poisoned first, against float64."""
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")
  rng = np.random.default_rng(1)
  small = os.environ.get("KILN_GPU_CHECK_SMALL") == "1"  # under compute-sanitizer: the big shapes would take minutes
  for name, m, n, k, batch, dt in _tiled_cases():
    if small and m * n * k > 1 << 26: continue
    def one(m=m, n=n, k=k, batch=batch, dt=dt) -> str:
      tf32 = dt == "float32-tf32"  # opt-in TF32 tensor cores for a float32 product
      os.environ["KILN_CUDA_TF32"] = "1" if tf32 else "0"
      dt = "float32" if tf32 else dt
      kdt = getattr(dtypes, dt)
      spec = rt.renderer.render(kernels.matmul(m, n, k, kdt, batch=batch, acc_dtype=dtypes.float32))
      a32, b32 = rng.standard_normal((*batch, m, k)).astype(np.float32), rng.standard_normal((*batch, k, n)).astype(np.float32)
      if dt == "bfloat16":
        a, b = (a32.view(np.uint32) >> 16).astype(np.uint16), (b32.view(np.uint32) >> 16).astype(np.uint16)
        a64, b64 = (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64), (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        out = np.full((*batch, m, n), 0xFFFF, np.uint16)
      else:
        a, b = a32.astype(dt), b32.astype(dt)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        out = np.full((*batch, m, n), np.nan, dt)
      t = _run_spec(rt, spec, {spec.outs[0]: out, spec.ins[0]: a, spec.ins[1]: b})
      got = (out.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dt == "bfloat16" else out.astype(np.float64)
      ref = a64 @ b64
      err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
      tol = 2e-3 if tf32 else {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dt]
      if tf32 and not spec.applied_opts[0].startswith("TILED_MATMUL(tf32"): raise AssertionError(f"not TF32: {spec.applied_opts}")
      if not np.isfinite(got).all() or not err < tol: raise AssertionError(f"{spec.applied_opts}: rel err {err:.3g} (tol {tol})")
      return f"{spec.applied_opts[0]} rel err {err:.2g}, {t * 1e6:.0f} us"
    check(f"tiled {name} {batch}{m}x{n}x{k} {dt}", one)
  os.environ.pop("KILN_CUDA_TF32", None)
  for dt in ("float32", "float16"):
    check(f"tiled epilogue bias+gelu+residual (2,)520x264x200 {dt}", lambda dt=dt: _epilogue_case(rt, rng, dt))


def _epilogue_case(rt, rng, dt: str, m: int = 520, n: int = 264, k: int = 200, nb: int = 2) -> str:
  """out = gelu(A @ B + bias) + res, batched, as kiln-graph fuses a linear layer: the tiled kernel's epilogue on the device."""
  import math

  from kiln.ir import UOp
  from kiln.ir.dtype import dtypes
  from kiln.ir.ops import AxisType, Ops
  f32, kdt = dtypes.float32, getattr(dtypes, dt)
  bi, i, j, kk = UOp.range(nb, 0), UOp.range(m, 1), UOp.range(n, 2), UOp.range(k, 3, AxisType.REDUCE)
  a = UOp.define_global(1, kdt.ptr(nb * m * k)).index(bi * (m * k) + i * k + kk).load()
  b = UOp.define_global(2, kdt.ptr(nb * k * n)).index(bi * (k * n) + kk * n + j).load()
  acc = (a.cast(f32) * b.cast(f32)).reduce(Ops.ADD, kk) if kdt != f32 else (a * b).reduce(Ops.ADD, kk)
  x = acc + UOp.define_global(3, f32.ptr(n)).index(j).load()
  res = UOp.define_global(4, kdt.ptr(nb * m * n)).index(bi * (m * n) + i * n + j).load()
  v = x * 0.5 * ((x * 0.7071067811865476).erf() + 1.0) + (res.cast(f32) if kdt != f32 else res)
  ast = UOp.sink(UOp.define_global(0, kdt.ptr(nb * m * n)).index(bi * (m * n) + i * n + j).store(v.cast(kdt)), name="linear_gelu")
  spec = rt.renderer.render(ast)
  if not spec.applied_opts[0].startswith("TILED_MATMUL"): raise AssertionError(f"not tiled: {spec.applied_opts}")
  host = {1: rng.standard_normal((nb, m, k)).astype(dt), 2: rng.standard_normal((nb, k, n)).astype(dt),
          3: rng.standard_normal(n).astype(np.float32), 4: rng.standard_normal((nb, m, n)).astype(dt), 0: np.full((nb, m, n), np.nan, dt)}
  _run_spec(rt, spec, host)
  xr = host[1].astype(np.float64) @ host[2].astype(np.float64) + host[3]
  ref = xr * 0.5 * (np.vectorize(math.erf)(xr / math.sqrt(2)) + 1) + host[4].astype(np.float64)
  err = float(np.abs(host[0].astype(np.float64) - ref).max() / np.abs(ref).max())
  if not np.isfinite(host[0]).all() or not err < (1e-5 if dt == "float32" else 4e-3): raise AssertionError(f"{spec.applied_opts}: error {err:.3g}")
  return f"{spec.applied_opts[0]}: max error {err:.2g} of the largest output"


def sass() -> None:
  """What nvcc made of the tiled matmuls: registers, spills, and the instructions that should be there (cuobjdump)."""
  import shutil
  import tempfile

  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")
  nvcc = shutil.which("nvcc") or "nvcc"
  for s, dt in ((4096, "float32"), (1024, "float32"), (4096, "float16"), (4096, "bfloat16")):
    def one(s=s, dt=dt) -> str:
      spec = rt.renderer.render(kernels.matmul(s, s, s, getattr(dtypes, dt), acc_dtype=dtypes.float32))
      with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.cu", "w") as f: f.write(spec.src)
        r = subprocess.run([nvcc, f"-arch={rt.arch}", "-cubin", "-o", f"{d}/k.cubin", "--resource-usage", f"{d}/k.cu"],
                           capture_output=True, text=True)
        if r.returncode: raise AssertionError(r.stderr[-2000:])
        sass = subprocess.run([os.path.join(os.path.dirname(nvcc), "cuobjdump"), "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
      use = [ln.split(" : ", 1)[-1].strip() for ln in r.stderr.splitlines() if "Used" in ln or "spill" in ln]
      counts = {i: sass.count(i) for i in ("HMMA", "FFMA", "LDSM", "LDGSTS", "LDG.E.128", "LDS.128", "LDL", "STL")}
      if counts["LDL"] or counts["STL"]: raise AssertionError(f"local memory in the inner loop: {counts}")
      return f"{spec.applied_opts[0]}: {'; '.join(use)}; {counts}"
    check(f"sass matmul {s} {dt}", one)


MMA_PEAK_SRC = r"""
extern "C" __global__ void __launch_bounds__(256) mma_peak(float* out, int iters) {
  // 8 independent m16n8k16 accumulations per warp on register operands: the tensor cores' issue rate, no memory traffic
  unsigned a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x ^ 5u, 7u}, b[2] = {threadIdx.x * 11u, 13u};
  float d[8][4] = {};
  for (int it = 0; it < iters; it++) {
    #pragma unroll
    for (int q = 0; q < 8; q++)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(d[q][0]), "+f"(d[q][1]), "+f"(d[q][2]), "+f"(d[q][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  float s = 0.f;
  for (int q = 0; q < 8; q++) s += d[q][0] + d[q][1] + d[q][2] + d[q][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def mmapeak() -> None:
  """The rate mma.sync m16n8k16 (float16 in, float32 sums) issues at on this GPU with no memory traffic: the ceiling of
  kiln's tensor-core matmul, against which its measured rate and torch's (wgmma on Hopper) are read."""
  import struct

  import torch

  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")

  def one() -> str:
    _, binary = rt.compiler.compile_src(MMA_PEAK_SRC, "mma_peak")
    sms = rt.target().gpu_sms or 132
    out = torch.empty(sms * 4 * 256, device="cuda")
    iters = 4096
    with rt.current():
      fn = rt.drv.module_from_buffer(binary).get_function("mma_peak")
      args = struct.pack("=Qi", out.data_ptr(), iters)
      t = _time_events(lambda: fn._launch_kernel((sms * 4, 1, 1), (256, 1, 1), args, 0, None))
    flops = sms * 4 * 8 * 8 * iters * 2 * 16 * 8 * 16  # blocks x warps x mmas per iteration x iterations x 2mnk
    return f"{flops / t / 1e12:.0f} TFLOP/s ({t * 1e3:.2f} ms)"
  check("mma.sync peak", one)


def mmatune() -> None:
  """Times tensor-core tilings of the float16 matmul against each other and torch (events, median of 20 after warm-up)."""
  from kiln.codegen.choose.tiling import Tiling
  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")
  variants = [Tiling("mma", 128, 128, 32, 2, 4, 2), Tiling("mma", 128, 128, 32, 2, 4, 3), Tiling("mma", 128, 128, 64, 2, 2, 3, 8),
              Tiling("mma", 128, 128, 64, 2, 2, 4, 8), Tiling("mma", 128, 256, 64, 2, 4, 3), Tiling("mma", 128, 256, 64, 2, 4, 3, 8),
              Tiling("mma", 128, 256, 64, 2, 4, 3, 16), Tiling("mma", 128, 256, 64, 2, 4, 4, 8), Tiling("mma", 256, 128, 64, 4, 2, 4, 8)]
  sizes = [int(x) for x in os.environ.get("KILN_MMATUNE_SIZES", "2048,4096,8192").split(",")]
  for s_ in sizes: _mmatune_size(rt, s_, variants)


def _time_events(fn: Callable[[], object]) -> float:
  """Median seconds of fn between two CUDA events (torch's), 20 times after 3 warm-ups."""
  import statistics

  import torch
  for _ in range(3): fn()
  ts = []
  for _ in range(20):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    ts.append(e0.elapsed_time(e1) * 1e-3)
  return statistics.median(ts)


def _mmatune_size(rt, size: int, variants: list) -> None:
  import struct

  import torch

  from kiln.codegen.render.cuda_matmul import covers, program
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  drv = rt.drv
  a = torch.randn(size, size, device="cuda", dtype=torch.float16)
  b = torch.randn(size, size, device="cuda", dtype=torch.float16)
  out = torch.empty(size, size, device="cuda", dtype=torch.float16)
  ref = a.float() @ b.float()
  tt = _time_events(lambda: a @ b)
  print(f"f16 {size}: torch {tt * 1e6:.0f} us ({2 * size ** 3 / tt / 1e12:.0f} TFLOP/s)", flush=True)
  for t in variants:
    def one(t=t) -> str:
      ast = kernels.matmul(size, size, size, dtypes.float16, acc_dtype=dtypes.float32)
      c = covers(ast, rt.target())
      assert c is not None
      spec = program(ast, c, t, "mm")
      binary = rt.compiler.compile(spec).bytes
      with rt.current():
        fn = drv.module_from_buffer(binary).get_function("mm")
        if spec.shared_bytes: fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.shared_bytes)
        grid, block = tuple(int(x) for x in spec.global_size), tuple(int(x) for x in spec.local_size)
        args = struct.pack("=QQQ", out.data_ptr(), a.data_ptr(), b.data_ptr())
        out.fill_(float("nan"))
        fn._launch_kernel(grid, block, args, spec.shared_bytes, None)
        torch.cuda.synchronize()
        err = float((out.float() - ref).norm() / ref.norm())
        tk = _time_events(lambda: fn._launch_kernel(grid, block, args, spec.shared_bytes, None))
      if not err < 2e-3: raise AssertionError(f"rel err {err}")
      return f"{tk * 1e6:.0f} us ({2 * size ** 3 / tk / 1e12:.0f} TFLOP/s, {tt / tk:.2f}x torch), err {err:.1e}"
    check(f"mma {size} {t}", one)


PROBE = r"""
import sys, threading, numpy as np
from kiln.executor import Buffer, ExecutionPlanBuilder
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
what = sys.argv[1]
def run_plan(n=4096):
  b = ExecutionPlanBuilder("CUDA")
  i, o = b.add_buffer(Buffer("CUDA", n, dtypes.float32)), b.add_buffer(Buffer("CUDA", n, dtypes.float32))
  b.add_kernel(kernels.elementwise(lambda v: v * 2.0 + 1.0, dtypes.float32, ((n,), dtypes.float32), name="affine"), [o, i])
  b.set_outputs([o])
  plan = b.build()
  x = np.arange(n, dtype=np.float32)
  b.buffers[i].copyin(x)
  plan.execute()
  got = b.buffers[o].numpy()
  assert (got == x * 2 + 1).all(), got[:8]
  return plan
def in_thread(fn):
  err = []
  def body():
    try: fn()
    except BaseException as e: err.append(e)
  t = threading.Thread(target=body); t.start(); t.join()
  if err: raise err[0]
if what == "main_thread": run_plan()
elif what == "worker_threads":
  plan = run_plan()
  in_thread(run_plan)
  in_thread(plan.execute)
  ts = [threading.Thread(target=run_plan) for _ in range(4)]
  [t.start() for t in ts]; [t.join() for t in ts]
elif what == "two_runtimes":
  from kiln.runtime.cuda.driver import CUDARuntime
  a, b = CUDARuntime("CUDA:0"), CUDARuntime("CUDA:0")
  x = a.allocator.alloc(64); y = b.allocator.alloc(64)
  a.allocator.copyin(x, memoryview(bytearray(range(64)))); b.allocator.copy(y, x, 64)
  out = bytearray(64); b.allocator.copyout(memoryview(out), y)
  assert out == bytearray(range(64))
  in_thread(lambda: a.allocator.free(x, 64)); b.allocator.free(y, 64)
  run_plan()
elif what == "torch_first":  # the user's torch already made the primary context current
  import torch
  t = torch.ones(10, device="cuda")
  run_plan()
  assert float(t.sum()) == 10
elif what == "fault":
  from kiln.ir import UOp
  from kiln.ir.errors import DeviceError
  from kiln.runtime.cuda.driver import CUDARuntime
  rt = CUDARuntime("CUDA:0")
  src = 'extern "C" __global__ void bad(float* p) { p[threadIdx.x] = 1.0f; }'
  from kiln.runtime.cuda.compiler import CUDACompiler
  _, binary = rt.compiler.compile_src(src, "bad")
  mod = None
  try:
    with rt.current():
      mod = rt.drv.module_from_buffer(binary); fn = mod.get_function("bad")
      import struct
      fn._launch_kernel((1, 1, 1), (1, 1, 1), struct.pack("=Q", 0), 0, None)
    rt.synchronize()
    raise AssertionError("the fault was not reported")
  except DeviceError as e:
    assert "illegal" in str(e).lower() and "dead" in str(e), e
    print("reported:", e)
  try:
    run_plan(); raise AssertionError("a plan ran on a dead context")
  except Exception as e: print("after the fault:", type(e).__name__, str(e)[:200])
  sys.exit(0)
print(what, "ok")
"""


def probes() -> None:
  for what in ("main_thread", "worker_threads", "two_runtimes", "torch_first", "fault"):
    def one(what=what) -> str:
      r = subprocess.run([sys.executable, "-c", PROBE, what], capture_output=True, text=True, timeout=300)
      bad = [ln for ln in r.stderr.splitlines() if "PyCUDA" in ln or "pycuda" in ln.lower() and "warn" in ln.lower()]
      if what == "fault":  # after a sticky error pycuda's own destructors warn that they could not unload from the dead context
        bad = [ln for ln in bad if "clean-up operation failed" not in ln]
      if r.returncode != 0 or bad: raise AssertionError(f"exit {r.returncode}; stdout {r.stdout[-800:]!r}; stderr {r.stderr[-1500:]!r}")
      return r.stdout.strip().splitlines()[-1][:200] if r.stdout.strip() else ""
    check(f"probe {what}", one)


def mixed() -> None:
  """A plan with CPU and CUDA kernels and copies between them (gpu_mixed.py), against numpy."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import gpu_mixed
  check("mixed CPU/CUDA plan", gpu_mixed.mixed_plan_check)


def launch() -> None:
  """Per-kernel cost of a 200-kernel CUDA plan (gpu_launch.py); the target is 5 us."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import gpu_launch

  def one() -> str:
    r = gpu_launch.launch_overhead()
    if not r["output_ok"]: raise AssertionError(f"the chain's output is wrong: {r}")
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
  check("launch overhead", one)


def main(argv: list[str]) -> int:
  os.environ.setdefault("KILN_CACHE_DIR", "/tmp/kiln-gpu-cache")
  sections = {"info": info, "conformance": conformance, "plans": plans, "probes": probes, "tiled": tiled, "sass": sass,
              "mmatune": mmatune, "mmapeak": mmapeak,
              "mixed": mixed, "launch": launch}
  for what in argv or ["info", "conformance", "plans", "probes"]:
    if what.startswith("bench"):  # bench, or bench:ROWS (rows whose names contain ROWS: add, row, soft, mm, launch)
      sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
      import gpu_bench
      gpu_bench.main(what.split(":")[1:])
      continue
    print(f"== {what}", flush=True)
    sections[what]()
  print(f"{len(FAILS)} failed" + (": " + ", ".join(FAILS) if FAILS else ""))
  return 1 if FAILS else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
