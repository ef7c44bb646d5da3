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
its scale, so every code is converted and multiplied once. A product of many rows (a prefill chunk) reads
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
from kiln.graph.lazy import Source
from kiln.ir.dtype import dtypes
from kiln.llm.qrepack import REPACK, repack
from kiln.llm.quants import QuantTensor

LANES = 32
BYTES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")  # int8 codes, a scale (and a min) per block
NIBBLES = ("Q4_0", "Q4_1", "Q4_K")  # two 4-bit codes a byte, per block of 32 a scale (Q4_0: less 8) or a scale and a min
PACKED = (*BYTES, *NIBBLES, "F16", "BF16")


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
    if any(p.format != a.format or p.block != a.block or p.shape[1] != a.shape[1] or p.codes.dtype != a.codes.dtype
           or p.shape[0] % LANES or [s.dtype for s in p.scales] != [s.dtype for s in a.scales] for p in parts): return None
    return QuantWeight(a.format, (sum(p.shape[0] for p in parts), a.shape[1]), np.concatenate([p.codes for p in parts], 0),
                       tuple(np.concatenate([p.scales[i] for p in parts], 0) for i in range(len(a.scales))), a.block)

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

  def embedding(self, ids: Tensor) -> Tensor:
    """Rows `ids` of the HF (out, in) weight (an embedding table's lookup), (len(ids), in) float32: only those columns of
    the planes are read."""
    return self.matrix().gather(ids, 1).T


def _f16(b: np.ndarray) -> np.ndarray:
  """(out, nb, 2) bytes -> float16 (nb, out)."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0].T


def pack(qt: QuantTensor) -> QuantWeight | None:
  """The planes of a 2-d weight in a packed format (None for any other: the caller dequantises it)."""
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
