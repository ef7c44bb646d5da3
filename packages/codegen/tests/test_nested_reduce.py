"""Row reduces under a vectorised output axis get an UPCAST of their own (issue 14): the heuristic's choice, the vector
accumulators in the generated LLVM IR, the scalar tail of a width that does not divide the row, and the option rules.
Results on a real CPU: packages/runtime-cpu/tests/test_nested_reduce.py."""
from __future__ import annotations

import re

import pytest

from kiln.codegen.choose import Opt, OptOps, Target, heuristic_opts
from kiln.codegen.lowering.prepare import prepare
from kiln.codegen.pipeline import lower
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import AxisType, Ops, UOp, dtypes, kernels
from kiln.ir.errors import CodegenError

AVX2, AVX512 = Target(vector_bytes=32), Target(vector_bytes=64)


def heur(ast: UOp, t: Target) -> list[Opt]: return heuristic_opts(prepare(ast)[0], t)


def loop_bodies(src: str) -> dict[str, str]:
  """Each loop's text from its header to its latch, by loop label."""
  return {m.group(1): m.group(0) for m in re.finditer(r"^loop(\d+):.*?^latch\1:", src, re.S | re.M)}


def matmul(n: int) -> UOp:
  c, a, b = (UOp.define_global(s, dtypes.float32.ptr(n * n)) for s in range(3))
  i, j, k = UOp.range(n, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE)
  return UOp.sink(c.index(i * n + j).store((a.index(i * n + k).load() * b.index(k * n + j).load()).reduce(Ops.ADD, k)))


# the output axis takes two vectors: its exp is an inline polynomial, latency-bound on one vector; so does the sum of exps
# (four chains of exp spilled AVX2's registers: 35 stack references in the kernel, 9 with two), which keeps its exps (KEEP)
# for the store; the max takes four; rows of at most 16 vectors are interleaved in pairs (opt._interleaved_rows)
@pytest.mark.parametrize("t, want", [
  (AVX2, [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.UPCAST, 2, 32), Opt(OptOps.UPCAST, 3, 16), Opt(OptOps.KEEP, 3, 1), Opt(OptOps.UNROLL, 0, 2)]),
  (AVX512, [Opt(OptOps.UPCAST, 1, 32), Opt(OptOps.UPCAST, 2, 64), Opt(OptOps.UPCAST, 3, 32), Opt(OptOps.KEEP, 3, 1), Opt(OptOps.UNROLL, 0, 2)])])
def test_heuristic_vectorises_softmax_row_reduces(t: Target, want: list[Opt]):
  assert heur(kernels.softmax((64, 128), dtypes.float32), t) == want


def test_heuristic_width_keeps_the_tail_under_one_vector():
  # 100 = 3 x 32 + 4; 127 = 15 x 8 + 7 (not 3 x 32 + 31); a row shorter than a vector keeps its scalar loop
  assert heur(kernels.softmax((64, 100), dtypes.float32), AVX2)[1:3] == [Opt(OptOps.UPCAST, 2, 32), Opt(OptOps.UPCAST, 3, 16)]
  assert heur(kernels.softmax((64, 127), dtypes.float32), AVX2)[1:3] == [Opt(OptOps.UPCAST, 2, 8), Opt(OptOps.UPCAST, 3, 8)]
  assert all(o.axis == 1 for o in heur(kernels.softmax((64, 6), dtypes.float32), AVX2) if o.op not in (OptOps.KEEP, OptOps.UNROLL))


def test_heuristic_leaves_other_kernels_alone():
  # a matmul's reduce varies along the vectorised columns: its accumulators are vectors of those already
  assert not any(o.op is OptOps.UPCAST and o.axis == 2 for o in heur(matmul(64), AVX2))
  # a full reduction keeps its four vectors; a row sum over a non-contiguous axis gets no UPCAST of its reduce
  assert heur(kernels.reduce_sum((1 << 16,), dtypes.float32), AVX2) == [Opt(OptOps.UPCAST, 0, 32)]
  assert not any(o.axis == 2 for o in heur(kernels.softmax((64, 128), dtypes.float32, axis=0), AVX2))


def test_ir_accumulates_vectors_in_the_row_loop():
  src = LLVMRenderer(AVX2).render(kernels.softmax((64, 128), dtypes.float32)).src
  bodies = [b for b in loop_bodies(src).values() if "phi" in b]
  # the max: 128 / 32 = 4 trips, one <32 x float> (four AVX2 registers) per trip, on its bits (max_bits: a signed and two
  # unsigned maxima); the sum of exps: 8 trips of two registers
  assert any("icmp slt i32 %r" in b and ", 4\n" in b and "@llvm.smax.v32i32" in b and "@llvm.umax.v32i32" in b for b in bodies), src
  assert any("icmp slt i32 %r" in b and ", 8\n" in b and "fadd <16 x float>" in b for b in bodies), src
  assert "alloca <32 x i32>" in src and "@llvm.maximum.v32f32" not in src
  # no scalar loop over the row's elements is left
  assert not re.search(r"icmp slt i32 %r\d+, 128\n", src)


def test_ir_folds_in_a_tree_and_finishes_the_tail():
  src = LLVMRenderer(AVX2).render(kernels.softmax((64, 100), dtypes.float32)).src
  for w in (16, 8, 4, 2): assert f"fadd <{w} x float>" in src and f"@llvm.smax.v{w}i32(" in src and f"@llvm.umax.v{w}i32(" in src
  # 100 = 3 x 32 + 4 for the max, 6 x 16 + 4 for the sum of exps: vector loops of 3 and 6 trips, scalar ones of 4
  # continuing from the fold
  trips = re.findall(r"icmp slt i32 %r\d+, (\d+)", src)
  assert trips.count("3") == 1 and "6" in trips and trips.count("4") == 2, trips


def test_explicit_options():
  sm = kernels.softmax((8, 40), dtypes.float32)
  lower(sm, AVX2, [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 2, 16), Opt(OptOps.UPCAST, 3, 8)])  # 40 = 2 x 16 + 8: a tail of a vector
  lower(sm, AVX2, [Opt(OptOps.UPCAST, 2, 8)])  # a reduce UPCAST alone, as before
  mm = matmul(16)
  with pytest.raises(CodegenError, match="only one axis can be vectorised"): lower(mm, AVX2, [Opt(OptOps.UPCAST, 0, 2), Opt(OptOps.UPCAST, 1, 2)])
  with pytest.raises(CodegenError, match="varies along the vectorised axis 1"): lower(mm, AVX2, [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 2, 8)])
  with pytest.raises(CodegenError, match="must divide"): lower(sm, AVX2, [Opt(OptOps.UNROLL, 2, 16)])  # only an UPCAST may leave a tail
  full = kernels.reduce_sum((1 << 20,), dtypes.float32)
  with pytest.raises(CodegenError, match="THREAD on a reduce axis needs its UPCAST to divide"):
    lower(full, Target(vector_bytes=32, threads=2), [Opt(OptOps.UPCAST, 0, 24), Opt(OptOps.THREAD, 0, 2)])


def test_a_tail_cannot_repeat_a_reduce_over_its_axis():
  x, out = UOp.define_global(1, dtypes.float32.ptr(40 * 8)), UOp.define_global(0, dtypes.float32.ptr(1))
  k, m = UOp.range(40, 0, AxisType.REDUCE), UOp.range(8, 1, AxisType.REDUCE)
  inner = x.index(k * 8 + m).load().reduce(Ops.ADD, m)  # varies with k
  ast = UOp.sink(out.index(0).store(inner.reduce(Ops.MAX, k)))
  lower(ast, AVX2, [Opt(OptOps.UPCAST, 0, 8)])  # divides: no tail
  with pytest.raises(CodegenError, match="tail cannot repeat"): lower(ast, AVX2, [Opt(OptOps.UPCAST, 0, 16)])
