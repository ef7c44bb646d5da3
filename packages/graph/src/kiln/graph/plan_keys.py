"""What a plan cache key is made of, for every kind of kept plan (onnx_plan_cache.py: a loaded ONNX model; compile_cache.py:
a graph its caller names, such as a language model's plans): the code that built the plan, the settings that shape it,
and the content of the files it came from.

A file's content hash is remembered beside its stat (device, inode, size, mtime and ctime, in a sealed entry of the
`hashes` area), as git's index does: a file whose stat is unchanged is not read again; any write to it changes its ctime."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from kiln.codegen import diskcache
from kiln.executor import plan_cache
from kiln.executor.cache import _source_stamp, cache_dir
from kiln.executor.plan_cache import stat_id
from kiln.ir import settings as ir_settings
from kiln.ir.files import open_regular

HASH_AREA = "hashes"
# settings that never change a built plan (how it runs, where caches are, what is printed): left out of the key
NEUTRAL = {"KILN_THREADS", "KILN_DEBUG", "KILN_CACHE", "KILN_CACHE_DIR", "KILN_CACHE_KEY", "KILN_POOL", "KILN_SPIN_US",
           "KILN_COMPILE_THREADS", "KILN_CUDA_LRU_BYTES", "KILN_CUDA_DRIVER", "KILN_EMU_MODE", "KILN_EMU_STACK_KB", "KILN_PLAN_CACHE",
           "KILN_PLAN_CACHE_BYTES"}
_settings: list[Any] | None = None
_stamps: dict[str, str] = {}


def shaping_settings() -> str:
  """Every KILN_* setting but the NEUTRAL ones, with its value: KILN_WINOGRAD, KILN_TUNE, a new setting too."""
  global _settings
  if _settings is None: _settings = [s for group in ir_settings.installed().values() for s in group if s.name not in NEUTRAL and not s.secret]
  return ";".join(f"{s.name}={s.raw()}" for s in sorted(_settings, key=lambda s: s.name))


def stamp(module: str) -> str:
  """The source stamp of an installed package (kiln.executor.cache's: its .py files), once per process."""
  if (hit := _stamps.get(module)) is None:
    import importlib.util
    spec = importlib.util.find_spec(module)
    locs = list(spec.submodule_search_locations or []) if spec else []
    hit = _stamps[module] = _source_stamp(Path(locs[0])) if locs else "?"
  return hit


def digest(data: Any) -> str:
  """One sha256 over the chunk hashes (plan_cache.chunk_digests: side by side on threads)."""
  return hashlib.sha256("".join(plan_cache.chunk_digests(data)).encode()).hexdigest()


def _read_digest(f: Any) -> str:
  """digest() of an open file's bytes, read a chunk at a time into one buffer: a checkpoint of gigabytes is neither held
  in memory nor mapped (its mapped pages would count in the process's resident memory until unmapped)."""
  buf = bytearray(plan_cache.CHUNK)
  view = memoryview(buf)
  parts = []
  while True:
    n, got = 0, 1
    while n < len(buf) and (got := f.readinto(view[n:])): n += got
    if n: parts.append(hashlib.sha256(view[:n]).hexdigest())
    if n < len(buf): break
  return hashlib.sha256("".join(parts).encode()).hexdigest()


def file_digest(path: str, limit: int) -> tuple[str, list[int]] | None:
  """The file's content hash and the stat it was taken under, remembered beside the stat; None when the file cannot be
  read, is not a regular file or is larger than `limit` bytes (the loader then reports why)."""
  if "\0" in path: return None
  real = os.path.realpath(path)
  memo = diskcache.DiskCache(HASH_AREA, "model hash cache", cache_dir())
  name = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest() + ".json"
  try: st = os.stat(real)
  except OSError: return None
  if not stat.S_ISREG(st.st_mode) or st.st_size > limit: return None  # a FIFO must not hang us; the loader refuses both
  sid = stat_id(st)
  try:
    got = memo.load_json(name)
    if got is not None and got.get("path") == real and got.get("stat") == sid and isinstance(got.get("sha256"), str): return got["sha256"], sid
  except diskcache.CacheKeyError: raise
  except diskcache.BadEntry: pass
  try:
    fd = open_regular(real, "the model file", OSError)  # non-blocking, and refused unless a regular file
    with os.fdopen(fd, "rb", buffering=0) as f:
      before = stat_id(os.fstat(f.fileno()))
      h = _read_digest(f)
      after = stat_id(os.fstat(f.fileno()))
  except OSError: return None
  if before == after == sid:  # unchanged while read: the hash is the content's under this stat
    memo.store_json(name, {"path": real, "stat": sid, "sha256": h})
    return h, sid
  return None
