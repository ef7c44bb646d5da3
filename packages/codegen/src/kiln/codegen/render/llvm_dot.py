"""Ops.DOT4 in LLVM IR: c + the dot product of a's four bytes (unsigned) with b's four bytes (signed), per int32 lane.

Where the target has a byte dot product instruction (Target.dot_bytes: AVX512-VNNI's or AVX-VNNI's vpdpbusd, which is
exact: no saturation, the sum wraps as the add does) a vector of 16-byte multiples takes it, in pieces of the widest
vector it has. Elsewhere (AVX2, SSE, NEON, a scalar) the bytes are widened to int32, multiplied (exact: |u8 x s8| <
2**15) and summed in adjacent pairs twice; x86 selects that as pmaddwd on byte-to-word extensions, NEON as its widening
multiplies."""
from __future__ import annotations

from typing import Any, Protocol

from kiln.codegen.render.llvm_math import vtype


class Emitter(Protocol):
  def tmp(self) -> str: ...
  def emit(self, s: str) -> None: ...
  def intrinsic(self, name: str, ret: str, args: list[str]) -> str: ...


def entry(p: Any, op: Any, s: Any, t: str, n: int, a: list[str], guard: bool) -> str:
  """The LLVM printer's table entry for Ops.DOT4 (render/llvm.py's alu_text calls it so): for the printer's target."""
  return render(p, p.target.dot_bytes, n, *a)


def render(p: Emitter, dot_bytes: int, n: int, a: str, b: str, c: str) -> str:
  """The value of DOT4(a, b, c) over n int32 lanes (n == 1: scalars) for a target whose widest dot product vector is
  dot_bytes (0: none)."""
  piece = min(4 * n, dot_bytes)
  if piece >= 16 and (4 * n) % piece == 0 and _power_of_two(4 * n // piece): return _instruction(p, n, piece // 4, a, b, c)
  return _widened(p, n, a, b, c)


def _power_of_two(k: int) -> bool: return k > 0 and k & (k - 1) == 0


def _instruction(p: Emitter, n: int, w: int, a: str, b: str, c: str) -> str:
  fn = p.intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * w}", vtype("i32", w), [vtype("i32", w), vtype("i8", 4 * w), vtype("i8", 4 * w)])
  outs = []
  for i in range(n // w):
    pa, pb, pc = (_part(p, x, n, i * w, w) for x in (a, b, c))
    ba, bb = _bytes(p, pa, w), _bytes(p, pb, w)
    r = p.tmp()
    p.emit(f"{r} = call {vtype('i32', w)} {fn}({vtype('i32', w)} {pc}, {vtype('i8', 4 * w)} {ba}, {vtype('i8', 4 * w)} {bb})")
    outs.append(r)
  return _joined(p, outs, w)


def _widened(p: Emitter, n: int, a: str, b: str, c: str) -> str:
  t = vtype("i32", 4 * n)
  ua, sb = p.tmp(), p.tmp()
  p.emit(f"{ua} = zext {vtype('i8', 4 * n)} {_bytes(p, a, n)} to {t}")
  p.emit(f"{sb} = sext {vtype('i8', 4 * n)} {_bytes(p, b, n)} to {t}")
  prod = p.tmp()
  p.emit(f"{prod} = mul nsw {t} {ua}, {sb}")
  pairs = _pair_sums(p, prod, 4 * n)
  quads = _pair_sums(p, pairs, 2 * n)
  if n == 1:
    q = p.tmp()
    p.emit(f"{q} = extractelement <1 x i32> {quads}, i32 0")
    quads = q
  r = p.tmp()
  p.emit(f"{r} = add {vtype('i32', n)} {quads}, {c}")
  return r


def _pair_sums(p: Emitter, v: str, m: int) -> str:
  """<m x i32> -> <m/2 x i32>: the sums of lanes 2i and 2i + 1."""
  half = m // 2
  ev, od, r = p.tmp(), p.tmp(), p.tmp()
  for name, start in ((ev, 0), (od, 1)):
    mask = ", ".join(f"i32 {2 * i + start}" for i in range(half))
    p.emit(f"{name} = shufflevector <{m} x i32> {v}, <{m} x i32> poison, <{half} x i32> <{mask}>")
  p.emit(f"{r} = add nsw <{half} x i32> {ev}, {od}")
  return r


def _bytes(p: Emitter, v: str, n: int) -> str:
  r = p.tmp()
  p.emit(f"{r} = bitcast {vtype('i32', n)} {v} to {vtype('i8', 4 * n)}")
  return r


def _part(p: Emitter, v: str, n: int, start: int, w: int) -> str:
  """Lanes [start, start + w) of an <n x i32>."""
  if w == n: return v
  r = p.tmp()
  mask = ", ".join(f"i32 {start + i}" for i in range(w))
  p.emit(f"{r} = shufflevector <{n} x i32> {v}, <{n} x i32> poison, <{w} x i32> <{mask}>")
  return r


def _joined(p: Emitter, parts: list[str], w: int) -> str:
  """Pieces of w lanes each, concatenated in order (a power-of-two count, as vector widths are)."""
  while len(parts) > 1:
    nxt = []
    for x, y in zip(parts[0::2], parts[1::2]):
      r = p.tmp()
      mask = ", ".join(f"i32 {i}" for i in range(2 * w))
      p.emit(f"{r} = shufflevector <{w} x i32> {x}, <{w} x i32> {y}, <{2 * w} x i32> <{mask}>")
      nxt.append(r)
    parts, w = nxt, 2 * w
  return parts[0]
