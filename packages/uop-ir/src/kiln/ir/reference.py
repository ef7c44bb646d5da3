"""The reference evaluator: runs a kernel AST on numpy arrays with the exact semantics of compiled code. The oracle for every backend.

Every RANGE of the kernel gets its own numpy axis; a node's value is an array that broadcasts over the axes of the ranges it
depends on (size 1 elsewhere), so a whole STORE is one vectorised evaluation. A REDUCE accumulates sequentially over its
ranges (first range outermost), starting from the identity, rounding in its dtype at every step, as a naive compiled loop
does; integer and MAX reductions are order-independent, so numpy reduces them directly. Every op goes through kiln.ir.alu,
the same code constant folding uses.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.ir.alu import bitcast, cast, compute_np, exec_alu, from_storage, round_to, to_storage
from kiln.ir.analysis import free_ranges_of, identity
from kiln.ir.dtype import PtrDType, dtypes
from kiln.ir.errors import EvalError, VariableBoundsError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.uop import UOp


def _nodes(root: UOp) -> list[UOp]:
  """Toposort of root that does not enter a BIND's variable (a bound variable needs no var_vals entry)."""
  out: list[UOp] = []
  seen: set[int] = set()
  stack: list[tuple[UOp, bool]] = [(root, False)]
  while stack:
    u, done = stack.pop()
    if done: out.append(u); continue
    if id(u) in seen: continue
    seen.add(id(u))
    stack.append((u, True))
    for s in reversed(u.src[1:] if u.op is Ops.BIND else u.src):
      if id(s) not in seen: stack.append((s, False))
  return out


def _desc(u: UOp) -> str: return f"{u.op.name} ({u.dtype}{'' if u.arg is None else f', arg={u.arg!r}'})"


class _Evaluator:
  def __init__(self, ast: UOp, bufs: Sequence[np.ndarray], var_vals: dict[str, int]):
    self.bufs, self.var_vals = bufs, var_vals
    nodes = _nodes(ast)
    # each RANGE node owns an axis, ordered by axis id (the loop order of the nest)
    ranges = sorted((u for u in nodes if u.op is Ops.RANGE), key=lambda r: (r.arg[0], r.key))
    if len(ranges) > 64: raise EvalError(f"the reference evaluator handles at most 64 ranges, the kernel has {len(ranges)}")
    self.axis = {r: i for i, r in enumerate(ranges)}
    self.nd = len(ranges)
    self.size: dict[UOp, int] = {}
    for r in ranges: self.size[r] = self._range_end(r)
    self.free = free_ranges_of(nodes)

  # ---- setup ----
  def _range_end(self, r: UOp) -> int:
    end_nodes = _nodes(r.src[0])
    if any(n.op is Ops.RANGE for n in end_nodes): raise EvalError(f"{_desc(r)}: a range end that depends on another range is not supported")
    v = self._eval_scalar(r.src[0], end_nodes)
    return max(int(v), 0)

  def _eval_scalar(self, root: UOp, nodes: list[UOp]) -> Any:
    vals: dict[UOp, Any] = {}
    for u in nodes: vals[u] = self._eval(u, vals)
    return np.asarray(vals[root]).reshape(-1)[0]

  def var_value(self, u: UOp) -> np.ndarray:
    name, lo, hi = u.arg
    if name not in self.var_vals: raise VariableBoundsError(f"variable {name} has no value: pass var_vals={{{name!r}: ...}} or bind it")
    v = self.var_vals[name]
    if isinstance(v, bool) or not isinstance(v, int | np.integer): raise VariableBoundsError(f"variable {name} must be an int, got {v!r}")
    if not lo <= int(v) <= hi: raise VariableBoundsError(f"variable {name}={int(v)} is outside bounds [{lo}, {hi}]")
    return np.asarray(int(v), dtype=compute_np(u.dtype))

  def buffer(self, g: UOp) -> np.ndarray:
    slot, pt = g.arg, g.dtype
    assert isinstance(pt, PtrDType)
    if slot >= len(self.bufs): raise EvalError(f"no buffer for slot {slot} ({pt}): only {len(self.bufs)} buffers were given")
    b = self.bufs[slot]
    if not isinstance(b, np.ndarray): raise EvalError(f"buffer for slot {slot} must be a numpy array, got {type(b).__name__}")
    if b.dtype != pt.base.np:
      raise EvalError(f"buffer for slot {slot} has numpy dtype {b.dtype}, the kernel wants {pt.base} (stored as {pt.base.np})")
    if b.ndim != 1: raise EvalError(f"buffer for slot {slot} must be a flat 1-D array, got shape {b.shape}")
    return b

  # ---- evaluation ----
  def run_store(self, st: UOp) -> None:
    if st.op is not Ops.STORE: raise EvalError(f"a kernel SINK holds STOREs only, got {_desc(st)}")
    nodes = _nodes(st)
    vals: dict[UOp, Any] = {}
    for u in nodes[:-1]: vals[u] = self._eval(u, vals)
    g, idx, gate = vals[st.src[0]]
    loops = self.free[st]
    shape = tuple(self.size[r] if r in loops else 1 for r in self.axis)
    idx, val = np.broadcast_to(idx, shape).reshape(-1), np.broadcast_to(vals[st.src[1]], shape).reshape(-1)
    if gate is not None:
      m = np.broadcast_to(gate, shape).reshape(-1)
      idx, val = idx[m], val[m]
    buf = self.buffer(g)
    self._check_bounds(st.src[0], g, buf, idx)
    buf[idx] = to_storage(st.src[1].dtype, val)

  def _check_bounds(self, node: UOp, g: UOp, buf: np.ndarray, idx: np.ndarray) -> None:
    n = len(buf) if g.dtype.size < 0 else min(len(buf), g.dtype.size)  # type: ignore[attr-defined]
    if idx.size and ((lo := int(idx.min())) < 0 or (hi := int(idx.max())) >= n):
      bad = lo if lo < 0 else hi
      raise EvalError(f"{_desc(node)}: index {bad} is out of bounds for slot {g.arg} ({g.dtype}, {len(buf)} elements given)")

  def _eval(self, u: UOp, vals: dict[UOp, Any]) -> Any:
    op, dt = u.op, u.dtype
    if op is Ops.CONST: return np.asarray(u.arg, dtype=compute_np(dt))
    if op is Ops.DEFINE_VAR: return self.var_value(u)
    if op is Ops.BIND: return np.asarray(u.src[1].arg, dtype=compute_np(dt))
    if op is Ops.DEFINE_GLOBAL: return u
    if op is Ops.RANGE:
      shape = [1] * self.nd
      shape[self.axis[u]] = self.size[u]
      return np.arange(self.size[u], dtype=compute_np(dt)).reshape(shape)
    if op is Ops.INDEX:
      if u.src[0].op is not Ops.DEFINE_GLOBAL: raise EvalError(f"{_desc(u)}: INDEX must index a DEFINE_GLOBAL, got {_desc(u.src[0])}")
      return (u.src[0], vals[u.src[1]], vals[u.src[2]] if len(u.src) > 2 else None)
    if op is Ops.LOAD: return self._load(u, vals[u.src[0]])
    if op is Ops.REDUCE: return self._reduce(u, vals[u.src[0]])
    if op is Ops.CAST: return cast(vals[u.src[0]], u.src[0].dtype, dt)
    if op is Ops.BITCAST: return bitcast(vals[u.src[0]], u.src[0].dtype, dt)
    if op in GroupOp.ALU: return exec_alu(op, dt, *(vals[s] for s in u.src))
    if op in GroupOp.Lowered: raise EvalError(f"{_desc(u)} appears only after lowering; the reference evaluator runs kernel ASTs")
    raise EvalError(f"{_desc(u)} cannot be evaluated here (STORE and SINK belong at the top of a kernel)")

  def _load(self, u: UOp, ix: tuple[UOp, np.ndarray, np.ndarray | None]) -> np.ndarray:
    g, idx, gate = ix
    buf = self.buffer(g)
    if gate is not None:
      idx, gate = np.broadcast_arrays(idx, gate)
      safe = np.where(gate, idx, 0)
      self._check_bounds(u.src[0], g, buf, idx[gate])
      if len(buf) == 0: return np.zeros(idx.shape, compute_np(u.dtype))
      return np.where(gate, from_storage(u.dtype, buf[safe]), np.zeros((), compute_np(u.dtype)))
    idx = np.asarray(idx)
    self._check_bounds(u.src[0], g, buf, idx.reshape(-1))
    return from_storage(u.dtype, buf[idx])

  def _reduce(self, u: UOp, x: np.ndarray) -> np.ndarray:
    op, dt, rngs = u.arg, u.dtype, u.src[1:]
    rngs = tuple(dict.fromkeys(rngs))  # a range listed twice is reduced once
    axes = [self.axis[r] for r in rngs]
    x = np.asarray(x)
    if x.ndim < self.nd: x = x.reshape(x.shape + (1,) * (self.nd - x.ndim))  # values are 0-d or span every axis
    full = list(x.shape)
    for r in rngs: full[self.axis[r]] = self.size[r]
    x = np.broadcast_to(x, full)  # a value that does not vary over a reduced range still counts once per iteration
    out_shape = list(full)
    for a in axes: out_shape[a] = 1
    ident = np.asarray(identity(op, dt), dtype=compute_np(dt))
    if op is Ops.MAX or not dt.is_float:
      if dt.is_bool: res = (np.logical_and if op is Ops.MUL else np.logical_or).reduce(x, axis=tuple(axes), keepdims=True)
      else:
        with np.errstate(all="ignore"):
          uf = {Ops.ADD: np.add, Ops.MUL: np.multiply, Ops.MAX: np.maximum}[op]
          res = uf.reduce(x, axis=tuple(axes), keepdims=True, dtype=x.dtype) if x.size else np.broadcast_to(ident, out_shape)
        if op is Ops.MAX and dt.is_float and x.size:  # IEEE maximum: +0 beats -0 (np.maximum keeps either)
          pos0 = np.any((x == 0) & ~np.signbit(x), axis=tuple(axes), keepdims=True)
          res = np.where((res == 0) & pos0, np.zeros((), res.dtype), res)
      return exec_alu(op, dt, ident, res)
    # float ADD/MUL: sequential, first range outermost, rounding at every step
    seq = np.moveaxis(x, axes, list(range(self.nd - len(axes), self.nd)))
    seq = seq.reshape(seq.shape[:self.nd - len(axes)] + (int(np.prod(seq.shape[self.nd - len(axes):], dtype=np.int64)),))  # not -1: sizes may be 0
    seq = np.concatenate([np.broadcast_to(ident, seq.shape[:-1] + (1,)), seq], axis=-1)
    with np.errstate(all="ignore"):
      if dt.scalar() == dtypes.bfloat16:  # no numpy bf16: a loop that rounds after each step
        acc = seq[..., 0]
        for k in range(1, seq.shape[-1]): acc = exec_alu(op, dt, acc, seq[..., k])
      else: acc = (np.add if op is Ops.ADD else np.multiply).accumulate(seq, axis=-1, dtype=seq.dtype)[..., -1]
    return round_to(dt, acc).reshape(out_shape)


def evaluate(ast: UOp, bufs: Sequence[np.ndarray], var_vals: dict[str, int] | None = None) -> None:
  """Run the kernel `ast` (a SINK of STOREs) on `bufs`, writing its outputs in place.

  bufs[slot] is the flat 1-D numpy array bound to DEFINE_GLOBAL `slot`, in the slot's storage dtype (dtype.np; bfloat16 as its
  uint16 bit pattern). var_vals gives every DEFINE_VAR that no BIND fixes. Stores run in SINK order; each computes all its
  values before writing any. Raises EvalError for a missing, mistyped or too small buffer and for any out-of-bounds index,
  VariableBoundsError for a missing or out-of-bounds variable.
  """
  if not isinstance(ast, UOp): raise EvalError(f"evaluate() needs a UOp kernel, got {type(ast).__name__}")
  stores = ast.src if ast.op is Ops.SINK else (ast,) if ast.op is Ops.STORE else None
  if stores is None: raise EvalError(f"evaluate() needs a SINK of STOREs, got {_desc(ast)}")
  vv = dict(var_vals or {})
  ev = _Evaluator(ast, bufs, vv)
  for g in (n for n in _nodes(ast) if n.op is Ops.DEFINE_GLOBAL): ev.buffer(g)  # check every buffer before writing anything
  for st in stores: ev.run_store(st)


def run(ast: UOp, *arrays: np.ndarray, var_vals: dict[str, int] | None = None) -> list[np.ndarray]:
  """Convenience: copy `arrays` (in slot order, any shape, numpy dtypes as stored), evaluate, and return the copies."""
  bufs = [np.ascontiguousarray(a).reshape(-1).copy() for a in arrays]
  evaluate(ast, bufs, var_vals)
  return bufs
