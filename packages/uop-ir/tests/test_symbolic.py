"""The simplifier: specific rules, and the property that simplify() never changes a value."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln_ir_testgen import INT_DTYPES, bounded_vars, int_expr, points

from kiln.ir import IRTypeError, Ops, UOp, VariableBoundsError, dtypes
from kiln.ir.analysis import sym_int_eval
from kiln.ir.symbolic import simplify, symbolic

i, j = UOp.variable("i", 0, 15), UOp.variable("j", 0, 3)
n = UOp.variable("n", -5, 5)
k = UOp.variable("k", 1, 8)


def ops(u: UOp) -> list[str]: return sorted(x.op.name for x in u.toposort() if x.op not in (Ops.CONST, Ops.DEFINE_VAR))


@pytest.mark.parametrize("before,after", [
  (lambda: (i * 4 + j) // 4, lambda: i), (lambda: (i * 4 + j) % 4, lambda: j), (lambda: (i * 4 + j + 8) // 4, lambda: i + 2),
  (lambda: i + i, lambda: i * 2), (lambda: i * 3 + i * 2, lambda: i * 5), (lambda: (i + 3) + 4, lambda: i + 7), (lambda: 3 + i, lambda: i + 3),
  (lambda: i * 2 - i, lambda: i), (lambda: (i * 4 + j) // 2, lambda: i * 2 + j // 2), (lambda: (i * 8 + j * 4 + 4) // 4, lambda: i * 2 + j + 1),
  (lambda: i < 16, lambda: UOp.const(dtypes.bool, True)), (lambda: i < 0, lambda: UOp.const(dtypes.bool, False)),
  (lambda: i + 3 < 5, lambda: i < 2), (lambda: i * 4 < 9, lambda: i < 3), (lambda: i.maximum(j + 16), lambda: j + 16),
  (lambda: (i // 4) // 2, lambda: i // 8), (lambda: (i % 8) % 4, lambda: i % 4), (lambda: (i // 4) * 4 + i % 4, lambda: i),
  (lambda: j % 4, lambda: j), (lambda: j // 4, lambda: UOp.const(dtypes.int32, 0)),
  (lambda: n % 6, lambda: n), (lambda: n // 6, lambda: UOp.const(dtypes.int32, 0)),
  (lambda: j % k.maximum(4), lambda: j), (lambda: (i << 2) >> 2, lambda: i), (lambda: j.cast(dtypes.int64).cast(dtypes.int32), lambda: j),
  (lambda: (i + j) * 3 - j * 3, lambda: i * 3), (lambda: (i < 5).where(True, False), lambda: i < 5),
  (lambda: (i < 5).where(j, (i < 5).where(n, k)), lambda: (i < 5).where(j, k)),
  (lambda: (i < 5).logical_not().where(j, k), lambda: (i < 5).where(k, j)), (lambda: -(i.alu(Ops.NEG)), lambda: i),
  (lambda: (n * 4 + 2) % 2, lambda: UOp.const(dtypes.int32, 0)), (lambda: (n * 6 + 4) // 2, lambda: n * 3 + 2),
])
def test_rules(before, after):
  assert simplify(before()) is after()


@pytest.mark.parametrize("expr,why", [
  (lambda: (n * 4 + j) // 4, "n*4 + j crosses zero: truncation does not split (n=-1, j=1: 0, not -1)"),
  (lambda: (n * 4 + j) % 4, "same, for %"),
  (lambda: (UOp.variable("w", 0, 2**30) * 4 + j) // 4, "w*4 may wrap int32"),
  (lambda: UOp.variable("w", 0, 2**30) * 4 < 8, "w*4 may wrap, so the comparison cannot be narrowed"),
  (lambda: n % 5, "|n| may equal 5"),
  (lambda: (n + 3) >> 1, "n+3 may be negative: >> floors, // truncates"),
  (lambda: UOp.variable("w", 100, 300).cast(dtypes.int8).cast(dtypes.int32), "int8 does not hold 100..300"),
  (lambda: UOp.variable("f", 0, 3000).cast(dtypes.float16).cast(dtypes.int32), "float16 rounds 2049 to 2048"),
  (lambda: UOp.variable("f", 0, 300).cast(dtypes.float32).cast(dtypes.int8), "float->int8 saturates, int->int8 wraps"),
])
def test_rules_that_must_not_fire(expr, why):
  e = expr()
  assert simplify(e) is e, why


def test_int8_wraparound_is_respected():
  x = UOp.variable("x", 0, 100, dtypes.int8)
  e = (x * 2) // 2  # x*2 wraps past 127
  s = simplify(e)
  assert s is not x and sym_int_eval(s, {"x": 100}) == sym_int_eval(e, {"x": 100}) == -28


def test_symbolic_table_and_simplify_fixed_point():
  e = ((i * 4 + j) // 4 + n * 2 - n) % 1000
  s = simplify(e)
  assert simplify(s) is s and all(symbolic.rewrite(x) is None for x in s.toposort())  # nothing left to fire anywhere


def test_sym_int_eval():
  e = (i * 7 - n) // 3 % 5
  for iv in (0, 7, 15):
    for nv in (-5, 0, 5):
      q = abs(iv * 7 - nv) // 3 * (1 if iv * 7 - nv >= 0 else -1)
      r = abs(q) % 5 * (1 if q >= 0 else -1)
      assert sym_int_eval(e, {"i": iv, "n": nv}) == r
  assert sym_int_eval(UOp.const(dtypes.int8, 100) + UOp.variable("z", 0, 100, dtypes.int8), {"z": 100}) == -56
  assert sym_int_eval(i < 3, {"i": 2}) == 1 and sym_int_eval(i.bind(4) * 2, {}) == 8
  with pytest.raises(VariableBoundsError, match="variable n"): sym_int_eval(i + n, {"i": 1})
  with pytest.raises(VariableBoundsError, match=r"i=16 is outside bounds \[0, 15\]"): sym_int_eval(i + 1, {"i": 16})
  with pytest.raises(IRTypeError): sym_int_eval(i.cast(dtypes.float32), {"i": 1})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_simplify_never_changes_a_value(data):
  dt = data.draw(st.sampled_from(INT_DTYPES))
  bounds = data.draw(bounded_vars(dt))
  e, f = data.draw(int_expr(dt, bounds))
  s = simplify(e)
  for env in data.draw(points(bounds)):
    want = f(env)
    assert sym_int_eval(e, env) == want, f"construction folding changed the value of {e}"
    assert sym_int_eval(s, env) == want, f"simplify changed the value at {env}"


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_index_expressions_simplify_exactly(data):
  # the shapes codegen makes: (a*C + b) // C, % C, over small non-negative ranges, nested
  bounds = {"a": (0, data.draw(st.integers(0, 64))), "b": (0, data.draw(st.integers(0, 16))), "c": (0, data.draw(st.integers(0, 8)))}
  a, b, c = (UOp.variable(nm, *bounds[nm]) for nm in "abc")
  C = data.draw(st.sampled_from([2, 3, 4, 8, 16]))
  D = data.draw(st.sampled_from([1, 2, 4, 5]))
  e = data.draw(st.sampled_from([
    ((a * C + b) // C) * D + (a * C + b) % C, ((a * C * D + b * D + c) // D) % C, (a * C + b + c) // C - a, ((a + b) * C + c) % (C * 2)]))
  s = simplify(e)
  assert simplify(s) is s  # a fixed point
  for env in data.draw(points(bounds, 4)): assert sym_int_eval(s, env) == sym_int_eval(e, env)


def test_is_multiple_proves_only_what_holds():
  from kiln.ir.symbolic import is_multiple
  r, s = UOp.range(100, 0), UOp.range(7, 1)
  assert is_multiple(r * 16, 16) and is_multiple(s * 512 + r * 16 + 32, 16) and is_multiple(r * 16, 8)
  assert not is_multiple(r * 16 + 4, 16) and not is_multiple(s * 1000 + r * 16, 16) and not is_multiple(r, 2)
  assert not is_multiple(r * 12, 12)  # not a power of two: wraparound could break it, so unproven
  assert is_multiple(r * 3, 1) and is_multiple(UOp.const(dtypes.int32, 64), 64)


def test_simplify_shares_results_between_calls(monkeypatch):
  """simplify keeps each node's fixed point between calls (graph_rewrite's memo): the same index at another lane rewrites
  only the nodes the lane reaches (fewer rule lookups than the first), and gives what a fresh rewrite gives. Past the
  bound the memo is a new dict, never cleared in place (a call in another thread keeps the one it took)."""
  import kiln.ir.symbolic as sym
  from kiln.ir.rewrite import graph_rewrite
  monkeypatch.setattr(sym, "_SIMPLIFIED", {})
  a, b = UOp.variable("a", 0, 100), UOp.variable("b", 0, 7)
  base = ((a * 16 + b) // 4 * 3 + (a * 16 + b) % 4) * 5 + 7
  looked: list[UOp] = []
  orig = sym.symbolic.rewrite
  monkeypatch.setattr(sym.symbolic, "rewrite", lambda u, ctx=None: looked.append(u) or orig(u, ctx))
  got, per_call = [], []
  for lane in range(4):
    n = len(looked)
    got.append(simplify(base + lane))
    per_call.append(len(looked) - n)
  monkeypatch.setattr(sym.symbolic, "rewrite", orig)
  assert got == [graph_rewrite(base + lane, sym.symbolic) for lane in range(4)]
  assert base in sym._SIMPLIFIED and max(per_call[1:]) < per_call[0], per_call  # the shared part rewritten once
  old = sym._SIMPLIFIED
  monkeypatch.setattr(sym, "_SIMPLIFIED_MAX", 0)
  simplify(base + 9)
  assert sym._SIMPLIFIED is not old and len(old) > 0
