"""KILN_CPU=x86-64-v3 on a wider host: AVX2 code that runs and matches numpy; and the register tile's inner loop keeps
its accumulators in registers (no stack spills) on AVX2 (16 registers) and AVX-512 (32)."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest

from kiln.codegen.choose import OptOps, Target, heuristic_opts
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import kernels
from kiln.runtime.cpu.compiler import LLVMCompiler, host_cpu
from kiln.runtime.cpu.machine import is_x86

FEATS = host_cpu()[1].split(",")
needs_avx2 = pytest.mark.skipif(not (is_x86(platform.machine()) and "+avx2" in FEATS), reason="needs an x86 host with AVX2")

AVX2_RUN = r'''
import numpy as np
from kiln.codegen.registry import get_runtime
from kiln.ir import dtypes, kernels
rt = get_runtime("CPU")
assert (rt.compiler.cpu, rt.compiler.choice.from_env, rt.target.vector_bytes, rt.target.vector_registers) == ("x86-64-v3", True, 32, 16)
rng = np.random.default_rng(0)
def run(ast, out, *ins):
  spec = rt.renderer.render(ast)
  asm = rt.compiler.assembly(spec.src)
  assert "ymm" in asm and "zmm" not in asm, spec.name
  rt.load(rt.compiler.compile(spec))([out.ctypes.data] + [a.ctypes.data for a in ins], [], wait=True)
  return spec
a, b = rng.standard_normal((96, 80)).astype(np.float32), rng.standard_normal((80, 72)).astype(np.float32)
out = np.zeros((96, 72), np.float32)
spec = run(kernels.matmul(96, 72, 80), out, a, b)
assert "UNROLL(axis=0, 6)" in spec.applied_opts, spec.applied_opts  # the 16-register tile: 6 rows where 6 divide them
np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
x, y = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
z = np.zeros(1000, np.float32)
run(kernels.elementwise(lambda p, q: p * q + p, dtypes.float32, ((1000,), dtypes.float32), ((1000,), dtypes.float32)), z, x, y)
np.testing.assert_array_equal(z, x * y + x)
print("ok")
'''


@needs_avx2
def test_kiln_cpu_x86_64_v3_compiles_and_runs_avx2_code() -> None:
  env = {**os.environ, "KILN_CPU": "x86-64-v3", "KILN_CACHE": "0"}
  r = subprocess.run([sys.executable, "-c", AVX2_RUN], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def hot_loop(asm: str) -> str:
  """The basic block with the most fused multiply-adds: the register tile's inner reduce loop."""
  return max(re.split(r"^\S+:.*$", asm, flags=re.M), key=lambda b: len(re.findall(r"\bvfmadd", b)))


def stack_vector_refs(block: str) -> list[str]:
  """Vector instructions that read or write the stack (spills and reloads)."""
  return [ln for ln in block.splitlines() if re.search(r"\((%rsp|%rbp)\b", ln) and re.search(r"%[xyz]mm\d", ln)]


@pytest.mark.parametrize("n", [256, 960, 1024])  # 960: AVX2 tiles 6 rows
@pytest.mark.parametrize("cpu,vector_bytes,feature", [("x86-64-v3", 32, "+avx2"), ("x86-64-v4", 64, "+avx512f")])
def test_matmul_register_tile_does_not_spill(cpu: str, vector_bytes: int, feature: str, n: int) -> None:
  # only compiled and read, never run: any x86 host checks both ISAs' code
  if not is_x86(platform.machine()): pytest.skip("needs an x86 host (the check reads x86 assembly)")
  comp = LLVMCompiler(cpu=cpu, runnable=False)
  t = Target(vector_bytes=vector_bytes, vector_registers=comp.choice.vector_registers, threads=1)
  ast = kernels.matmul(n, n, n)
  opts = heuristic_opts(ast, t)
  assert any(o.op is OptOps.UNROLL and o.axis == 0 for o in opts), opts
  hot = hot_loop(comp.assembly(LLVMRenderer(t).render(ast, opts).src))
  assert len(re.findall(r"\bvfmadd", hot)) >= 8, hot
  assert not stack_vector_refs(hot), f"{cpu}: the inner loop spills:\n" + "\n".join(stack_vector_refs(hot))


@needs_avx2
def test_spill_check_can_fail() -> None:
  # the old 8-row tile on AVX2's 16 registers spills: the check above sees it
  comp = LLVMCompiler(cpu="x86-64-v3")
  t = Target(vector_bytes=32, vector_registers=32, threads=1)  # a model that lies about the register file
  ast = kernels.matmul(256, 256, 256)
  assert stack_vector_refs(hot_loop(comp.assembly(LLVMRenderer(t).render(ast, heuristic_opts(ast, t)).src)))
