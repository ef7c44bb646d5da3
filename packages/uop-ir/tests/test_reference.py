"""The reference evaluator against results computed independently: exact rational arithmetic rounded once, Python ints wrapped."""
import itertools
import math
import struct
from fractions import Fraction

import numpy as np
import pytest

from kiln.ir import AxisType, EvalError, Ops, UOp, VariableBoundsError, dtypes
from kiln.ir import kernels as K
from kiln.ir.dtype import ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, DType
from kiln.ir.fold import fold_alu
from kiln.ir.reference import evaluate, run

# ---- an independent model of the dtypes: exact rounding, wrapping, bf16 bits ----
FP = {"float16": (11, -14, 15), "bfloat16": (8, -126, 127), "float32": (24, -126, 127), "float64": (53, -1022, 1023)}


def fround(x: Fraction | float | int, dt: DType) -> float:
  """x rounded to nearest even in dt, exactly (overflow to inf, underflow keeping the sign)."""
  if isinstance(x, float) and not math.isfinite(x): return x
  q = Fraction(x)
  if q == 0: return math.copysign(0.0, x) if isinstance(x, float) else 0.0
  p, emin, emax = FP[dt.name]
  a = abs(q)
  e = a.numerator.bit_length() - a.denominator.bit_length()
  if Fraction(2) ** e > a: e -= 1
  if Fraction(2) ** (e + 1) <= a: e += 1
  quantum = Fraction(2) ** (max(e, emin) - (p - 1))
  n = a / quantum
  fl = n.numerator // n.denominator
  rem = n - fl
  if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1): fl += 1
  r = fl * quantum
  out = math.inf if r >= Fraction(2) ** (emax + 1) else float(r)
  return -out if q < 0 else out


def wrap(v: int, dt: DType) -> int:
  v &= (1 << dt.bits) - 1
  return v - (1 << dt.bits) if dt.kind == "i" and v >= 1 << (dt.bits - 1) else v


def fmax(dt: DType) -> float:
  p, _, emax = FP[dt.name]
  return float((2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax)


def edge_values(dt: DType) -> list:
  if dt.is_bool: return [False, True]
  if dt.is_int:
    vals = [0, 1, -1, 2, 3, -2, 7, -7, 100, dt.min, dt.max, dt.min + 1, dt.max - 1, dt.bits - 1, dt.bits, dt.bits + 1, -dt.bits]
    return list(dict.fromkeys(wrap(v, dt) for v in vals))
  p, emin, _ = FP[dt.name]
  tiny, denorm = 2.0 ** emin, 2.0 ** (emin - p + 1)
  raw = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, -2.5, 3.0, 7.0, -7.0, math.nan, math.inf, -math.inf, fmax(dt), -fmax(dt), tiny, -tiny, denorm,
         -denorm, tiny - denorm, 0.1, 1e10, 65504.0, 2.0 ** 24 + 1, 1e-30]
  return [fround(v, dt) if math.isfinite(v) else v for v in raw]


def to_np(vals: list, dt: DType) -> np.ndarray:
  """Storage array for dt; bfloat16 as its bits (exact: every value is already a bf16)."""
  if dt == dtypes.bfloat16: return np.array([struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in vals], np.uint16)
  return np.array(vals, dtype=dt.np)


def from_np(a: np.ndarray, dt: DType) -> list:
  if dt == dtypes.bfloat16: return [struct.unpack("<f", struct.pack("<I", int(b) << 16))[0] for b in a]
  return [x.item() for x in a]


def same(got, exp, dt: DType, ulps: int = 0) -> bool:
  if dt.is_float:
    if math.isnan(exp): return math.isnan(got)
    if ulps == 0 or math.isinf(exp) or exp == 0: return got == exp and math.copysign(1, got) == math.copysign(1, exp)
    p, emin, _ = FP[dt.name]
    spacing = 2.0 ** (max(math.frexp(exp)[1] - 1, emin) - (p - 1))
    return abs(got - exp) <= ulps * spacing
  return got == exp


# ---- the expected result of each op, computed without kiln ----
def tdiv(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b >= 0) else -q


def expect_int(op: Ops, dt: DType, a: int, b: int = 0):
  if op is Ops.CMPLT: return a < b
  if op is Ops.CMPEQ: return a == b
  if op is Ops.CMPNE: return a != b
  if dt.is_bool:
    return {Ops.ADD: a or b, Ops.SUB: a != b, Ops.MUL: a and b, Ops.MAX: a or b, Ops.AND: a and b, Ops.OR: a or b, Ops.XOR: a != b}[op]
  amt = b % dt.bits  # shift amount modulo the bit width (b & (bits-1) for a power-of-two width)
  r = {Ops.ADD: lambda: a + b, Ops.SUB: lambda: a - b, Ops.MUL: lambda: a * b, Ops.MAX: lambda: max(a, b), Ops.AND: lambda: a & b,
       Ops.OR: lambda: a | b, Ops.XOR: lambda: a ^ b, Ops.NEG: lambda: -a, Ops.SHL: lambda: a << amt, Ops.SHR: lambda: a >> amt,
       Ops.IDIV: lambda: a if b == 0 else tdiv(a, b), Ops.MOD: lambda: 0 if b == 0 else a - tdiv(a, b) * b}[op]()
  return wrap(r, dt)


def expect_float(op: Ops, dt: DType, a: float, b: float = 0.0) -> float | bool:
  if op is Ops.CMPLT: return a < b
  if op is Ops.CMPEQ: return a == b
  if op is Ops.CMPNE: return a != b
  if op is Ops.NEG: return -a
  if op is Ops.MAX:
    if math.isnan(a) or math.isnan(b): return math.nan
    if a == b == 0: return -0.0 if math.copysign(1, a) < 0 and math.copysign(1, b) < 0 else 0.0
    return max(a, b)
  if op is Ops.TRUNC: return a if not math.isfinite(a) else math.copysign(float(math.trunc(a)), a)
  if op in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.RECIPROCAL):
    if op is Ops.RECIPROCAL: a, b, op = 1.0, a, Ops.FDIV
    with np.errstate(all="ignore"):
      r64 = float({Ops.ADD: np.add, Ops.SUB: np.subtract, Ops.MUL: np.multiply, Ops.FDIV: np.divide}[op](np.float64(a), np.float64(b)))
    if not (math.isfinite(a) and math.isfinite(b)) or (op is Ops.FDIV and b == 0): return r64
    fa, fb = Fraction(a), Fraction(b)
    exact = {Ops.ADD: fa + fb, Ops.SUB: fa - fb, Ops.MUL: fa * fb, Ops.FDIV: fa / fb if fb else Fraction(0)}[op]
    if exact == 0: return r64  # IEEE's sign of an exact zero
    return fround(exact, dt)
  if op is Ops.SQRT: return math.nan if a < 0 or math.isnan(a) else fround(math.sqrt(a), dt) if math.isfinite(a) else a
  fn = {Ops.EXP2: lambda x: 2.0 ** x, Ops.LOG2: math.log2, Ops.SIN: math.sin}[op]
  try: r = fn(a)
  except (ValueError, OverflowError):
    if op is Ops.EXP2: return math.inf
    if op is Ops.LOG2: return -math.inf if a == 0 else math.nan
    return math.nan
  return fround(r, dt) if math.isfinite(r) else r


def binop_kernel(op: Ops, dt: DType, n: int) -> UOp:
  out_dt = dtypes.bool if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else dt
  o, a, b = UOp.define_global(0, out_dt.ptr(n)), UOp.define_global(1, dt.ptr(n)), UOp.define_global(2, dt.ptr(n))
  i = UOp.range(n, 0)
  return UOp.sink(o.index(i).store(a.index(i).load().alu(op, b.index(i).load())))


def unop_kernel(op: Ops, dt: DType, n: int) -> UOp:
  o, a = UOp.define_global(0, dt.ptr(n)), UOp.define_global(1, dt.ptr(n))
  i = UOp.range(n, 0)
  return UOp.sink(o.index(i).store(a.index(i).load().alu(op)))


BINARY_INT = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR]
BINARY_FLOAT = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE]
BINARY_BOOL = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.MAX, Ops.AND, Ops.OR, Ops.XOR, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE]
UNARY_FLOAT = [Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC]
BIN_CASES = [(op, d) for d in ALL_DTYPES for op in (BINARY_BOOL if d.is_bool else BINARY_INT if d.is_int else BINARY_FLOAT)]
UN_CASES = [(op, d) for d in FLOAT_DTYPES for op in UNARY_FLOAT] + [(Ops.NEG, d) for d in INT_DTYPES]


@pytest.mark.parametrize("op,dt", BIN_CASES, ids=[f"{o.name}-{d.name}" for o, d in BIN_CASES])
def test_binary_op_vs_independent(op, dt):
  vals = edge_values(dt)
  pairs = list(itertools.product(vals, vals))
  av, bv = [p[0] for p in pairs], [p[1] for p in pairs]
  k = binop_kernel(op, dt, len(pairs))
  out_dt = dtypes.bool if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else dt
  out = np.zeros(len(pairs), out_dt.np)
  evaluate(k, [out, to_np(av, dt), to_np(bv, dt)])
  got = from_np(out, out_dt)
  for (a, b), g in zip(pairs, got):
    e = expect_float(op, dt, a, b) if dt.is_float else expect_int(op, dt, a, b)
    assert same(g, e, out_dt), f"{op.name} {dt}: {a!r}, {b!r} -> {g!r}, expected {e!r}"
  # constant folding shares the semantics: fold a sample of the same pairs
  for a, b in pairs[:: max(1, len(pairs) // 40)]:
    f = fold_alu(op, out_dt, (UOp.const(dt, a), UOp.const(dt, b)))
    e = expect_float(op, dt, a, b) if dt.is_float else expect_int(op, dt, a, b)
    assert f is not None and same(f.arg, e, out_dt), f"folded {op.name} {dt}: {a!r}, {b!r} -> {f!r}, expected {e!r}"


@pytest.mark.parametrize("op,dt", UN_CASES, ids=[f"{o.name}-{d.name}" for o, d in UN_CASES])
def test_unary_op_vs_independent(op, dt):
  vals = edge_values(dt)
  out = np.zeros(len(vals), dt.np)
  evaluate(unop_kernel(op, dt, len(vals)), [out, to_np(vals, dt)])
  ulps = 4 if op in (Ops.EXP2, Ops.LOG2, Ops.SIN) else 0  # transcendental: libm accuracy, special values exact
  for a, g in zip(vals, from_np(out, dt)):
    e = expect_float(op, dt, a) if dt.is_float else expect_int(op, dt, a)
    assert same(g, e, dt, ulps), f"{op.name} {dt}: {a!r} -> {g!r}, expected {e!r}"


def test_c_truncation_explicit():
  k = binop_kernel(Ops.IDIV, dtypes.int32, 6)
  a, b = np.array([-7, 7, -7, 7, -2**31, 5], np.int32), np.array([2, -2, -2, 2, -1, 0], np.int32)
  out = run(k, np.zeros(6, np.int32), a, b)[0]
  assert out.tolist() == [-3, -3, 3, 3, -2**31, 5]  # toward zero (numpy // would give -4, -4), MIN//-1 wraps, x//0 == x
  out = run(binop_kernel(Ops.MOD, dtypes.int32, 6), np.zeros(6, np.int32), a, b)[0]
  assert out.tolist() == [-1, 1, -1, 1, 0, 0]  # sign of the dividend (numpy % would give 1, -1)


CAST_CASES = [(s, d) for s in ALL_DTYPES for d in ALL_DTYPES if s != d]


def expect_cast(v, src: DType, dst: DType):
  if dst.is_bool: return v != 0 or (isinstance(v, float) and math.isnan(v))
  if dst.is_int:
    if isinstance(v, float):
      if math.isnan(v): return 0
      if math.isinf(v): return dst.max if v > 0 else dst.min
      return max(min(math.trunc(v), dst.max), dst.min)
    return wrap(int(v), dst)
  if isinstance(v, float) and not math.isfinite(v): return v
  if isinstance(v, float) and v == 0: return v
  return fround(Fraction(int(v)) if not isinstance(v, float) else v, dst)


@pytest.mark.parametrize("src,dst", CAST_CASES, ids=[f"{s.name}-{d.name}" for s, d in CAST_CASES])
def test_cast_vs_independent(src, dst):
  vals = edge_values(src)
  o, a = UOp.define_global(0, dst.ptr(len(vals))), UOp.define_global(1, src.ptr(len(vals)))
  i = UOp.range(len(vals), 0)
  out = np.zeros(len(vals), dst.np)
  evaluate(UOp.sink(o.index(i).store(a.index(i).load().cast(dst))), [out, to_np(vals, src)])
  for v, g in zip(vals, from_np(out, dst)):
    e = expect_cast(v, src, dst)
    assert same(g, e, dst), f"cast {src}->{dst}: {v!r} -> {g!r}, expected {e!r}"


def test_bitcast_and_where():
  n = 4
  o, a = UOp.define_global(0, dtypes.uint32.ptr(n)), UOp.define_global(1, dtypes.float32.ptr(n))
  i = UOp.range(n, 0)
  x = np.array([1.0, -0.0, np.inf, np.nan], np.float32)
  out = run(UOp.sink(o.index(i).store(a.index(i).load().bitcast(dtypes.uint32))), np.zeros(n, np.uint32), x)[0]
  assert out.tolist() == x.view(np.uint32).tolist()
  o2 = UOp.define_global(0, dtypes.int8.ptr(n))
  c, p, q = UOp.define_global(1, dtypes.bool.ptr(n)), UOp.define_global(2, dtypes.int8.ptr(n)), UOp.define_global(3, dtypes.int8.ptr(n))
  k = UOp.sink(o2.index(i).store(c.index(i).load().where(p.index(i).load(), q.index(i).load())))
  out = run(k, np.zeros(n, np.int8), np.array([1, 0, 1, 0], bool), np.arange(4, dtype=np.int8), -np.arange(4, dtype=np.int8))[0]
  assert out.tolist() == [0, -1, 2, -3]


# ---- structure: reductions, matmul, softmax, gates, symbolic sizes, store order ----
RNG = np.random.default_rng(0)


@pytest.mark.parametrize("axes", [0, 1, 2, (0, 2), (1, 2), None])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_each_axis(axes, keepdims):
  x = RNG.standard_normal((3, 4, 5)).astype(np.float32)
  for build, ref in ((K.reduce_sum, np.sum), (K.reduce_max, np.max), (K.reduce_prod, np.prod)):
    exp = np.asarray(ref(x, axis=axes, keepdims=keepdims))
    got = run(build((3, 4, 5), dtypes.float32, axes, keepdims), np.zeros(exp.size, np.float32), x)[0]
    np.testing.assert_allclose(got, exp.ravel(), rtol=1e-5, atol=1e-6)
  xi = RNG.integers(-2**31, 2**31, (3, 4, 5), dtype=np.int64).astype(np.int32)
  exp = np.asarray(np.sum(xi, axis=axes, keepdims=keepdims, dtype=np.int32))  # numpy wraps in int32 too
  assert run(K.reduce_sum((3, 4, 5), dtypes.int32, axes, keepdims), np.zeros(exp.size, np.int32), xi)[0].tolist() == exp.ravel().tolist()


def test_reduce_semantics():
  # float16 accumulates in float16, rounding each step, in order: 2048 + 1 rounds back to 2048 every time
  x = np.array([2048] + [1] * 10, np.float16)
  assert run(K.reduce_sum((11,), dtypes.float16), np.zeros(1, np.float16), x)[0][0] == 2048
  # max: NaN propagates, +0 beats -0, empty-free identity; sum of -0.0 is +0.0 (the accumulator starts at 0)
  assert np.isnan(run(K.reduce_max((3,), dtypes.float32), np.zeros(1, np.float32), np.array([1, np.nan, 2], np.float32))[0][0])
  z = run(K.reduce_max((2,), dtypes.float32), np.zeros(1, np.float32), np.array([-0.0, 0.0], np.float32))[0][0]
  assert z == 0 and not np.signbit(z)
  s = run(K.reduce_sum((2,), dtypes.float32), np.zeros(1, np.float32), np.array([-0.0, -0.0], np.float32))[0][0]
  assert s == 0 and not np.signbit(s)
  assert run(K.reduce_max((3,), dtypes.int8), np.zeros(1, np.int8), np.array([-128, -5, -100], np.int8))[0][0] == -5
  # bool sum is "any", bool prod is "all"
  assert run(K.reduce_sum((3,), dtypes.bool), np.zeros(1, bool), np.array([0, 1, 1], bool))[0][0]
  assert not run(K.reduce_prod((3,), dtypes.bool), np.zeros(1, bool), np.array([0, 1, 1], bool))[0][0]
  # bfloat16 sums in bfloat16: 256 + 1 == 256
  bits = (np.array([256, 1, 1], np.float32).view(np.uint32) >> 16).astype(np.uint16)
  assert run(K.reduce_sum((3,), dtypes.bfloat16), np.zeros(1, np.uint16), bits)[0][0] == 0x4380
  # a value that does not depend on the reduced range counts once per iteration; an empty range gives the identity
  n = UOp.variable("n", 0, 10)
  o = UOp.define_global(0, dtypes.float32.ptr(1))
  r = UOp.range(n, 0, AxisType.REDUCE)
  k = UOp.sink(o.index(0).store(UOp.const(dtypes.float32, 2.0).alu(Ops.ADD, UOp.const(dtypes.float32, 0.5) * r.cast(dtypes.float32) * 0.0)
                                 .reduce(Ops.ADD, r)))
  assert run(k, np.zeros(1, np.float32), var_vals={"n": 4})[0][0] == 8.0
  assert run(k, np.ones(1, np.float32), var_vals={"n": 0})[0][0] == 0.0


@pytest.mark.parametrize("batch", [(), (3,)])
def test_matmul_vs_numpy(batch):
  a = RNG.standard_normal((*batch, 6, 7)).astype(np.float32)
  b = RNG.standard_normal((*batch, 7, 5)).astype(np.float32)
  got = run(K.matmul(6, 5, 7, batch=batch), np.zeros(a.size // 7 * 5, np.float32), a, b)[0]
  np.testing.assert_allclose(got, (a @ b).ravel(), rtol=1e-5, atol=1e-5)
  ai, bi = RNG.integers(-100, 100, (4, 3)).astype(np.int32), RNG.integers(-100, 100, (3, 2)).astype(np.int32)
  assert run(K.matmul(4, 2, 3, dtypes.int32), np.zeros(8, np.int32), ai, bi)[0].tolist() == (ai @ bi).ravel().tolist()


def test_softmax_parts_and_fused_vs_numpy():
  x = (RNG.standard_normal((4, 9)) * 5).astype(np.float32)
  e = np.exp(x - x.max(-1, keepdims=True))
  exp = e / e.sum(-1, keepdims=True)
  got = run(K.softmax((4, 9), dtypes.float32), np.zeros(36, np.float32), x)[0]
  np.testing.assert_allclose(got, exp.ravel(), rtol=1e-5, atol=1e-7)
  mx, ex, sm, dv = K.softmax_parts((4, 9), dtypes.float32)
  m = run(mx, np.zeros(4, np.float32), x)[0]
  ee = run(ex, np.zeros(36, np.float32), x, m)[0]
  s = run(sm, np.zeros(4, np.float32), ee)[0]
  out = run(dv, np.zeros(36, np.float32), ee, s)[0]
  np.testing.assert_allclose(out, exp.ravel(), rtol=1e-5, atol=1e-7)
  xt = x.T.copy()  # softmax over axis 0
  got0 = run(K.softmax((9, 4), dtypes.float32, axis=0), np.zeros(36, np.float32), xt)[0]
  np.testing.assert_allclose(got0.reshape(9, 4).T.ravel(), exp.ravel(), rtol=1e-5, atol=1e-7)


def test_gated_load_and_store():
  n = 8
  o, a = UOp.define_global(0, dtypes.float32.ptr(n)), UOp.define_global(1, dtypes.float32.ptr(4))
  i = UOp.range(n, 0)
  # gated load: past the end reads 0 instead of memory
  k = UOp.sink(o.index(i).store(a.index(i, i < 4).load() + 1.0))
  assert run(k, np.zeros(n, np.float32), np.arange(4, dtype=np.float32) + 10)[0].tolist() == [11, 12, 13, 14, 1, 1, 1, 1]
  # gated store: odd elements are left alone
  k = UOp.sink(o.index(i, (i % 2).eq(0)).store(UOp.const(dtypes.float32, 5.0)))
  assert run(k, np.full(n, -1, np.float32))[0].tolist() == [5, -1] * 4
  # ungated, the same load is out of bounds: an error, never garbage
  o2 = UOp.define_global(0, dtypes.float32.ptr(n))
  a2 = UOp.define_global(1, dtypes.float32.ptr(-1))
  with pytest.raises(EvalError, match="slot 1"):
    evaluate(UOp.sink(o2.index(i).store(a2.index(i).load())), [np.zeros(n, np.float32), np.zeros(4, np.float32)])


def test_symbolic_sizes():
  n = UOp.variable("n", 1, 32)
  k = K.elementwise(lambda x, y: x * y, dtypes.int32, ((n, 3), dtypes.int32), ((3,), dtypes.int32))
  for nv in (1, 5, 32):
    x = RNG.integers(-50, 50, (nv, 3)).astype(np.int32)
    y = np.array([1, -2, 3], np.int32)
    assert run(k, np.zeros(nv * 3, np.int32), x, y, var_vals={"n": nv})[0].tolist() == (x * y).ravel().tolist()
  ks = K.reduce_sum((n, 4), dtypes.float32, 0)
  x = RNG.standard_normal((7, 4)).astype(np.float32)
  np.testing.assert_allclose(run(ks, np.zeros(4, np.float32), x, var_vals={"n": 7})[0], x.sum(0), rtol=1e-5)
  # a bound variable needs no var_vals
  kb = K.elementwise(lambda x: x + 1, dtypes.int32, ((n.bind(3),), dtypes.int32))
  assert run(kb, np.zeros(3, np.int32), np.arange(3, dtype=np.int32))[0].tolist() == [1, 2, 3]


def test_variable_errors():
  n = UOp.variable("n", 1, 32)
  k = K.elementwise(lambda x: x, dtypes.int32, ((n,), dtypes.int32))
  bufs = [np.zeros(32, np.int32), np.zeros(32, np.int32)]
  with pytest.raises(VariableBoundsError, match="n"): evaluate(k, bufs)
  with pytest.raises(VariableBoundsError, match=r"variable n=33 is outside bounds \[1, 32\]"): evaluate(k, bufs, {"n": 33})
  with pytest.raises(VariableBoundsError, match=r"variable n=0 is outside bounds \[1, 32\]"): evaluate(k, bufs, {"n": 0})
  evaluate(k, bufs, {"n": 4, "unused": 7})  # names no kernel uses are ignored


def test_buffer_errors():
  k = K.elementwise(lambda x: x + 1.0, dtypes.float32, ((8,), dtypes.float32))
  with pytest.raises(EvalError, match="slot 1"): evaluate(k, [np.zeros(8, np.float32)])
  with pytest.raises(EvalError, match="slot 1.*float64"): evaluate(k, [np.zeros(8, np.float32), np.zeros(8, np.float64)])
  with pytest.raises(EvalError, match="slot 0"): evaluate(k, [np.zeros(7, np.float32), np.zeros(8, np.float32)])
  with pytest.raises(EvalError, match="slot 1"): evaluate(k, [np.zeros(8, np.float32), np.zeros((2, 4), np.float32)])
  out = np.full(8, 7, np.float32)
  with pytest.raises(EvalError): evaluate(k, [out, np.zeros(5, np.float32)])
  assert out.tolist() == [7] * 8  # nothing written by a failed store


def test_store_order_and_read_before_write():
  n = 5
  x = UOp.define_global(0, dtypes.int32.ptr(n))
  i = UOp.range(n - 1, 0)
  # x[i] = x[i+1]: every value is read before any is written (a vector shift, not a smear)
  shift = UOp.sink(x.index(i).store(x.index(i + 1).load()))
  assert run(shift, np.arange(n, dtype=np.int32))[0].tolist() == [1, 2, 3, 4, 4]
  # stores run in SINK order: the second sees the first's writes
  j = UOp.range(n, 1)
  y = UOp.define_global(1, dtypes.int32.ptr(n))
  k = UOp.sink(x.index(j).store(j * 10), y.index(j).store(x.index(j).load() + 1))
  x_out, y_out = run(k, np.zeros(n, np.int32), np.zeros(n, np.int32))
  assert x_out.tolist() == [0, 10, 20, 30, 40] and y_out.tolist() == [1, 11, 21, 31, 41]


def test_nested_ranges_and_broadcast_values():
  # out[i, j] = i * 3 + j with a 2-d loop nest and a store whose value ignores one loop
  o = UOp.define_global(0, dtypes.int32.ptr(12))
  i, j = UOp.range(4, 0), UOp.range(3, 1)
  assert run(UOp.sink(o.index(i * 3 + j).store(i * 3 + j)), np.zeros(12, np.int32))[0].tolist() == list(range(12))
  assert run(UOp.sink(o.index(i * 3 + j).store(i)), np.zeros(12, np.int32))[0].tolist() == [v // 3 for v in range(12)]


def test_lowered_ops_rejected():
  o = UOp.define_global(0, dtypes.int32.ptr(4))
  s = UOp.special("gidx0", 4)
  with pytest.raises(EvalError, match="SPECIAL"): evaluate(UOp.sink(o.index(s).store(s)), [np.zeros(4, np.int32)])
