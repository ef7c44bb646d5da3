"""Streaming (non-temporal) stores for the LLVM renderer: which tiers a vector store can take, the entry flags that pick one,
and the branches that write it. Functions of the printer `p` (LLVMPrinter: emit, label, tmp, n, target, entry, stream_flags).

An output of at least Target.stream_store_bytes streams by its base's alignment (flags
computed once on entry; LLVM unswitches the loop on them, one copy per row):
  base aligned to           | each vector store is written as              | x86
  the vector (up to 64 B)   | one non-temporal store                       | vmovntps ymm / zmm
  16 bytes (numpy, malloc)  | its 16-byte pieces, each non-temporal        | vmovntps xmm (+ vextractf128 / 32x4)
  less (the element's own)  | the ordinary store                           | vmovups
Not covered: an element-aligned base (4, 8 or 12 past a 16-byte boundary) keeps ordinary stores. Its streamed pieces
would be scalar (movnti; SSE4A movntsd), which measured slower than ordinary stores on Zen 3 (16M float add, 2
threads, output 4 past a boundary: 12.6 ms against 7.6; 8 past: 10.1 against 8.6; under KILN_CPU=x86-64-v3's
movnti about 4x slower). Peeling each thread's chunk to a 16-byte boundary would do it, but the loop is the
lowering's, not the renderer's. Gated stores, scalar stores and vectors not a power of two >= 16 bytes wide stay
ordinary too. Every piece lies inside the vector it comes from: nothing outside the output is touched.
"""
from __future__ import annotations

from typing import Any

from kiln.codegen.render.llvm_math import vtype
from kiln.ir.dtype import DType, PtrDType
from kiln.ir.ops import Ops
from kiln.ir.symbolic import is_multiple
from kiln.ir.uop import UOp


def multiple(u: UOp, k: int) -> bool:
  """is_multiple, also through a sum of parts and a WHERE of two (an overlapped last tile starts at n - width)."""
  if is_multiple(u, k): return True
  if u.op is Ops.WHERE: return multiple(u.src[1], k) and multiple(u.src[2], k)
  return u.op is Ops.ADD and all(multiple(s, k) for s in u.src)


def tiers(p: Any, idx: UOp, dt: DType) -> list[tuple[str, int]]:
  """The streaming tiers (the table above) a vector store to a large output can take: x86 needs each non-temporal store
  aligned to its own width, so a piece must land at a provable multiple of that width from the buffer's start, and
  the base's alignment is checked at run time. Returns (flag, piece bytes) per tier, widest first; [] for an
  ordinary store."""
  buf = idx.src[0]
  if not p.target.stream_store_bytes or dt.count == 1 or buf.op is not Ops.DEFINE_GLOBAL: return []
  assert isinstance(buf.dtype, PtrDType)
  item, width = buf.dtype.base.itemsize, buf.dtype.base.itemsize * dt.count
  if buf.dtype.size <= 0 or buf.dtype.size * item < p.target.stream_store_bytes: return []
  if width < 16 or width & (width - 1): return []
  out = []
  for piece in dict.fromkeys((min(width, 64), 16)):  # the whole vector, then its xmm pieces
    if width % piece == 0 and multiple(idx.src[1], piece // item): out.append((flag(p, buf.arg, piece), piece))
  return out


def flag(p: Any, slot: int, align: int) -> str:
  """The entry block's flag: is buffer `slot`'s base a multiple of `align` bytes. Computed once, before every loop,
  so LLVM unswitches the branches on it out of the loops."""
  name = f"%stream{slot}.a{align}"
  if name not in p.stream_flags:
    p.stream_flags.add(name)
    p.entry += [f"{name}.p = ptrtoint ptr %data{slot} to i64", f"{name}.m = and i64 {name}.p, {align - 1}", f"{name} = icmp eq i64 {name}.m, 0"]
  return name


def store(p: Any, v: str, ptr: str, ms: str, dt: DType, tiers: list[tuple[str, int]], plain: str) -> None:
  """Branch on the tiers' flags, widest first: the first whose base alignment holds writes the vector as non-temporal
  stores of its pieces; none: the ordinary store."""
  n = p.n
  p.n += 1
  done, lanes = f"stdone{n}", dt.count
  for k, (fl, piece) in enumerate(tiers):
    nt, nxt = f"stnt{n}.{k}", f"stck{n}.{k + 1}" if k + 1 < len(tiers) else f"stpl{n}"
    p.emit(f"br i1 {fl}, label %{nt}, label %{nxt}")  # loop-invariant: LLVM unswitches it out of the loop
    p.label(nt)
    per = piece // dt.itemsize  # lanes a piece
    for s in range(0, lanes, per):
      pv, pp = v, ptr
      if per < lanes:
        pv, pp, mask = p.tmp(), p.tmp(), ", ".join(f"i32 {s + i}" for i in range(per))
        p.emit(f"{pv} = shufflevector {vtype(ms, lanes)} {v}, {vtype(ms, lanes)} poison, <{per} x i32> <{mask}>")
        p.emit(f"{pp} = getelementptr inbounds {ms}, ptr {ptr}, i32 {s}")
      p.emit(f"store {vtype(ms, per)} {pv}, ptr {pp}, align {piece}, !nontemporal !{{i32 1}}")
    p.emit(f"br label %{done}")
    p.label(nxt)
  p.emit(plain)
  p.emit(f"br label %{done}")
  p.label(done)
