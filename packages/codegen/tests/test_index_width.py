"""Index arithmetic past int32 (issue 41 item 2): a kernel whose bounds need it gets 64-bit loops, lanes and offsets on the
CPU and in CUDA C, decided from the bounds at each boundary (the AST's: a range of 2**31; lowering's: a THREAD split's chunk
bounds), while every other kernel keeps 32-bit index arithmetic; widen() keeps every value; and index arithmetic the AST
asks to compute in 32 bits that may pass int32 is a CodegenError naming the kernel, never a silent wrap."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.conformance import cases, evaluate, mismatches
from kiln.codegen.lowering.index_width import may_wrap, widen, wrap_risk
from kiln.codegen.pipeline import lower
from kiln.codegen.render.cuda import CUDARenderer
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import AxisType, CodegenError, Ops, UOp, dtypes, kernels
from kiln.ir.verify import verify

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


# ---- 64-bit index arithmetic where the bounds need it, 32-bit everywhere else ----
def broadcast_sum(n: int, dt=dtypes.float64) -> UOp:
  """out[0] = sum over r < n of (x[0] + r): a reduction over n elements that reads one element (no n-element buffer)."""
  o, x = UOp.define_global(0, dt.ptr(1)), UOp.define_global(1, dt.ptr(1))
  r = UOp.range(n, 0, AxisType.REDUCE)
  return UOp.sink(o.index(0).store((x.index(0).load() + r.cast(dt)).reduce(Ops.ADD, r)), name="wide_sum")


def ranges(lk) -> list:
  return [u for u in lk.uops if u.op is Ops.RANGE]


@pytest.mark.parametrize("n,wide", [(2**31 - 1, False), (2**31, True)])
def test_the_ast_boundary(n, wide):
  """A range of 2**31 - 1 trips is int32 and so is its loop; 2**31 is int64, its loop, its lanes and its offsets too."""
  lk = lower(broadcast_sum(n), CPU, [Opt(OptOps.UPCAST, 0, 4)])
  assert lk.index == (I64 if wide else I32) and {r.dtype for r in ranges(lk)} == {lk.index}
  src = LLVMRenderer(CPU).render(broadcast_sum(n), [Opt(OptOps.UPCAST, 0, 4)]).src
  loop = "phi i64" if wide else "phi i32"
  assert loop in src and ("phi i32" if wide else "phi i64") not in src
  assert ("add nsw i64 %r0, 1" in src) == wide and ("<4 x i64>" in src) == wide  # the loop counter, the lanes' index vector


def test_a_hand_built_kernel_of_2_31_plus_3_elements():
  """The kernel-level case: a range of 2**31 + 3 over real buffers (a strided read, a stored index), split over threads
  and vectorised by the heuristic: every loop, lane and offset is 64-bit on the CPU and in CUDA C; a stored int32 copy of
  the index keeps its dtype (a cast of the 64-bit one)."""
  n = 2**31 + 3
  o, x, ix = UOp.define_global(0, F32.ptr(n)), UOp.define_global(1, F32.ptr(2 * n)), UOp.define_global(2, I32.ptr(n))
  r = UOp.range(n, 0)
  assert r.dtype == I64
  ast = UOp.sink(o.index(r).store(x.index(r * 2).load() * 2.0), ix.index(r).store(r.cast(I32)), name="wide_copy")
  cpu, opts = Target(device="CPU", vector_bytes=32, threads=2, cores=2), [Opt(OptOps.UPCAST, 0, 8), Opt(OptOps.THREAD, 0, 16)]
  lk = lower(ast, cpu, opts)
  assert lk.index == I64 and lk.threads == 16 and {r.dtype for r in ranges(lk)} == {I64}
  idx = [u.src[1] for u in lk.uops if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL and u.src[0].arg >= 0]
  assert idx and {i.dtype for i in idx} == {I64} and max(int(i.vmax) for i in idx) >= 2 * (n - 1)
  src = LLVMRenderer(cpu).render(ast, opts).src
  assert "phi i64" in src and "phi i32" not in src and "ptr %data1, i64" in src
  assert "sext i32 %core_id to i64" in src  # the chunk index arrives as an i32
  assert "trunc <8 x i64>" in src  # the stored int32 index: the 64-bit lanes cast back
  cu = CUDARenderer().render(ast, [Opt(OptOps.LOCAL, 0, 256)]).src
  assert "long long gidx0 = blockIdx.x; /* 8388609 */" in cu and "long long lidx0" in cu and "(int)" in cu  # the stored index cast back
  cu = CUDARenderer().render(ast).src  # no LOCAL: 2**31 + 3 blocks are more than a grid has, so the axis is a loop
  assert "for (long long ridx0 = 0LL; ridx0 < 2147483651LL; ridx0++)" in cu


@pytest.mark.parametrize("n,wide", [(2**31 - 16, False), (2**31 - 1, True)])
def test_the_thread_split_boundary(n, wide):
  """A THREAD split's chunk bounds reach threads * ceil(n / threads): at 2**31 - 1 over 16 chunks that is 2**31, so the
  kernel is lowered again 64-bit, though its AST is int32. Before, the chunk size folded to the wrapped constant
  -134217727 and the sum ran over nothing."""
  ast = broadcast_sum(n)
  assert ast.src[0].src[1].src[1].dtype == I32
  lk = lower(ast, CPU, [Opt(OptOps.THREAD, 0, 16)])
  assert lk.index == (I64 if wide else I32)


def test_small_kernels_keep_32_bit_index_arithmetic():
  """What nearly every kernel is: no 64-bit loop, lane or offset (their IR is the same as before the 64-bit path)."""
  for ast in (kernels.matmul(64, 48, 80), kernels.softmax((33, 100), F32), kernels.reduce_sum((1000, 1000), F32, axes=1)):
    lk = lower(ast, CPU)
    assert lk.index == I32 and all(u.dtype != I64 for u in lk.uops if u.dtype.is_int), ast.arg
    assert "phi i64" not in LLVMRenderer(CPU).render(ast).src and not re.search(r"long long (ridx|gidx|lidx)", CUDARenderer().render(ast).src)


def test_widen_keeps_every_value():
  """widen() changes dtypes, not values: the reference evaluator gives every conformance case's outputs bit for bit."""
  for case in cases():
    w = widen(case.ast)
    verify(w)
    assert {u.dtype for u in w.toposort() if u.op is Ops.RANGE} <= {I64}
    assert all(u.src[1].dtype == I64 for u in w.toposort() if u.op is Ops.INDEX)
    got = case.fresh()
    evaluate(w, got, case.var_vals)
    assert not mismatches(case, got), case.name


def test_widen_keeps_a_wrap_the_ast_asks_for():
  """Stored values keep their dtype's wraparound: r * 2**30 // 3 in int32 wraps for r >= 2, and still does once the index
  arithmetic around it is 64-bit (only ops that cannot wrap are rebuilt wide)."""
  o = UOp.define_global(0, I32.ptr(8))
  r = UOp.range(8, 0)
  ast = UOp.sink(o.index(r).store((r * (1 << 30)) // 3), name="wraps")
  want = [0] * 8
  evaluate(ast, bufs := [np.zeros(8, np.int32)], {})
  want = bufs[0].tolist()
  assert want[2] == ((2 << 30) - (1 << 32)) // 3 + 1  # the wrapped value, truncated toward zero
  evaluate(widen(ast), bufs := [np.zeros(8, np.int32)], {})
  assert bufs[0].tolist() == want


def test_peeled_tiles_past_int32():
  """An output axis of 2**31 - 1 elements whose UPCAST of 8 does not divide it becomes whole tiles, the last shifted back:
  the tiles' range runs to 2**31, so the kernel is lowered 64-bit (before, that range was the int32 -2**31 and the
  kernel stored nothing); the shifted index stays within the axis."""
  n = 2**31 - 1
  o, x = UOp.define_global(0, F32.ptr(n)), UOp.define_global(1, F32.ptr(1))
  ast = UOp.sink(o.index(UOp.range(n, 0)).store(x.index(0).load() * 2.0), name="fill")
  lk = lower(ast, CPU, [Opt(OptOps.UPCAST, 0, 8)])
  assert lk.index == I64 and [int(r.src[1].vmax) for r in ranges(lk)] == [2**28]
  assert lower(ast, CPU, []).index == I32  # unpeeled, it fits
