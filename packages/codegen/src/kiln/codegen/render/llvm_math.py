"""float32 EXP2, LOG2, ERF and TANH for the LLVM renderer as inline IR that LLVM vectorises (its llvm.exp2/llvm.log2 intrinsics lower
to one libm call per vector lane, and erf/tanh have no intrinsic at all). float64 keeps libm: the intrinsics, and erf/tanh called
lane by lane.

Each function is an alwaysinline helper of a float or an <n x float> made of the same instructions for every n, so a result does
not depend on whether its loop was vectorised. No fast-math flag is used. Where the target has a fused multiply-add (Target.fma:
x86-64-v3 and up, AArch64) each polynomial step a + b*c is one llvm.fma, and 2^f = 1 + f*P(f) ends in one; without one it is
fmul then fadd. So a target with FMA and one without may differ in the last bit (both within the bounds below, each tested);
every target with FMA gives the same bits, and so does every target without.

EXP2, ERF and TANH compute in float32 (<n x float> and <n x i32>, the full vector width): range reduction, near-minimax
polynomials (Horner's rule) and 2^n built from exponent bits. Each is within 1 ulp of the correctly rounded result, measured over
float32 bit patterns (off by 1 at 0.41% of inputs for EXP2 over all of them, 8.4% for ERF over every 64th, 0.30% for TANH over
every 4th; with FMA 0.21%, 8.4% and 0.29%, EXP2 over every 4th); test_vector_math.py (both variants) and test_erf_tanh.py
enforce it. LOG2 widens to double, evaluates there and rounds once (also within 1 ulp).

On AVX-512 targets 2^f * 2^n is one vscalefps (_Body.scale) instead of exponent-field factors and multiplies: IEEE's single
rounding of the exact product either way, so the same bits (test_vector_math checks it on AVX-512 hosts) in fewer instructions.
Where rounding to nearest even is one instruction (has_round: SSE4.1 and up, AArch64) n = round(x) is llvm.roundeven instead of the
MAGIC add and subtract: the same bits again (test_vector_math compares the two over the sweep).
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from kiln.ir.ops import Ops


def _hex(*h: str) -> tuple[float, ...]: return tuple(map(float.fromhex, h))
def f32(v: float) -> float: return float(struct.unpack("<f", struct.pack("<f", v))[0])  # v rounded to float32


# Fits made at development time with numpy: weighted least squares on 4000 Chebyshev nodes against numpy's double exp2/tanh and
# math.erf/erfc, reweighted 60 times toward the largest weighted error (Lawson), so near-minimax; then each coefficient rounded to
# float32 in turn, lowest order first, and the higher ones refitted. Errors are the fits' own (in double, float32 coefficients).
# 2^f = 1 + (c0*f + c1*f^2 + ... + c5*f^6) on |f| <= 1/2: relative error 3.0e-9 (0.05 of 2^-24)
EXP2_POLY = _hex('0x1.62e43p-1', '0x1.ebfbdcp-3', '0x1.c6af7ap-5', '0x1.3b2dd2p-7', '0x1.5f0948p-10', '0x1.417a9cp-13')
# erf(x) = x + x*P(x^2) on |x| <= ERF_SPLIT: relative error 1.4e-8 (0.24 of 2^-24)
ERF_SMALL = _hex('0x1.06eba6p-3', '-0x1.8126eep-2', '0x1.ce1bfp-4', '-0x1.b6a25p-6', '0x1.47c73p-8', '-0x1.3c61c8p-11')
# erfc(x) = exp(-x^2) * P(v), v = (x-1.5)/(x+1.5) in [-0.25, 0.45] for x in [ERF_SPLIT, ERF_TOP]: absolute error 4.4e-9 (0.07 of 2^-24)
ERFC_SCALED = _hex('0x1.494dbp-2', '-0x1.f6a69p-2', '0x1.8e4c08p-3', '-0x1.2e91eap-7', '-0x1.27ea64p-6')
ERFC_V = 1.5
# 2^f = 1 + (c0*f + ... + c4*f^5) on |f| <= 1/2 for ERF's exp(-x^2), one degree less than EXP2_POLY: relative error 9.3e-8 (1.56 of 2^-24), which
# erfc <= 0.21 scales down to a third of an ulp of erf
ERF_EXP2 = _hex('0x1.62e42ap-1', '0x1.ebf9c2p-3', '0x1.c6b6dap-5', '0x1.3ce8b2p-7', '0x1.5bd97ap-10')
# tanh(x) = x + x*(x^2*P(x^2)) on |x| <= TANH_SPLIT: relative error 1.6e-8 (0.26 of 2^-24)
TANH_SMALL = _hex('-0x1.555504p-2', '0x1.11017ap-3', '-0x1.b81622p-5', '0x1.567e5ap-6', '-0x1.c19544p-8', '0x1.55d49p-10')
# |x| below: the polynomial in x^2; at or above: through exp2, |x| clamped to the top (past it float32 erf/tanh round to +-1, as
# does the formula there: erfc(4) = 1.5e-8 and 2/(e^20 + 1) = 4e-9 are under half an ulp of 1)
ERF_SPLIT, ERF_TOP, TANH_SPLIT, TANH_TOP = f32(0.9), 4.0, f32(0.9), 10.0
LOG2E_F = float.fromhex('0x1.715476p+0')  # log2(e) rounded to float32
MAGIC = 1.5 * 2.0**23  # adding it rounds a float of magnitude < 2^22 to an integer (ties to even), the integer in its low bits
MAGIC_BITS = 0x4B400000  # MAGIC's bits: t = x + MAGIC has bits MAGIC_BITS + round(x)
# x at or below EXP2_FLUSH becomes EXP2_LO (2^x rounds to 0 from there), above EXP2_HI becomes EXP2_HI (2^x is inf); NaN stays.
# numpy's float32 exp2 (the reference) gives 0 at and below -149.5, where 2^x rounds to the least denormal 2^-149 (1 ulp away):
# flushing there too keeps a 0 wherever the reference has one
EXP2_FLUSH, EXP2_LO, EXP2_HI = -149.5, -151.0, 129.0
F_SIGN, F_ABS = 1 << 31, (1 << 31) - 1
# LOG2 (in double): log2(m) = s*(c1 + c3 s^2 + ... + c9 s^8), s = (m-1)/(m+1), m in [sqrt(1/2), sqrt(2)): relative error 4.2e-12
LOG2_POLY = _hex('0x1.71547652be60cp+1', '0x1.ec709d1658c80p-1', '0x1.27777e32049c7p-1', '0x1.a58e260054e25p-2', '0x1.5cdef07b475e7p-2')
SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # the mantissa split point: m lands in [sqrt(1/2), sqrt(2)), so |s| <= 0.1716
FLOAT_CONST = {"nan": "0x7FF8000000000000", "inf": "0x7FF0000000000000", "-inf": "0xFFF0000000000000"}


def double_hex(v: float) -> str:
  """A float constant as LLVM IR writes it exactly: the 16 hex digits of its double bits (float constants too)."""
  return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}"
SCALEF, V16 = "llvm.x86.avx512.mask.scalef.ps.512", "<16 x float>"  # vscalefps zmm: a * 2^floor(b), merge mask, rounding 4 = MXCSR's


def has_scalef(target: Any) -> bool:
  """AVX-512F's vscalefps may scale 2^f by 2^n: x86 targets with 64-byte vectors (kiln's machine model gives 64 only for
  +avx512f; runtime-cpu machine.isa_of)."""
  return getattr(target, "device", "") == "CPU" and getattr(target, "vector_bytes", 0) >= 64


def has_round(target: Any) -> bool:
  """A one-instruction round to nearest even (llvm.roundeven): the machine model's Target.round (SSE4.1's roundps, so
  x86-64-v2 and up; AArch64's frintn). Without it (SSE2 only) llvm.roundeven would be a libm call: the MAGIC add instead."""
  return getattr(target, "device", "") == "CPU" and bool(getattr(target, "round", False))


def fma_suffix(n: int) -> str: return "f32" if n == 1 else f"v{n}f32"  # llvm.fma's on n floats (the caller declares it)
def vtype(t: str, n: int) -> str: return t if n == 1 else f"<{n} x {t}>"
def _sp(t: str, c: str, n: int) -> str: return c if n == 1 else "<" + ", ".join([f"{t} {c}"] * n) + ">"


class _Body:
  """The instructions of one helper: each call appends `%vK = text` and names its result."""
  def __init__(self, n: int, fma: bool = False, scalef: bool = False, rounds: bool = False):
    self.n, self.fma, self.scalef, self.lines, self.k = n, fma, scalef and n & (n - 1) == 0 and n <= 64, list[str](), 0
    self.rounds = rounds  # llvm.roundeven is one instruction (has_round): n = round(x) without the MAGIC add
    self.F, self.I, self.B, self.D, self.L = (vtype(t, n) for t in ("float", "i32", "i1", "double", "i64"))

  def __call__(self, text: str) -> str:
    self.k += 1
    self.lines.append(f"  %v{self.k} = {text}")
    return f"%v{self.k}"

  def f(self, v: float) -> str:
    assert f32(v) == v, f"{v!r} is not a float32"  # LLVM rejects an inexact float constant
    return _sp("float", double_hex(v), self.n)
  def i(self, v: int) -> str: return _sp("i32", str(v), self.n)
  def d(self, v: float) -> str: return _sp("double", double_hex(v), self.n)
  def i64(self, v: int) -> str: return _sp("i64", str(v), self.n)

  def horner(self, x: str, coeffs: tuple[float, ...]) -> str:  # double coeffs[0] + x*(coeffs[1] + ...), unfused (LOG2's)
    acc = self.d(coeffs[-1])
    for k in reversed(coeffs[:-1]): acc = self(f"fadd {self.D} {self(f'fmul {self.D} {acc}, {x}')}, {self.d(k)}")
    return acc

  def poly(self, x: str, coeffs: tuple[float, ...]) -> str:
    """The float polynomial coeffs[0] + coeffs[1]*x + ... by Horner's rule, each step one mad. Estrin's scheme (a chain of
    ~log2(len) steps, two more multiplies for six coefficients) once measured faster, but with vscalefps and roundeven in the
    chain Horner's fewer multiplies win: 4M-float exact GELU 1.29 -> 1.10 ms, softmax 1024x1024 0.24 -> 0.18 ms (2-core Zen 4,
    AVX-512; level on AVX2). A zero constant term is left out (c1*x, not c1*x + 0, which would turn -0 into +0)."""
    acc = self.f(coeffs[-1])
    for c in reversed(coeffs[1:-1]): acc = self.mad(x, acc, self.f(c))
    if len(coeffs) == 1: return acc
    return self(f"fmul {self.F} {x}, {acc}") if coeffs[0] == 0 else self.mad(x, acc, self.f(coeffs[0]))

  def mad(self, a: str, b: str, c: str) -> str:
    """a*b + c: one llvm.fma (one rounding) where the target has it, else fmul then fadd (two)."""
    if self.fma: return self(f"call {self.F} @llvm.fma.{self.suffix}({self.F} {a}, {self.F} {b}, {self.F} {c})")
    return self(f"fadd {self.F} {self(f'fmul {self.F} {a}, {b}')}, {c}")

  @property
  def suffix(self) -> str: return fma_suffix(self.n)

  def scale(self, v: str, nf: str, n: int | None = None) -> str:
    """v * 2^nf (nf an integer-valued float) by AVX-512's vscalefps, rounded once as IEEE does (into the denormals, to 0 or
    to inf): the same bits as the exponent-field factors, in one instruction. Lane counts other than 16 are padded with
    zeros or split in halves (n a power of two up to 64, see __init__)."""
    n = self.n if n is None else n
    def call(a: str, b: str) -> str: return self(f"call {V16} @{SCALEF}({V16} {a}, {V16} {b}, {V16} zeroinitializer, i16 -1, i32 4)")
    if n == 1:
      w = [self(f"insertelement {V16} zeroinitializer, float {a}, i32 0") for a in (v, nf)]
      return self(f"extractelement {V16} {call(*w)}, i32 0")
    t = f"<{n} x float>"
    if n > 16:  # two halves, each scaled, joined again
      halves = []
      for lo in (0, n // 2):
        pick = lambda a, lo=lo: self(f"shufflevector {t} {a}, {t} poison, <{n // 2} x i32> <{', '.join(f'i32 {i}' for i in range(lo, lo + n // 2))}>")
        halves.append(self.scale(pick(v), pick(nf), n // 2))
      h = f"<{n // 2} x float>"
      return self(f"shufflevector {h} {halves[0]}, {h} {halves[1]}, <{n} x i32> <{', '.join(f'i32 {i}' for i in range(n))}>")
    if n < 16:  # padded with zeros (lane n of the second operand) to one zmm, scaled, cut back
      pad = f"<16 x i32> <{', '.join(f'i32 {min(i, n)}' for i in range(16))}>"
      r = call(*[self(f"shufflevector {t} {a}, {t} zeroinitializer, {pad}") for a in (v, nf)])
      return self(f"shufflevector {V16} {r}, {V16} poison, <{n} x i32> <{', '.join(f'i32 {i}' for i in range(n))}>")
    return call(v, nf)

  def define(self, name: str, ret: str) -> str:
    return "\n".join([f"define internal {self.F} @{name}({self.F} %x) alwaysinline {{", *self.lines, f"  ret {self.F} {ret}", "}"])


def _exp2_reduced(b: _Body, x: str, poly: tuple[float, ...] = EXP2_POLY) -> tuple[str, str, str | None]:
  """x = n + f for |x| < 2^22 (NaN gives NaN): n = round(x), ties to even, f = x - n exact in [-1/2, 1/2]. Returns 2^f by
  poly (EXP2_POLY: within [0.7, 1.42]), n as a float and t = x + MAGIC (n in its low bits, for _int_n; None where n came
  from llvm.roundeven, one instruction instead of the add and subtract). Both give the same f: they differ only in the sign of
  a zero n (roundeven(-0.3) is -0), and x - (-0) = x - 0, 2^-0 = 2^0."""
  if b.rounds: t, nf = None, b(f"call {b.F} @llvm.roundeven.{fma_suffix(b.n)}({b.F} {x})")
  else:
    t = b(f"fadd {b.F} {x}, {b.f(MAGIC)}")
    nf = b(f"fsub {b.F} {t}, {b.f(MAGIC)}")
  f = b(f"fsub {b.F} {x}, {nf}")
  if b.fma: p = b.mad(f, b.poly(f, poly), b.f(1.0))  # 1 + f*P(f), the last step one rounding
  else: p = b(f"fadd {b.F} {b.poly(f, (0.0, *poly))}, {b.f(1.0)}")  # 1 + (f*c0 + f^2*c1 + ...): f*P by Horner's rule, then the 1
  return p, nf, t


def _int_n(b: _Body, nf: str, t: str | None) -> str:
  """n as i32: converted from its float, or read from t's low bits (t = x + MAGIC)."""
  if t is None: return b(f"fptosi {b.F} {nf} to {b.I}")
  return b(f"sub {b.I} {b(f'bitcast {b.F} {t} to {b.I}')}, {b.i(MAGIC_BITS)}")


def _pow2(b: _Body, n: str) -> str:  # 2^n from its exponent field, n in [-126, 127]
  e = b(f"add {b.I} {n}, {b.i(127)}")
  return b(f"bitcast {b.I} {b(f'shl {b.I} {e}, {b.i(23)}')} to {b.F}")


def exp2_f32(b: _Body) -> str:
  """2^x: x clamped to [EXP2_LO, EXP2_HI] (and flushed below EXP2_FLUSH), then 2^f * 2^n1 * 2^n2 with n1 = n >> 1, n2 = n - n1,
  both normal: the first product is exact, so the second rounds once, to a denormal, 0 or inf where IEEE does."""
  lo = b(f"select {b.B} {b(f'fcmp ole {b.F} %x, {b.f(EXP2_FLUSH)}')}, {b.F} {b.f(EXP2_LO)}, {b.F} %x")
  x = b(f"select {b.B} {b(f'fcmp ogt {b.F} {lo}, {b.f(EXP2_HI)}')}, {b.F} {b.f(EXP2_HI)}, {b.F} {lo}")
  p, nf, t = _exp2_reduced(b, x)
  if b.scalef: return b.scale(p, nf)
  n = _int_n(b, nf, t)
  n1 = b(f"ashr {b.I} {n}, {b.i(1)}")
  return b(f"fmul {b.F} {b(f'fmul {b.F} {p}, {_pow2(b, n1)}')}, {_pow2(b, b(f'sub {b.I} {n}, {n1}'))}")


def _exp2_mid(b: _Body, x: str) -> str:  # 2^x for x in [-24, 30] (or NaN): one scale factor
  p, nf, t = _exp2_reduced(b, x)
  return b.scale(p, nf) if b.scalef else b(f"fmul {b.F} {p}, {_pow2(b, _int_n(b, nf, t))}")


def log2_f32(b: _Body) -> str:
  """log2(x): x widened to double (a float denormal is a normal double), x = m * 2^e with m in [sqrt(1/2), sqrt(2)), log2(m) by
  LOG2_POLY in s = (m-1)/(m+1); exact at powers of two (s = 0). 0 -> -inf, negative or NaN -> NaN, +inf -> +inf by selects."""
  bits = b(f"bitcast {b.D} {b(f'fpext {b.F} %x to {b.D}')} to {b.L}")
  e = b(f"ashr {b.L} {b(f'sub {b.L} {bits}, {b.i64(SQRT_HALF_BITS)}')}, {b.i64(52)}")
  top = b(f"shl {b.L} {e}, {b.i64(52)}")
  m = b(f"bitcast {b.L} {b(f'sub {b.L} {bits}, {top}')} to {b.D}")
  s = b(f"fdiv {b.D} {b(f'fsub {b.D} {m}, {b.d(1.0)}')}, {b(f'fadd {b.D} {m}, {b.d(1.0)}')}")  # m - 1 exact
  lm = b(f"fmul {b.D} {s}, {b.horner(b(f'fmul {b.D} {s}, {s}'), LOG2_POLY)}")
  ef = b(f"sitofp {b.L} {e} to {b.D}")
  r = b(f"fptrunc {b.D} {b(f'fadd {b.D} {ef}, {lm}')} to {b.F}")
  for cmp, val in (("oeq", "-inf"), ("ult", "nan")):  # ult: below zero or unordered
    r = b(f"select {b.B} {b(f'fcmp {cmp} {b.F} %x, {b.f(0.0)}')}, {b.F} {_sp('float', FLOAT_CONST[val], b.n)}, {b.F} {r}")
  inf = _sp("float", FLOAT_CONST["inf"], b.n)
  return b(f"select {b.B} {b(f'fcmp oeq {b.F} %x, {inf}')}, {b.F} {inf}, {b.F} {r}")


def _odd(b: _Body, split: float, top: float, small: Callable[[_Body, str], str], large: Callable[[_Body, str, str], str]) -> str:
  """An odd function of |x| given x's sign bit: with c = min(|x|, top), c + c*small(c^2) where |x| < split, else large(c, c^2).
  Both are computed and one selected (no branch). NaN fails both compares and reaches large, which keeps it NaN; +-inf is
  clamped to top; +-0 is 0 + 0*small with the sign put back (x + x*small would turn -0 into +0 where small(0) < 0)."""
  bits = b(f"bitcast {b.F} %x to {b.I}")
  a = b(f"bitcast {b.I} {b(f'and {b.I} {bits}, {b.i(F_ABS)}')} to {b.F}")
  c = b(f"select {b.B} {b(f'fcmp ogt {b.F} {a}, {b.f(top)}')}, {b.F} {b.f(top)}, {b.F} {a}")
  z = b(f"fmul {b.F} {c}, {c}")
  sm = b.mad(c, small(b, z), c)  # c + c*(f(c)/c - 1): the small part's error shrinks
  r = b(f"select {b.B} {b(f'fcmp olt {b.F} {a}, {b.f(split)}')}, {b.F} {sm}, {b.F} {large(b, c, z)}")
  rb = b(f"or {b.I} {b(f'bitcast {b.F} {r} to {b.I}')}, {b(f'and {b.I} {bits}, {b.i(F_SIGN)}')}")
  return b(f"bitcast {b.I} {rb} to {b.F}")


def _erf_large(b: _Body, a: str, z: str) -> str:  # 1 - exp(-a^2) * ERFC_SCALED(v); erfc <= 0.21 here, so 1 - erfc loses nothing
  v = b(f"fdiv {b.F} {b(f'fsub {b.F} {a}, {b.f(ERFC_V)}')}, {b(f'fadd {b.F} {a}, {b.f(ERFC_V)}')}")
  p, nf, t = _exp2_reduced(b, b(f"fmul {b.F} {z}, {b.f(-LOG2E_F)}"), ERF_EXP2)
  q = b.poly(v, ERFC_SCALED)
  # 2^n * P(v) is exact: p * (2^n * P) is (p * 2^n) * P, sooner
  sr = b.scale(q, nf) if b.scalef else b(f"fmul {b.F} {_pow2(b, _int_n(b, nf, t))}, {q}")
  return b(f"fsub {b.F} {b.f(1.0)}, {b(f'fmul {b.F} {p}, {sr}')}")


def _tanh_large(b: _Body, a: str, z: str) -> str:  # 1 - 2/(e^2a + 1); 2/(e^2a + 1) <= 0.29 here
  e = _exp2_mid(b, b(f"fmul {b.F} {a}, {b.f(2 * LOG2E_F)}"))
  q = b(f"fdiv {b.F} {b.f(2.0)}, {b(f'fadd {b.F} {e}, {b.f(1.0)}')}")
  return b(f"fsub {b.F} {b.f(1.0)}, {q}")


def _erf_small(b: _Body, z: str) -> str: return b.poly(z, ERF_SMALL)
def _tanh_small(b: _Body, z: str) -> str: return b(f"fmul {b.F} {z}, {b.poly(z, TANH_SMALL)}")
def erf_f32(b: _Body) -> str: return _odd(b, ERF_SPLIT, ERF_TOP, _erf_small, _erf_large)
def tanh_f32(b: _Body) -> str: return _odd(b, TANH_SPLIT, TANH_TOP, _tanh_small, _tanh_large)


BODIES = {Ops.EXP2: exp2_f32, Ops.LOG2: log2_f32, Ops.ERF: erf_f32, Ops.TANH: tanh_f32}
INTRINSIC = {Ops.EXP2: "llvm.exp2", Ops.LOG2: "llvm.log2"}  # float64: libm through the intrinsic
LIBM = {Ops.ERF: "erf", Ops.TANH: "tanh"}  # float64: libm, called lane by lane (LLVM has no intrinsic to do it)


def helper(op: Ops, n: int, fma: bool = False, scalef: bool = False, rounds: bool = False) -> tuple[str, str]:
  """The name and definition of op's float32 helper on n lanes (fused multiply-adds in its polynomials with `fma`; 2^n scaling
  by AVX-512's vscalefps with `scalef` and n by llvm.roundeven with `rounds`: the same bits, fewer instructions)."""
  b = _Body(n, fma, scalef, rounds and op is not Ops.LOG2)  # LOG2 rounds nothing
  name = f"kiln.{op.name.lower()}.f32.{n}{'.fma' if fma else ''}{'.sc' if b.scalef else ''}{'.rn' if b.rounds else ''}"
  return name, b.define(name, BODIES[op](b))


def render(p: Any, op: Ops, s: Any, t: str, n: int, a: list[str], guard: bool) -> str:
  """An LLVMPrinter op entry: float, bfloat16 and widened float16 (all float in registers) call the helper; double calls libm (the
  intrinsic, or erf/tanh lane by lane)."""
  if "double" in t and op in LIBM: return libm_lanes(p, p.intrinsic(LIBM[op], "double", ["double"]), t, n, a[0])
  r = p.tmp()
  if "double" in t: fn = p.intrinsic(f"{INTRINSIC[op]}.{'f64' if n == 1 else f'v{n}f64'}", t, [t])
  else:
    fma, scalef = bool(getattr(p.target, "fma", False)), has_scalef(p.target)
    name, text = helper(op, n, fma, scalef, has_round(p.target))
    if fma: p.intrinsic(f"llvm.fma.{fma_suffix(n)}", t, [t, t, t])  # the helper's, declared once in the module
    if "@llvm.roundeven." in text: p.intrinsic(f"llvm.roundeven.{fma_suffix(n)}", t, [t])
    if SCALEF in text: p.intrinsic(SCALEF, V16, [V16, V16, V16, "i16", "i32"])
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
