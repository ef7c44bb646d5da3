"""The conformance set: kernel ASTs with inputs that every renderer must render and every runtime must run like the reference
evaluator. Elementwise kernels cover every ALU op, cast and bitcast for every dtype on edge values (0, -1, MIN, MAX, NaN, inf,
-0, subnormals, huge values); then reductions over each axis of 2-D and 3-D inputs, full (GPU group) reductions, matmul,
softmax parts, symbolic sizes and gated loads and stores.

`check(case, bufs)` compares a runtime's buffers with the reference's: integers and bools exactly, floats bit for bit (NaN
equals NaN, -0 differs from +0) except where `case.tol` allows a relative error: transcendental ops (exp2/log2/sin/erf/tanh, whose
libraries differ by a few ulp) and float reductions a runtime sums in another order (group reductions).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from kiln.codegen.choose import Opt, OptOps
from kiln.ir import kernels
from kiln.ir.alu import round_to, to_storage
from kiln.ir.dtype import ALL_DTYPES, DType, bf16_bits_to_f32, dtypes
from kiln.ir.ops import AxisType, Ops
from kiln.ir.reference import evaluate
from kiln.ir.uop import UOp

# relative tolerance of one transcendental result (a few ulp of the dtype, as the device libraries document)
TRANSCENDENTAL_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-14}


@dataclass
class Case:
  name: str
  ast: UOp
  bufs: list[np.ndarray]  # per slot, storage dtype (bfloat16 as uint16); outputs pre-filled so a skipped store shows
  var_vals: dict[str, int] = field(default_factory=dict)
  opts: list[Opt] | None = None
  tol: dict[int, float] = field(default_factory=dict)  # slot -> relative tolerance for float outputs (default: exact)
  labels: dict[int, str] = field(default_factory=dict)  # slot -> what it holds, for messages
  # slot -> error allowed relative to the output's largest magnitude: sums in another order whose terms cancel (a near-zero
  # result's relative error says nothing there)
  scale_tol: dict[int, float] = field(default_factory=dict)

  def expected(self) -> list[np.ndarray]:
    out = [b.copy() for b in self.bufs]
    evaluate(self.ast, out, self.var_vals)
    return out

  def fresh(self) -> list[np.ndarray]: return [b.copy() for b in self.bufs]


def _int_edges(dt: DType) -> list[int]:
  lo, hi = int(dt.min), int(dt.max)
  vals = [0, 1, 2, 3, 7, 8, 15, 31, 33, 63, 64, 100, hi, hi - 1, hi // 2 + 1]
  if dt.kind == "i": vals += [-1, -2, -3, -8, -33, -100, lo, lo + 1]
  return sorted({v for v in vals if lo <= v <= hi})


def _float_edges(dt: DType) -> list[float]:
  vals = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.5, -2.5, 3.0, -7.25, 100.3, 3.14159, 1e-3, 1e-40, -1e-8, 65504.0, 70000.0, 1e30, -1e30,
          3e9, -3e9, 1.8e19, 9.3e18, 255.9, -129.5, 32767.5, float("inf"), float("-inf"), float("nan")]
  with np.errstate(all="ignore"):
    return [float(x) for x in round_to(dt, np.asarray(vals, np.float64).astype(np.float64 if dt.itemsize == 8 else np.float32))]


def edges(dt: DType) -> list:
  if dt.is_bool: return [False, True]
  return _int_edges(dt) if dt.is_int else _float_edges(dt)


def _storage(dt: DType, vals: list | np.ndarray) -> np.ndarray:
  a = np.asarray(vals)
  with np.errstate(all="ignore"):  # edge values overflow narrow floats on purpose
    if dt.is_float: a = round_to(dt, a.astype(np.float64 if dt.itemsize == 8 else np.float32))
    return np.ascontiguousarray(to_storage(dt, a.astype(dt.np) if not dt.is_float else a))


def _fill(dt: DType, n: int) -> np.ndarray:
  """An output buffer's initial contents: a pattern a kernel would not produce by accident."""
  return _storage(dt, [(i % 5 == 1) for i in range(n)] if dt.is_bool else [(i * 7 + 3) % 101 for i in range(n)])


def _pairs(dt: DType) -> tuple[list, list]:
  e = edges(dt)
  a, b = zip(*itertools.product(e, e))
  return list(a), list(b)


_BIN = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL,
        Ops.SHR]
_UN = [Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC, Ops.ERF, Ops.TANH]
_BOOL_OPS = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.MAX, Ops.AND, Ops.OR, Ops.XOR, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE}
_FLOAT_ONLY = {Ops.FDIV, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC, Ops.ERF, Ops.TANH}
_INT_ONLY = {Ops.IDIV, Ops.MOD, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR}
_TRANSCENDENTAL = {Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.ERF, Ops.TANH}


def _ops_for(dt: DType) -> list[Ops]:
  ops = [*_BIN, *_UN, Ops.WHERE, Ops.MULACC, *([Ops.DOT4] if dt == dtypes.int32 else [])]
  if dt.is_bool: return [o for o in ops if o in _BOOL_OPS or o is Ops.WHERE]
  if dt.is_int: return [o for o in ops if o not in _FLOAT_ONLY]
  return [o for o in ops if o not in _INT_ONLY]


def elementwise_case(dt: DType) -> Case:
  """Every ALU op of dtype dt, every cast from dt and every bitcast to a dtype of its size, in one kernel with one output buffer
  each; inputs a and b hold all pairs of edge values, c and a bool condition are random picks."""
  a_vals, b_vals = _pairs(dt)
  n = len(a_vals)
  rng = np.random.default_rng(dt.priority)
  c_vals = [edges(dt)[i] for i in rng.integers(0, len(edges(dt)), n)]
  ops = _ops_for(dt)
  casts = [(Ops.CAST, d) for d in ALL_DTYPES if d != dt] + [(Ops.BITCAST, d) for d in ALL_DTYPES if d != dt and d.itemsize == dt.itemsize]
  k = len(ops) + len(casts)
  i = UOp.range(n, 0)
  in_dts = (dt, dt, dtypes.bool, dt) if Ops.MULACC in ops else (dt, dt, dtypes.bool)  # bool has no MULACC: no c
  a, b, cond, *c_ = (UOp.define_global(k + j, t.ptr(n)).index(i).load() for j, t in enumerate(in_dts))
  vals: list[UOp] = []
  labels: dict[int, str] = {}
  tol: dict[int, float] = {}
  for op in ops:
    if op in _UN: v = UOp(op, dt, (a,))
    elif op is Ops.WHERE: v = UOp(op, dt, (cond, a, b))
    elif op in (Ops.MULACC, Ops.DOT4): v = UOp(op, dt, (a, b, c_[0]))
    else: v = UOp(op, dtypes.bool if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else dt, (a, b))
    if op in _TRANSCENDENTAL: tol[len(vals)] = TRANSCENDENTAL_RTOL[dt.name]
    labels[len(vals)] = f"{op.name}({dt})"
    vals.append(v)
  for op, d in casts:
    labels[len(vals)] = f"{op.name}({dt} -> {d})"
    vals.append(a.cast(d) if op is Ops.CAST else a.bitcast(d))
  stores = [UOp.define_global(s, v.dtype.ptr(n)).index(i).store(v) for s, v in enumerate(vals)]
  bufs = [_fill(v.dtype, n) for v in vals]
  bufs += [_storage(dt, a_vals), _storage(dt, b_vals), _storage(dtypes.bool, list(rng.integers(0, 2, n).astype(bool)))]
  if c_: bufs.append(_storage(dt, c_vals))
  return Case(f"ew_{dt.name}", UOp.sink(*stores, name=f"ew_{dt.name}"), bufs, tol=tol, labels=labels)


def _renumber(ast: UOp, slots: dict[int, int]) -> UOp:
  """ast with DEFINE_GLOBAL slots renumbered (to put several kernels' stores in one SINK)."""
  gs = {u: UOp.define_global(slots[u.arg], u.dtype) for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL and u.arg in slots}  # type: ignore[arg-type]
  return ast.substitute(gs)


def merged(name: str, asts: list[UOp]) -> UOp:
  """One kernel from single-output kernels of the same input (slot 1): outputs 0..k-1, the shared input k."""
  k = len(asts)
  stores = [_renumber(a, {0: j, 1: k}).src[0] for j, a in enumerate(asts)]
  return UOp.sink(*stores, name=name)


def _rand(dt: DType, n: int, rng: np.random.Generator, lo: float = -4, hi: float = 4) -> np.ndarray:
  if dt.is_bool: return _storage(dt, rng.integers(0, 2, n).astype(bool))
  if dt.is_int: return _storage(dt, rng.integers(max(int(dt.min), -100), min(int(dt.max), 100) + 1, n))
  return _storage(dt, rng.uniform(lo, hi, n))


def _reduce_case(name: str, ast: UOp, rng: np.random.Generator, opts: list[Opt] | None = None, var_vals: dict[str, int] | None = None,
                 lo: float = -4, hi: float = 4, tol: float | None = None) -> Case:
  bufs = []
  outs = {st.src[0].src[0].arg for st in ast.src}
  for g in sorted({u for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL}, key=lambda g: g.arg):
    dt, size = g.dtype.base, g.dtype.size  # type: ignore[attr-defined]
    bufs.append(_fill(dt, size) if g.arg in outs else _rand(dt, size, rng, lo, hi))
  return Case(name, ast, bufs, var_vals or {}, opts, {0: tol} if tol else {})


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
  return rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)


def structured_cases() -> list[Case]:
  rng = np.random.default_rng(0)
  out: list[Case] = []
  f32 = dtypes.float32
  fns = (kernels.reduce_sum, kernels.reduce_max, kernels.reduce_prod)
  # sum, max and prod over each axis (one kernel per axis: the three share its loops); values near 1 keep products finite
  for shape in ((6, 37), (4, 5, 33)):
    for ax in range(len(shape)):
      ast = merged(f"reduce_ax{ax}", [f(shape, f32, ax) for f in fns])
      out.append(_reduce_case(f"reduce_{'x'.join(map(str, shape))}_ax{ax}", ast, rng, lo=0.5, hi=1.5))
  # full reductions: the GPU splits each over a block (GROUP), combining partials in another order than the reference
  for f in fns: out.append(_reduce_case(f"{f.__name__}_full", f((1000,), f32), rng, lo=0.5, hi=1.5, tol=None if f is kernels.reduce_max else 1e-4))
  out.append(_reduce_case("reduce_full_2d", merged("reduce_full_2d", [f((13, 29), f32) for f in fns]), rng, lo=0.5, hi=1.5))
  for dt in (dtypes.int32, dtypes.uint8, dtypes.float16, dtypes.bfloat16, dtypes.float64, dtypes.bool):
    out.append(_reduce_case(f"reduce_{dt.name}_ax1", merged("reduce_rows", [f((5, 21), dt, 1) for f in fns]), rng, lo=0.5, hi=1.5))
    if dt.name in ("int32", "bfloat16"):
      out.append(_reduce_case(f"sum_{dt.name}_full", kernels.reduce_sum((300,), dt), rng, tol=3e-2 if dt.is_float else None))
  out.append(_reduce_case("sum_rows_group", kernels.reduce_sum((7, 300), f32, 1), rng, opts=[Opt(OptOps.GROUP, 1, 64)], tol=1e-5))
  # the GPU's cuts (opt._gpu_opts): a full reduction over several blocks (BLOCKS: the last block folds their partials), a few
  # long rows each over several blocks, rows of a block each with the columns shared by its threads (SPREAD)
  for f in (kernels.reduce_sum, kernels.reduce_max):
    out.append(_reduce_case(f"{f.__name__}_full_blocks", f((20000,), f32), rng, lo=0.5, hi=1.5, tol=None if f is kernels.reduce_max else 1e-4))
  out.append(_reduce_case("sum_int32_full_blocks", kernels.reduce_sum((20000,), dtypes.int32), rng))
  out.append(_reduce_case("sum_rows_blocks", kernels.reduce_sum((3, 20000), f32, 1), rng, lo=0.5, hi=1.5, tol=1e-4))
  out.append(_reduce_case("softmax_rows_1024", kernels.softmax((4, 1024), f32), rng, tol=1e-5))
  out.append(_reduce_case("sum_rows_local", kernels.reduce_sum((300, 7), f32, 1), rng))
  # short rows, many of them: a GPU block stacks 8 rows of one warp each, the last block's extra rows gated off
  out.append(_reduce_case("sum_rows_stacked", kernels.reduce_sum((100, 64), f32, 1), rng, tol=1e-5))
  out.append(_reduce_case("softmax_rows_stacked", kernels.softmax((45, 96), f32), rng, tol=1e-5))
  out.append(_reduce_case("matmul", kernels.matmul(33, 17, 29), rng))
  out.append(_reduce_case("matmul_batched", kernels.matmul(5, 7, 9, batch=(3,)), rng))
  out.append(_reduce_case("matmul_f16_acc32", kernels.matmul(9, 10, 11, dtype=dtypes.float16, acc_dtype=f32), rng))
  out.append(_reduce_case("matmul_local", kernels.matmul(20, 24, 8), rng, opts=[Opt(OptOps.LOCAL, 1, 16)]))
  # byte products (DOT4) on full-range words, summed in the accumulator: a CPU vector of 8, 16 or 32 lanes takes vpdpbusd where
  # the target has it, the widened products elsewhere; the off-vector edge (n = 52) a scalar tail
  dot4 = kernels.matmul_dot4(6, 52, 37)
  out.append(Case("matmul_dot4", dot4, [_fill(dtypes.int32, 6 * 52), _words(rng, 6 * 37), _words(rng, 37 * 52)]))
  # sizes off every tile edge, a batch, 16-bit inputs: the shapes CUDA's tiled matmul (SIMT and tensor cores) must cover
  out.append(_reduce_case("matmul_tiled", kernels.matmul(70, 40, 50), rng))
  out.append(_reduce_case("matmul_tiled_f16_batch", kernels.matmul(40, 48, 64, dtype=dtypes.float16, batch=(2,), acc_dtype=f32), rng))
  out.append(_reduce_case("matmul_tiled_bf16", kernels.matmul(24, 16, 32, dtype=dtypes.bfloat16, acc_dtype=f32), rng))
  shape = (7, 45)
  ex = TRANSCENDENTAL_RTOL["float32"]
  # the sum part sums what exp made (non-negative, as in a softmax): a GPU tree sums it in another order, and a relative bound on
  # a sum whose terms cancel says nothing (random signed inputs once failed it by 6e-6 on an H100, by the data's luck alone)
  for part, tol in zip(kernels.softmax_parts(shape, f32), (None, ex, ex, None)):
    out.append(_reduce_case(part.arg, part, rng, tol=tol, lo=0 if part.arg == "softmax_sum" else -4))
  out.append(_reduce_case("softmax_fused", kernels.softmax((3, 300), f32), rng, tol=1e-5))
  out.append(_reduce_case("softmax_fused_ax0", kernels.softmax(shape, f32, axis=0), rng, tol=1e-5))
  # symbolic sizes
  n, m = UOp.variable("n", 1, 300), UOp.variable("m", 1, 64)
  out.append(_reduce_case("ew_symbolic", kernels.elementwise(lambda a, b: a * b + a, f32, ((n, 3), f32), ((n, 3), f32)), rng, var_vals={"n": 257}))
  out.append(_reduce_case("sum_symbolic_rows", kernels.reduce_sum((n, 7), f32, 1), rng, var_vals={"n": 259}))
  out.append(_reduce_case("sum_symbolic_full", kernels.reduce_sum((n,), f32), rng, var_vals={"n": 283}, tol=1e-5))
  out.append(_reduce_case("matmul_symbolic", kernels.matmul(m, 12, n), rng, var_vals={"m": 37, "n": 11}))
  # gated loads and stores: out[i] = x[i-1] (i > 0) + x[i+1] (i < 99), stored for i < n only
  i, x = UOp.range(100, 0), UOp.define_global(1, f32.ptr(100))
  val = x.index(i - 1, gate=i > 0).load() + x.index(i + 1, gate=i < 99).load()
  gated = UOp.sink(UOp.define_global(0, f32.ptr(100)).index(i, gate=i < n).store(val), name="gated")
  out.append(_reduce_case("gated", gated, rng, var_vals={"n": 77}))
  # a reduction over gated loads, and two stores of different sizes sharing the grid
  r, j, y = UOp.range(64, 1, AxisType.REDUCE), UOp.range(10, 0), UOp.define_global(2, dtypes.int32.ptr(640))
  red = y.index(j * 64 + r, gate=r < j * 7).load().reduce(Ops.MAX, r)
  k = UOp.range(640, 2)
  ast = UOp.sink(UOp.define_global(0, dtypes.int32.ptr(10)).index(j).store(red),
                 UOp.define_global(1, dtypes.int32.ptr(640)).index(k).store(y.index(k).load() * 3), name="gated_max")
  out.append(_reduce_case("gated_max_two_sizes", ast, rng))
  return out


def cases() -> list[Case]:
  return [elementwise_case(dt) for dt in ALL_DTYPES] + structured_cases()


# a kernel that sums in its own order with fused multiply-adds (CUDA's tiled matmul, applied_opts "TILED_MATMUL(...)"): the error
# allowed relative to the output's largest magnitude, per output dtype (float32 sums; the 16-bit outputs round once more)
REORDERED_SUM_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def for_spec(case: Case, applied_opts: list[str]) -> Case:
  """The case as a kernel rendered with these options must meet it: a tiled matmul's output gets REORDERED_SUM_TOL."""
  if not any(o.startswith("TILED_MATMUL") for o in applied_opts): return case
  outs = {st.src[0].src[0].arg: st.src[0].src[0].dtype.base for st in case.ast.src}  # type: ignore[attr-defined]
  return replace(case, scale_tol={**case.scale_tol, **{s: REORDERED_SUM_TOL[dt.name] for s, dt in outs.items()}})


def _as_float(dt: DType, a: np.ndarray) -> np.ndarray: return bf16_bits_to_f32(a) if dt == dtypes.bfloat16 else a


def mismatches(case: Case, got: list[np.ndarray], want: list[np.ndarray] | None = None) -> list[str]:
  """What differs between a runtime's buffers and the reference's (empty when they agree)."""
  want = want if want is not None else case.expected()
  globals_ = {u.arg: u.dtype.base for u in case.ast.toposort() if u.op is Ops.DEFINE_GLOBAL}  # type: ignore[attr-defined]
  errs = []
  for slot, (g, w) in enumerate(zip(got, want)):
    dt = globals_[slot]
    if not dt.is_float:
      bad = np.nonzero(g != w)[0]
    else:
      gf, wf = _as_float(dt, g).astype(np.float64), _as_float(dt, w).astype(np.float64)
      same = (gf == wf) & (np.signbit(gf) == np.signbit(wf)) | (np.isnan(gf) & np.isnan(wf))
      if (rt := case.tol.get(slot)) is not None:
        tiny = float(np.finfo(np.float16 if dt.itemsize == 2 else dt.np).tiny)
        with np.errstate(invalid="ignore"):
          same |= np.isclose(gf, wf, rtol=rt, atol=tiny) | ((gf == wf) & (gf == 0))
      if (st := case.scale_tol.get(slot)) is not None and len(wf):
        with np.errstate(invalid="ignore"):
          same |= np.abs(gf - wf) <= st * float(np.nanmax(np.abs(wf)))
      bad = np.nonzero(~same)[0]
    if len(bad):
      k = bad[0]
      errs.append(f"{case.name} slot {slot} ({case.labels.get(slot, dt)}): {len(bad)} of {len(w)} differ, first at {k}: got {g[k]!r}, want {w[k]!r}")
  return errs
