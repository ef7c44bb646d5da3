"""Ops.DOT4 on the CPU: each way the LLVM renderer prints it (vpdpbusd on 64- or 32-byte vectors where the target has a
byte dot product; widened products and pairwise adds where it has none; scalars) runs on this machine exactly as the
reference evaluator computes it, and a reduction of DOT4s accumulates in the instruction itself."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kiln.codegen.choose import Target
from kiln.codegen.registry import get_runtime
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import kernels, reference

RT = get_runtime("CPU")
HOST_DOT = RT.target.dot_bytes
M, N, K = 6, 52, 37  # 52 columns: a vector part and a scalar tail


def _run(target: Target, opts: list | None = None) -> tuple[str, bool]:
  ast = kernels.matmul_dot4(M, N, K)
  spec = LLVMRenderer(target).render(ast, opts=opts)
  rng = np.random.default_rng(3)
  words = lambda n: rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
  bufs = [np.full(M * N, 7, np.int32), words(M * K), words(K * N)]
  want = [b.copy() for b in bufs]
  reference.evaluate(ast, want, {})
  RT.load(RT.compiler.compile(spec))([b.ctypes.data for b in bufs])
  return spec.src, bool(np.array_equal(bufs[0], want[0]))


@pytest.mark.parametrize("vector_bytes,dot_bytes", [(64, 64), (64, 32), (32, 32), (64, 0), (32, 0), (16, 0)])
def test_each_rendering_matches_the_reference(vector_bytes: int, dot_bytes: int) -> None:
  if dot_bytes > HOST_DOT or vector_bytes > RT.target.vector_bytes:
    pytest.skip(f"this CPU has no {dot_bytes}-byte dot product or {vector_bytes}-byte vectors")
  src, same = _run(Target(vector_bytes=vector_bytes, dot_bytes=dot_bytes))
  assert same
  calls = re.findall(r"call <(\d+) x i32> @llvm\.x86\.avx512\.vpdpbusd\.\d+\((<\d+ x i32> [^,]+)", src)
  if dot_bytes:
    assert calls and all(int(n) * 4 <= dot_bytes for n, _ in calls)
    assert not any("i32 0," in acc or "zeroinitializer" in acc for _, acc in calls), "the accumulator is the instruction's own operand"
  else:
    assert not calls and "mul nsw <" in src  # the widened products


def test_scalar_program_matches_the_reference() -> None:
  src, same = _run(Target(vector_bytes=64, dot_bytes=HOST_DOT), opts=[])
  assert same and "vpdpbusd" not in src


def test_a_chain_of_dot4s_accumulates_through_the_chain() -> None:
  """sum_k DOT4(a, b, DOT4(c, d, 0)) (a 4-bit word's low and high nibbles against two words of the row): the accumulator
  goes in at the chain's end, so every term is one vpdpbusd and none starts from zero."""
  from kiln.ir import AxisType, Ops, UOp, dtypes
  from kiln.ir.kernels import buffer, flat_index
  i32, m, n, k = dtypes.int32, 3, 32, 9
  i, j, kk = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  ld = lambda slot, idx, shape: buffer(slot, i32, shape).index(flat_index(idx, shape)).load()
  a, c = ld(1, [i, kk], (m, k)), ld(3, [i, kk], (m, k))
  b, d = ld(2, [kk, j], (k, n)), ld(4, [kk, j], (k, n))
  v = UOp(Ops.DOT4, i32, (a, b, UOp(Ops.DOT4, i32, (c, d, UOp.const(i32, 0))))).reduce(Ops.ADD, kk)
  ast = UOp.sink(buffer(0, i32, (m, n)).index(flat_index([i, j], (m, n))).store(v), name="dot4_chain")
  rng = np.random.default_rng(5)
  words = lambda size: rng.integers(-(2**31), 2**31, size, dtype=np.int64).astype(np.int32)
  bufs = [np.zeros(m * n, np.int32), words(m * k), words(k * n), words(m * k), words(k * n)]
  want = [x.copy() for x in bufs]
  reference.evaluate(ast, want, {})
  spec = LLVMRenderer(Target(vector_bytes=RT.target.vector_bytes, dot_bytes=HOST_DOT)).render(ast)
  RT.load(RT.compiler.compile(spec))([x.ctypes.data for x in bufs])
  np.testing.assert_array_equal(bufs[0], want[0])
  if HOST_DOT: assert "vpdpbusd" in spec.src and not re.search(r"vpdpbusd\.\d+\(<\d+ x i32> (<i32 0,|zeroinitializer)", spec.src)
