"""The ONNX operators that read an image at computed places, GridSample and Col2Im, registered in onnx_ops.OPS (onnx.py
imports this module for that).

GridSample (opsets 16-22; 2-D and 3-D, as onnxruntime): the grid is data, so where each output reads is known only at run
time. Per spatial axis, the grid's coordinate is denormalised (align_corners) and turned into taps, each an input index and a
weight, with Tensor arithmetic in the grid's float type, onnxruntime's steps in its order (nearest: round half to even;
linear: floor and floor + 1; cubic: floor - 1 .. floor + 2 with Keys' coefficients, a = -0.75). As in onnxruntime, the
padding is applied to each tap, not to the coordinate: zeros reads 0 for a tap outside the input, border clamps the tap,
reflection reflects it about the borders (-0.5 and size - 0.5, or 0 and size - 1 with align_corners) as many times as it
takes. Each axis's taps lie along an axis of their own, so those of all axes
broadcast into one flat row number per tap into the input laid out as (N * spatial, C): one gather, whose rows are
weighted and summed over the tap axes. Every index is clamped into the input before it is read, so a grid of any
value (NaN, inf) never reads outside it.

Col2Im (opset 18): the image of summed blocks. Which block element lands on which pixel depends only on the shapes,
strides, pads and dilations, all known at load: numpy lists, per pixel, the (block element, block) entries that land on
it in onnxruntime's order, and the op is a gather of those entries (a slot past the input reads 0) summed per pixel."""
from __future__ import annotations

import math

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import onnx_limits as lim
from kiln.graph.indexing import index_dtype, slots
from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.onnx_ops_act import _floor, _round, _trunc
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType, dtypes

MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic", "cubic": "cubic"}  # opset 16's names, then 20's
PADDINGS = ("zeros", "border", "reflection")
CUBIC_A = -0.75  # onnxruntime's (and torch's) Keys coefficient for GridSample


# ---- GridSample: one spatial axis's taps ----
class _Axis:
  """One spatial axis of the input: its size L and the borders reflection reflects about, in the grid's float type."""
  def __init__(self, size: int, align: bool, ft: np.dtype):
    self.size = size
    self.lo, self.hi = (ft.type(0), ft.type(size - 1)) if align else (ft.type(-0.5), ft.type(size) - ft.type(0.5))


def _denormalise(g: Tensor, size: int, align: bool) -> Tensor:
  """The grid's normalised [-1, 1] as a position in the input, as onnxruntime computes it."""
  if align: return (g + 1.0) / 2.0 * float(size - 1)
  return ((g + 1.0) * float(size) - 1.0) / 2.0


def _near(s: Tensor) -> Tensor:
  a = CUBIC_A
  return ((s * (a + 2)) - (a + 3)) * s * s + 1.0


def _far(s: Tensor) -> Tensor:
  a = CUBIC_A
  return ((s * a - 5 * a) * s + 8 * a) * s - 4 * a


def _taps(n: OnnxNode, u: Tensor, mode: str, shape: tuple[int, ...], ft: np.dtype) -> tuple[Tensor, Tensor | None]:
  """Position u's taps along a tap axis of its own (shape: 1s, and the tap count where this axis's taps go): each tap's
  whole position, and its weight (None for nearest's one tap of weight 1), onnxruntime's arithmetic."""
  if mode == "nearest": return _round(n, u), None
  f = _floor(n, u)
  k = 2 if mode == "linear" else 4
  def const(v: list[float] | list[bool]) -> Tensor: return Tensor(np.asarray(v, ft if not isinstance(v[0], bool) else np.bool_).reshape(shape))
  if mode == "linear": return f + const([0.0, 1.0]), const([True, False]).where((f + 1.0) - u, u - f)
  t = (u - (f - 1.0)) - 1.0  # onnxruntime's x - x0 - 1, x0 = floor(x) - 1
  dist = t * const([1.0, 1.0, -1.0, -1.0]) + const([1.0, 0.0, 1.0, 2.0])  # x + 1, x, 1 - x, 2 - x: each tap's distance, as Keys' terms take it
  assert k == 4
  return f + const([-1.0, 0.0, 1.0, 2.0]), const([False, True, True, False]).where(_near(dist), _far(dist))


def _reflect(c: Tensor, lo: float, hi: float) -> Tensor:
  """c reflected about lo and hi until it lies between them (onnxruntime's GsReflect): the distance past the near border,
  less whole ranges; an odd count of ranges lands it back from the far border."""
  rng = hi - lo
  below, above = c < lo, c > hi
  dx = below.where(lo - c, c - hi)
  k = _trunc(dx / rng)
  r = dx - k * rng
  even = (_trunc(k * 0.5) * 2.0).eq(k)
  from_lo = (below & even) | (above & even.logical_not())
  return (below | above).where(from_lo.where(r + lo, hi - r), c)


def _index(c: Tensor, ax: _Axis, padding: str, dt: DType) -> tuple[Tensor, Tensor | None]:
  """A tap at whole position c: (its index into the axis, whether it reads the input: None for always)."""
  valid = (c > -1.0) & (c < float(ax.size)) if padding == "zeros" else None
  if padding == "reflection": c = _trunc(_reflect(c, float(ax.lo), float(ax.hi)))
  i = c.maximum(0.0).minimum(float(ax.size - 1)).cast(dt)  # a NaN position casts to anything: clamped again as an integer
  return i.maximum(0).minimum(ax.size - 1), valid


def _grid_sample(n: OnnxNode) -> Value:
  x, grid = n.t(0), n.t(1)
  mode = MODES.get(str(n.attr("mode", "bilinear" if n.opset < 20 else "linear")))
  padding, align = n.attr("padding_mode", "zeros"), bool(n.attr("align_corners", 0))
  if mode is None: raise n.error(f"attribute mode={n.attr('mode')!r} is not supported (linear, nearest, cubic; bilinear, bicubic before opset 20)")
  if padding not in PADDINGS: raise n.error(f"attribute padding_mode={padding!r} is not supported ({', '.join(PADDINGS)})")
  r = x.ndim - 2
  if r not in (2, 3): raise n.error(f"input {sym.fmt_shape(x.shape)} needs 2 or 3 spatial dims (N, C, H, W or N, C, D, H, W), as onnxruntime")
  if grid.ndim != x.ndim or grid.shape[-1] != r or (grid.shape[0] is not x.shape[0] and grid.shape[0] != x.shape[0]):
    raise n.error(f"grid {sym.fmt_shape(grid.shape)} does not fit input {sym.fmt_shape(x.shape)} (it needs N, *output, {r})")
  if mode == "cubic" and r == 3: raise n.error("cubic mode on 3-D input is not supported (onnxruntime has it in 2-D only)")
  if not x.dtype.is_float or not grid.dtype.is_float: raise n.error(f"input and grid must be floats, got {x.dtype.name} and {grid.dtype.name}")
  spatial = sym.static_shape("GridSample (input's spatial dims)", x.shape[2:])
  if padding == "reflection" and align and 1 in spatial:
    raise n.error(f"reflection with align_corners about an axis of size 1 ({spatial}) is undefined (onnxruntime divides by its zero range)")
  ft = grid.dtype if grid.dtype in (dtypes.float32, dtypes.float64) else dtypes.float32
  g = grid.cast(ft) if grid.dtype != ft else grid
  batch, out, c = x.shape[0], tuple(grid.shape[1:-1]), x.shape[1]
  rows = sym.mul(batch, math.prod(spatial))
  dt = index_dtype(sym.dmax(rows))
  k = {"nearest": 1, "linear": 2, "cubic": 4}[mode]
  lead = (1,) * (1 + len(out))
  flat = Tensor.arange(batch, dt).reshape((batch,) + (1,) * (len(out) + r)) * math.prod(spatial)  # each batch's first row
  w: Tensor | None = None
  ok: Tensor | None = None
  for a, size in enumerate(spatial):  # a tap axis per spatial axis, after the output's: (N, *out, k, k[, k])
    ax = _Axis(size, align, np.dtype(ft.np))
    u = _denormalise(g.slice([r - 1 - a], [r - a], [-1]).reshape(*g.shape[:-1], *[1] * r), size, align)  # grid[..., r-1-a]: x is the last axis
    pos, wa = _taps(n, u, mode, lead + tuple(k if j == a else 1 for j in range(r)), np.dtype(ft.np))
    i, valid = _index(pos, ax, padding, dt)
    st = math.prod(spatial[a + 1:])
    flat = flat + (i * st if st != 1 else i)
    if wa is not None: w = wa if w is None else w * wa
    if valid is not None: ok = valid if ok is None else ok & valid
  table = x.permute(0, *range(2, x.ndim), 1).reshape(rows, c)  # (N * spatial, C): one row per pixel
  got = table.gather(flat, 0, name=f"node {n.name} ({n.op})")  # (N, *out, *taps, C)
  if ok is not None: got = ok.unsqueeze(-1).where(got, Tensor.full((), 0, x.dtype))
  taps = tuple(range(1 + len(out), 1 + len(out) + r))
  acc = dtypes.float64 if dtypes.float64 in (x.dtype, ft) else dtypes.float32  # a float64 input keeps its precision beside a float32 grid
  y = got.reshape(*got.shape[:1 + len(out)], c) if w is None else (got.cast(acc) * w.cast(acc).unsqueeze(-1)).sum(taps)
  y = y.permute(0, y.ndim - 1, *range(1, y.ndim - 1))
  return y.cast(x.dtype) if y.dtype != x.dtype else y


# ---- Col2Im ----
def _ints(n: OnnxNode, i: int, what: str) -> list[int]:
  v = n.const(i, what).reshape(-1)
  if v.dtype.kind not in "iu": raise n.error(f"input {i} ({what}) must be integers, got {v.dtype}")
  return [int(d) for d in v]


def _col2im(n: OnnxNode) -> Value:
  x = n.t(0)
  img, blk = _ints(n, 1, "image_shape"), _ints(n, 2, "block_shape")
  r = len(img)
  dil, st = list(n.attr("dilations") or [1] * r), list(n.attr("strides") or [1] * r)
  pads = list(n.attr("pads") or [0] * (2 * r))
  if x.ndim != 3: raise n.error(f"input {sym.fmt_shape(x.shape)} must be (N, C * prod(block_shape), L)")
  if r < 1 or len(blk) != r or len(dil) != r or len(st) != r or len(pads) != 2 * r:
    raise n.error(f"image_shape {img}, block_shape {blk}, dilations {dil}, strides {st} and pads {pads} do not fit one another")
  if min(img + blk + dil + st) < 1 or min(pads) < 0:
    raise n.error(f"image_shape {img}, block_shape {blk}, dilations and strides must be >= 1, pads >= 0")
  ck, length = sym.static_shape("Col2Im (input's blocks)", x.shape[1:])
  k = math.prod(blk)
  if ck % k: raise n.error(f"input's dim 1 ({ck}) is not a multiple of the block's {k} elements ({blk})")
  counts = [(i + pads[a] + pads[a + r] - (d * (b - 1) + 1)) // s + 1 for a, (i, b, d, s) in enumerate(zip(img, blk, dil, st))]
  if min(counts) < 1 or math.prod(counts) != length:
    raise n.error(f"input's {length} blocks do not fit image_shape {img} with block_shape {blk}, dilations {dil}, strides {st}, pads {pads} "
                  f"(that makes {counts} blocks)")
  pixels = math.prod(img)
  lim.limit(f"node {n.name} ({n.op}): the entries of its gather table", k * length, "MAX_FOLDED_ELEMENTS", lim.MAX_FOLDED_ELEMENTS)
  # each (block element, block) entry's pixel, in input order (block element major, as onnxruntime adds them)
  pos = np.zeros((k, length), np.int64)
  inside = np.ones((k, length), np.bool_)
  for a in range(r):
    ka = np.unravel_index(np.arange(k), blk)[a][:, None]
    la = np.unravel_index(np.arange(length), counts)[a][None, :]
    p = la * st[a] + ka * dil[a] - pads[a]
    inside &= (p >= 0) & (p < img[a])
    pos = pos * img[a] + np.clip(p, 0, img[a] - 1)
  entry = np.flatnonzero(inside)
  hit, where = slots(pos.reshape(-1)[entry])  # where[j, h]: the j-th entry (in order) landing on pixel hit[h], or -1
  table = np.full((pixels, max(where.shape[0], 1)), k * length, np.int64)  # k * length: the zero slot past the input
  table[hit] = np.where(where >= 0, entry[np.maximum(where, 0)], k * length).T
  n.budget.folded += table.size * 4
  n.budget.check(f"node {n.name} ({n.op})", n.budget.folded)
  c = ck // k
  flat = x.reshape(x.shape[0], c, k * length).pad(((0, 0), (0, 0), (0, 1)))
  got = flat.gather(Tensor(table.astype(index_dtype(k * length + 1).np)), 2, name=f"node {n.name} ({n.op})")  # (N, C, pixels, slots)
  return got.sum(-1).reshape(x.shape[0], c, *img)


_op("GridSample", _grid_sample, "align_corners mode padding_mode")
_op("Col2Im", _col2im, "dilations pads strides")
