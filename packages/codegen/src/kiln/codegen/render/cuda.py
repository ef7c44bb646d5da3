"""CUDA C for NVIDIA GPUs, from a lowered kernel. Text only: no CUDA toolkit needed to render.

ABI: `extern "C" __global__ void __launch_bounds__(THREADS) NAME(T* __restrict__ data<slot>..., int <var>...)`: buffers in
slot order (const when only read), then int variables in var_names order. gidx<d>/lidx<d> are blockIdx/threadIdx; the
ProgramSpec's global_size is the grid in blocks, local_size the block. Registers hold float16 and bfloat16 as float, rounded
after every op (float16 computes in float and rounds once; bfloat16 rounds to nearest even after every op); memory holds
half and __nv_bfloat16. kiln's defined edges are small __device__ helpers in a prelude: x//0 == x, x%0 == 0, MIN//-1 == MIN,
shift amounts modulo the bit width, saturating float->int casts with NaN -> 0, IEEE maximum (NaN propagates, +0 > -0), and
signed arithmetic done in unsigned so it wraps instead of being undefined. Float multiplies go through __fmul_rn/__dmul_rn so
nvcc never contracts a*b+c into an FMA: results match the reference evaluator bit for bit except transcendental functions
(CUDA's exp2f/log2f/sinf are within 2 ulp) and group reductions (partial sums per thread, folded in thread order).
"""
from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence

from kiln.codegen.lower import LoweredKernel, lower
from kiln.codegen.opt import Opt, Target
from kiln.codegen.render.llvm import program_spec
from kiln.codegen.spec import ProgramSpec
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
_FUNC = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.SQRT: "sqrt", Ops.TRUNC: "trunc"}
_CMP = {Ops.CMPLT: "<", Ops.CMPEQ: "==", Ops.CMPNE: "!="}
_BIT = {Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^"}
_BOOL = {Ops.ADD: "||", Ops.OR: "||", Ops.MAX: "||", Ops.MUL: "&&", Ops.AND: "&&", Ops.XOR: "!=", Ops.SUB: "!=", Ops.CMPNE: "!="}
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
  if math.isnan(f): return "__int_as_float(0x7fc00000)"
  if math.isinf(f): return f"__int_as_float({struct.unpack('<i', struct.pack('<f', f))[0]})"
  s = float(struct.unpack("<f", struct.pack("<f", f))[0]).hex() + "f"
  return f"({s})" if s.startswith("-") else s


# ---- prelude helpers, emitted only when used ----
def _fmul(t: str, intr: str) -> str:
  # the intrinsic is never contracted into an FMA; the host (emulation) build has no FMA contraction to fear
  return (f"__device__ __forceinline__ {t} kiln_mul_{t}({t} a, {t} b) {{\n#ifdef __CUDACC__\n  return {intr}(a, b);\n#else\n  return a * b;\n"
          f"#endif\n}}")


def _helper(name: str) -> str:
  if name == "kiln_rh": return "__device__ __forceinline__ float kiln_rh(float x) { return __half2float(__float2half_rn(x)); }"
  if name == "kiln_rbf":  # round to nearest even bfloat16, NaN to the quiet NaN 0x7FC0 (as the reference)
    return ("__device__ __forceinline__ float kiln_rbf(float x) {\n  unsigned int b = __float_as_uint(x);\n"
            "  return x != x ? __uint_as_float(0x7fc00000u) : __uint_as_float((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);\n}")
  if name == "kiln_tobf16":
    return ("__device__ __forceinline__ __nv_bfloat16 kiln_tobf16(float x) {\n"
            "  return __ushort_as_bfloat16(x != x ? (unsigned short)0x7fc0 : (unsigned short)(__float_as_uint(x) >> 16));\n}")
  if name == "kiln_mul_float": return _fmul("float", "__fmul_rn")
  if name == "kiln_mul_double": return _fmul("double", "__dmul_rn")
  if name == "kiln_max_float":
    return ("__device__ __forceinline__ float kiln_max_float(float a, float b) {\n"
            "  return (a != a || b != b) ? a + b : a == b ? ((__float_as_uint(a) >> 31) ? b : a) : (a > b ? a : b);\n}")
  if name == "kiln_max_double":
    return ("__device__ __forceinline__ double kiln_max_double(double a, double b) {\n"
            "  return (a != a || b != b) ? a + b : a == b ? (__double_as_longlong(a) < 0 ? b : a) : (a > b ? a : b);\n}")
  if name == "kiln_odd_f32":  # double -> float rounded to odd: a later round to nearest of a narrower type then rounds once
    return ("__device__ __forceinline__ float kiln_odd_f32(double d) {\n  float f = (float)d;\n  if (d != d || (double)f == d) return f;\n"
            "  unsigned int b = __float_as_uint(f);\n  if (fabs((double)f) > fabs(d)) b -= 1;\n  return __uint_as_float(b | 1u);\n}")
  if name == "kiln_u64_bf16":  # an integer magnitude rounded once to bfloat16 (8 significant bits, ties to even)
    return ("__device__ __forceinline__ float kiln_u64_bf16(unsigned long long u) {\n  if (u < 256ULL) return (float)u;\n  int l = 63;\n"
            "  while (!(u >> l)) l--;\n  unsigned long long m = u >> (l - 7), rem = u & ((1ULL << (l - 7)) - 1), half = 1ULL << (l - 8);\n"
            "  if (rem > half || (rem == half && (m & 1ULL))) m++;\n  return ldexpf((float)m, l - 7);\n}")
  if (m := re.fullmatch(r"kiln_(idiv|mod|sat)_(\w+)", name)) is None: raise CodegenError(f"unknown CUDA helper {name}")
  kind, dt = m.group(1), getattr(dtypes, m.group(2))
  t, u = ctype(dt), _utype(dt)
  if kind in ("idiv", "mod"):
    if dt.is_unsigned:
      body = "b == 0 ? a : (T)(a / b)" if kind == "idiv" else "b == 0 ? (T)0 : (T)(a % b)"
    else:
      body = f"b == 0 ? a : b == -1 ? (T)(({u})0 - ({u})a) : (T)(a / b)" if kind == "idiv" else "(b == 0 || b == -1) ? (T)0 : (T)(a % b)"
    return f"__device__ __forceinline__ {t} {name}({t} a, {t} b) {{ return {body.replace('(T)', f'({t})')}; }}"
  # sat: float -> int: truncate, saturate, NaN -> 0 (C leaves it undefined)
  lo, hi = {8: ("-9223372036854775808.0", "9223372036854775808.0")}.get(dt.itemsize, (f"{dt.min}.0", f"{dt.max}.0"))
  if dt.is_unsigned: lo = "0.0"
  if dt.is_unsigned and dt.itemsize == 8: hi = "18446744073709551616.0"
  return (f"__device__ __forceinline__ {t} {name}(double x) {{\n  return x != x ? ({t})0 : x <= {lo} ? {const_text(dt, dt.min)} : "
          f"x >= {hi} ? {const_text(dt, dt.max)} : ({t})x;\n}}")


# device functions and types a kernel of the same name would clash with (an extern "C" kernel cannot overload them)
_CUDA_NAMES = _KEYWORDS | frozenset("""max min abs fabs fabsf fmax fmin fmaxf fminf sin cos tan sinf cosf tanf exp exp2 expf exp2f log log2 logf
  log2f log10 sqrt sqrtf rsqrt rsqrtf pow powf trunc truncf floor ceil round rint fma fmaf signbit isnan isinf isfinite ldexp ldexpf erf
  tanh sinh cosh asin acos atan atan2 cbrt hypot nan main float2 float4 int2 int4 dim3 uint3 warpSize blockIdx threadIdx blockDim
  gridDim""".split())


def _c_name(name: str) -> str: return f"var_{name}" if name in _KEYWORDS or _RESERVED.match(name) else name


class CUDARenderer:
  """Renderer for NVIDIA GPUs: lowers to blockIdx/threadIdx (LOCAL/GROUP options) and prints CUDA C."""
  device = "CUDA"

  def __init__(self, target: Target | None = None):
    self.target = target or Target(device="CUDA", vector_bytes=0, threads=1)

  def render(self, ast: UOp, opts: Sequence[Opt] | None = None) -> ProgramSpec:
    lk = lower(ast, self.target, list(opts) if opts is not None else None)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", lk.name): lk.name = re.sub(r"\W", "_", lk.name) or "kernel"
    if lk.name[0].isdigit() or lk.name in _CUDA_NAMES or lk.name.startswith("kiln_"): lk.name = "k_" + lk.name
    return program_spec(lk, CUDAPrinter(lk).print(), "CUDA", ast)


class CUDAPrinter:
  def __init__(self, lk: LoweredKernel):
    self.lk = lk
    self.names: dict[UOp, str] = {}
    self.lines: list[str] = []
    self.helpers: dict[str, str] = {}
    self.depth = 1
    self.n = 0
    names = {(u.dtype.base if isinstance(u.dtype, PtrDType) else u.dtype).name for u in lk.uops}
    self.uses_half, self.uses_bf16 = "float16" in names, "bfloat16" in names  # the CUDA headers only when used

  def emit(self, s: str) -> None: self.lines.append("  " * self.depth + s)

  def helper(self, name: str) -> str:
    if name not in self.helpers: self.helpers[name] = _helper(name)
    return name

  def val(self, u: UOp) -> str:
    if u.op is Ops.CONST:
      assert isinstance(u.dtype, DType)
      return const_text(u.dtype, u.arg)
    if u not in self.names: raise CodegenError(f"{u.op} used before it is defined (linearizer bug)")
    return self.names[u]

  def assign(self, u: UOp, expr: str, prefix: str = "v") -> None:
    assert isinstance(u.dtype, DType)
    name = f"{prefix}{self.n}"
    self.n += 1
    self.emit(f"{ctype(u.dtype)} {name} = {expr};")
    self.names[u] = name

  def print(self) -> str:
    lk = self.lk
    written = {u.src[0].src[0] for u in lk.uops if u.op is Ops.STORE and u.src[0].src[0].op is Ops.DEFINE_GLOBAL}
    params = []
    for g in lk.globals:
      assert isinstance(g.dtype, PtrDType)
      base = g.dtype.base
      params.append(f"{'' if g in written else 'const '}{_MTYPE[base.name]}* __restrict__ data{g.arg}")
      self.names[g] = f"data{g.arg}"
    for v in lk.vars:
      params.append(f"int {_c_name(v.arg[0])}")  # variables travel as 32-bit ints
      self.names[v] = _c_name(v.arg[0]) if v.dtype == dtypes.int32 else f"(({ctype(v.dtype)}){_c_name(v.arg[0])})"  # type: ignore[arg-type]
    for u in lk.uops: self.render(u)
    ls = lk.local_size or (1, 1, 1)
    threads = math.prod(int(x) if isinstance(x, int) else 1 for x in ls)
    head = [*(["#include <cuda_fp16.h>"] if self.uses_half else []), *(["#include <cuda_bf16.h>"] if self.uses_bf16 else []),
            *self.helpers.values(),
            f'extern "C" __global__ void __launch_bounds__({threads}) {lk.name}({", ".join(params)}) {{']
    return "\n".join([*head, *self.lines, "}", ""])

  # ---- one uop ----
  def render(self, u: UOp) -> None:
    op = u.op
    if op in (Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR): return
    if op is Ops.SPECIAL:
      if u.arg not in _SPECIAL: raise CodegenError(f"the CUDA renderer has no {u.arg} (core_id is a CPU thread index)")
      self.emit(f"int {u.arg} = {_SPECIAL[u.arg]}; /* {self.size_text(u.src[0])} */")
      self.names[u] = u.arg
      return
    if op is Ops.DEFINE_LOCAL:
      assert isinstance(u.dtype, PtrDType)
      name = f"red{self.n}"
      self.n += 1
      self.emit(f"__shared__ {ctype(u.dtype.base)} {name}[{u.dtype.size}];")
      self.names[u] = name
      return
    if op is Ops.BARRIER: return self.emit("__syncthreads();")
    if op is Ops.BIND:
      self.names[u] = self.val(u.src[1])  # a bound variable is its value
      return
    if op is Ops.RANGE:
      name = f"ridx{u.arg[0]}"
      self.emit(f"for (int {name} = {self.val(u.src[0])}; {name} < {self.val(u.src[1])}; {name}++) {{")
      self.names[u] = name
      self.depth += 1
      return
    if op is Ops.IF:
      self.emit(f"if ({self.val(u.src[0])}) {{")
      self.depth += 1
      return
    if op in (Ops.ENDRANGE, Ops.ENDIF):
      self.depth -= 1
      return self.emit("}")
    if op is Ops.DEFINE_ACC: return self.assign(u, self.val(u.src[0]), "acc")
    if op is Ops.ACC_STORE: return self.emit(f"{self.val(u.src[0])} = {self.val(u.src[1])};")
    if op is Ops.LOAD and u.src[0].op is Ops.DEFINE_ACC: return self.assign(u, self.val(u.src[0]))
    if op is Ops.INDEX:
      self.names[u] = f"{self.val(u.src[0])}[{self.val(u.src[1])}]"
      return
    if op is Ops.LOAD: return self.load(u)
    if op is Ops.STORE: return self.store(u)
    if op is Ops.CAST: return self.assign(u, self.cast(u))
    if op is Ops.BITCAST: return self.assign(u, self.bitcast(u))
    if op in GroupOp.ALU: return self.assign(u, self.alu(u))
    if op is Ops.FMA:  # fused, one rounding (the lowering makes it for float32/float64 sums of products only)
      return self.assign(u, f"{'fma' if u.dtype == dtypes.float64 else 'fmaf'}({self.val(u.src[0])}, {self.val(u.src[1])}, {self.val(u.src[2])})")
    raise CodegenError(f"the CUDA renderer cannot render {op} (no vectors on CUDA)")

  def size_text(self, s: UOp) -> str: return str(s.arg) if s.op is Ops.CONST else "symbolic"

  # ---- memory ----
  def load(self, u: UOp) -> None:
    idx = u.src[0]
    dt = u.dtype
    assert isinstance(dt, DType)
    v = self.val(idx)
    if idx.src[0].op is Ops.DEFINE_GLOBAL:
      if dt.name == "float16": v = f"__half2float({v})"
      elif dt.name == "bfloat16": v = f"__bfloat162float({v})"
    if len(idx.src) == 3: v = f"{self.val(idx.src[2])} ? {v} : {const_text(dt, 0)}"  # gated: no access when off
    self.assign(u, v)

  def store(self, u: UOp) -> None:
    idx, val = u.src
    dt = val.dtype
    assert isinstance(dt, DType)
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
    op, dt = u.op, u.dtype
    assert isinstance(dt, DType)
    src_dt = u.src[0].dtype if op is not Ops.WHERE else u.src[1].dtype
    assert isinstance(src_dt, DType)
    a = [self.val(x) for x in u.src]
    if op is Ops.WHERE: return f"{a[0]} ? {a[1]} : {a[2]}"
    if op in _CMP and not src_dt.is_bool: return f"{a[0]} {_CMP[op]} {a[1]}"
    if src_dt.is_bool:
      if op in _BOOL: return f"{a[0]} {_BOOL[op]} {a[1]}"
      if op is Ops.CMPLT: return f"!{a[0]} && {a[1]}"
      if op is Ops.CMPEQ: return f"{a[0]} == {a[1]}"
      raise CodegenError(f"{op} does not take bool operands")
    if src_dt.is_float: return self.float_alu(op, dt, a)
    return self.int_alu(u, op, dt, a)

  def float_alu(self, op: Ops, dt: DType, a: list[str]) -> str:
    t = "double" if dt.name == "float64" else "float"
    f = "" if t == "double" else "f"
    if op is Ops.NEG: return f"-{a[0]}"  # exact in every float type
    if op is Ops.MAX: return f"{self.helper(f'kiln_max_{t}')}({a[0]}, {a[1]})"  # returns an operand: no rounding needed
    if op is Ops.TRUNC: return f"trunc{f}({a[0]})"
    mul = f"kiln_mul_{t}"
    if op in (Ops.MUL, Ops.MULACC): self.helper(mul)
    if op is Ops.ADD: e = f"{a[0]} + {a[1]}"
    elif op is Ops.SUB: e = f"{a[0]} - {a[1]}"
    elif op is Ops.MUL: e = f"{mul}({a[0]}, {a[1]})"
    elif op is Ops.FDIV: e = f"{a[0]} / {a[1]}"
    elif op is Ops.RECIPROCAL: e = f"{const_text(dtypes.float64 if t == 'double' else dtypes.float32, 1.0)} / {a[0]}"
    elif op is Ops.MULACC: e = f"{self.round(f'{mul}({a[0]}, {a[1]})', dt)} + {a[2]}"  # unfused: round the product first
    elif op in _FUNC: e = f"{_FUNC[op]}{f}({a[0]})"
    else: raise CodegenError(f"{op} does not take {dt}")
    return self.round(e, dt)

  def int_alu(self, u: UOp, op: Ops, dt: DType, a: list[str]) -> str:
    t, ut = ctype(dt), _utype(dt)
    if op in _BIT: return f"({t})({a[0]} {_BIT[op]} {a[1]})"
    if op is Ops.MAX: return f"{a[0]} > {a[1]} ? {a[0]} : {a[1]}"
    if op in (Ops.SHL, Ops.SHR):
      amt = f"({a[1]} & {dt.bits - 1})"
      return f"({t})(({ut}){a[0]} << {amt})" if op is Ops.SHL else f"({t})({a[0]} >> {amt})"  # unsigned: a signed << may overflow
    if op in (Ops.IDIV, Ops.MOD):
      c = u.src[1]
      if c.op is Ops.CONST and c.arg not in (0, -1): return f"({t})({a[0]} {'/' if op is Ops.IDIV else '%'} {a[1]})"
      return f"{self.helper(f'kiln_{op.name.lower()}_{_sfx(dt)}')}({a[0]}, {a[1]})"
    sym = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*"}.get(op)
    if op is Ops.NEG: return f"({t})(-{a[0]})" if self.no_wrap(u) else f"({t})(({ut})0 - ({ut}){a[0]})"
    if sym is not None: return f"{a[0]} {sym} {a[1]}" if self.no_wrap(u) else f"({t})(({ut}){a[0]} {sym} ({ut}){a[1]})"
    if op is Ops.MULACC: return f"({t})(({ut}){a[0]} * ({ut}){a[1]} + ({ut}){a[2]})"
    raise CodegenError(f"{op} does not take {dt}")

  def no_wrap(self, u: UOp) -> bool:
    """True when u's bounds prove C's arithmetic on it cannot overflow (signed overflow is undefined; kiln wraps)."""
    dt = u.dtype
    assert isinstance(dt, DType)
    if dt.is_unsigned and dt.itemsize >= 4: return True  # unsigned int arithmetic wraps by definition
    try: lo, hi = u.vmin, u.vmax
    except Exception: return False  # noqa: BLE001  (no bounds: be safe)
    if (lo, hi) == (dt.min, dt.max): return False  # the bounds say it may wrap
    return all(isinstance(x.vmin, int) and -(2**31) <= int(x.vmin) and int(x.vmax) < 2**31 for x in (u, *u.src)) if dt.itemsize < 8 else True

  def cast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    assert isinstance(src, DType) and isinstance(dst, DType)
    v = self.val(u.src[0])
    if dst.is_bool: return f"{v} != {const_text(src, 0)}" if not src.is_bool else v
    if dst.is_int:
      if src.is_float: return f"{self.helper(f'kiln_sat_{_sfx(dst)}')}((double){v})"
      return f"({ctype(dst)}){v}"  # int/bool -> int: two's complement wrap
    # -> float
    if dst.name == "float64": return f"(double){v}"
    if src.is_bool or (src.is_int and src.itemsize <= 2): return self.round(f"(float){v}", dst)  # exact in float: one rounding
    if src.is_int:
      if dst.name == "bfloat16":  # round once from the exact integer (a float in between would round twice)
        if src.is_unsigned: return f"{self.helper('kiln_u64_bf16')}({v})"
        m = f"({v} < 0 ? 0ULL - (unsigned long long){v} : (unsigned long long){v})"
        return f"({v} < 0 ? -{self.helper('kiln_u64_bf16')}({m}) : {self.helper('kiln_u64_bf16')}({m}))"
      return self.round(f"(float){v}", dst)  # float16: a 32/64-bit int past 65519 is inf either way
    if src.name == "float64" and dst.name != "float32": return self.round(f"{self.helper('kiln_odd_f32')}({v})", dst)
    if src.name == "float64": return f"(float){v}"
    return self.round(v, dst) if dst.name in ("float16", "bfloat16") else v  # float32/float16/bfloat16 registers are floats

  def bitcast(self, u: UOp) -> str:
    src, dst = u.src[0].dtype, u.dtype
    assert isinstance(src, DType) and isinstance(dst, DType)
    v = self.val(u.src[0])
    # to raw bits
    if src.name == "float32": bits = f"__float_as_uint({v})"
    elif src.name == "float64": bits = f"(unsigned long long)__double_as_longlong({v})"
    elif src.name == "float16": bits = f"__half_as_ushort(__float2half_rn({v}))"
    elif src.name == "bfloat16": bits = f"(unsigned short)(__float_as_uint({v}) >> 16)"
    else: bits = f"({_utype(src) if src.itemsize >= 4 else 'unsigned int'}){v}"
    # from raw bits
    if dst.is_bool: return f"(unsigned char)({bits}) != 0"
    if dst.is_int: return f"({ctype(dst)})({bits})"
    if dst.name == "float32": return f"__uint_as_float((unsigned int)({bits}))"
    if dst.name == "float64": return f"__longlong_as_double((long long)({bits}))"
    if dst.name == "float16": return f"__half2float(__ushort_as_half((unsigned short)({bits})))"
    return f"__uint_as_float((unsigned int)(unsigned short)({bits}) << 16)"
