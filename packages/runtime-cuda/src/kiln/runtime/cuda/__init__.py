"""kiln.runtime.cuda: CUDA C to PTX and a fatbin (nvcc) or cubin (NVRTC), a runtime over pycuda.driver (the `driver` extra,
imported lazily) and a CPU emulation harness for rendered CUDA C. Importing this package never needs pycuda or a GPU.
None of it has run on a real GPU (see README.md for what was checked and how)."""
from kiln.runtime.cuda.compiler import CUDACompiler
from kiln.runtime.cuda.driver import CUDAAllocator, CUDAProgram, CUDARuntime
from kiln.runtime.cuda.version import __version__

__all__ = ["CUDACompiler", "CUDAAllocator", "CUDAProgram", "CUDARuntime", "__version__"]
