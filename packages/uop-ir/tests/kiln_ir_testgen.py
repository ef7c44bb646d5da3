"""Shared hypothesis strategies: random integer expression trees over bounded variables, with an independent Python model of C semantics."""
from __future__ import annotations

from hypothesis import strategies as st

from kiln.ir import UOp, dtypes
from kiln.ir.dtype import DType

NAMES = ("a", "b", "c")


def wrap(dt: DType, v: int) -> int:
  m = v & ((1 << dt.bits) - 1)
  return m - (1 << dt.bits) if dt.kind == "i" and m >= 1 << (dt.bits - 1) else m


def tdiv(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def cdiv(dt: DType, a: int, b: int) -> int: return a if b == 0 else wrap(dt, tdiv(a, b))
def cmod(dt: DType, a: int, b: int) -> int: return 0 if b == 0 else wrap(dt, a - b * tdiv(a, b))


@st.composite
def bounded_vars(draw, dt: DType) -> dict[str, tuple[int, int]]:
  out = {}
  for n in NAMES:
    kind = draw(st.sampled_from(["small", "small", "pos", "wide"]))
    if kind == "small": lo = draw(st.integers(max(dt.min, -20), min(dt.max, 20))); hi = draw(st.integers(lo, min(dt.max, lo + 40)))
    elif kind == "pos": lo = draw(st.integers(0, min(dt.max, 8))); hi = draw(st.integers(lo, min(dt.max, 300)))
    else: lo = draw(st.integers(dt.min, dt.max)); hi = draw(st.integers(lo, dt.max))
    out[n] = (lo, hi)
  return out


def consts(dt: DType):
  return st.one_of(st.integers(-9, 9), st.sampled_from([16, 32, 64, 100, -64]), st.integers(dt.min, dt.max)).map(lambda v: wrap(dt, v))


@st.composite
def int_expr(draw, dt: DType, bounds: dict[str, tuple[int, int]], depth: int = 4):
  """(uop, f) where f(env) is the value by an independent Python model of kiln's C semantics."""
  if depth == 0 or draw(st.integers(0, 4)) == 0:
    if draw(st.booleans()):
      n = draw(st.sampled_from(NAMES))
      return UOp.variable(n, *bounds[n], dtype=dt), lambda env, n=n: env[n]
    c = draw(consts(dt))
    return UOp.const(dt, c), lambda env, c=c: c
  op = draw(st.sampled_from(["add", "sub", "mul", "div", "mod", "max", "min", "neg", "where", "divc", "modc", "mulc", "affine", "affine"]))
  x, fx = draw(int_expr(dt, bounds, depth - 1))
  if op == "affine":  # (x*c + y) // d or % d with d a multiple or divisor of c: what the div/mod rules rewrite
    y, fy = draw(int_expr(dt, bounds, depth - 1))
    c = draw(st.sampled_from([2, 3, 4, 8, 16, 6, 12]))
    d = draw(st.sampled_from([c, c, c * 2, max(c // 2, 1), 2]))
    num, fnum = x * c + y, lambda e: wrap(dt, wrap(dt, fx(e) * c) + fy(e))
    if draw(st.booleans()): return num // d, lambda e: cdiv(dt, fnum(e), d)
    return num % d, lambda e: cmod(dt, fnum(e), d)
  if op == "neg":
    if dt.kind == "u": return x, fx
    return -x, lambda e: wrap(dt, -fx(e))
  if op in ("divc", "modc", "mulc"):
    c = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 5, 7, -2, -4]))
    if dt.kind == "u": c = abs(c)
    if op == "divc": return x // c, lambda e: cdiv(dt, fx(e), c)
    if op == "modc": return x % c, lambda e: cmod(dt, fx(e), c)
    return x * c, lambda e: wrap(dt, fx(e) * c)
  y, fy = draw(int_expr(dt, bounds, depth - 1))
  if op == "add": return x + y, lambda e: wrap(dt, fx(e) + fy(e))
  if op == "sub": return x - y, lambda e: wrap(dt, fx(e) - fy(e))
  if op == "mul": return x * y, lambda e: wrap(dt, fx(e) * fy(e))
  if op == "div": return x // y, lambda e: cdiv(dt, fx(e), fy(e))
  if op == "mod": return x % y, lambda e: cmod(dt, fx(e), fy(e))
  if op == "max": return x.maximum(y), lambda e: max(fx(e), fy(e))
  if op == "min": return x.minimum(y), lambda e: min(fx(e), fy(e))
  z, fz = draw(int_expr(dt, bounds, depth - 1))
  w, fw = draw(int_expr(dt, bounds, depth - 1))
  cmp = draw(st.sampled_from(["lt", "eq", "ne", "ge"]))
  if cmp == "lt": return (z < w).where(x, y), lambda e: fx(e) if fz(e) < fw(e) else fy(e)
  if cmp == "eq": return z.eq(w).where(x, y), lambda e: fx(e) if fz(e) == fw(e) else fy(e)
  if cmp == "ne": return z.ne(w).where(x, y), lambda e: fx(e) if fz(e) != fw(e) else fy(e)
  return (z >= w).where(x, y), lambda e: fx(e) if fz(e) >= fw(e) else fy(e)


@st.composite
def points(draw, bounds: dict[str, tuple[int, int]], n: int = 6) -> list[dict[str, int]]:
  return [{k: draw(st.one_of(st.sampled_from([lo, hi]), st.integers(lo, hi))) for k, (lo, hi) in bounds.items()} for _ in range(n)]


INT_DTYPES = [dtypes.int32, dtypes.int32, dtypes.int32, dtypes.int8, dtypes.int16, dtypes.int64, dtypes.uint8, dtypes.uint32]
