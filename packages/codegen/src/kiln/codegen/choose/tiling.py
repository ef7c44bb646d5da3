"""The CUDA matrix product's tile (render/cuda_matmul.py prints the kernel for it): tensor cores where they apply (16-bit
inputs, or float32 under the TF32 opt-in, on sm_80+ with 16-byte aligned rows), else the largest SIMT tile that still gives
every multiprocessor a block. What it reads of the GPU: Target.gpu_arch, gpu_sms and allow_tf32."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.codegen.choose.base import Target
from kiln.codegen.choose.contraction import Contraction
from kiln.ir.dtype import dtypes
from kiln.ir.errors import CodegenError

THREADS = 256  # a SIMT tile's block


@dataclass(frozen=True)
class Tiling:
  kind: str  # "simt", "mma" (float16/bfloat16 tensor cores) or "tf32" (float32 inputs rounded to TF32, opt-in)
  bm: int
  bn: int
  bk: int
  warps_m: int = 2  # mma: the block's warps as warps_m x warps_n, each a (bm / warps_m) x (bn / warps_n) warp tile
  warps_n: int = 4
  stages: int = 2  # mma: slices in flight (cp.async groups); more than fit 48 KB of static shared memory go dynamic
  group_m: int = 0  # blocks walk tile rows in groups of this many (0: row by row), so neighbours share B's slices in L2
  b_kmajor: bool = False  # tensor cores: B's k is contiguous (B^T stored, ONNX Gemm's transB): staged n-major like A

  @property
  def threads(self) -> int: return THREADS if self.kind == "simt" else 32 * self.warps_m * self.warps_n

  @property
  def elem(self) -> int:
    """Bytes of one staged element: 2 for float16/bfloat16, 4 for TF32's float32 (SIMT stages float32 too)."""
    return 2 if self.kind == "mma" else 4

  @property
  def pad_a(self) -> int: return 16 // self.elem  # elements added to each shared row of A: 16 bytes, so fragment reads miss no bank

  pad_b = 8  # and of B: 16 bytes for ldmatrix's rows; 32 for TF32's scalar reads (lanes t and t + 1 rows apart)

  @property
  def shared_bytes(self) -> int:
    """Tensor cores: shared memory per block (every stage's A and B slices, rows padded)."""
    if self.kind == "simt": return 0
    return self.stages * self.elem * (self.bm * (self.bk + self.pad_a) + self.b_stage_elems)

  @property
  def b_stage_elems(self) -> int:
    """B's slice in shared memory: bk rows of bn (padded), or for a k-major B bn rows of bk (padded like A's)."""
    return self.bn * (self.bk + self.pad_a) if self.b_kmajor else self.bk * (self.bn + self.pad_b)

  def __str__(self) -> str:
    if self.kind == "simt": return f"TILED_MATMUL(simt {self.bm}x{self.bn}x{self.bk})"
    return (f"TILED_MATMUL({self.kind} {self.bm}x{self.bn}x{self.bk} warps {self.warps_m}x{self.warps_n} stages {self.stages}"
            f"{f' group {self.group_m}' if self.group_m else ''}{' B k-major' if self.b_kmajor else ''})")


def _mma_kind(c: Contraction, target: Target) -> str | None:
  """Which tensor-core kernel applies: "mma" for 16-bit float inputs, "tf32" for float32 inputs when the target allows TF32
  (opt-in: it rounds the inputs to 10 mantissa bits), on sm_80+ with float32 sums, k- and n-contiguous rows whose 16-byte
  chunks align; else None."""
  if target.gpu_arch < 80 or c.acc != dtypes.float32: return None
  if c.a.dtype in (dtypes.float16, dtypes.bfloat16): kind, per = "mma", 8
  elif c.a.dtype == dtypes.float32 and target.allow_tf32: kind, per = "tf32", 4
  else: return None
  a, b = c.a, c.b
  # B in 16-byte chunks along n (row-major) or along k (B^T stored): its other stride and every start a multiple of a chunk;
  # A too, or element by element where its offsets are an expression (implicit GEMM: render_mma's stash)
  b_ok = not b.affine or (((b.cols == 1 and b.rows % per == 0) or (b.rows == 1 and b.cols % per == 0)) and b.offset % per == 0
                          and c.n % per == 0 and all(s % per == 0 for s in b.batch))
  a_ok = not a.affine or (a.cols == 1 and a.rows % per == 0 and a.offset % per == 0 and all(s % per == 0 for s in a.batch))
  return kind if a_ok and b_ok and c.k % per == 0 else None


def b_kmajor(c: Contraction) -> bool:
  """B's k is contiguous (B^T stored, ONNX Gemm's transB), or B is read element by element (staged as B^T is)."""
  return not c.b.affine or (c.b.rows == 1 and c.b.cols != 1)


# The tiles an option may name (OptOps.TILE's amount is a number here, from 1); B's layout is the product's (b_kmajor).
TILES = (Tiling("simt", 128, 128, 8), Tiling("simt", 128, 64, 8), Tiling("simt", 64, 64, 8),
         Tiling("mma", 128, 128, 32, 2, 4, 3), Tiling("mma", 128, 256, 64, 2, 4, 3, 8),  # float16/bfloat16 tensor cores
         Tiling("tf32", 128, 128, 32, 2, 4, 3))


def choose_tiling(c: Contraction, target: Target) -> Tiling:
  """The tile: tensor cores where they apply; else the largest SIMT tile that still gives every SM a block."""
  return tile_for(c, target, choose_tile(c, target))


def choose_tile(c: Contraction, target: Target) -> int:
  """The heuristic's tile, as its number in TILES."""
  sms = max(1, target.gpu_sms)
  kind = _mma_kind(c, target)
  if kind == "tf32": return 6  # float32 stages: half the k of a 16-bit slice in the same bytes
  if kind == "mma":
    # measured on an H100 (runtime-cuda tools/gpu_check.py mmatune): 128x256x64 tiles lead once there are two waves of them; before that
    # 128x128x32 keeps more SMs busy. Three stages of cp.async either way (two left 5% on the table, four gained nothing)
    return 5 if -(-c.m // 128) * -(-c.n // 256) * c.batches >= 2 * sms else 4
  for number, (bm, bn) in enumerate(((128, 128), (128, 64)), 1):
    if -(-c.m // bm) * -(-c.n // bn) * c.batches >= sms: return number
  return 3


def fitting_tiles(c: Contraction, target: Target) -> list[int]:
  """The numbers of the TILES the product takes on the target: SIMT always, tensor cores of the kind that applies."""
  kind = _mma_kind(c, target)
  return [i for i, t in enumerate(TILES, 1) if t.kind in ("simt", kind)]


def tile_for(c: Contraction, target: Target, number: int) -> Tiling:
  """Tile `number` of TILES for the product, B laid out as the product's; a CodegenError names why when it does not fit."""
  if not 1 <= number <= len(TILES): raise CodegenError(f"TILE {number}: the tiles are numbered 1 to {len(TILES)}")
  t = TILES[number - 1]
  if t.kind != "simt" and _mma_kind(c, target) != t.kind:
    need = "float32 inputs with TF32 allowed (KILN_CUDA_TF32=1)" if t.kind == "tf32" else "float16/bfloat16 inputs"
    raise CodegenError(f"TILE {number} ({t}) does not fit this product: tensor cores need sm_80+, {need}, float32 sums and "
                       f"16-byte aligned rows; it has {c.a.dtype.name} inputs on sm_{target.gpu_arch}")
  return replace(t, b_kmajor=b_kmajor(c))
