"""Memory forms for the LLVM renderer: bool is stored as i8 and bfloat16 as i16, so loads convert from them and stores to
them. Functions of the printer `p` (LLVMPrinter: emit, tmp, splat)."""
from __future__ import annotations

from typing import Any

from kiln.codegen.render.llvm_math import vtype
from kiln.ir.dtype import DType, dtypes


def from_mem(p: Any, r: str, dt: DType) -> str:
  """A value loaded in its memory form, in its register form: bool from i8 (non-zero), bfloat16 from i16 (a float32's top half)."""
  n = dt.count
  if dt.scalar().is_bool:
    b = p.tmp()
    p.emit(f"{b} = icmp ne {vtype('i8', n)} {r}, {'zeroinitializer' if n > 1 else '0'}")
    return b
  if dt.scalar() == dtypes.bfloat16:
    a, b, c = p.tmp(), p.tmp(), p.tmp()
    p.emit(f"{a} = zext {vtype('i16', n)} {r} to {vtype('i32', n)}")
    p.emit(f"{b} = shl {vtype('i32', n)} {a}, {p.splat('i32', '16', n)}")
    p.emit(f"{c} = bitcast {vtype('i32', n)} {b} to {vtype('float', n)}")
    return c
  return r


def to_mem(p: Any, v: str, dt: DType) -> str:
  """A value in its memory form, for a store: bool as i8, bfloat16 as i16."""
  n = dt.count
  if dt.scalar().is_bool:
    b = p.tmp()
    p.emit(f"{b} = zext {vtype('i1', n)} {v} to {vtype('i8', n)}")
    return b
  if dt.scalar() == dtypes.bfloat16:  # the top half of the float; a NaN as the quiet NaN 0x7FC0, as alu.py's storage form is
    a, b, c, nan, q = p.tmp(), p.tmp(), p.tmp(), p.tmp(), p.tmp()
    p.emit(f"{a} = bitcast {vtype('float', n)} {v} to {vtype('i32', n)}")
    p.emit(f"{b} = lshr {vtype('i32', n)} {a}, {p.splat('i32', '16', n)}")
    p.emit(f"{c} = trunc {vtype('i32', n)} {b} to {vtype('i16', n)}")
    p.emit(f"{nan} = fcmp uno {vtype('float', n)} {v}, {v}")
    p.emit(f"{q} = select {vtype('i1', n)} {nan}, {vtype('i16', n)} {p.splat('i16', '32704', n)}, {vtype('i16', n)} {c}")
    return q
  return v
