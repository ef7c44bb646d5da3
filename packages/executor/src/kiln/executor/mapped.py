"""The file mappings a plan's host memory lies in, checked before each run.

A weight mapped from a file (an ONNX model's external data, a safetensors or .npy file, a DISK buffer) is read in place.
If the file is truncated while the plan holds the map, touching a lost page raises SIGBUS and kills the process, so before
each run the plan asks each map's own descriptor for the file's size (one fstat a file: `mmap.size()`) and raises a
MappedFileError when it is smaller than when the plan was built. Replacing the file (a rename over it) is harmless: the
map keeps the old inode. A truncation during a run can still fault; only a copy would rule that out.
"""
from __future__ import annotations

import mmap
from collections.abc import Iterable
from typing import Any

from kiln.executor.buffer import base_chain
from kiln.ir.errors import MappedFileError


def _mapping(obj: Any) -> mmap.mmap | None:
  """The mmap an array, memoryview or buffer object's memory belongs to."""
  return next((o for o in base_chain(obj) if isinstance(o, mmap.mmap)), None)


class MappedFiles:
  """Each distinct map under some memory, with its file's size when the plan was built."""

  def __init__(self, memories: Iterable[Any]):
    self._maps: dict[int, tuple[mmap.mmap, int]] = {}
    for mem in memories:
      m = _mapping(mem)
      if m is not None and id(m) not in self._maps:
        try: self._maps[id(m)] = (m, m.size())
        except (OSError, ValueError): continue  # a closed map, or one of anonymous memory: nothing on disk to shrink

  def __bool__(self) -> bool: return bool(self._maps)
  def __len__(self) -> int: return len(self._maps)

  def check(self) -> None:
    for m, size in self._maps.values():
      try: now = m.size()
      except (OSError, ValueError) as e: raise MappedFileError(f"a mapped weights file can no longer be read ({e}); rebuild the plan") from None
      if now < size:
        raise MappedFileError(f"a weights file this plan reads in place was truncated from {size} to {now} bytes after it was mapped: "
                              "reading it would crash the process; restore the file and load the model again")
