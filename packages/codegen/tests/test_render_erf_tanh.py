"""ERF and TANH render to the CUDA math library (erff/tanhf on float registers, erf/tanh on double) and in LLVM IR to
the renderer's own inline code for float registers (render/llvm_math.py) and libm calls on double. The float32 EXP2, ERF and TANH
helpers compute in float and i32 only, with no fast-math flag, in the same instructions for every lane count; FMA only where the
target has one (Target.fma), and then as llvm.fma in every polynomial step."""
import re

import pytest

from kiln.codegen.choose import Target
from kiln.codegen.render import CUDARenderer, llvm_math
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import Ops, UOp, dtypes

FLOATS = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]


def kernel(op: Ops, dt, n: int = 64) -> UOp:
  i = UOp.range(n, 0)
  return UOp.sink(UOp.define_global(0, dt.ptr(n)).index(i).store(UOp(op, dt, (UOp.define_global(1, dt.ptr(n)).index(i).load(),))))


@pytest.mark.parametrize("op", [Ops.ERF, Ops.TANH])
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_cuda_calls_the_math_library(op: Ops, dt) -> None:
  fn = op.name.lower() + ("" if dt == dtypes.float64 else "f")  # 16-bit floats live in float registers
  assert f"{fn}(" in CUDARenderer().render(kernel(op, dt)).src


@pytest.mark.parametrize("op", [Ops.ERF, Ops.TANH])
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_llvm_inline_float_libm_double(op: Ops, dt) -> None:
  name = op.name.lower()
  for opts in ([], None):  # scalar, and vectorised: double called lane by lane
    src = LLVMRenderer().render(kernel(op, dt), opts=opts).src
    if dt == dtypes.float64: assert f"declare double @{name}(double)" in src and f"call double @{name}(double " in src, src
    else: assert f"@kiln.{name}.f32." in src and f"@{name}f(" not in src, src


@pytest.mark.parametrize("op", [Ops.EXP2, Ops.ERF, Ops.TANH])
def test_float32_helper_stays_in_float(op: Ops) -> None:
  """No double (the full vector width of floats), no FMA or fast-math flag (the same bits on every x86 level), no call, and one
  instruction sequence whatever the lane count (scalar and vector code agree bit for bit)."""
  def opcodes(text: str) -> list[str]: return re.findall(r"= (fcmp \w+|\w+) ", text)
  seqs = []
  for n in (1, 4, 8, 16):
    name, text = llvm_math.helper(op, n)
    assert name == f"kiln.{op.name.lower()}.f32.{n}"
    assert not re.search(r"double|fpext|fptrunc|call|fma|fmuladd|\b(fast|contract|reassoc|afn|nnan|ninf|nsz|arcp)\b", text), text
    seqs.append(opcodes(text))
  assert seqs[0] and all(s == seqs[0] for s in seqs), seqs


@pytest.mark.parametrize("op", [Ops.EXP2, Ops.ERF, Ops.TANH])
def test_fma_helper_fuses_its_polynomials(op: Ops) -> None:
  """With a fused multiply-add (Target.fma) the helper calls llvm.fma and nothing else, stays in float, is shorter than without,
  has one instruction sequence whatever the lane count, and the renderer declares the intrinsic once for the kernel."""
  def opcodes(text: str) -> list[str]: return re.findall(r"= (fcmp \w+|call [^@]*@[\w.]+|\w+) ", text)
  seqs = []
  for n in (1, 4, 8, 16):
    name, text = llvm_math.helper(op, n, fma=True)
    assert name == f"kiln.{op.name.lower()}.f32.{n}.fma"
    calls = set(re.findall(r"call [^@]*@([\w.]+)\(", text))
    assert calls == {f"llvm.fma.{'f32' if n == 1 else f'v{n}f32'}"}, calls
    assert not re.search(r"double|fpext|fptrunc|fmuladd|\b(fast|contract|reassoc|afn|nnan|ninf|nsz|arcp)\b", text), text
    assert len(opcodes(text)) < len(opcodes(llvm_math.helper(op, n)[1])), (op, n)
    seqs.append([re.sub(r"call [^@]*@([\w.]+)\.(f32|v\d+f32)$", r"\1", o) for o in opcodes(text)])
  assert seqs[0] and all(s == seqs[0] for s in seqs), seqs
  src = LLVMRenderer(Target(device="CPU", vector_bytes=32, fma=True)).render(kernel(op, dtypes.float32)).src
  decls = re.findall(r"declare .*@llvm\.fma\.(v\d+f32)\(", src)
  helpers = re.findall(rf"define internal .*@kiln\.{op.name.lower()}\.f32\.(\d+)\.fma(?:\.rn)?\(", src)
  assert len(decls) == len(set(decls)) == len(helpers) == 1 and decls[0] == f"v{helpers[0]}f32", (decls, helpers)


@pytest.mark.parametrize("op", [Ops.EXP2, Ops.ERF, Ops.TANH])
def test_avx512_helpers_scale_by_vscalef(op: Ops) -> None:
  """AVX-512 targets scale 2^f by 2^n with vscalefps (llvm_math._Body.scale): no exponent-field shifts, fewer instructions, every
  lane count a power of two up to 64 (padded or split to zmm), other lane counts as before; declared once per kernel."""
  def ops(text: str) -> list[str]: return re.findall(r"= (\w+) ", text)
  for n in (1, 4, 8, 16, 32, 64):
    name, text = llvm_math.helper(op, n, fma=True, scalef=True)
    assert name.endswith(".fma.sc") and llvm_math.SCALEF in text and " shl " not in text, (n, text)
    assert len([o for o in ops(text) if o not in ("shufflevector", "insertelement", "extractelement")]) < len(ops(llvm_math.helper(op, n, True)[1]))
  name, text = llvm_math.helper(op, 10, fma=True, scalef=True)  # not a power of two: the exponent-field path
  assert not name.endswith(".sc") and llvm_math.SCALEF not in text
  assert not llvm_math.has_scalef(Target(device="CPU", vector_bytes=32)) and not llvm_math.has_scalef(Target(device="CUDA", vector_bytes=0))
  src = LLVMRenderer(Target(device="CPU", vector_bytes=64, fma=True)).render(kernel(op, dtypes.float32)).src
  assert src.count(f"declare <16 x float> @{llvm_math.SCALEF}(") == 1, src[:2000]


@pytest.mark.parametrize("op", [Ops.EXP2, Ops.ERF, Ops.TANH])
def test_round_by_roundeven_where_one_instruction(op: Ops) -> None:
  """AVX (and wider) and AArch64 targets round n = round(x) by llvm.roundeven (roundps/frintn: one instruction) instead of the MAGIC
  add and subtract, declared once per kernel; 16-byte x86 targets (SSE2, x86-64-v2) keep the add; fewer instructions either way
  (test_vector_math.py checks the bits are the same)."""
  def ops(text: str) -> list[str]: return re.findall(r"= (\w+) ", text)
  for n in (1, 8, 16):
    name, text = llvm_math.helper(op, n, fma=True, rounds=True)
    assert name.endswith(".rn") and f"@llvm.roundeven.{llvm_math.fma_suffix(n)}(" in text and llvm_math.double_hex(llvm_math.MAGIC) not in text
    assert len(ops(text)) < len(ops(llvm_math.helper(op, n, fma=True)[1])), (op, n)
  assert not llvm_math.helper(Ops.LOG2, 8, rounds=True)[0].endswith(".rn")  # LOG2 rounds nothing
  # the machine model says (Target.round), not the vector width: an SSE4.1 target of 16-byte vectors rounds in one instruction
  assert llvm_math.has_round(Target(device="CPU", vector_bytes=16, round=True))
  assert not llvm_math.has_round(Target(device="CPU", vector_bytes=64, round=False))
  assert not llvm_math.has_round(Target(device="CUDA", vector_bytes=0, round=True))
  for vb in (16, 32):
    src = LLVMRenderer(Target(device="CPU", vector_bytes=vb, fma=vb > 16, round=True)).render(kernel(op, dtypes.float32)).src
    assert len(re.findall(r"declare .*@llvm\.roundeven\.", src)) == 1, src[:2000]
  assert "roundeven" not in LLVMRenderer(Target(device="CPU", vector_bytes=32, fma=True)).render(kernel(op, dtypes.float32)).src
