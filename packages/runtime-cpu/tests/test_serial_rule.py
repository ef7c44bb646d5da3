"""A kernel split over a symbolic axis runs on the calling thread alone where its work at the bound values is under one
thread's least share (codegen's split_rule, serial_rule.py): the compiled spec carries the rule, the bound call's
`serial` follows set_vals and a plan's vals_writer, a sequence step's word of calls follows it, and results are the same
bits either way. The rule's expression is walked, never executed as code: an operator outside sizes' arithmetic gives no
rule."""
from __future__ import annotations

import numpy as np
import pytest

import kiln.codegen.choose.heuristic as H
import kiln.runtime.cpu.bound as bound_mod
import kiln.runtime.cpu.sequence as sequence_mod
from kiln.codegen.choose import Target
from kiln.codegen.choose.heuristic import SYMBOLIC_GUESS
from kiln.codegen.registry import get_runtime
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.codegen.spec import CompiledSpec
from kiln.ir import UOp, dtypes, kernels
from kiln.runtime.cpu.native_pool import NativePool, native_pool_supported
from kiln.runtime.cpu.sequence import CPUSequence, sequence_calls, step_word
from kiln.runtime.cpu.serial_rule import SerialRule

RT = get_runtime("CPU")
F32 = dtypes.float32
C = 1024
TARGET = Target(vector_bytes=RT.target.vector_bytes, threads=2, cores=2)


def _scaled(rows: UOp | int) -> UOp:
  return kernels.elementwise(lambda a, b: a * b + 1.0, F32, ((rows, C), F32), ((rows, C), F32), name="scaled")


@pytest.fixture(scope="module")
def product():
  """a * b + 1 over (n, C) with n symbolic, split for a 2-thread target (its rows taken at SYMBOLIC_GUESS)."""
  return RT.load(RT.compiler.compile(LLVMRenderer(TARGET).render(_scaled(UOp.variable("n", 1, 4096)))))


@pytest.fixture(scope="module")
def pool():
  p = NativePool(2, spin=50)
  yield p
  p.close()


def _least_serial_rows(prog) -> int:
  """The fewest rows that split, by evaluating the work row count by row count."""
  rule = SerialRule.of(prog.spec.work, prog.spec.split_min, prog.user_vars)
  assert rule is not None
  return next(m for m in range(1, SYMBOLIC_GUESS) if rule._eval((m,)) >= rule.split_min)


def test_the_spec_carries_the_rule_and_it_survives_json(product) -> None:
  spec = product.spec
  assert product.threads > 1 and isinstance(spec.work, UOp) and spec.split_min > 0
  again = CompiledSpec.model_validate_json(spec.model_dump_json())
  assert isinstance(again.work, UOp) and again.split_min == spec.split_min
  rule = SerialRule.of(again.work, again.split_min, product.user_vars)
  assert rule is not None and rule.serial([1]) and not rule.serial([4096])
  assert rule._eval((2,)) == 2 * rule._eval((1,)) == 2 * C  # one element-op an output
  assert rule.below == _least_serial_rows(product)  # the bisection's edge is where the work reaches the threshold


def test_fixed_work_has_no_rule() -> None:
  spec = LLVMRenderer(TARGET).render(_scaled(4096))
  assert spec.threads > 1 and spec.work is None and spec.split_min == 0


def test_a_tiled_product_is_judged_at_the_tile_rate_only_where_its_panels_are_reused() -> None:
  lanes = max(1, TARGET.vector_bytes // 4)
  tile_rate, streaming = H._split_work(TARGET, lanes, True, True), H._split_work(TARGET, lanes, False, True)
  rows = LLVMRenderer(TARGET).render(kernels.matmul(UOp.variable("n", 1, 4096), 256, 256))  # a prompt's tokens
  assert "OUTER" in " ".join(rows.applied_opts) and isinstance(rows.work, UOp) and rows.split_min == tile_rate
  # a decode step's attention context: 3 query rows, all in one tile, over the cached positions
  few = LLVMRenderer(TARGET).render(kernels.matmul(3, 256, UOp.variable("p", 1, 4096)))
  assert "OUTER" in " ".join(few.applied_opts) and few.threads > 1, few.applied_opts
  assert isinstance(few.work, UOp) and few.split_min == streaming < tile_rate


def test_an_expression_outside_sizes_arithmetic_gives_no_rule() -> None:
  n = UOp.variable("n", 1, 100)
  assert SerialRule.of(n.cast(dtypes.int64) * 3, 10, ["n"]) is not None
  assert SerialRule.of((n < 5).where(n, n * 2).cast(dtypes.int64), 10, ["n"]) is None  # WHERE: not a size's arithmetic
  assert SerialRule.of(UOp.variable("m", 1, 9).cast(dtypes.int64), 10, ["n"]) is None  # a variable the kernel does not take
  assert SerialRule.of(None, 10, ["n"]) is None and SerialRule.of(n.cast(dtypes.int64), 0, ["n"]) is None
  # work of two variables is evaluated at each new pair of values; a size divided by a variable at 0 keeps the split
  m = UOp.variable("m", 0, 100)
  rule = SerialRule.of(UOp.const(dtypes.int64, 100) // m.cast(dtypes.int64) + n.cast(dtypes.int64), 10, ["n", "m"])
  assert rule is not None and rule.at == -1
  assert rule.serial([1, 0]) is False and rule.serial([1, 50]) is True and rule.serial([9, 50]) is False


@pytest.mark.skipif(not native_pool_supported(), reason="sequences run on the native pool: Linux on x86-64 or AArch64")
def test_serial_follows_the_values_in_calls_and_sequence_steps(product, pool, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(bound_mod, "get_pool", lambda: pool)
  monkeypatch.setattr(sequence_mod, "get_pool", lambda: pool)
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((4096, C)).astype(np.float32), rng.standard_normal((4096, C)).astype(np.float32)
  out, out2 = np.zeros((4096, C), np.float32), np.zeros((4096, C), np.float32)
  edge = _least_serial_rows(product)
  a = product.bind([out.ctypes.data, x.ctypes.data, w.ctypes.data], [1])
  b = product.bind([out2.ctypes.data, x.ctypes.data, w.ctypes.data], [1])
  assert a.workers == 2 and a.serial
  seq = sequence_calls([a, b])
  assert isinstance(seq, CPUSequence) and a.rows and int(seq.steps[0][3]) & 0xFFFFFFFF == 1
  for rows in (edge, edge - 1, 4096, 3):
    a.set_vals([rows])
    write = bound_mod.CPUBoundCall.vals_writer([(b, 0)])
    assert write is not None
    write(rows)
    assert a.serial == b.serial == (rows < edge)
    assert [int(r[3]) for r in seq.steps] == [step_word(a), step_word(b)] and (int(seq.steps[0][3]) & 0xFFFFFFFF) == (1 if rows < edge else 2)
    out[:], out2[:] = 0, 0
    seq()
    np.testing.assert_allclose(out[:rows], x[:rows] * w[:rows] + 1.0, rtol=1e-6)
    assert out2[:rows].tobytes() == out[:rows].tobytes() and not out[rows:].any()
    a()  # the Python path: the same bits alone or split
    assert out2[:rows].tobytes() == out[:rows].tobytes()
