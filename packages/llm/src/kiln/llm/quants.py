"""Weight formats as stored in a checkpoint, and their dequantisation to float32 with vectorised numpy.

A GGML block format packs each run of `block_size` values of a row (along the input dim, so a row is whole blocks) into
`type_size` bytes. The layouts, as ggml-quants.c defines them (d, dmin, m: float16; q: unsigned unless said):
  Q8_0  32 values, 34 bytes: d, 32 int8 q                      x = q * d
  Q4_0  32 values, 18 bytes: d, 16 bytes of nibbles            x = (q - 8) * d      (value j: low nibble of byte j, j+16: high)
  Q4_1  32 values, 20 bytes: d, m, 16 bytes of nibbles         x = q * d + m
  Q5_0  32 values, 22 bytes: d, 4 bytes of 5th bits, nibbles   x = (q - 16) * d
  Q5_1  32 values, 24 bytes: d, m, 5th bits, nibbles           x = q * d + m
  Q4_K  256 values, 144 bytes: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (sub-block 2c takes
        the low nibbles of bytes 32c..32c+31, 2c+1 the high ones)                      x = (d * sc) * q - dmin * m
  Q5_K  256 values, 176 bytes: as Q4_K plus 32 bytes whose bit j is sub-block j's 5th bit, before the nibbles
  Q6_K  256 values, 210 bytes: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), d
                                                                                        x = (d * sc) * (q - 32)
The arithmetic is float32 in the order above, so results equal gguf.quants.dequantize bit for bit (the tests check it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.llm.errors import CheckpointError


@dataclass(frozen=True)
class Format:
  """A stored weight format: `block_size` values in `type_size` bytes (1 and the item size for plain floats)."""
  name: str
  ggml_type: int | None  # the GGML type id (None: a safetensors-only dtype)
  block_size: int
  type_size: int


FORMATS: dict[str, Format] = {f.name: f for f in (
  Format("F32", 0, 1, 4), Format("F16", 1, 1, 2), Format("BF16", 30, 1, 2), Format("Q8_0", 8, 32, 34), Format("Q4_0", 2, 32, 18),
  Format("Q4_1", 3, 32, 20), Format("Q5_0", 6, 32, 22), Format("Q5_1", 7, 32, 24), Format("Q4_K", 12, 256, 144),
  Format("Q5_K", 13, 256, 176), Format("Q6_K", 14, 256, 210))}
BY_GGML_TYPE: dict[int, Format] = {f.ggml_type: f for f in FORMATS.values() if f.ggml_type is not None}


def ggml_type_name(t: int) -> str:
  """A GGML type id's name (from the gguf package's table), for messages about types kiln does not read."""
  try:
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(t).name
  except (ImportError, ValueError): return f"type {t}"


@dataclass(frozen=True)
class QuantTensor:
  """One weight as the file stores it: `data` is a read-only uint8 view of its bytes in the mapped file, (rows, row_bytes)
  in storage order (a 1-d weight is one row, or one row per value where row_perm applies), for kernels that compute on
  the blocks directly. `shape` is the weight's
  Hugging Face shape ((out, in) for a linear). Where the stored layout differs from HF's:
    row_perm    HF row i is stored row row_perm[i] (llama.cpp's converter interleaves a llama Q or K projection's rows for
                its rope layout; rows are whole blocks, so this is a row gather)
    transposed  stored as (in, out) (HF GPT-2's Conv1D weights in safetensors); HF shape is the transpose
    offset      HF value = stored value + offset (llama.cpp's converter stores gemma's norm weights as 1 + w)
  `dequantize()` applies them: it is Checkpoint.tensor()."""
  format: str
  shape: tuple[int, ...]
  data: np.ndarray
  row_perm: np.ndarray | None = None
  transposed: bool = False
  offset: float = 0.0

  @property
  def block_size(self) -> int: return FORMATS[self.format].block_size

  @property
  def type_size(self) -> int: return FORMATS[self.format].type_size

  def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
    """float32 in HF layout (a read-only view of the file where it is stored so: F32, nothing to undo). `rows` picks rows of
    the HF layout (an embedding lookup) without dequantising the others; not for a transposed weight."""
    data = self.data
    if rows is not None:
      if self.transposed: raise CheckpointError("rows() of a transposed (Conv1D) weight: take tensor() and index it")
      idx = np.asarray(rows, dtype=np.int64).reshape(-1)
      n = data.shape[0]
      if idx.size and (idx.min() < -n or idx.max() >= n): raise CheckpointError(f"row index out of range 0..{n - 1}")
      data = data[self.row_perm[idx] if self.row_perm is not None else idx]
    elif self.row_perm is not None: data = data[self.row_perm]
    out = dequantize(data, self.format)
    if self.offset: out = out + np.float32(self.offset)
    if rows is not None: return out.reshape(len(data), *self.shape[1:]) if len(self.shape) > 1 else out.reshape(-1)
    if self.transposed: return np.ascontiguousarray(out.reshape(self.shape[::-1]).T)
    return out.reshape(self.shape)


def _f16(b: np.ndarray) -> np.ndarray:
  """Two bytes per row of b (n, 2) as float32 (n, 1)."""
  return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """Bytes (n, k) -> uint8 (n, 2k): the k low nibbles, then the k high nibbles (ggml's order within a block)."""
  k = qs.shape[1]
  out = np.empty((len(qs), 2 * k), np.uint8)
  np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :k])
  np.right_shift(qs, np.uint8(4), out=out[:, k:])
  return out


def _fifth_bits(qh: np.ndarray, n: int) -> np.ndarray:
  """Bit j of each little-endian row of qh (n, 4) for j = 0..31, as uint8 (n, 32)."""
  return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :32].reshape(n, 32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The eight 6-bit scales and mins of K-quant blocks from their 12 packed bytes (n, 12): for j < 4 the low 6 bits of
  bytes j and j + 4; for j >= 4 a nibble of byte j + 4 with the top 2 bits of byte j - 4 (scale) or j (min) above it."""
  lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
  sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
  mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
  return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray: return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, 0:2])


def _q4_0(b: np.ndarray) -> np.ndarray:
  x = _nibbles(b[:, 2:]).astype(np.float32)
  x -= np.float32(8)
  x *= _f16(b[:, 0:2])
  return x


def _q4_1(b: np.ndarray) -> np.ndarray:
  x = _nibbles(b[:, 4:]).astype(np.float32)
  x *= _f16(b[:, 0:2])
  x += _f16(b[:, 2:4])
  return x


def _split_nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
  """Bytes (n, groups * 32) -> uint8 (n, groups, 2, 32): per group of 32 bytes, their low nibbles, then their high ones."""
  n = len(qs)
  out = np.empty((n, groups, 2, 32), np.uint8)
  g = qs.reshape(n, groups, 32)
  np.bitwise_and(g, np.uint8(0x0F), out=out[:, :, 0])
  np.right_shift(g, np.uint8(4), out=out[:, :, 1])
  return out


# The codes and block scales of each format, one home for their bit layouts: the oracle below dequantises with them, and
# qrepack.py repacks them into the planes the kernels read.

def q5_0_codes(b: np.ndarray) -> np.ndarray:
  """Q5_0 blocks (n, 22) -> their unsigned 5-bit codes, uint8 (n, 32) in value order."""
  return _nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6], len(b)) << np.uint8(4))


def q5_1_codes(b: np.ndarray) -> np.ndarray:
  """Q5_1 blocks (n, 24) -> their 5-bit codes, uint8 (n, 32) in value order."""
  return _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8], len(b)) << np.uint8(4))


def k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(d * sc, dmin * m) of Q4_K / Q5_K blocks, float32 (n, 8) each: each sub-block's scale and the min it subtracts."""
  sc, mn = _scale_min_k4(b[:, 4:16])
  return _f16(b[:, 0:2]) * sc, _f16(b[:, 2:4]) * mn


def q4_k_codes(b: np.ndarray) -> np.ndarray:
  """Q4_K blocks (n, 144) -> their 4-bit codes, uint8 (n, 8, 32): sub-block, value."""
  return _split_nibbles(b[:, 16:], 4).reshape(len(b), 8, 32)


def q5_k_codes(b: np.ndarray) -> np.ndarray:
  """Q5_K blocks (n, 176) -> their 5-bit codes, uint8 (n, 8, 32): sub-block, value."""
  q = _split_nibbles(b[:, 48:], 4).reshape(len(b), 8, 32)
  high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # (n, 8, 32): bit j for sub-block j
  q |= high << np.uint8(4)
  return q


def q6_k_codes(b: np.ndarray) -> np.ndarray:
  """Q6_K blocks (n, 210) -> their unsigned 6-bit codes, uint8 (n, 16, 16): sub-block of 16, value."""
  n = len(b)
  low = _split_nibbles(b[:, 0:128], 4).reshape(n, 2, 2, 2, 32).transpose(0, 1, 3, 2, 4).reshape(n, 2, 4, 32)  # (half, group 0..3, l)
  qh = b[:, 128:192].reshape(n, 2, 1, 32)
  high = (qh >> (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]) & np.uint8(3)
  return (low | (high << np.uint8(4))).reshape(n, 16, 16)


def q6_k_scales(b: np.ndarray) -> np.ndarray:
  """d * sc of Q6_K blocks, float32 (n, 16): each sub-block of 16's scale."""
  return _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)


def _q5_0(b: np.ndarray) -> np.ndarray:
  return (q5_0_codes(b).astype(np.int8) - np.int8(16)).astype(np.float32) * _f16(b[:, 0:2])


def _q5_1(b: np.ndarray) -> np.ndarray:
  return _f16(b[:, 0:2]) * q5_1_codes(b).astype(np.float32) + _f16(b[:, 2:4])


def _scale_k(b: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Q4_K's and Q5_K's (n, 8, 32) quants times each sub-block's scale, less its min (in place, float32), as (n, 256)."""
  d, m = k_scales(b)
  x *= d[:, :, None]
  x -= m[:, :, None]
  return x.reshape(len(b), 256)


def _q4_k(b: np.ndarray) -> np.ndarray: return _scale_k(b, q4_k_codes(b).astype(np.float32))


def _q5_k(b: np.ndarray) -> np.ndarray: return _scale_k(b, q5_k_codes(b).astype(np.float32))


def _q6_k(b: np.ndarray) -> np.ndarray:
  x = q6_k_codes(b).astype(np.float32)
  x -= np.float32(32)
  x *= q6_k_scales(b)[:, :, None]
  return x.reshape(len(b), 256)


CHUNK_BLOCKS = 1 << 13  # blocks decoded at a time: the temporaries of one chunk stay in cache
_BLOCK_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(data: np.ndarray, fmt: str) -> np.ndarray:
  """float32 values (rows, row_values) of raw rows (rows, row_bytes) uint8 in format `fmt`. F32 data comes back as a view."""
  f = FORMATS.get(fmt)
  if f is None: raise CheckpointError(f"weight format {fmt!r} cannot be dequantised (kiln reads {', '.join(FORMATS)})")
  raw = np.asarray(data, dtype=np.uint8)
  if raw.ndim != 2 or raw.shape[1] % f.type_size:
    raise CheckpointError(f"{fmt} rows of {raw.shape[-1]} bytes are not whole {f.type_size}-byte blocks")
  rows, nb = raw.shape[0], raw.shape[1] // f.type_size
  if fmt == "F32": return np.ascontiguousarray(raw).view(np.float32)
  if fmt == "F16": return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
  if fmt == "BF16": return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
  blocks = np.ascontiguousarray(raw).reshape(rows * nb, f.type_size)
  out = np.empty((rows * nb, f.block_size), np.float32)
  decode = _BLOCK_DEQUANT[fmt]
  for i in range(0, len(blocks), CHUNK_BLOCKS): out[i:i + CHUNK_BLOCKS] = decode(blocks[i:i + CHUNK_BLOCKS])
  return out.reshape(rows, nb * f.block_size)
