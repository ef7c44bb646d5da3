"""The index-arithmetic rule families (issue 19): each family's before/after node counts, the cases it must leave alone, and
a brute-force property (every point of small variable ranges: the same value after simplify, every node's vmin/vmax holding it)."""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln_ir_testgen import tdiv, wrap

from kiln.ir import Ops, UOp, dtypes
from kiln.ir.dtype import DType
from kiln.ir.symbolic import simplify, symbolic

V = UOp.variable


def nodes(u: UOp) -> int: return len(u.toposort())


# (name, before, after): simplify(before) is after
FAMILIES = {
  "divmod": [
    # congruence: the remainder part's quotient is one value
    ("(3 + 3a)//4", lambda: (3 + V("a", 0, 3) * 3) // 4, lambda: V("a", 0, 3)),
    ("(10a)%9", lambda: (V("a", 0, 5) * 10) % 9, lambda: V("a", 0, 5)),
    ("(9a+1)%8", lambda: (V("a", 0, 6) * 9 + 1) % 8, lambda: V("a", 0, 6) + 1),
    ("(7a+12)//8", lambda: (V("a", 0, 4) * 7 + 12) // 8, lambda: V("a", 0, 4) + 1),
    ("(-3a-3)//4", lambda: (V("a", 0, 3) * -3 - 3) // 4, lambda: V("a", 0, 3) * -1),
    ("(4i+2j+k)%4 two-valued", lambda: (V("i", 0, 9) * 4 + V("j", 0, 1) * 2 + 1) % 4, lambda: V("j", 0, 1) * 2 + 1),
    # a factor of the divisor first: (2g + l)//2 == g
    ("(2g+l)//10", lambda: (V("g", 0, 1000) * 2 + V("l", 0, 1)) // 10, lambda: V("g", 0, 1000) // 5),
    # a constant below the terms' common factor with the divisor: it never carries (a vector lane over a row of channels)
    ("(16i+5)%48", lambda: (V("i", 0, 26) * 16 + 5) % 48, lambda: (V("i", 0, 26) % 3) * 16 + 5),
    ("(16i+5)//48", lambda: (V("i", 0, 26) * 16 + 5) // 48, lambda: V("i", 0, 26) // 3),
    ("(6i+4j+1)%10", lambda: (V("i", 0, 9) * 6 + V("j", 0, 9) * 4 + 1) % 10, lambda: ((V("i", 0, 9) * 3 + V("j", 0, 9) * 2) % 5) * 2 + 1),
    # the constant cut to its smallest residue (kept in range)
    ("(x+262145)//16", lambda: (V("x", 0, 2**31 - 262146) + 262145) // 16, lambda: (V("x", 0, 2**31 - 262146) + 1) // 16 + 16384),
    ("(x+262145)%16", lambda: (V("x", 0, 2**20) + 262145) % 16, lambda: (V("x", 0, 2**20) + 1) % 16),
    ("(x+15)//4", lambda: (V("x", 0, 99) + 15) // 4, lambda: (V("x", 0, 99) + 3) // 4 + 3),
    ("(x+13)//8 small negative residue", lambda: (V("x", 5, 99) + 13) // 8, lambda: (V("x", 5, 99) + -3) // 8 + 2),
    # negative divisors, ceil read as floor
    ("((-i+200)//-4)+50", lambda: (-V("i", 0, 200) + 200) // -4 + 50, lambda: (V("i", 0, 200) + 3) // 4),
    ("x % -6", lambda: V("x", -9, 99) % -6, lambda: V("x", -9, 99) % 6),
    ("x // -6", lambda: V("x", -9, 99) // -6, lambda: (V("x", -9, 99) // 6) * -1),
  ],
  "chains": [
    # y % c and y // c meet again in a sum, also after a common factor was cancelled from both
    ("(16b+2)%18 + ((16b+2)//18)*18", lambda: (V("b", 0, 100) * 16 + 2) % 18 + ((V("b", 0, 100) * 16 + 2) // 18) * 18,
     lambda: V("b", 0, 100) * 16 + 2),
    ("3(x%4) + 12(x//4) + y", lambda: (V("x", -9, 9) % 4) * 3 + V("y", 0, 5) + (V("x", -9, 9) // 4) * 12, lambda: V("y", 0, 5) + V("x", -9, 9) * 3),
    # Hermite: n shifted quotients add up to the numerator
    ("(g+2561)//4 + (g+2562)//4 + (g+2560)//4 + (g+2559)//4",
     lambda: (V("g", 0, 2559) + 2561) // 4 + (V("g", 0, 2559) + 2562) // 4 + (V("g", 0, 2559) + 2560) // 4 + (V("g", 0, 2559) + 2559) // 4,
     lambda: V("g", 0, 2559) + 2559),
    ("x//2 + (x+1)//2", lambda: V("x", 0, 50) // 2 + (V("x", 0, 50) + 1) // 2, lambda: V("x", 0, 50)),
    ("2(y//3) + 2((y+1)//3) + 2((y+2)//3), y = 4i+j", lambda: sum(((V("i", 0, 9) * 4 + V("j", 0, 3) + k) // 3) * 2 for k in range(3)),
     lambda: V("i", 0, 9) * 8 + V("j", 0, 3) * 2),
    # a reshape's digits: (y % a) + a*((y // a) % b) is y % (ab), of either sign (truncating division nests)
    ("(k//9)*9 + ((k//3)%3)*3 + k%3", lambda: (V("k", 0, 26) // 9) * 9 + ((V("k", 0, 26) // 3) % 3) * 3 + V("k", 0, 26) % 3,
     lambda: V("k", 0, 26)),
    ("12((x//4)%5) + 3(x%4), x of both signs", lambda: ((V("x", -50, 50) // 4) % 5) * 12 + (V("x", -50, 50) % 4) * 3,
     lambda: (V("x", -50, 50) % 20) * 3),
    ("ceil side: x//2 + (x+1)//2, x <= -2", lambda: V("x", -50, -2) // 2 + (V("x", -50, -2) + 1) // 2, lambda: V("x", -50, -2) + 1),
  ],
  "compare": [
    ("(4i + f) < 512", lambda: (V("i", 0, 1000) * 4 + V("f", 0, 3)) < 512, lambda: V("i", 0, 1000) < 128),
    ("(6i + 2j + 3) < 40", lambda: (V("i", 0, 99) * 6 + V("j", 0, 2) * 2 + 3) < 40, lambda: V("i", 0, 99) * 3 + V("j", 0, 2) < 19),
    ("(8i + 4j + k) < 20, k in [0, 3]", lambda: (V("i", 0, 9) * 8 + V("j", 0, 1) * 4 + V("k", 0, 3)) < 20,
     lambda: V("i", 0, 9) * 2 + V("j", 0, 1) < 5),
    ("i//4 < 3", lambda: V("i", 0, 1000) // 4 < 3, lambda: V("i", 0, 1000) < 12),
    ("x//4 < -1", lambda: V("x", -50, 50) // 4 < -1, lambda: V("x", -50, 50) < -7),
    ("x//4 < 0", lambda: V("x", -50, 50) // 4 < 0, lambda: V("x", -50, 50) < -3),
    ("2 < x//4", lambda: 2 < V("x", -50, 50) // 4, lambda: 11 < V("x", -50, 50)),
    ("-a < -b", lambda: -V("a", 0, 10) < -V("b", 0, 10), lambda: V("b", 0, 10) < V("a", 0, 10)),
    ("-2i < -5", lambda: V("i", 0, 9) * -2 < -5, lambda: 2 < V("i", 0, 9)),
    ("3 < 8 - 4i", lambda: 3 < 8 - V("i", 0, 9) * 4, lambda: V("i", 0, 9) < 2),
    ("(x//-4) < -2: through a negative divisor", lambda: V("x", 0, 99) // -4 < -2, lambda: 11 < V("x", 0, 99)),
  ],
  "where": [
    ("c ? (c ? j : 1) : 2", lambda: (V("i", 0, 9) < 5).where((V("i", 0, 9) < 5).where(V("j", 0, 3), 1), 2),
     lambda: (V("i", 0, 9) < 5).where(V("j", 0, 3), 2)),
    ("c ? i : 0  +  c ? 2i : 0", lambda: (V("i", 0, 9) < 5).where(V("i", 0, 9), 0) + (V("i", 0, 9) < 5).where(V("i", 0, 9) * 2, 0),
     lambda: (V("i", 0, 9) < 5).where(V("i", 0, 9) * 3, 0)),
    ("max(c ? i : j, c ? 0 : 5)", lambda: (V("i", 0, 9) < 5).where(V("i", 0, 9), V("j", 0, 3)).maximum((V("i", 0, 9) < 5).where(0, 5)),
     lambda: (V("i", 0, 9) < 5).where(V("i", 0, 9), 5)),
    ("float: c ? x : 0 + c ? y : 0", lambda: (V("i", 0, 9) < 5).where(V("i", 0, 9).cast(dtypes.float32), 0.0) +
     (V("i", 0, 9) < 5).where(V("j", 0, 3).cast(dtypes.float32), 0.0),
     lambda: (V("i", 0, 9) < 5).where(V("i", 0, 9).cast(dtypes.float32) + V("j", 0, 3).cast(dtypes.float32), 0.0)),
  ],
  "divisor": [
    ("r // n, r in range(n)", lambda: UOp.range(V("n", 1, 300), 0) // V("n", 1, 300), lambda: UOp.const(dtypes.int32, 0)),
    ("r % n", lambda: UOp.range(V("n", 1, 300), 0) % V("n", 1, 300), lambda: UOp.range(V("n", 1, 300), 0)),
    ("(r + 1) % (n + 1)", lambda: (UOp.range(V("n", 1, 300), 0) + 1) % (V("n", 1, 300) + 1), lambda: UOp.range(V("n", 1, 300), 0) + 1),
    ("(2r) // (2n)", lambda: (UOp.range(V("n", 1, 300), 0) * 2) // (V("n", 1, 300) * 2), lambda: UOp.const(dtypes.int32, 0)),
  ],
  "casts": [
    ("cast32(cast64(i)*4 + 3)", lambda: (V("i", 0, 100).cast(dtypes.int64) * 4 + 3).cast(dtypes.int32), lambda: V("i", 0, 100) * 4 + 3),
    ("cast32(cast64(i) + w)", lambda: (V("i", 0, 100).cast(dtypes.int64) + V("w", 0, 2**40, dtypes.int64)).cast(dtypes.int32),
     lambda: V("i", 0, 100) + V("w", 0, 2**40, dtypes.int64).cast(dtypes.int32)),
    ("cast32(cast64(i)*2**33 + cast64(i)): the high term wraps away", lambda: (V("i", 0, 100).cast(dtypes.int64) * 2**33 +
     V("i", 0, 100).cast(dtypes.int64)).cast(dtypes.int32), lambda: V("i", 0, 100)),
  ],
}
NOT_FIRING = [
  ("cast32(3w): no term was int32", lambda: (V("w", 0, 2**40, dtypes.int64) * 3).cast(dtypes.int32)),
  ("cast8(cast64(i) + 7): the term was int32", lambda: (V("i", 0, 100).cast(dtypes.int64) + 7).cast(dtypes.int8)),
  ("(r + 1) % n: r + 1 reaches n", lambda: (UOp.range(V("n", 1, 300), 0) + 1) % V("n", 1, 300)),
  ("r % m: another loop's end", lambda: UOp.range(V("n", 1, 300), 0) % V("m", 1, 300)),
  ("c ? a : b + d ? a : b: two conditions", lambda: (V("i", 0, 9) < 5).where(V("j", 0, 3), 1) + (V("i", 0, 9) < 6).where(V("j", 0, 3), 2)),
  ("(4i + f) < 513: f decides at i = 128", lambda: (V("i", 0, 1000) * 4 + V("f", 0, 3)) < 513),
  ("i < n", lambda: V("i", 0, 9) < V("n", 1, 10)),
  ("-a < b: mixed signs", lambda: V("a", 0, 10) * -1 < V("b", 0, 10)),
  ("x//y < 3: y not a constant", lambda: V("x", 0, 99) // V("y", 1, 9) < 3),
  ("4w < 8: 4w may wrap", lambda: V("w", 0, 2**30) * 4 < 8),
  ("x//2 + (x+1)//2 crosses zero", lambda: V("x", -5, 5) // 2 + (V("x", -5, 5) + 1) // 2),
  ("x//4 + (x+1)//4 + (x+2)//4: a residue missing", lambda: V("x", 0, 50) // 4 + (V("x", 0, 50) + 1) // 4 + (V("x", 0, 50) + 2) // 4),
  ("x%4 + (x//4)*8: not 4 times", lambda: V("x", 0, 50) % 4 + (V("x", 0, 50) // 4) * 8),
  ("(4n+j)//4 crosses zero", lambda: (V("n", -5, 5) * 4 + V("j", 0, 3)) // 4),
  ("(x+3)//4: 3 is already the smallest residue", lambda: (V("x", 0, 99) + 3) // 4),
  ("(x+2)//4 crosses zero", lambda: (V("x", -9, 99) + 2) // 4),
  ("(x+5)%4 crosses zero", lambda: (V("x", -9, 99) + 5) % 4),
  ("(16i-4j+5)%48: the terms' sum may be negative", lambda: (V("i", 0, 9) * 16 + V("j", 0, 9) * -4 + 5) % 48),
  ("(w+262145)//16 may wrap", lambda: (V("w", 0, 2**31 - 1) + 262145) // 16),
]


CASES = [(f, *c) for f, cs in FAMILIES.items() for c in cs]


@pytest.mark.parametrize("family,name,before,after", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_family(family, name, before, after):
  b, a = before(), after()
  s = simplify(b)
  assert s is a, f"{name}: {nodes(b)} nodes -> {nodes(s)}, wanted {nodes(a)}"


@pytest.mark.parametrize("name,expr", NOT_FIRING, ids=[n for n, _ in NOT_FIRING])
def test_left_alone(name, expr):
  e = expr()
  assert simplify(e) is e, name


# ---- brute force: an independent model of C semantics over every point of small ranges ----

def ev(u: UOp, env: dict[str, int], memo: dict) -> int:
  if (v := memo.get(u)) is not None: return v
  op, dt = u.op, u.dtype
  if op is Ops.CONST: v = u.arg
  elif op is Ops.DEFINE_VAR: v = env[u.arg[0]]
  else:
    s = [ev(x, env, memo) for x in u.src]
    if op is Ops.WHERE: v = s[1] if s[0] else s[2]
    elif op is Ops.CMPLT: v = s[0] < s[1]
    elif op is Ops.CMPNE: v = s[0] != s[1]
    elif op is Ops.CMPEQ: v = s[0] == s[1]
    elif op is Ops.AND: v = s[0] and s[1] if dt.is_bool else s[0] & s[1]
    elif op is Ops.OR: v = s[0] or s[1] if dt.is_bool else s[0] | s[1]
    elif op is Ops.XOR: v = s[0] != s[1] if dt.is_bool else wrap(dt, s[0] ^ s[1])
    elif op is Ops.CAST: v = bool(s[0]) if dt.is_bool else wrap(dt, int(s[0]))
    elif op is Ops.IDIV: v = s[0] if s[1] == 0 else wrap(dt, tdiv(s[0], s[1]))
    elif op is Ops.MOD: v = 0 if s[1] == 0 else wrap(dt, s[0] - s[1] * tdiv(s[0], s[1]))
    else: v = wrap(dt, {Ops.ADD: lambda a, b: a + b, Ops.SUB: lambda a, b: a - b, Ops.MUL: lambda a, b: a * b,
                        Ops.MAX: max, Ops.NEG: lambda a: -a}[op](*s))
  memo[u] = v
  return v


@st.composite
def small_vars(draw, dt: DType) -> dict[str, tuple[int, int]]:
  out = {}
  for n in ("a", "b", "c"):
    lo = draw(st.sampled_from([0, 0, 0, 1, -3, -8, 5]))
    out[n] = (lo, lo + draw(st.integers(0, 9)))
  return out


@st.composite
def index_expr(draw, dt: DType, vs: dict[str, UOp], depth: int = 4) -> UOp:
  """Expressions as lowering makes them: sums of scaled variables and constants under // and % by constants, comparisons of
  them, selects on shared conditions, and the forms each rule family targets."""
  def leaf() -> UOp:
    if draw(st.integers(0, 3)) == 0: return UOp.const(dt, wrap(dt, draw(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 16, 100, 2559, 262145, -4, -9]))))
    return vs[draw(st.sampled_from(sorted(vs)))]
  if depth == 0: return leaf()
  kind = draw(st.sampled_from(["affine", "affine", "div", "mod", "div", "mod", "add", "mul", "neg", "leaf", "where", "cmp", "hermite",
                               "recombine", "max", "divcmp", "divcmp", "narrow"]))
  sub = lambda: draw(index_expr(dt, vs, depth - 1))  # noqa: E731
  if kind == "leaf": return leaf()
  if kind == "affine": return sub() * draw(st.integers(-12, 12)) + sub() * draw(st.integers(-4, 4)) + draw(st.integers(-40, 40))
  if kind in ("div", "mod"):
    c = draw(st.sampled_from([2, 3, 4, 5, 8, 9, 10, 16, 18, -4, -3, 1]))
    d = UOp.const(dt, c) if draw(st.integers(0, 4)) else sub()
    return sub() // d if kind == "div" else sub() % d
  if kind == "add": return sub() + sub()
  if kind == "mul": return sub() * draw(st.sampled_from([2, 3, -1, 4, 16]))
  if kind == "neg": return -sub()
  if kind == "max": return sub().maximum(sub())
  if kind == "cmp":
    x, y = sub(), (UOp.const(dt, draw(st.integers(-30, 60))) if draw(st.booleans()) else sub())
    c = x < y if draw(st.booleans()) else y < x
    return c.where(sub(), sub())
  if kind == "divcmp":  # a quotient against a small constant, either side
    q, k = sub() // draw(st.sampled_from([2, 3, 4, -4])), UOp.const(dt, draw(st.integers(-3, 3)))
    return (q < k if draw(st.booleans()) else k < q).where(sub(), sub())
  if kind == "narrow":  # a sum computed wider, cast back
    w = dtypes.int64 if dt.bits < 64 else dt
    return (sub().cast(w) * draw(st.sampled_from([1, 3, 2**20 + 1])) + sub().cast(w) + draw(st.integers(-300, 300))).cast(dt)
  if kind == "where":
    c = sub() < sub()
    op = draw(st.sampled_from([Ops.ADD, Ops.MAX, Ops.MUL]))
    return c.where(sub(), sub()).alu(op, c.where(sub(), sub()) if draw(st.booleans()) else c.where(c.where(sub(), sub()), sub()))
  if kind == "hermite":  # sum over shifted quotients, as unrolling makes them
    x, n = sub(), draw(st.sampled_from([2, 3, 4]))
    base = draw(st.integers(-3, 30))
    return sum((((x + base + k) // n) for k in draw(st.permutations(range(n)))), UOp.const(dt, 0))
  x, c = sub(), draw(st.sampled_from([3, 4, 9, 18]))
  k = draw(st.sampled_from([1, 2, -1]))
  return (x % c) * k + (x // c) * (c * k) + sub()


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_brute_force_value_and_bounds(data):
  dt = data.draw(st.sampled_from([dtypes.int32, dtypes.int32, dtypes.int32, dtypes.int8, dtypes.int16]))
  bounds = data.draw(small_vars(dt))
  vs = {n: V(n, *b, dtype=dt) for n, b in bounds.items()}
  e = data.draw(index_expr(dt, vs))
  if data.draw(st.booleans()): e = e < data.draw(st.integers(-20, 40)) if data.draw(st.booleans()) else data.draw(st.integers(-20, 40)) < e
  s = simplify(e)
  assert simplify(s) is s, "not a fixed point"
  for u in e.toposort():  # the matcher's per-shape rule lists leave out no rule that matches
    kept = symbolic.rules_for(u)
    assert all(r in kept for r in symbolic.by_op.get(u.op, []) if r[0].match(u, {})), f"a rule that matches {u.op} was skipped"
  nodes_s = s.toposort()
  for pt in itertools.product(*(range(lo, hi + 1) for lo, hi in bounds.values())):
    env = dict(zip(bounds, pt))
    want, memo = ev(e, env, {}), {}
    assert ev(s, env, memo) == want, f"simplify changed the value at {env}"
    for u in nodes_s:
      if u.dtype.kind in "iub": assert u.vmin <= memo[u] <= u.vmax, f"{u.op}: {memo[u]} outside [{u.vmin}, {u.vmax}] at {env}"


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_float_nodes_lose_no_rule(data):
  """simplify tries only folding and the where/cast rules on float-valued nodes: the whole table must do no more on them."""
  from kiln.ir.rewrite import PatternMatcher, graph_rewrite
  i, j = V("i", 0, 9), V("j", -4, 4)
  fts = [dtypes.float32, dtypes.float16, dtypes.float64]

  def fexpr(depth: int) -> UOp:
    f = dtypes.float32
    kind = draw(st.sampled_from(["leaf", "leaf", "const", "bin", "bin", "where", "same_where", "cast", "unary"])) if depth else "leaf"
    if kind == "leaf": return (i * draw(st.integers(-3, 3)) + j).cast(f) if draw(st.booleans()) else j.cast(f)
    if kind == "const": return UOp.const(f, draw(st.sampled_from([0.0, 1.0, -1.0, 2.5])))
    a, b = fexpr(depth - 1), fexpr(depth - 1)
    if kind == "bin": return a.alu(draw(st.sampled_from([Ops.ADD, Ops.MUL, Ops.MAX, Ops.SUB])), b)
    c = (i < draw(st.integers(0, 9))) if draw(st.booleans()) else (a < b)
    if kind == "where": return c.where(a, b)
    if kind == "same_where": return c.where(c.where(a, b), fexpr(depth - 1)) + c.where(b, a)
    if kind == "cast": return a.cast(draw(st.sampled_from(fts))).cast(f)
    return a.exp2() if draw(st.booleans()) else -a

  draw = data.draw
  e = fexpr(4)
  assert graph_rewrite(e, PatternMatcher(symbolic.rules)) is simplify(e)


def test_loop_index_below_its_end_brute_force():
  """r // y and r % y for r a loop over n and y built from n: every (n, r) with r < n, against the model."""
  n = V("n", 1, 12)
  r = UOp.range(n, 0)
  for k, m, a in itertools.product((0, 1, 2), (0, 1, 2), (1, 2, 3)):
    for e in ((r * a + k) // (n * a + m), (r * a + k) % (n * a + m), (r + k) % (n - 1 + m).maximum(1)):
      s = simplify(e)
      for nv in range(1, 13):
        for rv in range(nv):
          memo = {r: rv}
          want = ev(e, {"n": nv}, memo)
          memo2 = {r: rv}
          assert ev(s, {"n": nv}, memo2) == want, f"{k, m, a}: n={nv} r={rv}"
          for u in s.toposort():
            if u in memo2 and u.dtype.kind == "i": assert u.vmin <= memo2[u] <= u.vmax
