"""Convolution built from the graph's primitives: per group a matrix product over the window view of the input (the
codegen tiles it as a matmul), Winograd F(4x4, 3x3) where its cost rule says so (winograd.py), or, for a depthwise conv,
a sum over each window (in NCHW, or in a blocked channel layout where the output rows are narrower than a block).
Tensor.conv2d calls `conv`; this module makes new tensors through its operands' type, so it imports Tensor only for
type checking (tensor.py imports this module)."""
from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import winograd
from kiln.graph.build_target import build_device, cpu_layouts
from kiln.graph.errors import GraphError
from kiln.graph.lazy import Node, prod
from kiln.ir.errors import DeviceError
from kiln.ir.kernels import Dim

if TYPE_CHECKING:
  from kiln.graph.tensor import Tensor

# a padded conv reads its realized input through the pad (gated loads its packed panel copies as masked row runs) instead
# of realizing the padded copy first (a kernel of its own per conv); False: the padded copy, for comparison
PAD_INLINE = True
# a depthwise conv whose output rows are narrower than BLOCK runs in the blocked channel layout (_window_conv_blocked);
# False: always NCHW, for comparison
DEPTHWISE_BLOCKED = True
WIDE_BLOCKED = True  # a depthwise conv over rows of BLOCK or more runs blocked too where its input is channels-last
POINTWISE_CHANNELS_LAST = True  # a 1x1 conv whose input is channels-last computes its product channels-last
BLOCK = 16  # channels per block of the blocked layout: one 64-byte cache line of float32, a whole vector or two
# a conv with fewer output positions per image than CHANNELS_LAST_POSITIONS computes its product channels-last
# (_product_channels_last, _positions_few); False: never. BLOCK: only where its positions fill less than one vector
PRODUCT_CHANNELS_LAST = True
CHANNELS_LAST_POSITIONS = BLOCK * BLOCK
FOLD_BATCH = True  # ... with a static batch's images as more rows of one product; False: the batch an outer loop
FOLD_SYMBOLIC_BATCH = True  # ... and a symbolic batch's (_folds)
# ... over its realized patches, (g, N*P, K) with K = (*k, C/g), where it reads a window view (_patches); False: read per tap
PATCHES_FIRST = True
# ... copied from the input realized padded and channels-last (runs of channels); False: from the input as it is (NCHW)
CHANNELS_LAST_PATCHES = True
# a strided NCHW depthwise conv reads a realized padded copy of its input: through the pad's bounds test its loads, lanes
# `stride` apart, were a gather of gated scalars; ungated they are one masked span shuffled (expand.STRIDE_LOADS). False: in place
STRIDED_PADDED_COPY = True
# ... and so does a padded conv's product strided along its rows, in NCHW (_positions >= BLOCK); False: in place
STRIDED_PRODUCT_PADDED_COPY = True
# ... with a weight array stored in blocks of WEIGHT_BLOCK output channels, (g, O/WB, K, WB) (_product_blocked); False: (g, K, O/g)
BLOCKED_WEIGHT = True
# the widest register tile's columns (two AVX-512 vectors of float32): one K step of a block is one contiguous 128-byte run
WEIGHT_BLOCK = 32
# kernel taps that read only padding at every output position are dropped (_live_taps); False: every tap computed
DROP_PAD_TAPS = True
# a conv of one input channel per group and several outputs (a depthwise multiplier, FastViT's downsampling 7x7) runs as
# a depthwise conv over its input's channels each repeated (_repeat_channels); False: a product of one row per group
DEPTHWISE_MULTIPLIER = True
# the blocked layout's copy takes the padding along where the window sum reads at least PADDED_COPY_TAPS taps per element
# of the padded copy (_padded_copy_pays): its loads are then ungated, where each was a bounds test and a masked load; 0: never.
# 9: a 3x3 window (at most 9 taps an element) never copies: over a 224 px net's 112x112 and 56x56 maps the copy is a trip
# through memory that costs more than the window's gated loads save
PADDED_COPY_TAPS = 9
# a conv over an input of at most STEM_CHANNELS channels per group (an image's stem) computes its product channels-last,
# reading the window view in place: in NCHW its rows were the few output channels, its K 27-147, and its packed panel a
# strided gather of the positions (_image_stem); False: NCHW
STEM_CHANNELS_LAST = True
STEM_CHANNELS = 4
# a pool over a channels-last buffer computes channels-last too (pooled); False: NCHW
POOL_CHANNELS_LAST = True
# an NCHW product whose packed column panel would not stay in a core's L2 sums K in chunks of input channels (_k_chunks)
SPLIT_K = True
K_CHUNK_ROWS = 8  # a register tile's rows: a product of fewer than two tiles reads its panel once
GPU_TILE = 64  # the CUDA product's smallest tile's rows and columns (kiln.codegen.choose.tiling)
GPU_CHUNK_K = 512  # a GPU chunk's least K: its block's work stays well above the partials' trip through memory


def conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int] | int, padding: Sequence[tuple[int, int]] | int,
         dilation: Sequence[int] | int, groups: int) -> Tensor:
  """N-d convolution (torch's conv2d for 2 spatial dims): x (N, C, *sp), weight (O, C/groups, *k), padding (before, after) per dim.

  Per group a matrix product y[n, o, p] = sum_k W[o, k] * cols[n, k, p], k = (c, *kernel) and p = the output positions,
  shaped so the codegen gives it the matmul options (register tile, packed panel, threads): cols is the window view of
  the input, which the matmul's packing copies panel by panel (im2col without a buffer of its own). A padded input is
  read in place: the input is realized and the pad renders as gated loads under its bounds test, which the packing
  copies as masked loads of contiguous lanes (no padded copy: the bench CNN's three pad kernels took 0.38 ms of 4.2).
  The product is realized as (N, groups, O/groups, P), the loops the matmul tiles (as (groups, N*P, O/groups) where P
  is few or leaves vector lanes idle: _positions_few, _product_channels_last); what follows reads it through an NCHW view (the bias, batch norm and
  relu become the product kernel's epilogue when their readers read each element at least once: epilogue.py). A
  depthwise conv (one input and one output channel per group) has no matrix to tile: it stays a sum over each window,
  of its input realized first where that input is computed (every tap reads each element), padded by a copy where it
  is strided along its rows; where its output rows are narrower than BLOCK, in the blocked channel layout
  (_window_conv_blocked), whose vector runs across channels instead of along a row, and so over wider rows where its
  input's channels are innermost already (_channels_last_source) or can be: a pointwise conv's NCHW product is then
  computed channels-last for it (_relaid), and a 1x1 conv over such an input computes channels-last as well, so a mobile
  net's expansion, depthwise conv and projection run without a layout copy between them. A conv of one input channel per
  group and several outputs is such a depthwise conv over its input's channels repeated (_repeat_channels). An image's
  stem (a few input channels) computes its product channels-last as well (_image_stem), and a pool over a channels-last
  buffer pools channels-last (pooled). Before any of this, kernel taps that read only padding are dropped (_live_taps)."""
  d = weight.ndim - 2
  if x.ndim != d + 2 or d < 1: raise GraphError(f"conv: input {x.shape} and weight {weight.shape} need the same rank >= 3")
  sym.require_static("conv", x.shape, range(1, x.ndim))
  sym.require_static("conv (weight)", weight.shape)
  n, c = x.shape[:2]
  o, cg = weight.shape[:2]
  if groups < 1 or c % groups or o % groups or cg * groups != c:
    raise GraphError(f"conv: input {x.shape}, weight {weight.shape} and groups={groups} do not fit (C = C/groups * groups)")
  st = [stride] * d if isinstance(stride, int) else list(stride)
  dl = [dilation] * d if isinstance(dilation, int) else list(dilation)
  pads = [(padding, padding)] * d if isinstance(padding, int) else list(padding)
  if len(pads) != d: raise GraphError(f"conv: {len(pads)} (before, after) pads for {d} spatial dims of {x.shape}")
  x, w = x._coerce(weight)
  if DROP_PAD_TAPS: w, pads = _live_taps(x, w, pads, st, dl)
  cpu = cpu_layouts()  # the channels-last products and relayouts serve the CPU's vectors; elsewhere the NCHW product
  if winograd.fits(x, w, pads, st, dl, groups): return winograd.conv3x3(x, w, pads, bias)
  ks, og = sym.static_shape("conv (weight)", w.shape)[2:], o // groups
  if cg == 1 and isinstance(og, int) and og > 1 and DEPTHWISE_MULTIPLIER:  # each input channel feeds og outputs: depthwise over the channels repeated
    x, groups, og = _repeat_channels(x, og), groups * og, 1
  xp = x.pad(((0, 0), (0, 0), *pads))
  if cg == 1 and og == 1:  # each input element is read by every tap of its windows: compute it once, not per tap
    if DEPTHWISE_BLOCKED and prod(ks) > 1:
      # rows of BLOCK or more run blocked where the input's channels are innermost already (whole blocks of them): read in
      # place, where NCHW rows gated every tap's lanes; a pointwise conv's NCHW product is computed channels-last for it
      wide = WIDE_BLOCKED and cpu and isinstance(x.shape[1], int) and x.shape[1] % BLOCK == 0
      cl = wide and _channels_last_source(x)
      if wide and not cl and _row(x, ks, pads, st, dl) >= BLOCK and (relaid := _relaid(x)) is not None:
        x, cl = relaid, _channels_last_source(relaid)
      if _row(x, ks, pads, st, dl) < BLOCK or cl: return _window_conv_blocked(x, w, pads, st, dl, bias)
    if prod(ks) > 1 and STRIDED_PADDED_COPY and st[-1] > 1 and xp is not x:
      # a computed input realized first: padded as computed, its loads' indices are clamped, not gated (a gather)
      xp = (x.contiguous() if _computes(x.node) else x).pad(((0, 0), (0, 0), *pads)).contiguous()
    elif prod(ks) > 1 and _computes(x.node): xp = x.contiguous().pad(((0, 0), (0, 0), *pads))
    return _window_conv(xp, w, st, dl, groups, bias)
  if xp is not x and STRIDED_PRODUCT_PADDED_COPY and st[-1] > 1 and _positions(x, ks, pads, st, dl) >= BLOCK:
    # the packed panel's rows are output positions `stride` apart: read through the pad's bounds test, a gather of gated
    # scalars; from a padded copy, one masked span shuffled (expand.STRIDE_LOADS), as the strided depthwise conv does
    xp = (x.contiguous() if _computes(x.node) else x).pad(((0, 0), (0, 0), *pads)).contiguous()
  elif xp is not x and PAD_INLINE:  # the input realized, its padding read in place (the product's loads gated by the bounds)
    xp = x.contiguous().pad(((0, 0), (0, 0), *pads))
  elif xp is not x:
    xp = (x.contiguous() if _reduces(x.node) else x).pad(((0, 0), (0, 0), *pads)).contiguous()
  if all(k == 1 for k in ks) and all(s == 1 for s in st) and xp is x:
    out, cols = x.shape[2:], x.reshape(n, groups, cg, prod(x.shape[2:]))  # 1x1: the input is the matrix already
    chan = cols  # (N, g, C/g, ...): what K's chunks split along the channels
  else:
    win = xp.windows(ks, st, dl)  # (N, C, *out, *k)
    out = win.shape[2:2 + d]
    # the patches pay where the product reads each of them more than once: more output channels than one register tile's
    if cpu and PRODUCT_CHANNELS_LAST and PATCHES_FIRST and _folds(n) and _positions_few(prod(out), og) and og > WEIGHT_BLOCK:
      # the input realized padded and channels-last first, each element once: the patches' rows then copy runs of channels
      # (their K is (*k, C/g)), where from NCHW each lane was a gather H*W apart with a bounds test of its own; and a
      # computed input is computed once, not in the copy (a layer norm's sums per element)
      if CHANNELS_LAST_PATCHES or _computes(xp.node):
        xp = xp.permute(0, *range(2, 2 + d), 1).contiguous().permute(0, 1 + d, *range(1, 1 + d)) if CHANNELS_LAST_PATCHES else xp.contiguous()
        win = xp.windows(ks, st, dl)
      cols, w = _patches(win, w, groups)
      return _product_channels_last(cols, w, bias, groups, out)
    win = win.reshape(n, groups, cg, *out, *ks).permute(0, 1, 2, *range(3 + d, 3 + 2 * d), *range(3, 3 + d))  # (N, g, C/g, *k, *out)
    cols, chan = win.reshape(n, groups, cg * prod(ks), prod(out)), win
  kk, p = cols.shape[2:]
  if _image_stem(cg, og): return _product_channels_last(cols, w, bias, groups, out)
  pointwise_cl = cpu and POINTWISE_CHANNELS_LAST and all(k == 1 for k in ks) and all(s == 1 for s in st) and isinstance(og, int) and \
    (og <= WEIGHT_BLOCK and og % BLOCK == 0 or _weight_block(og) > 0)
  if cpu and PRODUCT_CHANNELS_LAST and (_positions_few(p, og) or pointwise_cl and _channels_last_source(x)):
    return _product_channels_last(cols, w, bias, groups, out)
  if isinstance(cg, int) and isinstance(og, int) and isinstance(kk, int) and isinstance(n, int) and isinstance(p, int) and \
     (s := _k_chunks(cg, kk // cg, og) if cpu else _gpu_k_chunks(cg, kk // cg, og, p, n * groups)) > 1:
    # K in chunks of whole input channels, each a product of its own (the chunks the outermost axis: one product after
    # another, each over its panels), then their partials summed
    kc = kk // s
    if (data := w.node.data) is not None: wc = type(w)(np.ascontiguousarray(np.moveaxis(data.reshape(groups, og, s, kc), 2, 0)))
    else: wc = w.reshape(groups, og, s, kc).permute(2, 0, 1, 3).contiguous()
    # the chunks split the channel axis before K is merged: chunk i's channel is i * cg / s + k // taps, affine in i (a
    # merged K reshaped into chunks divided i by the taps, which the CUDA matcher refuses as a batch stride)
    chunks = chan.reshape(n, groups, s, cg // s, *chan.shape[3:]).permute(2, 0, 1, *range(3, chan.ndim + 1)).reshape(s, n, groups, 1, kc, p)
    part = (wc.reshape(s, 1, groups, og, kc, 1) * chunks).sum(4)  # (s, n, g, og, p)
    y = part.contiguous().sum(0).reshape(n, o, *out)
  else: y = (_flat(w, (1, groups, og, kk, 1)) * cols.reshape(n, groups, 1, kk, p)).sum(3, keepdims=True).contiguous().reshape(n, o, *out)
  y = y if bias is None else y + bias.reshape(1, o, *([1] * d))
  if pointwise_cl: _RELAYOUT[y.node] = (cols, w, bias, groups, out)
  return y


def _k_chunks(cg: int, taps: int, og: Dim) -> int:
  """How many chunks of its cg input channels (taps each) an NCHW product sums its K in: 1 where a packed column panel
  (K rows of the register tile's two vectors) stays within half of a core's L2, which each row tile of the product reads
  again: past the L2 it streams from memory every time (FCN's head, a 3x3 conv over 2048 channels: K = 18432, 2.4 MB
  panels, ran at 142 GF/s where its 512-channel 3x3 convs ran at 282); else the fewest chunks, a divisor of cg, whose
  panel fits. Not for a product of one row tile's rows (og < 2 * K_CHUNK_ROWS): its panel is read once anyway."""
  if not SPLIT_K or not isinstance(og, int) or og < 2 * K_CHUNK_ROWS: return 1
  from kiln.codegen.registry import target_of
  if (t := target_of("CPU")) is None: return 1
  row, room = 2 * t.vector_bytes, t.l2_bytes // 2
  if cg * taps * row <= room: return 1
  return next((s for s in range(2, cg + 1) if cg % s == 0 and cg // s * taps * row <= room), 1)


def _gpu_k_chunks(cg: int, taps: int, og: int, cols: int, batches: int) -> int:
  """How many chunks of its cg input channels a GPU's product sums K in: where its smallest tiles (GPU_TILE square) give
  fewer blocks than half the multiprocessors (ResNet-50 at batch 1: a 3x3 conv over 512 channels of a 7x7 map is 8
  blocks on an H200's 132 SMs, K = 4608 long each), as many as fill them, a divisor of cg, each chunk's K at least
  GPU_CHUNK_K; the partials then summed. Unmeasured on a GPU (the emulation proves the sums)."""
  from kiln.codegen.registry import target_of
  if not SPLIT_K: return 1
  try: t = target_of(build_device())
  except DeviceError: return 1  # no runtime for the device here: a graph built for it all the same keeps one K
  if t is None or t.gpu_sms < 1: return 1
  blocks = -(-og // GPU_TILE) * -(-cols // GPU_TILE) * batches
  if 2 * blocks >= t.gpu_sms: return 1
  want = -(-t.gpu_sms // blocks)
  return max((s for s in range(1, min(want, cg) + 1) if cg % s == 0 and cg // s * taps >= GPU_CHUNK_K), default=1)


def _image_stem(cg: Dim, og: Dim) -> bool:
  """Whether a conv of cg input and og output channels per group is an image's stem that runs channels-last: few input
  channels (RGB), output channels in whole blocks. Its (g, N*P, O/g) product's rows are the output positions, tens of
  thousands, each a row of K scalars read from the input in place (the packed operand is the weight, in L1 for the whole
  run); as (N, g, O/g, P) the same product had 32-64 rows, and each panel of positions, gathered `stride` apart, served
  those few rows only. Its output is then channels-last, which a depthwise conv (a mobile net's next layer) and a pool
  (pooled) read in place."""
  return STEM_CHANNELS_LAST and isinstance(cg, int) and cg <= STEM_CHANNELS and isinstance(og, int) and og % BLOCK == 0 and cpu_layouts()


def pooled(x: Tensor, y: Tensor) -> Tensor:
  """A pool's output y (N, C, *out) computed from x's windows, realized channels-last where x reads a channels-last
  buffer (_channels_last_source) of whole blocks of channels: its vector then runs across the channels, each tap one
  contiguous load, where in NCHW each lane of a row was a gather C apart."""
  d = y.ndim - 2
  if not POOL_CHANNELS_LAST or not cpu_layouts() or d < 1 or not isinstance(x.shape[1], int) or x.shape[1] % BLOCK: return y
  if not _channels_last_source(x): return y
  return y.permute(0, *range(2, 2 + d), 1).contiguous().permute(0, 1 + d, *range(1, 1 + d))


def _product_channels_last(cols: Tensor, w: Tensor, bias: Tensor | None, groups: int, out: tuple[Dim, ...]) -> Tensor:
  """The product of a conv over few output positions (a mobile net's last 2x2 and 4x4 maps) as (g, N*P, O/g): the
  output channels are the contiguous axis, so the matmul's vector runs across them, and its rows are every image's
  positions, so the weight streams through once per run, not once per image. In (N, g, O/g, P) the vector was the P
  positions, a quarter of a vector for a 2x2 map. The weight is read as (g, K, O/g), contiguous along O/g (an array
  reordered in numpy). A symbolic batch folds in too (_folds); without FOLD_BATCH the batch is an outer loop, (N, g, P, O/g)."""
  n = cols.shape[0]
  kk, p = sym.static_shape("conv", cols.shape[2:])
  og = sym.static_shape("conv (weight)", w.shape)[0] // groups
  data = w.node.data
  if BLOCKED_WEIGHT and data is not None and (b := _weight_block(og)): return _product_blocked(cols, data, bias, groups, b, out)
  if data is not None: wt = type(w)(np.ascontiguousarray(np.swapaxes(data.reshape(groups, og, kk), 1, 2)))
  else: wt = w.reshape(groups, og, kk).permute(0, 2, 1).contiguous()
  if _folds(n):
    rows = cols.permute(1, 0, 3, 2).reshape(groups, n * p, kk, 1)  # (g, N*P, K, 1)
    y = (wt.reshape(groups, 1, kk, og) * rows).sum(2)  # (g, N*P, O/g)
    if bias is not None: y = y + bias.reshape(groups, 1, og)
    return y.contiguous().reshape(groups, n, p, og).permute(1, 0, 3, 2).reshape(n, groups * og, *out)
  y = (wt.reshape(1, groups, 1, kk, og) * cols.permute(0, 1, 3, 2).reshape(n, groups, p, kk, 1)).sum(3)  # (N, g, P, O/g)
  if bias is not None: y = y + bias.reshape(1, groups, 1, og)
  return y.contiguous().permute(0, 1, 3, 2).reshape(n, groups * og, *out)


def _patches(win: Tensor, w: Tensor, groups: int) -> tuple[Tensor, Tensor]:
  """A conv's windows (N, C, *out, *k) realized as the rows of its channels-last product, (g, N*P, K), K = (*k, C/g): each output
  position's taps with the channels innermost, returned as the product's (N, g, K, P) view with the weight's taps
  reordered to match, (O, *k, C/g). Read through the window view, each step of the product's K (a channel and a tap)
  was a scalar load whose index took a division and a remainder by each kernel size and a bounds test per row of the
  register tile: a 3x3 conv over 3x3 maps ran its product at a third of the speed of a 1x1 conv of the same shape. The
  copy reads each input element once per tap, as few as the output positions are (_positions_few), and pays where
  the product reads each patch more than once (more than WEIGHT_BLOCK output channels a group: a tile per 32)."""
  n, c, *rest = win.shape
  d = len(rest) // 2
  out, ks = rest[:d], sym.static_shape("conv (weight)", w.shape)[2:]
  cg, p, kk = c // groups, prod(out), (c // groups) * prod(ks)
  # realized as (g, N*P, *k[:-1], k[-1] * C/g), read back as the product's own (g, N*P, K), one contiguous reshape: the
  # copy's inner axis is a run of the last tap's channels, contiguous in a channels-last input (realized as (g, N*P, K)
  # each lane's source took a division and a remainder by the channels and kernel sizes: a gather, 7x slower for
  # ConvMixer's 7x7 patches); a realized (g, N, *out, *k, C/g) read as K left those divisions in the product's inner
  # loop for the simplifier to fold (it does not)
  runs = (*ks[:-1], ks[-1] * cg)
  rows = win.reshape(n, groups, cg, *out, *ks).permute(1, 0, *range(3, 3 + 2 * d), 2).reshape(groups, n * p, *runs).contiguous()
  cols = rows.reshape(groups, n, p, kk).permute(1, 0, 3, 2)  # (N, g, K, P), K = (*k, C/g)
  if (data := w.node.data) is not None: return cols, type(w)(np.ascontiguousarray(np.moveaxis(data, 1, -1)))
  return cols, w.permute(0, *range(2, 2 + d), 1)


def _product_blocked(cols: Tensor, data: np.ndarray, bias: Tensor | None, groups: int, block: int, out: tuple[Dim, ...]) -> Tensor:
  """The channels-last product with its weight array stored in blocks of `block` output channels, (g, O/g/block, K,
  block): a register tile's columns stream one contiguous run of the weight along K. Stored (g, K, O/g), a tile read
  `block` channels of each K row, a short run every O/g * 4 bytes: over a 2x2 map the weight is read once per run and
  that stride made it a scattered read from memory, not a stream. The product is computed as (g, O/g/block, N*P, block)
  (_folds), or without FOLD_BATCH as (N, g, O/g/block, P, block), the batch an outer loop."""
  n = cols.shape[0]
  kk, p = sym.static_shape("conv", cols.shape[2:])
  og = data.shape[0] // groups
  ob = og // block
  wb = type(cols)(np.ascontiguousarray(data.reshape(groups, ob, block, kk).transpose(0, 1, 3, 2)))  # (g, OB, K, B)
  if _folds(n):
    rows = cols.permute(1, 0, 3, 2).reshape(groups, 1, n * p, kk, 1)  # (g, 1, N*P, K, 1)
    y = (wb.reshape(groups, ob, 1, kk, block) * rows).sum(3)  # (g, OB, N*P, B)
    if bias is not None: y = y + bias.reshape(groups, ob, 1, block)
    return y.contiguous().reshape(groups, ob, n, p, block).permute(2, 0, 1, 4, 3).reshape(n, groups * og, *out)
  rows = cols.permute(0, 1, 3, 2).reshape(n, groups, 1, p, kk, 1)  # (N, g, 1, P, K, 1)
  y = (wb.reshape(1, groups, ob, 1, kk, block) * rows).sum(4)  # (N, g, OB, P, B)
  if bias is not None: y = y + bias.reshape(1, groups, ob, 1, block)
  return y.contiguous().permute(0, 1, 2, 4, 3).reshape(n, groups * og, *out)


def _folds(n: Dim) -> bool:
  """Whether the batch folds into the product's rows (FOLD_BATCH), a symbolic one too (FOLD_SYMBOLIC_BATCH): its rows N*P
  are then symbolic, whole register tiles the last of which is shifted back or repeats its last row (prepare.peel), so
  the weight streams once a tile, not once an image."""
  return FOLD_BATCH and (isinstance(n, int) or FOLD_SYMBOLIC_BATCH)


def _positions_few(p: Dim, og: Dim) -> bool:
  """Whether a product over p output positions per image, og output channels per group, runs channels-last
  (_product_channels_last): fewer positions than BLOCK; or fewer than CHANNELS_LAST_POSITIONS that are no whole number
  of vectors, where the weight is stored in blocks of output channels (_weight_block). Its tile is then 6-8 rows of
  positions by 32 channels, against 8 channels by one vector of positions, whose last vector runs part empty (49
  positions in 4 vectors of 16). Measured per conv, 1 thread, AVX-512, NCHW -> channels-last: 3x3 over 7x7 maps 0.85x,
  5x5 0.93x, 10x10 0.90x; 1x1 over 10x10 0.83x, 14x14 0.89x (batch 4, 2 threads: 0.84x); 20x20 1.10x. Whole vectors
  gain less than the patches' copies cost: ResNet-18's 3x3 convs over 4x4 maps 1.11x, over 8x8 0.96x before the copies.
  Of 32 output channels or fewer (a DenseNet layer's 3x3 conv) the product reads the window view, not realized patches,
  and ran slower channels-last; of 728 (Xception's 1x1 convs over 4x4 maps) the weight is no whole number of blocks,
  and ran 1.5x slower."""
  if not isinstance(p, int): return False
  return p < BLOCK or (p % BLOCK > 0 and p < CHANNELS_LAST_POSITIONS and isinstance(og, int) and _weight_block(og) > 0)


# a pointwise conv's NCHW product -> what computes it channels-last instead (cols, weight, bias, groups, output dims), for a
# depthwise conv that reads it to ask for (_relaid); weak keys: a graph dropped takes its entries along
_RELAYOUT: weakref.WeakKeyDictionary[Node, tuple] = weakref.WeakKeyDictionary()


def _relaid(x: Tensor, limit: int = 16) -> Tensor | None:
  """x computed from a pointwise conv's channels-last product instead of its NCHW one, where x is that conv's output
  through elementwise ops with constant operands (an activation, a batch norm) and reshapes: the same ops applied to the
  channels-last product read back as NCHW, x's node rewritten in place to read them. None where x is not such a chain
  (a reader of the chain's inner nodes, none in a mobile block, would still read the NCHW product)."""
  path: list[tuple[Node, int]] = []
  n = x.node
  while n not in _RELAYOUT:
    if len(path) >= limit or n.realize or n.op not in ("ALU", "VIEW") or n.op == "VIEW" and n.arg[0] != "reshape": return None
    live = [i for i, m in enumerate(n.src) if not _constant(m)]
    if len(live) != 1: return None
    path.append((n, live[0]))
    n = n.src[live[0]]
  cols, w, bias, groups, out = _RELAYOUT[n]
  node = _product_channels_last(cols, w, bias, groups, out).node
  for m, i in reversed(path):
    node = Node(m.op, tuple(node if j == i else s for j, s in enumerate(m.src)), m.arg, m.shape, m.dtype, origin=m.origin)
  # x's own node becomes a view of the new chain, so every other reader of x (a residual, a concatenation: GhostNet's
  # primary features) reads the channels-last product too, and the NCHW one is never computed beside it
  x.node.op, x.node.src, x.node.arg = "VIEW", (node,), ("reshape", x.node.shape)
  return x


def _constant(n: Node, depth: int = 8) -> bool:
  """Whether n is computed from constants alone (a weight, a scalar, Clip's bound negated): views and elementwise ops of them."""
  if n.op == "BUFFER": return n.data is not None
  if n.op == "CONST": return True
  return depth > 0 and n.op in ("VIEW", "ALU") and all(_constant(m, depth - 1) for m in n.src)


def _channels_last_source(x: Tensor, limit: int = 64) -> bool:
  """Whether x reads realized buffers whose channels are the innermost axis (a channels-last product's, a blocked
  depthwise conv's: each read back as NCHW through a permute), through elementwise ops (an activation, a batch norm, a
  residual add) and views: every path from x to a realized node passes a permute, and some path reaches one. Constant
  operands do not count; an input, an NCHW product or a walk of more than `limit` nodes is no such source."""
  todo, seen, found = [(x.node, False)], set(), False
  while todo:
    n, permuted = todo.pop()
    if (n, permuted) in seen: continue
    seen.add((n, permuted))
    if len(seen) > limit: return False
    if _constant(n): continue
    if n.op == "BUFFER": return False  # a model input: NCHW
    if n.realize or n.op == "REDUCE":
      if not permuted: return False
      found = True
      continue
    if n.op not in ("ALU", "VIEW"): return False
    todo += [(m, permuted or n.op == "VIEW" and n.arg[0] == "permute") for m in n.src]
  return found


def _weight_block(og: int) -> int:
  """The output channels of one block of the channels-last product's weight (0: not blocked): WEIGHT_BLOCK, else one
  64-byte line of float32, whichever divides O/g; O/g of at most WEIGHT_BLOCK is one block already ((g, K, O/g))."""
  return next((b for b in (WEIGHT_BLOCK, 16) if og > WEIGHT_BLOCK and og % b == 0), 0)


def _live_taps(x: Tensor, w: Tensor, pads: list[tuple[int, int]], st: list[int], dl: list[int]) -> tuple[Tensor, list[tuple[int, int]]]:
  """The weight and pads without the kernel taps that read only padding at every output position: they add zeros. A
  kernel larger than its padded map is mostly such taps (a 5x5 depthwise conv over a mobile net's 2x2 maps reads its
  input with 3x3 of them, DeepLabV3's atrous 3x3 convs of dilation 12-36 over 4x4 maps with their centre alone). Along
  each spatial axis the taps that reach the input form one run [lo, hi]; the pads shrink by the taps dropped on each
  side, so the output keeps its size. A run whose pads would go negative is kept whole."""
  ks = sym.static_shape("conv (weight)", w.shape)[2:]
  sp = sym.static_shape("conv", x.shape[2:])
  keep: list[tuple[int, int]] = []
  new_pads: list[tuple[int, int]] = []
  for n, k, (pb, pa), s, q in zip(sp, ks, pads, st, dl):
    out = (n + pb + pa - q * (k - 1) - 1) // s + 1
    live = [t for t in range(k) if t * q - pb <= n - 1 and (out - 1) * s + t * q - pb >= 0]  # reads a row of the input
    lo, hi = (live[0], live[-1]) if live else (0, k - 1)
    if pb - lo * q < 0 or pa - (k - 1 - hi) * q < 0: lo, hi = 0, k - 1
    keep.append((lo, hi + 1))
    new_pads.append((pb - lo * q, pa - (k - 1 - hi) * q))
  if all(b - a == k for (a, b), k in zip(keep, ks)): return w, pads
  sl = (slice(None), slice(None), *(slice(a, b) for a, b in keep))
  if (data := w.node.data) is not None: return type(w)(np.ascontiguousarray(data[sl])), new_pads
  return w[sl], new_pads


def _repeat_channels(x: Tensor, r: int) -> Tensor:
  """x (N, C, *sp) as (N, C*r, *sp), channel c*r + j a view of channel c: a conv with one input channel per group and r
  outputs each (output g*r + j reads input g) is then a depthwise conv, vectorised as one (across channels in the
  blocked layout, along the rows in NCHW). As a product each group was a matrix of one row, K = the taps: no register
  tile, and its vector along the output positions."""
  n, c, *sp = x.shape
  return x.reshape(n, c, 1, *sp).expand(n, c, r, *sp).reshape(n, c * r, *sp)


def _flat(t: Tensor, shape: tuple[Dim, ...]) -> Tensor:
  """t reshaped to shape, read with a flat index: a weight array is reshaped in numpy, anything else realized (the
  reshape's index // and % would otherwise sit in a matmul's inner loop)."""
  if (data := t.node.data) is not None: return type(t)(data.reshape(shape))
  return t.reshape(shape).contiguous()


def _reached(n: Node, through: tuple[str, ...]) -> Iterator[Node]:
  """n and the nodes it reads through ops in `through`, each once; a realized node is reached but not read through."""
  stack, seen = [n], set()
  while stack:
    m = stack.pop()
    if m in seen: continue
    seen.add(m)
    yield m
    if not m.realize and m.op in through: stack.extend(m.src)


def _computes(n: Node) -> bool:
  """Whether n computes anything (an ALU or REDUCE op through views, up to realized nodes) rather than viewing buffers."""
  return any(not m.realize and m.op not in ("VIEW", "BUFFER", "CONST", "IOTA") for m in _reached(n, ("VIEW",)))


def _reduces(n: Node) -> bool:
  """Whether n computes a reduction (through views and elementwise ops, up to realized nodes). Written under a pad's
  bounds test it vectorises poorly: the CNN bench's max pools with the next conv's padding took 0.53 and 0.49 ms as one
  kernel each, 0.26 + 0.20 and 0.18 + 0.19 ms as pool and pad (2-core AVX2, quiet). (With PAD_INLINE the conv reads
  the pool's buffer through its padding, so only the PAD_INLINE = False path still asks.)"""
  return any(m.op == "REDUCE" for m in _reached(n, ("VIEW", "ALU")))


def _window_conv(xp: Tensor, w: Tensor, st: list[int], dl: list[int], groups: int, bias: Tensor | None) -> Tensor:
  """A depthwise conv (one input and one output channel per group) as a product and a sum over each window."""
  d = w.ndim - 2
  win = xp.windows(sym.static_shape("conv (weight)", w.shape)[2:], st, dl)  # (N, C, *out, *k)
  y = (win * w.reshape(1, groups, *[1] * d, *w.shape[2:])).sum(tuple(range(2 + d, 2 + 2 * d)))
  return y if bias is None else y + bias.reshape(1, groups, *([1] * d))


def _positions(x: Tensor, ks: Sequence[int], pads: Sequence[tuple[int, int]], st: Sequence[int], dl: Sequence[int]) -> int:
  """The conv's output positions per image (the product of its output's spatial sizes)."""
  sp = sym.static_shape("conv", x.shape[2:])
  return prod([(n + b + a - q * (k - 1) - 1) // s + 1 for n, k, (b, a), s, q in zip(sp, ks, pads, st, dl)])


def _row(x: Tensor, ks: Sequence[int], pads: Sequence[tuple[int, int]], st: Sequence[int], dl: Sequence[int]) -> int:
  """The width of the conv's output rows (its last spatial axis)."""
  n = sym.static_shape("conv", x.shape[-1:])[0] + pads[-1][0] + pads[-1][1]
  return (n - dl[-1] * (ks[-1] - 1) - 1) // st[-1] + 1


def _padded_copy_pays(sp: Sequence[int], ks: Sequence[int], pads: Sequence[tuple[int, int]], st: Sequence[int], dl: Sequence[int]) -> bool:
  """Whether a blocked depthwise conv copies its input with the padding (ungated taps) rather than reading it in place:
  where its window sum reads at least PADDED_COPY_TAPS taps (output positions x kernel taps) per padded element copied.
  A 5x5 window over 8x8 maps reads 11 per element (its window sum 32 -> 20 us, the copy 6 -> 12 us: 240 channels), a
  stride-2 one 2.8 and a 3x3 over 4x4 maps 4, where the larger copy costs more than the gates it saves. A 3x3 window
  over a 56x56 map reads 8.4, and there the copy (144 channels, batch 2: 370-430 us, memory-bound) cost more than the
  gated window sum saved (350 -> 400 us): MobileNetV2 at 224 px ran 8% faster without its two copies."""
  if not PADDED_COPY_TAPS or not any(b or a for b, a in pads): return False
  padded, taps = 1, 1
  for n, k, (b, a), s, q in zip(sp, ks, pads, st, dl):
    padded *= n + b + a
    taps *= ((n + b + a - q * (k - 1) - 1) // s + 1) * k
  return taps >= PADDED_COPY_TAPS * padded


def _window_conv_blocked(x: Tensor, w: Tensor, pads: Sequence[tuple[int, int]], st: list[int], dl: list[int], bias: Tensor | None) -> Tensor:
  """A depthwise conv in a blocked channel layout (oneDNN's nChw16c): the input realized as (N, C/16, *sp, 16), the window
  sum computed as (N, C/16, *out, 16) and copied back to NCHW. The 16 channels of a block are contiguous, so the codegen's
  vector runs across them: a tap's load is one vector whose pad bounds test is the same for every lane (a masked load,
  not a gate per lane), the weight, stored (C/16, *k, 16), one contiguous vector per tap, and a block's plane stays in
  the L1 cache while its windows slide over it. In NCHW the vector ran along an output row, a few lanes wide on a
  mobile net's small maps (2 to 14), each lane gated. C is padded with zero channels to a multiple of 16. Where the
  window's taps outnumber the padded map's elements enough (_padded_copy_pays), the copy in takes the padding along."""
  d = w.ndim - 2
  ks = sym.static_shape("conv (weight)", w.shape)[2:]
  c = sym.static_shape("conv", x.shape[1:2])[0]
  cb = -(-c // BLOCK)
  sp = x.shape[2:]
  xb = x.pad(((0, 0), (0, cb * BLOCK - c), *[(0, 0)] * d)) if cb * BLOCK != c else x
  xb = xb.reshape(x.shape[0], cb, BLOCK, *sp).permute(0, 1, *range(3, 3 + d), 2)  # (N, CB, *sp, B)
  if _padded_copy_pays(sym.static_shape("conv", sp), ks, pads, st, dl): xb = xb.pad(((0, 0), (0, 0), *pads, (0, 0))).contiguous()
  else: xb = xb.contiguous().pad(((0, 0), (0, 0), *pads, (0, 0)))  # read in place through the pad's bounds test
  win = xb.permute(0, 1, 2 + d, *range(2, 2 + d)).windows(ks, st, dl)  # (N, CB, B, *out, *k)
  win = win.permute(0, 1, *range(3, 3 + d), 2, *range(3 + d, 3 + 2 * d))  # (N, CB, *out, B, *k)
  if (data := w.node.data) is not None:
    wd = np.zeros((cb * BLOCK, *ks), data.dtype)
    wd[:c] = data.reshape(c, *ks)
    wk = type(w)(np.ascontiguousarray(np.moveaxis(wd.reshape(cb, BLOCK, *ks), 1, -1)))  # (CB, *k, B)
  else:
    wp = w.reshape(c, *ks)
    wp = wp.pad(((0, cb * BLOCK - c), *[(0, 0)] * d)) if cb * BLOCK != c else wp
    wk = wp.reshape(cb, BLOCK, *ks).permute(0, *range(2, 2 + d), 1).contiguous()
  wk = wk.permute(0, 1 + d, *range(1, 1 + d))  # (CB, B, *k)
  y = (win * wk.reshape(1, cb, *[1] * d, BLOCK, *ks)).sum(tuple(range(3 + d, 3 + 2 * d)))  # (N, CB, *out, B)
  if bias is not None:
    bb = bias.pad(((0, cb * BLOCK - c),)) if cb * BLOCK != c else bias
    y = y + bb.reshape(1, cb, *[1] * d, BLOCK)
  y = y.contiguous()
  out = y.shape[2:2 + d]
  y = y.permute(0, 1, 2 + d, *range(2, 2 + d)).reshape(x.shape[0], cb * BLOCK, *out)
  return y.slice([0], [c], [1]) if cb * BLOCK != c else y
