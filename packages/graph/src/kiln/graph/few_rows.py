"""A matrix product by a weight array (a linear layer, a classifier's Gemm): the weight is stored in blocks of BLOCK
output columns, (N/BLOCK, K, BLOCK), and the product computed as (rows, N/BLOCK, BLOCK), so the register tile of each
block streams one contiguous run of the weight along K.

Why: with few rows the weight is read once per run, from memory, and how it is laid out decides the speed. Read as the
model stores it, (K, N) or a transposed (N, K) view, a tile of 32 columns either walked K rows of 128 bytes each
N * 4 bytes apart or gathered its lanes a row apart: 9216 -> 4096 at batch 1 took 38 ms (N, K) and 67 ms (K, N) for a
151 MB weight. With more rows (a transformer's or an MLP-mixer's tokens) the codegen's packed panel reuses each
panel of the weight over the row tiles, but it copies the whole weight, K rows of 128 bytes N * 4 bytes apart, on every
run: with a few row tiles the copy cost about as much as the product (32 x 512 @ 512 x 2048: 1.29 -> 0.77 ms in blocks).
The blocks are that panel laid out once at load, so every static row count takes them; past MAX_ROWS (one register
tile's rows, where the product is compute-bound) only a column count BLOCK divides does, since narrower blocks would
narrow the register tile and padded columns would be computed for nothing."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.build_target import cpu_layouts
from kiln.graph.dims import is_static, static_shape
from kiln.graph.lazy import Node

if TYPE_CHECKING:  # Tensor.matmul calls this module: new tensors are made through the operands' own type (no import loop)
  from kiln.graph.tensor import Tensor

ENABLED = True  # False: every product as Tensor.matmul writes it, for comparison
# the widest register tile's columns (two AVX-512 vectors of float32): one K step of a block is one contiguous 128-byte run
BLOCK = 32
MAX_ROWS = 8  # the most rows the codegen's register tile takes (choose.heuristic._tile_rows): past it, whole blocks only
# symbolic rows (a dynamic export's batch or tokens: (N, H, W, C) @ (C, D) with N symbolic) take the blocks too, as one
# symbolic row axis: the codegen tiles it in whole tiles (prepare.peel), and the weight streams once a tile, where the
# plain product looped over N outside a tile of W rows and streamed the weight N*H times; a weight under
# SYMBOLIC_MIN_BYTES stays in cache across those passes, and the plain product (its panel packed) keeps it
SYMBOLIC_ROWS = True
SYMBOLIC_MIN_BYTES = 512 << 10


def weight_array(n: Node) -> np.ndarray | None:
  """The array a node reads when it is a weight array seen through reshapes and transposes (None otherwise)."""
  views: list[tuple[str, tuple[int, ...]]] = []
  while n.op == "VIEW" and n.arg[0] in ("reshape", "permute"):
    views.append(n.arg)
    n = n.src[0]
  if (data := n.data) is None: return None
  for kind, p in reversed(views):
    data = data.reshape(p) if kind == "reshape" else data.transpose(p)
  return data


def in_memory(data: np.ndarray) -> bool:
  """Whether an array's memory is numpy's or Python bytes' (an ONNX initializer), not a mapped file's pages (a DISK
  buffer, an mmap of external data): those stay mapped, as the file's page cache, and are not copied into blocks."""
  base: object = data
  while isinstance(base, np.ndarray) and base.base is not None: base = base.base
  return isinstance(base, np.ndarray | bytes | bytearray) and not isinstance(base, np.memmap)


def product(a: Tensor, b: Tensor) -> Tensor | None:
  """a (..., M, K) @ b (K, N) as a product over the blocked weight, where b is a weight array in memory of more than BLOCK
  columns, a multiple of BLOCK where a has more than MAX_ROWS rows or symbolic ones (those over a weight of at least
  SYMBOLIC_MIN_BYTES), in a graph built for the CPU (build_target.py); None where it does not apply (the caller writes
  the plain product)."""
  if not ENABLED or not cpu_layouts() or b.ndim != 2 or a.ndim < 2 or not is_static(a.shape[-1:]) or not is_static(b.shape): return None
  if not is_static(a.shape) and not SYMBOLIC_ROWS: return None
  rows = sym.mul(*a.shape[:-1])  # an int where the rows are static
  k, n = static_shape("matmul", b.shape)
  many = not isinstance(rows, int) or rows > MAX_ROWS  # symbolic rows may be many: whole blocks only
  if isinstance(rows, int) and rows == 0 or n <= BLOCK or many and n % BLOCK: return None
  if (data := weight_array(b.node)) is None or not in_memory(data): return None
  if not isinstance(rows, int) and data.nbytes < SYMBOLIC_MIN_BYTES: return None
  width = next((w for w in (BLOCK, BLOCK // 2, BLOCK // 4) if n % w == 0), BLOCK)
  nb = -(-n // width)
  padded = np.zeros((k, nb * width), data.dtype) if nb * width != n else data
  if padded is not data: padded[:, :n] = data
  wb = type(b)(np.ascontiguousarray(padded.reshape(k, nb, width).transpose(1, 0, 2)))  # (N/B, K, B)
  # realized as (rows, N/B, B), which is (rows, N) as stored: what follows (a bias, an activation) reads it through a
  # reshape, so the product's kernel takes it as its epilogue (epilogue.py)
  y = (a.reshape(rows, 1, k, 1) * wb.reshape(1, nb, k, width)).sum(2).contiguous().reshape(rows, nb * width)
  if nb * width != n: y = y.slice([0], [n], [1])
  return y.reshape(*a.shape[:-1], n)
