"""A GGUF file (v2 and v3, little-endian), mapped and parsed by kiln: the header is untrusted input, checked field by field
against kiln.llm.limits, and every failure is a CheckpointError naming the file and the field. Nothing is read whole: the
file is mapped read-only once, the header parsed from the map, each tensor a view of its pages.

Layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count; metadata (u64-length key, u32 value type,
value; arrays: u32 element type, u64 count, elements); tensor infos (name, u32 n_dims, u64 dims innermost first, u32 GGML
type, u64 offset from the data section); the data section at the next multiple of general.alignment (default 32).

gguf's own GGUFReader would also map the file, but fails on corrupt files with IndexError, ValueError or numpy errors
from deep inside and reads whole arrays of strings eagerly without limits; parsing here gives each failure its field.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir.files import open_regular
from kiln.llm import limits
from kiln.llm.errors import CheckpointError
from kiln.llm.quants import BY_GGML_TYPE, Format, ggml_type_name

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> (name, struct code or None, numpy dtype or None)
_SCALARS: dict[int, tuple[str, str, Any]] = {
  0: ("UINT8", "<B", np.uint8), 1: ("INT8", "<b", np.int8), 2: ("UINT16", "<H", np.uint16), 3: ("INT16", "<h", np.int16),
  4: ("UINT32", "<I", np.uint32), 5: ("INT32", "<i", np.int32), 6: ("FLOAT32", "<f", np.float32), 7: ("BOOL", "<B", np.uint8),
  10: ("UINT64", "<Q", np.uint64), 11: ("INT64", "<q", np.int64), 12: ("FLOAT64", "<d", np.float64)}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
  """One tensor of a GGUF file: its name, numpy shape (GGUF's dims reversed: (rows, row values) for a matrix), format and
  the absolute byte range of its data in the file."""
  name: str
  shape: tuple[int, ...]
  format: Format
  offset: int
  nbytes: int

  @property
  def rows(self) -> int: return math.prod(self.shape[:-1])

  @property
  def row_bytes(self) -> int: return self.shape[-1] // self.format.block_size * self.format.type_size


class _Cursor:
  """Reads the header from the map at a moving position; running past the file (or the header limit) names the field."""
  def __init__(self, mem: mmap.mmap, path: str):
    self.mem, self.path, self.pos = mem, path, 0
    self.end = min(len(mem), limits.MAX_GGUF_HEADER_BYTES)

  def fail(self, what: str, why: str) -> CheckpointError: return CheckpointError(f"{self.path}: {what}: {why}")

  def take(self, n: int, what: str) -> int:
    """The position of the next n bytes, advancing past them."""
    if n < 0 or self.pos + n > self.end:
      why = "the header is over MAX_GGUF_HEADER_BYTES" if self.pos + n <= len(self.mem) else f"the file ends at byte {len(self.mem)}"
      raise self.fail(what, f"{n} bytes at offset {self.pos} are past the end ({why}; truncated or corrupt)")
    p, self.pos = self.pos, self.pos + n
    return p

  def scalar(self, code: str, what: str) -> Any:
    return struct.unpack_from(code, self.mem, self.take(struct.calcsize(code), what))[0]

  def string(self, what: str, limit: int = limits.MAX_GGUF_STRING_BYTES) -> str:
    n = self.scalar("<Q", what)
    if n > limit: raise self.fail(what, f"a string of {n} bytes is over the {limit}-byte limit")
    p = self.take(n, what)
    try: return bytes(self.mem[p:p + n]).decode("utf-8")
    except UnicodeDecodeError as e: raise self.fail(what, f"a string that is not UTF-8 ({e.reason} at byte {e.start})") from None

  def strings(self, n: int, what: str) -> list[str]:
    """n strings in a row (a vocabulary: up to 10**5 and more): string()'s checks in one tight loop; any failure is
    reported by string() itself, re-reading the culprit."""
    mem, pos, end, limit = self.mem, self.pos, self.end, limits.MAX_GGUF_STRING_BYTES
    out: list[str] = []
    unpack, append = struct.Struct("<Q").unpack_from, out.append
    try:
      for _ in range(n):
        if pos + 8 > end: break
        (k,) = unpack(mem, pos)
        if k > limit or pos + 8 + k > end: break
        append(mem[pos + 8:pos + 8 + k].decode("utf-8"))
        pos += 8 + k
    except UnicodeDecodeError: pass
    if len(out) < n:  # the one that failed: string() names it and why
      self.pos = pos
      self.string(f"{what}[{len(out)}]")
      raise self.fail(what, f"string {len(out)} could not be read")  # string() raised; not reached
    self.pos = pos
    return out

  def value(self, vtype: int, what: str, depth: int = 0) -> Any:
    if vtype in _SCALARS:
      name, code, _ = _SCALARS[vtype]
      v = self.scalar(code, what)
      if name == "BOOL":
        if v > 1: raise self.fail(what, f"a BOOL holding {v}")
        return bool(v)
      return v
    if vtype == STRING: return self.string(what)
    if vtype == ARRAY: return self.array(what, depth + 1)
    raise self.fail(what, f"unknown value type {vtype}")

  def array(self, what: str, depth: int) -> Any:
    if depth > limits.MAX_GGUF_ARRAY_DEPTH: raise self.fail(what, f"arrays nested over MAX_GGUF_ARRAY_DEPTH = {limits.MAX_GGUF_ARRAY_DEPTH}")
    etype, n = self.scalar("<I", what), self.scalar("<Q", what)
    if n > limits.MAX_GGUF_ARRAY_ITEMS: raise self.fail(what, f"an array of {n} items is over MAX_GGUF_ARRAY_ITEMS = {limits.MAX_GGUF_ARRAY_ITEMS}")
    if etype in _SCALARS:  # numbers: one numpy view (copied out of the map: metadata is small)
      name, code, dt = _SCALARS[etype]
      size = struct.calcsize(code)
      a = np.frombuffer(self.mem, dtype=np.dtype(dt).newbyteorder("<"), count=n, offset=self.take(n * size, what)).astype(dt)
      if name == "BOOL":
        if n and int(a.max()) > 1: raise self.fail(what, "a BOOL array holding values other than 0 and 1")
        return a.astype(bool)
      return a
    if etype == STRING: return self.strings(n, what)
    if etype == ARRAY: return [self.array(f"{what}[{i}]", depth + 1) for i in range(n)]
    raise self.fail(what, f"unknown array element type {etype}")


class GGUFFile:
  """A parsed GGUF file: `metadata` ({key: int | float | bool | str | numpy array | list}), `tensors` ({name: TensorInfo},
  in file order), `version`, `alignment`, and `raw(name)`: a tensor's bytes as a read-only (rows, row_bytes) uint8 view of
  the map. Tensors of GGML types kiln does not read are refused when the file is opened, naming the type."""

  def __init__(self, path: str | os.PathLike[str]):
    self.path = p = os.path.abspath(os.fspath(path))
    fd = open_regular(p, "GGUF file", CheckpointError)
    try:
      size = os.fstat(fd).st_size
      if size < 24: raise CheckpointError(f"{p}: {size} bytes is too short for a GGUF file (a 24-byte header first)")
      try: self._mem = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
      except (OSError, ValueError) as e: raise CheckpointError(f"{p}: cannot map the file: {e}") from None
    finally: os.close(fd)
    self.metadata: dict[str, Any] = {}
    self.tensors: dict[str, TensorInfo] = {}
    self._parse()

  def _parse(self) -> None:
    c, p = _Cursor(self._mem, self.path), self.path
    magic = bytes(self._mem[:4])
    if magic != MAGIC: raise CheckpointError(f"{p}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    c.pos = 4
    self.version = c.scalar("<I", "version")
    if self.version not in (2, 3):
      hint = " (a big-endian file: kiln reads little-endian GGUF)" if self.version & 0xFFFF == 0 else ""
      raise CheckpointError(f"{p}: GGUF version {self.version} is not supported (kiln reads versions 2 and 3){hint}")
    n_tensors, n_kv = c.scalar("<Q", "tensor count"), c.scalar("<Q", "metadata count")
    if n_tensors > limits.MAX_GGUF_TENSORS:
      raise CheckpointError(f"{p}: tensor count {n_tensors} is over MAX_GGUF_TENSORS = {limits.MAX_GGUF_TENSORS}")
    if n_kv > limits.MAX_GGUF_KV: raise CheckpointError(f"{p}: metadata count {n_kv} is over MAX_GGUF_KV = {limits.MAX_GGUF_KV}")
    for i in range(n_kv):
      key = c.string(f"metadata key {i}", limits.MAX_GGUF_NAME_BYTES)
      if key in self.metadata: raise CheckpointError(f"{p}: metadata key {key!r} appears twice")
      self.metadata[key] = c.value(c.scalar("<I", f"metadata {key!r} type"), f"metadata {key!r}")
    infos = [self._info(c, i) for i in range(n_tensors)]
    align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= limits.MAX_GGUF_ALIGNMENT or align & (align - 1):
      raise CheckpointError(f"{p}: general.alignment {align!r} is not a power of two up to {limits.MAX_GGUF_ALIGNMENT}")
    self.alignment = align
    self.data_offset = -(-c.pos // align) * align
    self._place(infos)

  def _info(self, c: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string(f"tensor {i} name", limits.MAX_GGUF_NAME_BYTES)
    where = f"tensor {name!r}"
    nd = c.scalar("<I", f"{where} n_dims")
    if not 1 <= nd <= limits.MAX_GGUF_DIMS: raise c.fail(where, f"{nd} dims, outside 1..MAX_GGUF_DIMS = {limits.MAX_GGUF_DIMS}")
    ne = struct.unpack_from(f"<{nd}Q", c.mem, c.take(8 * nd, f"{where} dims"))
    if any(d == 0 for d in ne): raise c.fail(where, f"dims {list(ne)} hold a zero (an empty tensor)")
    gtype, offset = c.scalar("<I", f"{where} type"), c.scalar("<Q", f"{where} offset")
    return name, tuple(int(d) for d in reversed(ne)), gtype, offset

  def _place(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
    p, size = self.path, len(self._mem)
    for name, shape, gtype, off in infos:
      where = f"{p}: tensor {name!r}"
      if name in self.tensors: raise CheckpointError(f"{where} appears twice")
      fmt = BY_GGML_TYPE.get(gtype)
      if fmt is None: raise CheckpointError(f"{where} has GGML type {ggml_type_name(gtype)}, which kiln does not read "
                                            f"(it reads {', '.join(f.name for f in BY_GGML_TYPE.values())})")
      if shape[-1] % fmt.block_size: raise CheckpointError(f"{where}: rows of {shape[-1]} values are not whole {fmt.name} blocks of {fmt.block_size}")
      nbytes = math.prod(shape[:-1]) * (shape[-1] // fmt.block_size) * fmt.type_size  # Python ints: no wrap
      if off % self.alignment: raise CheckpointError(f"{where}: data offset {off} is not a multiple of the alignment {self.alignment}")
      start = self.data_offset + off
      if start + nbytes > size:
        raise CheckpointError(f"{where}: its {nbytes} data bytes at file offset {start} run past the end of the file ({size} bytes; truncated?)")
      self.tensors[name] = TensorInfo(name, shape, fmt, start, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
    for (_, end0, a), (begin1, _, b) in zip(spans, spans[1:]):
      if begin1 < end0: raise CheckpointError(f"{p}: tensors {a!r} and {b!r} overlap (file bytes {begin1}..{end0})")

  def release(self, name: str) -> None:
    """Drops the pages of tensor `name` from this process's resident memory, for a caller that keeps its own copy (a
    matrix repacked at load). The map is file-backed and read-only: a later read faults them in again from the page
    cache, so nothing is lost, and until then the file's bytes do not count twice in the process's memory."""
    t = self.tensors.get(name)
    if t is None or not t.nbytes or not hasattr(mmap, "MADV_DONTNEED"): return
    lo = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
    self._mem.madvise(mmap.MADV_DONTNEED, lo, t.offset + t.nbytes - lo)

  def raw(self, name: str) -> np.ndarray:
    """The stored bytes of tensor `name`: a read-only uint8 view of the map, (rows, row_bytes)."""
    t = self.tensors.get(name)
    if t is None: raise CheckpointError(f"{self.path}: no tensor named {name!r}")
    return np.frombuffer(self._mem, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t.rows, t.row_bytes)
