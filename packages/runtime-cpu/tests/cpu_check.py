"""What the codegen tests beside this file share: one kernel rendered, compiled and run on raw arrays (run_kernel), and a
test module's check run again as AVX2 code, in a fresh process with KILN_CPU=x86-64-v3 (and no disk cache) on an x86
host that has AVX2, so an AVX-512 host proves the other ISA's code too (check_as_avx2)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import UOp
from kiln.runtime.cpu.compiler import host_cpu
from kiln.runtime.cpu.machine import is_x86

needs_avx2 = pytest.mark.skipif(not (is_x86(platform.machine()) and "+avx2" in host_cpu()[1].split(",")), reason="needs an x86 host with AVX2")


def check_as_avx2(module: str, check: str) -> None:
  """Import `module` (a test file beside this one) in a fresh AVX2 process and call its `check`; it must print nothing
  but pass."""
  env = {**os.environ, "KILN_CPU": "x86-64-v3", "KILN_CACHE": "0"}
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
          "from kiln.codegen.registry import get_runtime\nassert get_runtime('CPU').target.vector_bytes == 32\n"
          f"from {module} import {check}\n{check}()\nprint('ok')")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def run_kernel(ast: UOp, out: np.ndarray, *ins: np.ndarray) -> str:
  """Render ast with the heuristic's options, run it once on out and ins (slots 0, 1, ...), and return its LLVM IR."""
  rt = get_runtime("CPU")
  spec = rt.renderer.render(ast)
  rt.load(rt.compiler.compile(spec))([out.ctypes.data] + [a.ctypes.data for a in ins], [], wait=True)
  return spec.src
