"""Renderers: kernel AST to source. LLVM IR for the CPU; CUDA C for NVIDIA GPUs."""
from kiln.codegen.render.cuda import CUDARenderer
from kiln.codegen.render.llvm import LLVMRenderer

__all__ = ["CUDARenderer", "LLVMRenderer"]
