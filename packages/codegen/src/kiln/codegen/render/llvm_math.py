"""float32 EXP2 and LOG2 for the LLVM renderer as inline IR that LLVM vectorises (its llvm.exp2/llvm.log2 intrinsics lower to one
libm call per vector lane). float64 keeps the intrinsics (libm).

Each function is an alwaysinline helper of a float or an <n x float> made of the same instructions for every n, so a result does
not depend on whether its loop was vectorised. Both widen to double, reduce the range, evaluate a polynomial and round to float
once at the end: the double result is within ~5e-11 relative of the truth, so the float result is the correctly rounded one except
within that distance of a rounding boundary (never more than 1 ulp off, with or without FMA: none is used, so every x86 level
gives the same bits), and overflow to inf, underflow through the denormals to 0 and the ties between them fall out of that one
rounding (the fptrunc) exactly as IEEE defines them.
"""
from __future__ import annotations

import struct
from typing import Any

from kiln.ir.ops import Ops

# 2^f = 1 + f*(c1 + f*(c2 + ... + f*c7)) on |f| <= 1/2: relative error 4.7e-11 (Lawson-weighted least-squares minimax fit)
EXP2_POLY = tuple(map(float.fromhex, ('0x1.62e42ff0e1929p-1', '0x1.ebfbe07787770p-3', '0x1.c6b08ac069f68p-5', '0x1.3b29f39cfe158p-7',
  '0x1.5d8a85fff9e10p-10', '0x1.445c8446fe860p-13', '0x1.fde5fd5cbd200p-17')))
# log2(m) = s*(c1 + c3 s^2 + ... + c9 s^8), s = (m-1)/(m+1), m in [sqrt(1/2), sqrt(2)): relative error 4.2e-12 (same fit)
LOG2_POLY = tuple(map(float.fromhex, ('0x1.71547652be60cp+1', '0x1.ec709d1658c80p-1', '0x1.27777e32049c7p-1', '0x1.a58e260054e25p-2',
  '0x1.5cdef07b475e7p-2')))
EXP2_CLAMP = 200.0  # |x| beyond this gives inf or 0 anyway; keeps 2^n a normal double
# numpy's float32 exp2 (the reference) gives 0 at and below -149.5, where 2^x rounds to the least denormal 2^-149 (1 ulp away):
# flushing there too keeps a 0 wherever the reference has one
EXP2_FLUSH = -149.5
ROUND_MAGIC = 1.5 * 2.0**52  # adding it rounds a double of magnitude < 2^51 to an integer (ties to even), the integer in its low bits
SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # the mantissa split point: m lands in [sqrt(1/2), sqrt(2)), so |s| <= 0.1716
FLOAT_CONST = {"nan": "0x7FF8000000000000", "inf": "0x7FF0000000000000", "-inf": "0xFFF0000000000000"}


def _d(v: float) -> str: return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}"
def _vt(t: str, n: int) -> str: return t if n == 1 else f"<{n} x {t}>"
def _sp(t: str, c: str, n: int) -> str: return c if n == 1 else "<" + ", ".join([f"{t} {c}"] * n) + ">"


class _Body:
  """The instructions of one helper: each call appends `%vK = text` and names its result."""
  def __init__(self, n: int):
    self.n, self.lines, self.k = n, list[str](), 0
    self.F, self.D, self.L, self.B = (_vt(t, n) for t in ("float", "double", "i64", "i1"))

  def __call__(self, text: str) -> str:
    self.k += 1
    self.lines.append(f"  %v{self.k} = {text}")
    return f"%v{self.k}"

  def f(self, v: float) -> str: return _sp("float", _d(v), self.n)
  def d(self, v: float) -> str: return _sp("double", _d(v), self.n)
  def i(self, v: int) -> str: return _sp("i64", str(v), self.n)

  def horner(self, x: str, coeffs: tuple[float, ...]) -> str:  # coeffs[0] + x*(coeffs[1] + ...), unfused: the same on every ISA
    acc = self.d(coeffs[-1])
    for c in reversed(coeffs[:-1]): acc = self(f"fadd {self.D} {self(f'fmul {self.D} {acc}, {x}')}, {self.d(c)}")
    return acc

  def define(self, name: str, ret: str) -> str:
    return "\n".join([f"define internal {self.F} @{name}({self.F} %x) alwaysinline {{", *self.lines, f"  ret {self.F} {ret}", "}"])


def exp2_f32(b: _Body) -> str:
  """2^x: x at or below EXP2_FLUSH taken as -EXP2_CLAMP, above EXP2_CLAMP as EXP2_CLAMP (NaN kept); x = n + f with n = round(x),
  2^f by EXP2_POLY, times 2^n made from n's bits."""
  lo = b(f"select {b.B} {b(f'fcmp ole {b.F} %x, {b.f(EXP2_FLUSH)}')}, {b.F} {b.f(-EXP2_CLAMP)}, {b.F} %x")
  x = b(f"select {b.B} {b(f'fcmp ogt {b.F} {lo}, {b.f(EXP2_CLAMP)}')}, {b.F} {b.f(EXP2_CLAMP)}, {b.F} {lo}")
  d = b(f"fpext {b.F} {x} to {b.D}")
  t = b(f"fadd {b.D} {d}, {b.d(ROUND_MAGIC)}")
  f = b(f"fsub {b.D} {d}, {b(f'fsub {b.D} {t}, {b.d(ROUND_MAGIC)}')}")  # exact
  p = b.horner(f, (1.0, *EXP2_POLY))
  # t's low bits hold n (two's complement); the exponent field keeps 11 bits of n + 1023, in [823, 1223]
  nb = b(f"add {b.L} {b(f'bitcast {b.D} {t} to {b.L}')}, {b.i(1023)}")
  scale = b(f"bitcast {b.L} {b(f'shl {b.L} {nb}, {b.i(52)}')} to {b.D}")
  return b(f"fptrunc {b.D} {b(f'fmul {b.D} {p}, {scale}')} to {b.F}")  # the one rounding: inf, denormals, 0 included


def log2_f32(b: _Body) -> str:
  """log2(x): x widened to double (a float denormal is a normal double), x = m * 2^e with m in [sqrt(1/2), sqrt(2)), log2(m) by
  LOG2_POLY in s = (m-1)/(m+1); exact at powers of two (s = 0). 0 -> -inf, negative or NaN -> NaN, +inf -> +inf by selects."""
  bits = b(f"bitcast {b.D} {b(f'fpext {b.F} %x to {b.D}')} to {b.L}")
  e = b(f"ashr {b.L} {b(f'sub {b.L} {bits}, {b.i(SQRT_HALF_BITS)}')}, {b.i(52)}")
  top = b(f"shl {b.L} {e}, {b.i(52)}")
  m = b(f"bitcast {b.L} {b(f'sub {b.L} {bits}, {top}')} to {b.D}")
  s = b(f"fdiv {b.D} {b(f'fsub {b.D} {m}, {b.d(1.0)}')}, {b(f'fadd {b.D} {m}, {b.d(1.0)}')}")  # m - 1 exact
  lm = b(f"fmul {b.D} {s}, {b.horner(b(f'fmul {b.D} {s}, {s}'), LOG2_POLY)}")
  ef = b(f"sitofp {b.L} {e} to {b.D}")
  r = b(f"fptrunc {b.D} {b(f'fadd {b.D} {ef}, {lm}')} to {b.F}")
  for cmp, val in (("oeq", "-inf"), ("ult", "nan")):  # ult: below zero or unordered
    r = b(f"select {b.B} {b(f'fcmp {cmp} {b.F} %x, {b.f(0.0)}')}, {b.F} {_sp('float', FLOAT_CONST[val], b.n)}, {b.F} {r}")
  inf = _sp("float", FLOAT_CONST["inf"], b.n)
  return b(f"select {b.B} {b(f'fcmp oeq {b.F} %x, {inf}')}, {b.F} {inf}, {b.F} {r}")


BODIES = {Ops.EXP2: exp2_f32, Ops.LOG2: log2_f32}
INTRINSIC = {Ops.EXP2: "llvm.exp2", Ops.LOG2: "llvm.log2"}  # float64: libm through the intrinsic


def helper(op: Ops, n: int) -> tuple[str, str]:
  """The name and definition of op's float32 helper on n lanes."""
  b = _Body(n)
  name = f"kiln.{op.name.lower()}.f32.{n}"
  return name, b.define(name, BODIES[op](b))


def render(p: Any, op: Ops, s: Any, t: str, n: int, a: list[str], guard: bool) -> str:
  """An LLVMPrinter op entry: float, bfloat16 and widened float16 (all float in registers) call the helper, double the intrinsic."""
  r = p.tmp()
  if "double" in t: fn = p.intrinsic(f"{INTRINSIC[op]}.{'f64' if n == 1 else f'v{n}f64'}", t, [t])
  else:
    name, text = helper(op, n)
    p.helpers.setdefault(name, text)
    fn = f"@{name}"
  p.emit(f"{r} = call {t} {fn}({t} {a[0]})")
  return r
