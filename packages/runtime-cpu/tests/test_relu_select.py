"""max(x, +0.0) (ReLU, on float32 and float64) renders as select(x <= 0, +0, x), two instructions where llvm.maximum took
three on AVX-512 (max, an unordered compare, a masked move): the same bits for every input, NaN payloads and -0 included,
checked here against the reference evaluator, vectorised and scalar, with the constant on either side. max(x, -0.0)
keeps llvm.maximum (the select would give -0 for x = +0)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import dtypes, kernels
from kiln.ir.dtype import DType
from kiln.ir.reference import evaluate
from kiln.ir.uop import UOp

RT = get_runtime("CPU")
SPECIAL = [np.nan, -np.nan, 0.0, -0.0, -1.0, 1.0, np.inf, -np.inf, 5e-324, -5e-324, 1e-45, -1e-45, 3.0, -3.0, 1e300, -1e300]


def values(dt: DType) -> np.ndarray:
  with np.errstate(over="ignore", under="ignore"): x = np.asarray(SPECIAL * 4, dt.np)
  x.view(np.uint32 if dt.itemsize == 4 else np.uint64)[0] |= 5  # a NaN with a payload: the result's bits are compared below
  return x


@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("const_first", [False, True])
@pytest.mark.parametrize("vector", [True, False])
def test_max_with_positive_zero_is_a_select_with_maximums_bits(dt: DType, const_first: bool, vector: bool) -> None:
  z = UOp.const(dt, 0.0)
  ast = kernels.elementwise((lambda v: z.maximum(v)) if const_first else (lambda v: v.maximum(0.0)), dt, ((64,), dt))
  spec = RT.renderer.render(ast, None if vector else [])
  assert "select" in spec.src and "llvm.maximum" not in spec.src
  x = values(dt)
  out = np.zeros_like(x)
  RT.load(RT.compiler.compile(spec))([out.ctypes.data, x.ctypes.data], [])
  want = np.zeros_like(x)
  evaluate(ast, [want, x])
  bits = np.uint32 if dt.itemsize == 4 else np.uint64
  assert out.view(bits).tolist() == want.view(bits).tolist()


def test_max_with_negative_zero_keeps_llvm_maximum() -> None:
  ast = kernels.elementwise(lambda v: v.maximum(-0.0), dtypes.float32, ((64,), dtypes.float32))
  assert "llvm.maximum" in RT.renderer.render(ast).src
