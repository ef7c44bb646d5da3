"""ERF and TANH render to the CUDA math library (erff/tanhf on float registers, erf/tanh on double) and in LLVM IR to
the renderer's own inline code for float registers (render/llvm_math.py) and libm calls on double."""
import pytest

from kiln.codegen.render import CUDARenderer
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import Ops, UOp, dtypes

FLOATS = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]


def kernel(op: Ops, dt, n: int = 64) -> UOp:
  i = UOp.range(n, 0)
  return UOp.sink(UOp.define_global(0, dt.ptr(n)).index(i).store(UOp(op, dt, (UOp.define_global(1, dt.ptr(n)).index(i).load(),))))


@pytest.mark.parametrize("op", [Ops.ERF, Ops.TANH])
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_cuda_calls_the_math_library(op: Ops, dt) -> None:
  fn = op.name.lower() + ("" if dt == dtypes.float64 else "f")  # 16-bit floats live in float registers
  assert f"{fn}(" in CUDARenderer().render(kernel(op, dt)).src


@pytest.mark.parametrize("op", [Ops.ERF, Ops.TANH])
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_llvm_inline_float_libm_double(op: Ops, dt) -> None:
  name = op.name.lower()
  for opts in ([], None):  # scalar, and vectorised: double called lane by lane
    src = LLVMRenderer().render(kernel(op, dt), opts=opts).src
    if dt == dtypes.float64: assert f"declare double @{name}(double)" in src and f"call double @{name}(double " in src, src
    else: assert f"@kiln.{name}.f32." in src and f"@{name}f(" not in src, src
