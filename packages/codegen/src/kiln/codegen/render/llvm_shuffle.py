"""A VECTORIZE of lanes picked from one or two vectors, in LLVM IR as one shufflevector: the stages of a transpose in
registers (lowering/expand.py's block reads). As a chain of inserts, LLVM merged the stages into shuffles of many sources,
which the x86 backend lowered lane by lane."""
from __future__ import annotations

from typing import Protocol

from kiln.codegen.render.llvm_dot import Emitter
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp


class ValueEmitter(Emitter, Protocol):
  """An Emitter that also prints a value (val) and a typed value (tv): LLVMPrinter."""
  def val(self, u: UOp) -> str: ...
  def tv(self, u: UOp) -> str: ...


def picks(u: UOp) -> tuple[list[UOp], list[int]] | None:
  """A VECTORIZE whose lanes are each a lane (GEP) of one or two vectors of one type (of its element type): those
  vectors and the mask picking its lanes from them; else None."""
  if not all(s.op is Ops.GEP and isinstance(s.arg, int) for s in u.src): return None
  srcs = list(dict.fromkeys(s.src[0] for s in u.src))
  if len(srcs) > 2 or any(v.dtype != srcs[0].dtype or v.dtype.scalar() != u.dtype.scalar() for v in srcs): return None
  return srcs, [srcs.index(s.src[0]) * srcs[0].dtype.count + s.arg for s in u.src]


def shuffle(p: ValueEmitter, u: UOp, src_type: str) -> str | None:
  """u as one shufflevector where its lanes are picks of at most two vectors (src_type: their LLVM type); else None."""
  if (found := picks(u)) is None: return None
  srcs, mask = found
  r = p.tmp()
  second = p.val(srcs[1]) if len(srcs) > 1 else "poison"
  lanes = ", ".join(f"i32 {m}" for m in mask)
  p.emit(f"{r} = shufflevector {p.tv(srcs[0])}, {src_type} {second}, <{u.dtype.count} x i32> <{lanes}>")
  return r
