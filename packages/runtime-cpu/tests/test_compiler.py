"""LLVMCompiler: host object code, CompileError with LLVM's message and the offending IR line, specs that travel between processes."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import kiln.runtime.cpu.compiler as compiler_mod
from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import CompiledSpec
from kiln.ir import CodegenError, CompileError, UOp, dtypes, kernels, reference
from kiln.runtime.cpu.compiler import LLVMCompiler, host_cpu, host_vector_bytes

RT = get_runtime("CPU")


def add_kernel(n: int = 256, name: str = "add") -> UOp:
  return kernels.elementwise(lambda a, b: a + b, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32), name=name)


def broken(src: str, old: str, new: str) -> tuple[str, int]:
  """src with the first line containing `old` changed; returns it and that line's 1-based number."""
  lines = src.splitlines()
  ln = next(i for i, line in enumerate(lines) if old in line)
  lines[ln] = lines[ln].replace(old, new, 1)
  return "\n".join(lines) + "\n", ln + 1


@pytest.mark.parametrize("old,new,msg", [("fadd", "fbad", "expected instruction opcode"), ("fadd float", "fadd i32", "expected 'i32'"),
                                         ("ret void", "ret i32 %nope", "")])
def test_compile_error_carries_llvm_message_and_offending_line(old: str, new: str, msg: str) -> None:
  spec = RT.renderer.render(add_kernel(), opts=[])
  src, ln = broken(spec.src, old, new)
  with pytest.raises(CompileError) as ei: RT.compiler.compile(spec.model_copy(update={"src": src}))
  e = ei.value
  assert "error" in e.log and msg in e.log, e.log
  assert re.search(rf"^\s*{ln}> .*{re.escape(new)}", e.source_lines, re.M), f"line {ln} not marked in:\n{e.source_lines}"
  assert e.log in str(e) and e.source_lines in str(e)


def test_compile_error_from_the_verifier() -> None:
  # parses, but a block without a terminator fails verification: still a CompileError with the log
  spec = RT.renderer.render(add_kernel(), opts=[])
  src = spec.src.replace("  ret void\n", "")
  with pytest.raises(CompileError, match="LLVM rejected") as ei: RT.compiler.compile(spec.model_copy(update={"src": src}))
  assert ei.value.log


def test_object_code_for_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv("KILN_CPU", raising=False)  # this test is about the host: the suite may run under KILN_CPU
  from kiln.codegen.render.llvm import LLVMRenderer
  from kiln.runtime.cpu.device import cpu_target
  spec = LLVMRenderer(cpu_target()).render(add_kernel(), opts=None)  # the host's vector width, not RT's (made under KILN_CPU)
  c = LLVMCompiler().compile(spec)
  assert c.bytes[:4] == b"\x7fELF" if sys.platform.startswith("linux") else c.bytes
  cpu, feats = host_cpu()
  comp = LLVMCompiler()
  assert comp.cpu == cpu and comp.features == feats and cpu in comp.cache_key and "O3" in comp.cache_key
  asm = comp.assembly(spec.src)
  if host_vector_bytes() == 64: assert "zmm" in asm, "AVX-512 host but no 512-bit vectors in the vectorised kernel"
  elif host_vector_bytes() == 32: assert "ymm" in asm


def test_no_deprecated_llvm_initialize() -> None:
  assert "llvm.initialize()" not in inspect.getsource(compiler_mod)


def test_compiled_spec_round_trips_through_json_and_runs() -> None:
  ast = add_kernel(1000, "add1000")
  c = RT.compiler.compile(RT.renderer.render(ast))
  c2 = CompiledSpec.model_validate_json(c.model_dump_json())
  assert c2.bytes == c.bytes and c2.var_names == c.var_names and c2.threads == c.threads
  a, b = np.arange(1000, dtype=np.float32), np.full(1000, 0.5, np.float32)
  out = np.zeros(1000, np.float32)
  RT.load(c2)([out.ctypes.data, a.ctypes.data, b.ctypes.data])
  assert (out == a + b).all()


def test_compiled_in_another_process_loads_here(tmp_path) -> None:
  path = tmp_path / "k.json"
  code = f"""
from kiln.codegen.registry import get_runtime
from kiln.ir import dtypes, kernels
rt = get_runtime("CPU")
ast = kernels.elementwise(lambda a: a * a - 1.0, dtypes.float64, ((777,), dtypes.float64), name="sq")
open({str(path)!r}, "w").write(rt.compiler.compile(rt.renderer.render(ast)).model_dump_json())
"""
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  c = CompiledSpec.model_validate_json(path.read_text())
  x = np.random.default_rng(1).standard_normal(777)
  out = np.zeros(777)
  RT.load(c)([out.ctypes.data, x.ctypes.data])
  assert out.tobytes() == reference.run(c.ast, np.zeros(777), x)[0].tobytes()


def test_compiles_from_several_threads_at_once() -> None:
  results: dict[int, np.ndarray] = {}
  errors: list[str] = []

  def work(t: int) -> None:
    try:
      ast = kernels.elementwise(lambda a, t=t: a * float(t + 2), dtypes.float32, ((512,), dtypes.float32), name=f"mul{t}")
      prog = RT.load(RT.compiler.compile(RT.renderer.render(ast)))
      x, out = np.arange(512, dtype=np.float32), np.zeros(512, np.float32)
      prog([out.ctypes.data, x.ctypes.data])
      results[t] = out
    except Exception as e:  # reported below
      errors.append(repr(e))

  ts = [threading.Thread(target=work, args=(t,)) for t in range(6)]
  for t in ts: t.start()
  for t in ts: t.join(120)
  assert not errors, errors
  for t, out in results.items(): assert (out == np.arange(512, dtype=np.float32) * (t + 2)).all()
  assert len(results) == 6


def test_load_rejects_missing_code_or_symbol() -> None:
  c = RT.compiler.compile(RT.renderer.render(add_kernel(name="named_a")))
  with pytest.raises(CompileError, match="symbol named_b not found"): RT.load(c.model_copy(update={"name": "named_b", "entry_point": "named_b"}))
  assert RT.load(c) is not None  # the object went into the shared engine once; its real symbol still loads
  with pytest.raises(CompileError, match="no object code"): RT.load(CompiledSpec(name="x", src="x", ast=c.ast))


def test_variable_names_cannot_clash_with_generated_names() -> None:
  # user variables named like the renderer's own values (%t1, %data0, %r0, %acc0, %scratch) must still compile and run
  for name in ("t1", "data0", "r0", "acc0", "scratch", "var"):
    v = UOp.variable(name, 1, 300)
    ast = kernels.elementwise(lambda a: a + 1.0, dtypes.float32, ((v,), dtypes.float32), name=f"clash_{name}")
    prog = RT.load(RT.compiler.compile(RT.renderer.render(ast)))
    x, out = np.arange(300, dtype=np.float32), np.zeros(300, np.float32)
    prog([out.ctypes.data, x.ctypes.data], [200])
    assert (out[:200] == x[:200] + 1).all() and not out[200:].any(), name


def test_core_id_is_a_reserved_variable_name() -> None:
  v = UOp.variable("core_id", 1, 300)
  ast = kernels.elementwise(lambda a: a + 1.0, dtypes.float32, ((v,), dtypes.float32), name="uses_core_id")
  with pytest.raises(CodegenError, match="core_id is reserved"): RT.renderer.render(ast)


def _loads_module(n: int, ty: str = "float") -> str:
  """A function summing n scalar loads of `ty` from one pointer (a gathered vector's lanes, as a kernel renders them)."""
  body = [f"  %p{i} = getelementptr inbounds float, ptr %a, i32 {i * 16}\n  %v{i} = load {ty}, ptr %p{i}, align 4" for i in range(n)]
  adds = [f"  %s{i} = fadd {ty} %s{i - 1}, %v{i}" if i else f"  %s0 = fadd {ty} 0.0, %v0" for i in range(n)]
  return f"define {ty} @f(ptr noalias %a) {{\n" + "\n".join(body + adds) + f"\n  ret {ty} %s{n - 1}\n}}\n"


def test_slp_is_skipped_in_a_module_of_many_scalar_loads() -> None:
  limit = compiler_mod.SLP_MAX_SCALAR_LOADS
  assert limit is not None
  assert compiler_mod.slp_pays(_loads_module(limit)) and not compiler_mod.slp_pays(_loads_module(limit + 1))
  vec = "define void @g(ptr %a) {\n" + "\n".join(f"  %v{i} = load <16 x float>, ptr %a, align 64" for i in range(limit + 1)) + "\n  ret void\n}\n"
  assert compiler_mod.slp_pays(vec)  # kiln's own vectors are not what SLP looks for
  comp = LLVMCompiler()
  assert f"|slp{limit}" in comp.cache_key  # code compiled under another limit is not reused
  for n in (8, limit + 1):  # either pipeline builds the module
    assert comp.compile_module(_loads_module(n))
