"""Facts about a kernel graph that several layers need: which loops a value varies over, what a reduction starts from, and
the exact integer value of a symbolic expression. One definition each, so lowering, the reference evaluator, launch sizes
and plans cannot disagree."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kiln.ir.alu import bitcast, cast, compute_np, exec_alu
from kiln.ir.dtype import DType
from kiln.ir.errors import IRError, IRTypeError, VariableBoundsError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.uop import UOp


def free_ranges_of(nodes: Iterable[UOp]) -> dict[UOp, frozenset[UOp]]:
  """For each node (given in topological order) the RANGEs it varies over: those it uses that no REDUCE below it closes.
  A source missing from `nodes` contributes nothing (the reference evaluator leaves a BIND's variable out)."""
  free: dict[UOp, frozenset[UOp]] = {}
  for u in nodes:
    f: frozenset[UOp] = frozenset().union(*(free[s] for s in u.src if s in free))
    if u.op is Ops.RANGE: f = f | {u}
    elif u.op is Ops.REDUCE: f = f - frozenset(u.src[1:])
    free[u] = f
  return free


def free_ranges(u: UOp) -> set[UOp]:
  """RANGEs u uses that no REDUCE inside u closes: the loops a store or value runs under."""
  return set(free_ranges_of(u.toposort())[u])


def reads_stored(ast: UOp) -> bool:
  """Whether the kernel loads from a buffer it also stores to (then a recomputed element could read a value it wrote)."""
  written = {s.src[0].src[0].arg for s in ast.src if s.op is Ops.STORE}
  return any(u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0].arg in written for u in ast.toposort())


def identity(op: Ops, dt: DType) -> int | float | bool:
  """The value a REDUCE starts from: 0 (False) for ADD, 1 (True) for MUL, the dtype's minimum (-inf for floats) for MAX."""
  s = dt.scalar()
  if op is Ops.ADD: return False if s.is_bool else 0
  if op is Ops.MUL: return True if s.is_bool else 1
  if op is Ops.MAX: return s.min
  raise IRError(f"{op} is not a reduction (ADD, MUL or MAX)")


def exact_int_bounds(u: UOp, limit: int = 1 << 16) -> tuple[int, int] | None:
  """The least and greatest value of an integer expression of constant-size RANGEs, evaluated at every point (vmin/vmax
  bound each node alone and lose what terms share: j - j % 16 over j < 128 gives [-15, 127], not [0, 112]). None when it
  has another kind of leaf, an empty range or more than `limit` points."""
  topo = u.toposort()
  ranges = [x for x in topo if x.op is Ops.RANGE]
  sizes = [int(r.src[0].arg) if r.src[0].op is Ops.CONST else 0 for r in ranges]
  if u.dtype.kind == "p" or u.dtype.count != 1 or u.dtype.is_float or min(sizes, default=1) < 1 or math.prod(sizes) > limit: return None
  vals: dict[UOp, Any] = dict(zip(ranges, np.meshgrid(*(np.arange(n) for n in sizes), indexing="ij", sparse=True)))
  for x in topo:
    if x in vals or x.op is Ops.RANGE: continue
    if x.dtype.kind == "p" or x.dtype.count != 1: return None
    if x.op is Ops.CONST: vals[x] = np.asarray(x.arg, dtype=compute_np(x.dtype))
    elif x.op in GroupOp.ALU: vals[x] = exec_alu(x.op, x.dtype, *(vals[s] for s in x.src))
    else: return None
  v = np.asarray(vals[u])
  return int(v.min()), int(v.max())


def sym_int_eval(u: int | UOp, var_vals: Mapping[str, int], *, check_bounds: bool = True) -> int:
  """The exact value of an integer (or bool) expression under kiln's C semantics (wraparound, truncating division: the
  same exec_alu the reference evaluator runs). A BIND fixes its variable; var_vals never overrides it. An unbound
  variable, or (with check_bounds) one outside its bounds, is a VariableBoundsError naming it."""
  if isinstance(u, int): return u
  if u.dtype.kind == "p" or u.dtype.count != 1 or u.dtype.is_float:
    raise IRTypeError(f"sym_int_eval needs a scalar integer or bool expression, got {u.dtype}")
  topo = u.toposort()
  bound = {x.src[0].arg[0]: x.src[1].arg for x in topo if x.op is Ops.BIND}
  vals: dict[UOp, Any] = {}
  for x in topo:
    dt = x.dtype
    if dt.kind == "p" or dt.count != 1: raise IRError(f"sym_int_eval cannot evaluate {x!r} (dtype {dt})")
    if x.op is Ops.CONST: v = np.asarray(x.arg, dtype=compute_np(dt))
    elif x.op is Ops.DEFINE_VAR:
      name, lo, hi = x.arg
      if name in bound: val = bound[name]
      elif name not in var_vals: raise VariableBoundsError(f"variable {name} has no value (bounds [{lo}, {hi}]); pass it in var_vals")
      else: val = var_vals[name]
      if check_bounds and not lo <= val <= hi: raise VariableBoundsError(f"variable {name}={val} is outside bounds [{lo}, {hi}]")
      v = np.asarray(val, dtype=compute_np(dt))
    elif x.op is Ops.BIND: v = vals[x.src[1]]
    elif x.op is Ops.CAST: v = cast(vals[x.src[0]], x.src[0].dtype, dt)
    elif x.op is Ops.BITCAST: v = bitcast(vals[x.src[0]], x.src[0].dtype, dt)
    elif x.op in GroupOp.ALU: v = exec_alu(x.op, dt, *(vals[s] for s in x.src))
    else: raise IRError(f"sym_int_eval cannot evaluate {x!r}: only constants, variables and ALU ops have a value")
    vals[x] = v
  return int(vals[u])
