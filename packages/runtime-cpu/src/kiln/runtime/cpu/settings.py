"""kiln-runtime-cpu's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them)."""
from __future__ import annotations

import platform

from kiln.ir.settings import choice, flag, integer, text
from kiln.runtime.cpu.machine import cpu_names


def _cpu(name: str) -> str:
  if name.lower() not in (known := cpu_names(platform.machine())): raise ValueError(f"accepted here: {', '.join(sorted(known)) or 'none'}")
  return name


CPU = text("KILN_CPU", None, "the CPU LLVM compiles for, a narrower one than the host (unset: the host's)",
           "an LLVM CPU name kiln can target on this machine", _cpu)
GUARD = flag("KILN_GUARD", False, "every CPU buffer ends at an inaccessible page, so an out-of-bounds access faults (debugging)")
POOL_KINDS = ("native", "python")
POOL = choice("KILN_POOL", None, POOL_KINDS, "the CPU worker pool (unset: native where supported, else python)")
SPIN_US = integer("KILN_SPIN_US", 100, "microseconds a worker spins for the next kernel inside a plan and after the last plan ends "
                  "(0: never)", 0, "a whole number of microseconds >= 0")
