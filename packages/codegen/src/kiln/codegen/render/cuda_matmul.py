"""Tiled matrix-product kernels for CUDA, for kernels kiln.codegen.choose.contraction recognises. Blocks sit on the grid's x (tile
columns), y (tile rows) and z (batch); kiln.codegen.choose.tiling picks the tile from the GPU (gpu_arch, gpu_sms, allow_tf32):
- SIMT (any float input, float32 sums; 256 threads): BMxBNx8 slices of A and B in shared memory two stages deep (A
  transposed, so a thread reads its rows as one broadcast); each thread keeps an 8x8, 8x4 or 4x4 register tile of float32
  sums, accumulated with fused multiply-adds; the next slice's global loads (float4/float2 where the layout allows) are in
  flight while the current one is multiplied.
- MMA (float16 or bfloat16 inputs, float32 sums, sm_80 or newer, rows in 16-byte chunks; B n- or k-contiguous): tensor
  cores through mma.sync.m16n8k16, warps_m x warps_n warps per block; slices filled by cp.async 16 bytes at a time
  (zero-filled past the edges), `stages` deep with one barrier per slice; fragments read by ldmatrix from rows padded by 16
  bytes (no bank conflicts); dynamic shared memory past 48 KB.
- TF32 (float32 inputs, opt-in): the same pipeline with mma.sync.m16n8k8.tf32, fragments read by 32-bit shared loads.
An elementwise epilogue (bias, activation, residual, the output cast) runs in the store loop.

The tensor-core and copy steps are small __device__ functions (kiln_ldmatrix_x4, kiln_ldmatrix_x4_trans, kiln_mma_*,
kiln_cp_async16, ...): inline PTX under nvcc, and plain C++ warp collectives in the CPU emulation harness
(kiln.runtime.cuda.emulate, include/kiln_cuda_mma.h), so every kernel shape is checked against the reference without a GPU.

Numerics: the sums are float32 like the reference's, but fused (one rounding per multiply-add) and in another order (per
thread, per tile, per tensor-core step), so results agree to float32 rounding, not bit for bit."""
from __future__ import annotations

from kiln.codegen.choose import Target
from kiln.codegen.choose.contraction import Contraction, Operand, match
from kiln.codegen.choose.tiling import THREADS, Tiling, b_kmajor
from kiln.codegen.render.cuda_c import EpiloguePrinter, ctype
from kiln.codegen.spec import KernelArg, ProgramSpec, Variable
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.ops import Ops
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp

MIN_DIM = 16  # a product smaller than this along m, n or k keeps the generic kernel: a tile would be mostly idle
_MEM = {"float32": "float", "float16": "half", "bfloat16": "__nv_bfloat16"}
_TO_F32 = {"float32": "{v}", "float16": "__half2float({v})", "bfloat16": "__bfloat162float({v})"}
# float32 sum -> the output's type; bfloat16 NaN is the quiet NaN 0x7FC0, as every kiln bfloat16 result (alu.py)
_FROM_F32 = {"float32": "{v}", "float16": "__float2half_rn({v})",
             "bfloat16": "({v} != {v} ? __ushort_as_bfloat16((unsigned short)0x7fc0) : __float2bfloat16_rn({v}))"}


def applies(c: Contraction | None, target: Target) -> bool:
  # a matrix's element offsets are C ints in the tiled kernel (only the batch offsets are long long)
  return (c is not None and c.acc == dtypes.float32 and c.a.dtype.name in _MEM and c.c.dtype.name in _FROM_F32
          and min(c.m, c.n, c.k) >= MIN_DIM and c.batches <= target.max_grid[2] and max(c.m * c.k, c.k * c.n, c.m * c.n) <= dtypes.index.max)


def _batch_offsets(c: Contraction) -> list[str]:
  """C lines setting long long offA/offB/offC for this block's batch (blockIdx.z split over the batch axes, each axis's
  index kept as bidx<d> for the epilogue)."""
  lines = [f"long long offA = {c.a.offset}LL, offB = {c.b.offset}LL, offC = {c.c.offset}LL;"]
  if not c.batch: return lines
  lines.append("long long bz = blockIdx.z;")
  for d in range(len(c.batch) - 1, -1, -1):  # the outermost takes what is left (its size may be symbolic: the grid's)
    index = f"const long long bidx{d} = bz % {c.batch[d]}; bz /= {c.batch[d]};" if d else "const long long bidx0 = bz;"
    lines.append(index + f" offA += bidx{d} * {c.a.batch[d]}LL; offB += bidx{d} * {c.b.batch[d]}LL; offC += bidx{d} * {c.c.batch[d]}LL;")
  return lines


def _stored(c: Contraction, acc: str, j: str, indent: str, helpers: dict[str, str], start: int) -> tuple[list[str], str, int]:
  """(lines computing the value stored for output (gm, j) from the sum `acc`, its C expression, the next temporary number):
  the epilogue printed by the CUDA printer's own tables (kiln's arithmetic), loads at the output's own indices. Without an
  epilogue the sum itself (the store converts it to the output's type)."""
  if not c.epilogue or c.value is None or c.reduce is None: return [], acc, start
  p = EpiloguePrinter(start)
  p.names[c.reduce] = acc
  ri, rj, *rb = c.ranges
  p.names[ri], p.names[rj] = "gm", j
  for d, r in enumerate(rb): p.names[r] = f"((int)bidx{d})"
  v = p.expr(c.value, c.reduce)
  helpers.update(p.helpers)
  return [indent + ln for ln in p.lines], v, p.n


def _slot_types(c: Contraction) -> dict[int, DType]:
  """Every buffer the kernel takes (the operands, the output, the epilogue's loads) and its element type."""
  typ = {c.a.slot: c.a.dtype, c.b.slot: c.b.dtype, c.c.slot: c.c.dtype}
  if c.extra and c.value is not None:
    for u in c.value.toposort():
      if u.op is Ops.DEFINE_GLOBAL and isinstance(u.dtype, PtrDType) and int(u.arg) in c.extra: typ[int(u.arg)] = u.dtype.base
  return typ


def _params(c: Contraction, name: str, threads: int = THREADS, min_blocks: int = 0) -> str:
  typ = _slot_types(c)
  slots = sorted(typ)
  # an epilogue's extra buffers take any type (a bool mask)
  ps = [f"{'' if s == c.c.slot else 'const '}{_MEM.get(typ[s].name) or ctype(typ[s])}* __restrict__ data{s}" for s in slots]
  ps += [f"int batch_var{i}" for i, _ in enumerate(c.variables)]  # a symbolic batch's variables: the grid's, unread here
  bounds = f"{threads}, {min_blocks}" if min_blocks else f"{threads}"
  return f'extern "C" __global__ void __launch_bounds__({bounds}) {name}({", ".join(ps)})'


def _vec(o: Operand, walk_cols: bool, extents: tuple[int, int], per_thread: int) -> int:
  """Elements per vector load (4, 2 or 1) along the walked tile axis: float32, stride 1 there, the walked extent and every
  row and batch start a multiple of it, and no more than the tile gives each thread."""
  if o.dtype != dtypes.float32 or (o.cols if walk_cols else o.rows) != 1: return 1
  other, extent = (o.rows if walk_cols else o.cols), extents[1 if walk_cols else 0]
  for v in (4, 2):
    if v <= per_thread and extent % v == 0 and o.offset % v == 0 and all(s % v == 0 for s in (other, *o.batch)): return v
  return 1


def _simt_loads(c: Contraction, t: Tiling, o: Operand) -> tuple[bool, int]:
  """How the SIMT kernel loads operand o (c.a or c.b): whether its threads walk the tile's second axis (A: k, B: n; the one
  with stride 1, or it when neither is), and the elements per vector load."""
  is_a = o is c.a
  walk = o.cols == 1 or o.rows != 1
  return walk, _vec(o, walk, (c.m, c.k) if is_a else (c.k, c.n), (t.bm if is_a else t.bn) * t.bk // THREADS)


def _offsets(o: Operand, rv: str, cv: str, helpers: dict[str, str]) -> tuple[list[str], str, str | None]:
  """(lines, the C offset of operand o's element (rv, cv), its gate or None): the indices times the strides, or the operand's
  expression of its two matrix ranges (contraction's Operand.expr: an implicit GEMM's pixel and tap) printed by the CUDA
  printer's own tables with the ranges named by the indices; the lines compute its temporaries (inside the load loop)."""
  if o.expr is None and o.gate is None: return [], f"(long long){rv} * {o.rows} + (long long){cv} * {o.cols}", None
  assert o.expr is not None
  r0, r1, part = o.expr
  p = EpiloguePrinter()
  p.names[r0], p.names[r1] = rv, cv
  off = p.expr(part)
  gate = None if o.gate is None else p.expr(o.gate)
  helpers.update(p.helpers)
  return ["      " + ln for ln in p.lines], f"(long long)({off})", gate


def _vec_load(reg: str, vec: int, ok: str, addr: str) -> str:
  """One float2/float4 load into reg[it * vec ...], zero where `ok` is false (a whole vector is in or out of bounds)."""
  lanes = "xyzw"[:vec]
  return (f"      float{vec} v = {{}};\n      if ({ok}) v = *(const float{vec}*)({addr});\n      "
          + " ".join(f"{reg}[it * {vec} + {i}] = v.{ch};" for i, ch in enumerate(lanes)))


def render_simt(c: Contraction, t: Tiling, name: str, helpers: dict[str, str]) -> str:
  bm, bn, bk = t.bm, t.bn, t.bk
  tm, tn = bm // 16, bn // 16
  a, b, o = c.a, c.b, c.c
  ta, tb = _MEM[a.dtype.name], _MEM[b.dtype.name]
  cvt_a, cvt_b = _TO_F32[a.dtype.name], _TO_F32[b.dtype.name]
  (a_k, a_vec), (b_n, b_vec) = _simt_loads(c, t, a), _simt_loads(c, t, b)
  na, nb = bm * bk // (THREADS * a_vec), bn * bk // (THREADS * b_vec)
  L: list[str] = []
  e = L.append
  e(_params(c, name) + " {")
  e(f"  __shared__ float As[2][{bk}][{bm}];")
  e(f"  __shared__ float Bs[2][{bk}][{bn}];")
  e(f"  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16, m0 = blockIdx.y * {bm}, n0 = blockIdx.x * {bn};")
  for ln in _batch_offsets(c): e("  " + ln)
  e(f"  const {ta}* A = data{a.slot} + offA;")
  e(f"  const {tb}* B = data{b.slot} + offB;")
  e(f"  float acc[{tm}][{tn}];")
  e(f"  #pragma unroll\n  for (int i = 0; i < {tm}; i++)\n    #pragma unroll\n    for (int j = 0; j < {tn}; j++) acc[i][j] = 0.0f;")
  e(f"  float ra[{na * a_vec}], rb[{nb * b_vec}];")

  def tile_coords(vec: int, rows: int, cols: int, walk_cols: bool, it: str) -> str:
    """r, cc of this thread's it-th load in a rows x cols tile (vec consecutive elements along the walked axis)."""
    if walk_cols: return f"const int e_ = tid + {it} * {THREADS}, r = e_ / {cols // vec}, cc = (e_ % {cols // vec}) * {vec};"
    return f"const int e_ = tid + {it} * {THREADS}, cc = e_ / {rows // vec}, r = (e_ % {rows // vec}) * {vec};"

  def global_loads(reg: str, n: int, vec: int, rows: int, cols: int, walk: bool, at: tuple[tuple[str, str], tuple[str, str]], ok: str,
                   ptr: str, o: Operand, cvt: str) -> None:
    """This thread's n loads (vec elements each) of a rows x cols slice into reg: tile element (r, cc) is the operand's
    element (row, col), at = ((row name, its expression), (col name, its expression)), in bounds where `ok`."""
    (rv, re_), (cv, ce) = at
    e(f"    #pragma unroll\n    for (int it = 0; it < {n}; it++) {{")
    e("      " + tile_coords(vec, rows, cols, walk, "it"))
    e(f"      const int {rv} = {re_}, {cv} = {ce};")
    pre, off, gate = _offsets(o, rv, cv, helpers)
    L.extend(pre)
    addr = f"{ptr} + {off}"
    if gate is not None: ok = f"{ok} && ({gate})"  # a padded input's border: 0
    if vec > 1: e(_vec_load(reg, vec, ok, addr))
    else: e(f"      {reg}[it] = ({ok}) ? {cvt.format(v=f'*({addr})')} : 0.0f;")
    e("    }")

  # loads: A element (m0 + r, k0 + cc); B element (k0 + r, n0 + cc)
  e("  auto load = [&](int k0) {")
  global_loads("ra", na, a_vec, bm, bk, a_k, (("gm", "m0 + r"), ("gk", "k0 + cc")), f"gm < {c.m} && gk < {c.k}", "A", a, cvt_a)
  global_loads("rb", nb, b_vec, bk, bn, b_n, (("gk", "k0 + r"), ("gn", "n0 + cc")), f"gk < {c.k} && gn < {c.n}", "B", b, cvt_b)
  e("  };")
  # stores to shared: A transposed (As[k][m]), B as is (Bs[k][n]); a vector's lanes run along the walked axis
  e("  auto stash = [&](int s) {")
  e(f"    #pragma unroll\n    for (int it = 0; it < {na}; it++) {{")
  e("      " + tile_coords(a_vec, bm, bk, a_k, "it"))
  a_at = "As[s][cc + v][r]" if a_k else "As[s][cc][r + v]"  # a vector's lanes run along the walked axis
  e(f"      #pragma unroll\n      for (int v = 0; v < {a_vec}; v++) {a_at} = ra[it * {a_vec} + v];")
  e("    }")
  e(f"    #pragma unroll\n    for (int it = 0; it < {nb}; it++) {{")
  e("      " + tile_coords(b_vec, bk, bn, b_n, "it"))
  b_at = "Bs[s][r][cc + v]" if b_n else "Bs[s][r + v][cc]"
  e(f"      #pragma unroll\n      for (int v = 0; v < {b_vec}; v++) {b_at} = rb[it * {b_vec} + v];")
  e("    }")
  e("  };")
  kt = -(-c.k // bk)
  e("  load(0);\n  stash(0);\n  __syncthreads();")
  e(f"  for (int kt = 0; kt < {kt}; kt++) {{")
  e("    const int s = kt & 1;")
  e(f"    if (kt + 1 < {kt}) load((kt + 1) * {bk});")
  e(f"    #pragma unroll\n    for (int kk = 0; kk < {bk}; kk++) {{")
  e(f"      float fa[{tm}], fb[{tn}];")
  # a thread's rows: chunks of 4 at ty*4, 64 apart (so a warp's reads are broadcasts and its 16-byte reads hit distinct banks)
  e(f"      #pragma unroll\n      for (int i = 0; i < {tm}; i++) fa[i] = As[s][kk][(i / 4) * 64 + ty * 4 + (i % 4)];")
  e(f"      #pragma unroll\n      for (int j = 0; j < {tn}; j++) fb[j] = Bs[s][kk][(j / 4) * 64 + tx * 4 + (j % 4)];")
  e(f"      #pragma unroll\n      for (int i = 0; i < {tm}; i++)\n        #pragma unroll\n        for (int j = 0; j < {tn}; j++)"
    " acc[i][j] = fmaf(fa[i], fb[j], acc[i][j]);")
  e("    }")
  e(f"    if (kt + 1 < {kt}) stash(s ^ 1);")
  e("    __syncthreads();")
  e("  }")
  e(f"  {_MEM[o.dtype.name]}* C = data{o.slot} + offC;")
  e(f"  #pragma unroll\n  for (int i = 0; i < {tm}; i++) {{")
  e("    const int gm = m0 + (i / 4) * 64 + ty * 4 + (i % 4);")
  e(f"    if (gm >= {c.m}) continue;")
  e(f"    #pragma unroll\n    for (int j = 0; j < {tn}; j++) {{")
  e("      const int gn = n0 + (j / 4) * 64 + tx * 4 + (j % 4);")
  e(f"      if (gn >= {c.n}) continue;")
  lines, v, _ = _stored(c, "acc[i][j]", "gn", "      ", helpers, 0)
  L.extend(lines)
  e(f"      C[(long long)gm * {o.rows} + (long long)gn * {o.cols}] = {_FROM_F32[o.dtype.name].format(v=v)};")
  e("    }\n  }\n}")
  return "\n".join(L)


_MMA_PTX = {"float16": "f16", "bfloat16": "bf16"}


# a thread's two neighbouring outputs as one store: (type, constructor); bfloat16 keeps its scalar stores (NaN's 0x7FC0)
_PAIR = {"float32": ("float2", "make_float2"), "float16": ("half2", "__floats2half2_rn")}


def _pairs_ok(c: Contraction) -> bool:
  """Pairs (gn even, gn + 1) line up: C's columns contiguous, an even n, even row and batch strides and offset."""
  o = c.c
  return o.cols == 1 and c.n % 2 == 0 and o.offset % 2 == 0 and all(s % 2 == 0 for s in (o.rows, *o.batch))


STATIC_SHARED = 48 << 10  # a block's static shared memory limit; beyond it the kernel declares it dynamic (ProgramSpec.shared_bytes)


def _block_origin(c: Contraction, t: Tiling) -> list[str]:
  """m0, n0 of this block's tile. With group_m, consecutive blocks walk group_m tile rows down before moving right, so the
  blocks resident together read the same slices of B (and few of A) from L2."""
  if not t.group_m: return [f"const int m0 = blockIdx.y * {t.bm}, n0 = blockIdx.x * {t.bn};"]
  tm, tn = -(-c.m // t.bm), -(-c.n // t.bn)
  return [f"const int bid = blockIdx.y * {tn} + blockIdx.x, per = {t.group_m * tn}, first = (bid / per) * {t.group_m};",
          f"const int rows = min({tm} - first, {t.group_m});",
          f"const int m0 = (first + (bid % per) % rows) * {t.bm}, n0 = ((bid % per) / rows) * {t.bn};"]


def render_mma(c: Contraction, t: Tiling, name: str, helpers: dict[str, str]) -> str:
  """Tensor cores: the block's warps_m x warps_n warps each own a warp tile of (bm / warps_m) x (bn / warps_n) outputs as
  m16 x n8 mma tiles; slices of bk are copied by cp.async `stages` deep (one barrier per slice). 16-bit inputs: m16n8k16
  steps with fragments read by ldmatrix. TF32: m16n8k8 steps with fragments read by 32-bit shared loads, each value rounded to
  TF32 (cvt.rna) as it is read."""
  a, b, o = c.a, c.b, c.c
  bm, bn, bk, S = t.bm, t.bn, t.bk, t.stages
  tf32 = t.kind == "tf32"
  ksz = 8 if tf32 else 16  # k of one mma step
  per = 16 // t.elem  # elements in a 16-byte chunk
  wtm, wtn = bm // t.warps_m, bn // t.warps_n
  mt, nt = wtm // 16, wtn // 8
  assert wtm % 16 == 0 and wtn % 16 == 0 and bk % 16 == 0 and S >= 2, t
  km = t.b_kmajor
  assert km == b_kmajor(c), t
  lda, ldb = bk + t.pad_a, (bk + t.pad_a if km else bn + t.pad_b)  # padded shared rows: 8 rows' fragment reads miss no bank
  a_chunks, b_chunks = bm * bk // per, bk * bn // per  # 16-byte chunks per slice
  assert a_chunks % t.threads == 0 and b_chunks % t.threads == 0, t
  mma = "kiln_mma_m16n8k8_tf32" if tf32 else f"kiln_mma_m16n8k16_{_MMA_PTX[a.dtype.name]}"
  el = "float" if tf32 else "unsigned short"
  kt = -(-c.k // bk)
  stage_a, stage_b = bm * lda, t.b_stage_elems  # elements
  L: list[str] = []
  e = L.append
  # registers: a 64x64 warp tile's 128 sums may take the whole file (one block per SM); smaller tiles are left to ptxas,
  # which keeps them near 128 (two blocks per SM) without spilling (a cap of 2 blocks spilled 4 bytes)
  e(_params(c, name, t.threads, 1 if mt * nt * 4 > 64 else 0) + " {")
  if t.shared_bytes > STATIC_SHARED: e(f"  KILN_DYNAMIC_SHARED(smem, {t.shared_bytes});")
  else: e(f"  __shared__ __align__(16) unsigned char smem[{t.shared_bytes}];")
  e(f"  {el}* As = ({el}*)smem;")
  e(f"  {el}* Bs = As + {S * stage_a};")
  e(f"  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = (warp / {t.warps_n}) * {wtm}, wn = (warp % {t.warps_n}) * {wtn};")
  for ln in _block_origin(c, t): e("  " + ln)
  for ln in _batch_offsets(c): e("  " + ln)
  e(f"  const {el}* A = (const {el}*)(data{a.slot} + offA);")
  e(f"  const {el}* B = (const {el}*)(data{b.slot} + offB);")
  e(f"  float acc[{mt}][{nt}][4];")
  e(f"  #pragma unroll\n  for (int i = 0; i < {mt}; i++)\n    #pragma unroll\n    for (int j = 0; j < {nt}; j++)\n"
    "      #pragma unroll\n      for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;")
  def copies(dst: str, stage: int, ld: int, chunks: int, width: int, row: tuple[str, str, int], col: tuple[str, str, int], stride: int,
             src: str) -> None:
    """This thread's cp.async chunks of one slice: shared rows of `width` elements, chunk (r, cc) holding the operand's row
    `row` and columns from `col` on (each: name, expression of r or cc, bound), `stride` elements between its rows."""
    (rv, rx, rb), (cv, cx, cb) = row, col
    e(f"      #pragma unroll\n      for (int it = 0; it < {chunks // t.threads}; it++) {{")
    e(f"        const int ch = tid + it * {t.threads}, r = ch / {width // per}, cc = (ch % {width // per}) * {per}, {rv} = {rx}, {cv} = {cx};")
    e(f"        const bool ok = {rv} < {rb} && {cv} < {cb};")
    e(f"        kiln_cp_async16({dst} + s * {stage} + r * {ld} + cc, {src} + (ok ? (long long){rv} * {stride} + {cv} : 0LL), ok);")
    e("      }")
  # an operand whose offsets are an expression (implicit GEMM) is read element by element into registers when its slice is
  # asked for, and stored to shared memory (rows of bk, k-major as A's) after this slice's steps (stash), so the loads'
  # latency hides behind them; the other keeps its cp.async chunks
  zero = "0.0f" if tf32 else "(unsigned short)0"
  scalar = [(reg, dst, stage, ld, rows) for op, reg, dst, stage, ld, rows in (
    (a, "ra", "As", stage_a, lda, bm), (b, "rb", "Bs", stage_b, ldb, bn)) if not op.affine]
  for reg, *_, rows in scalar: e(f"  {el} {reg}[{rows * bk // t.threads}];")
  if scalar:
    e("  auto stash = [&](int s) {")
    for reg, dst, stage, ld, rows in scalar:
      e(f"    #pragma unroll\n    for (int it = 0; it < {rows * bk // t.threads}; it++) {{")
      e(f"      const int e_ = tid + it * {t.threads};")
      e(f"      {dst}[s * {stage} + (e_ / {bk}) * {ld} + e_ % {bk}] = {reg}[it];")
      e("    }")
    e("  };")
  def elements(op: Operand, reg: str, rows: int, row0: str, bound: int, src: str) -> None:
    """This thread's elements of the operand's slice (rows x bk), its offsets and gate per element, into reg."""
    e(f"      #pragma unroll\n      for (int it = 0; it < {rows * bk // t.threads}; it++) {{")
    e(f"        const int e_ = tid + it * {t.threads}, gr = {row0} + e_ / {bk}, gk = k0 + e_ % {bk};")
    pre, off, gate = _offsets(op, "gr", "gk", helpers) if op is a else _offsets(op, "gk", "gr", helpers)
    L.extend("  " + ln for ln in pre)
    ok = f"gr < {bound} && gk < {c.k}" + (f" && ({gate})" if gate is not None else "")
    e(f"        {reg}[it] = ({ok}) ? {src}[{off}] : {zero};")
    e("      }")
  # one slice: A bm rows x bk, B bk rows x bn, in 16-byte chunks spread over the threads; a cp.async group per slice
  e("  auto load = [&](int s, int k0) {")
  e(f"    if (k0 < {c.k}) {{")
  if not a.affine: elements(a, "ra", bm, "m0", c.m, "A")
  else: copies("As", stage_a, lda, a_chunks, bk, ("gm", "m0 + r", c.m), ("gk", "k0 + cc", c.k), a.rows, "A")
  if not b.affine: elements(b, "rb", bn, "n0", c.n, "B")  # staged as B^T is
  elif km: copies("Bs", stage_b, ldb, b_chunks, bk, ("gn", "n0 + r", c.n), ("gk", "k0 + cc", c.k), b.cols, "B")  # B^T: rows n, k along them
  else: copies("Bs", stage_b, ldb, b_chunks, bn, ("gk", "k0 + r", c.k), ("gn", "n0 + cc", c.n), b.rows, "B")
  e("    }")
  e("    kiln_cp_async_commit();  // an empty group past the end keeps the wait counts uniform")
  e("  };")
  e(f"  #pragma unroll\n  for (int s = 0; s < {S - 1}; s++) {{ load(s, s * {bk});{' stash(s);' if scalar else ''} }}")
  e(f"  for (int kt = 0; kt < {kt}; kt++) {{")
  e(f"    kiln_cp_async_wait<{S - 2}>();  // this slice's copies are done (this thread's) ...")
  e("    __syncthreads();  // ... and everyone's; and every warp is past the slice the next load overwrites")
  e(f"    load((kt + {S - 1}) % {S}, (kt + {S - 1}) * {bk});")
  e(f"    const {el}* as = As + (kt % {S}) * {stage_a};")
  e(f"    const {el}* bs = Bs + (kt % {S}) * {stage_b};")
  e(f"    #pragma unroll\n    for (int ks = 0; ks < {bk}; ks += {ksz}) {{")
  e(f"      unsigned fa[{mt}][4], fb[{nt}][2];")
  if tf32:  # the m16n8k8 fragments (PTX ISA): A (g, t) (g+8, t) (g, t+4) (g+8, t+4); B (k t, n g) (k t+4, n g)
    e("      const int g = lane >> 2, t = lane & 3;")
    e(f"      #pragma unroll\n      for (int i = 0; i < {mt}; i++) {{")
    e(f"        const float* p = as + (wm + i * 16 + g) * {lda} + ks + t;")
    e(f"        fa[i][0] = kiln_tf32(p[0]); fa[i][1] = kiln_tf32(p[8 * {lda}]); fa[i][2] = kiln_tf32(p[4]); fa[i][3] = kiln_tf32(p[8 * {lda} + 4]);")
    e("      }")
    e(f"      #pragma unroll\n      for (int j = 0; j < {nt}; j++) {{")
    if km:
      e(f"        const float* p = bs + (wn + j * 8 + g) * {ldb} + ks + t;")
      e("        fb[j][0] = kiln_tf32(p[0]); fb[j][1] = kiln_tf32(p[4]);")
    else:
      e(f"        const float* p = bs + (ks + t) * {ldb} + wn + j * 8 + g;")
      e(f"        fb[j][0] = kiln_tf32(p[0]); fb[j][1] = kiln_tf32(p[4 * {ldb}]);")
    e("      }")
  else:
    e("      const int q = lane >> 3, r8 = lane & 7;")
    e(f"      #pragma unroll\n      for (int i = 0; i < {mt}; i++)")
    e(f"        kiln_ldmatrix_x4(fa[i], as + (wm + i * 16 + (q & 1) * 8 + r8) * {lda} + ks + (q >> 1) * 8);")
    e(f"      #pragma unroll\n      for (int j = 0; j < {nt}; j += 2) {{")
    e("        unsigned t4[4];")
    if km:  # n-major rows: plain ldmatrix gives the "col" fragments (matrices: n 0-7 k 0-7, n 0-7 k 8-15, n 8-15 ...)
      e(f"        kiln_ldmatrix_x4(t4, bs + (wn + j * 8 + (q >> 1) * 8 + r8) * {ldb} + ks + (q & 1) * 8);")
    else:
      e(f"        kiln_ldmatrix_x4_trans(t4, bs + (ks + (q & 1) * 8 + r8) * {ldb} + wn + j * 8 + (q >> 1) * 8);")
    e("        fb[j][0] = t4[0]; fb[j][1] = t4[1]; fb[j + 1][0] = t4[2]; fb[j + 1][1] = t4[3];")
    e("      }")
  e(f"      #pragma unroll\n      for (int i = 0; i < {mt}; i++)\n        #pragma unroll\n"
    f"        for (int j = 0; j < {nt}; j++) {mma}(acc[i][j], fa[i], fb[j]);")
  e("    }")
  if scalar: e(f"    stash((kt + {S - 1}) % {S});  // the slice every warp was past at this step's barrier")
  e("  }")
  e("  kiln_cp_async_wait<0>();")
  e(f"  {_MEM[o.dtype.name]}* C = data{o.slot} + offC;")
  e("  const int g = lane >> 2, t2 = (lane & 3) * 2;")
  e(f"  #pragma unroll\n  for (int i = 0; i < {mt}; i++)\n    #pragma unroll\n    for (int j = 0; j < {nt}; j++)\n"
    "      #pragma unroll\n      for (int h = 0; h < 4; h += 2) {")
  e("        const int gm = m0 + wm + i * 16 + g + (h >> 1) * 8, gn = n0 + wn + j * 8 + t2;")
  e(f"        if (gm >= {c.m}) continue;")
  e(f"        {_MEM[o.dtype.name]}* p = C + (long long)gm * {o.rows} + (long long)gn * {o.cols};")
  lines0, v0, nxt = _stored(c, "acc[i][j][h]", "gn", "        ", helpers, 0)
  if (pair := _PAIR.get(o.dtype.name)) is not None and _pairs_ok(c):  # each thread's two neighbours in one store
    lines1, v1, _ = _stored(c, "acc[i][j][h + 1]", "(gn + 1)", "        ", helpers, nxt)
    e(f"        if (gn < {c.n}) {{")
    L.extend(lines0 + lines1)
    e(f"          *({pair[0]}*)p = {pair[1]}({v0}, {v1});")
    e("        }")
  else:
    e(f"        if (gn < {c.n}) {{")
    L.extend(lines0)
    e(f"          p[0] = {_FROM_F32[o.dtype.name].format(v=v0)};")
    e("        }")
    lines1, v1, _ = _stored(c, "acc[i][j][h + 1]", "(gn + 1)", "        ", helpers, nxt)
    e(f"        if (gn + 1 < {c.n}) {{")
    L.extend(lines1)
    e(f"          p[{o.cols}] = {_FROM_F32[o.dtype.name].format(v=v1)};")
    e("        }")
  e("      }")
  e("}")
  return "\n".join(L)


# the tensor-core and async-copy steps under nvcc; the emulation harness defines the same names in plain C++
MMA_PRELUDE = r"""#ifdef __CUDACC__
__device__ __forceinline__ unsigned kiln_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void kiln_cp_async16(void* smem, const void* gmem, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(kiln_smem_addr(smem)), "l"(gmem), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void kiln_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void kiln_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
#define KILN_DYNAMIC_SHARED(name, bytes) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ void kiln_ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kiln_smem_addr(p)));
}
__device__ __forceinline__ void kiln_ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kiln_smem_addr(p)));
}
#define KILN_MMA(NAME, T) __device__ __forceinline__ void NAME(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); }
__device__ __forceinline__ unsigned kiln_tf32(float x) {  // round to TF32, to nearest with ties away (cvt.rna)
  unsigned r; asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x)); return r;
}
__device__ __forceinline__ void kiln_mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
KILN_MMA(kiln_mma_m16n8k16_f16, "f16")
KILN_MMA(kiln_mma_m16n8k16_bf16, "bf16")
#else
#include "kiln_cuda_mma.h"
#endif
"""


def _header(c: Contraction) -> str:
  dts = {d.name for d in _slot_types(c).values()} | ({u.dtype.scalar().name for u in c.value.toposort()} if c.value is not None else set())
  return "".join(h for d, h in (("float16", "#include <cuda_fp16.h>\n"), ("bfloat16", "#include <cuda_bf16.h>\n")) if d in dts)


def _align(c: Contraction, t: Tiling, slot: int) -> int:
  """The byte alignment the tiled kernel's vector accesses need of a buffer: 16 for cp.async chunks and float4 loads, 8 for
  float2; 0 where the element's own size does."""
  if slot not in (c.a.slot, c.b.slot, c.c.slot): return 0  # the epilogue's loads: one element at a time
  if slot == c.c.slot: return 2 * c.c.dtype.itemsize if t.kind != "simt" and c.c.dtype.name in _PAIR and _pairs_ok(c) else 0
  if t.kind != "simt": return 16
  vs = [_simt_loads(c, t, o)[1] for o in (c.a, c.b) if o.slot == slot]  # both, where A and B are one buffer
  return max(4 * v if v > 1 else 0 for v in vs)


def _simplified_indices(ast: UOp) -> UOp:
  """The AST with every buffer index simplified, where it has a sum to match: a graph's reshapes leave merged axes as
  (p // w) * w + p % w (a 1x1 conv's pixels, a flattened batch), which is p, affine, once simplified. Values are kept, so
  the tiled kernel computes what the AST does; the ProgramSpec keeps the AST as given (the kernel cache's key)."""
  nodes = ast.toposort()
  if not any(u.op is Ops.REDUCE for u in nodes): return ast
  new: dict[UOp, UOp] = {}
  for u in nodes:
    src = tuple(new[s] for s in u.src)
    if u.op is Ops.INDEX and len(src) >= 2 and src[1].op not in (Ops.RANGE, Ops.CONST): src = (src[0], simplify(src[1]), *src[2:])
    new[u] = u if all(a is b for a, b in zip(src, u.src)) else u.replace(src=src)
  return new[ast]


def covers(ast: UOp, target: Target) -> Contraction | None:
  """The contraction a verified kernel of 32-bit index arithmetic is, when the tiled kernel covers it; else None (the
  pipeline's `tiling` pass asks, kiln.codegen.pipeline)."""
  c = match(ast)
  if c is None and (plain := _simplified_indices(ast)) is not ast: c = match(plain)
  return c if c is not None and applies(c, target) else None


def program(ast: UOp, c: Contraction, t: Tiling, name: str) -> ProgramSpec:
  """The tiled kernel's ProgramSpec for the contraction c of ast (covers), tiled as t (kiln.codegen.choose.tiling)."""
  helpers: dict[str, str] = {}
  body = render_simt(c, t, name, helpers) if t.kind == "simt" else render_mma(c, t, name, helpers)
  src = _header(c) + ("" if t.kind == "simt" else MMA_PRELUDE) + "".join(h + "\n" for h in helpers.values()) + body + "\n"
  typ = _slot_types(c)
  slots = sorted(typ)
  sizes = {int(u.arg): u.dtype.size for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL and isinstance(u.dtype, PtrDType)}
  flops = 2 * c.m * c.n * c.k * c.batches
  mem = c.batches * (c.m * c.k * c.a.dtype.itemsize + c.k * c.n * c.b.dtype.itemsize + c.m * c.n * c.c.dtype.itemsize)
  return ProgramSpec(name=name, src=src, device="CUDA", ast=ast,  # type: ignore[arg-type]
                     global_size=(-(-c.n // t.bn), -(-c.m // t.bm), c.batch_grid if c.batch else 1), local_size=(t.threads, 1, 1),
                     vars=[Variable(name=v.arg[0], min=v.arg[1], max=v.arg[2]) for v in c.variables],
                     var_names=[v.arg[0] for v in c.variables],
                     globals=slots, outs=[c.c.slot], ins=[s for s in slots if s != c.c.slot], buf_count=len(slots),
                     args=[KernelArg(slot=s, dtype=str(typ[s]), size=sizes.get(s, -1), align=_align(c, t, s)) for s in slots],
                     applied_opts=[str(t)], flops=flops, mem_bytes=mem,
                     shared_bytes=t.shared_bytes if t.shared_bytes > STATIC_SHARED else 0)
