"""ERF and TANH in the IR: the reference evaluator against math.erf / math.tanh on edge values for every float dtype, constant
folding sharing those semantics, float-only typing (builders, verify, fold) and the [-1, 1] bounds."""
import math

import numpy as np
import pytest

from kiln.ir import IRTypeError, IRVerifyError, Ops, UOp, dtypes
from kiln.ir.dtype import FLOAT_DTYPES, DType, bf16_bits_to_f32, f32_to_bf16_bits
from kiln.ir.fold import fold_alu
from kiln.ir.reference import evaluate
from kiln.ir.verify import verify

EXACT = {Ops.ERF: math.erf, Ops.TANH: math.tanh}
# ulps from math's double value rounded once to dt: the reference rounds libm's double erf and numpy's double tanh (math.tanh and
# np.tanh differ by a few float64 ulp); float16 and bfloat16 round a float32 result again, as EXP2 does (1 ulp at a tie)
ULPS = {Ops.ERF: {"float16": 1, "bfloat16": 1, "float32": 0, "float64": 0}, Ops.TANH: {"float16": 1, "bfloat16": 1, "float32": 0, "float64": 3}}
CASES = [(op, dt) for op in EXACT for dt in FLOAT_DTYPES]


def storage(vals: list[float], dt: DType) -> np.ndarray:
  with np.errstate(over="ignore"):
    if dt == dtypes.bfloat16: return f32_to_bf16_bits(np.asarray(vals, np.float64).astype(np.float32))
    return np.asarray(vals, np.float64).astype(dt.np)


def as_f64(a: np.ndarray, dt: DType) -> np.ndarray: return (bf16_bits_to_f32(a) if dt == dtypes.bfloat16 else a).astype(np.float64)


def ulp_index(x: np.ndarray, dt: DType) -> np.ndarray:
  """Each value's position on dt's number line (adjacent values differ by 1, +0 and -0 are both 0)."""
  i = storage(list(x), dt).view(f"i{dt.itemsize}").astype(np.int64)
  return np.where(i < 0, -(i & np.int64((1 << (dt.bits - 1)) - 1)), i)


def edge_values(dt: DType) -> list[float]:
  tiny = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149, "float64": 5e-324}[dt.name]
  vals = [0.0, 1e-30, 1e-8, 1e-4, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 3.9, 4.0, 5.0, 5.9, 6.0, 9.0, 10.0, 19.0, 20.0,
          100.0, 1e30, 65504.0, tiny, 2.0 ** -14, 2.0 ** -126, math.inf]
  vals += [-v for v in vals] + [math.nan]
  return [float(v) for v in as_f64(storage(vals, dt), dt)]  # as dt holds them (1e30 is inf in float16)


def run_unary(op: Ops, dt: DType, vals: list[float]) -> np.ndarray:
  n = len(vals)
  o, a, i = UOp.define_global(0, dt.ptr(n)), UOp.define_global(1, dt.ptr(n)), UOp.range(n, 0)
  out = np.zeros(n, dt.np)
  evaluate(UOp.sink(o.index(i).store(UOp(op, dt, (a.index(i).load(),)))), [out, storage(vals, dt)])
  return as_f64(out, dt)


@pytest.mark.parametrize("op,dt", CASES, ids=[f"{o.name}-{d.name}" for o, d in CASES])
def test_reference_vs_math_on_edges(op: Ops, dt: DType) -> None:
  vals = edge_values(dt)
  got = run_unary(op, dt, vals)
  want = np.array([EXACT[op](v) for v in vals])
  for v, g, w in zip(vals, got, want):
    if math.isnan(v): assert math.isnan(g), f"{op.name} {dt}({v}) = {g}, not NaN"
    elif v == 0 or math.isinf(v): assert g == w and math.copysign(1, g) == math.copysign(1, w), f"{op.name} {dt}({v}) = {g!r}, want {w!r}"
    else: assert abs(g) <= 1 and math.copysign(1, g) == math.copysign(1, v), f"{op.name} {dt}({v}) = {g!r}: outside [-1, 1] or wrong sign"
  fin = ~np.isnan(want)
  err = np.abs(ulp_index(got[fin], dt) - ulp_index(want[fin], dt))
  assert err.max() <= ULPS[op][dt.name], f"{op.name} {dt}: {err.max()} ulp at x={np.array(vals)[fin][err.argmax()]}"


@pytest.mark.parametrize("op,dt", CASES, ids=[f"{o.name}-{d.name}" for o, d in CASES])
def test_folding_matches_reference(op: Ops, dt: DType) -> None:
  vals = edge_values(dt)
  for v, r in zip(vals, run_unary(op, dt, vals)):
    f = fold_alu(op, dt, (UOp.const(dt, v),))
    assert f is not None and f.op is Ops.CONST
    assert (math.isnan(f.arg) and math.isnan(r)) or (f.arg == r and math.copysign(1, f.arg) == math.copysign(1, r)), (v, f.arg, r)


def test_builders_are_float_only() -> None:
  x = UOp.define_global(1, dtypes.float32.ptr(4)).index(UOp.range(4, 0)).load()
  assert x.erf().op is Ops.ERF and x.tanh().op is Ops.TANH and x.erf().dtype == dtypes.float32
  assert UOp.const(dtypes.float64, 0.5).erf().arg == math.erf(0.5) and UOp.const(dtypes.float64, 0.5).tanh().arg == math.tanh(0.5)
  for dt in (dtypes.int32, dtypes.uint8, dtypes.bool):
    for f in (UOp.erf, UOp.tanh):
      with pytest.raises(IRTypeError, match="needs a float"): f(UOp.const(dt, 1 if dt != dtypes.bool else True))
  with pytest.raises(IRTypeError, match="float dtype"): fold_alu(Ops.ERF, dtypes.int32, (UOp.const(dtypes.int32, 1),))


@pytest.mark.parametrize("op", [Ops.ERF, Ops.TANH])
def test_verify_rejects_ints(op: Ops) -> None:
  i = UOp.range(16, 0)
  x = UOp.define_global(1, dtypes.int32.ptr(16)).index(i).load()
  bad = UOp.sink(UOp.define_global(0, dtypes.int32.ptr(16)).index(i).store(UOp(op, dtypes.int32, (x,))))
  with pytest.raises(IRVerifyError, match=f"{op.name}.*floats only"): verify(bad)
  f = UOp.define_global(1, dtypes.float16.ptr(16)).index(i).load()
  verify(UOp.sink(UOp.define_global(0, dtypes.float16.ptr(16)).index(i).store(UOp(op, dtypes.float16, (f,)))))


def test_bounds() -> None:
  i = UOp.range(16, 0)
  from_int = i.cast(dtypes.float32)  # finite bounds [0, 15], never NaN
  assert (from_int.erf().vmin, from_int.erf().vmax) == (-1.0, 1.0) and (from_int.tanh().vmin, from_int.tanh().vmax) == (-1.0, 1.0)
  loaded = UOp.define_global(1, dtypes.float32.ptr(16)).index(i).load()  # may be NaN: erf(NaN) is NaN, so no finite bound
  assert (loaded.erf().vmin, loaded.erf().vmax) == (dtypes.float32.min, dtypes.float32.max)
