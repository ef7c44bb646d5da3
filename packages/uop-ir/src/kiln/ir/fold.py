"""Folding done as graphs are built: constant operands compute at once, with the same C semantics as compiled code."""
from __future__ import annotations

import numpy as np

from kiln.ir.alu import compute_np, exec_alu
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import IRTypeError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.uop import UOp


def const_array(u: UOp) -> np.ndarray:
  assert isinstance(u.dtype, DType)
  return np.asarray(u.arg, dtype=compute_np(u.dtype))


def fold_alu(op: Ops, out_dt: DType, srcs: tuple[UOp, ...]) -> UOp | None:
  """A folded replacement for op(*srcs), or None to build the node as it is."""
  _check_operands(op, srcs)
  if all(s.op is Ops.CONST for s in srcs):
    v = exec_alu(op, out_dt, *(const_array(s) for s in srcs))
    return UOp.const(out_dt, v.item())
  if op is Ops.WHERE:
    c, a, b = srcs
    if c.op is Ops.CONST: return a if c.arg else b
    if a is b: return a
    return None
  if len(srcs) != 2: return None
  a, b = srcs
  bc = b.arg if b.op is Ops.CONST else None
  ac = a.arg if a.op is Ops.CONST else None
  exact = not out_dt.is_float  # identities below are exact for ints and bools only (x+0 is not x for x=-0.0)
  if op is Ops.MUL and bc is not None and bc == 1 and not out_dt.is_bool: return a  # x*1 is exact for floats too
  if op is Ops.MUL and ac is not None and ac == 1 and not out_dt.is_bool: return b
  if exact:
    if op in (Ops.ADD, Ops.OR, Ops.XOR, Ops.SUB, Ops.SHL, Ops.SHR) and bc is not None and bc == 0: return a
    if op in (Ops.ADD, Ops.OR, Ops.XOR) and ac is not None and ac == 0: return b
    if op is Ops.MUL and ((bc is not None and bc == 0) or (ac is not None and ac == 0)): return UOp.const(out_dt, 0)
    if op is Ops.IDIV and bc == 1: return a
    if op is Ops.MOD and bc == 1: return UOp.const(out_dt, 0)
    if op is Ops.AND and out_dt.is_bool and bc is True: return a
    if op is Ops.AND and out_dt.is_bool and ac is True: return b
    if op is Ops.AND and bc is not None and bc == 0: return UOp.const(out_dt, 0)
    if op in (Ops.MAX, Ops.AND, Ops.OR) and a is b: return a
    if op is Ops.SUB and a is b: return UOp.const(out_dt, 0)
    if op is Ops.XOR and a is b: return UOp.const(out_dt, 0)
  # x<x, x==x, x!=x: decide on the operand dtype (out_dt is bool), since a float x may be NaN
  if a is b and op in GroupOp.Comparison and isinstance(a.dtype, DType) and not a.dtype.is_float: return UOp.const(dtypes.bool, op is Ops.CMPEQ)
  return None


def _check_operands(op: Ops, srcs: tuple[UOp, ...]) -> None:
  """ALU operands must share one scalar-or-vector dtype (the condition of WHERE aside) that the op takes."""
  vals = srcs[1:] if op is Ops.WHERE else srcs
  dt = vals[0].dtype
  for s in vals:
    if s.dtype != dt: raise IRTypeError(f"{op} needs operands of one dtype, got {', '.join(str(x.dtype) for x in vals)}")
  if not isinstance(dt, DType): raise IRTypeError(f"{op} cannot take a pointer operand ({dt})")
  if op is Ops.WHERE and srcs[0].dtype.scalar() != dtypes.bool: raise IRTypeError(f"WHERE condition must be bool, got {srcs[0].dtype}")  # type: ignore[union-attr]
  if op in GroupOp.FloatOnly and not dt.is_float: raise IRTypeError(f"{op} needs a float dtype, got {dt}")
  if op in GroupOp.IntOnly and not dt.is_int: raise IRTypeError(f"{op} needs an integer dtype, got {dt}")
  if op in GroupOp.Bitwise and dt.is_float: raise IRTypeError(f"{op} needs an integer or bool dtype, got {dt}")
  if op in (Ops.NEG,) and dt.is_bool: raise IRTypeError("NEG does not take a bool")
