"""The 5-bit, 6-bit and K-quant formats repacked at load into the planes qweight.py computes on (issue 38: quantized
weights stay quantized). Their codes are spread over bit planes and their scales nested (a K-quant's 6-bit sub-block
scale times the superblock's float16), which a kernel could unpack per code but would then do per code on every run;
repacked once, each becomes a plane of plain codes beside one float32 scale (and min) per block:

  Q4_K   nibbles in Q4_0's order per 32 values (byte j: value j, value j + 16), d * sc and -(dmin * m) float32 per 32
  Q5_0   int8 q - 16, d float16 per 32           Q5_1   int8 q, d and m float16 per 32
  Q5_K   int8 q, d * sc and -(dmin * m) float32 per 32
  Q6_K   int8 q - 32, d * sc float32 per 16

The codes and scales are quants.py's (the functions its numpy oracle dequantises with), so a code times its block's
scale, plus its min, is what the oracle computes, in the same float32 operations: the planes dequantise bit for bit as
it does. They take more bytes than the file (a byte per 5- or 6-bit code, float32 block scales: 1.06 to 1.25 bytes a
value where Q4_K stays at 0.75) and far fewer than float32's 4.

Each function takes the matrix's blocks (rows * blocks per row, type size) uint8 and gives (codes (rows, in) or for
Q4_K (rows, in / 2), scale planes (rows, in / block)), the block size of the planes."""
from __future__ import annotations

import numpy as np

from kiln.llm.quants import _f16, k_scales, q4_k_codes, q5_0_codes, q5_1_codes, q5_k_codes, q6_k_codes, q6_k_scales

Planes = tuple[np.ndarray, tuple[np.ndarray, ...], int]


def _q4_k(b: np.ndarray) -> Planes:
  v = q4_k_codes(b)  # each sub-block's 32 values in order
  codes = v[:, :, :16] | (v[:, :, 16:] << np.uint8(4))  # Q4_0's order: byte j holds value j and value j + 16
  d, m = k_scales(b)
  return codes.reshape(len(b), 128), (d, -m), 32


def _q5_0(b: np.ndarray) -> Planes:
  return q5_0_codes(b).astype(np.int8) - np.int8(16), (_f16(b[:, 0:2]).astype(np.float16),), 32


def _q5_1(b: np.ndarray) -> Planes:
  return q5_1_codes(b).astype(np.int8), (_f16(b[:, 0:2]).astype(np.float16), _f16(b[:, 2:4]).astype(np.float16)), 32


def _q5_k(b: np.ndarray) -> Planes:
  d, m = k_scales(b)
  return q5_k_codes(b).reshape(len(b), 256).astype(np.int8), (d, -m), 32


def _q6_k(b: np.ndarray) -> Planes:
  return q6_k_codes(b).reshape(len(b), 256).astype(np.int8) - np.int8(32), (q6_k_scales(b),), 16


REPACK = {"Q4_K": _q4_k, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q5_K": _q5_k, "Q6_K": _q6_k}


def repack(fmt: str, blocks: np.ndarray, rows: int) -> Planes:
  """The planes of a matrix of `rows` rows whose blocks (rows * blocks per row, type size) are in format fmt: codes
  (rows, in) (Q4_K: (rows, in / 2) nibbles), scales (rows, in / block) each, the block size."""
  codes, scales, block = REPACK[fmt](np.ascontiguousarray(blocks))
  return codes.reshape(rows, -1), tuple(s.reshape(rows, -1) for s in scales), block
