"""A kernel renders to the same text in every process: the source (and the entry point hashed from it) may depend on the
AST and the target only, never on memory addresses or hash seeds (block labels were once numbered by id())."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.render.cuda import CUDARenderer
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import AxisType, Ops, UOp, dtypes
n = UOp.variable("n", 0, 64)
o, x = UOp.define_global(0, dtypes.float32.ptr(64)), UOp.define_global(1, dtypes.float32.ptr(64 * 64))
i, r = UOp.range(n, 0), UOp.range(64, 1, AxisType.REDUCE)
ast = UOp.sink(o.index(i, i < 40).store(x.index(i * 64 + r).load().reduce(Ops.MAX, r)), name="gated_rowmax")
full = UOp.sink(o.index(0).store(x.index(r).load().reduce(Ops.ADD, r)), name="full_sum")
t = Target(device="CPU", vector_bytes=32, threads=2, min_work_per_thread=16)
specs = [LLVMRenderer(t).render(ast), LLVMRenderer(t).render(full, [Opt(OptOps.THREAD, 1, 2)]), CUDARenderer().render(ast)]
print("\\n".join(s.src + (s.entry_point or "") for s in specs))
"""


def _render(seed: str) -> str:
  env = {**os.environ, "PYTHONHASHSEED": seed}
  return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, env=env).stdout


def test_rendered_source_is_the_same_in_every_process():
  first = _render("1")
  assert "br i1" in first, "the kernel should branch (a gated store, a finishing call), so block labels are exercised"
  assert _render("2") == first
  # a process that allocated other objects first puts the same UOps at other addresses
  assert subprocess.run([sys.executable, "-c", "junk = [object() for _ in range(12345)]\n" + SCRIPT], capture_output=True, text=True,
                        check=True).stdout == first
