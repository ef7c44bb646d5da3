"""The ONNX operators of object detectors: NonMaxSuppression and RoiAlign, registered in onnx_ops.OPS (onnx.py imports this
module for that).

NonMaxSuppression is a *host step*: greedy and sequential (each box is kept or dropped by the boxes kept before it), with
an output as long as what it keeps. onnxruntime's GPU provider runs it on the CPU too. OnnxNode.read_back makes it a value
computed at run time from the boxes and scores (and any threshold computed at run time): the converter cuts the model
before the node, each run reads those arrays back and `select` computes the selection with numpy on the host, exactly
onnxruntime's CPU kernel (non_max_suppression.cc): per batch and class, the boxes whose score is above score_threshold
(all of them without it) taken from a std::priority_queue ordered by score alone (equal scores leave in the order its
libstdc++ heap gives them, emulated here), each kept unless its IoU with a kept box is above iou_threshold (float32,
onnxruntime's arithmetic and tests, corners given in either order), at most max_output_boxes_per_class (0 or absent:
none). The rest of the model is compiled once, at load, for a number of kept boxes that each run binds (a runtime variable
up to batches * classes * min(max_output_boxes_per_class, boxes)), and reads the selection from a slot each run fills
(specialise.py).

RoiAlign (opset 10 and 16, avg and max, sampling_ratio fixed or 0): the rois are data, so each output sample's bilinear
taps are kernel arithmetic, onnxruntime's in its order (roialign.cc: half_pixel shifts by 0.5, output_half_pixel forces
a roi of at least 1x1; a sample more than one pixel outside the map reads 0, one below 0 is clamped, the four corners
weighted), gathered from the input laid out as (N * H * W, C) as GridSample's taps are (onnx_ops_sample.py). avg sums
each bin's samples over its count; max takes the largest weighted corner of each sample, then the largest sample (as
onnxruntime does). With sampling_ratio 0 a roi's grid is ceil(roi size / output size) samples a side: from rois known at
load it is computed then, else the largest grid is read back at run time (the rest compiled per grid size) and each
roi's samples past its own grid are masked out.
"""
from __future__ import annotations

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.indexing import index_dtype, wrapped
from kiln.graph.lazy import ONNXError
from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.onnx_ops_act import _trunc
from kiln.graph.specialise import Length
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

MAX_ROI_GRID = 1024  # samples per bin RoiAlign takes with sampling_ratio 0 (a roi's grid is data): a larger one is refused


# ---- NonMaxSuppression: the host step ----
def _corners(b: np.ndarray, center: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """x min, x max, y min, y max of boxes b (..., 4) in float32, as onnxruntime's SuppressByIOU reads them."""
  if center:
    hw, hh = b[..., 2] / np.float32(2), b[..., 3] / np.float32(2)
    return b[..., 0] - hw, b[..., 0] + hw, b[..., 1] - hh, b[..., 1] + hh
  def maxmin(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    swap = lo >= hi  # MaxMin: lhs >= rhs gives (rhs, lhs)
    return np.where(swap, hi, lo), np.where(swap, lo, hi)
  return (*maxmin(b[..., 1], b[..., 3]), *maxmin(b[..., 0], b[..., 2]))


def _suppressed(kept: np.ndarray, box: np.ndarray, center: bool, iou: np.float32) -> bool:
  """Whether box (4,) overlaps any of the kept boxes (k, 4) by an IoU above iou, onnxruntime's float32 steps."""
  ax0, ax1, ay0, ay1 = _corners(kept, center)
  bx0, bx1, by0, by1 = _corners(box, center)
  ix0, ix1 = np.where(ax0 < bx0, bx0, ax0), np.where(bx1 < ax1, bx1, ax1)  # std::max, std::min
  iy0, iy1 = np.where(ay0 < by0, by0, ay0), np.where(by1 < ay1, by1, ay1)
  with np.errstate(all="ignore"):
    inter = (ix1 - ix0) * (iy1 - iy0)
    a1, a2 = (ax1 - ax0) * (ay1 - ay0), (bx1 - bx0) * (by1 - by0)
    union = a1 + a2 - inter
    ok = (ix1 > ix0) & (iy1 > iy0) & (inter > 0) & (a1 > 0) & (a2 > 0) & (union > 0)
    return bool(np.any(ok & (inter / np.where(ok, union, np.float32(1)) > iou)))


def select(boxes: np.ndarray, scores: np.ndarray, max_out: int, iou: float, score: float | None, center: bool, label: str) -> np.ndarray:
  """NonMaxSuppression's selected_indices (n, 3) as onnxruntime's CPU kernel computes them (see the module's docstring)."""
  if not 0 <= iou <= 1: raise ONNXError(f"{label}: iou_threshold {iou} must be in [0, 1] (as onnxruntime requires)")
  out: list[tuple[int, int, int]] = []
  max_out = max(max_out, 0)
  if max_out == 0: return np.zeros((0, 3), np.int64)
  thr, sc = np.float32(iou), None if score is None else np.float32(score)
  for b in range(boxes.shape[0]):
    for c in range(scores.shape[1]):
      s = scores[b, c]
      cand = np.arange(s.shape[0]) if sc is None else np.flatnonzero(s > sc)
      if np.isnan(s[cand]).any():  # onnxruntime sorts with a comparison NaN breaks: its order is undefined
        raise ONNXError(f"{label}: a score of batch {b}, class {c} is NaN, where onnxruntime's order of the boxes is undefined (not supported)")
      kept: list[int] = []
      for i in cand[np.argsort(-s[cand], kind="stable")].tolist():
        if kept and _suppressed(boxes[b, kept], boxes[b, i], center, thr): continue
        if len(kept) >= max_out: break
        kept.append(i)
        out.append((b, c, i))
  return np.array(out, np.int64).reshape(-1, 3)


def _nms(n: OnnxNode) -> Value:
  center = int(n.attr("center_point_box", 0))
  if center not in (0, 1): raise n.error(f"attribute center_point_box={center} must be 0 or 1")
  boxes, scores = n.ins[0], n.ins[1] if len(n.ins) > 1 else None
  if boxes is None or scores is None: raise n.error("needs boxes and scores")
  if boxes.ndim != 3 or scores.ndim != 3 or boxes.shape[2] != 4 or boxes.shape[0] != scores.shape[0] or boxes.shape[1] != scores.shape[2]:
    raise n.error(f"boxes {sym.fmt_shape(boxes.shape)} and scores {sym.fmt_shape(scores.shape)} must be (batches, boxes, 4) and "
                  "(batches, classes, boxes)")
  if any((v.dtype.np if isinstance(v, Tensor) else v.dtype) != np.float32 for v in (boxes, scores)):
    raise n.error("boxes and scores must be float32 (as onnxruntime's kernel)")
  opts = [n.ins[i] if i < len(n.ins) else None for i in (2, 3, 4)]
  for v, what in zip(opts, ("max_output_boxes_per_class", "iou_threshold", "score_threshold")):
    if v is not None and (v.ndim > 1 or sym.max_numel(v.shape) != 1):
      raise n.error(f"{what} must hold one number, got shape {sym.fmt_shape(v.shape)}")
  label = f"node {n.name} ({n.op})"

  def run(arrays: list[np.ndarray]) -> np.ndarray:
    got = iter(arrays)
    b, s = next(got), next(got)
    o = [None if v is None else (v if isinstance(v, np.ndarray) else next(got)).reshape(-1)[0] for v in opts]
    return select(b, s, 0 if o[0] is None else int(o[0]), 0.0 if o[1] is None else float(o[1]), None if o[2] is None else float(o[2]),
                  bool(center), label)
  ins = [boxes, scores, *[v for v in opts if v is not None]]
  if all(isinstance(v, np.ndarray) for v in ins): return run([v for v in ins[:2] if isinstance(v, np.ndarray)])  # all known at load
  reads = [v if isinstance(v, Tensor) else Tensor(v) for v in (boxes, scores)] + [v for v in opts if isinstance(v, Tensor)]
  nb, nbox, ncls = (sym.dmax(d) for d in (boxes.shape[0], boxes.shape[1], scores.shape[1]))  # symbolic: the host reads this run's
  per_class = nbox if not isinstance(opts[0], np.ndarray) else min(nbox, max(int(opts[0].reshape(-1)[0]), 0))
  return n.read_back("the boxes NonMaxSuppression keeps", reads, run, Length(nb * ncls * per_class, (3,), np.int64))


# ---- RoiAlign ----
def _ceil_div(n: OnnxNode, v: Tensor, d: int) -> Tensor:
  q = v / float(d)
  t = _trunc(q)
  return (t < q).where(t + 1.0, t)


def _grid(n: OnnxNode, rois: Value, size_h: Tensor, size_w: Tensor, oh: int, ow: int, sr: int) -> tuple[int, int]:
  """The largest sample grid (rows, cols) of any roi: sampling_ratio, or ceil(roi size / output size) of the largest roi
  (computed now from constant rois, else read back at run time). A roi whose grid is empty (a size <= 0, half_pixel) is
  refused: onnxruntime then fails (a negative grid) or divides by its count of 0."""
  if sr > 0: return sr, sr
  gh, gw = _ceil_div(n, size_h, oh), _ceil_div(n, size_w, ow)
  both = Tensor.stack([gh.max(), gw.max(), gh.min(), gw.min()], 0)
  g = both.numpy() if isinstance(rois, np.ndarray) else np.asarray(n.read_back("the sample grids of its rois", [both]))
  if not np.all(np.isfinite(g)) or g[2] < 1 or g[3] < 1 or g[0] * g[1] > MAX_ROI_GRID:
    raise n.error(f"its rois' sample grids (sampling_ratio 0: ceil(roi size / output size)) range over {g[2:].tolist()} .. {g[:2].tolist()}: "
                  f"kiln takes grids of at least 1 (onnxruntime fails on less) and at most MAX_ROI_GRID = {MAX_ROI_GRID} samples")
  return int(g[0]), int(g[1])


def _axis_taps(pos: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
  """One axis of each sample, onnxruntime's steps: (outside: more than a pixel off the map, low index, high index, low
  tap's weight, high tap's weight). A position at or past the last pixel puts both taps on it, all weight on the low one."""
  outside = (pos < -1.0) | (pos > float(size))
  p = (pos <= 0.0).where(0.0, pos)  # y <= 0 is 0 (a NaN stays NaN)
  top = p >= float(size - 1)
  p = top.where(float(size - 1), p)
  low_f = _trunc(p)
  lw = p - low_f
  low = low_f.maximum(0.0).minimum(float(size - 1)).cast(dtypes.int32).maximum(0).minimum(size - 1)  # a NaN casts to anything: clamped
  high = top.where(Tensor.full((), size - 1, dtypes.int32), (low + 1).minimum(size - 1))
  return outside, low, high, 1.0 - lw, lw


def _roi_align(n: OnnxNode) -> Value:
  x, rois_v, bi = n.t(0), n.ins[1], n.t(2)
  rois = n.t(1)
  mode = n.attr("mode", "avg")
  if mode not in ("avg", "max"): raise n.error(f"attribute mode={mode!r} is not supported (avg, max)")
  oh, ow, sr = int(n.attr("output_height", 1)), int(n.attr("output_width", 1)), int(n.attr("sampling_ratio", 0))
  scale = float(n.attr("spatial_scale", 1.0))
  ctm = n.attr("coordinate_transformation_mode", "half_pixel") if n.opset >= 16 else "output_half_pixel"
  if ctm not in ("half_pixel", "output_half_pixel"): raise n.error(f"attribute coordinate_transformation_mode={ctm!r} is not supported")
  if oh < 1 or ow < 1 or sr < 0: raise n.error(f"output_height {oh} and output_width {ow} must be >= 1, sampling_ratio {sr} >= 0")
  if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4 or bi.ndim != 1 or bi.shape[0] != rois.shape[0]:
    raise n.error(f"X {sym.fmt_shape(x.shape)}, rois {sym.fmt_shape(rois.shape)} and batch_indices {sym.fmt_shape(bi.shape)} must be "
                  "(N, C, H, W), (num_rois, 4) and (num_rois,)")
  if x.dtype not in (dtypes.float32, dtypes.float64) or rois.dtype != x.dtype:
    raise n.error(f"X and rois must be both float32 or both float64 (as onnxruntime's kernel), got {x.dtype.name} and {rois.dtype.name}")
  if not bi.dtype.is_int: raise n.error(f"batch_indices must be integers, got {bi.dtype.name}")
  nb, c, h, w = sym.static_shape("RoiAlign (input)", x.shape)
  (nr,) = sym.static_shape("RoiAlign (rois)", rois.shape[:1])
  half = ctm == "half_pixel"
  ft = np.dtype(x.dtype.np)
  def coord(i: int) -> Tensor:
    v = rois.slice([i], [i + 1], [1]).reshape(nr, 1, 1, 1, 1) * float(np.float32(scale))  # a float attribute, as onnxruntime holds it
    return v - 0.5 if half else v
  x0, y0, x1, y1 = coord(0), coord(1), coord(2), coord(3)
  rw, rh = x1 - x0, y1 - y0
  if not half: rw, rh = rw.maximum(1.0), rh.maximum(1.0)  # output_half_pixel: a malformed roi is 1x1
  gh, gw = _grid(n, rois_v if rois_v is not None else rois, rh, rw, oh, ow, sr)
  bh, bw = rh / float(oh), rw / float(ow)
  if sr > 0: ch = cw = Tensor.full((), float(sr), x.dtype)
  else: ch, cw = _ceil_div(n, rh, oh), _ceil_div(n, rw, ow)  # this roi's grid (a float: the divisor of onnxruntime's step)
  def along(k: int, g: int, at: int) -> Tensor:
    shape = [1] * 5
    shape[at] = k
    return Tensor(np.arange(k, dtype=ft).reshape(shape)) if g == 0 else Tensor((np.arange(k, dtype=ft) + ft.type(0.5)).reshape(shape))
  yy = (y0 + along(oh, 0, 1) * bh) + along(gh, 1, 3) * bh / ch  # (R, oh, 1, gh, 1)
  xx = (x0 + along(ow, 0, 2) * bw) + along(gw, 1, 4) * bw / cw  # (R, 1, ow, 1, gw)
  out_y, ylo, yhi, hy, ly = _axis_taps(yy, h)
  out_x, xlo, xhi, hx, lx = _axis_taps(xx, w)
  label = f"node {n.name} ({n.op})"
  dt = index_dtype(nb * h * w)
  base = wrapped(bi, nb, f"{label}: batch_indices", dt).reshape(nr, 1, 1, 1, 1) * (h * w)
  table = x.permute(0, 2, 3, 1).reshape(nb * h * w, c)
  outside = out_y | out_x
  zero = Tensor.full((), 0, x.dtype)
  terms = []
  for yi, wy in ((ylo, hy), (yhi, ly)):
    for xi, wx in ((xlo, hx), (xhi, lx)):
      wgt = outside.where(zero, wy * wx)
      row = outside.where(base, base + yi.cast(dt) * w + xi.cast(dt))  # outside: the map's first pixel, weighted 0
      terms.append(wgt.unsqueeze(-1) * table.gather(row, 0, name=label))  # (R, oh, ow, gh, gw, C)
  iy = Tensor(np.arange(gh, dtype=ft).reshape(1, 1, 1, gh, 1, 1))
  ix = Tensor(np.arange(gw, dtype=ft).reshape(1, 1, 1, 1, gw, 1))
  taken = (iy < ch.unsqueeze(-1)) & (ix < cw.unsqueeze(-1))  # a roi's own grid of the largest one
  if mode == "avg":
    s = ((terms[0] + terms[1]) + terms[2]) + terms[3]
    count = ch * cw
    count = count.reshape(nr, 1, 1, 1) if count.ndim else count
    y = taken.where(s, zero).sum((3, 4)) / count
  else:
    m = terms[0].maximum(terms[1]).maximum(terms[2]).maximum(terms[3])
    y = taken.where(m, Tensor.full((), float("-inf"), x.dtype)).max((3, 4))  # every roi has a sample (_grid)
  return y.permute(0, 3, 1, 2)


_op("NonMaxSuppression", _nms, "center_point_box")
_op("RoiAlign", _roi_align, "coordinate_transformation_mode mode output_height output_width sampling_ratio spatial_scale")
