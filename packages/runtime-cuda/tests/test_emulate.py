"""The CPU emulation harness runs hand-written kernels of the renderer's shape and gives numpy's results."""
import time

import numpy as np
import pytest

from kiln.codegen.spec import ProgramSpec, Variable
from kiln.ir import UOp, dtypes
from kiln.ir.dtype import bf16_bits_to_f32, f32_to_bf16_bits
from kiln.ir.errors import CompileError, RuntimeLaunchError
from kiln.runtime.cuda.emulate import EmulatedProgram, compile_emulator, emulate

from .conftest import requires_cxx
from .kernels import BROKEN, EW_BF16, EW_F32, EW_F64, EW_HALF, EW_I32, GROUP_SUM, SYMBOLIC

pytestmark = requires_cxx
rng = np.random.default_rng(0)


def test_elementwise_f32():
  a, b = rng.uniform(-4, 4, 64 * 20).astype(np.float32), rng.uniform(0.1, 4, 64 * 20).astype(np.float32)
  out = np.zeros_like(a)
  emulate(EW_F32, "ew_f32", [out, a, b], [], (20, 1, 1), (64, 1, 1))
  v = np.maximum(a * b + np.sqrt(b), np.exp2(a * np.float32(0.5))) + np.log2(b + np.float32(1)) + np.sin(a) - np.trunc(a * np.float32(3.7))
  np.testing.assert_allclose(out, np.where(a < b, v, -v), rtol=1e-6, atol=1e-6)


def test_elementwise_f64():
  a = rng.uniform(0, 10, 32 * 4)
  out = np.zeros_like(a)
  emulate(EW_F64, "ew_f64", [out, a], [], (4, 1, 1), (32, 1, 1))
  np.testing.assert_allclose(out, np.maximum(np.sqrt(a) * np.exp2(a * 0.25) + np.log2(a + 1) + np.sin(a), np.trunc(a)), rtol=1e-14)


def test_elementwise_i32():
  a = rng.integers(-(2**31), 2**31, 128 * 8, dtype=np.int64).astype(np.int32)
  b = rng.integers(-1000, 1000, 128 * 8).astype(np.int32)
  b[:5] = [0, -1, 1, 7, -7]
  out = np.zeros_like(a)
  emulate(EW_I32, "ew_i32", [out, a, b], [], (8, 1, 1), (128, 1, 1))
  a64, b64 = a.astype(np.int64), b.astype(np.int64)
  bs = np.where(b64 == 0, 1, b64)
  q = np.where(b64 != 0, np.trunc(a64 / bs).astype(np.int64), 0)  # C division truncates
  q = np.where((b64 != 0) & (np.abs(a64) >= 2**31 - 1), (np.sign(a64) * np.sign(bs) * (np.abs(a64) // np.abs(bs))), q)  # exact for big a
  r = np.where(b64 != 0, a64 - q * bs, 0)
  want = (((a64 * 31 + b64) & 0xFFFFFFFF) ^ (a64 >> 3)) + q - r + np.maximum(a64, b64)
  np.testing.assert_array_equal(out, ((want + 2**31) % 2**32 - 2**31).astype(np.int32))


def test_elementwise_half():
  a, b = rng.uniform(-8, 8, 256 * 4).astype(np.float16), rng.uniform(0, 8, 256 * 4).astype(np.float16)
  out = np.zeros_like(a)
  emulate(EW_HALF, "ew_half", [out, a, b], [], (4, 1, 1), (256, 1, 1))
  want = ((a * b).astype(np.float32) + np.sqrt(b.astype(np.float32))).astype(np.float16)
  np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))


def test_elementwise_bf16():
  a = f32_to_bf16_bits(rng.uniform(-100, 100, 256 * 3).astype(np.float32))
  s = rng.uniform(-2, 2, 256 * 3).astype(np.float32)
  out = np.zeros_like(a)
  emulate(EW_BF16, "ew_bf16", [out, a, s], [], (3, 1, 1), (256, 1, 1))
  np.testing.assert_array_equal(out, f32_to_bf16_bits(bf16_bits_to_f32(a) * s + np.float32(1)))


CONVERT = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void __launch_bounds__(256) convert(unsigned short* __restrict__ data0, unsigned short* __restrict__ data1,
    float* __restrict__ data2, float* __restrict__ data3, const float* __restrict__ data4) {
  int i = blockIdx.x * 256 + threadIdx.x;
  half h = __float2half(data4[i]);
  __nv_bfloat16 b = __float2bfloat16(data4[i]);
  data0[i] = __half_as_ushort(h); data1[i] = __bfloat16_as_ushort(b);
  data2[i] = __half2float(h); data3[i] = __bfloat162float(b);
}"""


def test_half_and_bfloat16_round_to_nearest_even():
  # random bit patterns (every exponent: subnormals, overflow, inf, nan) plus exact ties
  bits = rng.integers(0, 2**32, 256 * 64, dtype=np.uint64).astype(np.uint32)
  ties = np.array([0x3F801000, 0x3F803000, 0x477FF000, 0x477FE000, 0x33000000, 0x33000001, 0x38800000, 0x387FC000, 0x3F808000,
                   0x3F818000, 0x7F7FFFFF, 0x80000000, 0x00000001], dtype=np.uint32)
  bits[:len(ties)] = ties
  x = bits.view(np.float32)
  h, b, hf, bf = np.zeros(x.size, np.uint16), np.zeros(x.size, np.uint16), np.zeros_like(x), np.zeros_like(x)
  emulate(CONVERT, "convert", [h, b, hf, bf, x], [], (64, 1, 1), (256, 1, 1))
  nan = np.isnan(x)
  with np.errstate(over="ignore"): want_h = x.astype(np.float16)
  np.testing.assert_array_equal(h[~nan], want_h[~nan].view(np.uint16))
  np.testing.assert_array_equal(b[~nan], f32_to_bf16_bits(x)[~nan])
  assert np.isnan(h.view(np.float16)[nan]).all() and np.isnan(bf16_bits_to_f32(b[nan])).all()
  np.testing.assert_array_equal(hf[~nan], want_h[~nan].astype(np.float32))
  np.testing.assert_array_equal(bf[~nan], bf16_bits_to_f32(f32_to_bf16_bits(x))[~nan])


@pytest.mark.parametrize("mode", ["fibers", "threads"])
def test_group_reduction_with_shared_memory(mode):
  rows, n = (6, 1000) if mode == "threads" else (40, 1000)
  x = rng.standard_normal((rows, n)).astype(np.float32)
  out = np.zeros(rows, np.float32)
  emulate(GROUP_SUM, "group_sum", [out, x], [n], (rows, 1, 1), (256, 1, 1), mode=mode)
  np.testing.assert_allclose(out, x.sum(1), rtol=1e-4, atol=1e-4)


def test_symbolic_sizes_with_vars():
  rows = UOp.variable("rows", 1, 256)
  ast = UOp.sink(UOp.define_global(0, dtypes.int32.ptr()).index(0).store(UOp.const(dtypes.int32, 0)))
  spec = ProgramSpec(name="sym2d", src=SYMBOLIC, device="CUDA", ast=ast, global_size=(3, (rows + 7) // 8, 1), local_size=(16, 8, 1),  # type: ignore[arg-type]
                     vars=[Variable(name="k", min=-100, max=100), Variable(name="rows", min=1, max=256)], var_names=["k", "rows"],
                     globals=[0, 1], outs=[0], ins=[1], buf_count=2)
  prog = EmulatedProgram(spec)
  for kv, nrows in [(3, 37), (-5, 8), (7, 1)]:
    a = rng.integers(-1000, 1000, 256 * 48).astype(np.int32)
    out = np.full(256 * 48, -1, np.int32)
    assert prog.sizes([kv, nrows]) == ([3, (nrows + 7) // 8, 1], [16, 8, 1])
    assert prog([out.ctypes.data, a.ctypes.data], [kv, nrows], wait=True) is not None
    want = np.full(256 * 48, -1, np.int32)
    want[:nrows * 48] = a[:nrows * 48] * kv + np.tile(np.arange(48), nrows)
    np.testing.assert_array_equal(out, want)


RSUM_1024 = """extern "C" __global__ void __launch_bounds__(1024) rsum(float* __restrict__ data0, const float* __restrict__ data1) {
  __shared__ float temp[1024];
  int l = threadIdx.x;
  temp[l] = data1[blockIdx.x * 1024 + l];
  __syncthreads();
  for (int s = 512; s > 0; s >>= 1) { if (l < s) temp[l] += temp[l + s]; __syncthreads(); }
  if (l == 0) data0[blockIdx.x] = temp[0];
}"""


def test_1024_thread_blocks_thousands_of_blocks_in_seconds():
  nb = 2000
  x = rng.random(nb * 1024, dtype=np.float32)
  out = np.zeros(nb, np.float32)
  compile_emulator(RSUM_1024, "rsum")
  st = time.perf_counter()
  emulate(RSUM_1024, "rsum", [out, x], [], (nb, 1, 1), (1024, 1, 1))
  assert time.perf_counter() - st < 20  # ~1 s on 2 idle cores; generous for a loaded machine
  np.testing.assert_allclose(out, x.reshape(nb, 1024).sum(1), rtol=1e-5)


EARLY_EXIT = """extern "C" __global__ void __launch_bounds__(64) early(int* __restrict__ data0) {
  __shared__ int s[64];
  int l = threadIdx.x;
  if (l >= 48) return;  // exited threads no longer hold up the barrier
  s[l] = l * 2;
  __syncthreads();
  data0[blockIdx.x * 64 + l] = s[47 - l] + blockIdx.x;
}"""


@pytest.mark.parametrize("mode", ["fibers", "threads"])
def test_threads_that_return_early_leave_the_barrier(mode):
  out = np.full(2 * 64, -1, np.int32)
  emulate(EARLY_EXIT, "early", [out], [], (2, 1, 1), (64, 1, 1), mode=mode)
  l = np.arange(48)
  for b in range(2): np.testing.assert_array_equal(out[b * 64:b * 64 + 48], (47 - l) * 2 + b)
  assert (out.reshape(2, 64)[:, 48:] == -1).all()


def test_3d_indices():
  src = """extern "C" __global__ void __launch_bounds__(24) idx3(int* __restrict__ data0) {
  int b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  data0[b * 24 + t] = b * 1000 + t;
}"""
  out = np.zeros(2 * 3 * 4 * 24, np.int32)
  emulate(src, "idx3", [out], [], (2, 3, 4), (2, 3, 4))
  np.testing.assert_array_equal(out, (np.arange(24)[None, :] + 1000 * np.arange(24)[:, None]).ravel())


def test_errors():
  with pytest.raises(CompileError) as ei: emulate(BROKEN, "broken", [np.zeros(32, np.float32)], [], (1, 1, 1), (32, 1, 1))
  assert "undefined_thing" in ei.value.log and ">   3 |" in ei.value.source_lines
  out, a = np.zeros(64, np.float32), np.zeros(64, np.float32)
  with pytest.raises(RuntimeLaunchError, match="parameter count"): emulate(EW_F32, "ew_f32", [out, a], [], (1, 1, 1), (64, 1, 1))
  with pytest.raises(RuntimeLaunchError, match="exceeds 1024"): emulate(EW_F32, "ew_f32", [out, a, a], [], (1, 1, 1), (64, 32, 1))
  with pytest.raises(RuntimeLaunchError, match=">= 1"): emulate(EW_F32, "ew_f32", [out, a, a], [], (1, 1, 1), (0, 1, 1))
  emulate(EW_F32, "ew_f32", [out, a, a], [], (0, 1, 1), (64, 1, 1))  # an empty grid (a size bound to 0) runs nothing
  with pytest.raises(RuntimeLaunchError, match="C-contiguous"): emulate(EW_F32, "ew_f32", [out, a[::2], a], [], (1, 1, 1), (32, 1, 1))
  with pytest.raises(CompileError, match="identifier"): compile_emulator(EW_F32, "not a name")


def test_build_cache_by_source_hash():
  k1 = compile_emulator(EW_F32, "ew_f32")
  assert compile_emulator(EW_F32, "ew_f32") is k1
  assert compile_emulator(EW_F32 + "\n// changed", "ew_f32") is not k1
