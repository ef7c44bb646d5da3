"""KILN_DEBUG: 1 one line per kernel run (time, GB/s or GFLOP/s), 2 applied optimisations, 3 generated source, 4 the AST."""
from __future__ import annotations

import sys
from typing import Any

from kiln.codegen import settings

DEBUG = settings.DEBUG.get()  # read on the fast path as a module global; set_level() changes it in-process


def set_level(level: int) -> None:
  global DEBUG
  DEBUG = int(level)


def level() -> int: return DEBUG


def emit(msg: str) -> None: print(msg, file=sys.stderr, flush=True)


def fmt_time(t: float) -> str:
  return f"{t * 1e6:8.2f} us" if t < 1e-3 else f"{t * 1e3:8.3f} ms" if t < 1 else f"{t:8.3f} s "


def rate(nbytes: int, flops: int, t: float) -> str:
  """GFLOP/s for compute-heavy kernels (over 4 flops per byte), else GB/s."""
  if t <= 0: return "-"
  if flops and flops > 4 * max(nbytes, 1): return f"{flops / t * 1e-9:8.2f} GFLOP/s"
  return f"{nbytes / t * 1e-9:8.2f} GB/s"


def kernel_line(name: str, device: str, t: float, nbytes: int, flops: int, extra: str = "") -> str:
  return f"*** {device:<6} {name:<32} {fmt_time(t)}  {rate(nbytes, flops, t)}{'  ' + extra if extra else ''}"


def on_compiled(kernel: Any, source: str) -> None:
  """Levels 2-4 when a kernel is compiled or loaded from the disk cache."""
  if DEBUG < 2: return
  emit(f"kiln: kernel {kernel.entry_point} on {kernel.device} ({source}); opts: {', '.join(kernel.applied_opts) or 'none'}")
  if DEBUG >= 3 and kernel.code: emit(kernel.code)
  if DEBUG >= 4 and kernel.ast is not None:
    for i, u in enumerate(kernel.ast.toposort()): emit(f"  {i:4d} {u.op.name:<14} {u.dtype!s:<14} src={[s.op.name for s in u.src]} arg={u.arg!r}")
