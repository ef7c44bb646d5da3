"""What the renderers share: the ProgramSpec of a lowered kernel, the printer skeleton (walk the linear uops, name their values,
dispatch each op through the language's table) and kiln's edge semantics (kiln/ir/alu.py) decided once, for each language to print.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from kiln.codegen.lowering.lower import LoweredKernel
from kiln.codegen.spec import KernelArg, ProgramSpec, Variable
from kiln.codegen.threads import CORE_ID
from kiln.ir.dtype import DType, PtrDType
from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp


def program_spec(lk: LoweredKernel, src: str, device: str, ast: UOp, vars_in_memory: bool = False) -> ProgramSpec:
  """The ProgramSpec for a lowered kernel: buffer and variable metadata from the lowering (vars_in_memory: CUDA's
  cuda_vars.py)."""
  var_names = [v.arg[0] for v in lk.vars] + ([CORE_ID] if lk.threads > 1 else [])
  args = []
  for g in lk.globals:
    assert isinstance(g.dtype, PtrDType)
    args.append(KernelArg(slot=g.arg, dtype=str(g.dtype.base), size=g.dtype.size if g.dtype.size > 0 else -1))
  return ProgramSpec(name=lk.name, src=src, device=device, ast=ast, global_size=lk.global_size, local_size=lk.local_size,  # type: ignore[arg-type]
                     vars=[Variable(name=v.arg[0], min=v.arg[1], max=v.arg[2]) for v in lk.vars], var_names=var_names,
                     globals=[g.arg for g in lk.globals], outs=lk.outs, ins=[i for i in lk.ins], buf_count=len(lk.globals), args=args,
                     applied_opts=[str(o) for o in lk.opts], threads=lk.threads, slots=lk.slots,
                     scratch_bytes=lk.scratch_bytes, finish=lk.finish, work=lk.work, split_min=lk.split_min,
                     flops=lk.flops, mem_bytes=lk.mem_bytes, vars_in_memory=vars_in_memory)


# ---- kiln's edge semantics (alu.py): the decisions; each language prints them its own way ----
# integer division's guarded divisors -> what they yield: "a" the dividend, "-a" its wrapped negation (MIN // -1 == MIN), "0"
DIV_EDGES: dict[Ops, dict[int, str]] = {Ops.IDIV: {0: "a", -1: "-a"}, Ops.MOD: {0: "0", -1: "0"}}
# float ops whose result needs no rounding to a 16-bit float: they return an operand or an exact value (bfloat16 still turns a
# NaN into the quiet NaN 0x7FC0 after them, as alu.py's every bfloat16 result is)
EXACT_FLOAT_OPS = frozenset({Ops.NEG, Ops.MAX, Ops.TRUNC})


def div_edges(op: Ops, dt: DType) -> dict[int, str]:
  """The guarded divisors of op on dt, in order: unsigned division has no -1."""
  return {d: r for d, r in DIV_EDGES[op].items() if d == 0 or not dt.is_unsigned}


def div_guarded(divisor: UOp) -> bool:
  """False for a constant divisor off the edges: C's division is kiln's there, no guard needed."""
  return not (divisor.op is Ops.CONST and divisor.arg not in DIV_EDGES[Ops.IDIV])


def shift_mask(dt: DType) -> int: return dt.bits - 1  # shift amounts are taken modulo the bit width


def sat_bounds(dt: DType) -> tuple[int, int]:
  """float -> int casts saturate (NaN -> 0): at or below lo gives dt.min, at or above hi dt.max. A double cannot hold a 64-bit
  maximum, so there hi is the next power of two."""
  return int(dt.min), int(dt.max) if dt.itemsize < 8 else int(dt.max) + 1


def odd_rounding(src: DType, dst: DType) -> bool:
  """A conversion to bfloat16 that would round twice through float32 (from a 32/64-bit integer or a double): it takes an exact or
  round-to-odd step first, so it rounds once as alu.cast defines."""
  s = src.scalar()
  return dst.scalar().name == "bfloat16" and (s.is_int and s.bits >= 32 or s.name == "float64")


def cast_kind(src: DType, dst: DType) -> str:
  """Which cast rule applies: to_bool (!= 0), wrap (int/bool -> int, two's complement), sat (float -> int, saturating, NaN -> 0),
  to_float (int/bool -> float), float (float -> float)."""
  s, d = src.scalar(), dst.scalar()
  if d.is_bool: return "to_bool"
  if d.is_int: return "sat" if s.is_float else "wrap"
  return "float" if s.is_float else "to_float"


def operand_dtype(u: UOp) -> DType:
  """The dtype an ALU op computes in (WHERE's condition is bool whatever its values are)."""
  dt = u.src[1].dtype if u.op is Ops.WHERE else u.src[0].dtype
  return dt


# ---- the printer skeleton ----
Handler = Callable[[Any, UOp], "str | None"]  # prints one uop; a returned string names its value
Template = str | tuple[str, str]  # an op's text with {fields}, or (callee, text): the text calls a declared function as {fn}


def skip(p: Any, u: UOp) -> None: return None  # parameters: named when the signature is built


class Printer:
  """Walks a lowered kernel's linear uops and prints each through OPS, the language's table of op -> handler."""
  lang: ClassVar[str]
  missing_hint: ClassVar[str] = ""  # why an op is missing from OPS, for the error
  OPS: ClassVar[dict[Ops, Handler]]

  def __init__(self, lk: LoweredKernel):
    self.lk = lk
    self.names: dict[UOp, str] = {}
    self.lines: list[str] = []
    self.helpers: dict[str, str] = {}
    self.n = 0

  def const(self, dt: DType, v: Any) -> str: raise NotImplementedError
  def buffer_param(self, g: UOp) -> str: raise NotImplementedError
  def var_param(self, v: UOp) -> str: raise NotImplementedError
  def assemble(self, params: list[str]) -> str: raise NotImplementedError  # the whole source, once every uop is printed
  def callee(self, stem: str, fields: dict[str, str]) -> str: raise NotImplementedError  # declare a Template's function, name it

  def val(self, u: UOp) -> str:
    if u.op is Ops.CONST:
      return self.const(u.dtype, u.arg)
    if u not in self.names: raise CodegenError(f"{u.op} used before it is defined (linearizer bug)")
    return self.names[u]

  def print(self) -> str:
    params = [self.buffer_param(g) for g in self.lk.globals] + [self.var_param(v) for v in self.lk.vars]
    for u in self.lk.uops: self.render(u)
    return self.assemble(params)

  def render(self, u: UOp) -> None:
    if (fn := self.OPS.get(u.op)) is None: raise CodegenError(f"the {self.lang} renderer cannot render {u.op}{self.missing_hint}")
    if (name := fn(self, u)) is not None: self.names[u] = name

  def fill(self, entry: Template, fields: dict[str, str]) -> str:
    if isinstance(entry, tuple):
      stem, entry = entry
      fields = {**fields, "fn": self.callee(stem.format(**fields), fields)}
    return entry.format(**fields)
