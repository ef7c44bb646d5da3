"""The ONNX operators for Resize in every mode, registered in onnx_ops.OPS (onnx.py imports this module for that).

Resize (opsets 10-19) and Upsample (7-9): nearest (every nearest_mode), linear and cubic (cubic_coeff_a, exclude_outside,
antialias), every coordinate_transformation_mode (tf_crop_and_resize with roi and extrapolation_value), axes and
keep_aspect_ratio_policy. The output's shape must be known when the node converts: scales, sizes and roi are constants
(or values computed at run time, which a run reads back and converts the rest of the model for: specialise.py) and each
resized axis has a fixed size. Each resized axis is then worked out at load, in numpy: for each output position, the input positions
it reads (its taps) and their weights, computed in float32 the way onnxruntime computes them, so that a nearest index or
the edge of the extrapolated region falls where its does (and a nearest coordinate within TIE of a half is a tie, as
onnxruntime rounds it). The op is, one axis after another, a gather of those taps with constant indices
and their weighted sum with constant weights, which kiln fuses; whole-factor nearest is a repeat (a view). As in
onnxruntime, an axis at scale 1 maps onto itself whatever the coordinate mode, and an unchanged shape is the input itself.
An axis left as it is may be symbolic (a batch). antialias on nearest, and exclude_outside on linear without antialias,
change nothing (onnxruntime refuses both)."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import onnx_limits as lim
from kiln.graph import shape_values as sv
from kiln.graph.onnx_ops import OnnxNode, Value, _norm, _op
from kiln.graph.tensor import Tensor
from kiln.ir.kernels import Dim

F32, F64 = np.float32, np.float64
Coord = Callable[[np.ndarray, np.float32, int, int, np.float32, np.float32], np.ndarray]


# ---- coordinate_transformation_mode: output index i (float32) -> input coordinate, given the axis' scale s, output
# length n, input length m and roi (start, end); onnxruntime's float32 arithmetic, its double steps where it has them ----
def _half_pixel_symmetric(i: np.ndarray, s: np.float32, n: int, m: int, r0: np.float32, r1: np.float32) -> np.ndarray:
  offset = F32(m) / F32(2) * (F32(1) - F32(n) / (s * F32(m)))  # the centre kept in place when n is rounded from s * m
  return ((F64(offset) + (i.astype(F64) + 0.5) / F64(s)) - 0.5).astype(F32)


def _crop(i: np.ndarray, s: np.float32, n: int, m: int, r0: np.float32, r1: np.float32) -> np.ndarray:
  if n == 1: return np.full_like(i, F32(0.5 * F64(r0 + r1) * F64(F32(m) - F32(1))))
  return r0 * F32(m - 1) + (i * (r1 - r0) * F32(m - 1)) / F32(n - 1)


COORDS: dict[str, Coord] = {
  "half_pixel": lambda i, s, n, m, r0, r1: (i + F32(0.5)) / s - F32(0.5),
  "half_pixel_symmetric": _half_pixel_symmetric,
  "pytorch_half_pixel": lambda i, s, n, m, r0, r1: (i + F32(0.5)) / s - F32(0.5) if n > 1 else np.zeros_like(i),
  "tf_half_pixel_for_nn": lambda i, s, n, m, r0, r1: (i + F32(0.5)) / s,
  "align_corners": lambda i, s, n, m, r0, r1: np.zeros_like(i) if n == 1 else i * F32(m - 1) / F32(n - 1),
  "asymmetric": lambda i, s, n, m, r0, r1: i / s,
  "tf_crop_and_resize": _crop,
}


# ---- nearest_mode: a coordinate (float32) -> an input index (before the clamp to the axis), and whether it downsamples ----
def _round_away(v: np.ndarray) -> np.ndarray:
  """C's round(): halves away from zero (numpy's round goes to even)."""
  t = np.trunc(v)
  return t + np.sign(v) * (np.abs(v - t) >= F32(0.5))


NEAREST: dict[str, Callable[[np.ndarray, bool], np.ndarray]] = {
  "round_prefer_floor": lambda v, down: np.where(np.trunc(v) + F32(0.5) == v, np.floor(v), _round_away(v)),
  "round_prefer_ceil": lambda v, down: _round_away(v),
  "floor": lambda v, down: np.floor(v),
  "ceil": lambda v, down: np.ceil(v),
  "": lambda v, down: np.ceil(v) if down else np.trunc(v),  # Resize-10 and Upsample, which had no nearest_mode
}


# ---- the antialias filters (Pillow's, as onnxruntime takes them): (support in input pixels at scale 1, filter) ----
def _triangle(x: np.ndarray, a: np.float32) -> np.ndarray:
  x = np.abs(x)
  return np.where(x < F32(1), F32(1) - x, F32(0))


def _keys(x: np.ndarray, a: np.float32) -> np.ndarray:
  x = np.abs(x)
  near = ((a + F32(2)) * x - (a + F32(3))) * x * x + F32(1)
  far = (((x - F32(5)) * x + F32(8)) * x - F32(4)) * a
  return np.where(x < F32(1), near, np.where(x < F32(2), far, F32(0)))


FILTERS: dict[str, tuple[float, Callable[[np.ndarray, np.float32], np.ndarray]]] = {"linear": (2.0, _triangle), "cubic": (4.0, _keys)}
TIE = 1e-6  # how near a half a nearest coordinate is a tie for round_prefer_floor/ceil, as onnxruntime rounds
DENSE_PER_TAP = 4  # an axis of up to this many inputs per tap is resized as a matrix product (_small_axis)
UNROLL = 4  # taps per axis up to which the weighted sum is written out (bilinear: 2, bicubic: 4); more gather and reduce


class Taps(NamedTuple):
  """One resized axis: idx (out, k) input indices in [0, m); w (out, k) their weights, None for one tap of weight 1
  (nearest); outside (out,) where tf_crop_and_resize reads beyond the input (extrapolation_value there), or None."""
  idx: np.ndarray
  w: np.ndarray | None
  outside: np.ndarray | None


class Params(NamedTuple):
  mode: str
  coord: Coord
  nearest: str
  a: np.float32  # cubic_coeff_a
  exclude: bool
  antialias: bool
  extrapolate: bool  # tf_crop_and_resize


def _nearest_taps(p: Params, orig: np.ndarray, m: int, s: np.float32) -> Taps:
  """One tap per output: the input index its nearest_mode rounds the coordinate to, clamped to the axis."""
  outside = (orig < 0) | (orig > F32(m - 1)) if p.extrapolate else None
  if p.nearest.startswith("round"):  # onnxruntime takes a coordinate within 1e-6 of a half for the tie (found by test)
    half = np.floor(orig) + F32(0.5)  # the x.5 of its unit
    orig = np.where(np.abs(orig.astype(F64) - half) <= TIE, half, orig).astype(F32)
  j = NEAREST[p.nearest](np.clip(orig, F32(-2 ** 30), F32(2 ** 30)), bool(s < 1))  # clipped: a far roi cannot overflow int64
  return Taps(np.clip(j.astype(np.int64), 0, m - 1)[:, None], None, outside)


def _linear_taps(p: Params, orig: np.ndarray, m: int, s: np.float32) -> Taps:
  v = np.minimum(np.maximum(orig, F32(0)), F32(m - 1))
  i1 = np.minimum(v.astype(np.int64), m - 1)
  i2 = np.minimum(i1 + 1, m - 1)
  d1, d2 = np.abs(v - i1.astype(F32)), np.abs(v - i2.astype(F32))  # each tap's weight is the other's distance
  same = i1 == i2
  d1[same], d2[same] = F32(0.5), F32(0.5)
  outside = (orig < 0) | (orig > F32(m - 1)) if p.extrapolate else None
  return Taps(np.stack([i1, i2], 1), np.stack([d2, d1], 1).astype(F64), outside)


def _cubic_taps(p: Params, orig: np.ndarray, m: int, s: np.float32) -> Taps:
  """Keys' cubic on the 4 input pixels around each coordinate, clamped to the edge; exclude_outside drops the ones beyond
  the edge instead and renormalises the rest."""
  a, fl = p.a, np.floor(orig)
  t = np.abs(orig - fl)
  u, v, w = t + F32(1), F32(1) - t, F32(2) - t
  c = np.stack([((a * u - F32(5) * a) * u + F32(8) * a) * u - F32(4) * a,
                ((a + F32(2)) * t - (a + F32(3))) * t * t + F32(1),
                ((a + F32(2)) * v - (a + F32(3))) * v * v + F32(1),
                ((a * w - F32(5) * a) * w + F32(8) * a) * w - F32(4) * a], 1)
  taps = np.clip(fl, -2 ** 30, 2 ** 30).astype(np.int64)[:, None] + np.arange(-1, 3)
  if p.exclude:
    c = np.where((taps >= 0) & (taps < m), c, F32(0))
    total = c.sum(1, keepdims=True)
    c = c / np.where(total == 0, F32(1), total)  # no tap inside: only where tf_crop_and_resize extrapolates anyway
  outside = (orig < 0) | (orig > F32(m - 1)) if p.extrapolate else None
  return Taps(np.clip(taps, 0, m - 1), c.astype(F64), outside)


def _antialias_taps(p: Params, i: np.ndarray, m: int, s: np.float32, roi: tuple[np.float32, np.float32]) -> Taps:
  """A downscale filtered as Pillow does (onnxruntime's antialias): the filter is stretched by 1/s, so that every input
  pixel under it contributes; the weights are normalised to sum to 1, and taps past the edge read the edge pixel (or,
  with exclude_outside, are dropped)."""
  size, filt = FILTERS[p.mode]
  inv_s = F32(1) / s
  support = F32(size * 0.5) * inv_s if inv_s >= 1 else F32(size * 0.5)
  stretch = F32(1) / inv_s if inv_s >= 1 else F32(1)
  orig = i if inv_s == 1 else p.coord(i, s, len(i), m, *roi)
  centre = F32(0.5) + orig
  lo = np.floor(np.clip((centre - support).astype(F64) + 0.5, -2 ** 30, 2 ** 30)).astype(np.int64)
  hi = np.floor(np.clip((centre + support).astype(F64) + 0.5, -2 ** 30, 2 ** 30)).astype(np.int64)
  if p.exclude: lo, hi = np.maximum(lo, 0), np.minimum(hi, m)
  k = max(int((hi - lo).max()), 1)
  taps = lo[:, None] + np.arange(k)
  w = np.where(taps < hi[:, None], filt((taps.astype(F32) - centre[:, None] + F32(0.5)) * stretch, p.a), F32(0))
  total = w.sum(1, keepdims=True, dtype=F32)
  w = np.where((total != 0) & (total != 1), w / np.where(total == 0, F32(1), total), w)
  outside = (orig < 0) | (orig > F32(m - 1)) if p.extrapolate else None
  return Taps(np.clip(taps, 0, m - 1), w.astype(F64), outside)


TAPS: dict[str, Callable[[Params, np.ndarray, int, np.float32], Taps]] = {"nearest": _nearest_taps, "linear": _linear_taps, "cubic": _cubic_taps}


def axis_taps(p: Params, n: int, m: int, s: np.float32, roi: tuple[np.float32, np.float32], what: str) -> Taps:
  """The taps of an axis of m resized to n at scale s (not 1), their tables held to MAX_FOLDED_ELEMENTS."""
  k = {"nearest": 1, "linear": 2, "cubic": 4}[p.mode]
  if p.antialias and p.mode != "nearest": k = int(np.ceil(FILTERS[p.mode][0] * 0.5 * max(1 / float(s), 1.0))) * 2 + 2
  lim.limit(f"{what}: the taps of a resized axis ({n} outputs, {k} taps each)", n * k, "MAX_FOLDED_ELEMENTS", lim.MAX_FOLDED_ELEMENTS)
  i = np.arange(n, dtype=F32)
  if p.antialias and p.mode != "nearest": return _antialias_taps(p, i, m, s, roi)
  return TAPS[p.mode](p, p.coord(i, s, n, m, *roi), m, s)


# ---- applying the taps to a Tensor ----
def _repeat(x: Tensor, a: int, r: int) -> Tensor:
  """Each element of axis a r times in a row: a new axis of r copies after it, expanded, and the two merged (a view)."""
  u = x.unsqueeze(a + 1)
  u = u.expand(tuple(r if j == a + 1 else d for j, d in enumerate(u.shape)))
  return u.reshape(tuple(x.shape[:a]) + (x.shape[a] * r,) + tuple(x.shape[a + 1:]))  # type: ignore[operator]


def _pick(x: Tensor, a: int, col: np.ndarray, name: str) -> Tensor:
  """x[..., col, ...] along axis a: nothing for the identity, a repeat (a view) for whole-factor nearest, else a gather."""
  m, n = x.shape[a], len(col)
  assert isinstance(m, int)
  if n == m and (col == np.arange(m)).all(): return x
  if n % m == 0 and (col == np.arange(n) // (n // m)).all(): return _repeat(x, a, n // m)
  return x.gather(Tensor(col.astype(np.int32)), a, name=name)


def _dense(idx: np.ndarray, w: np.ndarray, m: int) -> np.ndarray:
  """The (out, m) matrix that taps idx with weights w make (a tap read twice adds its weights)."""
  d = np.zeros((idx.shape[0], m))
  np.add.at(d, (np.arange(idx.shape[0])[:, None], idx), w)
  return d


def _periodic(x: Tensor, a: int, idx: np.ndarray, w: np.ndarray) -> Tensor | None:
  """An axis grown by a whole factor r whose taps repeat every r outputs, shifted by one input each time (bilinear at
  scale 2, 4, ... under half_pixel, pytorch_half_pixel, asymmetric): output r*i + p is a fixed weighted sum of inputs
  i + c[p, j], clamped to the axis. That is r weighted sums of shifted slices of the edge-extended input, interleaved:
  views and arithmetic, no index table read per element. None where the taps are not of that form (to rounding). An edge
  output reads only the inputs its weights use, where onnxruntime also reads a neighbour at weight 0 (differs for inf/NaN only)."""
  m, (n, k) = x.shape[a], idx.shape
  if not isinstance(m, int) or n % m or n == m or m < 2: return None
  r, mid = n // m, m // 2
  c, wp = idx[r * mid:r * mid + r] - mid, w[r * mid:r * mid + r]  # each phase's offsets and weights, read off the middle
  i = np.repeat(np.arange(m), r)
  want = _dense(np.clip(i[:, None] + np.tile(c, (m, 1)), 0, m - 1), np.tile(wp, (m, 1)), m)
  if np.abs(want - _dense(idx, w, m)).max() > 4 * np.finfo(F32).eps: return None
  lo, hi = max(0, -int(c.min())), max(0, int(c.max()))
  edge = [x.slice([0], [1], [a]).expand(*(lo if j == a else d for j, d in enumerate(x.shape)))] if lo else []
  edge_hi = [x.slice([m - 1], [m], [a]).expand(*(hi if j == a else d for j, d in enumerate(x.shape)))] if hi else []
  xp = Tensor.cat([*edge, x, *edge_hi], a)
  phases = []
  for p in range(r):
    y = xp.slice([lo + int(c[p, 0])], [lo + int(c[p, 0]) + m], [a]) * float(F32(wp[p, 0]))
    for j in range(1, k): y = y + xp.slice([lo + int(c[p, j])], [lo + int(c[p, j]) + m], [a]) * float(F32(wp[p, j]))
    phases.append(y)
  out = Tensor.stack(phases, a + 1)
  return out.reshape(tuple(x.shape[:a]) + (n,) + tuple(x.shape[a + 1:]))


def _small_axis(x: Tensor, a: int, idx: np.ndarray, w: np.ndarray) -> Tensor | None:
  """A short axis (at most DENSE_PER_TAP inputs per tap) resized as a product with the (out, m) matrix of the taps: m
  multiply-adds per output, contiguous and vectorised, in place of a gather of each tap through an index table. The
  entries off the taps are selected away, not multiplied by 0, so an inf or NaN reaches only the outputs whose taps read it."""
  m, (n, k) = x.shape[a], idx.shape
  if not isinstance(m, int) or m < 2 or m > DENSE_PER_TAP * k: return None  # one input: a view already (_pick)
  tail = (1,) * (x.ndim - a - 1)
  read = _dense(idx, np.ones_like(w), m).reshape((n, m) + tail) != 0
  d = _dense(idx, w, m).astype(F32).reshape((n, m) + tail)
  return Tensor(read).where(x.unsqueeze(a) * Tensor(d), 0.0).sum(a + 1)


def apply_taps(x: Tensor, a: int, t: Taps, name: str) -> Tensor:
  if t.w is None: return _pick(x, a, t.idx[:, 0], name)
  used = np.abs(t.w).sum(0) != 0  # a tap of weight 0 everywhere is left out
  idx, w = t.idx[:, used], t.w[:, used]
  if idx.shape[1] == 0: idx, w = t.idx[:, :1], t.w[:, :1]
  n, k = idx.shape
  if k == 1 and (w == 1).all(): return _pick(x, a, idx[:, 0], name)
  tail = (1,) * (x.ndim - a - 1)
  for way in (_periodic, _small_axis):  # without a gather where the taps allow
    if (fast := way(x, a, idx, w)) is not None: return fast
  if k > UNROLL:  # a wide antialias filter: one gather of every tap and a sum over them
    g = x.gather(Tensor(idx.astype(np.int32)), a, name=name)
    return (g * Tensor(w.astype(F32).reshape((n, k) + tail))).sum(a + 1)
  y: Tensor | None = None
  for j in range(k):
    part = _pick(x, a, idx[:, j], name) * Tensor(w[:, j].astype(F32).reshape((n,) + tail))
    y = part if y is None else y + part
  assert y is not None
  return y


# ---- the node: attributes, scales or sizes, roi ----
def _params(n: OnnxNode) -> Params:
  mode = n.attr("mode", "nearest")
  if mode not in ("nearest", "linear", "cubic"): raise n.error(f"attribute mode={mode!r} is not supported (nearest, linear, cubic)")
  if n.opset >= 11:
    ctm, near = n.attr("coordinate_transformation_mode", "half_pixel"), n.attr("nearest_mode", "round_prefer_floor")
  else: ctm, near = "asymmetric", ""  # Resize-10 and Upsample had only these
  if ctm not in COORDS: raise n.error(f"attribute coordinate_transformation_mode={ctm!r} is not supported ({', '.join(COORDS)})")
  if near not in NEAREST: raise n.error(f"attribute nearest_mode={near!r} is not supported ({', '.join(k for k in NEAREST if k)})")
  a = F32(n.attr("cubic_coeff_a", -0.75))
  if not np.isfinite(a): raise n.error(f"attribute cubic_coeff_a={a} is not finite")
  antialias = bool(n.attr("antialias", 0)) if n.opset >= 18 else False
  return Params(mode, COORDS[ctm], near, a, bool(n.attr("exclude_outside", 0)), antialias, ctm == "tf_crop_and_resize")


def _known(n: OnnxNode, i: int, what: str) -> np.ndarray | None:
  """Input i, a constant, flat; None where it is omitted or empty. One computed at run time is read back by a run, which
  converts the rest of the model for its value (OnnxNode.const: specialise.py)."""
  v = n.opt_const(i, what)
  if v is None: return None
  return v.reshape(-1) if v.size else None


def _axes(n: OnnxNode, rank: int) -> list[int]:
  axes = n.attr("axes") if n.opset >= 18 else None
  if not axes: return list(range(rank))
  out = [_norm(int(a), rank, n) for a in axes]
  if len(set(out)) != len(out): raise n.error(f"attribute axes={list(axes)} names an axis twice")
  return out


def _out_sizes(n: OnnxNode, x: Tensor, axes: list[int]) -> tuple[list[Dim], list[np.float32]]:
  """The output length and the scale of each axis in axes, as onnxruntime works them out in float32."""
  if n.opset < 9: scales = None if n.attr("scales") is None else np.asarray(n.attr("scales"), F32).reshape(-1)
  else: scales = _known(n, 1 if n.opset < 11 else 2, "scales")
  sizes = _known(n, 3, "sizes") if n.opset >= 11 else None
  if scales is not None and sizes is not None: raise n.error("both scales and sizes are given (one of them, the other empty or omitted)")
  if scales is not None: return _from_scales(n, x, axes, scales)
  if sizes is None: raise n.error("needs scales or sizes")
  return _from_sizes(n, x, axes, sizes)


def _from_scales(n: OnnxNode, x: Tensor, axes: list[int], scales: np.ndarray) -> tuple[list[Dim], list[np.float32]]:
  """Each length floor(scale * length) in float32; an axis at scale 1 stays as it is (it may be symbolic)."""
  if len(scales) != len(axes): raise n.error(f"{len(scales)} scales for {len(axes)} axes of {x.shape}")
  sc = [F32(v) for v in scales]
  if not all(np.isfinite(v) and v > 0 for v in sc) or (n.opset < 10 and any(v < 1 for v in sc)):
    raise n.error(f"scales {scales.tolist()} must be finite and > 0{' (>= 1 for Upsample)' if n.opset < 10 else ''}")
  outs: list[Dim] = []
  for a, s in zip(axes, sc):
    if s == 1: outs.append(x.shape[a]); continue
    with np.errstate(over="ignore"): grown = s * F32(_length(n, x, a))
    if not np.isfinite(grown) or grown >= 2 ** 62: raise n.error(f"scales {scales.tolist()} overflow the output's size")
    outs.append(int(grown))
  return outs, sc


def _from_sizes(n: OnnxNode, x: Tensor, axes: list[int], sizes: np.ndarray) -> tuple[list[Dim], list[np.float32]]:
  """The lengths given, their scales out / in in float32; keep_aspect_ratio_policy takes one scale for all and rounds."""
  if len(sizes) != len(axes): raise n.error(f"{len(sizes)} sizes for {len(axes)} axes of {x.shape}")
  if sizes.dtype == object: return _symbolic_sizes(n, x, axes, sizes)
  if sizes.dtype.kind not in "iu" or (sizes < 1).any(): raise n.error(f"sizes {sizes.tolist()} must be integers >= 1")
  ms = [_length(n, x, a) for a in axes]
  outs = [int(v) for v in sizes]
  sc = [F32(o) / F32(m) for o, m in zip(outs, ms)]
  policy = n.attr("keep_aspect_ratio_policy", "stretch") if n.opset >= 18 else "stretch"
  if policy not in ("stretch", "not_larger", "not_smaller"):
    raise n.error(f"attribute keep_aspect_ratio_policy={policy!r} is not supported (stretch, not_larger, not_smaller)")
  if policy != "stretch":  # the smallest (or largest) scale for every axis, each length rounded from it
    s = min(sc) if policy == "not_larger" else max(sc)
    sc, outs = [s] * len(sc), [int(_round_away(np.asarray(s * F32(m)))) for m in ms]
  return list(outs), sc


def _symbolic_sizes(n: OnnxNode, x: Tensor, axes: list[int], sizes: np.ndarray) -> tuple[list[Dim], list[np.float32]]:
  """sizes read off a Shape with symbolic dims (torch's interpolate to (batch, C, H, W)): a symbolic size must be the
  input's own dim on that axis, which is then not resized; the fixed sizes resize fixed axes as usual."""
  if (n.attr("keep_aspect_ratio_policy", "stretch") if n.opset >= 18 else "stretch") != "stretch":
    raise n.error(f"keep_aspect_ratio_policy with sizes holding the symbolic dims of a Shape ({sv.fmt_value(sizes)}) is not supported")
  outs: list[Dim] = []
  for a, v in zip(axes, sizes):
    d = sv.dim(v)
    if isinstance(d, int): outs.append(_from_sizes(n, x, [a], np.asarray([d], np.int64))[0][0])
    elif sv.same(d, x.shape[a]): outs.append(x.shape[a])
    else: raise n.error(f"sizes ({sv.fmt_value(sizes)}) give axis {a} of {sym.fmt_shape(x.shape)} the symbolic size {sym.fmt(d)}: a symbolic "
                        "size must be the input's own dim there (an axis left as it is)")
  return outs, [F32(1) if not isinstance(o, int) else F32(o) / F32(_length(n, x, a)) for a, o in zip(axes, outs)]


def _length(n: OnnxNode, x: Tensor, a: int) -> int:
  d = x.shape[a]
  if not isinstance(d, int): raise n.error(f"axis {a} of {x.shape} is symbolic ({sym.fmt(d)}): Resize needs a fixed size on an axis it resizes")
  return d


def _roi(n: OnnxNode, p: Params, rank: int, axes: list[int]) -> list[tuple[np.float32, np.float32]]:
  """(start, end) of each axis: tf_crop_and_resize's roi input (for axes only, from opset 18), else the whole axis."""
  full = [(F32(0), F32(1))] * rank
  if not p.extrapolate or n.opset < 11: return full
  r = _known(n, 1, "roi")
  if r is None: return full
  r = r.astype(F32)
  if len(r) != 2 * len(axes): raise n.error(f"roi has {len(r)} values for {len(axes)} axes (a start for each, then an end for each)")
  if not np.isfinite(r).all(): raise n.error(f"roi {r.tolist()} is not finite")
  for j, a in enumerate(axes): full[a] = (r[j], r[len(axes) + j])
  return full


def _resize(n: OnnxNode) -> Value:
  x = n.t(0)
  if x.ndim == 0: raise n.error("input is a scalar: Resize needs at least one axis")
  p = _params(n)
  axes = _axes(n, x.ndim)
  outs, scales = _out_sizes(n, x, axes)
  if any(isinstance(o, int) and o < 1 for o in outs): raise n.error(f"output sizes {outs} for {x.shape} hold an empty axis (not supported)")
  shape = list(x.shape)
  for a, o in zip(axes, outs): shape[a] = o
  lim.check_shape(f"node {n.name} ({n.op}): output", [d if isinstance(d, int) else getattr(d, "vmax", 1) for d in shape], x.dtype.itemsize)
  if shape == list(x.shape): return x  # as onnxruntime: an unchanged shape is the input itself, whatever the mode
  if p.mode != "nearest" and not x.dtype.is_float:
    raise n.error(f"mode {p.mode!r} on {x.dtype.name} data is not supported (float data only)")
  roi = _roi(n, p, x.ndim, axes)
  full = [F32(1)] * x.ndim
  for a, s in zip(axes, scales): full[a] = s
  nhwc = x.ndim == 4 and full[1] != 1 and full[0] == full[3] == 1  # onnxruntime's test for N, H, W, C
  if p.mode == "cubic" and nhwc and min(full) >= 1:
    p = p._replace(antialias=True)  # onnxruntime upscales NHWC cubic with its antialias code (its edges differ slightly)
  src, y = x.dtype, x.float() if p.mode != "nearest" else x
  outside: np.ndarray | None = None
  for a, o, s in zip(axes, outs, scales):
    if s == 1: continue  # onnxruntime maps an axis at scale 1 onto itself, whatever the coordinate mode
    m = _length(n, x, a)
    assert isinstance(o, int)
    t = axis_taps(p, o, m, s, roi[a], f"node {n.name} ({n.op})")
    if not (p.antialias and p.mode != "nearest" and o == m):  # onnxruntime's antialias code leaves such an axis as it is
      y = apply_taps(y, a, t, f"node {n.name} ({n.op})")  # (but for where tf_crop_and_resize extrapolates)
    if t.outside is not None and t.outside.any():
      here = t.outside.reshape((o,) + (1,) * (x.ndim - a - 1))
      outside = here if outside is None else outside | here
  if outside is not None:
    if p.antialias and p.mode != "nearest" and nhwc and x.shape[3] != 1:
      raise n.error("tf_crop_and_resize extrapolating N, H, W, C data of more than one channel with antialias (or NHWC cubic) is not "
                    "supported: onnxruntime fills only part of the extrapolated pixels there")
    e = n.attr("extrapolation_value", 0.0)
    mask = np.ascontiguousarray(outside.reshape((1,) * (x.ndim - outside.ndim) + outside.shape))
    y = Tensor(mask).where(Tensor.full((), float(np.float32(e)), y.dtype), y)
  return y.cast(src) if y.dtype != src else y


_op("Resize", _resize, "antialias axes coordinate_transformation_mode cubic_coeff_a exclude_outside extrapolation_value "
    "keep_aspect_ratio_policy mode nearest_mode")
_op("Upsample", _resize, "mode scales")
