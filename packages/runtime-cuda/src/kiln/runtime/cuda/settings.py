"""kiln-runtime-cuda's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them)."""
from __future__ import annotations

from kiln.ir.settings import choice, flag, integer, text

ARCH = text("KILN_CUDA_ARCH", None, "the GPU architecture compiled for (unset: the GPU's own, or sm_90 without one)", "an sm_XX name")
DRIVER = choice("KILN_CUDA_DRIVER", "pycuda", ("pycuda", "cuda-python"), "the Python binding to the CUDA driver")
GRAPHS = flag("KILN_CUDA_GRAPHS", True, "a plan's kernels are launched as one CUDA graph where it can be (0: one launch each)")
LRU_BYTES = integer("KILN_CUDA_LRU_BYTES", 1 << 30, "bytes of freed device memory kept for reuse", 0, "a whole number of bytes >= 0")
TF32 = flag("KILN_CUDA_TF32", False, "float32 matrix products may use TF32 tensor cores (inputs rounded to 10 mantissa bits)")
COMPILE_THREADS = integer("KILN_COMPILE_THREADS", None, "kernels a plan's builder compiles at once (unset: one per core, at most 32)",
                          1, "a positive whole number")
EMU_MODES = ("fibers", "threads")
EMU_MODE = choice("KILN_EMU_MODE", None, EMU_MODES, "the CUDA emulator's threads (unset: fibers on x86-64, else threads)")
EMU_STACK_KB = integer("KILN_EMU_STACK_KB", 64, "KiB of stack per emulated CUDA thread in fibers mode (read by the launcher's C++)",
                       1, "a positive whole number of KiB")
