"""CPU conformance: every ALU op, for every dtype it takes, compiled by LLVM and run on this machine, against kiln.ir.reference.

Each kernel is `out[i] = op(a[i], b[i], ...)` over an array of edge values (0, +-1, min, max, NaN, +-inf, -0.0, denormals,
division by 0 and -1, shift amounts past the width, values near every int limit for casts) plus seeded random bit patterns;
a binary op sees every pair of edge values. Every kernel runs twice: scalar (opts=[]) and with the optimiser's heuristic,
which must vectorise it (UPCAST); both must match the reference, and each other, bit for bit.

Exact (bit patterns compared; any NaN equals any NaN): every integer and bool op; float + - * / sqrt reciprocal max neg
trunc, compares, where, every cast and bitcast. float16 and bfloat16 compute in float32 and round once, as alu.py defines.

Transcendentals (EXP2 LOG2 SIN; ERF TANH have their own table in test_erf_tanh.py) go through libm on the CPU (float32 EXP2 and
LOG2: the renderer's own vectorised code, test_vector_math.py) and numpy in the reference, so they may differ in the last place.
Where the reference gives NaN, +-inf or +-0 the CPU must give exactly that; elsewhere the distance is at most, in units
in the last place of the result dtype:

  | op   | float16 | bfloat16 | float32 | float64 | domain                                        |
  |------|---------|----------|---------|---------|-----------------------------------------------|
  | EXP2 | 1       | 1        | 2       | 1       | all inputs                                    |
  | LOG2 | 1       | 1        | 2       | 1       | all inputs                                    |
  | SIN  | 1       | 1        | 2       | 1       | all inputs (huge arguments included)          |

float16/bfloat16 results are float32 libm values rounded once, so they can be one half-precision ulp off only when the float32
values differ across a rounding boundary. Measured on an x86-64 host (glibc libm, numpy 2): at most 1 ulp everywhere, 0 for
float16/bfloat16; SIN float32 allows 2 because numpy's own float32 sin is not correctly rounded on every CPU.
The same table is in packages/runtime-cpu/README.md ("Accuracy"); a test checks that they agree.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.pipeline import lower
from kiln.codegen.registry import get_runtime
from kiln.ir import UOp, dtypes, reference
from kiln.ir.dtype import ALL_DTYPES, DType, f32_to_bf16_bits
from kiln.ir.ops import GroupOp, Ops
from kiln.runtime.cpu.guard import guarded_copy

RT = get_runtime("CPU")
GUARD = sys.platform.startswith("linux")  # every run's buffers between inaccessible pages (kiln.runtime.cpu.guard)
INTS = [d for d in ALL_DTYPES if d.is_int]
FLOATS = [d for d in ALL_DTYPES if d.is_float]
TRANSCENDENTAL = (Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.ERF, Ops.TANH)
# float32 EXP2/LOG2 are the renderer's own code (render/llvm_math.py), within 1 ulp of the truth (test_vector_math.py); numpy's, the
# reference, is up to 3/2 ulp from it, and the two measured at most 2 apart over every 256th float32
ULP_TOL = {Ops.EXP2: {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 1}, Ops.LOG2: {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 1},
           Ops.SIN: {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 1},
           # against the reference (libm's double erf, numpy's double tanh, rounded); accuracy against the truth: test_erf_tanh.py
           Ops.ERF: {"float16": 1, "bfloat16": 1, "float32": 1, "float64": 1}, Ops.TANH: {"float16": 1, "bfloat16": 1, "float32": 1, "float64": 3}}
PAD = 64  # every array length is a multiple of the widest vector (64 x 1 byte), so the heuristic can always UPCAST


# ---- edge values, in storage form (bfloat16 as uint16 bits) ----
def _store(dt: DType, vals: list) -> np.ndarray:
  if dt.is_bool: return np.array([bool(v) for v in vals], np.bool_)
  if dt.is_int: return np.array([int(v) % (1 << dt.bits) for v in vals], f"u{dt.itemsize}").view(dt.np)
  with np.errstate(over="ignore"):
    f64 = np.array(vals, np.float64)
    if dt == dtypes.bfloat16: return f32_to_bf16_bits(f64.astype(np.float32))
    return f64.astype(dt.np)


def _finfo(dt: DType) -> tuple[float, float, float]:
  """(max, smallest normal, smallest denormal)."""
  if dt == dtypes.bfloat16: return float(np.float32(np.uint32(0x7F7F0000).view(np.float32))), 2.0 ** -126, 2.0 ** -133
  fi = np.finfo(dt.np)
  return float(fi.max), float(fi.tiny), float(fi.smallest_subnormal)


def _dedupe(a: np.ndarray) -> np.ndarray:
  _, first = np.unique(a.view(f"u{a.itemsize}"), return_index=True)
  return a[np.sort(first)]


def edges(dt: DType) -> np.ndarray:
  if dt.is_bool: return np.array([False, True])
  if dt.is_int:
    mn, mx = int(dt.min), int(dt.max)
    v = [0, 1, -1, 2, -2, 3, -3, 5, 7, -7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 255, 1000, -1000, 65535, mn, mn + 1, mx, mx - 1,
         mx // 2, mn // 2, 0x5555555555555555, 2 ** 31 - 1, 2 ** 31]
    return _dedupe(_store(dt, v))
  mx, tiny, den = _finfo(dt)
  v = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 2.0, 3.0, 0.1, -0.1, 10.0, 1e-3, math.pi, -math.pi, 100.5, 127.5, -128.5,
       255.5, 256.0, -129.0, 65504.0, 65520.0, 1e5, 2.0 ** 24 + 1, 2.0 ** 31, -(2.0 ** 31), 2.0 ** 32, 2.0 ** 63, -(2.0 ** 63), 2.0 ** 64,
       1e20, -1e20, 1e38, 1e300, -1e300, mx, -mx, tiny, -tiny, den, -den, tiny - den, 3 * den, math.inf, -math.inf, math.nan]
  return _dedupe(_store(dt, v))


def _rand(dt: DType, n: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dt.is_bool: return rng.integers(0, 2, n).astype(np.bool_)
  if dt.is_float and dt != dtypes.bfloat16 and seed % 2: return rng.standard_normal(n).astype(dt.np) * np.asarray(4, dt.np)
  if dt.is_float: return _store(dt, list(rng.standard_normal(n) * 8))
  return rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt.np)  # raw bit patterns


def _pad(arrs: list[np.ndarray], dt: DType, seed: int) -> list[np.ndarray]:
  extra = -len(arrs[0]) % PAD + PAD
  return [np.concatenate([a, _rand(dt, extra, seed + i)]) for i, a in enumerate(arrs)]


def operands(dt: DType, arity: int, seed: int = 0) -> list[np.ndarray]:
  """arity arrays of dt covering every combination of edge values (all pairs for binary ops), padded with random values."""
  e = edges(dt)
  if arity == 1: cols = [e]
  else: cols = [np.repeat(e, len(e)), np.tile(e, len(e))] if arity == 2 else [np.repeat(e, 4), np.tile(e, 4)[::-1].copy(), np.tile(e, 4)]
  return _pad(cols, dt, seed)


# ---- kernels ----
def _out_dt(op: Ops, dt: DType) -> DType: return dtypes.bool if op in GroupOp.Comparison else dt


def alu_kernel(op: Ops, in_dts: list[DType], out_dt: DType, n: int) -> UOp:
  """out[i] = op(in0[i], in1[i], ...); the UOp is built directly, so no constant folding or promotion gets in the way."""
  i = UOp.range(n, 0)
  srcs = tuple(UOp.define_global(s + 1, d.ptr(n)).index(i).load() for s, d in enumerate(in_dts))
  val = UOp(op, out_dt, srcs)
  return UOp.sink(UOp.define_global(0, out_dt.ptr(n)).index(i).store(val), name=f"{op.name.lower()}_{'_'.join(str(d) for d in in_dts)}_{out_dt}")


_compiled: dict = {}


def run_cpu(ast: UOp, bufs: list[np.ndarray], opts: list | None, vals: tuple[int, ...] = ()) -> tuple[list[np.ndarray], list[str]]:
  """Render (opts=None: the heuristic), compile, load and run on copies of bufs (slot order); returns the copies and the opts used."""
  key = (ast.key, None if opts is None else tuple(opts))
  if key not in _compiled:
    spec = RT.renderer.render(ast, opts=opts)
    _compiled[key] = (RT.load(RT.compiler.compile(spec)), spec.applied_opts)
  prog, applied = _compiled[key]
  out = [guarded_copy(b) if GUARD else b.copy() for b in bufs]  # between guard pages: a stray access faults (KILN_GUARD's buffers)
  prog([b.ctypes.data for b in out], list(vals))
  return out, applied


def bits(a: np.ndarray) -> np.ndarray: return a.view(np.uint8) if a.dtype == np.bool_ else a.view(f"u{a.itemsize}")


def as_float(a: np.ndarray, dt: DType) -> np.ndarray:
  return (a.astype(np.uint32) << 16).view(np.float32) if dt == dtypes.bfloat16 else a.astype(np.float64)


def ordered(a: np.ndarray, dt: DType) -> np.ndarray:
  """Float bit patterns mapped to integers that count ulps (adjacent floats differ by 1, +0 and -0 are both 0)."""
  i = bits(a).view(f"i{a.itemsize}").astype(np.int64)
  return np.where(i < 0, -(i & np.int64((1 << (dt.bits - 1)) - 1)), i)


def mismatches(got: np.ndarray, want: np.ndarray, dt: DType, ulps: int = 0) -> np.ndarray:
  """Indices where got and want differ: bit patterns (any NaN equals any NaN), or by more than `ulps` on finite nonzero values."""
  bad = bits(got) != bits(want)
  if dt.is_float:
    gf, wf = as_float(got, dt), as_float(want, dt)
    bad &= ~(np.isnan(gf) & np.isnan(wf))
    if ulps:
      close = np.isfinite(wf) & (wf != 0) & np.isfinite(gf) & (np.abs(ordered(got, dt) - ordered(want, dt)) <= ulps)
      bad &= ~close
  return np.nonzero(bad)[0]


def check(ast: UOp, ins: list[np.ndarray], out_dt: DType, what: str, ulps: int = 0, vector: bool = True) -> None:
  """Run ast scalar and vectorised; both must match the reference (within ulps for transcendentals) and each other exactly."""
  n = len(ins[0])
  out0 = np.zeros(n, out_dt.np)
  want = reference.run(ast, out0, *ins)[0]
  scalar, applied = run_cpu(ast, [out0, *ins], [])
  assert applied == []
  results = {"scalar": scalar[0]}
  if vector:
    vec, applied = run_cpu(ast, [out0, *ins], None)
    assert any(o.startswith("UPCAST") for o in applied), f"{what}: the heuristic did not vectorise ({applied})"
    results["vector"] = vec[0]
    # the same vector code cut into 5 chunks that the pool's threads claim (fewer units than chunks leaves some empty)
    split, applied = run_cpu(ast, [out0, *ins], [*heuristic(ast), Opt(OptOps.THREAD, 0, 5)])
    assert any(o.startswith("THREAD") for o in applied), applied
    results["split"] = split[0]
  for path, got in results.items():
    if len(bad := mismatches(got, want, out_dt, ulps)):
      rows = [f"  in={[a[j].item() for a in ins]} got={got[j].item()!r} want={want[j].item()!r}" for j in bad[:8]]
      tol = f" by more than {ulps} ulp" if ulps else ""
      pytest.fail(f"{what} ({path}): {len(bad)} of {n} differ from the reference{tol}\n" + "\n".join(rows))
  if vector and len(bad := mismatches(results["vector"], results["scalar"], out_dt)):
    pytest.fail(f"{what}: vectorised and scalar code disagree at {len(bad)} of {n}, first inputs {[a[bad[0]].item() for a in ins]}")
  if vector and bits(results["split"]).tobytes() != bits(results["vector"]).tobytes():
    pytest.fail(f"{what}: the code split into chunks differs from the same code whole")


def heuristic(ast: UOp) -> list[Opt]:
  """The optimiser's options for ast on this host, without its thread split."""
  return [o for o in lower(ast, RT.target, None).opts if o.op is not OptOps.THREAD]


# ---- which op takes which dtype ----
BINARY_INT = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR]
BINARY_FLOAT = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE]
BINARY_BOOL = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR]
UNARY_FLOAT = [Ops.NEG, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.ERF, Ops.TANH]
CASES = ([(op, d) for d in INTS for op in BINARY_INT + [Ops.NEG, Ops.WHERE]]
         + [(op, d) for d in FLOATS for op in BINARY_FLOAT + UNARY_FLOAT + [Ops.WHERE]]
         + [(op, dtypes.bool) for op in BINARY_BOOL + [Ops.WHERE]] + [(Ops.DOT4, dtypes.int32)])


def _arity(op: Ops) -> int: return 1 if op in GroupOp.Unary else 3 if op in GroupOp.Ternary else 2


@pytest.mark.parametrize("op,dt", CASES, ids=[f"{op.name}-{d}" for op, d in CASES])
def test_alu_op(op: Ops, dt: DType) -> None:
  if op is Ops.WHERE:
    a, b = operands(dt, 2, seed=7)
    ins = [_rand(dtypes.bool, len(a), 3), a, b]
    in_dts = [dtypes.bool, dt, dt]
  else:
    ins, in_dts = operands(dt, _arity(op)), [dt] * _arity(op)
  if op in TRANSCENDENTAL:  # a dense sweep too: the edge values alone say little about accuracy
    sweep = {Ops.EXP2: np.linspace(-30, 30, 4096), Ops.LOG2: np.geomspace(1e-6, 6e4, 4096), Ops.SIN: np.linspace(-200, 200, 4096),
             Ops.ERF: np.linspace(-6, 6, 4096), Ops.TANH: np.linspace(-20, 20, 4096)}[op]
    ins = [np.concatenate([ins[0], _store(dt, list(sweep))])]
  ulps = ULP_TOL[op][dt.name] if op in TRANSCENDENTAL else 0
  check(alu_kernel(op, in_dts, _out_dt(op, dt), len(ins[0])), ins, _out_dt(op, dt), f"{op.name} {dt}", ulps)


def test_every_alu_op_and_dtype_is_covered() -> None:
  ops = {op for op, _ in CASES}
  assert ops | {Ops.CAST, Ops.BITCAST} >= (GroupOp.ALU - {Ops.MULACC}), sorted(o.name for o in GroupOp.ALU - ops)
  assert {d for _, d in CASES} == set(ALL_DTYPES)


CAST_PAIRS = [(s, d) for s in ALL_DTYPES for d in ALL_DTYPES if s != d]


@pytest.mark.parametrize("src,dst", CAST_PAIRS, ids=[f"{s}-{d}" for s, d in CAST_PAIRS])
def test_cast(src: DType, dst: DType) -> None:
  ins = operands(src, 1, seed=11)
  if src.is_int and dst == dtypes.bfloat16:  # integers one past a bfloat16 tie: rounding twice (via float32) gets these wrong
    ties = [(1 << 24) + (1 << 16) + 1, (1 << 25) + (1 << 17) + 1, -((1 << 24) + (1 << 16) + 1), (1 << 40) + (1 << 32) + 1]
    ins = [np.concatenate([ins[0], _pad([_dedupe(_store(src, ties))], src, 5)[0]])]
  if src == dtypes.float64 and dst in (dtypes.bfloat16, dtypes.float16, dtypes.float32):  # float64 one past a tie of the target
    ties = [1.0 + 2.0 ** -8 + 2.0 ** -40, 1.0 + 2.0 ** -11 + 2.0 ** -40, 1.0 + 2.0 ** -24 + 2.0 ** -40, -(1.0 + 2.0 ** -8 + 2.0 ** -40)]
    ins = [np.concatenate([ins[0], _pad([np.array(ties)], src, 5)[0]])]
  check(alu_kernel(Ops.CAST, [src], dst, len(ins[0])), ins, dst, f"CAST {src} -> {dst}")


BITCAST_PAIRS = [(s, d) for s in ALL_DTYPES for d in ALL_DTYPES if s != d and s.itemsize == d.itemsize]


@pytest.mark.parametrize("src,dst", BITCAST_PAIRS, ids=[f"{s}-{d}" for s, d in BITCAST_PAIRS])
def test_bitcast(src: DType, dst: DType) -> None:
  ins = operands(src, 1, seed=13)
  check(alu_kernel(Ops.BITCAST, [src], dst, len(ins[0])), ins, dst, f"BITCAST {src} -> {dst}")


# ---- constant operands take other code paths (division by a known divisor, shifts by a known amount) ----
@pytest.mark.parametrize("dt", INTS, ids=str)
def test_int_ops_with_constant_operand(dt: DType) -> None:
  (a,) = operands(dt, 1, seed=17)
  n = len(a)
  consts = [int(c) for c in edges(dt)]
  ops = [Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR, Ops.MUL, Ops.MAX]
  i = UOp.range(n, 0)
  x = UOp.define_global(len(ops) * len(consts), dt.ptr(n)).index(i).load()
  stores = [UOp.define_global(k * len(consts) + j, dt.ptr(n)).index(i).store(UOp(op, dt, (x, UOp.const(dt, c))))
            for k, op in enumerate(ops) for j, c in enumerate(consts)]
  ast = UOp.sink(*stores, name=f"const_ops_{dt}")
  outs = [np.zeros(n, dt.np) for _ in stores]
  want = reference.run(ast, *outs, a)
  for opts in ([], [_upcast(dt)]):
    got, _ = run_cpu(ast, [*outs, a], opts)
    for k, op in enumerate(ops):
      for j, c in enumerate(consts):
        s = k * len(consts) + j
        if len(bad := mismatches(got[s], want[s], dt)):
          pytest.fail(f"{op.name} {dt} by constant {c} (opts={opts}): {len(bad)} differ, x={a[bad[0]]}: got {got[s][bad[0]]} want {want[s][bad[0]]}")


def _upcast(dt: DType):
  from kiln.codegen.choose import Opt, OptOps
  return Opt(OptOps.UPCAST, 0, max(64 // dt.itemsize, 2) if RT.target.vector_bytes >= 64 else 8)


def test_readme_accuracy_table_matches() -> None:
  import pathlib
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  assert "## Accuracy" in readme
  for op, tol in ULP_TOL.items():
    row = next(line for line in readme.splitlines() if line.startswith(f"| {op.name} "))
    assert [int(c) for c in row.split("|")[2:6]] == [tol[d.name] for d in FLOATS], (op.name, row)


# ---- reductions and gated memory access, every dtype ----
RED_CASES = [(op, d) for d in ALL_DTYPES for op in (Ops.ADD, Ops.MUL, Ops.MAX)]


@pytest.mark.parametrize("op,dt", RED_CASES, ids=[f"{op.name}-{d}" for op, d in RED_CASES])
def test_reduce(op: Ops, dt: DType) -> None:
  """Row reductions (kept axis vectorised: same order as the reference, so exact for floats too) and full reductions
  (reduce axis vectorised by the heuristic: exact for ints, bools and MAX; float ADD/MUL change order, so scalar only)."""
  from kiln.ir import kernels
  e = edges(dt)
  x = _pad([np.resize(e, 64 * 37 - PAD)], dt, 19)[0][: 64 * 37]
  rows = kernels.reduce(op, (64, 37), dt, axes=1, name=f"rows_{op.name}_{dt}")
  check(rows, [x], dt, f"row REDUCE {op.name} {dt}")
  full = kernels.reduce(op, (len(x),), dt, name=f"full_{op.name}_{dt}")
  check(full, [x], dt, f"full REDUCE {op.name} {dt}", vector=not (dt.is_float and op is not Ops.MAX))


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_gated_load_and_store(dt: DType) -> None:
  """out[i] = i % 3 != 0 ? a[(i * 7) % n] : 0 (gated load), stored only where i % 5 != 0 (gated store); vector lanes take the same gates."""
  (a,) = operands(dt, 1, seed=23)
  n = len(a)
  i = UOp.range(n, 0)
  src = UOp.define_global(1, dt.ptr(n)).index((i * 7) % n, (i % 3).ne(0)).load()
  ast = UOp.sink(UOp.define_global(0, dt.ptr(n)).index(i, (i % 5).ne(0)).store(src), name=f"gated_{dt}")
  out = _rand(dt, n, 29)
  want = reference.run(ast, out, a)[0]
  for opts in ([], [_upcast(dt)]):
    got = run_cpu(ast, [out, a], opts)[0][0]
    assert not len(bad := mismatches(got, want, dt)), f"gated {dt} opts={opts}: {len(bad)} differ, first at {bad[0]}"
