"""Entry point of the `kiln.devices` group: `CUDA = kiln.runtime.cuda.device:CUDARuntime`."""
from kiln.runtime.cuda.driver import CUDARuntime

__all__ = ["CUDARuntime"]
