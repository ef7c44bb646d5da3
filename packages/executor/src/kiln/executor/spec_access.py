"""What each op of a PlanSpec reads and writes, by storage: the one definition that export (which storages are weights)
and the pipeline cuts (which storages cross a cut) both use."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.executor.buffer import buffer_dtype
from kiln.ir.errors import PlanSpecError

if TYPE_CHECKING:  # planspec's export reads accesses through this module: the entries are told apart by their `kind`
  from kiln.executor.planspec import BufferEntry, KernelEntry, OpEntry, StorageEntry

Slots = tuple[list[int], list[int], list[int]]  # a kernel's (globals, ins, outs)


@dataclass(frozen=True)
class StorageAccess:
  """One PlanSpec op using a storage (by id), whole or in part (the builder's hazards.ByteAccess is its byte range)."""
  storage: int
  write: bool
  whole: bool  # the access covers every byte of the storage


def places(buffers: Sequence[BufferEntry], ops: Sequence[OpEntry]) -> dict[int, tuple[int, int, int]]:
  """buffer -> (storage, byte offset, bytes), through view ops."""
  out = {i: (b.storage, b.offset, b.size * buffer_dtype(b.dtype).itemsize) for i, b in enumerate(buffers)}
  for op in ops:
    if op.kind == "view":
      st, off, _ = out[op.base]
      out[op.out] = (st, off + op.byte_offset, op.byte_size)
  return out


def compiled_doc(k: KernelEntry) -> dict:
  """A kernel's compiled JSON as a dict (validated fully only when it is rebuilt)."""
  try: doc = json.loads(k.compiled)
  except ValueError as e: raise PlanSpecError(f"kernel op {k.id}: its compiled kernel is not JSON: {e}") from None
  if not isinstance(doc, dict): raise PlanSpecError(f"kernel op {k.id}: its compiled kernel is not a JSON object")
  return doc


def slots_of(k: KernelEntry) -> Slots:
  doc = compiled_doc(k)
  try: return list(doc.get("globals", [])), list(doc.get("ins", [])), list(doc.get("outs", []))
  except TypeError as e: raise PlanSpecError(f"kernel op {k.id}: its compiled kernel's slots are not lists: {e}") from None


def accesses(storages: Sequence[StorageEntry], buffers: Sequence[BufferEntry], ops: Sequence[OpEntry],
             slots: Callable[[KernelEntry], Slots] = slots_of) -> list[list[StorageAccess]]:
  """Per op, its accesses in order: a kernel's reads (slots it reads, or does not write) before its writes; a copy's
  source, then its destination; a view none. `slots` gives a kernel's slots (default: read off its compiled JSON)."""
  where = places(buffers, ops)
  def acc(b: int, write: bool) -> StorageAccess:
    st, off, n = where[b]
    return StorageAccess(st, write, off == 0 and n == storages[st].nbytes)
  out: list[list[StorageAccess]] = []
  for op in ops:
    if op.kind == "kernel":
      globs, ins, outs = slots(op)
      if bad := [s for s in globs if not 0 <= s < len(op.buffers)]: raise PlanSpecError(f"kernel op {op.id} has slots {bad} beyond its buffers")
      out.append([*(acc(op.buffers[s], False) for s in globs if s in ins or s not in outs), *(acc(op.buffers[s], True) for s in outs if s in globs)])
    elif op.kind == "copy": out.append([acc(op.src, False), acc(op.dst, True)])
    else: out.append([])
  return out


def first_reads(accs: Iterable[list[StorageAccess]]) -> set[int]:
  """Storages whose first access in these ops is not a write of all of them: they need the contents they held before
  (a partial write keeps the rest of the old contents)."""
  seen: set[int] = set()
  read: set[int] = set()
  for op in accs:
    for a in op:
      if a.storage in seen: continue
      seen.add(a.storage)
      if not (a.write and a.whole): read.add(a.storage)
  return read
