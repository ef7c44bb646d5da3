"""kiln.codegen.choose.contraction: which kernels are one matrix product (and get CUDA's tiled kernel), with their strides; and the
tile the CUDA renderer chooses for them from the GPU's properties."""
from __future__ import annotations

from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.choose.contraction import linear, match
from kiln.codegen.choose.tiling import Tiling, choose_tiling
from kiln.codegen.render import CUDARenderer
from kiln.ir import UOp, kernels
from kiln.ir.dtype import dtypes
from kiln.ir.ops import AxisType, Ops

H100 = Target(device="CUDA", vector_bytes=0, threads=1, gpu_arch=90, gpu_sms=132)
f32 = dtypes.float32


def _mm(m: int, n: int, k: int, b_index=None, epilogue=None, a_index=None, same=False) -> UOp:
  """C[i, j] = sum_k A[i, k] * B[...] by hand: b_index(j, kk) picks B's index (B^T when it is j * k + kk)."""
  i, j, kk = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  a = UOp.define_global(1, f32.ptr(m * k))
  b = a if same else UOp.define_global(2, f32.ptr(max(m, n, k) * k))
  av = a.index(a_index(i, kk) if a_index else i * k + kk).load()
  bv = b.index(b_index(j, kk) if b_index else kk * n + j).load()
  v = (av * bv).reduce(Ops.ADD, kk)
  if epilogue is not None: v = epilogue(v)
  return UOp.sink(UOp.define_global(0, f32.ptr(m * n)).index(i * n + j).store(v), name="mm")


def test_linear_reads_coefficients_and_refuses_what_is_not_affine() -> None:
  i, j = UOp.range(10, 0), UOp.range(20, 1)
  assert linear(i * 20 + j + 3) == {i: 20, j: 1, None: 3}
  assert linear((i + 1) * 4 - j) == {i: 4, None: 4, j: -1}
  assert linear(i * j) is None
  assert linear(i % 3) is None


def test_matmul_builders_match_with_their_strides() -> None:
  c = match(kernels.matmul(48, 40, 24))
  assert c is not None and (c.m, c.n, c.k, c.batch) == (48, 40, 24, ())
  assert (c.a.rows, c.a.cols, c.b.rows, c.b.cols, c.c.rows, c.c.cols) == (24, 1, 40, 1, 40, 1)
  assert (c.a.slot, c.b.slot, c.c.slot) == (1, 2, 0) and c.acc == f32
  cb = match(kernels.matmul(16, 32, 64, dtypes.float16, batch=(3, 2), acc_dtype=f32))
  assert cb is not None and cb.batch == (3, 2) and cb.batches == 6
  assert cb.a.batch == (2 * 16 * 64, 16 * 64) and cb.b.batch == (2 * 64 * 32, 64 * 32) and cb.c.batch == (2 * 16 * 32, 16 * 32)
  assert cb.a.dtype == dtypes.float16 and cb.c.dtype == dtypes.float16 and cb.acc == f32


def test_transposed_operand_matches_with_its_strides() -> None:
  c = match(_mm(32, 48, 16, b_index=lambda j, kk: j * 16 + kk))  # B stored as [n, k]
  assert c is not None and (c.b.rows, c.b.cols) == (1, 16)


def test_epilogues_match_and_name_what_they_read() -> None:
  relu = match(_mm(32, 32, 32, epilogue=lambda v: v.maximum(0.0)))
  assert relu is not None and relu.epilogue and relu.extra == ()
  plain = match(kernels.matmul(32, 32, 32, dtypes.float16, acc_dtype=f32))
  assert plain is not None and not plain.epilogue  # the cast to the output's dtype alone is no epilogue
  bias = UOp.define_global(3, f32.ptr(32))

  def with_bias(v: UOp) -> UOp:
    j = next(u for u in v.toposort() if u.op is Ops.RANGE and u.arg[0] == 1)
    return (v + bias.index(j).load()).maximum(0.0)
  c = match(_mm(32, 32, 32, epilogue=with_bias))
  assert c is not None and c.extra == (3,)


def test_what_is_not_one_plain_product_does_not_match() -> None:
  out = UOp.define_global(0, f32.ptr(32 * 32))
  i0 = UOp.range(32, 0)
  assert match(_mm(32, 32, 32, epilogue=lambda v: v + out.index(i0 * 32).load())) is None  # reads the output: another thread's
  r2 = UOp.range(8, 5, AxisType.REDUCE)
  other = UOp.define_global(4, f32.ptr(8)).index(r2).load().reduce(Ops.ADD, r2)
  assert match(_mm(32, 32, 32, epilogue=lambda v: v * other)) is None  # a second sum
  b = UOp.define_global(3, dtypes.int32.ptr(32 * 32))
  assert match(_mm(32, 32, 32, a_index=lambda i, kk: b.index(i * 32 + kk).load())) is None  # a gathered index
  assert match(kernels.reduce_sum((64, 64), f32, 1)) is None
  n = UOp.variable("n", 1, 64)
  assert match(kernels.matmul(n, 32, 32)) is None  # symbolic sizes: the generic kernel


def test_an_operand_may_be_an_expression_of_its_matrix_ranges() -> None:
  """An operand whose matrix part is not a stride per axis (a convolution's pixel and tap, taken apart by // and %; a term of
  both ranges; a gate) keeps it as an expression of its two matrix ranges (Operand.expr, strides 0); affine operands keep
  their strides and no expression."""
  c = match(_mm(32, 32, 36, a_index=lambda i, kk: (i // 8) * 100 + (i % 8) * 2 + (kk // 9) * 7 + kk % 9))
  assert c is not None and not c.a.affine and c.a.rows == c.a.cols == 0 and c.b.affine and c.c.affine
  assert c.a.expr is not None and [r.arg[0] for r in c.a.expr[:2]] == [0, 2] and c.a.gate is None
  both = match(_mm(32, 32, 32, a_index=lambda i, kk: (i * 32 + kk) % 7))  # one term of both ranges
  assert both is not None and both.a.expr is not None
  plain = match(_mm(32, 32, 32))
  assert plain is not None and plain.a.affine and (plain.a.rows, plain.a.cols) == (32, 1)
  gated = _mm(32, 32, 32)
  av = next(u for u in gated.toposort() if u.op is Ops.INDEX and int(u.src[0].arg) == 1)
  kk = next(u for u in gated.toposort() if u.op is Ops.RANGE and u.arg[0] == 2)
  g = match(gated.substitute({av: UOp(Ops.INDEX, av.dtype, (*av.src, kk < 20))}))  # a gated load (a pad's zeros)
  assert g is not None and g.a.gate is not None and g.a.expr is not None and g.b.affine


def test_renderer_uses_the_tiled_kernel_only_under_the_heuristic() -> None:
  r = CUDARenderer(H100)
  assert r.render(kernels.matmul(64, 64, 64)).applied_opts[0].startswith("TILED_MATMUL(simt")
  assert r.render(kernels.matmul(64, 64, 64, dtypes.float16, acc_dtype=f32)).applied_opts[0].startswith("TILED_MATMUL(mma")
  explicit = r.render(kernels.matmul(64, 64, 64), [Opt(OptOps.LOCAL, 1, 16)])
  assert not any(o.startswith("TILED") for o in explicit.applied_opts)
  assert not r.render(kernels.matmul(8, 64, 64)).applied_opts or not r.render(kernels.matmul(8, 64, 64)).applied_opts[0].startswith("TILED")
  # float16 sums (no float32 accumulator): the reference rounds every partial sum to half, which no tile reproduces
  assert not any(o.startswith("TILED") for o in r.render(kernels.matmul(64, 64, 64, dtypes.float16)).applied_opts)


def test_tile_follows_the_gpu() -> None:
  c = match(kernels.matmul(4096, 4096, 4096, dtypes.float16, acc_dtype=f32))
  assert c is not None
  assert choose_tiling(c, H100) == Tiling("mma", 128, 256, 64, 2, 4, 3, 8)  # two waves of large tiles
  c2 = match(kernels.matmul(2048, 2048, 2048, dtypes.float16, acc_dtype=f32))
  assert c2 is not None and choose_tiling(c2, H100) == Tiling("mma", 128, 128, 32, 2, 4, 3)
  older = Target(device="CUDA", vector_bytes=0, threads=1, gpu_arch=75, gpu_sms=40)  # no sm_80 tensor-core steps
  assert choose_tiling(c, older).kind == "simt"
  c3 = match(kernels.matmul(1024, 1024, 1024))
  assert c3 is not None
  assert (choose_tiling(c3, H100).bm, choose_tiling(c3, H100).bn) == (64, 64)  # 128x128 would leave half of 132 SMs idle
  assert (choose_tiling(c3, Target(device="CUDA", vector_bytes=0, gpu_arch=90, gpu_sms=40)).bm,) == (128,)
  # a layout the tensor-core copies cannot take (k not a multiple of 8) keeps the SIMT kernel
  c4 = match(kernels.matmul(256, 256, 100, dtypes.float16, acc_dtype=f32))
  assert c4 is not None and choose_tiling(c4, H100).kind == "simt"


def test_tiled_spec_declares_shared_memory_and_alignment() -> None:
  r = CUDARenderer(H100)
  big = r.render(kernels.matmul(4096, 4096, 4096, dtypes.float16, acc_dtype=f32))
  assert big.shared_bytes == Tiling("mma", 128, 256, 64, 2, 4, 3, 8).shared_bytes > 48 << 10
  assert big.local_size == (256, 1, 1) and big.global_size == (16, 32, 1)
  assert {a.slot: a.align for a in big.args} == {0: 4, 1: 16, 2: 16}  # half2 output stores
  simt = r.render(kernels.matmul(2048, 2048, 2048))  # 128x128 tiles: a float4 load per thread of each slice
  assert simt.shared_bytes == 0 and {a.slot: a.align for a in simt.args} == {0: 0, 1: 16, 2: 16}
  small = r.render(kernels.matmul(256, 256, 256))  # 64x64 tiles: two elements per thread per slice, float2
  assert {a.slot: a.align for a in small.args} == {0: 0, 1: 8, 2: 8}
  odd = r.render(kernels.matmul(33, 45, 27))
  assert {a.slot: a.align for a in odd.args} == {0: 0, 1: 0, 2: 0}  # scalar loads: the element's own alignment


def test_one_buffer_on_both_sides_matches() -> None:
  """q and k of a fused QKV projection live in one buffer: A and B read the same slot (each with its own strides), which the
  tiled kernel passes once. Only the output must be another buffer."""
  c = match(_mm(32, 32, 32, same=True))
  assert c is not None and c.a.slot == c.b.slot == 1 and c.c.slot == 0, c
