"""UOp: hash-consing (also across threads), cross-process key, no recursion on deep graphs, construction-time folding."""
import gc
import math
import pickle
import subprocess
import sys
import threading

import pytest

from kiln.ir import IRError, IRTypeError, Ops, UOp, dtypes
from kiln.ir.analysis import sym_int_eval
from kiln.ir.symbolic import simplify

BUILD = """
from kiln.ir import UOp, Ops, AxisType, dtypes
c = UOp.define_global(0, dtypes.float32.ptr(64 * 64))
a = UOp.define_global(1, dtypes.float32.ptr(64 * 64))
i, k = UOp.range(64, 0), UOp.range(64, 1, AxisType.REDUCE)
n = UOp.variable("n", 1, 64)
acc = (a.index(i * 64 + k).load() * 0.5 + float("nan")).reduce(Ops.ADD, k)
root = UOp.sink(c.index((i * 64 + n - 1) % 4096).store(acc.maximum(-0.0)), name="t")
"""


def _build():
  ns: dict = {}
  exec(BUILD, ns)
  return ns["root"]


def test_equal_nodes_are_the_same_object():
  a, b = _build(), _build()
  assert a is b and a.key == b.key
  v = UOp.variable("x", 0, 9)
  assert v + 1 is v + 1 and (v * 3).maximum(2) is (v * 3).maximum(2)
  assert UOp.const(dtypes.float32, math.nan) is UOp.const(dtypes.float32, float("nan"))  # NaN interns
  assert UOp.const(dtypes.float32, 0.0) is not UOp.const(dtypes.float32, -0.0)
  assert UOp.const(dtypes.int32, 1) is not UOp.const(dtypes.bool, True)
  assert v + 1 is not v + 2 and UOp.variable("x", 0, 8) is not v


def test_nodes_are_immutable_and_pickle_to_themselves():
  v = UOp.variable("x", 0, 9) * 2
  with pytest.raises(AttributeError, match="immutable"): v.arg = 3
  assert pickle.loads(pickle.dumps(v)) is v


def test_hash_consing_from_8_threads():
  n, barrier = 8, threading.Barrier(8)
  out: list = [None] * n
  errors: list = []
  def work(t: int) -> None:
    try:
      barrier.wait()  # all threads build the same never-seen nodes at the same moment
      v = UOp.variable("thread_hc_var", 0, 1000)
      nodes = []
      x = v
      for j in range(300):
        x = (x * 3 + j) % 1001
        nodes.append(x)
      out[t] = nodes
    except Exception as e: errors.append(e)
  threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
  for th in threads: th.start()
  for th in threads: th.join()
  assert not errors
  for t in range(1, n): assert all(a is b for a, b in zip(out[0], out[t])), f"thread {t} built different objects"
  assert len({id(x) for nodes in out for x in nodes}) == 300


def test_key_is_the_same_in_another_process():
  here = _build().key
  code = BUILD + "print(root.key)"
  there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
  assert there == here and len(here) == 64
  assert UOp.variable("n", 1, 64).key != UOp.variable("n", 1, 63).key


def test_100k_chain_toposorts_hashes_and_simplifies():
  v = UOp.variable("v", 0, 10)
  u = v
  for k in range(50_000): u = (u * v + 1) if k % 2 else u.maximum(v) + 1  # 100k ALU nodes, nothing folds away
  topo = u.toposort()
  assert len(topo) >= 100_000 and topo[-1] is u and topo.index(v) < topo.index(u)
  assert len(u.key) == 64
  s = simplify(u)
  val = sym_int_eval(u, {"v": 2})
  assert u.vmin <= val <= u.vmax and sym_int_eval(s, {"v": 2}) == val
  del u, s, topo
  gc.collect()  # freeing a deep chain must not overflow the C stack either


def test_long_collapsing_chain_simplifies():
  v = UOp.variable("v", -5, 5)
  u = v
  for k in range(3_000): u = u + (k % 7) - 3 if k % 3 else u + v
  s = simplify(u)
  assert len(s.toposort()) <= 5
  for x in (-5, 0, 5): assert sym_int_eval(s, {"v": x}) == sym_int_eval(u, {"v": x})


def test_construction_folding():
  v = UOp.variable("x", -4, 4)
  i8 = lambda x: UOp.const(dtypes.int8, x)
  assert (i8(100) + i8(100)).arg == -56  # wraps like C
  assert (UOp.const(dtypes.int32, -7) // 2).arg == -3 and (UOp.const(dtypes.int32, -7) % 2).arg == -1  # truncating
  assert (UOp.const(dtypes.int32, 7) // 0).arg == 7 and (UOp.const(dtypes.int32, -2**31) // -1).arg == -2**31
  assert v + 0 is v and v * 1 is v and (v * 0).arg == 0 and v // 1 is v and (v % 1).arg == 0 and (v - v).arg == 0
  assert (v < v).arg is False and v.eq(v).arg is True and v.maximum(v) is v
  f = v.cast(dtypes.float32)
  assert (f + 0.0).op is Ops.ADD  # -0.0 + 0.0 is 0.0: not an identity for floats
  assert f.ne(f).op is Ops.CMPNE and f.eq(f).op is Ops.CMPEQ  # NaN != NaN: must not fold
  assert (f * 1.0) is f
  c = v < 2
  assert UOp.const(dtypes.bool, True).where(v, v + 1) is v and c.where(v, v) is v
  assert (UOp.const(dtypes.float32, 1.5).cast(dtypes.int32)).arg == 1 and UOp.const(dtypes.float32, 1e10).cast(dtypes.int32).arg == 2**31 - 1
  assert c.where(1, 2.5).dtype == dtypes.float32


def test_constants_are_the_same_node_each_time_and_keep_their_exact_value():
  """UOp.const keeps the integer-valued constants it builds (uop._INT_CONSTS): asked again, the same node, and the same
  value as a first build: wrapped into the dtype, rounded into a float dtype, -0.0 apart from 0.0, True apart from 1."""
  for _ in range(2):
    assert UOp.const(dtypes.int8, 300).arg == 44 and UOp.const(dtypes.uint8, -1).arg == 255
    assert UOp.const(dtypes.int32, 5) is UOp.const(dtypes.int32, 5) and UOp.const(dtypes.int32, 5) is not UOp.const(dtypes.int64, 5)
    assert UOp.const(dtypes.float32, 0).arg == 0.0 and math.copysign(1, UOp.const(dtypes.float32, -0.0).arg) == -1
    assert UOp.const(dtypes.float16, 2049).arg == 2048.0 and UOp.const(dtypes.bool, 1).arg is True
    assert UOp.const(dtypes.int32.vec(4), 3).src == (UOp.const(dtypes.int32, 3),) * 4
  with pytest.raises(IRTypeError): UOp.const(dtypes.float32.ptr(4), 0)


def test_builders_and_errors():
  v = UOp.variable("n", 1, 10)
  assert (v.vmin, v.vmax) == (1, 10) and (v.bind(3).vmin, v.bind(3).vmax) == (1, 10)
  r = UOp.range(v, 0)
  assert (r.vmin, r.vmax) == (0, 9) and r.dtype == dtypes.index
  with pytest.raises(IRError, match="outside bounds"): v.bind(11)
  with pytest.raises(IRError, match="min <= max"): UOp.variable("m", 3, 2)
  with pytest.raises(IRTypeError, match="true division"): _ = v / 2
  with pytest.raises(IRTypeError, match="one dtype"): v.alu(Ops.ADD, v.cast(dtypes.int64))
  with pytest.raises(IRError, match="truth value"): bool(v < 3)
  b = UOp.define_global(0, dtypes.float32.ptr(16))
  with pytest.raises(IRTypeError, match="cast it first"): b.index(0).store(v)
  assert (v > 3).src == ((UOp.const(dtypes.int32, 3)), v) and (v >= 3).op is Ops.XOR
  assert (1 - v).src[0].arg == 1  # reflected operators keep the operand order
