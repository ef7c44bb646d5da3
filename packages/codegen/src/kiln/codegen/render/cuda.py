"""The CUDA renderer: kiln.codegen.pipeline lowers a kernel (or picks the tiled matrix product) and this prints it as CUDA
C, through cuda_c.py's printer (the C text, its ABI and kiln's defined edges) or cuda_matmul.py's tiled kernel."""
from __future__ import annotations

import re
from collections.abc import Sequence

from kiln.codegen.choose import Opt, Target
from kiln.codegen.choose.contraction import Contraction
from kiln.codegen.choose.tiling import Tiling
from kiln.codegen.lowering.lower import LoweredKernel
from kiln.codegen.pipeline import compile_ast
from kiln.codegen.render import cuda_matmul
from kiln.codegen.render.base import program_spec
from kiln.codegen.render.cuda_c import CUDA_NAMES, CUDAPrinter
from kiln.codegen.spec import ProgramSpec
from kiln.ir.uop import UOp


class CUDARenderer:
  """Renderer for NVIDIA GPUs: kiln.codegen.pipeline lowers to blockIdx/threadIdx (LOCAL/GROUP options) or picks the tiled
  matrix-product kernel (render/cuda_matmul.py); this prints CUDA C."""
  device = "CUDA"

  def __init__(self, target: Target | None = None):
    self.target = target or Target(device="CUDA", vector_bytes=0, threads=1)

  def render(self, ast: UOp, opts: Sequence[Opt] | None = None) -> ProgramSpec: return compile_ast(ast, self, opts)

  def print_kernel(self, lk: LoweredKernel, ast: UOp) -> ProgramSpec:
    lk.name = _c_kernel_name(lk.name)
    printer = CUDAPrinter(lk)
    return program_spec(lk, printer.print(), "CUDA", ast, vars_in_memory=printer.vars_in_memory)

  def tiled_product(self, ast: UOp) -> Contraction | None: return cuda_matmul.covers(ast, self.target)

  def print_tiled(self, ast: UOp, product: Contraction, tiling: Tiling) -> ProgramSpec:
    return cuda_matmul.program(ast, product, tiling, _c_kernel_name(str(ast.arg or "kernel")))


def _c_kernel_name(name: str) -> str:
  """A kernel name that is a C identifier and clashes with nothing CUDA or kiln's helpers define."""
  if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name): name = re.sub(r"\W", "_", name) or "kernel"
  if name[0].isdigit() or name in CUDA_NAMES or name.startswith("kiln_"): name = "k_" + name
  return name
