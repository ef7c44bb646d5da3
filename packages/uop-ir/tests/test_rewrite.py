"""UPat, PatternMatcher and graph_rewrite: matching, both traversal orders, fixed point, endless-rewrite guard."""
import pytest

from kiln.ir import Ops, PatternMatcher, RewriteError, UOp, UPat, dtypes, graph_rewrite, substitute

x, y = UOp.variable("x", 0, 10), UOp.variable("y", 0, 10)


def test_upat_matching():
  p = UPat.var("a") + UPat.cvar("c")
  (m,) = p.match(x + 3, {})
  assert m["a"] is x and m["c"].arg == 3
  assert p.match(x + y, {}) == []
  (m,) = UPat(Ops.ADD, src=(UPat.var("a"), UPat.var("a"))).match(x + x, {})  # a name bound twice must be the same node
  assert m["a"] is x and UPat(Ops.ADD, src=(UPat.var("a"), UPat.var("a"))).match(x + y, {}) == []
  assert UPat(Ops.MUL, dtype=dtypes.int64).match(x * y, {}) == [] and UPat(Ops.MUL, dtype=dtypes.int32).match(x * y, {}) != []
  assert UPat.const(dtypes.int32, 3).match(UOp.const(dtypes.int32, 3), {}) and not UPat.const(dtypes.int32, 3).match(UOp.const(dtypes.int32, 4), {})
  only_y = UPat(Ops.DEFINE_VAR, custom=lambda u: u.arg[0] == "y")
  assert only_y.match(y, {}) and not only_y.match(x, {})


def test_pattern_matcher_first_rule_wins():
  pm = PatternMatcher([(UPat(Ops.ADD, name="n"), lambda n: None), (UPat.var("a") + UPat.cvar("c"), lambda a, c: a * c.arg),
                       (UPat(Ops.ADD, name="n"), lambda n: UOp.const(dtypes.int32, 0))])
  assert pm.rewrite(x + 3) is x * 3 and pm.rewrite(x + y).arg == 0 and pm.rewrite(x * y) is None


def test_default_rewrites_sources_first_and_reaches_a_fixed_point():
  seen: list[UOp] = []
  def fold_add(a, b):  # (a + b) of two constants only after the sources have been rewritten into constants
    return UOp.const(dtypes.int32, a.arg + b.arg)
  def var_to_const(v):
    seen.append(v)
    return UOp.const(dtypes.int32, v.arg[2])
  pm = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v"), var_to_const),
                       (UPat(Ops.ADD, src=(UPat(Ops.CONST, name="a"), UPat(Ops.CONST, name="b"))), fold_add)])
  e = (x + y) + UOp.variable("z", 0, 5)
  assert graph_rewrite(e, pm).arg == 25
  assert {v.arg[0] for v in seen} == {"x", "y", "z"}


def test_bottom_up_sees_the_node_before_its_sources():
  log: list[str] = []
  def see(n):
    log.append(n.op.name)
  pm = PatternMatcher([(UPat(name="n"), see)])
  e = x * y + 1
  graph_rewrite(e, pm, bottom_up=True)
  assert log.index("ADD") < log.index("MUL") < log.index("DEFINE_VAR")
  log.clear()
  graph_rewrite(e, pm)
  assert log.index("DEFINE_VAR") < log.index("MUL") < log.index("ADD")
  # a top-down rule sees the original operands: rewrite (x*y)+1 as a whole before x*y changes
  pm2 = PatternMatcher([(UPat(Ops.ADD, src=(UPat(Ops.MUL, name="m"), UPat.cvar())), lambda m: m.src[0]),
                        (UPat(Ops.MUL, name="m"), lambda m: m.src[1])])
  assert graph_rewrite(e, pm2, bottom_up=True) is x and graph_rewrite(e, pm2) is e.replace(src=(y, e.src[1]))


def test_shared_nodes_rewrite_once_and_results_are_shared():
  calls: list[UOp] = []
  def double(v):
    calls.append(v)
    return v.replace(arg=(v.arg[0] + "2", v.arg[1], v.arg[2]))
  pm = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v", custom=lambda v: not v.arg[0].endswith("2")), double)])
  e = (x * x + x) * (x + 1)
  out = graph_rewrite(e, pm)
  assert len(calls) == 1 and [v.arg[0] for v in out.variables()] == ["x2"]


def test_a_rule_set_that_undoes_itself_raises():
  pm = PatternMatcher([(UPat.var("a") + UPat.var("b"), lambda a, b: b + a if a is not b else None)])  # x+y -> y+x -> x+y ...
  with pytest.raises(RewriteError, match="endless rewrite.*undoes itself"): graph_rewrite(x + y, pm)
  with pytest.raises(RewriteError, match="endless rewrite"): graph_rewrite(x + y, pm, bottom_up=True)


def test_a_rule_set_that_grows_forever_raises():
  pm = PatternMatcher([(UPat(Ops.CONST, name="c"), lambda c: UOp.const(dtypes.int32, c.arg + 1))])
  with pytest.raises(RewriteError, match="more than 50 rewrites"): graph_rewrite(x + 1, pm, max_rewrites=50)
  # by default 100,000 rewrites plus 50 a node of the graph (x, 1 and their sum: 3 nodes), counted once 100,000 are passed
  with pytest.raises(RewriteError, match="more than 100150 rewrites"): graph_rewrite(x + 1, pm)


def test_substitute():
  e = (x + y) * x
  assert substitute(e, {x: y}) is (y + y) * y and substitute(e, {}) is e
