"""CUDA C with 64-bit index arithmetic (issue 41 item 2), under the CPU emulation harness and nvcc: a full reduction over
2**31 + 3 elements of a broadcast value (GROUP and BLOCKS: each thread's strided loop and the grid's indices are long long)
gives the exact answer, where the int32 range's end had wrapped to a loop that never ran; and conformance cases that use
every GPU option, widened to int64 (index_width.widen), still meet the reference evaluator."""
import re

import numpy as np
import pytest

from kiln.codegen.conformance import cases, for_spec, mismatches
from kiln.codegen.lowering.index_width import widen
from kiln.codegen.render import CUDARenderer
from kiln.ir import AxisType, Ops, UOp, dtypes

from .conftest import requires_cxx, requires_nvcc

emulate = pytest.importorskip("kiln.runtime.cuda.emulate")
N = 2**31 + 3
# the GPU options: GROUP, BLOCKS, LOCAL, SPREAD (the fused softmax), a symbolic size, a gate
WIDENED = ("reduce_sum_full_blocks", "sum_rows_local", "softmax_rows_stacked", "sum_symbolic_rows", "gated_max_two_sizes")


def reduction(op: Ops, value) -> UOp:  # type: ignore[no-untyped-def]
  o, x = UOp.define_global(0, dtypes.float64.ptr(1)), UOp.define_global(1, dtypes.float64.ptr(1))
  r = UOp.range(N, 0, AxisType.REDUCE)
  return UOp.sink(o.index(0).store(value(x.index(0).load(), r).reduce(op, r)), name="wide_reduce")


@requires_cxx
@pytest.mark.parametrize("op,value,want", [(Ops.ADD, lambda x, r: x, N), (Ops.MAX, lambda x, r: x + r.cast(dtypes.float64), N)],
                         ids=["sum_of_ones", "max_of_the_index"])
def test_reduction_over_2_31_plus_3(op, value, want):
  spec = CUDARenderer().render(reduction(op, value))
  assert "for (long long ridx0" in spec.src and "long long gidx0" in spec.src and "for (int ridx" not in spec.src
  prog = emulate.EmulatedProgram(spec)
  out, x = np.zeros(1), np.ones(1)
  prog.kernel([out, x], [], *prog.sizes([]))
  assert out[0] == want


@requires_nvcc
def test_nvcc_compiles_the_64_bit_loops(nvcc_compiler):
  spec = CUDARenderer().render(reduction(Ops.ADD, lambda x, r: x))
  ptx, _ = nvcc_compiler.compile_src(spec.src, spec.name)
  assert re.search(r"setp\.\w+\.[us]64\s+%p\d+, %rd\d+, 2147483651;", ptx)  # the element count, compared in 64 bits


@requires_cxx
@pytest.mark.parametrize("name", WIDENED)
def test_widened_conformance(name):
  case = next(c for c in cases() if c.name == name)
  spec = CUDARenderer().render(widen(case.ast), case.opts)
  assert "long long" in spec.src and "for (int ridx" not in spec.src
  prog = emulate.EmulatedProgram(spec)
  bufs = case.fresh()
  vals = [case.var_vals[n] for n in spec.var_names]
  prog.kernel(bufs, vals, *prog.sizes(vals))
  assert not (errs := mismatches(for_spec(case, spec.applied_opts), bufs)), "\n".join(errs)
