"""Index arithmetic past int32 is never a silent wrap: index arithmetic the AST asks to compute in 32 bits that may pass
int32 is a CodegenError naming the kernel."""
from __future__ import annotations

import pytest

from kiln.codegen.index_width import may_wrap, wrap_risk
from kiln.codegen.lower import lower
from kiln.codegen.opt import Target
from kiln.ir import AxisType, CodegenError, Ops, UOp, dtypes

F32, I32, I64 = dtypes.float32, dtypes.int32, dtypes.int64
CPU = Target(device="CPU", vector_bytes=32, threads=1)


def test_a_range_end_that_may_wrap_in_int32_is_an_error():
  """v * v over v <= 2**20 passes int32: the loop's trip count would wrap (a negative end runs nothing)."""
  v = UOp.variable("v", 1, 1 << 20)
  o, x = UOp.define_global(0, F32.ptr(1)), UOp.define_global(1, F32.ptr(1))
  r = UOp.range(v * v, 0, AxisType.REDUCE)
  ast = UOp.sink(o.index(0).store(x.index(0).load().reduce(Ops.ADD, r)), name="square_sum")
  with pytest.raises(CodegenError, match=r"kernel square_sum: index arithmetic MUL \(int32\) of operands over \[1, 1048576\]"):
    lower(ast, CPU)


def test_may_wrap_by_op():
  n = UOp.variable("n", 0, 1 << 20)
  assert may_wrap(n * 4096) and not may_wrap(n * 2047) and not may_wrap(n.cast(I64) * 4096)
  assert not may_wrap(n + (2**31 - 1 - (1 << 20))) and may_wrap(n + (2**31 - (1 << 20))) and may_wrap(-UOp.variable("m", -2**31, 0))
  assert may_wrap(n.cast(I64).cast(I32)) is False and may_wrap((n.cast(I64) * 4096).cast(I32))
  assert may_wrap(n << 12) and not may_wrap(n << 10)
  assert may_wrap(UOp.variable("m", -2**31, 0) // UOp.variable("d", -1, 1)) and not may_wrap(n // UOp.variable("d", -1, 1))


def test_wrap_risk_ignores_indices_computed_from_data():
  """A gather's index comes from a load: the front end bounds it (a clamp), as kiln.graph does; only arithmetic of
  ranges, variables and constants is checked."""
  t = UOp.define_global(1, I32.ptr(4))
  iv = t.index(UOp.range(4, 0)).load()
  assert wrap_risk([UOp(Ops.INDEX, F32.ptr(8), (UOp.define_global(0, F32.ptr(8)), (iv + 100).maximum(0).minimum(7)))]) is None
  big = UOp.range(4, 0) * (1 << 30)
  assert wrap_risk([UOp(Ops.INDEX, F32.ptr(8), (UOp.define_global(0, F32.ptr(8)), big))]) is big
