"""Reductions over 2**31 elements and more, compiled by LLVM and run on this machine (issue 41 item 2): before, the range's
end wrapped to -2**31 and a sum over 2**31 ones gave 0.0, a max -inf, at once. Each reads one element (a broadcast), so
no test allocates the elements it sums; the answers are exact (float64 sums of ones and integer sums are exact at these
sizes in any order, and a max of x + r is reached only by the last element). At the 32-bit boundary: a loop of 2**31 - 1
trips stays 32-bit and runs to its end, and a THREAD split whose chunk bounds pass int32 there runs 64-bit (before, its
chunk size folded to a wrapped constant and the sum ran over nothing). The conformance set widened to 64-bit index
arithmetic gives the 32-bit kernels' results bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.conformance import cases
from kiln.codegen.lowering.index_width import widen
from kiln.codegen.pipeline import lower
from kiln.codegen.registry import get_runtime
from kiln.ir import AxisType, Ops, UOp, dtypes

RT = get_runtime("CPU")


def reduction(n: int, op: Ops, dt, value) -> UOp:  # type: ignore[no-untyped-def]
  """out[0] = op over r < n of value(x[0], r), x one element."""
  o, x = UOp.define_global(0, dt.ptr(1)), UOp.define_global(1, dt.ptr(1))
  r = UOp.range(n, 0, AxisType.REDUCE)
  return UOp.sink(o.index(0).store(value(x.index(0).load(), r).reduce(op, r)), name="big_reduce")


def run(ast: UOp, x, opts: list[Opt] | None = None):  # type: ignore[no-untyped-def]
  spec = RT.renderer.render(ast) if opts is None else RT.renderer.render(ast, opts)
  out, xs = np.zeros(1, x.dtype), np.asarray(x)
  RT.load(RT.compiler.compile(spec))([out.ctypes.data, xs.ctypes.data], [], wait=True)
  return spec, out[0]


@pytest.mark.parametrize("n", [2**31, 2**31 + 3, 2**32 + 1])
def test_sum_of_ones(n):
  spec, got = run(reduction(n, Ops.ADD, dtypes.float64, lambda x, r: x), np.ones(1))
  assert got == n and "phi i64" in spec.src


@pytest.mark.parametrize("n", [2**31, 2**31 + 3])
def test_max_reaches_the_last_element(n):
  spec, got = run(reduction(n, Ops.MAX, dtypes.float64, lambda x, r: x + r.cast(dtypes.float64)), np.ones(1))
  assert got == n  # 1 + (n - 1)


@pytest.mark.parametrize("n", [2**31, 2**31 + 3])
def test_integer_sum_of_the_index(n):
  spec, got = run(reduction(n, Ops.ADD, dtypes.int64, lambda x, r: x * r.cast(dtypes.int64)), np.ones(1, np.int64))
  assert got == n * (n - 1) // 2


def test_the_last_32_bit_loop_runs_to_its_end():
  """2**31 - 1 trips, vectorised by 4 with a scalar tail of 3: 32-bit loops whose counters reach 2**31 - 2."""
  opts = [Opt(OptOps.UPCAST, 0, 4)]
  ast = reduction(2**31 - 1, Ops.MAX, dtypes.float64, lambda x, r: x + r.cast(dtypes.float64))
  assert lower(ast, RT.renderer.target, opts).index == dtypes.int32
  spec, got = run(ast, np.ones(1), opts)
  assert got == 2**31 - 1 and "phi i64" not in spec.src


def test_a_thread_split_past_int32_runs_wide():
  opts = [Opt(OptOps.THREAD, 0, 16)]
  ast = reduction(2**31 - 1, Ops.ADD, dtypes.float64, lambda x, r: x)
  assert lower(ast, RT.renderer.target, opts).index == dtypes.int64
  spec, got = run(ast, np.ones(1), opts)
  assert got == 2**31 - 1 and spec.threads == 16


def test_conformance_widened_is_bit_for_bit_the_same():
  """Every conformance case, scalar, with the heuristic's options and with its own, lowered 64-bit (widen: int64 ranges and index
  arithmetic) and 32-bit: the same options and the same output bits."""
  def go(ast: UOp, case, opts):  # type: ignore[no-untyped-def]
    spec = RT.renderer.render(ast) if opts is None else RT.renderer.render(ast, opts)
    bufs = case.fresh()
    RT.load(RT.compiler.compile(spec))([b.ctypes.data for b in bufs], [case.var_vals[v] for v in spec.var_names if v != "core_id"], wait=True)
    return spec, bufs
  runs = 0
  for case in cases():
    gpu_only = case.opts is not None and any(o.op in (OptOps.GROUP, OptOps.LOCAL) for o in case.opts)
    for opts in [None, [], *([case.opts] if case.opts is not None and not gpu_only else [])]:
      narrow, want = go(case.ast, case, opts)
      wide, got = go(widen(case.ast), case, opts)
      assert "phi i32" not in wide.src and wide.applied_opts == narrow.applied_opts, case.name
      assert all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)), case.name
      runs += 1
  assert runs >= 110  # 58 cases, each scalar and heuristic, some with their own options too
