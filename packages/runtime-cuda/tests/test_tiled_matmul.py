"""CUDA's tiled matmul kernels (kiln.codegen.render.cuda_matmul) under the CPU emulation harness against float64 products:
every SIMT tile and vector width, the tensor-core kernel at each pipeline depth, warp layout, slice depth and block order the
heuristic may pick, edges off every tile, batches, float16/bfloat16 inputs and outputs; and nvcc's report on each for sm_90
(no spills, no stack). What this cannot show: real tensor-core rounding and scheduling (tools/gpu_check.py on a GPU does)."""
from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.choose.tiling import TILES, Tiling
from kiln.codegen.render.cuda import CUDARenderer
from kiln.codegen.render.cuda_matmul import covers, program
from kiln.codegen.spec import ProgramSpec
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.uop import UOp
from kiln.runtime.cuda.compiler import find_nvcc

from .conftest import requires_cxx, requires_nvcc

emulate = pytest.importorskip("kiln.runtime.cuda.emulate")
H100 = Target(device="CUDA", vector_bytes=0, threads=1, gpu_arch=90, gpu_sms=132)
TF32 = Target(device="CUDA", vector_bytes=0, threads=1, gpu_arch=90, gpu_sms=132, allow_tf32=True)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

MMA = [Tiling("mma", 128, 128, 32, 2, 4, 2), Tiling("mma", 128, 128, 32, 2, 4, 3), Tiling("mma", 128, 256, 64, 2, 4, 3, 8),
       Tiling("mma", 128, 128, 64, 2, 2, 4, 4)]
SIMT = [Tiling("simt", 128, 128, 8), Tiling("simt", 128, 64, 8), Tiling("simt", 64, 64, 8)]


def tiled(ast: UOp, target: Target, name: str, t: Tiling | int | None) -> ProgramSpec:
  """The tiled kernel of ast with the tile t; t None: the pipeline's (kiln.codegen.pipeline's tiling pass chooses it); an
  int: the pipeline's with that TILE option."""
  if t is None: return CUDARenderer(target).render(ast)
  if isinstance(t, int): return CUDARenderer(target).render(ast, [Opt(OptOps.TILE, 0, t)])
  c = covers(ast, target)
  assert c is not None, "the tiled kernel does not cover this product"
  return program(ast, c, t, name)


def _bits16(x: np.ndarray, dt: str) -> np.ndarray:
  if dt == "bfloat16": return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncated: exact in bf16
  return x.astype(dt)


def _f64(x: np.ndarray, dt: str) -> np.ndarray:
  if dt == "bfloat16": return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
  return x.astype(np.float64)


def run(m: int, n: int, k: int, dt: str, tiling: Tiling | int | None, batch: tuple[int, ...] = (), out: str | None = None) -> str:
  """Renders (tiling None: the heuristic's choice), emulates with a poisoned output, compares; returns the applied tiling."""
  rng = np.random.default_rng(m * 7 + n * 3 + k)
  kdt = getattr(dtypes, dt)
  ast = kernels.matmul(m, n, k, kdt, batch=batch, acc_dtype=dtypes.float32)
  if out is not None and out != dt:  # the float32 sum stored as another dtype
    st = ast.src[0]
    g = UOp.define_global(0, getattr(dtypes, out).ptr(st.src[0].src[0].dtype.size))
    ast = UOp.sink(g.index(st.src[0].src[1]).store(st.src[1].src[0].cast(getattr(dtypes, out))), name="mm_out")
  spec = tiled(ast, H100, "mm", tiling)
  assert spec is not None
  a, b = _bits16(rng.uniform(-2, 2, (*batch, m, k)), dt), _bits16(rng.uniform(-2, 2, (*batch, k, n)), dt)
  od = out or dt
  c = np.full((*batch, m, n), 0xFFFF, np.uint16) if od == "bfloat16" else np.full((*batch, m, n), np.nan, od)
  prog = emulate.EmulatedProgram(spec)
  prog.kernel([c, a, b], [], *prog.sizes([]))
  ref = _f64(a, dt) @ _f64(b, dt)
  got = _f64(c, od)
  assert np.isfinite(got).all(), "an output was not written"
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert err < TOL[od], f"{spec.applied_opts}: max error {err:.3g} relative to the largest output"
  return spec.applied_opts[0]


@requires_cxx
@pytest.mark.parametrize("t", SIMT, ids=str)
@pytest.mark.parametrize("shape", [(130, 70, 36), (64, 64, 64), (17, 300, 19)], ids=lambda s: "x".join(map(str, s)))
def test_simt_tiles(t: Tiling, shape: tuple[int, int, int]) -> None:
  run(*shape, "float32", t)  # 130x70x36: float4 loads with edges; 17x300x19: scalar loads (k odd), many column tiles


@requires_cxx
@pytest.mark.parametrize("t", MMA, ids=str)
def test_tensor_core_tiles(t: Tiling) -> None:
  run(200, 136, 72, "float16", t)  # edges on m (not a multiple of the tile), n and k partial tiles, zero-filled copies


@requires_cxx
def test_tensor_core_batch_bfloat16_and_outputs() -> None:
  assert run(48, 40, 96, "bfloat16", None, batch=(2, 2)).startswith("TILED_MATMUL(mma")
  run(72, 64, 48, "float16", MMA[1], out="float32")
  run(72, 64, 48, "float16", MMA[0], out="bfloat16")


@requires_cxx
@pytest.mark.parametrize("number", [2, 5])
def test_a_tile_asked_as_an_option(number: int) -> None:
  # neither is the heuristic's for this product (128x128x32 tensor cores): the option decides, and the kernel is right
  assert run(200, 136, 72, "float16", number) == str(TILES[number - 1])


@requires_cxx
def test_simt_for_what_tensor_cores_cannot_take() -> None:
  assert run(40, 30, 50, "float16", None).startswith("TILED_MATMUL(simt")  # k, n not multiples of 8
  assert run(33, 40, 48, "float32", None, batch=(3,)).startswith("TILED_MATMUL(simt")


@requires_nvcc
@pytest.mark.parametrize("t", MMA + SIMT + [Tiling("tf32", 128, 128, 32, 2, 4, 3), Tiling("mma", 128, 256, 64, 2, 4, 3, 8, b_kmajor=True),
                               Tiling("tf32", 128, 128, 32, 2, 4, 3, b_kmajor=True)], ids=str)
def test_nvcc_builds_them_without_spills(t: Tiling, nvcc_compiler, tmp_path) -> None:
  dt = "float16" if t.kind == "mma" else "float32"
  kdt = getattr(dtypes, dt)
  ast = _matmul_bt(4096, 4096, 4096, kdt) if t.b_kmajor else kernels.matmul(4096, 4096, 4096, kdt, acc_dtype=dtypes.float32)
  spec = tiled(ast, TF32 if t.kind == "tf32" else H100, "mm", t)
  assert spec is not None
  (tmp_path / "k.cu").write_text(spec.src)
  r = subprocess.run([find_nvcc() or "nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "--resource-usage",
                      str(tmp_path / "k.cu")], capture_output=True, text=True, cwd=tmp_path, env={**os.environ})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr
  smem = int(m.group(1)) if (m := re.search(r"(\d+) bytes smem", r.stderr)) else 0
  assert smem == (0 if spec.shared_bytes else t.shared_bytes or smem)  # dynamic shared memory is not in the static count


@requires_cxx
@pytest.mark.parametrize("t", [Tiling("tf32", 128, 128, 32, 2, 4, 3), Tiling("tf32", 128, 128, 32, 2, 4, 2)], ids=str)
def test_tf32_tiles(t: Tiling) -> None:
  """Opt-in TF32: float32 inputs rounded to 10 mantissa bits, float32 sums; within TF32's error of the float64 product, and
  measurably not float32-exact (the rounding happens)."""
  rng = np.random.default_rng(5)
  m, n, k = 200, 136, 72
  spec = tiled(kernels.matmul(m, n, k), TF32, "mm", t)
  assert spec is not None and spec.applied_opts[0].startswith("TILED_MATMUL(tf32")
  a, b = rng.uniform(-2, 2, (m, k)).astype(np.float32), rng.uniform(-2, 2, (k, n)).astype(np.float32)
  c = np.full((m, n), np.nan, np.float32)
  prog = emulate.EmulatedProgram(spec)
  prog.kernel([c, a, b], [], *prog.sizes([]))
  ref = a.astype(np.float64) @ b.astype(np.float64)
  err = np.abs(c - ref).max() / np.abs(ref).max()
  assert 1e-6 < err < 2e-3, err


def test_tf32_is_opt_in(monkeypatch) -> None:
  from kiln.codegen.choose.contraction import match
  from kiln.codegen.choose.tiling import choose_tiling
  from kiln.ir.errors import SettingError
  from kiln.runtime.cuda.driver import tf32_allowed
  c = match(kernels.matmul(1024, 1024, 1024))
  assert c is not None and choose_tiling(c, H100).kind == "simt" and choose_tiling(c, TF32).kind == "tf32"
  monkeypatch.delenv("KILN_CUDA_TF32", raising=False)
  assert not tf32_allowed()
  monkeypatch.setenv("KILN_CUDA_TF32", "1")
  assert tf32_allowed()
  monkeypatch.setenv("KILN_CUDA_TF32", "maybe")
  with pytest.raises(SettingError, match="KILN_CUDA_TF32 must be 1 or 0"): tf32_allowed()


def _linear_ast(m: int, n: int, k: int, dt, batch: tuple[int, ...], epilogue, out_dt=None):
  """out[b, i, j] = epilogue(sum_k A[b, i, k] * B[b, k, j] in float32, bias[j], res[b, i, j]) cast to out_dt: what a model's
  linear layer fuses (kiln-graph puts bias, activation and residual in the matmul's kernel). Slots: 0 out, 1 A, 2 B, 3 bias
  (float32), 4 res (out_dt)."""
  from kiln.ir.ops import AxisType, Ops
  f32 = dtypes.float32
  out_dt = out_dt or dt
  nb = int(np.prod(batch)) if batch else 1
  bs = [UOp.range(s, d) for d, s in enumerate(batch)]
  i, j, kk = UOp.range(m, len(batch)), UOp.range(n, len(batch) + 1), UOp.range(k, len(batch) + 2, AxisType.REDUCE)
  flat = 0
  for d, s in enumerate(batch): flat = flat * s + bs[d]
  a = UOp.define_global(1, dt.ptr(nb * m * k)).index(flat * (m * k) + i * k + kk).load()
  b = UOp.define_global(2, dt.ptr(nb * k * n)).index(flat * (k * n) + kk * n + j).load()
  acc = (a.cast(f32) * b.cast(f32)).reduce(Ops.ADD, kk) if dt != f32 else (a * b).reduce(Ops.ADD, kk)
  bias = UOp.define_global(3, f32.ptr(n)).index(j).load()
  res = UOp.define_global(4, out_dt.ptr(nb * m * n)).index(flat * (m * n) + i * n + j).load()
  v = epilogue(acc, bias, res.cast(f32) if out_dt != f32 else res)
  return UOp.sink(UOp.define_global(0, out_dt.ptr(nb * m * n)).index(flat * (m * n) + i * n + j).store(v.cast(out_dt)), name="linear")


def _gelu(x):
  return x * 0.5 * ((x * 0.7071067811865476).erf() + 1.0)


EPILOGUES = {
  "bias_relu": lambda acc, bias, res: (acc + bias).maximum(0.0),
  "bias_gelu_residual": lambda acc, bias, res: _gelu(acc + bias) + res,
  "scale_tanh": lambda acc, bias, res: (acc * 0.125).tanh() * bias,
}


@requires_cxx
@pytest.mark.parametrize("name", list(EPILOGUES))
@pytest.mark.parametrize("dt,tiling", [("float32", None), ("float16", None), ("float16", Tiling("mma", 128, 128, 32, 2, 4, 2))],
                         ids=["simt", "mma", "mma-2stage"])
def test_epilogues_match_the_reference(name: str, dt: str, tiling) -> None:
  """Epilogues run in the tiled kernel's store loop, printed by the CUDA printer's own tables (kiln's arithmetic), against the
  reference evaluator with the tiled sum's tolerance; the output is poisoned first, and every case is tiled (not generic)."""
  from kiln.codegen.conformance import Case, for_spec, mismatches
  kdt = getattr(dtypes, dt)
  batch = (2,) if name == "bias_gelu_residual" else ()
  ast = _linear_ast(72, 48, 40, kdt, batch, EPILOGUES[name])
  spec = tiled(ast, H100, "linear", tiling)
  assert spec is not None and spec.applied_opts[0].startswith("TILED_MATMUL(" + ("simt" if dt == "float32" else "mma"))
  rng = np.random.default_rng(len(name))
  bufs = []
  for g in sorted({u for u in ast.toposort() if u.op.name == "DEFINE_GLOBAL"}, key=lambda g: g.arg):
    n_, gdt = g.dtype.size, g.dtype.base.name
    bufs.append(np.full(n_, np.nan, gdt) if g.arg == 0 else rng.uniform(-1, 1, n_).astype(gdt))
  case = Case(name, ast, bufs)
  got = case.fresh()
  prog = emulate.EmulatedProgram(spec)
  prog.kernel([got[s] for s in spec.globals], [], *prog.sizes([]))
  assert not (errs := mismatches(for_spec(case, spec.applied_opts), got)), "\n".join(errs)


def _emulated(name: str, ast: UOp, spec: ProgramSpec, bufs: list[np.ndarray]) -> list[np.ndarray]:
  """Run the tiled kernel under emulation on fresh copies of bufs; the conformance harness's mismatches against the
  reference, with the tiled sum's tolerance, fail the test. Returns what it wrote."""
  from kiln.codegen.conformance import Case, for_spec, mismatches
  case = Case(name, ast, bufs)
  got = case.fresh()
  prog = emulate.EmulatedProgram(spec)
  prog.kernel([got[s] for s in spec.globals], [], *prog.sizes([]))
  assert not (errs := mismatches(for_spec(case, spec.applied_opts), got)), "\n".join(errs)
  return got


@requires_cxx
def test_an_epilogue_reuses_the_operands_index_arithmetic() -> None:
  """n == k: the residual's index i * n + j shares i * k with A's, a node of the sum's body, which the epilogue printer left
  unprinted (CodegenError "used before it is defined": a GPT-2 export's attention scores plus their mask on CUDA)."""
  ast = _linear_ast(72, 40, 40, dtypes.float32, (2,), EPILOGUES["bias_gelu_residual"])
  spec = tiled(ast, H100, "linear", None)
  assert spec is not None and spec.applied_opts[0].startswith("TILED_MATMUL(simt")
  rng = np.random.default_rng(7)
  gl = sorted({u for u in ast.toposort() if u.op.name == "DEFINE_GLOBAL"}, key=lambda g: g.arg)
  _emulated("shared_index", ast, spec, [np.full(g.dtype.size, np.nan, np.float32) if g.arg == 0 else
                                        rng.uniform(-1, 1, g.dtype.size).astype(np.float32) for g in gl])


@requires_cxx
def test_an_epilogue_reads_a_bool_mask() -> None:
  """out = where(mask[i, j], A @ B, -1e4) with a bool mask (attention scores and their mask, as DeBERTa's export has them):
  the tiled kernel's parameter list had no C type for a bool buffer (KeyError)."""
  from kiln.ir.ops import AxisType, Ops
  m, n, k = 40, 48, 32
  i, j, kk = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  a = UOp.define_global(1, dtypes.float32.ptr(m * k)).index(i * k + kk).load()
  b = UOp.define_global(2, dtypes.float32.ptr(k * n)).index(kk * n + j).load()
  mask = UOp.define_global(3, dtypes.bool.ptr(m * n)).index(i * n + j).load()
  v = mask.where((a * b).reduce(Ops.ADD, kk), UOp.const(dtypes.float32, -1e4))
  ast = UOp.sink(UOp.define_global(0, dtypes.float32.ptr(m * n)).index(i * n + j).store(v), name="masked")
  spec = tiled(ast, H100, "masked", None)
  assert spec is not None and spec.applied_opts[0].startswith("TILED_MATMUL(simt")
  rng = np.random.default_rng(8)
  bufs = [np.full(m * n, np.nan, np.float32), rng.uniform(-1, 1, m * k).astype(np.float32), rng.uniform(-1, 1, k * n).astype(np.float32),
          rng.uniform(size=m * n) < 0.7]
  got = _emulated("masked", ast, spec, bufs)
  assert (got[0] == -1e4).sum() == (~bufs[3]).sum()


def _conv_ast(b: int, c: int, h: int, w: int, oc: int, stride: int, dt, pad: int = 0, where: bool = False, x_as_b: bool = False):
  """out[b, o, p] = sum_k x[b, k // 9, (p // ow) * s + (k // 3) % 3 - pad, (p % ow) * s + k % 3 - pad] * wt[o, k] (+ bias[o],
  relu): a 3x3 convolution as kiln-graph reads it, the pixel and the (channel, tap) axes merged, so A's offsets are
  expressions of the pixel and of k (implicit GEMM); with pad, the load is gated to the image (0 outside), as kiln-graph
  reads a padding it does not realize (where: as where(inside, load, 0), kiln-graph's form). The product's first factor is
  the matcher's A: x, or with x_as_b the weight (as kiln-graph multiplies them: x is then B, its n the pixels). Slots: 0
  out, 1 x, 2 wt, 3 bias."""
  from kiln.ir.ops import AxisType, Ops
  f32 = dtypes.float32
  oh, ow, k = (h + 2 * pad - 3) // stride + 1, (w + 2 * pad - 3) // stride + 1, c * 9
  bi, o, p, kk = UOp.range(b, 0), UOp.range(oc, 1), UOp.range(oh * ow, 2), UOp.range(k, 3, AxisType.REDUCE)
  y, xx = (p // ow) * stride + (kk // 3) % 3 - pad, (p % ow) * stride + kk % 3 - pad
  xg = UOp.define_global(1, dt.ptr(b * c * h * w))
  if pad:  # each coordinate clamped into the image (the verifier's proof of the address), the load gated to it
    inside = ((y < 0).logical_not()) & (y < h) & ((xx < 0).logical_not()) & (xx < w)
    y, xx = y.maximum(0).minimum(h - 1), xx.maximum(0).minimum(w - 1)
  at = bi * (c * h * w) + (kk // 9) * (h * w) + y * w + xx
  x = (inside.where(xg.index(at).load(), UOp.const(dt, 0)) if where else xg.index(at, inside).load()) if pad else xg.index(at).load()
  wt = UOp.define_global(2, dt.ptr(oc * k)).index(o * k + kk).load()
  f0, f1 = (wt, x) if x_as_b else (x, wt)
  acc = (f0.cast(f32) * f1.cast(f32)).reduce(Ops.ADD, kk) if dt != f32 else (f0 * f1).reduce(Ops.ADD, kk)
  v = (acc + UOp.define_global(3, f32.ptr(oc)).index(o).load()).maximum(0.0)
  return UOp.sink(UOp.define_global(0, dt.ptr(b * oc * oh * ow)).index(bi * (oc * oh * ow) + o * (oh * ow) + p).store(v.cast(dt)), name="conv")


@requires_cxx
@pytest.mark.parametrize(("stride", "dt", "pad", "where", "kind", "x_as_b"), [
  (1, "float32", 0, False, "simt", False), (2, "float32", 0, False, "simt", False), (1, "float32", 1, False, "simt", False),
  (2, "float32", 1, False, "simt", False), (1, "float32", 1, True, "simt", False), (1, "float32", 1, True, "simt", True),
  (1, "float16", 1, True, "mma", False), (2, "bfloat16", 1, True, "mma", False), (1, "float16", 1, True, "mma", True),
  (1, "float32", 1, True, "tf32", False), (2, "float32", 1, True, "tf32", True)])
def test_a_convolution_is_an_implicit_gemm(stride: int, dt: str, pad: int, where: bool, kind: str, x_as_b: bool) -> None:
  """A 3x3 convolution's product takes a tile with A's offsets computed per element from the pixel and the tap, and a
  padded one its gate (before: the generic kernel, one thread an output): the SIMT tile, or tensor cores for 16-bit inputs
  and TF32 (A read into registers and stashed in shared memory after each slice's steps), against the reference with the
  tiled sum's tolerance, off every tile edge (m = 33 pixels or more, n = 24 channels, k = 45 or 48). The output is
  poisoned first; a gate left out reads the clamped border element and fails."""
  from kiln.codegen.conformance import Case
  kdt = getattr(dtypes, dt)
  c = 5 if kind == "simt" else 16  # tensor cores take k in whole 16-byte chunks (k = 9c)
  ast = _conv_ast(2, c, 13 if stride == 1 else 11, 5 if stride == 1 else 9, 24, stride, kdt, pad, where, x_as_b)
  spec = tiled(ast, TF32 if kind == "tf32" else H100, "conv", None)
  assert spec is not None and spec.applied_opts[0].startswith(f"TILED_MATMUL({kind}")
  product = covers(ast, TF32 if kind == "tf32" else H100)
  assert product is not None and not (product.b if x_as_b else product.a).affine and (product.a if x_as_b else product.b).affine
  rng = np.random.default_rng(stride)
  gl = sorted({u for u in ast.toposort() if u.op.name == "DEFINE_GLOBAL"}, key=lambda g: g.arg)
  bufs = [np.full(g.dtype.size, np.nan, np.float32) if g.arg == 0 else rng.uniform(-1, 1, g.dtype.size).astype(np.float32) for g in gl]
  bufs = [b if g.dtype.base == dtypes.float32 else _bits16(b, g.dtype.base.name) for b, g in zip(bufs, gl)]
  if kind == "tf32":  # inputs rounded to 10 mantissa bits: within TF32's error of the exact sums, and not float32-exact
    from kiln.codegen.conformance import Case
    from kiln.ir.reference import evaluate
    case = Case("conv", ast, bufs)
    got, want = case.fresh(), case.fresh()
    prog = emulate.EmulatedProgram(spec)
    prog.kernel([got[s] for s in spec.globals], [], *prog.sizes([]))
    evaluate(ast, want, {})
    err = np.abs(got[0] - want[0]).max() / np.abs(want[0]).max()
    assert 1e-6 < err < 2e-3, err
  else: _emulated("conv", ast, spec, bufs)


@requires_nvcc
@pytest.mark.parametrize(("dt", "x_as_b"), [("float32", True), ("float16", False), ("float16", True)])
def test_nvcc_builds_an_implicit_gemm_without_spills(dt: str, x_as_b: bool, nvcc_compiler, tmp_path) -> None:
  """A ResNet-sized padded 3x3 convolution (batch 32, 256 channels, 14x14) as the SIMT and the tensor-core kernel (the image
  as A or as B): nvcc builds each for sm_90 with no stack frame and no spills (per-element offsets and gates in registers)."""
  ast = _conv_ast(32, 256, 14, 14, 256, 1, getattr(dtypes, dt), 1, True, x_as_b)
  spec = tiled(ast, H100, "conv", None)
  assert spec is not None and spec.applied_opts[0].startswith("TILED_MATMUL(" + ("simt" if dt == "float32" else "mma"))
  (tmp_path / "k.cu").write_text(spec.src)
  r = subprocess.run([find_nvcc() or "nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "--resource-usage",
                      str(tmp_path / "k.cu")], capture_output=True, text=True, cwd=tmp_path, env={**os.environ})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr


def _matmul_bt(m: int, n: int, k: int, dt, batch: int = 1):
  """C[b, i, j] = sum_k A[b, i, k] * B[b, j, k]: B stored transposed (k contiguous), as ONNX Gemm's transB reads it."""
  from kiln.ir.ops import AxisType, Ops
  f32 = dtypes.float32
  bi, i, j, kk = UOp.range(batch, 0), UOp.range(m, 1), UOp.range(n, 2), UOp.range(k, 3, AxisType.REDUCE)
  a = UOp.define_global(1, dt.ptr(batch * m * k)).index(bi * (m * k) + i * k + kk).load()
  b = UOp.define_global(2, dt.ptr(batch * n * k)).index(bi * (n * k) + j * k + kk).load()
  acc = (a * b).reduce(Ops.ADD, kk) if dt == f32 else (a.cast(f32) * b.cast(f32)).reduce(Ops.ADD, kk)
  return UOp.sink(UOp.define_global(0, dt.ptr(batch * m * n)).index(bi * (m * n) + i * n + j).store(acc.cast(dt) if dt != f32 else acc), name="mm_bt")


@requires_cxx
@pytest.mark.parametrize("dt,t", [
  ("float16", None), ("bfloat16", None), ("float16", Tiling("mma", 128, 256, 64, 2, 4, 3, 8, b_kmajor=True)),
  ("float32", Tiling("tf32", 128, 128, 32, 2, 4, 3, b_kmajor=True))], ids=["f16", "bf16", "f16-128x256", "tf32"])
def test_tensor_cores_take_a_transposed_b(dt: str, t) -> None:
  """B with k contiguous stages n-major like A and is read by plain ldmatrix (TF32: scalar reads along k)."""
  from kiln.codegen.choose.contraction import match
  m, n, k, nb = 200, 136, 72, 2
  ast = _matmul_bt(m, n, k, getattr(dtypes, dt), nb)
  c = match(ast)
  assert c is not None and (c.b.rows, c.b.cols) == (1, k)
  spec = tiled(ast, TF32, "mm_bt", t)
  assert spec is not None and "B k-major" in spec.applied_opts[0]
  rng = np.random.default_rng(9)
  a, b = _bits16(rng.uniform(-2, 2, (nb, m, k)), dt) if dt != "float32" else rng.uniform(-2, 2, (nb, m, k)).astype(np.float32), \
    _bits16(rng.uniform(-2, 2, (nb, n, k)), dt) if dt != "float32" else rng.uniform(-2, 2, (nb, n, k)).astype(np.float32)
  out = np.full((nb, m, n), 0xFFFF, np.uint16) if dt == "bfloat16" else np.full((nb, m, n), np.nan, dt)
  prog = emulate.EmulatedProgram(spec)
  prog.kernel([out, a, b], [], *prog.sizes([]))
  ref = _f64(a, dt) @ np.swapaxes(_f64(b, dt), 1, 2)
  err = np.abs(_f64(out, dt) - ref).max() / np.abs(ref).max()
  assert np.isfinite(_f64(out, dt)).all() and err < (2e-3 if dt == "float32" else TOL[dt]), (spec.applied_opts, err)
