"""The plan cache: whole built plans on disk (KILN_CACHE_DIR/plans), so a process that builds a plan it built before (a
model loaded again) rebuilds it from its PlanSpec instead of lowering, scheduling and looking up each kernel again.

The caller names a plan by a key that says everything the plan depends on (kiln.graph.onnx: the model's bytes, its dims,
the device and target, the code's version, the settings that shape plans). An entry is two files named by the key's hash:
- `<hash>.json`, a sealed JSON entry (kiln.codegen.diskcache: HMAC-SHA256 under the cache key, so whoever can write the
  cache but not read the key cannot forge one): the key, the PlanSpec as an object whose kernel entries name their
  compiled text (object code sealed as planspec.export seals it, and AST) by its place in a list beside it, each text
  once however many places run it, the caller's metadata (JSON), and the weights file's size and the sha256 of each of
  its chunks;
- `<hash>.bin`, the weights, each starting on a 64-byte boundary: mapped read-only on a hit, so a weight no op writes
  is a view of the map (zero-copy) and its pages are read as the first run touches them.

A hit verifies the weights against the sealed hashes (in chunks, on threads: hashlib releases the GIL) before anything
uses them, and then seals the weights file's stat (device, inode, size, mtime, ctime) into the entry: a later hit whose
file has that stat skips the hashing, as git's index trusts an unchanged stat (any write to the file, or putting another
file in its place, changes its ctime, which no user process can set back; the cache directory is this user's alone). The
spec is validated and rebuilt as any PlanSpec is (a target key that differs compiles every kernel again). An entry that
is absent, another key's, altered, truncated or written by another kiln is a miss (one debug line): the caller builds the
plan and stores it again. Only a malformed KILN_CACHE_KEY raises. KILN_PLAN_CACHE=0 turns the plan cache off, KILN_CACHE=0
both disk caches; the least recently used plans go once the area holds more than KILN_PLAN_CACHE_BYTES.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from kiln.codegen import diskcache
from kiln.executor import debug, settings
from kiln.executor.cache import _stats, cache_dir
from kiln.executor.planspec import PlanSpec
from kiln.ir.errors import PlanSpecError

AREA = "plans"
FORMAT = 2  # 2: the spec as an object whose kernels' texts are listed once (texts)
ALIGN = 64  # bytes: a weight's start in the weights file (kernels assume aligned storage, the rebuild maps it zero-copy)
CHUNK = 16 << 20  # bytes of the weights file per sealed sha256: chunks verify side by side
MAX_SPEC_BYTES = 64 << 20  # the sealed JSON (object code and ASTs; no weights)
MAX_WEIGHT_BYTES = 16 << 30
HASH_THREADS = 4


@dataclass
class CachedPlan:
  """A plan cache hit: the spec, its weights (read-only views of the mapped weights file, by the spec's keys and the
  caller's extra array names) and the caller's metadata."""
  spec: PlanSpec
  weights: dict[str, np.ndarray]
  meta: dict[str, Any]


def stat_id(st: os.stat_result) -> list[int]:
  """What identifies a file's contents while unchanged (a write moves its ctime): device, inode, size, mtime, ctime."""
  return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def enabled() -> bool: return diskcache.enabled() and settings.PLAN_CACHE.get()


def _area() -> diskcache.DiskCache: return diskcache.DiskCache(AREA, "plan cache", cache_dir())


def entry_name(key: str) -> str: return hashlib.sha256(key.encode()).hexdigest()


def chunk_digests(data: memoryview | bytes | bytearray | mmap.mmap) -> list[str]:
  """The sha256 of each CHUNK of `data`, hashed side by side on threads."""
  view = memoryview(data)
  spans = [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)]
  if len(spans) <= 1: return [hashlib.sha256(s).hexdigest() for s in spans]
  with ThreadPoolExecutor(min(HASH_THREADS, len(spans))) as ex: return list(ex.map(lambda s: hashlib.sha256(s).hexdigest(), spans))


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, list[Any]], int]:
  """Where each array lies in the weights file: {name: [offset, nbytes, dtype, shape]}, and the file's size."""
  where: dict[str, list[Any]] = {}
  end = 0
  for name, a in arrays.items():
    end = -(-end // ALIGN) * ALIGN
    where[name] = [end, int(a.nbytes), a.dtype.str, list(a.shape)]
    end += int(a.nbytes)
  return where, end


def _shared_texts(spec: PlanSpec) -> tuple[dict[str, Any], list[str]]:
  """The spec as a JSON object whose kernel entries name their compiled text by its index in the list beside it: a
  model's repeated layers run one kernel at many places, and each place held the whole text (object code and AST)."""
  doc = spec.model_dump(mode="json")
  index: dict[str, int] = {}
  for op in doc["ops"]:
    if op.get("kind") == "kernel": op["compiled"] = index.setdefault(op["compiled"], len(index))
  return doc, list(index)


def _spec_of(doc: Any, texts: Any) -> PlanSpec:
  """_shared_texts undone, validated as any PlanSpec (a PlanSpecError names what is wrong)."""
  if not isinstance(doc, dict) or not isinstance(doc.get("ops"), list) or not isinstance(texts, list):
    raise diskcache.BadEntry("its spec is not a spec object with a list of texts")
  for op in doc["ops"]:
    if isinstance(op, dict) and op.get("kind") == "kernel":
      i = op.get("compiled")
      if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(texts):
        raise diskcache.BadEntry(f"a kernel names text {i!r} of {len(texts)}")
      op["compiled"] = texts[i]
  try: return PlanSpec.model_validate(doc)
  except ValidationError as e: raise PlanSpecError(f"invalid PlanSpec: {e}") from None


def store(key: str, spec: PlanSpec, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bool:
  """Keep a built plan under `key`: its spec, the arrays its weights name (export()'s, plus any the caller's metadata
  refers to by name) and JSON metadata. False when it was not written (no disk cache, no key, a full disk: one warning)."""
  if not enabled() or diskcache.cache_key() is None: return False
  where, size = _layout(arrays)
  blob = bytearray(max(size, 1))
  for name, a in arrays.items():
    off, n = where[name][0], where[name][1]
    blob[off:off + n] = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
  name = entry_name(key)
  area = _area()
  if not area.write_plain(name + ".bin", blob, durable=False): return False  # a hit hashes it before trusting it: no fsync
  doc, texts = _shared_texts(spec)
  entry = {"format": FORMAT, "key": key, "spec": doc, "texts": texts, "meta": dict(meta), "weights": where, "size": len(blob),
           "chunks": chunk_digests(blob)}
  if stored := area.store_json(name + ".json", entry):
    _stats["plan_stores"] += 1
    _evict(area, keep=name)
  return stored


def _evict(area: diskcache.DiskCache, keep: str) -> None:
  """Remove the least recently used entries (a hit touches its JSON) until the area holds at most KILN_PLAN_CACHE_BYTES;
  never `keep`, the entry just stored. Stray temporary files of a writer that died go too."""
  bound = settings.PLAN_CACHE_BYTES.get()
  entries: dict[str, list[float]] = {}
  try:
    with os.scandir(area.path) as it:
      for e in it:
        if not e.is_file(follow_symlinks=False): continue
        st = e.stat(follow_symlinks=False)
        stem, _, ext = e.name.rpartition(".")
        if e.name.startswith(".tmp-"):
          if time.time() - st.st_mtime > 3600: os.unlink(e.path)  # a write that never finished, an hour ago
          continue
        got = entries.setdefault(stem, [0.0, 0.0])
        got[1] += st.st_size
        if ext == "json": got[0] = st.st_mtime
  except OSError: return
  total = sum(size for _, size in entries.values())
  for stem, (_, size) in sorted(entries.items(), key=lambda kv: kv[1][0]):
    if total <= bound: break
    if stem == keep: continue
    for suffix in (".json", ".bin"):
      with contextlib.suppress(OSError): os.unlink(area.path / (stem + suffix))
    total -= size


def _seal_verified(area: diskcache.DiskCache, name: str, env: dict[str, Any], sid: list[int]) -> None:
  """Seal the weights file's stat into the entry once its bytes verified, after an fsync: it was written without one, and
  a crash must not leave torn bytes on disk under a stat the entry vouches for."""
  fd = os.open(area.path / (name + ".bin"), os.O_RDONLY | os.O_NOFOLLOW)
  try:
    if stat_id(os.fstat(fd)) != sid: return  # replaced since it was mapped
    os.fsync(fd)
  finally: os.close(fd)
  area.store_json(name + ".json", {**env, "verified": sid})


def load(key: str) -> CachedPlan | None:
  """The plan stored under `key`, verified, or None (a miss; see the module docstring)."""
  if not enabled(): return None
  name = entry_name(key)
  area = _area()
  try:
    env = area.load_json(name + ".json", MAX_SPEC_BYTES)
    if env is None: return None
    if env.get("format") != FORMAT or env.get("key") != key: raise diskcache.BadEntry("it holds another plan's key")
    mapped = area.map_plain(name + ".bin", MAX_WEIGHT_BYTES)
    if mapped is None: raise diskcache.BadEntry("its weights file is missing")
    buf, st = mapped
    if st.st_size != env["size"]: raise diskcache.BadEntry(f"its weights file holds {st.st_size} bytes, the entry says {env['size']}")
    if env.get("verified") != (sid := stat_id(st)):  # else: verified before, and not written to since (see the module docstring)
      if chunk_digests(buf) != env["chunks"]: raise diskcache.BadEntry("its weights file does not match the entry's sha256 (altered or torn)")
      with contextlib.suppress(OSError): _seal_verified(area, name, env, sid)
    raw = np.frombuffer(buf, np.uint8)
    weights: dict[str, np.ndarray] = {}
    for wname, (off, n, dt, shape) in env["weights"].items():
      if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and off + n <= raw.size and off % ALIGN == 0):
        raise diskcache.BadEntry(f"weight {wname!r} lies outside its weights file")
      a = raw[off:off + n].view(np.dtype(dt)).reshape(shape)
      weights[wname] = a
    spec = _spec_of(env["spec"], env["texts"])
    meta = env["meta"]
    if not isinstance(meta, dict): raise diskcache.BadEntry("its metadata is not an object")
  except diskcache.CacheKeyError: raise
  except Exception as e:  # BadEntry, or a verified entry that no longer validates (another kiln's format): build again
    _stats["disk_errors"] += 1
    if debug.DEBUG >= 1: debug.emit(f"kiln: plan cache entry {name} not used ({type(e).__name__}: {str(e)[:160]}); building the plan")
    return None
  _stats["plan_hits"] += 1
  with contextlib.suppress(OSError): os.utime(area.path / (name + ".json"))  # recently used: evicted last
  return CachedPlan(spec, weights, meta)


def remove(key: str) -> None:
  """Forget the entry of `key` (a hit whose plan then failed to build): the next load builds and stores it again."""
  area = _area()
  for suffix in (".json", ".bin"):
    with contextlib.suppress(OSError): os.unlink(area.path / (entry_name(key) + suffix))
