"""Which CUDA errors are sticky: after one of them the context cannot be used again (CUDA reports it on every later call).
The driver's ContextGuard and the graph runs (graph.py) both ask."""
from __future__ import annotations

# cuGetErrorString texts (and CUresult names) of the sticky errors
STICKY = ("illegal memory access", "illegal address", "unspecified launch failure", "misaligned address", "illegal instruction",
          "device-side assert", "hardware stack error", "invalid program counter", "not supported on global/shared address space",
          "launch timed out", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED_ADDRESS",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_ASSERT", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_LAUNCH_TIMEOUT")


def is_sticky(e: BaseException) -> bool:
  """An error after which the CUDA context is unusable."""
  s = str(e).lower()
  return any(k.lower() in s for k in STICKY)
