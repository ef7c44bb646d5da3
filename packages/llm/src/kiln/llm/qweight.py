"""Linear weights kept in their stored format: the blocks' codes and scales repacked once at load into planes no bigger
than the file's bytes, and dequantised by graph ops inside the kernel that reads them (no float32 copy of the model).

Layout: every plane is input-major, (in, out) for codes and (in / 32, out) for a block's scales, so that consecutive
outputs of one input position are adjacent. kiln's matrix-vector kernel gives its vector lanes to consecutive outputs
(each lane one output's running sum, summed in the reference order), so it loads a vector of one input position's codes
at once; in the file's (out, in) order those lanes would gather codes a row apart. The product x @ W is written as
graph ops on those planes (cast, mask, multiply by the block's scale) and the scheduler fuses them into the product's
kernel: a decode step reads the codes and scales, nothing else. A prefill chunk's product (many rows) has the scheduler
realize the dequantised matrix once per run in a scratch buffer of the plan, then run the register-tiled product on it.

Formats (quants.py has the byte layouts and the numpy oracle):
  Q8_0   codes int8 (in, out), d float16 (in / 32, out)                         34 bytes per 32 values, as the file
  Q4_0   nibbles uint8 (in / 2, out): byte j of a block holds value j (low) and j + 16 (high), d float16      18 bytes
  Q4_1   nibbles as Q4_0, d and m float16                                                                      20 bytes
  F16    float16 (in, out);  BF16  bfloat16 (in, out)                                                           2 bytes a value
Other formats (Q5_0, Q5_1, the K-quants) are not packed: pack() returns None and the caller dequantises them.
Weights come in Hugging Face layout: a llama.cpp row permutation (QuantTensor.row_perm) is applied to the planes' out
axis, and a weight stored transposed (GPT-2's Conv1D in safetensors) is already (in, out).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.graph import Node, Tensor
from kiln.graph.lazy import Source
from kiln.ir.dtype import dtypes
from kiln.llm.quants import QuantTensor

PACKED = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16")


@dataclass(frozen=True)
class QuantWeight:
  """A linear weight of HF shape (out, in) as planes (see the module's docstring): `codes` (in, out) or, for the 4-bit
  formats, (in / 2, out); `scales` ((in / 32, out) float16: d, then m for Q4_1)."""
  format: str
  shape: tuple[int, int]
  codes: np.ndarray
  scales: tuple[np.ndarray, ...] = ()

  @property
  def nbytes(self) -> int: return self.codes.nbytes + sum(s.nbytes for s in self.scales)

  def rows(self, lo: int, hi: int) -> QuantWeight:
    """HF rows lo..hi (outputs): phi3's fused projections split at load."""
    return QuantWeight(self.format, (hi - lo, self.shape[1]), np.ascontiguousarray(self.codes[:, lo:hi]),
                       tuple(np.ascontiguousarray(s[:, lo:hi]) for s in self.scales))

  def matrix(self) -> Tensor:
    """The dequantised weight as a graph expression, (in, out) float32: a kernel that reads it reads the planes."""
    out, inn = self.shape
    f = self.format
    if f == "F16": return Tensor(self.codes).cast(dtypes.float32)
    if f == "BF16": return Tensor(Node("BUFFER", (), Source(data=self.codes), self.codes.shape, dtypes.bfloat16)).cast(dtypes.float32)
    nb = inn // 32
    d = Tensor(self.scales[0]).cast(dtypes.float32).reshape(nb, 1, out)
    c = Tensor(self.codes)
    if f == "Q8_0": return (c.reshape(nb, 32, out).cast(dtypes.float32) * d).reshape(inn, out)
    c = c.reshape(nb, 16, out)
    lo, hi = (c & 0x0F).cast(dtypes.float32), (c & 0xF0).cast(dtypes.float32) * (1.0 / 16)  # the high nibble, exactly
    if f == "Q4_0": q = Tensor.cat([(lo - 8.0) * d, (hi - 8.0) * d], 1)
    else:
      m = Tensor(self.scales[1]).cast(dtypes.float32).reshape(nb, 1, out)
      q = Tensor.cat([lo * d + m, hi * d + m], 1)
    return q.reshape(inn, out)

  def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ W.T (+ bias) for x (..., in), as Tensor.linear with the HF (out, in) weight."""
    rows = 1
    for n in x.shape[:-1]: rows *= n if isinstance(n, int) else 2
    y = self._one_row(x) if rows == 1 and self.scales else x @ self.matrix()
    return y if bias is None else y + bias

  def _one_row(self, x: Tensor) -> Tensor:
    """x @ W.T for one row of x, block by block: each block's dot product on the codes, then times its scale (and for
    Q4_0 less 8 x the block's sum of x, for Q4_1 plus m x it), so the codes are multiplied once each, not dequantised
    first. Two kernels: the per-block sums (in / 32, out), then their scaled sum. A product of many rows runs on matrix()
    instead: the register-tiled kernel wants one (in, out) matrix."""
    out, inn = self.shape
    nb = inn // 32
    lead = x.shape[:-1]
    xb = x.reshape(nb, 32, 1)
    d = Tensor(self.scales[0]).cast(dtypes.float32)
    c = Tensor(self.codes)
    if self.format == "Q8_0": y = ((xb * c.reshape(nb, 32, out).cast(dtypes.float32)).sum(1) * d).sum(0)
    else:
      c = c.reshape(nb, 16, out)
      lo, hi = (c & 0x0F).cast(dtypes.float32), (c & 0xF0).cast(dtypes.float32)
      part = (xb[:, :16] * lo + (xb[:, 16:] * (1.0 / 16)) * hi).sum(1)  # (nb, out): the codes' dot products
      xs = xb.sum(1)  # (nb, 1)
      if self.format == "Q4_0": y = ((part - xs * 8.0) * d).sum(0)
      else: y = (part * d + xs * Tensor(self.scales[1]).cast(dtypes.float32)).sum(0)
    return y.reshape(*lead, out)

  def embedding(self, ids: Tensor) -> Tensor:
    """Rows `ids` of the HF (out, in) weight (an embedding table's lookup), (len(ids), in) float32: only those columns of
    the planes are read."""
    return self.matrix().gather(ids, 1).T


def _f16(b: np.ndarray) -> np.ndarray:
  """(out, nb, 2) bytes -> float16 (nb, out)."""
  return np.ascontiguousarray(np.ascontiguousarray(b).view(np.float16)[..., 0].T)


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
    return QuantWeight(qt.format, (out, inn), np.ascontiguousarray(a))
  if qt.transposed or inn % 32: return None
  if qt.row_perm is not None: data = data[qt.row_perm]
  nb = inn // 32
  b = np.asarray(data).reshape(out, nb, qt.type_size)
  if qt.format == "Q8_0":
    return QuantWeight("Q8_0", (out, inn), np.ascontiguousarray(b[:, :, 2:].reshape(out, inn).T).view(np.int8), (_f16(b[:, :, 0:2]),))
  start = 2 if qt.format == "Q4_0" else 4
  codes = np.ascontiguousarray(b[:, :, start:start + 16].reshape(out, inn // 2).T)
  scales = (_f16(b[:, :, 0:2]),) if qt.format == "Q4_0" else (_f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]))
  return QuantWeight(qt.format, (out, inn), codes, scales)
