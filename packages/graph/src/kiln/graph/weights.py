"""Weights from files, mapped instead of read: `load_npy(path) -> Tensor` and `load_safetensors(path) -> {name: Tensor}`.

Both map the file read-only through the executor's DISK:/path device (kiln-runtime-cpu's disk.py does the mmap) and make
each weight a Tensor over the mapped pages: nothing is read until a kernel touches a page. A CPU plan compiled from such a
Tensor wraps the same pages as its buffer (`Buffer.from_numpy` takes a C-contiguous, element-aligned array as it is), so
the kernel reads the file's pages in place. Where a copy still happens:
- a tensor whose bytes are not aligned to its element size (a safetensors header whose length is not a multiple of 8,
  or a hand-made file) is copied into aligned memory when the plan is built: kiln's kernels load elements at their natural
  alignment. Files written by the reference safetensors writer, by `save_safetensors` and by numpy are aligned;
- a plan on another device (CUDA) copies the weight there: its kernels cannot read host pages;
- `Tensor.numpy()` on the weight itself returns a copy, as for any BUFFER tensor;
- BOOL data is checked to hold only 0 and 1 (the one dtype whose bytes can be invalid), which reads those pages once.

A weights file is untrusted input: header sizes, dtypes, shapes, offsets and overlaps are checked before anything is
mapped as a tensor; every failure is a `WeightsError` naming the file (and the tensor). The header is parsed from the
mapped bytes, so the checks and the tensors see the same file even if it changes on disk meanwhile (a file truncated
after mapping still faults on access: that is mmap's contract, not something a reader can check away).
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.graph.lazy import GraphError, Node, Source
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import DeviceError, KilnBufferError
from kiln.ir.files import open_regular, regular_size
from kiln.ir.npy import read_header

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference reader's limit on a safetensors header
MAX_NAME_BYTES = 1024  # longer tensor names are refused (real ones are well under 256)
MAX_DIMS = 32

# safetensors dtype names -> kiln dtypes (F8_* and the 4-bit types have no kiln dtype)
ST_DTYPES: dict[str, DType] = {
  "BOOL": dtypes.bool, "U8": dtypes.uint8, "I8": dtypes.int8, "U16": dtypes.uint16, "I16": dtypes.int16,
  "U32": dtypes.uint32, "I32": dtypes.int32, "U64": dtypes.uint64, "I64": dtypes.int64,
  "F16": dtypes.float16, "BF16": dtypes.bfloat16, "F32": dtypes.float32, "F64": dtypes.float64,
}
_ST_NAMES = {v.name: k for k, v in ST_DTYPES.items()}


class WeightsError(GraphError):
  """A weights file (.npy or safetensors) cannot be mapped: unreadable, malformed, truncated, or holding what kiln cannot
  compute on. The message names the file and, for safetensors, the tensor."""


def _weight(arr: np.ndarray, dtype: DType) -> Tensor:
  """A constant Tensor over arr as it is (a view of mapped pages: no ascontiguousarray, no astype)."""
  return Tensor(Node("BUFFER", (), Source(data=arr), tuple(int(d) for d in arr.shape), dtype))


def _map(path: str, nbytes: int, dtype: DType, offset: int) -> np.ndarray:
  """nbytes // itemsize elements at byte `offset` of the file as a read-only 1-d array: one DISK buffer, mapped now."""
  from kiln.executor import Buffer
  try: return Buffer(f"DISK:{path}", nbytes // dtype.itemsize, dtype, options={"offset": offset}).numpy()
  except (KilnBufferError, ValueError) as e: raise WeightsError(f"{path}: cannot map bytes {offset}..{offset + nbytes}: {e}") from None
  except DeviceError as e: raise WeightsError(f"{path}: the DISK device is not available ({e})") from None


def _abspath(path: Any) -> str:
  try: return os.path.abspath(os.fspath(path))
  except TypeError: raise WeightsError(f"a weights file's path must be a str or os.PathLike, got {type(path).__name__}") from None


def _check_bool(arr: np.ndarray, where: str) -> None:
  if arr.size and int(arr.view(np.uint8).max()) > 1: raise WeightsError(f"{where}: BOOL data holds bytes other than 0 and 1")


# ---- .npy ----
def _kiln_dtype(dt: np.dtype, where: str) -> DType:
  if dt.hasobject: raise WeightsError(f"{where}: dtype {dt} holds Python objects, which have no raw bytes to map")
  if not dt.isnative:
    raise WeightsError(f"{where}: dtype {dt.str} is not in this machine's byte order; save it with a.astype(a.dtype.newbyteorder('='))")
  try: return dtypes.from_numpy(dt)
  except Exception: raise WeightsError(f"{where}: dtype {dt} has no kiln dtype") from None


def npy_region(path: str | os.PathLike[str]) -> tuple[int, tuple[int, ...], DType]:
  """(data offset, shape, kiln dtype) of a C-order .npy file, from its header (kiln.ir.npy, as the DISK device reads it),
  with the checks disk.py's npy_region makes (kiln.graph cannot import the runtime) plus byte order, negative dims and the
  dtype kiln computes on."""
  p = _abspath(path)
  with os.fdopen(open_regular(p, ".npy file", WeightsError), "rb") as f:
    try: shape, fortran, dt = read_header(f)
    except (ValueError, OSError) as e: raise WeightsError(f"{p} is not a readable .npy file: {e}") from None
    offset, flen = f.tell(), os.fstat(f.fileno()).st_size
  kdt = _kiln_dtype(dt, p)
  if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or len(shape) > MAX_DIMS:
    raise WeightsError(f"{p}: shape {shape!r} is not a tuple of at most {MAX_DIMS} non-negative ints")
  if fortran and sum(d > 1 for d in shape) > 1:
    raise WeightsError(f"{p}: Fortran-order (column-major) arrays are not supported; save it with np.save(path, np.ascontiguousarray(a))")
  n = math.prod(shape)
  if n == 0: raise WeightsError(f"{p}: array of shape {shape} is empty; kiln tensors have at least one element")
  if offset + n * dt.itemsize > flen:
    raise WeightsError(f"{p} is truncated: header says {n * dt.itemsize} data bytes at offset {offset}, file length is {flen}")
  return offset, tuple(shape), kdt


def load_npy(path: str | os.PathLike[str]) -> Tensor:
  """The array in a .npy file as a constant Tensor over its mapped data region (a read-only DISK buffer, no read)."""
  offset, shape, dt = npy_region(path)
  p = _abspath(path)
  arr = _map(p, math.prod(shape) * dt.itemsize, dt, offset).reshape(shape)
  if dt == dtypes.bool: _check_bool(arr, p)
  return _weight(arr, dt)


# ---- safetensors ----
@dataclass(frozen=True)
class Entry:
  """One tensor of a safetensors header, checked: its kiln dtype, shape and byte range in the data section."""
  name: str
  dtype: DType
  shape: tuple[int, ...]
  begin: int
  end: int


def _no_constant(s: str) -> Any: raise ValueError(f"{s} is not JSON")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  d = dict(pairs)
  if len(d) != len(pairs): raise ValueError(f"duplicate key {next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))!r}")
  return d


def _entry(p: str, name: Any, info: Any, data_len: int) -> Entry:
  if not isinstance(name, str) or not name: raise WeightsError(f"{p}: a tensor name must be a non-empty string, got {name!r}")
  if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
    raise WeightsError(f"{p}: tensor name {name[:40]!r}... is over {MAX_NAME_BYTES} bytes")
  where = f"{p}: tensor {name!r}"
  if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
    got = sorted(info) if isinstance(info, dict) else type(info).__name__
    raise WeightsError(f"{where}: entry must have exactly dtype, shape and data_offsets, got {got}")
  dt = ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
  if dt is None: raise WeightsError(f"{where}: dtype {info['dtype']!r} is not supported (kiln has {', '.join(ST_DTYPES)})")
  shape, offs = info["shape"], info["data_offsets"]
  if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
    raise WeightsError(f"{where}: shape {shape!r} is not a list of at most {MAX_DIMS} non-negative ints")
  if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs):
    raise WeightsError(f"{where}: data_offsets {offs!r} is not a list of two ints")
  begin, end = offs
  if not 0 <= begin <= end <= data_len:
    raise WeightsError(f"{where}: data_offsets [{begin}, {end}] are outside the data section (0..{data_len} bytes)")
  if end - begin != math.prod(shape) * dt.itemsize:
    raise WeightsError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, shape {shape} of {info['dtype']} takes "
                       f"{math.prod(shape) * dt.itemsize}")
  return Entry(name, dt, tuple(shape), begin, end)


def parse_safetensors_header(p: str, head: bytes, data_len: int) -> tuple[dict[str, Entry], dict[str, str]]:
  """The checked tensor entries and the metadata of a safetensors JSON header (`head`), for a data section of data_len
  bytes: valid JSON, no duplicate keys, known dtypes, non-negative int shapes, offsets inside the data matching
  shape x itemsize, no two tensors sharing a byte."""
  try: d = json.loads(head.decode("utf-8"), object_pairs_hook=_unique_pairs, parse_constant=_no_constant)
  except (UnicodeDecodeError, ValueError, RecursionError) as e: raise WeightsError(f"{p}: the header is not valid JSON: {e}") from None
  if not isinstance(d, dict): raise WeightsError(f"{p}: the header must be a JSON object, got {type(d).__name__}")
  meta = d.pop("__metadata__", {})
  if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
    raise WeightsError(f"{p}: __metadata__ must map strings to strings")
  entries = {name: _entry(p, name, info, data_len) for name, info in d.items()}
  spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
  for (_, end0, a), (begin1, _, b) in zip(spans, spans[1:]):
    if begin1 < end0: raise WeightsError(f"{p}: tensors {a!r} and {b!r} overlap (bytes {begin1}..{end0} of the data section)")
  return entries, meta


def load_safetensors(path: str | os.PathLike[str], names: Iterable[str] | None = None) -> dict[str, Tensor]:
  """The tensors of a safetensors file (all, or those in `names`) as constant Tensors over one read-only map of the file.

  Layout: an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
  "__metadata__": {str: str}}, then the data section; offsets count from its start. BF16 tensors hold their uint16 bit
  patterns (`Tensor.numpy()` of one gives the bits; `.cast("float32")` computes on them)."""
  p = _abspath(path)
  flen = regular_size(p, "safetensors file", WeightsError)
  if flen < 8: raise WeightsError(f"{p}: {flen} bytes is too short for a safetensors file (an 8-byte header length first)")
  mem = _map(p, flen, dtypes.uint8, 0)  # the whole file, once; each tensor is a view of it
  (hlen,) = struct.unpack("<Q", mem[:8].tobytes())
  if hlen > MAX_HEADER_BYTES: raise WeightsError(f"{p}: header length {hlen} is over the {MAX_HEADER_BYTES} byte limit")
  if 8 + hlen > mem.size: raise WeightsError(f"{p} is truncated: header length {hlen}, file length {mem.size}")
  entries, _ = parse_safetensors_header(p, mem[8:8 + hlen].tobytes(), mem.size - 8 - hlen)
  want = list(entries) if names is None else list(names)
  out: dict[str, Tensor] = {}
  for name in want:
    ent = entries.get(name)
    if ent is None: raise WeightsError(f"{p}: no tensor named {name!r} (the file has {len(entries)})")
    if ent.end == ent.begin: raise WeightsError(f"{p}: tensor {name!r} of shape {list(ent.shape)} is empty; kiln tensors have at least one element")
    base = 8 + hlen
    arr = mem[base + ent.begin:base + ent.end].view(ent.dtype.np).reshape(ent.shape)
    if ent.dtype == dtypes.bool: _check_bool(arr, f"{p}: tensor {name!r}")
    out[name] = _weight(arr, ent.dtype)
  return out


def safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
  """The __metadata__ of a safetensors file (its header checked as load_safetensors checks it)."""
  p = _abspath(path)
  try:
    with os.fdopen(open_regular(p, "safetensors file", WeightsError), "rb") as f:
      raw = f.read(8)
      hlen = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
      if not 0 <= hlen <= MAX_HEADER_BYTES: raise WeightsError(f"{p}: no safetensors header length, or one over {MAX_HEADER_BYTES} bytes")
      head, flen = f.read(hlen), os.fstat(f.fileno()).st_size
  except OSError as e: raise WeightsError(f"cannot open safetensors file {p}: {e.strerror}") from None
  if len(head) != hlen: raise WeightsError(f"{p} is truncated: header length {hlen}, file length {flen}")
  return parse_safetensors_header(p, head, flen - 8 - hlen)[1]


def save_safetensors(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray | tuple[np.ndarray, str]],
                     metadata: Mapping[str, str] | None = None) -> None:
  """Write numpy arrays as a safetensors file laid out as the reference writer lays it out: the header padded with spaces
  to a multiple of 8 bytes, tensors by descending element size then name, so each starts aligned to its element size.
  A value may be `(array, "BF16")`: uint16 bit patterns stored as bfloat16."""
  items: list[tuple[str, np.ndarray, str]] = []
  for name, v in arrays.items():
    a, st = (np.asarray(v[0]), v[1]) if isinstance(v, tuple) else (np.asarray(v), None)
    if st is None and a.dtype.isnative and not a.dtype.hasobject:
      st = next((k for k, d in ST_DTYPES.items() if d != dtypes.bfloat16 and d.np == a.dtype), None)
    if st not in ST_DTYPES or ST_DTYPES[st].itemsize != a.dtype.itemsize or not a.dtype.isnative:
      raise WeightsError(f"{path}: tensor {name!r}: cannot store a {a.dtype} array as safetensors {st or ''}".rstrip())
    items.append((name, a, st))
  items.sort(key=lambda t: (-t[1].dtype.itemsize, t[0]))
  header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
  pos = 0
  for name, a, st in items:
    header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
    pos += a.nbytes
  head = json.dumps(header, separators=(",", ":")).encode("utf-8")
  head += b" " * (-len(head) % 8)
  try:
    with open(_abspath(path), "wb") as f:
      f.write(struct.pack("<Q", len(head)) + head)
      for _, a, _ in items: f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
  except (OSError, ValueError) as e: raise WeightsError(f"cannot write safetensors file {path}: {e}") from None


# ---- where a file's pages are (Linux) ----
@dataclass(frozen=True)
class FileMap:
  """One map of a file in this process: its address range and how many of its bytes are resident (faulted in)."""
  start: int
  end: int
  rss: int


def file_maps(path: str | os.PathLike[str]) -> list[FileMap] | None:
  """This process's maps of `path`, from /proc/self/smaps (None where there is none: not Linux). A mapped weight that no
  kernel has touched adds its map's size here but (nearly) nothing to rss; a copy would show elsewhere (anonymous memory)."""
  want = os.path.realpath(os.fspath(path))
  try:
    with open("/proc/self/smaps") as f: lines = f.read().splitlines()
  except OSError: return None
  out: list[FileMap] = []
  span: tuple[int, int] | None = None
  for line in lines:
    head = line.split(maxsplit=5)
    if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a map's first line: range perms offset dev inode [path]
      named = len(head) == 6 and head[5].removesuffix(" (deleted)") == want
      lo, hi = (int(x, 16) for x in head[0].split("-"))
      span = (lo, hi) if named else None
    elif span is not None and line.startswith("Rss:"):
      out.append(FileMap(span[0], span[1], int(line.split()[1]) * 1024))
      span = None
  return out
