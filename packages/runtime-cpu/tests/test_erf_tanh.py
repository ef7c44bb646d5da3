"""ERF and TANH compiled for the CPU against the true value, over dense sweeps, scalar and vectorised code alike.

float32 (and bfloat16, float16 widened to float) is the renderer's own inline code (render/llvm_math.py: in float32, an odd
polynomial near 0 and a form through float32 exp2 beyond); float64 calls libm's erf/tanh lane by lane. The distance to the
correctly rounded true value, in ulps of the result dtype, is at most:

  | op   | float16 | bfloat16 | float32 | float64 | sweep                                                              |
  |------|---------|----------|---------|---------|--------------------------------------------------------------------|
  | ERF  | 1       | 1        | 1       | 1       | every 16-bit value; 1e6 points in [-10, 10]; 20001 in [-10, 10]    |
  | TANH | 1       | 1        | 1       | 2       | the same                                                           |

Truth: float64 math.erf / np.tanh rounded once for the 16- and 32-bit types (their error is far below those ulps), and for float64 a
60-80 digit decimal evaluation (series for erf, (e^2x - 1) / (e^2x + 1) for tanh). Measured on x86-64 glibc: ERF 0/0/1/1 and TANH
0/0/1/2 (float16/bfloat16/float32/float64; float32 off by 1 at 1.9% and 3.2% of the 1e6 points, and by at most 1 over every
float32 bit pattern); a 16-bit 1 would be where the float32 result rounds again to half.
"""
from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import UOp, dtypes
from kiln.ir.dtype import DType, bf16_bits_to_f32, f32_to_bf16_bits
from kiln.ir.ops import Ops

RT = get_runtime("CPU")
BOUND = {Ops.ERF: {"float16": 1, "bfloat16": 1, "float32": 1, "float64": 1}, Ops.TANH: {"float16": 1, "bfloat16": 1, "float32": 1, "float64": 2}}
CASES = [(op, dt) for op in BOUND for dt in (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)]
_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803")


def erf_hp(x: float) -> float:
  """erf to 80 digits by its Taylor series (|x| <= 6.5: past that erf rounds to +-1 in float64)."""
  if x == 0 or not math.isfinite(x) or abs(x) > 6.5: return math.erf(x)
  getcontext().prec = 80
  d = Decimal(x)
  x2, term, s, n = d * d, d, d, 0
  while True:
    n += 1
    term = -term * x2 / n
    s += (t := term / (2 * n + 1))
    if abs(t) < Decimal(10) ** -70: return float(2 * s / _PI.sqrt())


def tanh_hp(x: float) -> float:
  if x == 0 or not math.isfinite(x) or abs(x) > 40: return math.tanh(x)
  getcontext().prec = 60
  e = (2 * Decimal(x)).exp()
  return float((e - 1) / (e + 1))


def inputs(dt: DType) -> np.ndarray:
  """Storage-form inputs: every bit pattern of a 16-bit type, a linear sweep of [-10, 10] otherwise."""
  if dt.itemsize == 2: return np.arange(65536, dtype=np.uint16).view(np.uint16 if dt == dtypes.bfloat16 else np.float16)
  return np.linspace(-10, 10, 1_000_001 if dt == dtypes.float32 else 20001).astype(dt.np)


def values(a: np.ndarray, dt: DType) -> np.ndarray:
  with np.errstate(invalid="ignore"): return (bf16_bits_to_f32(a) if dt == dtypes.bfloat16 else a).astype(np.float64)  # NaN patterns


def truth(op: Ops, dt: DType, x: np.ndarray) -> np.ndarray:
  """The true result rounded to dt, in storage form."""
  if dt == dtypes.float64: return np.array([(erf_hp if op is Ops.ERF else tanh_hp)(float(v)) for v in x])
  with np.errstate(invalid="ignore"):
    t = np.vectorize(math.erf, otypes=[np.float64])(x) if op is Ops.ERF else np.tanh(x)
  return f32_to_bf16_bits(t.astype(np.float32)) if dt == dtypes.bfloat16 else t.astype(dt.np)  # float64 -> float32 -> bf16: no tie here


def ulp_index(a: np.ndarray, dt: DType) -> np.ndarray:
  i = a.view(f"i{dt.itemsize}").astype(np.int64)
  return np.where(i < 0, -(i & np.int64((1 << (dt.bits - 1)) - 1)), i)


def run_cpu(op: Ops, dt: DType, x: np.ndarray, opts: list | None) -> np.ndarray:
  n = len(x)
  i = UOp.range(n, 0)
  ast = UOp.sink(UOp.define_global(0, dt.ptr(n)).index(i).store(UOp(op, dt, (UOp.define_global(1, dt.ptr(n)).index(i).load(),))),
                 name=f"{op.name.lower()}_{dt}")
  spec = RT.renderer.render(ast, opts=opts)
  assert (opts is None) == any(o.startswith("UPCAST") for o in spec.applied_opts), spec.applied_opts  # the heuristic vectorises
  out = np.zeros(n, x.dtype)
  RT.load(RT.compiler.compile(spec))([out.ctypes.data, x.ctypes.data], [])
  return out


@pytest.mark.parametrize("op,dt", CASES, ids=[f"{o.name}-{d}" for o, d in CASES])
def test_sweep_within_bound(op: Ops, dt: DType) -> None:
  x = inputs(dt)
  xv = values(x, dt)
  want = truth(op, dt, xv)
  for opts in ([], None):
    got = run_cpu(op, dt, x, opts)
    gv, wv = values(got, dt), values(want, dt)
    nan = np.isnan(xv)
    assert np.isnan(gv[nan]).all(), f"{op.name} {dt}: NaN in, not NaN out"
    err = np.abs(ulp_index(got[~nan], dt) - ulp_index(want[~nan], dt))
    k = int(err.argmax())
    assert err[k] <= BOUND[op][dt.name], f"{op.name} {dt} (opts={opts}): {err[k]} ulp at x={xv[~nan][k]!r}: got {gv[~nan][k]!r}, true {wv[~nan][k]!r}"
    assert (np.abs(gv[~nan]) <= 1).all()


@pytest.mark.parametrize("op", [Ops.ERF, Ops.TANH])
def test_renders_inline_float_and_libm_double(op: Ops) -> None:
  n, name = 64, op.name.lower()
  i = UOp.range(n, 0)
  for dt in (dtypes.float32, dtypes.float64, dtypes.float16):
    ast = UOp.sink(UOp.define_global(0, dt.ptr(n)).index(i).store(UOp(op, dt, (UOp.define_global(1, dt.ptr(n)).index(i).load(),))))
    src = RT.renderer.render(ast, opts=None).src
    if dt == dtypes.float64: assert f"declare double @{name}(double)" in src and "extractelement" in src, src
    else: assert f"@kiln.{name}.f32." in src and f"@{name}f" not in src and "declare float" not in src, src
