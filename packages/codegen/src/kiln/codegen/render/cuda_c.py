"""CUDA C for NVIDIA GPUs, from a lowered kernel. Text only: no CUDA toolkit needed to render.

ABI: `extern "C" __global__ void __launch_bounds__(THREADS) NAME(T* __restrict__ data<slot>..., int <var>...)`: buffers in
slot order (const when only read), then int variables in var_names order. gidx<d>/lidx<d> are blockIdx/threadIdx; the
ProgramSpec's global_size is the grid in blocks, local_size the block. Registers hold float16 and bfloat16 as float, rounded
after every op (float16 computes in float and rounds once; bfloat16 rounds to nearest even after every op); memory holds
half and __nv_bfloat16. kiln's defined edges are small __device__ helpers in a prelude: x//0 == x, x%0 == 0, MIN//-1 == MIN,
shift amounts modulo the bit width, saturating float->int casts with NaN -> 0, IEEE maximum (NaN propagates, +0 > -0), and
signed arithmetic done in unsigned so it wraps instead of being undefined. Float multiplies go through __fmul_rn/__dmul_rn so
nvcc never contracts a*b+c into an FMA: results match the reference evaluator bit for bit except transcendental functions
(CUDA's exp2f/log2f/sinf are within 2 ulp, erff 2, tanhf 2) and group reductions (a partial per thread, combined in a fixed tree of
warp shuffles and shared memory: the kiln_warp_/kiln_block_/kiln_grid_ helpers below; docs/architecture.md, "GPU programs").
"""
from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable

from kiln.codegen.lowering.lower import LoweredKernel
from kiln.codegen.render import cuda_vars
from kiln.codegen.render.base import (
  DIV_EDGES,
  EXACT_FLOAT_OPS,
  Handler,
  Printer,
  Template,
  cast_kind,
  div_edges,
  div_guarded,
  odd_rounding,
  operand_dtype,
  sat_bounds,
  shift_mask,
  skip,
)
from kiln.ir.analysis import identity
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.uop import UOp

_CTYPE = {"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "uint16": "unsigned short", "int32": "int",
          "uint32": "unsigned int", "int64": "long long", "uint64": "unsigned long long", "float16": "float", "bfloat16": "float",
          "float32": "float", "float64": "double"}
_MTYPE = {**_CTYPE, "float16": "half", "bfloat16": "__nv_bfloat16"}
_SPECIAL = {"gidx0": "blockIdx.x", "gidx1": "blockIdx.y", "gidx2": "blockIdx.z",
            "lidx0": "threadIdx.x", "lidx1": "threadIdx.y", "lidx2": "threadIdx.z"}
_CMP = {Ops.CMPLT: "<", Ops.CMPEQ: "==", Ops.CMPNE: "!="}
_BIN, _BIN_T, _BIN_U = "{a0} %s {a1}", "({t})({a0} %s {a1})", "({t})(({u}){a0} %s ({u}){a1})"  # templates of the tables' binary ops
# bool ALU is C's (bool)(a op b) (alu.py)
_BOOL = {**{op: _BIN % c for op, c in {Ops.ADD: "||", Ops.OR: "||", Ops.MAX: "||", Ops.MUL: "&&", Ops.AND: "&&", Ops.XOR: "!=",
                                                  Ops.SUB: "!=", Ops.CMPNE: "!=", Ops.CMPEQ: "=="}.items()}, Ops.CMPLT: "!{a0} && {a1}"}
# float op -> C on operands {a0} {a1} in float or double ({f}: the float functions' suffix); (helper, text) calls kiln's helper as {fn}
_FLT: dict[Ops, Template] = {
  Ops.NEG: "-{a0}", Ops.MAX: ("kiln_max", "{fn}({a0}, {a1})"), Ops.TRUNC: "trunc{f}({a0})",  # exact: base.EXACT_FLOAT_OPS
  Ops.ADD: "{a0} + {a1}", Ops.SUB: "{a0} - {a1}", Ops.MUL: ("kiln_mul", "{fn}({a0}, {a1})"), Ops.FDIV: "{a0} / {a1}", Ops.RECIPROCAL: "{one} / {a0}",
  **{op: f"{fn}{{f}}({{a0}})" for op, fn in {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.SQRT: "sqrt",
                                                   Ops.ERF: "erf", Ops.TANH: "tanh"}.items()},
}
# integer op -> C of type {t}: signed arithmetic goes through the unsigned {u} so it wraps instead of being undefined
_INT = {
  **{op: _BIN_T % c for op, c in {Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^"}.items()}, Ops.MAX: "{a0} > {a1} ? {a0} : {a1}",
  Ops.SHL: "({t})(({u}){a0} << {amt})", Ops.SHR: "({t})({a0} >> {amt})",  # unsigned: a signed << may overflow
  Ops.NEG: "({t})(({u})0 - ({u}){a0})", **{op: _BIN_U % c for op, c in {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*"}.items()},
  Ops.MULACC: "({t})(({u}){a0} * ({u}){a1} + ({u}){a2})",
}
_INT_NO_WRAP = {Ops.NEG: "({t})(-{a0})", Ops.ADD: "{a0} + {a1}", Ops.SUB: "{a0} - {a1}", Ops.MUL: "{a0} * {a1}"}  # where bounds prove no overflow
# bitcast: a value to its raw bits (an integer: "({u}){v}") and raw bits to a value (an integer: "({t})({bits})")
_TO_BITS = {"float32": "__float_as_uint({v})", "float64": "(unsigned long long)__double_as_longlong({v})",
            "float16": "kiln_f2h_bits({v})",  # bfloat16: a NaN's bits are the quiet NaN 0x7FC0 (alu.py's storage form)
            "bfloat16": "({v} != {v} ? (unsigned short)0x7fc0 : (unsigned short)(__float_as_uint({v}) >> 16))"}
_FROM_BITS = {"bool": "(unsigned char)({bits}) != 0", "float32": "__uint_as_float((unsigned int)({bits}))",
              "float64": "__longlong_as_double((long long)({bits}))", "float16": "__half2float(__ushort_as_half((unsigned short)({bits})))",
              "bfloat16": "__uint_as_float((unsigned int)(unsigned short)({bits}) << 16)"}
_RESERVED = re.compile(r"^(data|gidx|lidx|ridx|acc|v|red)\d+$|^kiln_|^__")
_KEYWORDS = frozenset("""auto bool break case char const continue default do double else enum extern float for goto if inline int long register
  restrict return short signed sizeof static struct switch typedef union unsigned void volatile while class new delete this template typename
  namespace using true false operator private public protected virtual friend half nullptr""".split())


def ctype(dt: DType) -> str: return _CTYPE[dt.scalar().name]
def _utype(dt: DType) -> str: return "unsigned long long" if dt.itemsize == 8 else "unsigned int"  # what C does wrapping arithmetic in
def _sfx(dt: DType) -> str: return dt.scalar().name


def const_text(dt: DType, v: int | float | bool) -> str:
  """A C constant of scalar dtype dt (register form: float16/bfloat16 are floats)."""
  if dt.is_bool: return "true" if v else "false"
  if dt.is_int:
    i = int(v)
    if dt.itemsize == 8:
      if dt.is_unsigned: return f"{i}ULL"
      return "(-9223372036854775807LL-1)" if i == dt.min else f"({i}LL)" if i < 0 else f"{i}LL"
    if dt.is_unsigned: return f"{i}u" if dt.itemsize == 4 else str(i)
    return "(-2147483647-1)" if i == -(2**31) else f"({i})" if i < 0 else str(i)
  f = float(v)
  if dt.name == "float64":
    if not math.isfinite(f): return f"__longlong_as_double({struct.unpack('<q', struct.pack('<d', f))[0]}LL)"
    return f"({f.hex()})" if f < 0 or str(f).startswith("-") else f.hex()
  # a NaN keeps its sign and payload (a folded 0*inf is the hardware's negative NaN, as alu.py computes it)
  if not math.isfinite(f): return f"__int_as_float({struct.unpack('<i', struct.pack('<f', f))[0]})"
  s = float(struct.unpack("<f", struct.pack("<f", f))[0]).hex() + "f"
  return f"({s})" if s.startswith("-") else s


# ---- prelude helpers, emitted only when used ----
def _fmul(t: str, intr: str) -> str:
  # the intrinsic is never contracted into an FMA; the host (emulation) build has no FMA contraction to fear
  return (f"__device__ __forceinline__ {t} kiln_mul_{t}({t} a, {t} b) {{\n#ifdef __CUDACC__\n  return {intr}(a, b);\n#else\n  return a * b;\n"
          f"#endif\n}}")


_HELPERS = {
  # Ops.DOT4: c + a's bytes (unsigned) . b's bytes (signed), wrapping; one dp4a from sm_61, the same sum in C elsewhere
  "kiln_dot4": ("__device__ __forceinline__ int kiln_dot4(int a, int b, int c) {\n#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610\n"
                "  int d;\n  asm(\"dp4a.u32.s32 %0, %1, %2, %3;\" : \"=r\"(d) : \"r\"(a), \"r\"(b), \"r\"(c));\n  return d;\n#else\n"
                "  unsigned int s = (unsigned int)c;\n  for (int k = 0; k < 4; k++)\n"
                "    s += (((unsigned int)a >> (8 * k)) & 0xffu) * (unsigned int)(int)(signed char)(unsigned char)((unsigned int)b >> (8 * k));\n"
                "  return (int)s;\n#endif\n}"),
  # a loaded half: its NaN keeps sign and payload (the GPU's half->float conversion makes every NaN the canonical one)
  "kiln_h2f": ("__device__ __forceinline__ float kiln_h2f(half h) {\n  unsigned short b = __half_as_ushort(h);\n"
               "  return (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu)\n"
               "    ? __uint_as_float(((unsigned int)(b & 0x8000u) << 16) | 0x7f800000u | ((unsigned int)(b & 0x3ffu) << 13)) : __half2float(h);\n}"),
  # and back, to a half's bits: a NaN keeps its sign and payload (the GPU's float->half conversion makes every NaN 0x7FFF)
  "kiln_f2h_bits": ("__device__ __forceinline__ unsigned short kiln_f2h_bits(float x) {\n  unsigned int b = __float_as_uint(x);\n"
                    "  return x != x ? (unsigned short)(((b >> 16) & 0x8000u) | 0x7c00u | ((b >> 13) & 0x3ffu) | ((b & 0x7fe000u) ? 0u : 0x200u))\n"
                    "    : __half_as_ushort(__float2half_rn(x));\n}"),
  "kiln_rh": "__device__ __forceinline__ float kiln_rh(float x) { return __half2float(__float2half_rn(x)); }",
  # round to nearest even bfloat16, NaN to the quiet NaN 0x7FC0 (as the reference)
  "kiln_rbf": ("__device__ __forceinline__ float kiln_rbf(float x) {\n  unsigned int b = __float_as_uint(x);\n"
               "  return x != x ? __uint_as_float(0x7fc00000u) : __uint_as_float((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);\n}"),
  "kiln_tobf16": ("__device__ __forceinline__ __nv_bfloat16 kiln_tobf16(float x) {\n"
                  "  return __ushort_as_bfloat16(x != x ? (unsigned short)0x7fc0 : (unsigned short)(__float_as_uint(x) >> 16));\n}"),
  "kiln_mul_float": _fmul("float", "__fmul_rn"), "kiln_mul_double": _fmul("double", "__dmul_rn"),
  "kiln_max_float": ("__device__ __forceinline__ float kiln_max_float(float a, float b) {\n"
                     "  return (a != a || b != b) ? a + b : a == b ? ((__float_as_uint(a) >> 31) ? b : a) : (a > b ? a : b);\n}"),
  "kiln_max_double": ("__device__ __forceinline__ double kiln_max_double(double a, double b) {\n"
                      "  return (a != a || b != b) ? a + b : a == b ? (__double_as_longlong(a) < 0 ? b : a) : (a > b ? a : b);\n}"),
  # double -> float rounded to odd: a later round to nearest of a narrower type then rounds once
  "kiln_odd_f32": ("__device__ __forceinline__ float kiln_odd_f32(double d) {\n  float f = (float)d;\n  if (d != d || (double)f == d) return f;\n"
                   "  unsigned int b = __float_as_uint(f);\n  if (fabs((double)f) > fabs(d)) b -= 1;\n  return __uint_as_float(b | 1u);\n}"),
  # an integer magnitude rounded once to bfloat16 (8 significant bits, ties to even)
  "kiln_u64_bf16": ("__device__ __forceinline__ float kiln_u64_bf16(unsigned long long u) {\n  if (u < 256ULL) return (float)u;\n  int l = 63;\n"
                    "  while (!(u >> l)) l--;\n  unsigned long long m = u >> (l - 7), rem = u & ((1ULL << (l - 7)) - 1), half = 1ULL << (l - 8);\n"
                    "  if (rem > half || (rem == half && (m & 1ULL))) m++;\n  return ldexpf((float)m, l - 7);\n}"),
}
_EDGE_C = {"a": "a", "0": "(T)0", "-a": "(T)((U)0 - (U)a)"}  # base.DIV_EDGES results in C (T the type, U its unsigned twin)


def _div_helper(name: str, op: Ops, dt: DType) -> str:
  """kiln_idiv_T / kiln_mod_T: C division with base.DIV_EDGES printed as conditions, edges of one result merged."""
  groups: list[tuple[list[int], str]] = []
  for d, res in div_edges(op, dt).items():
    if groups and groups[-1][1] == res: groups[-1][0].append(d)
    else: groups.append(([d], res))
  conds = [f"b == {ds[0]}" if len(ds) == 1 else "(" + " || ".join(f"b == {d}" for d in ds) + ")" for ds, _ in groups]
  body = "".join(f"{c} ? {_EDGE_C[res]} : " for c, (_, res) in zip(conds, groups)) + f"(T)(a {'/' if op is Ops.IDIV else '%'} b)"
  t = ctype(dt)
  return f"__device__ __forceinline__ {t} {name}({t} a, {t} b) {{ return {body.replace('(T)', f'({t})').replace('(U)', f'({_utype(dt)})')}; }}"


def _sat_helper(name: str, dt: DType) -> str:
  """float -> int: truncate, saturate, NaN -> 0 (C leaves it undefined)."""
  t, (lo, hi) = ctype(dt), sat_bounds(dt)
  return (f"__device__ __forceinline__ {t} {name}(double x) {{\n  return x != x ? ({t})0 : x <= {lo}.0 ? {const_text(dt, dt.min)} : "
          f"x >= {hi}.0 ? {const_text(dt, dt.max)} : ({t})x;\n}}")


def _helper(name: str) -> str:
  if name in _HELPERS: return _HELPERS[name]
  if (m := re.fullmatch(r"kiln_(idiv|mod|sat)_(\w+)", name)) is None: raise CodegenError(f"unknown CUDA helper {name}")
  dt = getattr(dtypes, m.group(2))
  return _sat_helper(name, dt) if m.group(1) == "sat" else _div_helper(name, Ops.IDIV if m.group(1) == "idiv" else Ops.MOD, dt)


# device functions and types a kernel of the same name would clash with (an extern "C" kernel cannot overload them)
CUDA_NAMES = _KEYWORDS | frozenset("""max min abs fabs fabsf fmax fmin fmaxf fminf sin cos tan sinf cosf tanf exp exp2 expf exp2f log log2 logf
  log2f log10 sqrt sqrtf rsqrt rsqrtf pow powf trunc truncf floor ceil round rint fma fmaf signbit isnan isinf isfinite ldexp ldexpf erf
  tanh sinh cosh asin acos atan atan2 cbrt hypot nan main float2 float4 int2 int4 dim3 uint3 warpSize blockIdx threadIdx blockDim
  gridDim""".split())


def _c_name(name: str) -> str: return f"var_{name}" if name in _KEYWORDS or _RESERVED.match(name) else name


class CUDAPrinter(Printer):
  lang, missing_hint = "CUDA", " (no vectors on CUDA)"

  def __init__(self, lk: LoweredKernel):
    super().__init__(lk)
    self.depth = 1
    names = {(u.dtype.base if isinstance(u.dtype, PtrDType) else u.dtype).name for u in lk.uops}
    self.uses_half, self.uses_bf16 = "float16" in names, "bfloat16" in names  # the CUDA headers only when used
    self.last: dict[UOp, str] = {}  # a BLOCKS REDUCE -> its "this block folded the grid" flag
    self.written = {u.src[0].src[0] for u in lk.uops if u.op is Ops.STORE and u.src[0].src[0].op is Ops.DEFINE_GLOBAL}  # the rest are const
    self.vars_in_memory = False  # the variables come from a device array (cuda_vars.py), not as arguments
    self.prologue: list[str] = []  # lines before the body: reading them, and the grid's guard

  def emit(self, s: str) -> None: self.lines.append("  " * self.depth + s)

  def helper(self, name: str) -> str:
    if name not in self.helpers: self.helpers[name] = _helper(name)
    return name

  def callee(self, stem: str, fields: dict[str, str]) -> str: return self.helper(f"{stem}_{fields['ft']}")
  def const(self, dt: DType, v: int | float | bool) -> str: return const_text(dt, v)

  def assign(self, u: UOp, expr: str, prefix: str = "v") -> None:
    name = f"{prefix}{self.n}"
    self.n += 1
    self.emit(f"{ctype(u.dtype)} {name} = {expr};")
    self.names[u] = name

  def buffer_param(self, g: UOp) -> str:
    assert isinstance(g.dtype, PtrDType)
    self.names[g] = f"data{g.arg}"
    return f"{'' if g in self.written else 'const '}{_MTYPE[g.dtype.base.name]}* __restrict__ data{g.arg}"

  def var_param(self, v: UOp) -> str:
    self.names[v] = _c_name(v.arg[0]) if v.dtype == dtypes.int32 else f"(({ctype(v.dtype)}){_c_name(v.arg[0])})"
    return f"int {_c_name(v.arg[0])}"  # variables travel as 32-bit ints

  def print(self) -> str:
    """The kernel; with its variables read from device memory where cuda_vars says so (self.vars_in_memory)."""
    c_names = {v: _c_name(v.arg[0]) for v in self.lk.vars}
    if (guards := cuda_vars.in_memory(self.lk, c_names)) is None: return super().print()
    self.vars_in_memory = True
    params = [self.buffer_param(g) for g in self.lk.globals] + [f"const int* __restrict__ {cuda_vars.VARS}"]
    self.prologue = [f"  {self.var_param(v)} = {cuda_vars.VARS}[{i}];" for i, v in enumerate(self.lk.vars)] + [f"  {g}" for g in guards]
    for u in self.lk.uops: self.render(u)
    return self.assemble(params)

  def assemble(self, params: list[str]) -> str:
    ls = self.lk.local_size or (1, 1, 1)
    threads = math.prod(int(x) if isinstance(x, int) else 1 for x in ls)
    head = [*(["#include <cuda_fp16.h>"] if self.uses_half else []), *(["#include <cuda_bf16.h>"] if self.uses_bf16 else []),
            *self.helpers.values(),
            f'extern "C" __global__ void __launch_bounds__({threads}) {self.lk.name}({", ".join(params)}) {{']
    return "\n".join([*head, *self.prologue, *self.lines, "}", ""])

  # ---- control flow and registers ----
  def special(self, u: UOp) -> str:
    if u.arg not in _SPECIAL: raise CodegenError(f"the CUDA renderer has no {u.arg} (core_id is a CPU thread index)")
    self.emit(f"{ctype(u.dtype)} {u.arg} = {_SPECIAL[u.arg]}; /* {self.size_text(u.src[0])} */")  # long long in a wide kernel
    return str(u.arg)

  def define_local(self, u: UOp) -> str:
    assert isinstance(u.dtype, PtrDType)
    if str(u.arg).startswith("grid"):  # BLOCKS: a slot per block, a done count per row, in global memory for the module's life
      name = f"kiln_{self.lk.name}_{u.arg}"
      self.helpers[name] = f"__device__ {ctype(u.dtype.base)} {name}[{u.dtype.size}] = {{0}};"
      return name
    name = f"red{self.n}"
    self.n += 1
    self.emit(f"__shared__ {ctype(u.dtype.base)} {name}[{u.dtype.size}];")
    return name

  def range(self, u: UOp) -> str:
    name = f"ridx{u.arg[0]}"
    self.emit(f"for ({ctype(u.dtype)} {name} = {self.val(u.src[0])}; {name} < {self.val(u.src[1])}; {name}++) {{")
    self.depth += 1
    return name

  def if_(self, u: UOp) -> None:
    self.emit(f"if ({self.val(u.src[0])}) {{")
    self.depth += 1

  def close(self, u: UOp) -> None:
    self.depth -= 1
    self.emit("}")

  def size_text(self, s: UOp) -> str: return str(s.arg) if s.op is Ops.CONST else "symbolic"

  # ---- memory ----
  def load(self, u: UOp) -> None:
    idx = u.src[0]
    dt = u.dtype
    v = self.val(idx)
    if idx.op is Ops.DEFINE_ACC: return self.assign(u, v)
    if idx.src[0].op is Ops.DEFINE_GLOBAL:
      if dt.name == "float16": v = f"{self.helper('kiln_h2f')}({v})"
      elif dt.name == "bfloat16": v = f"__bfloat162float({v})"
    if len(idx.src) == 3: v = f"{self.val(idx.src[2])} ? {v} : {const_text(dt, 0)}"  # gated: no access when off
    self.assign(u, v)

  def store(self, u: UOp) -> None:
    idx, val = u.src
    dt = val.dtype
    v = self.val(val)
    if idx.src[0].op is Ops.DEFINE_GLOBAL:
      if dt.name == "float16": v = f"__float2half_rn({v})"  # exact: the value is already rounded to half
      elif dt.name == "bfloat16": v = f"{self.helper('kiln_tobf16')}({v})"
    st = f"{self.val(idx)} = {v};"
    self.emit(f"if ({self.val(idx.src[2])}) {st}" if len(idx.src) == 3 else st)

  # ---- arithmetic ----
  def round(self, expr: str, dt: DType) -> str:
    """Round a float result to the register form of a 16-bit float dtype."""
    if dt.name == "float16": return f"{self.helper('kiln_rh')}({expr})"
    if dt.name == "bfloat16": return f"{self.helper('kiln_rbf')}({expr})"
    return expr

  def alu(self, u: UOp) -> str:
    op, dt, src_dt = u.op, u.dtype, operand_dtype(u)
    a = [self.val(x) for x in u.src]
    if op is Ops.WHERE: return f"{a[0]} ? {a[1]} : {a[2]}"
    if op in _CMP and not src_dt.is_bool: return f"{a[0]} {_CMP[op]} {a[1]}"
    if src_dt.is_bool:
      if (b := _BOOL.get(op)) is None: raise CodegenError(f"{op} does not take bool operands")
      return b.format(a0=a[0], a1=a[1])
    if src_dt.is_float: return self.float_alu(op, dt, a)
    return self.int_alu(u, op, dt, a)

  def float_alu(self, op: Ops, dt: DType, a: list[str]) -> str:
    t = "double" if dt.name == "float64" else "float"
    fields = {"ft": t, "f": "" if t == "double" else "f", "one": const_text(dtypes.float64 if t == "double" else dtypes.float32, 1.0),
              **{f"a{i}": x for i, x in enumerate(a)}}
    if op is Ops.MULACC:  # unfused: round the product first
      return self.round(f"{self.round(self.fill(_FLT[Ops.MUL], fields), dt)} + {a[2]}", dt)
    if (entry := _FLT.get(op)) is None: raise CodegenError(f"{op} does not take {dt}")
    e = self.fill(entry, fields)
    return e if op in EXACT_FLOAT_OPS and dt.scalar().name != "bfloat16" else self.round(e, dt)  # bfloat16: a NaN becomes 0x7FC0

  def int_alu(self, u: UOp, op: Ops, dt: DType, a: list[str]) -> str:
    if op is Ops.DOT4: return f"{self.helper('kiln_dot4')}({a[0]}, {a[1]}, {a[2]})"
    if op in DIV_EDGES:
      if not div_guarded(u.src[1]): return f"({ctype(dt)})({a[0]} {'/' if op is Ops.IDIV else '%'} {a[1]})"
      return f"{self.helper(f'kiln_{op.name.lower()}_{_sfx(dt)}')}({a[0]}, {a[1]})"
    table = _INT_NO_WRAP if op in _INT_NO_WRAP and self.no_wrap(u) else _INT
    if (entry := table.get(op)) is None: raise CodegenError(f"{op} does not take {dt}")
    return entry.format(t=ctype(dt), u=_utype(dt), amt=f"({a[1]} & {shift_mask(dt)})" if len(a) > 1 else "", **{f"a{i}": x for i, x in enumerate(a)})

  def no_wrap(self, u: UOp) -> bool:
    """True when u's bounds prove C's arithmetic on it cannot overflow (signed overflow is undefined; kiln wraps)."""
    dt = u.dtype
    if dt.is_unsigned and dt.itemsize >= 4: return True  # unsigned int arithmetic wraps by definition
    try: lo, hi = u.vmin, u.vmax
    except Exception: return False  # no bounds: be safe
    if (lo, hi) == (dt.min, dt.max): return False  # the bounds say it may wrap
    return all(isinstance(x.vmin, int) and -(2**31) <= int(x.vmin) and int(x.vmax) < 2**31 for x in (u, *u.src)) if dt.itemsize < 8 else True

  def cast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    return _CASTS[cast_kind(src, dst)](self, self.val(u.src[0]), src, dst)

  def cast_to_float(self, v: str, src: DType, dst: DType) -> str:
    if dst.name == "float64": return f"(double){v}"
    if odd_rounding(src, dst):  # round once from the exact integer (a float in between would round twice)
      if src.is_unsigned: return f"{self.helper('kiln_u64_bf16')}({v})"
      m = f"({v} < 0 ? 0ULL - (unsigned long long){v} : (unsigned long long){v})"
      return f"({v} < 0 ? -{self.helper('kiln_u64_bf16')}({m}) : {self.helper('kiln_u64_bf16')}({m}))"
    return self.round(f"(float){v}", dst)  # exact in float, one rounding; float16: a 32/64-bit int past 65519 is inf either way

  def cast_float(self, v: str, src: DType, dst: DType) -> str:
    if dst.name == "float64": return f"(double){v}"
    if odd_rounding(src, dst) or src.name == "float64" and dst.name == "float16": return self.round(f"{self.helper('kiln_odd_f32')}({v})", dst)
    if src.name == "float64": return f"(float){v}"
    return self.round(v, dst) if dst.name in ("float16", "bfloat16") else v  # float32/float16/bfloat16 registers are floats

  def bitcast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    v = self.val(u.src[0])
    if src.name == "float16": self.helper("kiln_f2h_bits")  # the table's float16 entry calls it
    bits = _TO_BITS.get(src.name, "({u}){v}").format(v=v, u=_utype(src) if src.itemsize >= 4 else "unsigned int")
    return _FROM_BITS.get(dst.name, "({t})({bits})").format(bits=bits, t=ctype(dst))


# ---- block reductions: a fixed tree, the same bits from run to run ----
# A GROUP's partials (one per thread of a block of n, a power of two) are combined by kiln_block_<op>_<type>:
#  1. in each warp (or the whole block when n <= 32) a butterfly of __shfl_xor_sync over offsets span/2, ..., 2, 1: lane i
#     takes op(v_i, v_{i^o}) at each step, both lanes of a pair combine the same two values, so every lane ends with the
#     same bits (a fixed tree over the lanes, whatever the scheduling);
#  2. n > 32: lane 0 of warp w leaves it in smem[w], a barrier, then every warp reads smem[lane % nw] and does the same
#     butterfly over offsets nw/2..1 (nw = n / 32 warps), so every thread of the block gets the result, and a last barrier
#     lets the slots be written again (a reduction in a loop, the next one).
# All threads of the block must call it, the same number of times (barriers, full-warp shuffles); the lowering emits it
# where every thread runs (a gate on a block's row is the same for all its threads).
_WARP = ("__device__ __forceinline__ {t} {warp}({t} v, unsigned mask, int span) {{\n"
         "  for (int o = span >> 1; o > 0; o >>= 1) {{ {t} a = v, b = __shfl_xor_sync(mask, v, o); v = {comb}; }}\n  return v;\n}}")
_BLOCK = ("__device__ __forceinline__ {t} {block}({t} v, {t}* smem, int n) {{\n"
          "  v = {warp}(v, n >= 32 ? 0xffffffffu : (1u << n) - 1u, n < 32 ? n : 32);\n  if (n <= 32) return v;\n"
          "  int nw = n >> 5;\n  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = v;\n  __syncthreads();\n"
          "  v = {warp}(smem[threadIdx.x & (nw - 1)], 0xffffffffu, nw);\n  __syncthreads();\n  return v;\n}}")
_RED_NAME = {Ops.ADD: "sum", Ops.MAX: "max", Ops.MUL: "prod"}


# BLOCKS: the grid's second stage in the same launch (the last-block-done pattern). Thread 0 of each block leaves the block's
# result in parts[blockIdx.x], makes it visible to the whole GPU (__threadfence) and counts the block done; the block that
# counts last (the same for all its threads: a shared flag behind a barrier) folds parts[t], parts[t + n], ... per thread in
# order, then the block tree, and sets the count back to 0 for the next launch. The slots and the count are module-scope
# __device__ variables: one launch of the kernel at a time (kiln launches a kernel's calls in order on one stream).
# static: a __shared__ (a function-local static under the emulator) in an inline function of external linkage is one symbol
# across every loaded library (GNU unique), so the emulator's fibers build (thread_local) and threads build of one kernel in
# one process bound each other's flag and crashed
_GRID = ("static __device__ __forceinline__ {t} {grid}({t} v, {t}* smem, int n, {t}* parts, unsigned int* done, int nb, bool* last) {{\n"
         "  __shared__ bool is_last;\n  unsigned int row = blockIdx.y + gridDim.y * blockIdx.z;\n  parts += row * nb;\n  done += row;\n"
         "  if (threadIdx.x == 0) {{\n    parts[blockIdx.x] = v;\n    __threadfence();\n"
         "    is_last = atomicAdd(done, 1u) == (unsigned int)nb - 1u;\n  }}\n  __syncthreads();\n  *last = is_last;\n"
         "  if (!is_last) return v;\n  __threadfence();\n  {t} acc = {ident};\n"
         "  for (int i = threadIdx.x; i < nb; i += n) {{ {t} a = acc, b = ((volatile {t}*)parts)[i]; acc = {comb}; }}\n"
         "  acc = {block}(acc, smem, n);\n  if (threadIdx.x == 0) *done = 0u;\n  return acc;\n}}")


def _combine_text(p: CUDAPrinter, op: Ops, dt: DType) -> str:
  """op on registers named a and b, printed as the accumulators print it (16-bit floats rounded, integers wrapping)."""
  a, b = (UOp(Ops.SPECIAL, dt, (), x) for x in ("a", "b"))
  p.names[a], p.names[b] = "a", "b"
  return p.alu(UOp(op, dt, (a, b)))


def _red_helpers(p: CUDAPrinter, op: Ops, dt: DType, grid: bool) -> str:
  """Declare kiln_warp_ and kiln_block_<op>_<type>, and kiln_grid_ when asked (once each); returns the one to call."""
  name = f"{_RED_NAME.get(op, op.name.lower())}_{_sfx(dt)}"
  warp, block, t = f"kiln_warp_{name}", f"kiln_block_{name}", ctype(dt)
  comb = _combine_text(p, op, dt)
  if block not in p.helpers:
    p.helpers[warp] = _WARP.format(t=t, warp=warp, comb=comb)
    p.helpers[block] = _BLOCK.format(t=t, block=block, warp=warp)
  if not grid: return block
  if (g := f"kiln_grid_{name}") not in p.helpers:
    p.helpers[g] = _GRID.format(t=t, grid=g, block=block, comb=comb, ident=const_text(dt, identity(op, dt)))
  return g


def _block_reduce(p: CUDAPrinter, u: UOp) -> str:
  """A REDUCE left by the lowering. src (partial, shared slots, n): the block's partials in the fixed tree above; plus the
  grid's slots: the BLOCKS second stage; arg "last" (src: that stage's result): whether this block folded the grid."""
  if u.arg == "last": return p.last[u.src[0]]
  if len(u.src) == 3: return f"{_red_helpers(p, u.arg, u.dtype, False)}({p.val(u.src[0])}, {p.val(u.src[1])}, {p.val(u.src[2])})"
  grid = _red_helpers(p, u.arg, u.dtype, True)
  partial, smem, n, slots, done, nb = u.src
  flag = p.last[u] = f"last{p.n}"
  p.n += 1
  p.emit(f"bool {flag};")
  return f"{grid}({p.val(partial)}, {p.val(smem)}, {p.val(n)}, {p.val(slots)}, {p.val(done)}, {p.val(nb)}, &{flag})"


def _assigned(f: Callable[[CUDAPrinter, UOp], str], prefix: str = "v") -> Handler:
  """A handler that declares the value f prints as a new variable."""
  return lambda p, u: p.assign(u, f(p, u), prefix)


# uop -> its printer; the loads and stores of accumulators take the same ops as those of buffers
CUDAPrinter.OPS = {
  Ops.DEFINE_GLOBAL: skip, Ops.DEFINE_VAR: skip, Ops.SPECIAL: CUDAPrinter.special, Ops.DEFINE_LOCAL: CUDAPrinter.define_local,
  Ops.BARRIER: lambda p, u: p.emit("__syncthreads();"), Ops.BIND: lambda p, u: p.val(u.src[1]),  # a bound variable is its value
  Ops.RANGE: CUDAPrinter.range, Ops.IF: CUDAPrinter.if_, Ops.ENDRANGE: CUDAPrinter.close, Ops.ENDIF: CUDAPrinter.close,
  Ops.DEFINE_ACC: _assigned(lambda p, u: p.val(u.src[0]), "acc"), Ops.ACC_STORE: lambda p, u: p.emit(f"{p.val(u.src[0])} = {p.val(u.src[1])};"),
  Ops.REDUCE: _assigned(_block_reduce),
  Ops.INDEX: lambda p, u: f"{p.val(u.src[0])}[{p.val(u.src[1])}]", Ops.LOAD: CUDAPrinter.load, Ops.STORE: CUDAPrinter.store,
  Ops.CAST: _assigned(CUDAPrinter.cast), Ops.BITCAST: _assigned(CUDAPrinter.bitcast), **dict.fromkeys(GroupOp.ALU, _assigned(CUDAPrinter.alu)),
  # fused, one rounding (the lowering makes it for float32/float64 sums of products only)
  Ops.FMA: _assigned(lambda p, u: f"{'fma' if u.dtype == dtypes.float64 else 'fmaf'}({p.val(u.src[0])}, {p.val(u.src[1])}, {p.val(u.src[2])})"),
}
_CASTS: dict[str, Callable[[CUDAPrinter, str, DType, DType], str]] = {
  "to_bool": lambda p, v, src, dst: v if src.is_bool else f"{v} != {const_text(src, 0)}",
  "wrap": lambda p, v, src, dst: f"({ctype(dst)}){v}",  # int/bool -> int: two's complement wrap
  "sat": lambda p, v, src, dst: f"{p.helper(f'kiln_sat_{_sfx(dst)}')}((double){v})",
  "to_float": CUDAPrinter.cast_to_float, "float": CUDAPrinter.cast_float,
}


class EpiloguePrinter(CUDAPrinter):
  """Prints an elementwise expression (a tiled matmul's epilogue: cuda_matmul.py) with the same op tables and helpers as a
  whole kernel, so its arithmetic is kiln's; the caller names the sum and the ranges first (self.names) and collects
  self.lines and self.helpers."""

  def __init__(self, start: int = 0) -> None:
    Printer.__init__(self, None)  # type: ignore[arg-type]  # no lowered kernel: values only
    self.depth, self.n = 0, start
    self.last, self.written = {}, set()

  def expr(self, value: UOp, stop: UOp | None = None) -> str:
    """Renders value's nodes above `stop` (the sum, named by the caller) in order; returns value's C expression. A node the
    sum's body shares (an operand's index arithmetic that a load of the epilogue reuses) is printed here too."""
    for u in value.toposort(lambda x: x is not stop):
      if u in self.names or u.op is Ops.CONST: continue
      if u.op is Ops.DEFINE_GLOBAL: self.names[u] = f"data{u.arg}"
      else: self.render(u)
    return self.val(value)
