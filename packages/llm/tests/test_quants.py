"""kiln.llm.quants: every weight format dequantises bit for bit as gguf.quants does (data made by gguf's quantizers, random
raw blocks for the K-quants, which gguf cannot make), the K-quants also as a scalar transcription of ggml-quants.c does,
and QuantTensor's layout fixes."""
from __future__ import annotations

import numpy as np
import pytest
from checkpoint_files import K_QUANTS, random_blocks
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from kiln.llm.errors import CheckpointError
from kiln.llm.quants import FORMATS, QuantTensor, dequantize


def _bits(a: np.ndarray) -> np.ndarray: return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_quantized_by_gguf(fmt: str) -> None:
  x = np.random.default_rng(1).standard_normal((6, 128)).astype(np.float32) * 3
  x[0, :32] = 0  # an all-zero block (d = 0)
  raw = quantize(x, T[fmt]).view(np.uint8).reshape(6, -1)
  ours = dequantize(raw, fmt)
  assert ours.dtype == np.float32 and ours.shape == x.shape
  np.testing.assert_array_equal(_bits(ours), _bits(gguf_dequantize(raw, T[fmt]).reshape(6, -1)))
  assert np.abs(ours - x).max() < {"Q8_0": 0.05, "Q4_0": 1.0, "Q4_1": 0.8, "Q5_0": 0.5, "Q5_1": 0.4, "BF16": 0.05}[fmt]


@pytest.mark.parametrize("fmt", ["F32", "F16"])
def test_floats(fmt: str) -> None:
  x = np.random.default_rng(2).standard_normal((3, 10)).astype(np.float32)
  raw = x.astype(np.float16 if fmt == "F16" else np.float32).view(np.uint8)
  np.testing.assert_array_equal(dequantize(raw, fmt), x.astype(np.float16).astype(np.float32) if fmt == "F16" else x)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quants_match_gguf(fmt: str) -> None:
  raw = random_blocks(fmt, 4, 512, np.random.default_rng(3))
  ours = dequantize(raw, fmt)
  assert ours.shape == (4, 512)
  np.testing.assert_array_equal(_bits(ours), _bits(gguf_dequantize(raw, T[fmt]).reshape(4, -1)))


def _f16(b: np.ndarray, at: int) -> float: return float(b[at:at + 2].view(np.float16)[0])


def _scale_min(j: int, q: np.ndarray) -> tuple[int, int]:  # ggml-quants.c get_scale_min_k4
  if j < 4: return int(q[j]) & 63, int(q[j + 4]) & 63
  return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def _ref_block(fmt: str, b: np.ndarray) -> np.ndarray:
  """One K-quant block, transcribed loop by loop from ggml-quants.c's dequantize_row_q{4,5,6}_K (float64: compared with a
  tolerance, the float32 rounding order being the other test's business)."""
  y = np.zeros(256)
  if fmt == "Q6_K":
    ql, qh, sc, d = b[0:128].astype(int), b[128:192].astype(int), b[192:208].view(np.int8).astype(int), _f16(b, 208)
    for n in range(2):
      for l in range(32):
        i = l // 16
        q1 = ((ql[64 * n + l] & 0xF) | (((qh[32 * n + l] >> 0) & 3) << 4)) - 32
        q2 = ((ql[64 * n + l + 32] & 0xF) | (((qh[32 * n + l] >> 2) & 3) << 4)) - 32
        q3 = ((ql[64 * n + l] >> 4) | (((qh[32 * n + l] >> 4) & 3) << 4)) - 32
        q4 = ((ql[64 * n + l + 32] >> 4) | (((qh[32 * n + l] >> 6) & 3) << 4)) - 32
        for k, q in enumerate((q1, q2, q3, q4)): y[128 * n + 32 * k + l] = d * sc[8 * n + i + 2 * k] * q
    return y
  d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16]
  qh = b[16:48].astype(int) if fmt == "Q5_K" else None
  qs = (b[48:176] if fmt == "Q5_K" else b[16:144]).astype(int)
  for c in range(4):  # 64 values per step: the low nibbles, then the high ones, of 32 bytes
    for half in range(2):
      sc, m = _scale_min(2 * c + half, scales)
      for l in range(32):
        q = (qs[32 * c + l] >> (4 * half)) & 0xF
        if qh is not None and qh[l] & (1 << (2 * c + half)): q += 16
        y[64 * c + 32 * half + l] = d * sc * q - dmin * m
  return y


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quants_match_ggml_c(fmt: str) -> None:
  raw = random_blocks(fmt, 1, 512, np.random.default_rng(4))
  blocks = raw.reshape(2, -1)
  ref = np.concatenate([_ref_block(fmt, blk) for blk in blocks])
  np.testing.assert_allclose(dequantize(raw, fmt).reshape(-1), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_quant_tensor_layouts() -> None:
  x = np.arange(24, dtype=np.float32).reshape(4, 6)
  raw = x.view(np.uint8)
  perm = np.array([2, 0, 3, 1])
  qt = QuantTensor("F32", (4, 6), raw, row_perm=perm)
  np.testing.assert_array_equal(qt.dequantize(), x[perm])
  np.testing.assert_array_equal(qt.dequantize(rows=[1, 3]), x[perm][[1, 3]])
  t = QuantTensor("F32", (6, 4), raw, transposed=True)
  np.testing.assert_array_equal(t.dequantize(), x.T)
  np.testing.assert_array_equal(QuantTensor("F32", (4, 6), raw, offset=-1.0).dequantize(), x - 1)
  plain = QuantTensor("F32", (4, 6), raw).dequantize()
  assert np.shares_memory(plain, raw)  # F32 with nothing to undo: a view, no copy
  with pytest.raises(CheckpointError, match="out of range"): QuantTensor("F32", (4, 6), raw).dequantize(rows=[4])


def test_bad_formats() -> None:
  with pytest.raises(CheckpointError, match="Q2_K"): dequantize(np.zeros((1, 84), np.uint8), "Q2_K")
  with pytest.raises(CheckpointError, match="whole"): dequantize(np.zeros((1, 35), np.uint8), "Q8_0")
  assert set(FORMATS) >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}
