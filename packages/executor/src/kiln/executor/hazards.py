"""The order a plan must keep: hazard dependencies on storage byte ranges, dependency levels with cycle detection, and reuse of
intermediate buffers' memory between ops whose lifetimes do not overlap. Pure functions over op indices."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kiln.ir.errors import PlanError


@dataclass(frozen=True)
class ByteAccess:
  """One op touching bytes [start, end) of a storage, reading or writing."""
  storage: int
  start: int
  end: int
  write: bool


def hazard_deps(accesses: Sequence[Sequence[ByteAccess]]) -> list[set[int]]:
  """For ops in program order, the earlier ops each must wait for: read after write, write after read, write after write,
  on overlapping byte ranges of the same storage (so views of one buffer conflict only where they overlap).

  Only the nearest hazards are kept, so a plan of N ops over a few buffers is O(N), not O(N^2) in time and memory (10,000
  kernels took 64 s and 3.6 GB): an access that a later write covers whole leaves the storage's history (whatever conflicts
  with it conflicts with that write, which already waits for it), and a read is compared with writes only."""
  hist: dict[int, tuple[list[tuple[int, ByteAccess]], list[tuple[int, ByteAccess]]]] = {}  # storage -> (reads, writes) still visible
  deps: list[set[int]] = []
  for i, accs in enumerate(accesses):
    d: set[int] = set()
    for a in accs:
      reads, writes = hist.get(a.storage, ([], []))
      for j, b in (writes + reads) if a.write else writes:
        if j != i and a.start < b.end and b.start < a.end: d.add(j)
    for a in accs:
      reads, writes = hist.setdefault(a.storage, ([], []))
      if a.write:
        for lst in (reads, writes): lst[:] = [(j, b) for j, b in lst if not (a.start <= b.start and b.end <= a.end)]
      (writes if a.write else reads).append((i, a))
    deps.append(d)
  return deps


@dataclass(frozen=True)
class Engine:
  """How an op meets the plan's asynchronous devices (queues: a CUDA device runs its kernels and device copies in launch order,
  after the host has moved on). The host runs everything else to completion before the next op."""
  issues: frozenset[str] = frozenset()  # queues on which it leaves work the host has not waited for (a CUDA kernel, a copy into CUDA)
  ordered: frozenset[str] = frozenset()  # queues whose earlier work it follows without a host wait (it runs on them, or copies through them)
  drains: frozenset[str] = frozenset()  # queues whose earlier work is done when it returns (a device->host copy returns with the data)
  raw: frozenset[str] = frozenset()  # queues whose memory it touches from the host (a host function): it waits for their pending work


HOST = Engine()


def queue_waits(order: Sequence[int], deps: Sequence[set[int]], explicit: Sequence[set[int]], accesses: Sequence[Sequence[ByteAccess]],
                queue_of: Mapping[int, str], engines: Sequence[Engine]) -> dict[int, list[str]]:
  """For ops run in `order`, the queues to synchronise before each (op index -> sorted queue names; absent: none).

  An op waits for queue Q when it depends on work still pending on Q and does not follow Q by itself: for a hazard, only
  where the two ops conflict on memory of Q (a device->host copy's host side is done when it returns, so a CPU kernel
  overwriting its destination waits for nothing); for an explicit dependency, all the work the other op left on any queue.
  A host function touching Q's memory waits for whatever is pending there, this run's or the previous run's (memory reuse
  can hand it memory an earlier op of Q used). `queue_of` maps a storage id to its queue (storages on asynchronous
  devices only). A wait, or a copy that drains Q, clears Q's pending work."""
  pending: dict[str, set[int]] = {q: {-1} for e in engines for q in e.issues | e.raw}  # -1: the previous run's work
  waits: dict[int, list[str]] = {}
  for i in order:
    e, need = engines[i], set()
    for j in deps[i]:
      ej = engines[j]
      if not ej.issues: continue
      if j in explicit[i]: qs = set(ej.issues)
      else: qs = {queue_of[a.storage] for a in accesses[j] for b in accesses[i] if a.storage in queue_of and conflict([a], [b])} & ej.issues
      need |= {q for q in qs if q not in e.ordered and j in pending[q]}
    need |= {q for q in e.raw if q not in e.ordered and pending[q]}
    if need: waits[i] = sorted(need)
    for q in need | e.drains: pending.setdefault(q, set()).clear()
    for q in e.issues: pending[q].add(i)
  return waits


def conflict(a: Sequence[ByteAccess], b: Sequence[ByteAccess]) -> bool:
  return any(x.storage == y.storage and (x.write or y.write) and x.start < y.end and y.start < x.end for x in a for y in b)


def levels(deps: Sequence[set[int]], names: Sequence[str]) -> list[list[int]]:
  """Ops grouped by dependency depth (level k waits only on levels < k), except that an op with no dependency at all runs
  in the level before its first reader: it reads only weights and inputs, so running it early lengthens no buffer's life
  but its own, and a model's weight-only kernels (a quantized matrix dequantised for a product of many rows) would all run
  first and all be live at once (a 135M-parameter decoder's plan held every layer's float32 matrix together). A cycle is a
  PlanError naming its ops."""
  n = len(deps)
  indeg = [len(d) for d in deps]
  users: list[list[int]] = [[] for _ in range(n)]
  for i, d in enumerate(deps):
    for j in d: users[j].append(i)
  lvl = [0] * n
  ready = [i for i in range(n) if indeg[i] == 0]
  done = 0
  while ready:
    nxt: list[int] = []
    for i in ready:
      done += 1
      for u in users[i]:
        lvl[u] = max(lvl[u], lvl[i] + 1)
        indeg[u] -= 1
        if indeg[u] == 0: nxt.append(u)
    ready = nxt
  if done != n: raise PlanError(f"dependency cycle: {' -> '.join(names[i] for i in find_cycle(deps, [i for i in range(n) if indeg[i] > 0]))}")
  for i in range(n):
    if not deps[i] and users[i]: lvl[i] = min(lvl[u] for u in users[i]) - 1  # users depend on other ops only: not moved
  out: list[list[int]] = [[] for _ in range(max(lvl, default=-1) + 1)]
  for i in range(n): out[lvl[i]].append(i)
  return out


def find_cycle(deps: Sequence[set[int]], candidates: Sequence[int]) -> list[int]:
  """One cycle among the candidates (ops left over by the topological sort), first op repeated at the end."""
  cand = set(candidates)
  color: dict[int, int] = {}
  for start in candidates:
    if start in color: continue
    stack: list[tuple[int, list[int]]] = [(start, sorted(d for d in deps[start] if d in cand))]
    path, color[start] = [start], 1
    while stack:
      node, todo = stack[-1]
      if not todo:
        stack.pop(); path.pop(); color[node] = 2
        continue
      nxt = todo.pop()
      if color.get(nxt) == 1:  # back edge: the cycle is path[nxt..]; deps point backwards in time, so reverse it
        cyc = path[path.index(nxt):]
        return [*reversed(cyc), cyc[-1]]
      if nxt not in color:
        color[nxt] = 1; path.append(nxt)
        stack.append((nxt, sorted(d for d in deps[nxt] if d in cand)))
  return list(candidates)


@dataclass(frozen=True)
class Lifetime:
  """An intermediate buffer that lives from level `first` to level `last` (inclusive) and needs `nbytes`."""
  key: int
  nbytes: int
  first: int
  last: int


def plan_reuse(lifetimes: Sequence[Lifetime], align: int = 64) -> tuple[dict[int, int], list[int]]:
  """Greedy best-fit: map each lifetime to a slot; two lifetimes share a slot only if one ends at a level strictly before
  the other begins (execution is level by level, so that is safe even with ops of one level running concurrently).
  Returns (key -> slot, slot sizes in bytes)."""
  slots: list[int] = []  # size
  free_after: list[int] = []  # last level the slot is busy
  assign: dict[int, int] = {}
  for lt in sorted(lifetimes, key=lambda x: (x.first, -x.nbytes)):
    need = (lt.nbytes + align - 1) // align * align
    free = [s for s in range(len(slots)) if free_after[s] < lt.first]
    fits = [s for s in free if slots[s] >= need]
    s = min(fits, key=lambda s: slots[s]) if fits else (max(free, key=lambda s: slots[s]) if free else -1)
    if s < 0:
      slots.append(need); free_after.append(lt.last)
      s = len(slots) - 1
    else:
      slots[s], free_after[s] = max(slots[s], need), lt.last
    assign[lt.key] = s
  return assign, slots
