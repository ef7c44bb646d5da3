"""Linear weights kept in their stored format: the blocks' codes and scales repacked once at load into planes no bigger
than the file's bytes, and dequantised by graph ops inside the kernels that read them (no float32 copy of the model).

Layout: the outputs in tiles of LANES (T = out / LANES tiles; one tile of all outputs where LANES does not divide out),
each tile input-major: codes (T, in, LANES) and block scales (T, in / 32, LANES). kiln's matrix-vector kernel gives its
vector lanes to consecutive outputs (each lane one output's running sum), so it loads one input position's codes for a
tile at once, and the next input's codes are the next bytes: each tile is one sequential stream. In the file's
(out, in) order the lanes would gather codes a row apart; in a plain (in, out) order each step would jump a whole row
of outputs (a 49152-output head: 32 steps of 49 KB apart per block, 18x slower). LANES is 32: a whole number of vectors
of float32 lanes on every x86 and Arm vector width kiln targets, and 32 int8 codes are one AVX2 register.

A product of one row (a decode step) runs block by block (_one_row): each block's dot product on the codes, then times
its scale, so every code is converted and multiplied once. Where int8 products pay (int8_products: the 4-bit formats on
a CPU with a byte dot product or AVX2; KILN_LLM_INT8) a block format keeps its codes as int32 *words* instead, in tiles of
WORD_LANES outputs: (T, in / 4, 16) for the byte formats, (T, in / 8, 16) for the 4-bit ones, each word four codes of
consecutive inputs for one output (unsigned: a byte format's codes plus 128; a 4-bit word holds inputs j..j+3 of its
block in its low nibbles, j+16..j+19 in its high ones). The row is then quantized to int8 per block as llama.cpp's q8_0
does (a scale of its largest magnitude / 127, rounded half away from zero, its codes' sum), and each block's dot product
is Ops.DOT4 on the words: one vpdpbusd for 64 products. A product of many rows (a prefill chunk) reads
matrix(realized=True): the dequantised tiles are computed once per run into a scratch buffer of the plan, and kiln's
register-tiled kernel reads them as an (in, out) float32 matrix.

Formats (quants.py has the byte layouts and the numpy oracle):
  Q8_0   codes int8, d float16                                                   34 bytes per 32 values, as the file
  Q4_0   nibbles uint8 (T, in / 2, LANES): byte j of a block holds value j (low) and j + 16 (high), d float16   18 bytes
  Q4_1   nibbles as Q4_0, d and m float16                                                                      20 bytes
  F16    float16;  BF16  bfloat16                                                                               2 bytes a value
  Q4_K, Q5_0, Q5_1, Q5_K, Q6_K   repacked at load (qrepack.py): Q4_K as Q4_1's nibbles with float32 scales and mins, the
         others as int8 codes beside a scale (and a min) per block of 32 (Q6_K: 16)
Other formats (Q2_K, Q3_K: refused by the checkpoint reader) are not packed: pack() returns None.
Weights come in Hugging Face layout: a llama.cpp row permutation (QuantTensor.row_perm) is applied to the outputs, and a
weight stored transposed (GPT-2's Conv1D in safetensors) is already (in, out).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.graph import Node, Tensor
from kiln.graph.build_target import cpu_layouts
from kiln.graph.lazy import Source
from kiln.ir.dtype import dtypes
from kiln.ir.ops import Ops
from kiln.llm.qrepack import REPACK, repack
from kiln.llm.quants import QuantTensor
from kiln.llm.settings import INT8

LANES = 32
BYTE_SHIFTS = np.arange(0, 32, 8, dtype=np.int32)  # byte k of an int32 word sits at bit 8k (little-endian, as DOT4 reads it)
WORD_LANES = 16  # outputs a tile of words holds: a row of 16 words is one cache line (one AVX-512 register, two AVX2 ones)
BYTES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")  # int8 codes, a scale (and a min) per block
NIBBLES = ("Q4_0", "Q4_1", "Q4_K")  # two 4-bit codes a byte, per block of 32 a scale (Q4_0: less 8) or a scale and a min
BLOCK_FORMATS = (*BYTES, *NIBBLES)
PACKED = (*BLOCK_FORMATS, "F16", "BF16")


def _narrowed(a: np.ndarray) -> np.ndarray:
  """Tiles (T, k, LANES) as (T * LANES / WORD_LANES, k, WORD_LANES): a word row of a tile is then one 64-byte line."""
  t, k, lanes = a.shape
  if lanes != LANES: return a
  return np.ascontiguousarray(a.reshape(t, k, LANES // WORD_LANES, WORD_LANES).transpose(0, 2, 1, 3)).reshape(-1, k, WORD_LANES)


def _tiles(a: np.ndarray) -> np.ndarray:
  """(k, out) -> (T, k, L) contiguous, L = LANES where it divides out, else out (one tile)."""
  k, out = a.shape
  lanes = LANES if out % LANES == 0 else out
  return np.ascontiguousarray(a.reshape(k, out // lanes, lanes).transpose(1, 0, 2))


@dataclass(frozen=True)
class QuantWeight:
  """A linear weight of HF shape (out, in) as planes (see the module's docstring): `codes` (T, in, L) or, for the 4-bit
  formats, (T, in / 2, L); `scales` ((T, in / block, L) float16 or float32: the scale, then the min where there is one)."""
  format: str
  shape: tuple[int, int]
  codes: np.ndarray
  scales: tuple[np.ndarray, ...] = ()
  block: int = 32
  words: bool = False  # codes as int32 words of four unsigned codes (the module's docstring), for int8 products

  @staticmethod
  def of(fmt: str, shape: tuple[int, int], codes: np.ndarray, scales: tuple[np.ndarray, ...] = (), block: int = 32) -> QuantWeight:
    """From planes in (in, out) order (codes (in or in / 2, out), scales (in / block, out)): tiled."""
    return QuantWeight(fmt, shape, _tiles(codes), tuple(_tiles(s) for s in scales), block)

  @property
  def nbytes(self) -> int: return self.codes.nbytes + sum(s.nbytes for s in self.scales)

  @staticmethod
  def stack(parts: list[QuantWeight]) -> QuantWeight | None:
    """The weights `parts` (each (out_i, in)) as one (sum out_i, in): their tiles one after the other, so one product
    computes all their outputs (a decode step's q, k and v in one kernel, not three that each start their own stream).
    None where the parts differ in format, block, inputs or plane dtypes, or one's outputs are not whole tiles."""
    a = parts[0]
    if any(p.format != a.format or p.block != a.block or p.shape[1] != a.shape[1] or p.codes.dtype != a.codes.dtype or p.words != a.words
           or p.shape[0] % LANES or [s.dtype for s in p.scales] != [s.dtype for s in a.scales] for p in parts): return None
    return QuantWeight(a.format, (sum(p.shape[0] for p in parts), a.shape[1]), np.concatenate([p.codes for p in parts], 0),
                       tuple(np.concatenate([p.scales[i] for p in parts], 0) for i in range(len(a.scales))), a.block, a.words)

  def as_words(self) -> QuantWeight:
    """The same weight with its codes as int32 words (the module's docstring)."""
    t, _, lanes = self.codes.shape
    nb = self.shape[1] // self.block
    if self.format in NIBBLES: q = self.codes.reshape(t, nb, 4, 4, lanes)  # byte j = 4g + k of a block: inputs j and j + 16
    else: q = (self.codes.view(np.uint8) ^ np.uint8(0x80)).reshape(t, nb, self.block // 4, 4, lanes)  # int8 c -> c + 128
    w = np.ascontiguousarray(q.transpose(0, 1, 2, 4, 3)).view("<i4").reshape(t, -1, lanes)
    return QuantWeight(self.format, self.shape, _narrowed(w), tuple(_narrowed(s) for s in self.scales), self.block, True)

  @property
  def offset(self) -> int:
    """What the unsigned codes of a word exceed the format's codes by (Q4_0's 8, a byte format's 128)."""
    return 8 if self.format == "Q4_0" else 0 if self.format in NIBBLES else 128

  def _codes(self) -> Tensor:
    if self.format == "BF16": return Tensor(Node("BUFFER", (), Source(data=self.codes), self.codes.shape, dtypes.bfloat16))
    return Tensor(self.codes)

  def _scale(self, i: int) -> Tensor: return Tensor(self.scales[i]).cast(dtypes.float32)

  def _tiled_matrix(self) -> Tensor:
    """The dequantised weight (T, in, L) float32."""
    t, _, lanes = self.codes.shape
    inn, f = self.shape[1], self.format
    if f in ("F16", "BF16"): return self._codes().cast(dtypes.float32)
    nb = inn // self.block
    d = self._scale(0).reshape(t, nb, 1, lanes)
    if self.words: return self._word_matrix(d)
    c = self._codes()
    if f in BYTES:
      q = c.reshape(t, nb, self.block, lanes).cast(dtypes.float32) * d
      return (q if len(self.scales) == 1 else q + self._scale(1).reshape(t, nb, 1, lanes)).reshape(t, inn, lanes)
    c = c.reshape(t, nb, 16, lanes)
    lo, hi = (c & 0x0F).cast(dtypes.float32), (c & 0xF0).cast(dtypes.float32) * (1.0 / 16)  # the high nibble, exactly
    if f == "Q4_0": q = Tensor.cat([(lo - 8.0) * d, (hi - 8.0) * d], 2)
    else:
      m = self._scale(1).reshape(t, nb, 1, lanes)
      q = Tensor.cat([lo * d + m, hi * d + m], 2)
    return q.reshape(t, inn, lanes)

  def _word_matrix(self, d: Tensor) -> Tensor:
    """_tiled_matrix of a weight kept as words: each word's codes taken apart with shifts and masks."""
    t, _, lanes = self.codes.shape
    nb, bl = self.shape[1] // self.block, self.block
    w = Tensor(self.codes)
    if self.format in NIBBLES:
      w = w.reshape(t, nb, 1, 4, 1, lanes)
      nib = Tensor(np.array([0, 4], np.int32)).reshape(1, 1, 2, 1, 1, 1)  # low nibbles: inputs 4g + k; high: 16 + 4g + k
      byte = Tensor(BYTE_SHIFTS).reshape(1, 1, 1, 1, 4, 1)
      u = w._alu(Ops.SHR, nib + byte) & 0x0F  # (T, nb, 2, 4, 4, L)
    else:
      w = w.reshape(t, nb, bl // 4, 1, lanes)
      u = w._alu(Ops.SHR, Tensor(BYTE_SHIFTS).reshape(1, 1, 1, 4, 1)) & 0xFF  # (T, nb, bl / 4, 4, L)
    q = (u - self.offset).cast(dtypes.float32).reshape(t, nb, bl, lanes) * d
    if len(self.scales) > 1: q = q + self._scale(1).reshape(t, nb, 1, lanes)
    return q.reshape(t, self.shape[1], lanes)

  def matrix(self, realized: bool = False) -> Tensor:
    """The dequantised weight as a graph expression, (in, out) float32: a kernel that reads it reads the planes.
    realized: its tiles computed into a buffer of their own first (a product of many rows; see linear)."""
    out, inn = self.shape
    m = self._tiled_matrix()
    return (m.contiguous() if realized else m).permute(1, 0, 2).reshape(inn, out)

  def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ W.T (+ bias) for x (..., in), as Tensor.linear with the HF (out, in) weight. Many rows read the matrix
    realized: the scheduler realizes a block format's dequantised tiles by itself, but leaves an F16 or BF16 cast inline
    in the product, where the code generator takes it for no matrix product (no register tile, no packed panel) and
    converts each weight again for every few rows."""
    rows = 1
    for n in x.shape[:-1]: rows *= n if isinstance(n, int) else 2
    y = self._one_row(x) if rows == 1 else x @ self.matrix(realized=True)
    return y if bias is None else y + bias

  def _one_row(self, x: Tensor) -> Tensor:
    """x @ W.T for one row of x, tile by tile. A block format runs block by block: each block's dot product on the codes,
    then times its scale (Q4_0: less 8 x the block's sum of x; Q4_1: plus m x it), so each code is converted and
    multiplied once, not dequantised first; two to four small kernels (the per-block sums (T, in / 32, L), their scaled
    sum)."""
    (out, inn), lead = self.shape, x.shape[:-1]
    t, _, lanes = self.codes.shape
    if self.words: return self._one_row_int8(x).reshape(*lead, out)
    if not self.scales and inn % 32: return (x.reshape(1, inn, 1) * self._tiled_matrix()).sum(1).reshape(*lead, out)
    bl = self.block
    nb = inn // bl
    xb = x.reshape(1, nb, bl, 1)
    c = self._codes()
    if not self.scales: y = (xb * c.reshape(t, nb, bl, lanes).cast(dtypes.float32)).sum(2).sum(1)  # F16, BF16: in blocks of 32 too
    elif self.format in BYTES:
      part = (xb * c.reshape(t, nb, bl, lanes).cast(dtypes.float32)).sum(2) * self._scale(0)
      y = (part if len(self.scales) == 1 else part + xb.sum(2) * self._scale(1)).sum(1)  # a min: plus m x the block's sum of x
    else:
      c = c.reshape(t, nb, 16, lanes)
      lo, hi = (c & 0x0F).cast(dtypes.float32), (c & 0xF0).cast(dtypes.float32)
      part = (xb[:, :, :16] * lo + (xb[:, :, 16:] * (1.0 / 16)) * hi).sum(2)  # (T, nb, L): the codes' dot products
      xs = xb.sum(2)  # (1, nb, 1)
      if self.format == "Q4_0": y = ((part - xs * 8.0) * self._scale(0)).sum(1)
      else: y = (part * self._scale(0) + xs * self._scale(1)).sum(1)
    return y.reshape(*lead, out)

  def _one_row_int8(self, x: Tensor) -> Tensor:
    """x @ W.T for one row x, (T, L), on the words: per block, the DOT4 sums of its words with the row's int8 codes, less
    the offset x the block's sum of codes, times both scales (plus the min x the scaled sum, where there is one): the
    blocks' scaled sums (T, nb, L) in one kernel, their sum in a second. Not for a prefill chunk's rows: with a row axis
    the scheduler realizes the per-block int32 sums, (rows, T, nb, L), and that ran 1.4x slower than the float product of
    the dequantised matrix (a kernel keeping a tile of rows' block sums in registers is the way: not built)."""
    t, _, lanes = self.codes.shape
    nb, bl = self.shape[1] // self.block, self.block
    xw, dx, sx = quantized_row(x.reshape(nb, bl))
    c = Tensor(self.codes).reshape(t, nb, -1, lanes)
    zero = Tensor.full((), 0, dtypes.int32)
    if self.format in NIBBLES:
      lo, hi = c & 0x0F0F0F0F, c._alu(Ops.SHR, Tensor.full((), 4, dtypes.int32)) & 0x0F0F0F0F
      xlo, xhi = xw[:, :4].reshape(1, nb, 4, 1), xw[:, 4:].reshape(1, nb, 4, 1)
      isum = lo._alu(Ops.DOT4, xlo, hi._alu(Ops.DOT4, xhi, zero)).sum(2)  # (T, nb, L): two vpdpbusd a word
    else: isum = c._alu(Ops.DOT4, xw.reshape(1, nb, bl // 4, 1), zero).sum(2)
    sxb, dxb = sx.reshape(1, nb, 1), dx.reshape(1, nb, 1)
    q = isum - sxb * self.offset if self.offset else isum
    part = q.cast(dtypes.float32) * (self._scale(0) * dxb)
    if len(self.scales) > 1: part = part + self._scale(1) * (dxb * sxb.cast(dtypes.float32))
    return part.sum(1)

  def embedding(self, ids: Tensor) -> Tensor:
    """Rows `ids` of the HF (out, in) weight (an embedding table's lookup), (len(ids), in) float32: only those columns of
    the planes are read."""
    return self.matrix().gather(ids, 1).T


def quantized_row(xb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
  """A row in blocks (nb, bl) float32 as llama.cpp's q8_0 quantizes it: int8 codes round(x * 127 / max|x|) (half away from
  zero; 0 for a block of zeros), as int32 words of four (nb, bl / 4); the blocks' scales max|x| / 127 (nb,) float32; and
  the sums of their codes (nb,) int32, read from the words (a DOT4 of each with four unsigned ones sums its signed bytes)
  rather than quantizing the row a third time."""
  nb, bl = xb.shape
  amax = xb.abs().max(1)
  inv = (amax > 0.0).where(127.0 / amax.maximum(1e-30), 0.0)
  v = xb * inv.reshape(nb, 1)
  q = (v + (v < 0.0).where(-0.5, 0.5)).cast(dtypes.int32)
  words = (q & 0xFF).reshape(nb, bl // 4, 4)._alu(Ops.SHL, Tensor(BYTE_SHIFTS).reshape(1, 1, 4)).sum(2)  # disjoint bytes: the sum is their OR
  ones = Tensor.full((), 0x01010101, dtypes.int32)
  return words, amax * (1.0 / 127.0), ones._alu(Ops.DOT4, words, Tensor.full((), 0, dtypes.int32)).sum(1)


def int8_products(fmt: str) -> bool:
  """Whether a weight of block format `fmt` packed now takes int8 products (KILN_LLM_INT8). auto: a 4-bit format, in a CPU
  graph, on a CPU with a byte dot product (VNNI) or with 32-byte integer vectors and FMA (AVX2), where the widened
  products (pmaddwd) still beat converting every code to float; not on SSE, AVX without AVX2 or NEON, where that is
  unmeasured. A byte format's float product converts one code in one instruction and streams its tiles faster than the
  int8 one did (Q8_0 decode 10-12% slower in int8): KILN_LLM_INT8=1 takes it anyway. A CUDA graph keeps the float products."""
  if (mode := INT8.get()) == "0" or not cpu_layouts() or fmt not in BLOCK_FORMATS: return False
  if mode == "1": return True
  from kiln.codegen.registry import target_of
  return fmt in NIBBLES and (t := target_of("CPU")) is not None and (t.dot_bytes > 0 or (t.vector_bytes >= 32 and t.fma))


def _f16(b: np.ndarray) -> np.ndarray:
  """(out, nb, 2) bytes -> float16 (nb, out)."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0].T


def pack(qt: QuantTensor) -> QuantWeight | None:
  """The planes of a 2-d weight in a packed format (None for any other: the caller dequantises it); a block format's codes
  as words where int8 products are taken (int8_products)."""
  w = _planes(qt)
  return w.as_words() if w is not None and int8_products(w.format) else w


def _planes(qt: QuantTensor) -> QuantWeight | None:
  if qt.format not in PACKED or len(qt.shape) != 2 or qt.offset: return None
  out, inn = qt.shape
  data = qt.data
  if qt.format in ("F16", "BF16"):
    a = np.ascontiguousarray(data).view(np.float16 if qt.format == "F16" else np.uint16)
    if qt.transposed: a = a.reshape(inn, out)  # stored (in, out) already
    else:
      if qt.row_perm is not None: a = a[qt.row_perm]
      a = a.reshape(out, inn).T
    return QuantWeight.of(qt.format, (out, inn), a)
  if qt.transposed or inn % qt.block_size: return None
  if qt.row_perm is not None: data = data[qt.row_perm]
  if qt.format in REPACK:
    codes, planes, block = repack(qt.format, np.asarray(data).reshape(-1, qt.type_size), out)
    return QuantWeight.of(qt.format, (out, inn), codes.T, tuple(p.T for p in planes), block)
  nb = inn // 32
  b = np.asarray(data).reshape(out, nb, qt.type_size)
  if qt.format == "Q8_0": return QuantWeight.of("Q8_0", (out, inn), b[:, :, 2:].reshape(out, inn).T.view(np.int8), (_f16(b[:, :, 0:2]),))
  start = 2 if qt.format == "Q4_0" else 4
  codes = b[:, :, start:start + 16].reshape(out, inn // 2).T
  scales = (_f16(b[:, :, 0:2]),) if qt.format == "Q4_0" else (_f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]))
  return QuantWeight.of(qt.format, (out, inn), codes, scales)
