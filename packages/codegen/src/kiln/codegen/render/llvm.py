"""LLVM IR for the CPU, from a lowered kernel. Text only: no llvmlite needed to render.

ABI: `void NAME(ptr data<slot>..., i32 <var>..., i32 core_id)`: buffers in slot order (noalias, aligned to their
element), then variables in var_names order, then core_id when threaded. Values of bool are i1 in registers and i8 in
memory; bfloat16 is a float in registers rounded to bfloat16 after every op and i16 in memory; float16 ops compute in
float and round once (exact for + - * / sqrt). No fast-math flags: results match the reference evaluator bit for bit
except transcendental functions (libm) and reductions that UPCAST their reduce axis (summed in another order).
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

from kiln.codegen.lower import LoweredKernel, lower
from kiln.codegen.opt import Opt, Target
from kiln.codegen.spec import KernelArg, ProgramSpec, Variable
from kiln.codegen.threads import CORE_ID
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.symbolic import is_multiple
from kiln.ir.uop import UOp

_INT_BIN = {Ops.ADD: "add", Ops.SUB: "sub", Ops.MUL: "mul", Ops.AND: "and", Ops.OR: "or", Ops.XOR: "xor"}
_FLT_BIN = {Ops.ADD: "fadd", Ops.SUB: "fsub", Ops.MUL: "fmul", Ops.FDIV: "fdiv"}
_BOOL_BIN = {Ops.ADD: "or", Ops.MUL: "and", Ops.MAX: "or", Ops.AND: "and", Ops.OR: "or", Ops.XOR: "xor"}
_FLT_UNARY = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.SQRT: "sqrt", Ops.TRUNC: "trunc"}


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
def _vt(t: str, n: int) -> str: return t if n == 1 else f"<{n} x {t}>"
def _suffix(dt: DType) -> str:
  s = {"half": "f16", "float": "f32", "double": "f64"}.get(scalar_type(dt.scalar()), scalar_type(dt.scalar()))
  return s if dt.count == 1 else f"v{dt.count}{s}"


def const_text(dt: DType, v: int | float | bool) -> str:
  """An LLVM constant of scalar dtype dt."""
  if dt.is_bool: return "true" if v else "false"
  if dt.is_int: return str(int(v))
  f = float(v)
  if math.isnan(f): return "0x7FF8000000000000"
  return f"0x{struct.unpack('<Q', struct.pack('<d', f))[0]:016X}"


class LLVMRenderer:
  """Renderer for the CPU: lowers with `target` (vector width, threads) and prints LLVM IR."""
  device = "CPU"

  def __init__(self, target: Target | None = None):
    self.target = target or Target(device="CPU", vector_bytes=32, threads=1)

  def render(self, ast: UOp, opts: Sequence[Opt] | None = None) -> ProgramSpec:
    lk = lower(ast, self.target, list(opts) if opts is not None else None)
    if any(v.arg[0] == CORE_ID for v in lk.vars):  # the runtime passes core_id itself: a user value would be lost
      raise CodegenError("variable name core_id is reserved for the CPU thread index; rename the DEFINE_VAR")
    src = LLVMPrinter(lk, self.target).print()
    # the symbol carries a hash of the code, so kernels of one name but different code can share a JIT engine
    entry = f"{lk.name}_{hashlib.sha256(src.encode()).hexdigest()[:16]}"
    spec = program_spec(lk, src.replace(f"define void @{lk.name}(", f"define void @{entry}(", 1), "CPU", ast)
    spec.entry_point = entry
    return spec


def program_spec(lk: LoweredKernel, src: str, device: str, ast: UOp) -> ProgramSpec:
  """The ProgramSpec for a lowered kernel: buffer and variable metadata from the lowering."""
  var_names = [v.arg[0] for v in lk.vars] + ([CORE_ID] if lk.threads > 1 else [])
  args = []
  for g in lk.globals:
    assert isinstance(g.dtype, PtrDType)
    args.append(KernelArg(slot=g.arg, dtype=str(g.dtype.base), size=g.dtype.size if g.dtype.size > 0 else -1))
  return ProgramSpec(name=lk.name, src=src, device=device, ast=ast, global_size=lk.global_size, local_size=lk.local_size,  # type: ignore[arg-type]
                     vars=[Variable(name=v.arg[0], min=v.arg[1], max=v.arg[2]) for v in lk.vars], var_names=var_names,
                     globals=[g.arg for g in lk.globals], outs=lk.outs, ins=[i for i in lk.ins], buf_count=len(lk.globals), args=args,
                     applied_opts=[str(o) for o in lk.opts], threads=lk.threads,
                     scratch_bytes=lk.scratch_bytes, finish=lk.finish,
                     flops=lk.flops, mem_bytes=lk.mem_bytes)


class LLVMPrinter:
  def __init__(self, lk: LoweredKernel, target: Target):
    self.lk, self.target = lk, target
    self.names: dict[UOp, str] = {}
    self.lines: list[str] = []
    self.entry: list[str] = []  # the entry block's head: allocas, streaming-store alignment flags
    self.decls: set[str] = set()
    self.helpers: dict[str, str] = {}
    self.n = 0
    self.block = "entry"
    self.loops: dict[UOp, tuple[str, str]] = {}
    self.stream_flags: set[str] = set()  # per (buffer, alignment): is its base aligned for streaming stores

  def tmp(self) -> str:
    self.n += 1
    return f"%t{self.n}"

  def emit(self, s: str) -> None: self.lines.append("  " + s)

  def label(self, name: str) -> None:
    self.lines.append(f"{name}:")
    self.block = name

  def val(self, u: UOp) -> str:
    if u.op is Ops.CONST:
      assert isinstance(u.dtype, DType)
      return const_text(u.dtype, u.arg)
    if u.op is Ops.VECTORIZE and all(s.op is Ops.CONST for s in u.src):
      assert isinstance(u.dtype, DType)
      t = scalar_type(u.dtype.scalar())
      return "<" + ", ".join(f"{t} {const_text(u.dtype.scalar(), s.arg)}" for s in u.src) + ">"
    if u not in self.names: raise CodegenError(f"{u.op} used before it is defined (linearizer bug)")
    return self.names[u]

  def tv(self, u: UOp) -> str:
    assert isinstance(u.dtype, DType)
    return f"{ltype(u.dtype)} {self.val(u)}"

  def intrinsic(self, name: str, ret: str, args: Sequence[str]) -> str:
    self.decls.add(f"declare {ret} @{name}({', '.join(args)})")
    return f"@{name}"

  def print(self) -> str:
    lk = self.lk
    params = []
    for g in lk.globals:
      assert isinstance(g.dtype, PtrDType)
      params.append(f"ptr noalias align {max(g.dtype.base.itemsize, 1)} %data{g.arg}")
      self.names[g] = f"%data{g.arg}"
    for v in lk.vars:
      params.append(f"i32 %var.{v.arg[0]}")  # own prefix: a variable named t1 or data0 must not clash with generated values
      self.names[v] = f"%var.{v.arg[0]}"
    if lk.scratch is not None: self.names[lk.scratch] = "%scratch"
    body_start = len(self.lines)
    for u in lk.uops: self.render(u)
    body = self.lines[body_start:]
    if lk.threads > 1: params.append("i32 %core_id")
    if lk.scratch is not None: params.append("ptr noalias %scratch")
    vb = self.target.vector_bytes * 8
    head = [f"define void @{lk.name}({', '.join(params)}) #0 {{", "entry:"] + ["  " + a for a in self.entry]
    attrs = f'attributes #0 = {{ nounwind "prefer-vector-width"="{vb}" "min-legal-vector-width"="{vb}" }}'
    if self.stream_flags:  # streaming stores are weakly ordered: fence them before the caller (or another thread) reads
      body.append(f"  call void {self.intrinsic('llvm.x86.sse.sfence', 'void', [])}()")
    return "\n".join([*sorted(self.decls), *self.helpers.values(), *head, *body, "  ret void", "}", attrs, ""])

  # ---- one uop ----
  def render(self, u: UOp) -> None:
    op = u.op
    if op in (Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR): return
    if op is Ops.SPECIAL:
      if u.arg != CORE_ID: raise CodegenError(f"the CPU renderer has no {u.arg} (a GPU index)")
      self.names[u] = "%core_id"
      return
    if op is Ops.RANGE: return self.range(u)
    if op is Ops.ENDRANGE: return self.endrange(u)
    if op is Ops.IF:
      then, end = f"if{self.n}_{id(u) % 100000}", f"endif{self.n}_{id(u) % 100000}"
      self.n += 1
      self.emit(f"br i1 {self.val(u.src[0])}, label %{then}, label %{end}")
      self.loops[u] = (then, end)
      self.label(then)
      return
    if op is Ops.ENDIF:
      _, end = self.loops[u.src[0]]
      self.emit(f"br label %{end}")
      self.label(end)
      return
    if op is Ops.DEFINE_ACC:
      assert isinstance(u.dtype, DType)
      name = f"%acc{u.arg}"
      self.entry.append(f"{name} = alloca {ltype(u.dtype)}, align {1 << (max(u.dtype.nbytes, 1) - 1).bit_length()}")  # a power of two (<3 x i8>: 4)
      self.emit(f"store {self.tv(u.src[0])}, ptr {name}")
      self.names[u] = name
      return
    if op is Ops.ACC_STORE:
      self.emit(f"store {self.tv(u.src[1])}, ptr {self.val(u.src[0])}")
      return
    if op is Ops.STORE: return self.store(u)
    if op is Ops.LOAD and u.src[0].op is Ops.DEFINE_ACC:
      r = self.tmp()
      self.emit(f"{r} = load {ltype(u.dtype)}, ptr {self.val(u.src[0])}")  # type: ignore[arg-type]
      self.names[u] = r
      return
    if op is Ops.INDEX:
      buf, idx = u.src[0], u.src[1]
      assert isinstance(buf.dtype, PtrDType)
      if len(u.src) == 3:  # a gated access reads element 0 when the gate is off, so it never leaves the buffer
        safe = self.tmp()
        self.emit(f"{safe} = select i1 {self.val(u.src[2])}, i32 {self.val(idx)}, i32 0")
        idxv = safe
      else: idxv = self.val(idx)
      r = self.tmp()
      self.emit(f"{r} = getelementptr inbounds {mem_scalar(buf.dtype.base)}, ptr {self.val(buf)}, i32 {idxv}")
      self.names[u] = r
      return
    if op is Ops.LOAD: return self.load(u)
    if op is Ops.VECTORIZE: return self.vectorize(u)
    if op is Ops.GEP:
      r = self.tmp()
      self.emit(f"{r} = extractelement {self.tv(u.src[0])}, i32 {u.arg}")
      self.names[u] = r
      return
    if op in (Ops.CAST, Ops.BITCAST):
      self.names[u] = self.cast(u) if op is Ops.CAST else self.bitcast(u)
      return
    if op in GroupOp.ALU:
      self.names[u] = self.alu(u)
      return
    if op is Ops.FMA:  # the lowering makes it for float32/float64 sums of products only
      t = ltype(u.dtype)  # type: ignore[arg-type]
      fn, r = self.intrinsic(f"llvm.fma.{_suffix(u.dtype)}", t, [t, t, t]), self.tmp()  # type: ignore[arg-type]
      self.emit(f"{r} = call {t} {fn}({self.tv(u.src[0])}, {self.tv(u.src[1])}, {self.tv(u.src[2])})")
      self.names[u] = r
      return
    raise CodegenError(f"the LLVM renderer cannot render {op}")

  def range(self, u: UOp) -> None:
    i = u.arg[0]
    head, body, latch, exit_ = f"loop{i}", f"body{i}", f"latch{i}", f"exit{i}"
    start, end = self.val(u.src[0]), self.val(u.src[1])
    pre = self.block
    self.emit(f"br label %{head}")
    self.label(head)
    name = f"%r{i}"
    self.emit(f"{name} = phi i32 [{start}, %{pre}], [{name}.next, %{latch}]")
    self.emit(f"{name}.go = icmp slt i32 {name}, {end}")
    self.emit(f"br i1 {name}.go, label %{body}, label %{exit_}")
    self.label(body)
    self.names[u] = name
    self.loops[u] = (latch, exit_)

  def endrange(self, u: UOp) -> None:
    rng = u.src[0]
    latch, exit_ = self.loops[rng]
    name = self.names[rng]
    self.emit(f"br label %{latch}")
    self.label(latch)
    self.emit(f"{name}.next = add nsw i32 {name}, 1")
    self.emit(f"br label %loop{rng.arg[0]}")
    self.label(exit_)

  # ---- memory ----
  def load(self, u: UOp) -> None:
    idx = u.src[0]
    dt = u.dtype
    assert isinstance(dt, DType)
    r = self.tmp()
    self.emit(f"{r} = load {mtype(dt)}, ptr {self.val(idx)}, align {max(dt.itemsize, 1)}")
    v = self.from_mem(r, dt)
    if len(idx.src) == 3:  # gated: zero where the gate is off
      g = self.tmp()
      zero = "zeroinitializer" if dt.count > 1 else const_text(dt, 0)
      self.emit(f"{g} = select i1 {self.val(idx.src[2])}, {ltype(dt)} {v}, {ltype(dt)} {zero}")
      v = g
    self.names[u] = v

  def from_mem(self, r: str, dt: DType) -> str:
    n = dt.count
    if dt.scalar().is_bool:
      b = self.tmp()
      self.emit(f"{b} = icmp ne {_vt('i8', n)} {r}, {'zeroinitializer' if n > 1 else '0'}")
      return b
    if dt.scalar() == dtypes.bfloat16:
      a, b, c = self.tmp(), self.tmp(), self.tmp()
      self.emit(f"{a} = zext {_vt('i16', n)} {r} to {_vt('i32', n)}")
      self.emit(f"{b} = shl {_vt('i32', n)} {a}, {self.splat('i32', '16', n)}")
      self.emit(f"{c} = bitcast {_vt('i32', n)} {b} to {_vt('float', n)}")
      return c
    return r

  def to_mem(self, v: str, dt: DType) -> str:
    n = dt.count
    if dt.scalar().is_bool:
      b = self.tmp()
      self.emit(f"{b} = zext {_vt('i1', n)} {v} to {_vt('i8', n)}")
      return b
    if dt.scalar() == dtypes.bfloat16:
      a, b, c = self.tmp(), self.tmp(), self.tmp()
      self.emit(f"{a} = bitcast {_vt('float', n)} {v} to {_vt('i32', n)}")
      self.emit(f"{b} = lshr {_vt('i32', n)} {a}, {self.splat('i32', '16', n)}")
      self.emit(f"{c} = trunc {_vt('i32', n)} {b} to {_vt('i16', n)}")
      return c
    return v

  def splat(self, t: str, c: str, n: int) -> str: return c if n == 1 else "<" + ", ".join([f"{t} {c}"] * n) + ">"

  def store(self, u: UOp) -> None:
    idx, val = u.src
    dt = val.dtype
    assert isinstance(dt, DType)
    gated = len(idx.src) == 3
    if gated:
      then, cont = f"st{self.n}", f"stend{self.n}"
      self.n += 1
      self.emit(f"br i1 {self.val(idx.src[2])}, label %{then}, label %{cont}")
      self.label(then)
    v = self.to_mem(self.val(val), dt)
    store = f"store {mtype(dt)} {v}, ptr {self.val(idx)}, align "
    plain = store + str(max(dt.itemsize, 1))
    if not gated and (stream := self.stream_flag(idx, dt)) is not None:
      flag, align = stream
      nt, pl, done = f"stnt{self.n}", f"stpl{self.n}", f"stdone{self.n}"
      self.n += 1
      self.emit(f"br i1 {flag}, label %{nt}, label %{pl}")  # loop-invariant: LLVM unswitches it out of the loop
      self.label(nt)
      self.emit(store + f"{align}, !nontemporal !{{i32 1}}")
      self.emit(f"br label %{done}")
      self.label(pl)
      self.emit(plain)
      self.emit(f"br label %{done}")
      self.label(done)
      return
    self.emit(plain)
    if gated:
      self.emit(f"br label %{cont}")
      self.label(cont)

  def stream_flag(self, idx: UOp, dt: DType) -> tuple[str, int] | None:
    """A vector store to a large output streams past the caches (non-temporal: no read-for-ownership, no eviction of
    what the caches hold). x86 needs the address aligned to the vector, so the store must land at a provable multiple
    of its width from the buffer's start, and the buffer's own alignment is checked once on entry: the flag this
    returns picks the streaming or the ordinary store. None: an ordinary store."""
    buf = idx.src[0]
    if not self.target.stream_store_bytes or dt.count == 1 or buf.op is not Ops.DEFINE_GLOBAL: return None
    assert isinstance(buf.dtype, PtrDType)
    width = buf.dtype.base.itemsize * dt.count
    if buf.dtype.size <= 0 or buf.dtype.size * buf.dtype.base.itemsize < self.target.stream_store_bytes: return None
    if width < 16 or width & (width - 1) or not is_multiple(idx.src[1], dt.count): return None
    align = min(width, 64)
    flag = f"%stream{buf.arg}.a{align}"
    if flag not in self.stream_flags:
      self.stream_flags.add(flag)
      self.entry += [f"{flag}.p = ptrtoint ptr %data{buf.arg} to i64", f"{flag}.m = and i64 {flag}.p, {align - 1}",
                       f"{flag} = icmp eq i64 {flag}.m, 0"]
    return flag, align

  def vectorize(self, u: UOp) -> None:
    dt = u.dtype
    assert isinstance(dt, DType)
    t = ltype(dt)
    if all(s is u.src[0] for s in u.src):  # splat
      a, b = self.tmp(), self.tmp()
      self.emit(f"{a} = insertelement {t} poison, {self.tv(u.src[0])}, i32 0")
      self.emit(f"{b} = shufflevector {t} {a}, {t} poison, <{dt.count} x i32> zeroinitializer")
      self.names[u] = b
      return
    cur = "poison"
    for i, s in enumerate(u.src):
      r = self.tmp()
      self.emit(f"{r} = insertelement {t} {cur}, {self.tv(s)}, i32 {i}")
      cur = r
    self.names[u] = cur

  # ---- arithmetic ----
  def alu(self, u: UOp) -> str:
    op, dt = u.op, u.dtype
    assert isinstance(dt, DType)
    src_dt = u.src[0].dtype if op is not Ops.WHERE else u.src[1].dtype
    assert isinstance(src_dt, DType)
    s = src_dt.scalar()
    if op is Ops.WHERE:
      r = self.tmp()
      self.emit(f"{r} = select {self.tv(u.src[0])}, {self.tv(u.src[1])}, {self.tv(u.src[2])}")
      return r
    if s.is_float and s.name in ("float16", "bfloat16"):  # compute in float, round once per op
      vals = [self.val(x) for x in u.src]
      if op is Ops.MULACC:  # unfused, as alu.py defines it: the product rounds to the half type before the add
        return self.half_alu(Ops.ADD, dt, src_dt, [self.half_alu(Ops.MUL, dt, src_dt, vals[:2]), vals[2]])
      return self.half_alu(op, dt, src_dt, vals)
    return self.alu_text(op, dt, src_dt, [self.val(x) for x in u.src])

  def half_alu(self, op: Ops, dt: DType, src_dt: DType, vals: list[str]) -> str:
    s = src_dt.scalar()
    if s.name == "float16" and op is not Ops.NEG:
      wide = [self.fpext(v, src_dt) for v in vals]
      fdt = dtypes.float32.vec(dt.count) if dt.count > 1 else dtypes.float32
      r = self.alu_text(op, fdt if not dt.is_bool else dt, dtypes.float32.vec(src_dt.count) if src_dt.count > 1 else dtypes.float32, wide)
      return r if dt.is_bool else self.fptrunc(r, dt)
    r = self.alu_text(op, dt, src_dt, vals)
    return self.bf16_round(r, dt.count) if s.name == "bfloat16" and not dt.is_bool and op not in (Ops.NEG, Ops.MAX, Ops.TRUNC) else r

  def fpext(self, v: str, dt: DType) -> str:
    r = self.tmp()
    self.emit(f"{r} = fpext {_vt('half', dt.count)} {v} to {_vt('float', dt.count)}")
    return r

  def fptrunc(self, v: str, dt: DType) -> str:
    r = self.tmp()
    self.emit(f"{r} = fptrunc {_vt('float', dt.count)} {v} to {_vt('half', dt.count)}")
    return r

  def bf16_round(self, v: str, n: int) -> str:
    """Round a float (or float vector) to the nearest bfloat16, ties to even; NaN becomes the quiet NaN 0x7FC0."""
    name = f"kiln.bf16round.{n}"
    if name not in self.helpers:
      f, i = _vt("float", n), _vt("i32", n)
      sp = lambda c: self.splat("i32", c, n)  # noqa: E731
      self.helpers[name] = "\n".join([
        f"define internal {f} @{name}({f} %x) alwaysinline {{",
        f"  %b = bitcast {f} %x to {i}", f"  %s = lshr {i} %b, {sp('16')}", f"  %l = and {i} %s, {sp('1')}",
        f"  %a = add {i} %b, {sp('32767')}", f"  %c = add {i} %a, %l", f"  %m = and {i} %c, {sp('-65536')}",
        f"  %nan = fcmp uno {f} %x, %x", f"  %q = select {_vt('i1', n)} %nan, {i} {sp('2143289344')}, {i} %m",
        f"  %r = bitcast {i} %q to {f}", f"  ret {f} %r", "}"])
    r = self.tmp()
    self.emit(f"{r} = call {_vt('float', n)} @{name}({_vt('float', n)} {v})")
    return r

  def alu_text(self, op: Ops, dt: DType, src_dt: DType, a: list[str]) -> str:
    s = src_dt.scalar()
    t = ltype(src_dt)
    r = self.tmp()
    n = src_dt.count
    if s.is_bool and op in _BOOL_BIN:
      self.emit(f"{r} = {_BOOL_BIN[op]} {t} {a[0]}, {a[1]}")
      return r
    if op in GroupOp.Comparison:
      if s.is_float: cmp = {Ops.CMPLT: "fcmp olt", Ops.CMPEQ: "fcmp oeq", Ops.CMPNE: "fcmp une"}[op]
      else: cmp = {Ops.CMPLT: "icmp ult" if s.is_unsigned or s.is_bool else "icmp slt", Ops.CMPEQ: "icmp eq", Ops.CMPNE: "icmp ne"}[op]
      self.emit(f"{r} = {cmp} {t} {a[0]}, {a[1]}")
      return r
    if s.is_float:
      if op in _FLT_BIN: self.emit(f"{r} = {_FLT_BIN[op]} {t} {a[0]}, {a[1]}")
      elif op is Ops.NEG: self.emit(f"{r} = fneg {t} {a[0]}")
      elif op is Ops.RECIPROCAL: self.emit(f"{r} = fdiv {t} {self.splat(scalar_type(s), const_text(s, 1.0), n)}, {a[0]}")
      elif op is Ops.MAX:
        fn = self.intrinsic(f"llvm.maximum.{_suffix(src_dt)}", t, [t, t])
        self.emit(f"{r} = call {t} {fn}({t} {a[0]}, {t} {a[1]})")
      elif op in _FLT_UNARY:
        fn = self.intrinsic(f"llvm.{_FLT_UNARY[op]}.{_suffix(src_dt)}", t, [t])
        self.emit(f"{r} = call {t} {fn}({t} {a[0]})")
      elif op is Ops.MULACC:
        m = self.tmp()
        self.emit(f"{m} = fmul {t} {a[0]}, {a[1]}")
        self.emit(f"{r} = fadd {t} {m}, {a[2]}")
      else: raise CodegenError(f"{op} does not take {src_dt}")
      return r
    sign = "u" if s.is_unsigned else "s"
    if op in _INT_BIN: self.emit(f"{r} = {_INT_BIN[op]} {t} {a[0]}, {a[1]}")
    elif op is Ops.NEG: self.emit(f"{r} = sub {t} {self.splat(scalar_type(s), '0', n)}, {a[0]}")
    elif op is Ops.MAX:
      fn = self.intrinsic(f"llvm.{sign}max.{_suffix(src_dt)}", t, [t, t])
      self.emit(f"{r} = call {t} {fn}({t} {a[0]}, {t} {a[1]})")
    elif op in (Ops.SHL, Ops.SHR):
      m = self.tmp()
      self.emit(f"{m} = and {t} {a[1]}, {self.splat(scalar_type(s), str(s.bits - 1), n)}")
      self.emit(f"{r} = {'shl' if op is Ops.SHL else ('lshr' if s.is_unsigned else 'ashr')} {t} {a[0]}, {m}")
    elif op in (Ops.IDIV, Ops.MOD): return self.divmod(op, s, t, n, a)
    elif op is Ops.MULACC:
      m = self.tmp()
      self.emit(f"{m} = mul {t} {a[0]}, {a[1]}")
      self.emit(f"{r} = add {t} {m}, {a[2]}")
    else: raise CodegenError(f"{op} does not take {src_dt}")
    return r

  def divmod(self, op: Ops, s: DType, t: str, n: int, a: list[str]) -> str:
    """C division with kiln's defined edges (x//0 == x, x%0 == 0, MIN//-1 == MIN): never traps."""
    sp = lambda c: self.splat(scalar_type(s), c, n)  # noqa: E731
    it = _vt("i1", n)
    const_ok = a[1].lstrip("-").isdigit() and int(a[1]) not in (0, -1)
    sign = "u" if s.is_unsigned else "s"
    name = ("div" if op is Ops.IDIV else "rem")
    if const_ok:
      r = self.tmp()
      self.emit(f"{r} = {sign}{name} {t} {a[0]}, {a[1]}")
      return r
    z = self.tmp()
    self.emit(f"{z} = icmp eq {t} {a[1]}, {sp('0')}")
    bad = z
    if not s.is_unsigned:
      m1, bad = self.tmp(), self.tmp()
      self.emit(f"{m1} = icmp eq {t} {a[1]}, {sp('-1')}")
      self.emit(f"{bad} = or {it} {z}, {m1}")
    safe, r = self.tmp(), self.tmp()
    self.emit(f"{safe} = select {it} {bad}, {t} {sp('1')}, {t} {a[1]}")
    self.emit(f"{r} = {sign}{name} {t} {a[0]}, {safe}")
    if op is Ops.IDIV and not s.is_unsigned:
      ng, out = self.tmp(), self.tmp()
      self.emit(f"{ng} = sub {t} {sp('0')}, {a[0]}")
      self.emit(f"{out} = select {it} {m1}, {t} {ng}, {t} {r}")
      return out
    return r

  def cast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    assert isinstance(src, DType) and isinstance(dst, DType)
    v = self.val(u.src[0])
    n = dst.count
    s, d = src.scalar(), dst.scalar()
    st, dt_ = ltype(src), ltype(dst)
    r = self.tmp()
    if d.is_bool:
      if s.is_float: self.emit(f"{r} = fcmp une {st} {v}, {self.splat(scalar_type(s), const_text(s, 0.0), n)}")
      else: self.emit(f"{r} = icmp ne {st} {v}, {self.splat(scalar_type(s), '0', n)}")
      return r
    if s.is_bool:
      self.emit(f"{r} = {'uitofp' if d.is_float else 'zext'} {st} {v} to {dt_}")
      return self.bf16_round(r, n) if d.name == "bfloat16" else r
    if s.is_int and d.is_int:
      if s.bits == d.bits: return v
      self.emit(f"{r} = {'trunc' if d.bits < s.bits else ('zext' if s.is_unsigned else 'sext')} {st} {v} to {dt_}")
      return r
    if s.is_int and d.is_float:
      if d.name == "bfloat16" and s.bits >= 32: return self.bf16_round(self.int_to_odd_float(v, s, n), n)  # int -> float32 would round twice
      self.emit(f"{r} = {'uitofp' if s.is_unsigned else 'sitofp'} {st} {v} to {dt_}")
      return self.bf16_round(r, n) if d.name == "bfloat16" else r
    if s.is_float and d.is_int:
      if s.name == "float16": v, st = self.fpext(v, src), _vt("float", n)
      wide = src if s.name != "float16" else dtypes.float32.vec(n) if n > 1 else dtypes.float32
      fn = self.intrinsic(f"llvm.fpto{'u' if d.is_unsigned else 's'}i.sat.{_suffix(dst)}.{_suffix(wide)}", dt_, [st])
      self.emit(f"{r} = call {dt_} {fn}({st} {v})")
      return r
    # float -> float: registers hold bfloat16 as float
    sw, dw = scalar_type(s), scalar_type(d)
    if sw == dw: return self.bf16_round(v, n) if d.name == "bfloat16" and s.name != "bfloat16" else v
    if sw == "double" and d.name == "bfloat16": return self.bf16_round(self.f64_to_odd_float(v, n), n)  # via float32 would round twice
    order = {"half": 0, "float": 1, "double": 2}
    self.emit(f"{r} = {'fpext' if order[dw] > order[sw] else 'fptrunc'} {st} {v} to {_vt(dw, n)}")
    return self.bf16_round(r, n) if d.name == "bfloat16" else r

  def int_to_odd_float(self, v: str, s: DType, n: int) -> str:
    """A 32/64-bit integer to float32 rounded to odd (truncate to 24 significant bits, then set the last one if any bit was
    dropped): rounding that to bfloat16 equals rounding the exact integer once, as kiln's casts define."""
    i64, sp = _vt("i64", n), lambda c: self.splat("i64", c, n)
    x = v
    if s.bits < 64:
      x = self.tmp()
      self.emit(f"{x} = {'zext' if s.is_unsigned else 'sext'} {_vt(scalar_type(s), n)} {v} to {i64}")
    neg, m = "", x
    if not s.is_unsigned:  # magnitude as an unsigned number (|MIN| = 2^63 fits)
      neg, nx, m = self.tmp(), self.tmp(), self.tmp()
      self.emit(f"{neg} = icmp slt {i64} {x}, {sp('0')}")
      self.emit(f"{nx} = sub {i64} {sp('0')}, {x}")
      self.emit(f"{m} = select {_vt('i1', n)} {neg}, {i64} {nx}, {i64} {x}")
    ctlz = self.intrinsic(f"llvm.ctlz.{f'v{n}i64' if n > 1 else 'i64'}", i64, [i64, "i1"])
    lz, sh0, pos, sh, one, mask, low, sticky, kept, stb, odd, f = (self.tmp() for _ in range(12))
    self.emit(f"{lz} = call {i64} {ctlz}({i64} {m}, i1 false)")
    self.emit(f"{sh0} = sub {i64} {sp('40')}, {lz}")  # bits below the top 24
    self.emit(f"{pos} = icmp sgt {i64} {sh0}, {sp('0')}")
    self.emit(f"{sh} = select {_vt('i1', n)} {pos}, {i64} {sh0}, {i64} {sp('0')}")
    self.emit(f"{one} = shl {i64} {sp('1')}, {sh}")
    self.emit(f"{mask} = sub {i64} {one}, {sp('1')}")
    self.emit(f"{low} = and {i64} {m}, {mask}")
    self.emit(f"{sticky} = icmp ne {i64} {low}, {sp('0')}")
    self.emit(f"{kept} = sub {i64} {m}, {low}")
    self.emit(f"{stb} = select {_vt('i1', n)} {sticky}, {i64} {one}, {i64} {sp('0')}")
    self.emit(f"{odd} = or {i64} {kept}, {stb}")
    self.emit(f"{f} = uitofp {i64} {odd} to {_vt('float', n)}")  # exact: at most 24 significant bits
    if s.is_unsigned: return f
    nf, r = self.tmp(), self.tmp()
    self.emit(f"{nf} = fneg {_vt('float', n)} {f}")
    self.emit(f"{r} = select {_vt('i1', n)} {neg}, {_vt('float', n)} {nf}, {_vt('float', n)} {f}")
    return r

  def f64_to_odd_float(self, v: str, n: int) -> str:
    """double to float32 rounded to odd (toward zero, last bit set when inexact; NaN and inf kept), for a single bfloat16 rounding."""
    d, f, i32, i1 = _vt("double", n), _vt("float", n), _vt("i32", n), _vt("i1", n)
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
    assert isinstance(src, DType) and isinstance(dst, DType)
    v = self.to_mem(self.val(u.src[0]), src)  # memory form: bool as i8, bfloat16 as i16
    r = self.tmp()
    if mtype(src) == mtype(dst): r = v
    else: self.emit(f"{r} = bitcast {mtype(src)} {v} to {mtype(dst)}")
    return self.from_mem(r, dst)
