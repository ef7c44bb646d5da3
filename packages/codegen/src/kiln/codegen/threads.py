"""The CPU thread split's shared names and sizes: the `core_id` argument of a split kernel, how many threads kiln uses
(KILN_THREADS, else the physical cores this process may run on) and how many chunks a split kernel's work is cut into.
docs/architecture.md ("The thread split") follows a THREAD option from the heuristic through lowering, rendering and
the runtime's pool to the executor.

A split kernel is cut into `chunks` pieces, more than there are threads; the threads claim them from a shared counter
(an atomic add in the kernel's entry), so a thread on a free core takes more of them than one whose core is busy with
someone else's work. The chunk count is a property of the kernel, never of the thread count: a split reduction leaves
one partial per chunk and folds them in chunk order, so its bits are the same on 1 thread or 8. This module is the
protocol's one home; the pool that runs it, and its state (the count of running plans its workers spin on), are the CPU
runtime's (kiln.runtime.cpu.threads, native_pool, running)."""
from __future__ import annotations

import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from kiln.codegen import settings

# the name of the split kernel's chunk index in its ProgramSpec's var_names (last; the runtime passes it, never a user):
# chunks 0..chunks-1 each take a slice, and a split reduction's finishing call (chunk == chunks) folds the partials
CORE_ID = "core_id"

# what claiming a chunk costs, in core cycles: an atomic add on a cache line another core wrote last (~100 ns) and the
# call; a chunk gets at least 100 times that much work, so claiming costs under 1% of it
CLAIM_CYCLES = 300
CHUNKS_PER_CORE = 8  # enough that a core slowed by a neighbour's thread hands most of its share to the others
MIN_CHUNK_CAP = 16  # the cap on small machines, so a 2-core host still rebalances in eighths
MAX_CHUNKS = 256  # partials and argument space stay small whatever the core count


def min_chunk_work(vector_bytes: int, fused: bool) -> int:
  """Element-ops a chunk needs so claiming it costs under 1%: a core does about one element a cycle in a kernel that
  streams memory or computes a polynomial per element (a 1M-element float32 add: ~1.3 a cycle a thread, exact GELU
  less), and two vectors of multiply-adds a cycle in a register-tiled product (`fused`)."""
  return 100 * CLAIM_CYCLES * (2 * max(vector_bytes // 4, 1) if fused else 1)


def chunk_count(work: int, units: int | None, vector_bytes: int, cores: int, fused: bool = False) -> int:
  """How many chunks a kernel the heuristic splits gets, for `work` element-ops over `units` splittable units: as many
  as the claim cost allows, at most CHUNKS_PER_CORE per core (at least MIN_CHUNK_CAP, at most MAX_CHUNKS) and one per
  unit, but two at least (a kernel worth splitting at all is worth two threads), and a whole number a core (`per_core`)."""
  cap = min(max(MIN_CHUNK_CAP, CHUNKS_PER_CORE * max(cores, 1)), MAX_CHUNKS)
  least = min_chunk_work(vector_bytes, fused)
  n = max(min(work // least, cap), 2)
  if units is None: return per_core(n, cores)
  # a few more units than chunks: one a chunk where each is still worth its claim, since n chunks of ceil(units / n)
  # leave fewer, uneven ones (18 units in 16 chunks were 9 chunks of 2: one core of two took 5 of them)
  return per_core(units if n < units <= 2 * n and work // units >= least else min(n, units), cores)


def per_core(n: int, cores: int) -> int:
  """n chunks cut to a whole number a core where there are more chunks than cores: of 3 chunks on 2 cores one core
  computes two while the other waits (a third of the kernel's time), of 2 each computes one; fewer chunks, not more,
  so each is still worth its claim."""
  return n - n % cores if cores >= 1 and n > cores else n


def thread_count() -> int:
  """KILN_THREADS, else the number of physical cores this process may use. The one reader of KILN_THREADS."""
  n = settings.THREADS.get()
  return n if n is not None else available_cores()


def core_trip_ns() -> float | None:
  """A cache line's round trip between two of this process's cores, measured now by the CPU runtime (its
  `core_trip_ns`): what a split kernel's hand-offs cost. Benchmarks print it beside their times, so a run on cores
  placed far apart can be told from a slow one. None: one CPU, or no CPU runtime installed."""
  from kiln.codegen.registry import get_runtime
  try: runtime = get_runtime("CPU")
  except Exception: return None  # not installed, or it cannot start: the caller prints its line without it
  measure = getattr(runtime, "core_trip_ns", None)
  return measure() if measure is not None else None


SYSFS_CPU = "/sys/devices/system/cpu"
# a CPU's hardware threads, itself included: the newer name first (Linux 5.x), the older one where it is the only one
_SIBLINGS = ("core_cpus_list", "thread_siblings_list")


def available_cores() -> int:
  """The physical cores this process may run on: the CPUs of its affinity mask, the hardware threads of one core
  counted once. Two threads on one core share its vector units, so a split kernel's second thread there mostly spins
  and contends for them (onnxruntime, OpenVINO, torch and llama.cpp default to physical cores too); KILN_THREADS can
  still ask for more. Where the mask or the topology cannot be read: every CPU the OS reports."""
  try: allowed = os.sched_getaffinity(0)
  except AttributeError: return os.cpu_count() or 1
  return physical_cores(frozenset(allowed))


@lru_cache(maxsize=8)
def physical_cores(cpus: frozenset[int], root: str = SYSFS_CPU) -> int:
  """How many distinct cores the CPUs `cpus` belong to, from sysfs's sibling lists; len(cpus) where any CPU's list is
  missing (not Linux, a container without sysfs)."""
  cores: set[str] = set()
  for cpu in cpus:
    siblings = _read_first(Path(root, f"cpu{cpu}", "topology", name) for name in _SIBLINGS)
    if siblings is None: return max(len(cpus), 1)
    cores.add(siblings)
  return max(len(cores), 1)


def _read_first(paths: Iterable[Path]) -> str | None:
  for p in paths:
    try: return p.read_text().strip()
    except OSError: continue
  return None
