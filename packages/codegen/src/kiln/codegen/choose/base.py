"""What optimisation options are: the ops (OptOps), an option (Opt) and what the optimiser may assume about the device
(Target, the machine model), with the axis arithmetic every part of the optimiser shares. kiln.codegen.choose re-exports them."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops
from kiln.ir.rewrite import substitute
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp


class OptOps(Enum):
  UPCAST = "UPCAST"  # vectorise an axis: `amount` consecutive values become the lanes of one vector (one output axis; one axis per REDUCE)
  UNROLL = "UNROLL"  # unroll an axis by `amount` (output axes: register tiling; reduce axes: a longer loop body)
  THREAD = "THREAD"  # CPU: cut an output axis (or a full reduction) into `amount` chunks that the threads claim (core_id)
  LOCAL = "LOCAL"  # GPU: `amount` threads of a block along an output axis (the rest goes to the grid)
  GROUP = "GROUP"  # GPU: `amount` threads of a block share a reduction (a fixed tree: warp shuffles, then shared memory)
  SPREAD = "SPREAD"  # GPU, with a GROUP of `amount`: the block's threads share this output axis (thread t takes t, t + amount,
  # ...) inside the block, reading the GROUP reductions' results every thread got (softmax's row max and sum)
  BLOCKS = "BLOCKS"  # GPU: a full reduction's GROUP axis is cut over `amount` blocks; the last block to finish folds their
  # partials in block order (two stages in one launch)
  OUTER = "OUTER"  # CPU: make this output axis the outermost loop (amount 1)
  PACK = "PACK"  # CPU: copy the panel a reduce axis reads, per outer tile, into contiguous per-thread scratch (amount 1)
  FMA = "FMA"  # a float sum of products over this reduce axis accumulates with fused multiply-adds (one rounding; amount 1)
  KEEP = "KEEP"  # CPU: a REDUCE over this axis keeps its per-element values in per-thread scratch, and a store that computes
  # the same values along an output axis reads them back instead of computing them again (softmax's exp; amount 1)
  TILE = "TILE"  # CUDA: print the kernel as the tiled matrix product (render/cuda_matmul.py) with tile `amount` of
  # choose/tiling.py's TILES; the only option of its list, on axis 0 (it names no axis)


@dataclass(frozen=True, order=True)
class Opt:
  op: OptOps
  axis: int  # the axis_id of a user RANGE
  amount: int

  def __post_init__(self) -> None:
    if not isinstance(self.op, OptOps): raise CodegenError(f"Opt.op must be an OptOps, got {self.op!r}")
    if not isinstance(self.amount, int) or self.amount < 1: raise CodegenError(f"{self.op.name} amount must be a positive int, got {self.amount!r}")
  def __str__(self) -> str: return f"{self.op.name}(axis={self.axis}, {self.amount})"


@dataclass(frozen=True)
class Target:
  """What the optimiser may assume about the device: the machine model. The CPU runtime fills it from the CPU it compiles
  for (LLVM's features, sysfs caches); a Target made by hand gets the defaults below. vector_registers left at 0 follows
  vector_bytes: 32 for 64-byte vectors (AVX-512), else 16 (AVX2, AVX, SSE), so a hand-made AVX2 Target gets AVX2 tiles;
  aarch64 NEON (16-byte vectors, 32 registers) must say so."""
  device: str = "CPU"
  vector_bytes: int = 32  # 32 for AVX2, 64 for AVX-512; 0 on GPUs (no explicit vectors)
  threads: int = 1  # CPU: the most threads claiming a split kernel's chunks at once (each has its own PACK/KEEP scratch): the cores
  min_work_per_thread: int = 1 << 12  # CPU: cycles a thread's share of a split kernel must exceed (a chunk to a spinning worker: ~1 us)
  stream_store_bytes: int = 0  # CPU: vector stores to an output at least this large bypass the caches (0: never)
  max_local: int = 1024  # GPU: threads per block
  local_size: int = 256  # GPU: default block size
  max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
  gpu_arch: int = 0  # GPU: compute capability as major * 10 + minor (90: sm_90); 0 unknown: no tensor-core kernels
  gpu_sms: int = 0  # GPU: multiprocessors (the tiled matmul sizes its tiles so each gets a block); 0 unknown
  allow_tf32: bool = False  # GPU: float32 matmuls may round their inputs to TF32 for tensor cores (opt-in: KILN_CUDA_TF32=1)
  vector_registers: int = 0  # CPU: architectural vector registers (16 AVX2/AVX, 32 AVX-512 and NEON); 0: from vector_bytes
  l1d_bytes: int = 32 << 10  # CPU: per-core L1 data cache
  l2_bytes: int = 1 << 20  # CPU: per-core L2
  l3_bytes: int = 32 << 20  # CPU: the last-level cache cpu0 shares
  cores: int = 1  # CPU: physical cores this process may run on
  fma: bool = False  # CPU: a fused multiply-add exists; the vector maths (render/llvm_math.py) then fuses its polynomials
  round: bool = False  # CPU: rounding to nearest even is one instruction (SSE4.1 roundps, AArch64 frintn): the vector maths use it
  dot_bytes: int = 0  # CPU: the widest vector of an exact unsigned x signed byte dot product (VNNI's vpdpbusd: 64 AVX512-VNNI,
  #                     32 AVX-VNNI) the renderer prints Ops.DOT4 with; 0: widened multiplies and pairwise adds

  def __post_init__(self) -> None:
    if self.vector_registers == 0: object.__setattr__(self, "vector_registers", 32 if self.vector_bytes >= 64 else 16)


def axis_size(r: UOp) -> int | None:
  """A range's trip count when it is a constant."""
  e = r.src[0]
  return int(e.arg) if e.op is Ops.CONST else None


def axis_bound(r: UOp) -> int:
  """A range's largest trip count: its size, or a symbolic size's upper bound (a GPU grid dimension must hold it)."""
  return s if (s := axis_size(r)) is not None else int(r.src[0].vmax)


def affine_coeff(idx: UOp, var: UOp) -> int | None:
  """The constant a with idx == a*var + (terms without var), or None when idx is not affine in var."""
  memo: dict[UOp, int | None] = {}
  for u in idx.toposort():
    if u is var: memo[u] = 1; continue
    if not any(memo.get(s) != 0 for s in u.src) or not u.src: memo[u] = 0; continue
    c = [memo[s] for s in u.src]
    if u.op is Ops.ADD: memo[u] = None if None in c else c[0] + c[1]  # type: ignore[operator]
    elif u.op is Ops.SUB: memo[u] = None if None in c else c[0] - c[1]  # type: ignore[operator]
    elif u.op is Ops.NEG: memo[u] = None if c[0] is None else -c[0]
    elif u.op is Ops.MUL and u.src[1].op is Ops.CONST and c[1] == 0: memo[u] = None if c[0] is None else c[0] * int(u.src[1].arg)
    elif u.op is Ops.MUL and u.src[0].op is Ops.CONST and c[0] == 0: memo[u] = None if c[1] is None else c[1] * int(u.src[0].arg)
    elif u.op is Ops.CAST and u.dtype.is_int and u.dtype.itemsize >= 4: memo[u] = c[0]
    else: memo[u] = None
  return memo[idx]


GPU_WARP = 32  # the smallest row block: one warp (shuffles only, no shared memory), for rows under 2 * 32 * GPU_PER_THREAD


def divmod_free_steps(u: UOp, k: UOp, size: int, most: int) -> int:
  """The fewest steps m of axis k (dividing its size, at most `most`) after which u's index arithmetic, with k = q*m + c
  for a constant c, has no // or % of q left: a conv's k = (channel, ky, kx) over a 3x3 window takes m = 9, each step
  then one channel with its nine window offsets constants. 1 where u has no // or % of k (a matmul) or no such m exists."""
  def divides(e: UOp, v: UOp) -> bool: return any(n.op in (Ops.IDIV, Ops.MOD) and v in n.src[0].toposort() for n in e.toposort())
  if not divides(u, k): return 1
  for m in range(2, min(size, most) + 1):
    if size % m: continue
    qm = UOp(Ops.DEFINE_VAR, k.dtype, (), ("steps.q", 0, size // m - 1))
    if not any(divides(simplify(substitute(u, {k: qm * m + c})), qm) for c in range(m)): return m
  return 1
