"""Differential fuzzer: random kernel ASTs run by every backend and compared with kiln.ir.reference, the oracle.

A case is drawn by hypothesis (seeded, so a run is reproducible and a failure shrinks to a small kernel): one or two
stores over 0-2 output axes (sizes 0, 1, primes, powers of two; one may be a DEFINE_VAR bound at run time), a value tree
over every dtype (every ALU op the dtype takes, casts, bitcasts, constants, range indices, variables), loads from input
buffers laid out over random subsets and orders of the axes (broadcast and strided), gated loads (a shifted index gated
to stay in bounds, or an unrelated condition) and gated stores, and REDUCE ADD/MUL/MAX over one or two ranges (listed in
random order, nested reduces too). Input data comes from a numpy seed the case carries: integers over the whole range
with edge values, floats in [-4, 4] with a few zeros, infinities and NaNs.

Backends: the CPU (LLVM) with the heuristic options, with opts=[] and with random explicit options (UPCAST, UNROLL, PACK, FMA, OUTER,
KEEP, THREAD; a list the lowering rejects with CodegenError is counted, not failed), and CUDA C under the CPU emulation harness.
Every buffer they run on sits between inaccessible guard pages (KILN_GUARD; --no-guard turns it off), so a kernel that strays
outside its buffers faults; the case under way is kept in OUT/inflight.json until it finishes, for --replay.

Comparison (`compare`): integers and bools exactly; floats bit for bit with NaN == NaN, except a store whose value holds a
transcendental (EXP2/LOG2/SIN/ERF/TANH: libm or the device library vs numpy) or a float ADD/MUL reduction the backend sums in
another order (UPCAST or THREAD on its axis on the CPU, GROUP on CUDA) or with fused multiply-adds (FMA). Those compare
NaN/inf positions exactly and finite values within TOL: |got - want| <= rtol * (|want| + max|want| over the store's finite values) + tiny, with
rtol = eps(dtype) * (16 + 4 * reduced elements). To keep that well conditioned the generator never feeds an approximate
value into a discontinuous op (compare, cast to int or bool, bitcast, trunc, integer ops) or into a transcendental, clamps
MUL-reduce bodies to [-2, 2] and keeps half-precision reductions short.

The graph layer is fuzzed beside them (graph_fuzz.py): random tensor programs against numpy and random ONNX graphs against
onnxruntime (--graph G, --onnx O), and ONNX cases at the edges (edge_fuzz.py), under guard pages too: Gather indices at and
past the ends of their axis (--gather), constants in external data, valid and hostile (--extdata), and reductions over
2**31 - 1 to 2**32 + k broadcast elements (--boundary).

`python tests/fuzz/kfuzz.py N` (or scripts/fuzz N) runs N cases and writes every failing case, shrunk, as JSON
(`{"ast": kiln.ir.serialize.to_json(ast), "seed": ..., "var_vals": ..., "opts": ..., "backend": ...}`) with a one-line
replay command: `scripts/fuzz --replay FILE`.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kiln.codegen.choose import Opt, OptOps
from kiln.ir.alu import from_storage, round_to, to_storage
from kiln.ir.dtype import ALL_DTYPES, DType, PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import AxisType, GroupOp, Ops
from kiln.ir.reference import evaluate
from kiln.ir.serialize import from_json, to_json
from kiln.ir.uop import UOp

INTS = [d for d in ALL_DTYPES if d.is_int]
FLOATS = [d for d in ALL_DTYPES if d.is_float]
SIZES = [0, 1, 1, 2, 3, 4, 5, 7, 8, 8, 13, 16, 16, 17, 31, 32, 32, 64, 64]
TRANSCENDENTAL = (Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.ERF, Ops.TANH)
TINY = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -126, "float32": 2.0 ** -126, "float64": 2.0 ** -1022}
MAX_RANGES = 5
AVOID = set(filter(None, os.environ.get("KILN_FUZZ_AVOID", "").split(",")))  # known bugs to steer around: empty,upcast3,nested


# ---- the case ----
@dataclass
class Case:
  ast: UOp
  seed: int  # numpy seed of the input data
  var_vals: dict[str, int] = field(default_factory=dict)
  opts: list[Opt] | None = None  # random explicit CPU options (None: none drawn)

  def to_dict(self, backend: str = "", error: str = "") -> dict[str, Any]:
    return {"ast": json.loads(to_json(self.ast)), "seed": self.seed, "var_vals": self.var_vals,
            "opts": None if self.opts is None else [[o.op.value, o.axis, o.amount] for o in self.opts], "backend": backend, "error": error}

  @staticmethod
  def from_dict(d: dict[str, Any]) -> Case:
    opts = None if d.get("opts") is None else [Opt(OptOps(o), a, n) for o, a, n in d["opts"]]
    return Case(from_json(json.dumps(d["ast"])), int(d["seed"]), dict(d.get("var_vals") or {}), opts)


# ---- generation ----
class _Gen:
  """Builds one kernel from hypothesis draws. Values carry an `approx` flag: derived from a transcendental or a float ADD/MUL
  reduction (a backend may differ from the reference in the last places there), so they never reach a discontinuous op."""

  def __init__(self, draw: Callable[[Any], Any]):
    self.draw = draw
    self.next_axis = 0
    self.slots: list[UOp] = []
    self.nranges = 0
    self.var: UOp | None = None
    self.in_reduce = 0

  def b(self, p: float = 0.5) -> bool: return self.draw(st.integers(0, 999)) >= 1000 - p * 1000  # 0 (what shrinking aims at) is False
  def pick(self, xs: list) -> Any: return xs[self.draw(st.integers(0, len(xs) - 1))]

  def new_range(self, size: int | UOp, kind: AxisType) -> UOp:
    r = UOp.range(size, self.next_axis, kind)
    self.next_axis += 1
    self.nranges += 1
    return r

  def new_slot(self, dt: DType, size: int) -> UOp:
    g = UOp.define_global(len(self.slots), dt.ptr(max(1, size)))
    self.slots.append(g)
    return g

  @staticmethod
  def extent(r: UOp) -> int:
    e = r.src[0]
    if e.op is Ops.CONST: return int(e.arg)
    v = e if e.op is Ops.DEFINE_VAR else e.src[0]
    return int(v.arg[2])

  def layout(self, axes: list[UOp]) -> tuple[UOp, int]:
    """A row-major index over `axes` (in the given order) and the elements it spans."""
    idx: UOp = UOp.const(dtypes.index, 0)
    stride = 1
    for r in reversed(axes):
      idx = idx + r * stride if stride != 1 else idx + r
      stride *= max(1, self.extent(r))
    return idx, stride

  # ---- leaves ----
  def load(self, dt: DType, scope: list[UOp]) -> UOp:
    k = self.draw(st.integers(0, len(scope))) if scope else 0
    axes = list(self.draw(st.permutations(scope)))[:k] if scope else []
    idx, n = self.layout(axes)
    mode = self.draw(st.integers(0, 9))
    if mode == 0 and axes:  # shifted index, gated to stay inside the buffer
      off = self.draw(st.integers(-3, 3))
      g = self.new_slot(dt, n)
      j = idx + off
      return g.index(j, (j >= 0) & (j < n)).load()
    if mode == 1 and axes:  # gated by an unrelated condition
      g = self.new_slot(dt, n)
      r = self.pick(axes)
      return g.index(idx, r < self.draw(st.integers(0, 5))).load()
    return self.new_slot(dt, n).index(idx).load()

  def const(self, dt: DType) -> UOp:
    if dt.is_bool: return UOp.const(dt, self.b())
    if dt.is_int: return UOp.const(dt, self.pick([0, 1, 2, 3, 5, 7, 8, 31, -1, -7, int(dt.min), int(dt.max), 1000, 65537]))
    return UOp.const(dt, self.pick([0.0, -0.0, 1.0, -1.0, 0.5, 2.5, -3.25, 0.1, 3.0, 1e-3, float("inf"), float("nan")]))

  def leaf(self, dt: DType, scope: list[UOp]) -> UOp:
    k = self.draw(st.integers(0, 9))
    if k <= 5: return self.load(dt, scope)
    if k <= 7: return self.const(dt)
    if k == 8 and scope: return self.pick(scope).cast(dt)
    if self.var is not None: return self.var.cast(dt)
    return self.load(dt, scope)

  # ---- trees ----
  def value(self, dt: DType, scope: list[UOp], depth: int, exact: bool) -> tuple[UOp, bool]:
    """A value of dtype dt over the ranges in scope; returns (node, approx). exact=True forbids approximate values."""
    if depth <= 0 or self.draw(st.integers(0, 3)) == 0: return self.leaf(dt, scope), False
    k = self.draw(st.integers(0, 11))
    if (k == 0 or self.b(0.15)) and self.nranges < MAX_RANGES and not (exact and dt.is_float) and not (self.in_reduce and "nested" in AVOID):
      return self.reduce(dt, scope, depth)
    if k == 1:  # cast from another dtype
      src = self.pick(list(ALL_DTYPES))
      v, a = self.value(src, scope, depth - 1, exact or not (src.is_float and dt.is_float))
      return v.cast(dt), a
    if k == 2:  # bitcast from a dtype of the same size
      same = [d for d in ALL_DTYPES if d.itemsize == dt.itemsize and d != dt and not d.is_bool and not dt.is_bool]
      if same:
        v, _ = self.value(self.pick(same), scope, depth - 1, True)
        return v.bitcast(dt), False
    if k == 3:  # where
      c, _ = self.value(dtypes.bool, scope, depth - 1, True)
      x, a1 = self.value(dt, scope, depth - 1, exact)
      y, a2 = self.value(dt, scope, depth - 1, exact)
      return c.where(x, y), a1 or a2
    if dt.is_bool: return self.bool_op(scope, depth)
    if dt.is_int: return self.int_op(dt, scope, depth)
    return self.float_op(dt, scope, depth, exact)

  def bool_op(self, scope: list[UOp], depth: int) -> tuple[UOp, bool]:
    k = self.draw(st.integers(0, 3))
    if k == 0:
      x, _ = self.value(dtypes.bool, scope, depth - 1, True)
      y, _ = self.value(dtypes.bool, scope, depth - 1, True)
      return x.alu(self.pick([Ops.AND, Ops.OR, Ops.XOR, Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPNE, Ops.CMPEQ, Ops.CMPLT]), y), False
    src = self.pick(list(ALL_DTYPES))
    x, _ = self.value(src, scope, depth - 1, True)
    y, _ = self.value(src, scope, depth - 1, True)
    return x.alu(self.pick([Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE]), y), False

  def int_op(self, dt: DType, scope: list[UOp], depth: int) -> tuple[UOp, bool]:
    op = self.pick([Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.NEG, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR])
    x, _ = self.value(dt, scope, depth - 1, True)
    if op is Ops.NEG: return x.alu(Ops.NEG), False
    y, _ = self.value(dt, scope, depth - 1, True)
    return x.alu(op, y), False

  def float_op(self, dt: DType, scope: list[UOp], depth: int, exact: bool) -> tuple[UOp, bool]:
    ops = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.MAX, Ops.NEG, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC, Ops.MULACC]
    op = self.pick(ops + ([] if exact else list(TRANSCENDENTAL) * 2))
    if op in TRANSCENDENTAL or op is Ops.TRUNC:  # discontinuous or badly conditioned on approximate input
      x, _ = self.value(dt, scope, depth - 1, True)
      return x.alu(op), op in TRANSCENDENTAL
    x, a = self.value(dt, scope, depth - 1, exact)
    if op in GroupOp.Unary: return x.alu(op), a
    y, b = self.value(dt, scope, depth - 1, exact)
    if op is Ops.MULACC:
      z, c = self.value(dt, scope, depth - 1, exact)
      return x.alu(Ops.MULACC, y, z), a or b or c
    return x.alu(op, y), a or b

  def reduce(self, dt: DType, scope: list[UOp], depth: int) -> tuple[UOp, bool]:
    op = self.pick([Ops.ADD, Ops.MUL, Ops.MAX])
    cap = 16 if dt.itemsize <= 2 and dt.is_float else 8 if op is Ops.MUL and dt.is_float else 64
    n = self.draw(st.integers(1, 2)) if self.nranges + 2 <= MAX_RANGES else 1
    rs = [self.new_range(self.pick([s for s in SIZES if s <= cap]), AxisType.REDUCE) for _ in range(n)]
    self.in_reduce += 1
    body, a = self.value(dt, scope + rs, depth - 1, False)
    self.in_reduce -= 1
    if op is Ops.MUL and dt.is_float: body = body.maximum(-2.0).minimum(2.0)  # products stay inside the dtype's range
    listed = list(self.draw(st.permutations(rs)))  # the first listed range is the outer loop, whatever its axis id
    return body.reduce(op, *listed), a or (dt.is_float and op is not Ops.MAX)


@st.composite
def cases(draw: Callable[[Any], Any], cuda: bool = False) -> Case:
  g = _Gen(draw)
  nout = draw(st.integers(0, 2))
  sym = nout > 0 and g.b(0.3)
  out: list[UOp] = []
  var_vals: dict[str, int] = {}
  for i in range(nout):
    size = g.pick([s for s in SIZES if s or "empty" not in AVOID])
    if sym and i == 0:
      hi = max(1, size)
      lo = draw(st.integers(0 if "empty" not in AVOID else 1, min(1, hi)))
      g.var = UOp.variable("n", lo, hi)
      var_vals["n"] = draw(st.integers(lo, hi))
      out.append(g.new_range(g.var, AxisType.LOOP))
    else: out.append(g.new_range(size, AxisType.LOOP))
  stores = []
  for s in range(draw(st.integers(1, 2))):
    axes = out if s == 0 else out[:draw(st.integers(0, len(out)))]
    dt = g.pick(list(ALL_DTYPES))
    v, _ = g.value(dt, axes, draw(st.integers(0, 4)), False)
    idx, n = g.layout(axes)
    dst = g.new_slot(dt, n)
    gate = None
    if axes and g.b(0.2): gate = (g.pick(axes) % 2).eq(0) if g.b() else g.pick(axes) < draw(st.integers(0, 6))
    stores.append(dst.index(idx, gate).store(v))
  opts = draw(random_opts(UOp.sink(*stores))) if not cuda else None
  return Case(UOp.sink(*stores, name="fuzz"), draw(st.integers(0, 2**32 - 1)), var_vals, opts)


@st.composite
def random_opts(draw: Callable[[Any], Any], ast: UOp) -> list[Opt]:
  """A few CPU options that are usually valid: amounts dividing constant axes, one UPCAST among the output axes and one
  among the reduce axes (a nested row reduce may be vectorised beside its output), THREAD into 2-16 chunks, and sometimes PACK, FMA,
  OUTER and KEEP; or, one time in five, one of the option sets the tuner times for this kernel on this host."""
  if draw(st.integers(0, 4)) == 0:  # one of the option sets a tuner would time (kiln.codegen.choose.search), this host's target
    from kiln.codegen.choose.search import candidates
    from kiln.runtime.cpu.device import cpu_target
    try: cands = candidates(ast, cpu_target())
    except CodegenError: cands = []
    if cands: return list(cands[draw(st.integers(0, len(cands) - 1))])
  rngs = ast.ranges()
  by_id = {r.arg[0]: r for r in rngs}
  opts: list[Opt] = []
  used: set[int] = set()
  for _ in range(draw(st.integers(0, 3))):
    if not rngs: break
    r = rngs[draw(st.integers(0, len(rngs) - 1))]
    e = r.src[0]
    kind = draw(st.sampled_from([OptOps.UPCAST, OptOps.UNROLL, OptOps.THREAD]))
    if kind is OptOps.THREAD:
      if any(o.op is OptOps.THREAD for o in opts): continue
      opts.append(Opt(kind, r.arg[0], draw(st.sampled_from([2, 3, 4, 5, 7, 16]))))  # chunks: fewer, as many or more than the units
      continue
    upcast_here = [o for o in opts if o.op is OptOps.UPCAST and by_id[o.axis].arg[1] is r.arg[1]]  # same kind of axis
    if e.op is not Ops.CONST or r.arg[0] in used or (kind is OptOps.UPCAST and upcast_here): continue
    divs = [d for d in (2, 3, 4, 8, 16) if int(e.arg) % d == 0 and not (d == 3 and kind is OptOps.UPCAST and "upcast3" in AVOID)]
    if not divs: continue
    used.add(r.arg[0])
    opts.append(Opt(kind, r.arg[0], draw(st.sampled_from(divs))))
  # the matmul options beside them (a PACK with its reduce axis unrolled whole once read its panel before packing it):
  # PACK/FMA on a reduce axis, OUTER on an output axis; a combination the lowering refuses is counted, not failed
  # (and KEEP, which applies only where the store computes a reduce's body again; elsewhere it is refused and counted)
  for kind, axis_type in ((OptOps.PACK, AxisType.REDUCE), (OptOps.FMA, AxisType.REDUCE), (OptOps.OUTER, AxisType.LOOP),
                          (OptOps.KEEP, AxisType.REDUCE)):
    axes = [r for r in rngs if r.arg[1] is axis_type and r.src[0].op is Ops.CONST]
    if axes and draw(st.integers(0, 3)) == 0: opts.append(Opt(kind, axes[draw(st.integers(0, len(axes) - 1))].arg[0], 1))
  return opts


# ---- inputs and comparison ----
def _edge(dt: DType) -> list:
  if dt.is_bool: return [False, True]
  if dt.is_int: return [v for v in (0, 1, -1, 2, 7, -8, int(dt.min), int(dt.max), int(dt.max) - 1) if dt.min <= v <= dt.max]
  return [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 0.5]


def make_inputs(case: Case) -> list[np.ndarray]:
  """One flat array per slot in storage form, filled from the case's seed (outputs too: a skipped store keeps the filler)."""
  rng = np.random.default_rng(case.seed)
  gl = {u.arg: u for u in case.ast.toposort() if u.op is Ops.DEFINE_GLOBAL}
  bufs = []
  for slot in range(max(gl, default=-1) + 1):
    if (g := gl.get(slot)) is None:  # a slot whose only use was folded away: any array will do
      bufs.append(np.zeros(1, np.uint8))
      continue
    pt = g.dtype
    assert isinstance(pt, PtrDType)
    dt, n = pt.base, pt.size
    if dt.is_bool: v = rng.integers(0, 2, n).astype(bool)
    elif dt.is_int:
      small = rng.integers(-9, 10, n) if dt.kind == "i" else rng.integers(0, 20, n)
      big = rng.integers(int(dt.min), int(dt.max), n, dtype=np.int64 if dt.kind == "i" else np.uint64, endpoint=True)
      v = np.where(rng.random(n) < 0.5, small.astype(dt.np), big.astype(dt.np)).astype(dt.np)
    else:
      v = np.round(rng.uniform(-4, 4, n) * 64) / 64 if rng.random() < 0.5 else rng.uniform(-4, 4, n)
    ed = _edge(dt)
    mask = rng.random(n) < 0.06
    if dt.is_float:
      with np.errstate(all="ignore"):
        v = np.where(mask, np.asarray(ed, np.float64)[rng.integers(0, len(ed), n)], v)
        arr = to_storage(dt, round_to(dt, v.astype(np.float32 if dt.itemsize <= 4 else np.float64)))
    elif dt.is_int:
      pick = np.asarray(ed, dtype=np.int64 if dt.kind == "i" else np.uint64)[rng.integers(0, len(ed), n)].astype(dt.np)
      arr = np.where(mask, pick, v)
    else: arr = v
    bufs.append(np.ascontiguousarray(np.asarray(arr, dtype=dt.np)))
  return bufs


def _reordered_axes(applied: list[str], device: str) -> set[int] | None:
  """Reduce axes a backend sums in another order than the reference; None: every float sum (FMA rounds a*b+c once)."""
  out = set()
  for s in applied:
    if s.startswith(("FMA", "TILED_MATMUL")): return None  # CUDA's tiled matmul fuses and reorders its sums
    if (m := re.match(r"(\w+)\(axis=(\d+), (\d+)\)", s)) and m.group(1) in (("GROUP",) if device == "CUDA" else ("UPCAST", "THREAD")):
      out.add(int(m.group(2)))
  return out


def tolerances(case: Case, applied: list[str], device: str) -> dict[int, float]:
  """slot -> relative tolerance (0: bit-exact) for each store, from what its value holds and how the backend reduces."""
  reordered = _reordered_axes(applied, device)
  tol: dict[int, float] = {}
  for stv in case.ast.src:
    slot, dt = stv.src[0].src[0].arg, stv.src[1].dtype
    nodes = stv.src[1].toposort()
    # the approximate nodes: their rounding error is in their own dtype, which may be narrower than the store's (a float32
    # exp2 cast to float64 keeps its float32 ulp), so the tolerance takes the coarsest epsilon among them and the store
    inexact = [u for u in nodes if u.op in TRANSCENDENTAL]
    n_red = 1
    for u in nodes:
      if u.op is Ops.REDUCE and u.dtype.is_float and u.arg is not Ops.MAX:
        n_red *= max(1, math.prod(_Gen.extent(r) for r in u.src[1:]))
        if reordered is None or any(r.arg[0] in reordered for r in u.src[1:]): inexact.append(u)
    if inexact and isinstance(dt, DType) and dt.is_float:
      eps = max([dt.eps] + [u.dtype.scalar().eps for u in inexact])
      tol[slot] = max(tol.get(slot, 0.0), eps * (16 + 4 * n_red))
  return tol


def compare(case: Case, got: list[np.ndarray], want: list[np.ndarray], tol: dict[int, float]) -> list[str]:
  """Mismatch messages per slot (empty when everything agrees)."""
  bad = []
  values = {st.src[0].src[0].arg: st.src[1] for st in case.ast.src}
  for slot, val in values.items():
    g, w = got[slot], want[slot]
    dt = val.dtype
    assert isinstance(dt, DType)
    if not dt.is_float:
      ne = g != w
      if (fv := _float_under_bitcasts(val)) is not None and (fdt := fv.dtype.scalar()).name in NAN_BITS and _arithmetic(fv):
        # a float's bits after arithmetic: the sign and payload of a NaN that arithmetic made are not specified (IEEE
        # 754 6.3; LLVM folds x + -y into x - y, whose NaN keeps y's sign), so any NaN equals any NaN, as in float
        # slots. A NaN only loaded, negated, selected or a constant keeps its bits exactly.
        ne &= ~(_nan_bits(fdt.name, g) & _nan_bits(fdt.name, w))
      if ne.any(): bad.append(_diff(slot, dt, g, w, np.flatnonzero(ne)))
      continue
    gf, wf = from_storage(dt, g).astype(np.float64), from_storage(dt, w).astype(np.float64)
    gn, wn = np.isnan(gf), np.isnan(wf)
    if (r := tol.get(slot, 0.0)) == 0:
      ne = ~((gn & wn) | ((g.view(f"u{dt.itemsize}") == w.view(f"u{dt.itemsize}")) & ~gn & ~wn))
    else:
      fin = np.isfinite(wf)
      scale = float(np.max(np.abs(wf[fin]), initial=0.0))
      with np.errstate(all="ignore"):
        close = np.abs(gf - wf) <= r * (np.abs(wf) + scale) + TINY[dt.name] * 4
      ne = ~np.where(fin, close & np.isfinite(gf), (gn & wn) | (gf == wf))
    if ne.any(): bad.append(_diff(slot, dt, gf, wf, np.flatnonzero(ne), r))
  return bad


# exponent and mantissa masks of each float format: a NaN has every exponent bit set and some mantissa bit
NAN_BITS = {"float16": (0x7C00, 0x3FF), "bfloat16": (0x7F80, 0x7F), "float32": (0x7F800000, 0x7FFFFF),
            "float64": (0x7FF0000000000000, 0xFFFFFFFFFFFFF)}


_BIT_EXACT_FLOAT_OPS = frozenset({Ops.LOAD, Ops.CONST, Ops.BITCAST, Ops.NEG, Ops.WHERE, Ops.VECTORIZE, Ops.GEP})


def _float_under_bitcasts(v: UOp) -> UOp | None:
  """The float value an integer value is the bits of, through any chain of BITCASTs (int16 -> uint16 -> int16), or None."""
  while v.op is Ops.BITCAST:
    v = v.src[0]
    if not isinstance(v.dtype, PtrDType) and v.dtype.is_float: return v
  return None


def _arithmetic(v: UOp) -> bool:
  """Whether float value v went through arithmetic (anything but loads, constants, bitcasts, NEG and selects)."""
  return any(not isinstance(u.dtype, PtrDType) and u.dtype.is_float and u.op not in _BIT_EXACT_FLOAT_OPS for u in v.toposort())


def _nan_bits(fmt: str, a: np.ndarray) -> np.ndarray:
  """Which integers of `a` hold the bits of a NaN of float format `fmt` (of the same size)."""
  exp, man = NAN_BITS[fmt]
  u = a.view(f"u{a.dtype.itemsize}").astype(np.uint64)
  return ((u & np.uint64(exp)) == np.uint64(exp)) & ((u & np.uint64(man)) != 0)


def _diff(slot: int, dt: DType, g: np.ndarray, w: np.ndarray, where: np.ndarray, tol: float = 0.0) -> str:
  i = where[:4].tolist()
  how = "bit-exact" if tol == 0 else f"rtol {tol:.3g}"
  return f"slot {slot} ({dt}, {how}): {len(where)} of {len(g)} elements differ, e.g. at {i}: got {g[i].tolist()} want {w[i].tolist()}"


# ---- backends ----
@dataclass
class Result:
  ok: bool
  backend: str
  msg: str = ""
  rejected: bool = False  # random options the lowering refused (CodegenError): not a failure


class GUARD:
  """Every buffer a backend runs on sits between guard pages (KILN_GUARD); main() sets where the running case is kept."""
  on = True
  inflight: Path | None = None


def guarded(arrays: list[np.ndarray]) -> list[np.ndarray]:
  """The case's buffers copied between inaccessible pages (kiln.runtime.cpu.guard): a read or write outside them faults
  at once. The case being run is written to GUARD.inflight first, so a fault leaves it behind for --replay."""
  if not GUARD.on: return arrays
  from kiln.runtime.cpu.guard import guarded_copy
  return [guarded_copy(a) for a in arrays]


def run_cpu(case: Case, opts: list[Opt] | None, label: str) -> Result:
  from kiln.codegen.registry import get_runtime
  rt = get_runtime("CPU")
  try: spec = rt.renderer.render(case.ast) if opts is None else rt.renderer.render(case.ast, opts)
  except CodegenError as e:
    if label == "cpu-random": return Result(True, label, str(e), rejected=True)
    return Result(False, label, f"render failed: {type(e).__name__}: {e}")
  except Exception as e: return Result(False, label, f"render crashed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
  try: prog = rt.load(rt.compiler.compile(spec))
  except Exception as e: return Result(False, label, f"compile failed: {type(e).__name__}: {str(e)[:2000]}")
  want = make_inputs(case)
  evaluate(case.ast, want, case.var_vals)
  got = guarded(make_inputs(case))
  ptrs = [got[s].ctypes.data for s in spec.globals]
  try: prog(ptrs, [case.var_vals[v] for v in spec.var_names if v != "core_id"])
  except Exception as e: return Result(False, label, f"run failed: {type(e).__name__}: {e}")
  bad = compare(case, got, want, tolerances(case, list(spec.applied_opts), "CPU"))
  return Result(not bad, label, f"opts {spec.applied_opts}: " + "; ".join(bad) if bad else "")


def cuda_available() -> bool:
  import shutil
  return any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++"))


def run_cuda(case: Case) -> Result:
  from kiln.codegen.render.cuda import CUDARenderer
  from kiln.codegen.spec import sym_eval
  from kiln.runtime.cuda.emulate import EmulatedProgram
  label = "cuda-emu"
  try: spec = CUDARenderer().render(case.ast)
  except Exception as e: return Result(False, label, f"render failed: {type(e).__name__}: {e}")
  try: prog = EmulatedProgram(spec)
  except Exception as e: return Result(False, label, f"emulator build failed: {type(e).__name__}: {str(e)[:2000]}")
  want = make_inputs(case)
  evaluate(case.ast, want, case.var_vals)
  got = guarded(make_inputs(case))
  vals = [case.var_vals[v] for v in spec.var_names]
  try: prog([got[s].ctypes.data for s in spec.globals], vals)
  except Exception as e:
    gs = [sym_eval(x, dict(zip(spec.var_names, vals))) for x in (spec.global_size or (1, 1, 1))]
    return Result(False, label, f"run failed (grid {gs}): {type(e).__name__}: {e}")
  bad = compare(case, got, want, tolerances(case, list(spec.applied_opts), "CUDA"))
  return Result(not bad, label, f"opts {spec.applied_opts}: " + "; ".join(bad) if bad else "")


def check_case(case: Case, cuda: bool = False) -> list[Result]:
  """Every backend on one case; the reference must accept the case (the generator builds only valid kernels)."""
  from kiln.ir.verify import verify
  try:
    verify(case.ast)
    evaluate(case.ast, make_inputs(case), case.var_vals)
  except Exception as e: return [Result(False, "reference", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")]
  if cuda: return [run_cuda(case)]
  res = [run_cpu(case, None, "cpu-heuristic"), run_cpu(case, [], "cpu-noopts")]
  if case.opts: res.append(run_cpu(case, case.opts, "cpu-random"))
  return res


# ---- index expressions: simplify() keeps the value; vmin/vmax hold every value ----
@dataclass
class IndexCase:
  expr: UOp
  points: list[dict[str, int]]


@st.composite
def index_exprs(draw: Callable[[Any], Any]) -> IndexCase:
  nv = draw(st.integers(1, 3))
  vs = []
  for i in range(nv):
    lo = draw(st.integers(-40, 40))
    vs.append(UOp.variable(f"v{i}", lo, lo + draw(st.integers(0, 60))))
  consts = [0, 1, 2, 3, 4, 5, 7, 8, 16, -1, -3, -8]

  def expr(d: int) -> UOp:
    if d == 0 or draw(st.integers(0, 3)) == 0:
      return vs[draw(st.integers(0, nv - 1))] if draw(st.booleans()) else UOp.const(dtypes.int32, draw(st.sampled_from(consts)))
    op = draw(st.sampled_from(["+", "-", "*c", "//c", "%c", "//", "%", "max", "min", "where", "neg", "<<", ">>", "*"]))
    a = expr(d - 1)
    c = draw(st.sampled_from([x for x in consts if x != 0] if op in ("//c", "%c") else consts))
    if op == "+": return a + expr(d - 1)
    if op == "-": return a - expr(d - 1)
    if op == "*": return a * expr(d - 1)
    if op == "*c": return a * c
    if op == "//c": return a // c
    if op == "%c": return a % c
    if op == "//": return a // expr(d - 1)
    if op == "%": return a % expr(d - 1)
    if op == "max": return a.maximum(expr(d - 1))
    if op == "min": return a.minimum(expr(d - 1))
    if op == "where": return (a < expr(d - 1)).where(expr(d - 1), expr(d - 1))
    if op == "neg": return -a
    if op == "<<": return a << draw(st.integers(0, 4))
    return a >> draw(st.integers(0, 4))

  e = expr(draw(st.integers(1, 5)))
  pts = []
  for _ in range(8):
    pts.append({v.arg[0]: draw(st.integers(v.arg[1], v.arg[2])) for v in vs})
  pts += [{v.arg[0]: v.arg[1] for v in vs}, {v.arg[0]: v.arg[2] for v in vs}]
  return IndexCase(e, pts)


def check_index(ic: IndexCase) -> str:
  from kiln.ir.analysis import sym_int_eval
  s = ic.expr.simplify()
  for p in ic.points:
    a = sym_int_eval(ic.expr, p)
    if (b := sym_int_eval(s, p)) != a: return f"simplify changed the value at {p}: {a} -> {b}"
    if not ic.expr.vmin <= a <= ic.expr.vmax: return f"value {a} at {p} is outside vmin/vmax [{ic.expr.vmin}, {ic.expr.vmax}]"
    if not s.vmin <= a <= s.vmax: return f"value {a} at {p} is outside the simplified vmin/vmax [{s.vmin}, {s.vmax}]"
  return ""


# ---- the runner ----
COUNTS = {"kernel_cases": 0, "cpu_runs": 0, "cuda_runs": 0, "rejected_opts": 0, "index_cases": 0, "graph_programs": 0, "onnx_graphs": 0}


def _settings(n: int, seed_: int | None, shrink: bool) -> settings:
  phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
  return settings(max_examples=n, deadline=None, database=None, derandomize=seed_ is None, phases=phases, print_blob=False,
                  suppress_health_check=list(HealthCheck))


def fuzz_kernels(n: int, seed_: int | None = None, cuda: bool = False, shrink: bool = True) -> tuple[Case, list[Result]] | None:
  """Run n cases (hypothesis, derandomized unless a seed is given); the shrunk failing case and its results, or None."""
  fail: dict[str, Any] = {}
  if n <= 0: return None

  def body(case: Case) -> None:
    COUNTS["kernel_cases"] += 1
    if (inflight := GUARD.inflight) is not None:  # a guard fault kills the process: the case stays here for --replay
      inflight.parent.mkdir(parents=True, exist_ok=True)
      inflight.write_text(json.dumps(case.to_dict("cuda-emu" if cuda else "cpu", "the process died running this case (a guard page fault?)")))
    res = check_case(case, cuda)
    for r in res:
      COUNTS["cuda_runs" if cuda else "cpu_runs"] += 1
      COUNTS["rejected_opts"] += r.rejected
    if bad := [r for r in res if not r.ok]:
      fail["case"], fail["res"] = case, res
      raise AssertionError("; ".join(f"{r.backend}: {r.msg}" for r in bad))

  test = given(cases(cuda=cuda))(body)
  test = _settings(n, seed_, shrink)(test)
  if seed_ is not None: test = seed(seed_)(test)
  try: test()
  except AssertionError:
    return fail["case"], fail["res"]
  return None


def fuzz_graph(n: int, seed_: int | None = None, onnx: bool = False) -> tuple[dict[str, Any], str] | None:
  """n random tensor programs against numpy (or, onnx=True, random ONNX graphs against onnxruntime): graph_fuzz.py. The
  shrunk failing case as a JSON-able dict and what differed, or None."""
  gf = _graph_fuzz()
  fail: dict[str, Any] = {}
  if n <= 0: return None

  def body(case: Any) -> None:
    COUNTS["onnx_graphs" if onnx else "graph_programs"] += 1
    try: msg = gf.check_onnx(*case) if onnx else gf.check_program(case)
    except Exception as e: msg = f"{type(e).__name__}: {str(e)[:300]}"
    if msg:
      fail["case"] = {"kind": "onnx", "shape": case[0], "seed": case[1], "steps": case[2]} if onnx else \
        {"kind": "graph", "shape": case.shape, "seed": case.seed, "steps": case.steps}
      fail["msg"] = msg
      raise AssertionError(msg)

  test = given(gf.onnx_chains() if onnx else gf.programs())(body)
  test = _settings(n, seed_, True)(test)
  if seed_ is not None: test = seed(seed_)(test)
  try: test()
  except AssertionError: return fail["case"], fail["msg"]
  return None


def _graph_fuzz() -> Any:
  # beside this module: in the tests.fuzz package (test_fuzz.py), or on the path of the script scripts/fuzz runs
  return importlib.import_module(f"{__package__}.graph_fuzz" if __package__ else "graph_fuzz")


def replay_graph(d: dict[str, Any]) -> int:
  gf = _graph_fuzz()
  steps = [(name, dict(p)) for name, p in d["steps"]]
  if d["kind"] == "onnx": msg = gf.check_onnx(tuple(d["shape"]), d["seed"], steps)
  else: msg = gf.check_program(gf.Program(tuple(d["shape"]), d["seed"], steps))
  print(f"  {d['kind']}: {'ok' if msg is None else 'FAIL ' + msg}")
  return 0 if msg is None else 1


def fuzz_index(n: int, seed_: int | None = None) -> tuple[IndexCase, str] | None:
  fail: dict[str, Any] = {}
  if n <= 0: return None

  def body(ic: IndexCase) -> None:
    COUNTS["index_cases"] += 1
    if msg := check_index(ic):
      fail["c"], fail["m"] = ic, msg
      raise AssertionError(msg)

  test = _settings(n, seed_, True)(given(index_exprs())(body))
  if seed_ is not None: test = seed(seed_)(test)
  try: test()
  except AssertionError: return fail["c"], fail["m"]
  return None


def write_failure(case: Case, results: list[Result], out_dir: Path) -> Path:
  out_dir.mkdir(parents=True, exist_ok=True)
  bad = [r for r in results if not r.ok]
  d = case.to_dict(bad[0].backend if bad else "", "; ".join(r.msg for r in bad))
  p = out_dir / f"fuzz-{case.ast.key[:12]}-{d['backend']}.json"
  p.write_text(json.dumps(d, indent=1))
  return p


def _edge_fuzz() -> Any:
  return importlib.import_module(f"{__package__}.edge_fuzz" if __package__ else "edge_fuzz")


def replay(path: str) -> int:
  d = json.loads(Path(path).read_text())
  if d.get("kind") in ("graph", "onnx"): return replay_graph(d)
  if d.get("kind") in _edge_fuzz().KINDS: return _edge_fuzz().replay(d, GUARD.on)  # type: ignore[no-any-return]
  case = Case.from_dict(d)
  print(f"replaying {path}: backend {d.get('backend')!r}, var_vals {case.var_vals}, opts {case.opts}")
  res = check_case(case, cuda=d.get("backend") == "cuda-emu")
  for r in res: print(f"  {r.backend}: {'ok' if r.ok else 'FAIL ' + r.msg}{' (options rejected: ' + r.msg + ')' if r.rejected else ''}")
  return 0 if all(r.ok for r in res) else 1


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="scripts/fuzz", description="kiln differential fuzzer (CPU, CUDA emulation, symbolic index expressions)")
  ap.add_argument("n", nargs="?", type=int, default=200, help="kernel cases to run on the CPU (default 200)")
  ap.add_argument("--cuda", type=int, default=None, help="kernel cases under CUDA emulation (default n // 10)")
  ap.add_argument("--index", type=int, default=None, help="index-expression cases (default 5 * n)")
  ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized, the same cases every run)")
  ap.add_argument("--out", default="fuzz-failures", help="where failing cases are written (default ./fuzz-failures)")
  ap.add_argument("--graph", type=int, default=None, help="random tensor programs against numpy (default n // 20)")
  ap.add_argument("--onnx", type=int, default=None, help="random ONNX graphs against onnxruntime (default n // 40; needs onnxruntime)")
  _edge_fuzz().add_args(ap)
  ap.add_argument("--replay", metavar="FILE", help="re-run one failing case written by an earlier run")
  ap.add_argument("--no-guard", action="store_true", help="plain numpy buffers instead of buffers between guard pages")
  a = ap.parse_args(argv)
  GUARD.on = not a.no_guard
  if GUARD.on:
    os.environ["KILN_GUARD"] = "1"  # kiln's own allocations too: the scratch of a threaded reduction, PACK and KEEP
    GUARD.inflight = Path(a.out) / "inflight.json"
  if a.replay: return replay(a.replay)
  t0, rc = time.perf_counter(), 0
  ncuda = a.n // 10 if a.cuda is None else a.cuda
  runs = (("cpu", lambda: fuzz_kernels(a.n, a.seed)),
          ("cuda", lambda: fuzz_kernels(ncuda, a.seed, cuda=True) if ncuda and cuda_available() else None))
  for label, fn in runs:
    if (f := fn()) is not None:
      p = write_failure(*f, Path(a.out))
      print(f"FAIL ({label}): {'; '.join(r.backend + ': ' + r.msg for r in f[1] if not r.ok)}\n  case: {p}\n  replay: scripts/fuzz --replay {p}")
      rc = 1
  for onnx, count in ((False, a.n // 20 if a.graph is None else a.graph), (True, a.n // 40 if a.onnx is None else a.onnx)):
    if onnx and count and importlib.util.find_spec("onnxruntime") is None:
      print("kiln fuzz: onnxruntime is not installed: ONNX graphs skipped")
      continue
    if (fg := fuzz_graph(count, a.seed, onnx)) is not None:
      Path(a.out).mkdir(parents=True, exist_ok=True)
      p = Path(a.out) / f"fuzz-{fg[0]['kind']}-{abs(hash(json.dumps(fg[0], default=list))) % 10**12:012d}.json"
      p.write_text(json.dumps({**fg[0], "error": fg[1]}, default=list, indent=1))
      print(f"FAIL ({fg[0]['kind']}): {fg[1]}\n  case: {p}\n  replay: scripts/fuzz --replay {p}")
      rc = 1
  rc |= _edge_fuzz().run(a, GUARD.on, GUARD.inflight)
  if (fi := fuzz_index(5 * a.n if a.index is None else a.index, a.seed)) is not None:
    print(f"FAIL (index): {fi[1]}\n  expr: {to_json(fi[0].expr)}")
    rc = 1
  if (inflight := GUARD.inflight) is not None: inflight.unlink(missing_ok=True)
  print(f"kiln fuzz: {COUNTS['kernel_cases']} kernel cases ({COUNTS['cpu_runs']} CPU runs, {COUNTS['rejected_opts']} random option lists rejected, "
        f"{COUNTS['cuda_runs']} CUDA emulation runs), {COUNTS['graph_programs']} tensor programs, {COUNTS['onnx_graphs']} ONNX graphs, "
        f"{COUNTS['index_cases']} index expressions, ONNX edge cases {_edge_fuzz().COUNTS}, "
        f"guard pages {'on' if GUARD.on else 'off'}, {time.perf_counter() - t0:.1f} s: "
        f"{'FAILED' if rc else 'ok'}")
  return rc


if __name__ == "__main__":
  sys.exit(main())
