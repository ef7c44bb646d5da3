"""LLVM IR for the CPU, from a lowered kernel. Text only: no llvmlite needed to render.

ABI: `void NAME(ptr data<slot>..., i32 <var>...[, ptr scratch])`: buffers in slot order (noalias, aligned to their
element), then variables in var_names order, then the per-call scratch when it has one. A kernel split into chunks takes
`i32 slot, ptr claim` before the scratch and claims chunks from the counter at claim (llvm_claim.claim_loop). Every
kernel's `NAME.task(ptr args, i32 slot)` takes the same arguments from an int64 block, for the runtime's native code. Values of
bool are i1 in registers and i8 in memory; bfloat16 is a float in registers rounded to bfloat16 after every op and i16
in memory; float16 ops compute in float and round once (exact for + - * / sqrt). No fast-math flags: results match the reference evaluator bit for bit
except transcendental functions (libm, or llvm_math's own float32 code) and reductions that UPCAST their reduce axis (summed in another order).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kiln.codegen.choose import Opt, Target
from kiln.codegen.choose.contraction import Contraction
from kiln.codegen.choose.tiling import Tiling
from kiln.codegen.lowering.index_width import exact_ends
from kiln.codegen.lowering.lower import LoweredKernel
from kiln.codegen.pipeline import compile_ast
from kiln.codegen.render import llvm_dot, llvm_math, llvm_mem, llvm_shuffle, llvm_stream
from kiln.codegen.render.base import (
  DIV_EDGES,
  Printer,
  Template,
  cast_kind,
  div_edges,
  div_guarded,
  odd_rounding,
  operand_dtype,
  program_spec,  # defined in base since the split; still importable from here, its old home
  shift_mask,
  skip,
)
from kiln.codegen.render.llvm_claim import claim_loop, task_entry
from kiln.codegen.render.llvm_math import double_hex, vtype
from kiln.codegen.spec import ProgramSpec
from kiln.codegen.threads import CORE_ID
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.uop import UOp


def _divmod(p: LLVMPrinter, *args: Any) -> str: return p.divmod(*args)


# op -> the instruction(s) of a result {r}: operands {a0} {a1} {a2} of type {t}; a second line computes into the temporary {m};
# (intrinsic, text): the text calls llvm's `intrinsic.<type suffix>` as {fn}
_BIN = "{r} = %s {t} {a0}, {a1}"
_FLT_OPS: dict[Ops, Template | Callable[..., str]] = {
  **{op: _BIN % ins for op, ins in {Ops.ADD: "fadd", Ops.SUB: "fsub", Ops.MUL: "fmul", Ops.FDIV: "fdiv", Ops.CMPLT: "fcmp olt",
                                     Ops.CMPEQ: "fcmp oeq", Ops.CMPNE: "fcmp une"}.items()},
  Ops.NEG: "{r} = fneg {t} {a0}", Ops.RECIPROCAL: "{r} = fdiv {t} {one}, {a0}", Ops.MAX: ("llvm.maximum", "{r} = call {t} {fn}({t} {a0}, {t} {a1})"),
  **{op: (f"llvm.{f}", "{r} = call {t} {fn}({t} {a0})") for op, f in {Ops.SIN: "sin", Ops.SQRT: "sqrt", Ops.TRUNC: "trunc"}.items()},
  Ops.MULACC: "{m} = fmul {t} {a0}, {a1}\n{r} = fadd {t} {m}, {a2}",
  **{op: llvm_math.render for op in (Ops.EXP2, Ops.LOG2, Ops.ERF, Ops.TANH)},  # float32 inline and vectorised; float64 libm
}
_INT_OPS: dict[Ops, Template | Callable[..., str]] = {
  **{op: _BIN % ins for op, ins in {Ops.ADD: "add{nsw}", Ops.SUB: "sub{nsw}", Ops.MUL: "mul{nsw}", Ops.AND: "and", Ops.OR: "or",
                                     Ops.XOR: "xor", Ops.CMPLT: "icmp {lt}", Ops.CMPEQ: "icmp eq", Ops.CMPNE: "icmp ne"}.items()},
  Ops.NEG: "{r} = sub {t} {zero}, {a0}", Ops.MAX: ("llvm.{sign}max", "{r} = call {t} {fn}({t} {a0}, {t} {a1})"),
  Ops.SHL: "{m} = and {t} {a1}, {mask}\n{r} = shl {t} {a0}, {m}", Ops.SHR: "{m} = and {t} {a1}, {mask}\n{r} = {shr} {t} {a0}, {m}",
  Ops.IDIV: _divmod, Ops.MOD: _divmod, Ops.MULACC: "{m} = mul {t} {a0}, {a1}\n{r} = add {t} {m}, {a2}", Ops.DOT4: llvm_dot.entry,
}
# bool ALU is C's (bool)(a op b) (alu.py); the ops missing here take the integer instructions on i1
_BOOL_OPS: dict[Ops, Template | Callable[..., str]] = {
  op: _BIN % ins for op, ins in {Ops.ADD: "or", Ops.MUL: "and", Ops.MAX: "or", Ops.AND: "and", Ops.OR: "or", Ops.XOR: "xor"}.items()}
_NSW = (Ops.ADD, Ops.SUB, Ops.MUL)  # the integer instructions that take `nsw` (see no_signed_wrap)
_BY_ONE = {Ops.IDIV: "a", Ops.MOD: "0"}  # what an edge divisor replaced by 1 yields
_EDGE_VALUE = {"-a": "sub {t} {zero}, {a0}"}  # the other edge results, computed apart


def _positive_zero(u: UOp) -> bool:
  """A float constant +0.0, or a vector of them (not -0.0: max(-0, x) differs from max(+0, x) at x = -0)."""
  cs = u.src if u.op is Ops.VECTORIZE else (u,)
  return all(c.op is Ops.CONST and isinstance(c.arg, float) and c.arg == 0 and math.copysign(1.0, c.arg) > 0 for c in cs)


def no_signed_wrap(u: UOp) -> bool:
  """A scalar signed ADD/SUB/MUL whose exact result, from its operands' bounds, fits its type: rendered `nsw`, so LLVM may
  widen an i32 index sum to the pointer width term by term and share one base pointer among rows that differ by a
  constant (a 6-row register tile over attention's scores kept 12 row addresses in registers and spilled them without)."""
  dt = u.dtype
  if dt.is_unsigned or len(u.src) != 2 or (ends := exact_ends(u)) is None: return False
  return dt.min <= ends[0] and ends[1] <= dt.max


class _Cast(NamedTuple):
  v: str  # the value
  src: DType
  dst: DType
  st: str  # their register types
  dt: str
  r: str  # the result's temporary


def scalar_type(dt: DType) -> str:
  """Register type of one lane."""
  if dt.is_bool: return "i1"
  if dt.is_int: return f"i{dt.bits}"
  return {"float16": "half", "bfloat16": "float", "float32": "float", "float64": "double"}[dt.name]


def mem_scalar(dt: DType) -> str:
  if dt.is_bool: return "i8"
  if dt.name == "bfloat16": return "i16"
  return scalar_type(dt)


def ltype(dt: DType) -> str: return scalar_type(dt) if dt.count == 1 else f"<{dt.count} x {scalar_type(dt.scalar())}>"
def mtype(dt: DType) -> str: return mem_scalar(dt) if dt.count == 1 else f"<{dt.count} x {mem_scalar(dt.scalar())}>"
def _suffix(dt: DType, form: Callable[[DType], str] = scalar_type) -> str:
  """An intrinsic's type suffix for dt (f32, v16f32), of its register form, or of its memory form (form=mem_scalar: a
  masked load or gather of bool or bfloat16 reads i8 or i16)."""
  s = {"half": "f16", "float": "f32", "double": "f64"}.get(form(dt.scalar()), form(dt.scalar()))
  return s if dt.count == 1 else f"v{dt.count}{s}"


def const_text(dt: DType, v: int | float | bool) -> str:
  """An LLVM constant of scalar dtype dt."""
  if dt.is_bool: return "true" if v else "false"
  if dt.is_int: return str(int(v))
  f = float(v)
  return double_hex(f)  # a NaN keeps its sign and payload: a folded 0*inf is the hardware's negative NaN, as alu.py computes it


class LLVMRenderer:
  """Renderer for the CPU: kiln.codegen.pipeline lowers for `target` (vector width, threads); this prints LLVM IR."""
  device = "CPU"

  def __init__(self, target: Target | None = None):
    self.target = target or Target(device="CPU", vector_bytes=32, threads=1)

  def render(self, ast: UOp, opts: Sequence[Opt] | None = None) -> ProgramSpec: return compile_ast(ast, self, opts)

  def print_kernel(self, lk: LoweredKernel, ast: UOp) -> ProgramSpec:
    if any(v.arg[0] == CORE_ID for v in lk.vars):  # the runtime passes core_id itself: a user value would be lost
      raise CodegenError("variable name core_id is reserved for the CPU thread index; rename the DEFINE_VAR")
    src = LLVMPrinter(lk, self.target).print()
    # the entry (and its task entry; a split kernel's NAME.chunk is internal) carries a hash of the code, so kernels of one name
    # but different code can share a JIT engine
    entry = f"{lk.name}_{hashlib.sha256(src.encode()).hexdigest()[:16]}"
    src = src.replace(f"@{lk.name}(", f"@{entry}(").replace(f"@{lk.name}.task(", f"@{entry}.task(")
    spec = program_spec(lk, src, "CPU", ast)
    spec.entry_point = entry
    return spec

  def tiled_product(self, ast: UOp) -> None: return None  # a CPU matrix product is the generic lowering's register tile
  def print_tiled(self, ast: UOp, product: Contraction, tiling: Tiling) -> ProgramSpec: raise CodegenError("the CPU has no tiled kernel")


class LLVMPrinter(Printer):
  lang = "LLVM"

  def __init__(self, lk: LoweredKernel, target: Target):
    super().__init__(lk)
    self.target = target
    self.entry: list[str] = []  # the entry block's head: allocas, streaming-store alignment flags
    self.decls: set[str] = set()
    self.block = "entry"
    self.loops: dict[UOp, tuple[str, str]] = {}
    self.stream_flags: set[str] = set()  # per (buffer, alignment): is its base aligned for streaming stores
    if lk.scratch is not None: self.names[lk.scratch] = "%scratch"

  def tmp(self) -> str:
    self.n += 1
    return f"%t{self.n}"

  def emit(self, s: str) -> None: self.lines.append("  " + s)

  def label(self, name: str) -> None:
    self.lines.append(f"{name}:")
    self.block = name

  def const(self, dt: DType, v: int | float | bool) -> str: return const_text(dt, v)

  def val(self, u: UOp) -> str:
    if u.op is Ops.VECTORIZE and all(s.op is Ops.CONST for s in u.src):
      t = scalar_type(u.dtype.scalar())
      return "<" + ", ".join(f"{t} {const_text(u.dtype.scalar(), s.arg)}" for s in u.src) + ">"
    return super().val(u)

  def tv(self, u: UOp) -> str:
    return f"{ltype(u.dtype)} {self.val(u)}"

  def intrinsic(self, name: str, ret: str, args: Sequence[str]) -> str:
    self.decls.add(f"declare {ret} @{name}({', '.join(args)})")
    return f"@{name}"

  def callee(self, stem: str, fields: dict[str, str]) -> str:
    return self.intrinsic(f"{stem}.{fields['sfx']}", fields["t"], [fields["t"]] * int(fields["arity"]))

  def buffer_param(self, g: UOp) -> str:
    assert isinstance(g.dtype, PtrDType)
    self.names[g] = f"%data{g.arg}"
    return f"ptr noalias align {max(g.dtype.base.itemsize, 1)} %data{g.arg}"

  def var_param(self, v: UOp) -> str:
    self.names[v] = f"%var.{v.arg[0]}"  # own prefix: a variable named t1 or data0 must not clash with generated values
    return f"i32 %var.{v.arg[0]}"

  def assemble(self, params: list[str]) -> str:
    lk, body, split = self.lk, self.lines, self.lk.threads > 1
    # a split kernel's chunks are an internal function; the entry claims chunks for its thread (claim_loop)
    own = params + (["ptr noalias %scratch"] if lk.scratch is not None else [])
    entry = claim_loop(lk.name, params, lk.threads, lk.finish, lk.slot_bytes, lk.scratch is not None) if split else task_entry(lk.name, own)
    params = [*params, "i32 %core_id", *own[len(params):]] if split else own
    vb = self.target.vector_bytes * 8
    define = f"define internal void @{lk.name}.chunk" if split else f"define void @{lk.name}"
    head = [f"{define}({', '.join(params)}) #{1 if split else 0} {{", "entry:"] + ["  " + a for a in self.entry]
    feats = f'nounwind "prefer-vector-width"="{vb}" "min-legal-vector-width"="{vb}"'
    attrs = [f"attributes #0 = {{ {feats} }}"] + ([f"attributes #1 = {{ noinline {feats} }}"] if split else [])
    if self.stream_flags:  # streaming stores are weakly ordered: fence them before the caller (or another thread) reads
      body.append(f"  call void {self.intrinsic('llvm.x86.sse.sfence', 'void', [])}()")
    return "\n".join([*sorted(self.decls), *self.helpers.values(), *head, *body, "  ret void", "}", *entry, *attrs, ""])

  # ---- control flow and registers ----
  def special(self, u: UOp) -> str:
    if u.arg != CORE_ID: raise CodegenError(f"the CPU renderer has no {u.arg} (a GPU index)")
    return "%core_id"  # an i32 in every kernel (a 64-bit one casts it where its index arithmetic needs)

  def if_(self, u: UOp) -> None:
    then, end = f"if{self.n}", f"endif{self.n}"  # numbered, never by address: the same kernel renders the same text in every process
    self.n += 1
    self.emit(f"br i1 {self.val(u.src[0])}, label %{then}, label %{end}")
    self.loops[u] = (then, end)
    self.label(then)

  def endif(self, u: UOp) -> None:
    _, end = self.loops[u.src[0]]
    self.emit(f"br label %{end}")
    self.label(end)

  def define_acc(self, u: UOp) -> str:
    name = f"%acc{u.arg}"
    self.entry.append(f"{name} = alloca {ltype(u.dtype)}, align {1 << (max(u.dtype.nbytes, 1) - 1).bit_length()}")  # a power of two (<3 x i8>: 4)
    self.emit(f"store {self.tv(u.src[0])}, ptr {name}")
    return name

  def acc_store(self, u: UOp) -> None: self.emit(f"store {self.tv(u.src[1])}, ptr {self.val(u.src[0])}")

  def index(self, u: UOp) -> str:
    buf, idx = u.src[0], u.src[1]
    assert isinstance(buf.dtype, PtrDType)
    masked = len(u.src) == 3 and u.src[2].dtype.count > 1  # a masked load's base: no lane whose gate is off is read (no inbounds)
    it = ltype(idx.dtype)  # i32, or i64 in a kernel whose indices pass int32 (index_width)
    if len(u.src) == 3 and not masked:  # a gated access reads element 0 when the gate is off, so it never leaves the buffer
      safe = self.tmp()
      self.emit(f"{safe} = select i1 {self.val(u.src[2])}, {it} {self.val(idx)}, {it} 0")
      idxv = safe
    else: idxv = self.val(idx)
    r = self.tmp()
    self.emit(f"{r} = getelementptr {'' if masked else 'inbounds '}{mem_scalar(buf.dtype.base)}, ptr {self.val(buf)}, {it} {idxv}")
    return r

  def gep(self, u: UOp) -> str:
    r = self.tmp()
    self.emit(f"{r} = extractelement {self.tv(u.src[0])}, i32 {u.arg}")
    return r

  def fma(self, u: UOp) -> str:  # the lowering makes it for float32/float64 sums of products only
    t = ltype(u.dtype)
    fn, r = self.intrinsic(f"llvm.fma.{_suffix(u.dtype)}", t, [t, t, t]), self.tmp()
    self.emit(f"{r} = call {t} {fn}({self.tv(u.src[0])}, {self.tv(u.src[1])}, {self.tv(u.src[2])})")
    return r

  def range(self, u: UOp) -> str:
    i = u.arg[0]
    head, body, latch, exit_ = f"loop{i}", f"body{i}", f"latch{i}", f"exit{i}"
    start, end = self.val(u.src[0]), self.val(u.src[1])
    pre = self.block
    self.emit(f"br label %{head}")
    self.label(head)
    name, t = f"%r{i}", ltype(u.dtype)  # i32, or i64 in a wide kernel
    self.emit(f"{name} = phi {t} [{start}, %{pre}], [{name}.next, %{latch}]")
    self.emit(f"{name}.go = icmp slt {t} {name}, {end}")
    self.emit(f"br i1 {name}.go, label %{body}, label %{exit_}")
    self.label(body)
    self.loops[u] = (latch, exit_)
    return name

  def endrange(self, u: UOp) -> None:
    rng = u.src[0]
    latch, exit_ = self.loops[rng]
    name = self.names[rng]
    self.emit(f"br label %{latch}")
    self.label(latch)
    self.emit(f"{name}.next = add nsw {ltype(rng.dtype)} {name}, 1")
    self.emit(f"br label %loop{rng.arg[0]}")
    self.label(exit_)

  # ---- memory ----
  def load(self, u: UOp) -> str:
    idx = u.src[0]
    dt = u.dtype
    r = self.tmp()
    if idx.op is Ops.DEFINE_ACC:
      self.emit(f"{r} = load {ltype(dt)}, ptr {self.val(idx)}")
      return r
    mt = mtype(dt)  # bool and bfloat16 load as i8 and i16
    if (n := idx.src[1].dtype.count) > 1:  # a gather: a pointer a lane, under the lanes' gates (all on without), zero where off
      mask = self.tv(idx.src[2]) if len(idx.src) == 3 else f"<{n} x i1> " + self.splat("i1", "true", n)
      fn = self.intrinsic(f"llvm.masked.gather.{_suffix(dt, mem_scalar)}.v{n}p0", mt, [f"<{n} x ptr>", "i32", f"<{n} x i1>", mt])
      self.emit(f"{r} = call {mt} {fn}(<{n} x ptr> {self.val(idx)}, i32 {max(dt.itemsize, 1)}, {mask}, {mt} zeroinitializer)")
      return self.from_mem(r, dt)
    if len(idx.src) == 3 and idx.src[2].dtype.count > 1:  # contiguous lanes under a per-lane gate: a masked load, zero where off
      fn = self.intrinsic(f"llvm.masked.load.{_suffix(dt, mem_scalar)}.p0", mt, ["ptr", "i32", ltype(idx.src[2].dtype), mt])
      self.emit(f"{r} = call {mt} {fn}(ptr {self.val(idx)}, i32 {max(dt.itemsize, 1)}, {self.tv(idx.src[2])}, {mt} zeroinitializer)")
      return self.from_mem(r, dt)
    self.emit(f"{r} = load {mt}, ptr {self.val(idx)}, align {max(dt.itemsize, 1)}")
    v = self.from_mem(r, dt)
    if len(idx.src) == 3:  # gated: zero where the gate is off
      g = self.tmp()
      zero = "zeroinitializer" if dt.count > 1 else const_text(dt, 0)
      self.emit(f"{g} = select i1 {self.val(idx.src[2])}, {ltype(dt)} {v}, {ltype(dt)} {zero}")
      v = g
    return v

  def from_mem(self, r: str, dt: DType) -> str: return llvm_mem.from_mem(self, r, dt)

  def to_mem(self, v: str, dt: DType) -> str: return llvm_mem.to_mem(self, v, dt)

  def splat(self, t: str, c: str, n: int) -> str: return c if n == 1 else "<" + ", ".join([f"{t} {c}"] * n) + ">"

  def store(self, u: UOp) -> None:
    idx, val = u.src
    dt = val.dtype
    gated = len(idx.src) == 3
    if gated:
      then, cont = f"st{self.n}", f"stend{self.n}"
      self.n += 1
      self.emit(f"br i1 {self.val(idx.src[2])}, label %{then}, label %{cont}")
      self.label(then)
    v = self.to_mem(self.val(val), dt)
    plain = f"store {mtype(dt)} {v}, ptr {self.val(idx)}, align {max(dt.itemsize, 1)}"
    if not gated and (tiers := llvm_stream.tiers(self, idx, dt)):
      llvm_stream.store(self, v, self.val(idx), mem_scalar(dt.scalar()), dt, tiers, plain)
      return
    self.emit(plain)
    if gated:
      self.emit(f"br label %{cont}")
      self.label(cont)

  def vectorize(self, u: UOp) -> str:
    dt, t = u.dtype, ltype(u.dtype)
    if all(s is u.src[0] for s in u.src):  # splat
      a, b = self.tmp(), self.tmp()
      self.emit(f"{a} = insertelement {t} poison, {self.tv(u.src[0])}, i32 0")
      self.emit(f"{b} = shufflevector {t} {a}, {t} poison, <{dt.count} x i32> zeroinitializer")
      return b
    if u.src[0].op is Ops.GEP and (r := llvm_shuffle.shuffle(self, u, ltype(u.src[0].src[0].dtype))) is not None: return r
    cur = "poison"
    for i, s in enumerate(u.src):
      r = self.tmp()
      self.emit(f"{r} = insertelement {t} {cur}, {self.tv(s)}, i32 {i}")
      cur = r
    return cur

  # ---- arithmetic ----
  def alu(self, u: UOp) -> str:
    op, dt, src_dt = u.op, u.dtype, operand_dtype(u)
    s = src_dt.scalar()
    if op is Ops.WHERE:
      r = self.tmp()
      self.emit(f"{r} = select {self.tv(u.src[0])}, {self.tv(u.src[1])}, {self.tv(u.src[2])}")
      return r
    if op is Ops.MAX and s.name in ("float32", "float64") and (z := [x for x in u.src if _positive_zero(x)]):
      # max(x, +0) (ReLU) as select(x <= 0, +0, x): llvm.maximum's bits (NaN: x itself; -0: +0) in 2 instructions, not 3
      x, r, c = next((v for v in u.src if v is not z[0]), z[0]), self.tmp(), self.tmp()
      self.emit(f"{c} = fcmp ole {self.tv(x)}, {self.val(z[0])}")
      self.emit(f"{r} = select {vtype('i1', src_dt.count)} {c}, {self.tv(z[0])}, {self.tv(x)}")
      return r
    if s.is_float and s.name in ("float16", "bfloat16"):  # compute in float, round once per op
      vals = [self.val(x) for x in u.src]
      if op is Ops.MULACC:  # unfused, as alu.py defines it: the product rounds to the half type before the add
        return self.half_alu(Ops.ADD, dt, src_dt, [self.half_alu(Ops.MUL, dt, src_dt, vals[:2]), vals[2]])
      return self.half_alu(op, dt, src_dt, vals)
    return self.alu_text(op, dt, src_dt, [self.val(x) for x in u.src], guard=op not in DIV_EDGES or div_guarded(u.src[1]),
                         nsw=op in _NSW and no_signed_wrap(u))

  def half_alu(self, op: Ops, dt: DType, src_dt: DType, vals: list[str]) -> str:
    s = src_dt.scalar()
    if s.name == "float16" and op is not Ops.NEG:  # fneg is exact on half itself
      wide = [self.fpext(v, src_dt) for v in vals]
      fdt = dtypes.float32.vec(dt.count) if dt.count > 1 else dtypes.float32
      r = self.alu_text(op, fdt if not dt.is_bool else dt, dtypes.float32.vec(src_dt.count) if src_dt.count > 1 else dtypes.float32, wide)
      return r if dt.is_bool else self.fptrunc(r, dt)
    r = self.alu_text(op, dt, src_dt, vals)
    # exact ops too: their value needs no rounding, but a NaN must become the quiet NaN 0x7FC0 as every bfloat16 result does
    # in alu.py (a NEG of a NaN kept its flipped sign, which a BITCAST then showed: fuzz find 576a556a2b8e)
    return self.bf16_round(r, dt.count) if s.name == "bfloat16" and not dt.is_bool else r

  def fpext(self, v: str, dt: DType) -> str:
    r = self.tmp()
    self.emit(f"{r} = fpext {vtype('half', dt.count)} {v} to {vtype('float', dt.count)}")
    return r

  def fptrunc(self, v: str, dt: DType) -> str:
    r = self.tmp()
    self.emit(f"{r} = fptrunc {vtype('float', dt.count)} {v} to {vtype('half', dt.count)}")
    return r

  def bf16_round(self, v: str, n: int) -> str:
    """Round a float (or float vector) to the nearest bfloat16, ties to even; NaN becomes the quiet NaN 0x7FC0."""
    name = f"kiln.bf16round.{n}"
    if name not in self.helpers:
      f, i = vtype("float", n), vtype("i32", n)
      sp = lambda c: self.splat("i32", c, n)
      self.helpers[name] = "\n".join([
        f"define internal {f} @{name}({f} %x) alwaysinline {{",
        f"  %b = bitcast {f} %x to {i}", f"  %s = lshr {i} %b, {sp('16')}", f"  %l = and {i} %s, {sp('1')}",
        f"  %a = add {i} %b, {sp('32767')}", f"  %c = add {i} %a, %l", f"  %m = and {i} %c, {sp('-65536')}",
        f"  %nan = fcmp uno {f} %x, %x", f"  %q = select {vtype('i1', n)} %nan, {i} {sp('2143289344')}, {i} %m",
        f"  %r = bitcast {i} %q to {f}", f"  ret {f} %r", "}"])
    r = self.tmp()
    self.emit(f"{r} = call {vtype('float', n)} @{name}({vtype('float', n)} {v})")
    return r

  def alu_text(self, op: Ops, dt: DType, src_dt: DType, a: list[str], guard: bool = True, nsw: bool = False) -> str:
    s = src_dt.scalar()
    t = ltype(src_dt)
    r = self.tmp()
    n = src_dt.count
    table = _BOOL_OPS if s.is_bool and op in _BOOL_OPS else _FLT_OPS if s.is_float else _INT_OPS
    if (entry := table.get(op)) is None: raise CodegenError(f"{op} does not take {src_dt}")
    if callable(entry): return entry(self, op, s, t, n, a, guard)
    sc = scalar_type(s)
    fields = {"r": r, "t": t, "sfx": _suffix(src_dt), "arity": str(len(a)), **{f"a{i}": x for i, x in enumerate(a)},
              "lt": "ult" if s.is_unsigned or s.is_bool else "slt", "sign": "u" if s.is_unsigned else "s", "shr": "lshr" if s.is_unsigned else "ashr",
              "nsw": " nsw" if nsw else "", "zero": self.splat(sc, "0", n), "one": self.splat(sc, const_text(s, 1.0), n),
              "mask": self.splat(sc, str(shift_mask(s)), n)}
    if "{m}" in (entry if isinstance(entry, str) else entry[1]): fields["m"] = self.tmp()  # a second temporary, numbered after r
    for line in self.fill(entry, fields).split("\n"): self.emit(line)
    return r

  def divmod(self, op: Ops, s: DType, t: str, n: int, a: list[str], guard: bool) -> str:
    """C division with kiln's defined edges (base.DIV_EDGES): never traps. Edge divisors become 1, then the edges 1 does not
    give are selected apart."""
    sp = lambda c: self.splat(scalar_type(s), c, n)
    it = vtype("i1", n)
    ins = ("u" if s.is_unsigned else "s") + ("div" if op is Ops.IDIV else "rem")
    if not guard:
      r = self.tmp()
      self.emit(f"{r} = {ins} {t} {a[0]}, {a[1]}")
      return r
    edges, hit, bad = div_edges(op, s), {}, ""
    for d in edges:
      hit[d] = self.tmp()
      either = self.tmp() if bad else ""
      self.emit(f"{hit[d]} = icmp eq {t} {a[1]}, {sp(str(d))}")
      if either: self.emit(f"{either} = or {it} {bad}, {hit[d]}")
      bad = either or hit[d]
    safe, r = self.tmp(), self.tmp()
    self.emit(f"{safe} = select {it} {bad}, {t} {sp('1')}, {t} {a[1]}")
    self.emit(f"{r} = {ins} {t} {a[0]}, {safe}")
    for d, res in edges.items():
      if res == _BY_ONE[op]: continue  # dividing by the stand-in 1 gives it already
      v, out = self.tmp(), self.tmp()
      self.emit(f"{v} = " + _EDGE_VALUE[res].format(t=t, zero=sp("0"), a0=a[0]))
      self.emit(f"{out} = select {it} {hit[d]}, {t} {v}, {t} {r}")
      r = out
    return r

  def cast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    v = self.val(u.src[0])
    return _CASTS[cast_kind(src, dst)](self, _Cast(v, src, dst, ltype(src), ltype(dst), self.tmp()))

  def cast_to_bool(self, c: _Cast) -> str:
    s, n = c.src.scalar(), c.dst.count
    if s.is_float: self.emit(f"{c.r} = fcmp une {c.st} {c.v}, {self.splat(scalar_type(s), const_text(s, 0.0), n)}")
    else: self.emit(f"{c.r} = icmp ne {c.st} {c.v}, {self.splat(scalar_type(s), '0', n)}")
    return c.r

  def cast_wrap(self, c: _Cast) -> str:
    s, d = c.src.scalar(), c.dst.scalar()
    if s.is_bool: self.emit(f"{c.r} = zext {c.st} {c.v} to {c.dt}")
    elif s.bits == d.bits: return c.v
    else: self.emit(f"{c.r} = {'trunc' if d.bits < s.bits else ('zext' if s.is_unsigned else 'sext')} {c.st} {c.v} to {c.dt}")
    return c.r

  def cast_to_float(self, c: _Cast) -> str:
    s, n, bf16 = c.src.scalar(), c.dst.count, c.dst.scalar().name == "bfloat16"
    if odd_rounding(c.src, c.dst): return self.bf16_round(self.int_to_odd_float(c.v, s, n), n)
    self.emit(f"{c.r} = {'sitofp' if s.is_int and not s.is_unsigned else 'uitofp'} {c.st} {c.v} to {c.dt}")
    return self.bf16_round(c.r, n) if bf16 else c.r

  def cast_sat(self, c: _Cast) -> str:  # llvm's saturating conversion: NaN -> 0 as kiln defines
    v, st, n, wide = c.v, c.st, c.dst.count, c.src
    if c.src.scalar().name == "float16": v, st, wide = self.fpext(v, c.src), vtype("float", n), dtypes.float32.vec(n) if n > 1 else dtypes.float32
    fn = self.intrinsic(f"llvm.fpto{'u' if c.dst.is_unsigned else 's'}i.sat.{_suffix(c.dst)}.{_suffix(wide)}", c.dt, [st])
    self.emit(f"{c.r} = call {c.dt} {fn}({st} {v})")
    return c.r

  def cast_float(self, c: _Cast) -> str:  # registers hold bfloat16 as float
    s, d, n, v = c.src.scalar(), c.dst.scalar(), c.dst.count, c.v
    sw, dw = scalar_type(s), scalar_type(d)
    if sw == dw: return self.bf16_round(v, n) if d.name == "bfloat16" and s.name != "bfloat16" else v
    if odd_rounding(c.src, c.dst): return self.bf16_round(self.f64_to_odd_float(v, n), n)
    order = {"half": 0, "float": 1, "double": 2}
    self.emit(f"{c.r} = {'fpext' if order[dw] > order[sw] else 'fptrunc'} {c.st} {v} to {vtype(dw, n)}")
    return self.bf16_round(c.r, n) if d.name == "bfloat16" else c.r

  def int_to_odd_float(self, v: str, s: DType, n: int) -> str:
    """A 32/64-bit integer to float32 rounded to odd (truncate to 24 significant bits, then set the last one if any bit was
    dropped): rounding that to bfloat16 equals rounding the exact integer once, as kiln's casts define."""
    i64, sp = vtype("i64", n), lambda c: self.splat("i64", c, n)
    x = v
    if s.bits < 64:
      x = self.tmp()
      self.emit(f"{x} = {'zext' if s.is_unsigned else 'sext'} {vtype(scalar_type(s), n)} {v} to {i64}")
    neg, m = "", x
    if not s.is_unsigned:  # magnitude as an unsigned number (|MIN| = 2^63 fits)
      neg, nx, m = self.tmp(), self.tmp(), self.tmp()
      self.emit(f"{neg} = icmp slt {i64} {x}, {sp('0')}")
      self.emit(f"{nx} = sub {i64} {sp('0')}, {x}")
      self.emit(f"{m} = select {vtype('i1', n)} {neg}, {i64} {nx}, {i64} {x}")
    ctlz = self.intrinsic(f"llvm.ctlz.{f'v{n}i64' if n > 1 else 'i64'}", i64, [i64, "i1"])
    lz, sh0, pos, sh, one, mask, low, sticky, kept, stb, odd, f = (self.tmp() for _ in range(12))
    self.emit(f"{lz} = call {i64} {ctlz}({i64} {m}, i1 false)")
    self.emit(f"{sh0} = sub {i64} {sp('40')}, {lz}")  # bits below the top 24
    self.emit(f"{pos} = icmp sgt {i64} {sh0}, {sp('0')}")
    self.emit(f"{sh} = select {vtype('i1', n)} {pos}, {i64} {sh0}, {i64} {sp('0')}")
    self.emit(f"{one} = shl {i64} {sp('1')}, {sh}")
    self.emit(f"{mask} = sub {i64} {one}, {sp('1')}")
    self.emit(f"{low} = and {i64} {m}, {mask}")
    self.emit(f"{sticky} = icmp ne {i64} {low}, {sp('0')}")
    self.emit(f"{kept} = sub {i64} {m}, {low}")
    self.emit(f"{stb} = select {vtype('i1', n)} {sticky}, {i64} {one}, {i64} {sp('0')}")
    self.emit(f"{odd} = or {i64} {kept}, {stb}")
    self.emit(f"{f} = uitofp {i64} {odd} to {vtype('float', n)}")  # exact: at most 24 significant bits
    if s.is_unsigned: return f
    nf, r = self.tmp(), self.tmp()
    self.emit(f"{nf} = fneg {vtype('float', n)} {f}")
    self.emit(f"{r} = select {vtype('i1', n)} {neg}, {vtype('float', n)} {nf}, {vtype('float', n)} {f}")
    return r

  def f64_to_odd_float(self, v: str, n: int) -> str:
    """double to float32 rounded to odd (toward zero, last bit set when inexact; NaN and inf kept), for a single bfloat16 rounding."""
    d, f, i32, i1 = vtype("double", n), vtype("float", n), vtype("i32", n), vtype("i1", n)
    fabs = self.intrinsic(f"llvm.fabs.{f'v{n}f64' if n > 1 else 'f64'}", d, [d])
    r, back, ax, ab, away, fi, fm, adj, inexact, lsb, q, out = (self.tmp() for _ in range(12))
    self.emit(f"{r} = fptrunc {d} {v} to {f}")
    self.emit(f"{back} = fpext {f} {r} to {d}")
    self.emit(f"{ax} = call {d} {fabs}({d} {v})")
    self.emit(f"{ab} = call {d} {fabs}({d} {back})")
    self.emit(f"{away} = fcmp ogt {d} {ab}, {ax}")  # rounded away from zero: step back one ulp (inf -> FLT_MAX)
    self.emit(f"{fi} = bitcast {f} {r} to {i32}")
    self.emit(f"{fm} = sub {i32} {fi}, {self.splat('i32', '1', n)}")
    self.emit(f"{adj} = select {i1} {away}, {i32} {fm}, {i32} {fi}")
    self.emit(f"{inexact} = fcmp one {d} {back}, {v}")
    self.emit(f"{lsb} = zext {i1} {inexact} to {i32}")
    self.emit(f"{q} = or {i32} {adj}, {lsb}")
    self.emit(f"{out} = bitcast {i32} {q} to {f}")
    return out

  def bitcast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    v = self.to_mem(self.val(u.src[0]), src)  # memory form: bool as i8, bfloat16 as i16
    r = self.tmp()
    if mtype(src) == mtype(dst): r = v
    else: self.emit(f"{r} = bitcast {mtype(src)} {v} to {mtype(dst)}")
    return self.from_mem(r, dst)


# uop -> its printer; the loads and stores of accumulators take the same ops as those of buffers
LLVMPrinter.OPS = {
  Ops.DEFINE_GLOBAL: skip, Ops.DEFINE_VAR: skip, Ops.SPECIAL: LLVMPrinter.special, Ops.RANGE: LLVMPrinter.range, Ops.ENDRANGE: LLVMPrinter.endrange,
  Ops.IF: LLVMPrinter.if_, Ops.ENDIF: LLVMPrinter.endif, Ops.DEFINE_ACC: LLVMPrinter.define_acc, Ops.ACC_STORE: LLVMPrinter.acc_store,
  Ops.STORE: LLVMPrinter.store, Ops.LOAD: LLVMPrinter.load, Ops.INDEX: LLVMPrinter.index, Ops.VECTORIZE: LLVMPrinter.vectorize,
  Ops.GEP: LLVMPrinter.gep, Ops.CAST: LLVMPrinter.cast, Ops.BITCAST: LLVMPrinter.bitcast, Ops.FMA: LLVMPrinter.fma,
  **dict.fromkeys(GroupOp.ALU, LLVMPrinter.alu),
}
_CASTS: dict[str, Callable[[LLVMPrinter, _Cast], str]] = {
  "to_bool": LLVMPrinter.cast_to_bool, "wrap": LLVMPrinter.cast_wrap, "sat": LLVMPrinter.cast_sat, "to_float": LLVMPrinter.cast_to_float,
  "float": LLVMPrinter.cast_float}
