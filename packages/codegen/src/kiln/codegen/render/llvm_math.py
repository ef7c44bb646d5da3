"""float32 EXP2, LOG2, ERF and TANH for the LLVM renderer as inline IR that LLVM vectorises (its llvm.exp2/llvm.log2 intrinsics lower
to one libm call per vector lane, and erf/tanh have no intrinsic at all). float64 keeps libm: the intrinsics, and erf/tanh called
lane by lane.

Each function is an alwaysinline helper of a float or an <n x float> made of the same instructions for every n, so a result does
not depend on whether its loop was vectorised. All widen to double, reduce the range, evaluate a polynomial and round to float
once at the end: the double result is within ~5e-11 relative of the truth, so the float result is the correctly rounded one except
within that distance of a rounding boundary (never more than 1 ulp off, with or without FMA: none is used, so every x86 level
gives the same bits), and overflow to inf, underflow through the denormals to 0 and the ties between them fall out of that one
rounding (the fptrunc) exactly as IEEE defines them.
"""
from __future__ import annotations

import struct
from collections.abc import Callable
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
# Fits below made at development time with numpy: weighted least squares on 4000 Chebyshev nodes against math.erf/erfc/tanh in double,
# reweighted 60 times toward the largest relative error (Lawson), so near-minimax; errors measured with Horner in double on 2e5 points.
# erf(x) = x*P(x^2) on |x| <= 0.9: relative error 1.3e-13
ERF_SMALL = tuple(map(float.fromhex, ('0x1.20dd7504298d5p+0', '-0x1.812746afb8519p-2', '0x1.ce2f215f9820ep-4', '-0x1.b82cd65c92527p-6',
  '0x1.565a8b143d716p-8', '-0x1.c009b42c1db26p-11', '0x1.f740e7182f43ep-14', '-0x1.dced0c8ab0493p-17', '0x1.344c784e9bd9bp-20')))
# erfc(x) * exp(x^2) = P(v), v = (x-2)/(x+2) in [-0.38, 1/3] for x in [0.9, 4]: relative error 1.1e-12
ERFC_SCALED = tuple(map(float.fromhex, ('0x1.058671b52c8c7p-2', '-0x1.b57034effac78p-2', '0x1.eeea7dc8cae3fp-3', '-0x1.437f0b08835d5p-4',
  '0x1.e9470e50c8759p-9', '0x1.ca94e1ef3f4dbp-8', '-0x1.bc222eb47aee0p-11', '-0x1.011f04d7fae5ep-10', '0x1.6c118d9c54f56p-15',
  '0x1.5a5e014468ba2p-13', '0x1.b2caf443c1aecp-16')))
# tanh(x) = x*P(x^2) on |x| <= 0.55: relative error 7.8e-13
TANH_SMALL = tuple(map(float.fromhex, ('0x1.fffffffffe48ep-1', '-0x1.5555554fa1ffcp-2', '0x1.11110df42c4d0p-3', '-0x1.ba1a54c87278cp-5',
  '0x1.662ceaed6b889p-6', '-0x1.207c01a570632p-7', '0x1.b6ef4769d4083p-9', '-0x1.dd8b7d9fadd77p-11')))
# |x| below: the polynomial in x^2; at or above: through exp, clamped to the top (past it float32 erf/tanh round to +-1, as does the formula)
ERF_SPLIT, ERF_TOP, TANH_SPLIT, TANH_TOP = 0.9, 4.0, 0.55, 10.0
LOG2E = 1.4426950408889634
SIGN, ABS = 1 << 63, (1 << 63) - 1
FLOAT_CONST = {"nan": "0x7FF8000000000000", "inf": "0x7FF0000000000000", "-inf": "0xFFF0000000000000"}


def double_hex(v: float) -> str:
  """A float constant as LLVM IR writes it exactly: the 16 hex digits of its double bits (float constants too)."""
  return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}"
def vtype(t: str, n: int) -> str: return t if n == 1 else f"<{n} x {t}>"
def _sp(t: str, c: str, n: int) -> str: return c if n == 1 else "<" + ", ".join([f"{t} {c}"] * n) + ">"


class _Body:
  """The instructions of one helper: each call appends `%vK = text` and names its result."""
  def __init__(self, n: int):
    self.n, self.lines, self.k = n, list[str](), 0
    self.F, self.D, self.L, self.B = (vtype(t, n) for t in ("float", "double", "i64", "i1"))

  def __call__(self, text: str) -> str:
    self.k += 1
    self.lines.append(f"  %v{self.k} = {text}")
    return f"%v{self.k}"

  def f(self, v: float) -> str: return _sp("float", double_hex(v), self.n)
  def d(self, v: float) -> str: return _sp("double", double_hex(v), self.n)
  def i(self, v: int) -> str: return _sp("i64", str(v), self.n)

  def horner(self, x: str, coeffs: tuple[float, ...]) -> str:  # coeffs[0] + x*(coeffs[1] + ...), unfused: the same on every ISA
    acc = self.d(coeffs[-1])
    for c in reversed(coeffs[:-1]): acc = self(f"fadd {self.D} {self(f'fmul {self.D} {acc}, {x}')}, {self.d(c)}")
    return acc

  def define(self, name: str, ret: str) -> str:
    return "\n".join([f"define internal {self.F} @{name}({self.F} %x) alwaysinline {{", *self.lines, f"  ret {self.F} {ret}", "}"])


def exp2_f32(b: _Body) -> str:
  """2^x: x at or below EXP2_FLUSH taken as -EXP2_CLAMP, above EXP2_CLAMP as EXP2_CLAMP (NaN kept), then exp2_d."""
  lo = b(f"select {b.B} {b(f'fcmp ole {b.F} %x, {b.f(EXP2_FLUSH)}')}, {b.F} {b.f(-EXP2_CLAMP)}, {b.F} %x")
  x = b(f"select {b.B} {b(f'fcmp ogt {b.F} {lo}, {b.f(EXP2_CLAMP)}')}, {b.F} {b.f(EXP2_CLAMP)}, {b.F} {lo}")
  return b(f"fptrunc {b.D} {exp2double_hex(b, b(f'fpext {b.F} {x} to {b.D}'))} to {b.F}")  # the one rounding: inf, denormals, 0 included


def exp2double_hex(b: _Body, d: str) -> str:
  """2^d in double for |d| <= EXP2_CLAMP (NaN gives NaN): d = n + f with n = round(d), 2^f by EXP2_POLY, times 2^n made from n's bits."""
  t = b(f"fadd {b.D} {d}, {b.d(ROUND_MAGIC)}")
  f = b(f"fsub {b.D} {d}, {b(f'fsub {b.D} {t}, {b.d(ROUND_MAGIC)}')}")  # exact
  p = b.horner(f, (1.0, *EXP2_POLY))
  # t's low bits hold n (two's complement); the exponent field keeps 11 bits of n + 1023, in [823, 1223]
  nb = b(f"add {b.L} {b(f'bitcast {b.D} {t} to {b.L}')}, {b.i(1023)}")
  scale = b(f"bitcast {b.L} {b(f'shl {b.L} {nb}, {b.i(52)}')} to {b.D}")
  return b(f"fmul {b.D} {p}, {scale}")


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


def _odd(b: _Body, split: float, top: float, small: tuple[float, ...], large: Callable[[_Body, str], str]) -> str:
  """An odd function: x*small(x^2) where |x| < split, else large(min(|x|, top)) (positive) with x's sign, rounded once to float.
  NaN fails both compares and reaches large, which keeps it NaN; +-inf is clamped to top; +-0 is x*c = +-0."""
  x = b(f"fpext {b.F} %x to {b.D}")
  bits = b(f"bitcast {b.D} {x} to {b.L}")
  ax = b(f"bitcast {b.L} {b(f'and {b.L} {bits}, {b.i(ABS)}')} to {b.D}")
  c = b(f"select {b.B} {b(f'fcmp ogt {b.D} {ax}, {b.d(top)}')}, {b.D} {b.d(top)}, {b.D} {ax}")
  lb = b(f"or {b.L} {b(f'bitcast {b.D} {large(b, c)} to {b.L}')}, {b(f'and {b.L} {bits}, {b.i(SIGN)}')}")
  sm = b(f"fmul {b.D} {x}, {b.horner(b(f'fmul {b.D} {x}, {x}'), small)}")
  r = b(f"select {b.B} {b(f'fcmp olt {b.D} {ax}, {b.d(split)}')}, {b.D} {sm}, {b.D} {b(f'bitcast {b.L} {lb} to {b.D}')}")
  return b(f"fptrunc {b.D} {r} to {b.F}")


def _erf_large(b: _Body, a: str) -> str:  # 1 - exp(-a^2) * ERFC_SCALED((a-2)/(a+2)); erfc <= 0.21 here, so 1 - erfc loses nothing
  v = b(f"fdiv {b.D} {b(f'fsub {b.D} {a}, {b.d(2.0)}')}, {b(f'fadd {b.D} {a}, {b.d(2.0)}')}")
  e = exp2double_hex(b, b(f"fmul {b.D} {b(f'fmul {b.D} {a}, {a}')}, {b.d(-LOG2E)}"))
  return b(f"fsub {b.D} {b.d(1.0)}, {b(f'fmul {b.D} {e}, {b.horner(v, ERFC_SCALED)}')}")


def _tanh_large(b: _Body, a: str) -> str:  # 1 - 2/(e^2a + 1); 2/(e^2a + 1) <= 0.5 here, so the subtraction loses at most a bit
  e = exp2double_hex(b, b(f"fmul {b.D} {a}, {b.d(2 * LOG2E)}"))
  q = b(f"fdiv {b.D} {b.d(2.0)}, {b(f'fadd {b.D} {e}, {b.d(1.0)}')}")
  return b(f"fsub {b.D} {b.d(1.0)}, {q}")


def erf_f32(b: _Body) -> str: return _odd(b, ERF_SPLIT, ERF_TOP, ERF_SMALL, _erf_large)
def tanh_f32(b: _Body) -> str: return _odd(b, TANH_SPLIT, TANH_TOP, TANH_SMALL, _tanh_large)


BODIES = {Ops.EXP2: exp2_f32, Ops.LOG2: log2_f32, Ops.ERF: erf_f32, Ops.TANH: tanh_f32}
INTRINSIC = {Ops.EXP2: "llvm.exp2", Ops.LOG2: "llvm.log2"}  # float64: libm through the intrinsic
LIBM = {Ops.ERF: "erf", Ops.TANH: "tanh"}  # float64: libm, called lane by lane (LLVM has no intrinsic to do it)


def helper(op: Ops, n: int) -> tuple[str, str]:
  """The name and definition of op's float32 helper on n lanes."""
  b = _Body(n)
  name = f"kiln.{op.name.lower()}.f32.{n}"
  return name, b.define(name, BODIES[op](b))


def render(p: Any, op: Ops, s: Any, t: str, n: int, a: list[str], guard: bool) -> str:
  """An LLVMPrinter op entry: float, bfloat16 and widened float16 (all float in registers) call the helper; double calls libm (the
  intrinsic, or erf/tanh lane by lane)."""
  if "double" in t and op in LIBM: return libm_lanes(p, p.intrinsic(LIBM[op], "double", ["double"]), t, n, a[0])
  r = p.tmp()
  if "double" in t: fn = p.intrinsic(f"{INTRINSIC[op]}.{'f64' if n == 1 else f'v{n}f64'}", t, [t])
  else:
    name, text = helper(op, n)
    p.helpers.setdefault(name, text)
    fn = f"@{name}"
  p.emit(f"{r} = call {t} {fn}({t} {a[0]})")
  return r


def libm_lanes(p: Any, fn: str, t: str, n: int, a: str) -> str:
  """A scalar double function fn called on each lane of a (of type t, n lanes)."""
  if n == 1:
    p.emit(f"{(r := p.tmp())} = call double {fn}(double {a})")
    return r
  cur = "poison"
  for i in range(n):
    e, c, nxt = p.tmp(), p.tmp(), p.tmp()
    p.emit(f"{e} = extractelement {t} {a}, i32 {i}")
    p.emit(f"{c} = call double {fn}(double {e})")
    p.emit(f"{nxt} = insertelement {t} {cur}, double {c}, i32 {i}")
    cur = nxt
  return cur
