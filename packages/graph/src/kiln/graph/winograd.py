"""Winograd F(4x4, 3x3): a 3x3, stride-1 convolution as 36 products per 4x4 output tile instead of 144 (Lavin & Gray,
"Fast Algorithms for Convolutional Neural Networks", 2015), built from kiln's own products so each step gets the matmul
options (register tile, packed panel, threads).

| step             | what it computes                                             | as                                               |
|------------------|--------------------------------------------------------------|--------------------------------------------------|
| weight transform | U[e] = (G (x) G) g per (out, in) channel pair: (36, O, C)    | numpy at build for a weight array, else a product |
| input transform  | V = B^T d B per 6x6 window d, 4 apart: (36, C, NT)            | 36 stacked sums of window elements (`transform`) |
| batched product  | M[e] = U[e] @ V[e]: (36, O, NT), T the tiles of one image     | the matmul path                                  |
| output transform | Y = A^T M A per tile: (16, O * NT)                           | 16 stacked sums of M's planes (`transform`)      |
| read back        | y[n, o, 4ty + r, 4tx + s] = Y[4r + s, o, n, ty, tx], cropped | a copy; the bias (and what follows) its epilogue |

Against the direct product (conv + bias + relu + a mean over the maps, 2-core Zen 4, hot; AVX-512, then KILN_CPU=x86-64-v3):
32->32 over 16x16 maps at batch 32 1.33x / 1.16x, 32->64 1.53x / 1.24x, 64->64 over 8x8 1.93x / 1.61x, 512->512 over 7x7
at batch 4 2.56x / 2.03x, 64->64 over 56x56 at batch 1 1.95x / 2.14x; the bench CNN 3.24 (direct) -> 2.33-2.55 (the
transforms as dense products) -> 2.17-2.39 ms (onnxruntime 2.94-2.96).

The price is accuracy: the transforms' constants (1/24, 8, ...) round, so a sum over C channels is off by about 1e-5 of
its magnitude (the direct product: about 1e-6); F(2x2, 3x3) is closer (3e-6) but its 16 products per 4 outputs made
conv1 no faster than the direct product here. KILN_WINOGRAD=0 turns it off (the direct product everywhere, e.g. to
compare bits with another engine). Under a symbolic batch (a torch export's dynamic batch axis) the images stay an
outer loop of every step and one image's tiles are the product's columns, since the codegen neither vectorises nor tiles
a symbolic loop: it takes maps of at least MIN_IMAGE_TILES tiles (4x4 tiles: 13x13 maps and up). Measured against the direct product,
batch 8 of one compile (AVX-512 / AVX2): 64->64 over 56x56 1.51x, 128->128 over 28x28 2.08x, 256->256 over 14x14
2.77x / 2.07x, 32->64 over 16x16 at batch 32 1.93x; 64->128 over 8x8 (4 tiles) 1.08x, refused."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kiln.graph import settings
from kiln.graph.build_target import cpu_layouts
from kiln.graph.dims import is_static, static_shape
from kiln.ir.dtype import dtypes

if TYPE_CHECKING:  # Tensor.conv2d calls this module: new tensors are made through the operands' own type (no import loop)
  from kiln.graph.tensor import Tensor

TILE = 4  # outputs per tile side: F(4x4, 3x3)
WINDOW = TILE + 2  # input window side
# tiles (the batched product's columns) at least one float32 vector of the widest target: 512 channels over one 7x7
# map (4 tiles) ran 0.72x the direct conv, over four (16 tiles) 2.2x
MIN_TILES = 16
# under a symbolic batch the columns are one image's tiles: at least one vector of the widest target (16x16 maps: 16 tiles,
# 256 channels 2.77x the direct product; 8x8 maps' 4 tiles gained 1.08-1.11x at 128-256 channels, too little to take)
MIN_IMAGE_TILES = 16
MIN_CHANNELS = 32  # the fewest input and output channels the Winograd path takes (saves)
_BT = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], np.float64)
_G = np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
               [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], np.float64)
_AT = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], np.float64)
# the weight's 2-d transform as one matrix over the kernel flattened row by row: kron(G, G) vec(g) = vec(G g G^T); float64,
# applied once in numpy where the weight is an array
WEIGHT_T = np.kron(_G, _G)  # (36, 9)


def enabled() -> bool:
  return settings.WINOGRAD.get()


def fits(x: Tensor, w: Tensor, pads: Sequence[tuple[int, int]], stride: Sequence[int], dilation: Sequence[int], groups: int) -> bool:
  """Whether conv2d takes the Winograd path: a graph built for the CPU (the cost rule is the CPU's; on CUDA the direct
  product is the tiled implicit GEMM, and the transforms' trips through memory cost more than it saves), float32, static
  channels and maps (the batch may be symbolic), a 3x3 kernel at stride and dilation 1, one group, an output of at least
  one tile each way and MIN_TILES in all (MIN_IMAGE_TILES per image under a symbolic batch), and channels enough that it
  saves (the cost rule)."""
  if not enabled() or not cpu_layouts() or x.dtype != dtypes.float32 or w.dtype != dtypes.float32 or x.ndim != 4 or w.ndim != 4: return False
  if not (is_static(x.shape[1:]) and is_static(w.shape)) or groups != 1 or tuple(w.shape[2:]) != (3, 3): return False
  if any(s != 1 for s in stride) or any(d != 1 for d in dilation) or any(b < 0 or a < 0 for b, a in pads): return False
  o, c = static_shape("conv (weight)", w.shape)[:2]
  ho, wo, th, tw = _grid(x, pads)
  # a symbolic batch: each image's tiles are the product's columns (the images a batch loop), so one image needs them all
  if not is_static(x.shape[:1]): tiles, least = th * tw, MIN_IMAGE_TILES
  else: tiles, least = static_shape("conv", x.shape)[0] * th * tw, MIN_TILES
  return min(ho, wo) >= TILE and tiles >= least and saves(c, o)


def _grid(x: Tensor, pads: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
  """(output rows, output columns, tile rows, tile columns) of a 3x3 stride-1 conv of x under pads."""
  h, w = static_shape("conv", x.shape[2:])
  (pt, pb), (pl, pr) = pads
  ho, wo = h + pt + pb - 2, w + pl + pr - 2
  return ho, wo, -(-ho // TILE), -(-wo // TILE)


def saves(c: int, o: int) -> bool:
  """The cost rule: per tile, the direct product does 144 multiply-adds per (in, out) channel pair and Winograd 36, so it
  saves 108 C O; against that, the transforms and the products' 36 planes of tiles run from memory, about 1296
  multiply-adds' time per input and per output channel (fitted to the measured crossover): it pays when the harmonic
  mean of C and O is at least 24. Measured (conv + bias + relu + mean, batch 32, 2-core Zen 4, direct / Winograd):
  16 -> 16 over 32x32 maps 1.01x, 16 -> 32 0.91x, 8 -> 16 0.81x, 3 -> 32 0.44x, refused here; 32 -> 32 over 16x16 1.33x,
  32 -> 64 1.53x, 64 -> 64 over 8x8 1.93x, 512 -> 512 over 7x7 at batch 4 2.56x, taken. Held to AVX2 the same split:
  0.60-0.75x refused, 1.16-2.03x taken. And its batched product needs MIN_CHANNELS rows and steps of K (the output and
  input channels): with 16, each packed panel served too few multiply-adds (SqueezeNet's 16 -> 64 convs over 55x55 maps,
  which the cost rule alone took, ran slower than the direct product)."""
  return min(c, o) >= MIN_CHANNELS and 108 * c * o >= 1296 * (c + o)


def weight_transform(w: Tensor) -> Tensor:
  """U (36, O, C) from the weight (O, C, 3, 3): in float64 numpy for a weight array, else as a product each run."""
  o, c = static_shape("conv (weight)", w.shape)[:2]
  if (data := w.node.data) is not None:
    u = WEIGHT_T @ np.asarray(data, np.float64).reshape(o * c, 9).T  # (36, O*C)
    return type(w)(u.reshape(WINDOW * WINDOW, o, c).astype(np.float32))
  return (type(w)(WEIGHT_T.astype(np.float32)) @ w.reshape(o * c, 9).T).reshape(WINDOW * WINDOW, o, c)


def _sum(coefs: np.ndarray, terms: Sequence[Tensor]) -> Tensor:
  """sum(c * t) over the nonzero coefficients, a +-1 a plain add or subtract: the transforms' matrices are mostly 0, +-1."""
  acc: Tensor | None = None
  for k, t in zip(coefs.tolist(), terms):
    if k == 0: continue
    if acc is None: acc = t if k == 1 else -t if k == -1 else t * k
    else: acc = acc + t if k == 1 else acc - t if k == -1 else acc + t * k
  assert acc is not None  # every row of _BT and _AT has a nonzero
  return acc


def transform(x: np.ndarray, d: Sequence[Sequence[Tensor]]) -> Tensor:
  """X d X^T for a square grid d of tensors (one per window element, each over channels and tiles), as one stack of
  X.shape[0]**2 sums: rows first, then columns, each row sum shared by the sums that read it. Its kernel is elementwise;
  the optimiser unrolls the stacked axis whole (opt._selected_axes), so each output element is its own few adds: the
  input transform's 36 x 36 and the output transform's 16 x 36 as dense products did 4-5x the arithmetic and ran at
  half the speed (0.30 -> 0.15 ms on 32 maps of 16x16 at batch 32)."""
  k = range(x.shape[1])
  rows = [[_sum(x[i], [d[a][b] for a in k]) for b in k] for i in range(x.shape[0])]  # (X d)[i][b]
  return type(d[0][0]).stack([_sum(x[j], rows[i]) for i in range(x.shape[0]) for j in range(x.shape[0])], 0)


def conv3x3(x: Tensor, w: Tensor, pads: Sequence[tuple[int, int]], bias: Tensor | None) -> Tensor:
  """y = conv2d(x, w, bias, padding=pads) for a case `fits` accepts; x is read in place under its padding. A static batch
  makes all images' tiles one product's columns; a symbolic batch (N, a runtime variable) keeps the images an outer axis
  of every step, each image's tiles the columns, so the inner axes stay static (vectorised, tiled)."""
  n = x.shape[0]
  c = static_shape("conv", x.shape[1:])[0]
  o = static_shape("conv (weight)", w.shape)[0]
  (pt, pb), (pl, pr) = pads
  ho, wo, th, tw = _grid(x, pads)
  t, e = th * tw, WINDOW * WINDOW
  # the map padded to whole tiles (the extra rows and columns read as zeros, their outputs cropped below)
  xp = x.contiguous().pad(((0, 0), (0, 0), (pt, pb + TILE * th - ho), (pl, pr + TILE * tw - wo)))
  if isinstance(n, int):
    nt = n * t
    win = xp.windows((WINDOW, WINDOW), (TILE, TILE)).permute(4, 5, 1, 0, 2, 3)  # (6, 6, C, N, TH, TW)
    # each window element flattened over (C, tiles): the stack is then (36, C * tiles), its inner axis long enough to vectorise
    v = transform(_BT, [[win[a, b].reshape(c * nt) for b in range(WINDOW)] for a in range(WINDOW)]).reshape(e, c, nt)
    m = (weight_transform(w) @ v).reshape(WINDOW, WINDOW, o * nt)
    y = transform(_AT, [[m[a, b] for b in range(WINDOW)] for a in range(WINDOW)]).contiguous().reshape(TILE, TILE, o, n, th, tw)
    y = y.permute(3, 2, 4, 0, 5, 1)
  else:
    win = xp.windows((WINDOW, WINDOW), (TILE, TILE)).permute(4, 5, 0, 1, 2, 3)  # (6, 6, N, C, TH, TW)
    v = transform(_BT, [[win[a, b].reshape(n, c * t) for b in range(WINDOW)] for a in range(WINDOW)]).reshape(e, n, c, t)
    m = (weight_transform(w).reshape(e, 1, o, c) @ v).reshape(WINDOW, WINDOW, n, o * t)  # (36, N, O, T): images a batch axis
    y = transform(_AT, [[m[a, b] for b in range(WINDOW)] for a in range(WINDOW)]).contiguous().reshape(TILE, TILE, n, o, th, tw)
    y = y.permute(2, 3, 4, 0, 5, 1)
  y = y.reshape(n, o, TILE * th, TILE * tw)
  # the tiles put back in NCHW order, cropped, in a buffer of their own: what follows (bias, batch norm, relu) runs in this
  # copy's kernel (epilogue.py) and its readers read plain rows (a mean over the tiled view gathered: 0.55 ms against
  # 0.05 ms for the copy's reader plus 0.16 ms for the copy, 32x64 maps of 16x16)
  y = (y if (TILE * th, TILE * tw) == (ho, wo) else y[:, :, :ho, :wo]).contiguous()
  return y if bias is None else y + bias.reshape(1, o, 1, 1)
