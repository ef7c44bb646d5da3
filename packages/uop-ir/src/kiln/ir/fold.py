"""Folding done as graphs are built: constant operands compute at once, with the same C semantics as compiled code.

A leaf under uop.py (UOp is imported for typing only): new constants are built through an operand's own `const`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.ir.alu import compute_np, exec_alu
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import IRTypeError
from kiln.ir.ops import GroupOp, Ops

if TYPE_CHECKING:
  from kiln.ir.uop import UOp

# an identity rule: (a, b, a's constant or None, b's constant or None, result dtype) -> the replacement, or None
Rule = Callable[["UOp", "UOp", Any, Any, DType], "UOp | None"]


def const_array(u: UOp) -> np.ndarray:
  return np.asarray(u.arg, dtype=compute_np(u.dtype))


def _zero(a: UOp, dt: DType) -> UOp: return a.const(dt, 0)


def _and(a: UOp, b: UOp, ac: Any, bc: Any, dt: DType) -> UOp | None:
  if dt.is_bool and bc is True: return a
  if dt.is_bool and ac is True: return b
  if bc == 0: return _zero(a, dt)
  return a if a is b else None


def _same_cmp(op: Ops) -> Rule:
  # x<x, x==x, x!=x: decide on the operand dtype (the result is bool), since a float x may be NaN
  return lambda a, b, ac, bc, dt: a.const(dtypes.bool, op is Ops.CMPEQ) if a is b and a.dtype.kind != "p" and not a.dtype.is_float else None


# binary identities exact for every dtype, floats included (x*1 is x even for NaN and -0.0)
_ANY_DTYPE: dict[Ops, Rule] = {
  Ops.MUL: lambda a, b, ac, bc, dt: None if dt.is_bool else a if bc == 1 else b if ac == 1 else None,
  **{op: _same_cmp(op) for op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE)},
}
# binary identities exact for ints and bools only (x+0 is not x for x=-0.0); tried after _ANY_DTYPE
_INT_ONLY: dict[Ops, Rule] = {
  Ops.ADD: lambda a, b, ac, bc, dt: a if bc == 0 else b if ac == 0 else None,
  Ops.SUB: lambda a, b, ac, bc, dt: a if bc == 0 else _zero(a, dt) if a is b else None,
  Ops.OR: lambda a, b, ac, bc, dt: a if bc == 0 else b if ac == 0 else a if a is b else None,
  Ops.XOR: lambda a, b, ac, bc, dt: a if bc == 0 else b if ac == 0 else _zero(a, dt) if a is b else None,
  Ops.SHL: lambda a, b, ac, bc, dt: a if bc == 0 else None,
  Ops.SHR: lambda a, b, ac, bc, dt: a if bc == 0 else None,
  Ops.MUL: lambda a, b, ac, bc, dt: _zero(a, dt) if bc == 0 or ac == 0 else None,
  Ops.IDIV: lambda a, b, ac, bc, dt: a if bc == 1 else None,
  Ops.MOD: lambda a, b, ac, bc, dt: _zero(a, dt) if bc == 1 else None,
  Ops.AND: _and,
  Ops.MAX: lambda a, b, ac, bc, dt: a if a is b else None,
}


def fold_alu(op: Ops, out_dt: DType, srcs: tuple[UOp, ...]) -> UOp | None:
  """A folded replacement for op(*srcs), or None to build the node as it is."""
  _check_operands(op, srcs)
  if all(s.op is Ops.CONST for s in srcs):
    v = exec_alu(op, out_dt, *(const_array(s) for s in srcs))
    return srcs[0].const(out_dt, v.item())
  if op is Ops.WHERE:
    c, a, b = srcs
    if c.op is Ops.CONST: return a if c.arg else b
    if a is b: return a
    return None
  if len(srcs) != 2: return None
  a, b = srcs
  ac = a.arg if a.op is Ops.CONST else None
  bc = b.arg if b.op is Ops.CONST else None
  if (rule := _ANY_DTYPE.get(op)) is not None and (r := rule(a, b, ac, bc, out_dt)) is not None: return r
  if not out_dt.is_float and (rule := _INT_ONLY.get(op)) is not None: return rule(a, b, ac, bc, out_dt)
  return None


def _check_operands(op: Ops, srcs: tuple[UOp, ...]) -> None:
  """ALU operands must share one scalar-or-vector dtype (the condition of WHERE aside) that the op takes."""
  vals = srcs[1:] if op is Ops.WHERE else srcs
  dt = vals[0].dtype
  for s in vals:
    if s.dtype != dt: raise IRTypeError(f"{op} needs operands of one dtype, got {', '.join(str(x.dtype) for x in vals)}")
  if dt.kind == "p": raise IRTypeError(f"{op} cannot take a pointer operand ({dt})")
  if op is Ops.WHERE and srcs[0].dtype.scalar() != dtypes.bool: raise IRTypeError(f"WHERE condition must be bool, got {srcs[0].dtype}")
  if op in GroupOp.FloatOnly and not dt.is_float: raise IRTypeError(f"{op} needs a float dtype, got {dt}")
  if op in GroupOp.IntOnly and not dt.is_int: raise IRTypeError(f"{op} needs an integer dtype, got {dt}")
  if op in GroupOp.Bitwise and dt.is_float: raise IRTypeError(f"{op} needs an integer or bool dtype, got {dt}")
  if op in (Ops.NEG,) and dt.is_bool: raise IRTypeError("NEG does not take a bool")
  if op is Ops.DOT4 and dt.scalar() != dtypes.int32: raise IRTypeError(f"DOT4 takes int32 words of four bytes, got {dt}")
