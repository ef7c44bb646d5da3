"""The verifier: each rule rejects a malformed kernel and names the node; the bounds proof rejects what it cannot prove."""
import pytest

from kiln.ir import AxisType, IRVerifyError, Ops, UOp, dtypes
from kiln.ir import kernels as K
from kiln.ir.verify import verify

F32, I32 = dtypes.float32, dtypes.int32


def buf(slot=0, dt=F32, n=16): return UOp.define_global(slot, dt.ptr(n))


def store(val, n=16, slot=0):
  i = UOp.range(n, 0)
  return UOp.sink(buf(slot, val.dtype, n).index(i).store(val))


def bad(ast, *patterns):
  with pytest.raises(IRVerifyError) as e: verify(ast)
  for p in patterns: assert p in str(e.value), f"{p!r} not in: {e.value}"
  return str(e.value)


def ld(slot=1, dt=F32, n=16, i=None): return buf(slot, dt, n).index(UOp.range(n, 0) if i is None else i).load()


def test_good_kernels_verify():
  verify(K.matmul(8, 8, 8))
  verify(K.softmax((4, 9), F32))
  verify(K.elementwise(lambda x, y: (x < y).where(x, y), F32, ((3, 1), F32), ((1, 5), F32)))
  verify(store(ld() * 2.0))


def test_alu_operand_dtypes():
  x, y = ld(1, F32), ld(2, dtypes.int32)
  bad(store(UOp(Ops.ADD, F32, (x, y))), "ADD (float32)", "one dtype", "float32, int32")


def test_comparison_produces_bool():
  x = ld()
  bad(store(UOp(Ops.CMPLT, F32, (x, x))), "CMPLT (float32)", "produces bool")


def test_where_condition_bool():
  x = ld()
  bad(store(UOp(Ops.WHERE, F32, (x, x, x))), "WHERE (float32)", "condition must be bool")


@pytest.mark.parametrize("op", [Ops.FDIV, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC])
def test_float_only_ops(op):
  x = ld(1, I32)
  src = (x, x) if op is Ops.FDIV else (x,)
  bad(store(UOp(op, I32, src)), f"{op.name} (int32)", "floats only")


@pytest.mark.parametrize("op", [Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR])
def test_int_only_ops(op):
  x = ld()
  bad(store(UOp(op, F32, (x, x))), f"{op.name} (float32)", "integers only")


@pytest.mark.parametrize("op", [Ops.AND, Ops.OR, Ops.XOR])
def test_bitwise_int_or_bool(op):
  x = ld()
  bad(store(UOp(op, F32, (x, x))), f"{op.name} (float32)", "integers or bools")
  b = ld(1, dtypes.bool)
  verify(store(UOp(op, dtypes.bool, (b, b))))


def test_neg_bool_and_arity():
  b = ld(1, dtypes.bool)
  bad(store(UOp(Ops.NEG, dtypes.bool, (b,))), "NEG (bool)")
  x = ld()
  bad(store(UOp(Ops.ADD, F32, (x,))), "ADD (float32)", "takes 2")


def test_index_rules():
  i = UOp.range(16, 0)
  g = buf(1)
  bad(UOp.sink(buf(0).index(i).store(UOp(Ops.INDEX, F32.ptr(16), (g, UOp.const(F32, 1.0))).load())), "INDEX", "scalar integer")
  bad(UOp.sink(buf(0).index(i).store(UOp(Ops.INDEX, F32.ptr(16), (g, i, i)).load())), "INDEX", "gate must be bool")
  bad(UOp.sink(buf(0).index(i).store(UOp(Ops.INDEX, F32.ptr(16), (g.index(i), i)).load())), "INDEX", "must index a DEFINE_GLOBAL")


def test_load_and_store_rules():
  i = UOp.range(16, 0)
  x = ld()
  bad(UOp.sink(UOp(Ops.STORE, dtypes.void, (buf(0).index(i), x.cast(I32)))), "STORE (void)", "int32 value into a float32 buffer")
  bad(UOp.sink(buf(0).index(i).store(UOp(Ops.LOAD, F32, (buf(1),)))), "LOAD (float32)", "one INDEX")
  bad(UOp.sink(buf(0, I32).index(i).store(UOp(Ops.LOAD, I32, (buf(1).index(i),)))), "LOAD (int32)", "float32*16")


def test_sink_and_structure():
  x = ld()
  bad(UOp.sink(x), "SINK", "STOREs only", "LOAD")
  bad(store(x).src[0], "STORE", "root must be a SINK")
  i = UOp.range(16, 0)
  st = buf(0).index(i).store(x)
  bad(UOp.sink(st, buf(2).index(i).store(UOp(Ops.ADD, F32, (x, st)))), "ADD (float32)", "STORE")


def test_reduce_sources_are_ranges():
  x = ld()
  bad(store(UOp(Ops.REDUCE, F32, (x, x), Ops.ADD)), "REDUCE (float32", "must be RANGEs")
  r = UOp.range(4, 1, AxisType.REDUCE)
  bad(store(UOp(Ops.REDUCE, F32, (x, r), Ops.SUB)), "REDUCE", "ADD, MUL or MAX")


def test_range_end_int_and_one_end_per_axis():
  bad(store(UOp(Ops.RANGE, I32, (UOp.const(F32, 4.0),), (1, AxisType.LOOP)).cast(F32)), "RANGE (int32", "integer end")
  r1, r2 = UOp.range(4, 1, AxisType.REDUCE), UOp.range(5, 1, AxisType.REDUCE)
  bad(store((ld() + r1.cast(F32) + r2.cast(F32)).reduce(Ops.ADD, r1, r2)), "RANGE (int32", "axis id 1")


def test_one_global_per_slot_and_one_bounds_per_variable():
  i = UOp.range(16, 0)
  bad(UOp.sink(buf(0).index(i).store(buf(1, F32).index(i).load() + buf(1, I32).index(i).load().cast(F32))), "DEFINE_GLOBAL", "slot 1")
  n1, n2 = UOp.variable("n", 1, 10), UOp.variable("n", 1, 20)
  bad(store((n1 + n2).cast(F32)), "DEFINE_VAR", "variable n")


def test_const_and_bind():
  bad(store(UOp(Ops.CONST, F32, (), 1)), "CONST (float32", "float")
  bad(store(UOp(Ops.CAST, F32, (UOp(Ops.CONST, dtypes.int8, (), 300),))), "CONST (int8", "300")
  v = UOp.variable("n", 1, 10)
  bad(store(UOp(Ops.BIND, I32, (v, UOp.const(I32, 11))).cast(F32)), "BIND", "variable n=11 is outside bounds [1, 10]")


def test_lowered_ops_are_rejected_unless_allowed():
  s = UOp.special("gidx0", 16)
  ast = UOp.sink(buf(0).index(s).store(UOp.const(F32, 1.0)))
  bad(ast, "SPECIAL", "after lowering")
  verify(ast, allow_lowered=True)
  i = UOp.range(16, 0)
  x = buf(1).index(i).load()
  fused = UOp(Ops.FMA, F32, (x, x, x))  # the lowering's fused multiply-add is not a user op either
  bad(UOp.sink(buf(0).index(i).store(fused)), "FMA", "after lowering")


# ---- the static bounds proof ----
def test_bounds_proof_rejects_possible_out_of_bounds():
  i = UOp.range(16, 0)
  msg = bad(UOp.sink(buf(0).index(i).store(buf(1, n=15).index(i).load())), "INDEX (float32*15)", "[0, 15]", "15 elements")
  assert "slot 1" in msg
  bad(UOp.sink(buf(0).index(i).store(buf(1).index(i - 1).load())), "INDEX", "[-1, 14]")
  n = UOp.variable("n", 1, 32)
  j = UOp.range(n, 0)
  bad(UOp.sink(buf(0, n=32).index(j).store(buf(1, n=16).index(j).load())), "INDEX (float32*16)", "[0, 31]")


def test_bounds_proof_accepts_proven_and_gated():
  i = UOp.range(16, 0)
  verify(UOp.sink(buf(0).index(i).store(buf(1, n=32).index(i * 2 + 1).load())))  # max 31 < 32
  verify(UOp.sink(buf(0).index(i).store(buf(1, n=8).index(i, i < 8).load())))  # gated
  verify(UOp.sink(buf(0).index(i).store(buf(1, n=8).index(i % 8).load())))  # mod proves it
  verify(UOp.sink(buf(0).index(i).store(buf(1, n=-1).index(i * 1000).load())))  # unknown size: nothing to prove
  n = UOp.variable("n", 1, 16)
  j = UOp.range(n, 0)
  verify(UOp.sink(buf(0).index(j).store(buf(1).index(j).load())))


def test_deep_graph_verifies_without_recursion():
  x = ld()
  v = x
  for _ in range(10_000): v = v * 1.5 + 1.0
  verify(store(v))
  # and the path in a message stays short
  w = x
  for _ in range(10_000): w = w + 1.0
  msg = bad(store(UOp(Ops.ADD, F32, (w, ld(2, I32).cast(dtypes.float64).cast(F32).cast(I32)))), "ADD")
  assert len(msg) < 400
