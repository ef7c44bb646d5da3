"""The ONNX operators for ConvTranspose and LRN, registered in onnx_ops.OPS (onnx.py imports this module for that).

ConvTranspose as phase sub-convolutions: no multiply by a stuffed zero. Along one spatial axis (stride s, dilation d,
kernel k, output cropped by pb at the start), input i and tap t reach output o = i*s + t*d - pb, so an output phase
ro = o mod s reads only the taps with t*d = ro + pb (mod s), and reads them as a stride-1 convolution of the input:

| output phase ro    | r = (ro + pb) mod s, c = (ro + pb) // s                                                     |
| its taps           | t_0 < ... < t_J-1 with t*d = r (mod s): every s/gcd(s, d)-th tap, e_j = (t_j*d - r)/s apart by d/gcd(s, d) |
| as a convolution   | y[ro + s*q] = sum_j x[q + lo + j*d'] w[t_J-1-j], lo = c - e_J-1, d' = d/gcd(s, d) (the taps flipped)      |

Neighbouring phases with the same window (lo, J) become one convolution whose output channels are (channel, phase): a
kernel that is a multiple of the stride (U-Net's 2x2 at stride 2, FCN's 64x64 at stride 32) needs at most two per axis,
so a few products, not s**D of them, and each piece is kiln's ordinary conv (matmul options, Winograd for 3x3 at stride 1).
The pieces (one per box of runs across the axes) land in the output as views: (channel, phase, q) permuted to
(q, phase), padded over the phases another piece computes, merged to o = q*s + phase and cropped; the pieces are summed
and the bias added. Zero-stuffing the input instead would multiply s**D - 1 zeros for every product that counts.

Weights are rearranged per piece: in numpy at load for a weight array, else as a gather of the weight tensor each run.
Sizes follow onnxruntime: output_shape gives the pads (its total split with the smaller half first for SAME_UPPER, last
otherwise, explicit pads ignored), auto_pad SAME_* aims for input * stride, and a shape onnxruntime would refuse as
inconsistent with the input (output_padding >= stride, an output_shape past the last input's reach) is refused here."""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.power import power
from kiln.graph.tensor import Tensor

MAX_PIECES = 256  # sub-convolutions one ConvTranspose may become (each is a kernel to build and compile)
LRN_SHIFTED_SUM = 16  # LRN windows up to this many channels are summed as shifted views (a chain of adds), wider ones pooled


class _Run(NamedTuple):
  """Output phases a..b-1 of one axis that read the same input window: from lo, J taps d' apart; idx[p, j] the weight tap
  phase a + p multiplies at window element j."""
  a: int
  b: int
  lo: int
  dl: int
  idx: np.ndarray


def _axis_runs(s: int, d: int, k: int, pb: int, out: int) -> list[_Run]:
  taps: dict[int, list[int]] = {}
  for t in range(k):  # tap t lands in output phase (t*d - pb) mod s: the loop is over taps, never over a huge stride
    ro = (t * d - pb) % s
    if ro < out: taps.setdefault(ro, []).append(t)
  dl = d // math.gcd(d, s)
  groups: list[tuple[int, int, int, list[list[int]]]] = []  # (a, b, lo, taps per phase)
  for ro in sorted(taps):
    ts = taps[ro]
    r, c = (ro + pb) % s, (ro + pb) // s
    lo = c - (ts[-1] * d - r) // s
    if groups and groups[-1][1] == ro and groups[-1][2] == lo and len(groups[-1][3][0]) == len(ts):
      a, _, _, phases = groups[-1]
      groups[-1] = (a, ro + 1, lo, phases + [ts])
    else: groups.append((ro, ro + 1, lo, [ts]))
  return [_Run(a, b, lo, dl, np.array([t[::-1] for t in phases], np.int64)) for a, b, lo, phases in groups]


def _geometry(n: OnnxNode, size: int, s: int, d: int, k: int, adj: int, pads: tuple[int, int], want: int | None, auto: str) -> tuple[int, int]:
  """(pb, out) of one spatial axis, as onnxruntime computes them."""
  eff = (k - 1) * d + 1
  full = s * (size - 1) + adj + eff
  if want is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
    total = max(full - (want if want is not None else size * s), 0)
    pb = total // 2 if auto == "SAME_UPPER" else total - total // 2
    out = want if want is not None else full - total
  else:
    pb, total = pads
    total += pb
    out = full - total
  if out < 1: raise n.error(f"the output would have {out} elements along a spatial axis of input size {size} (pads too large)")
  if (out + total - eff) // s + 1 != size:
    raise n.error(f"an output size of {out} along a spatial axis is inconsistent with the input's {size} (stride {s}, kernel {k}, "
                  f"dilation {d}, output_padding {adj}); onnxruntime refuses it too")
  return pb, out


def _ints(n: OnnxNode, name: str, count: int, default: int, least: int) -> list[int]:
  v = n.attr(name)
  v = [default] * count if v is None else [int(x) for x in v]
  if len(v) != count or any(x < least for x in v): raise n.error(f"attribute {name}={v} needs {count} values, each at least {least}")
  return v


def _piece_weight(w: Value, shape: tuple[int, ...], g: int, runs: tuple[_Run, ...]) -> Tensor:
  """The weight (C, M/g, *k) = shape as one piece's conv weight (g * M/g * phases, C/g, *J): out channels (group, m, *phase)."""
  c, mg, ks, d = shape[0], shape[1], shape[2:], len(runs)
  order = (0, 2, *(3 + 2 * i for i in range(d)), 1, *(4 + 2 * i for i in range(d)))
  flat = (-1, c // g, *(r.idx.shape[1] for r in runs))
  if isinstance(w, np.ndarray):
    v = w.reshape(g, c // g, mg, *ks)
    for i, r in enumerate(runs): v = np.take(v, r.idx, axis=3 + 2 * i)  # the axis of k becomes (phase, tap)
    return Tensor(np.ascontiguousarray(v.transpose(order).reshape(flat)))
  t = w.reshape(g, c // g, mg, *ks)
  for i, r in enumerate(runs): t = t.gather(Tensor(r.idx), 3 + 2 * i)
  return t.permute(order).reshape(flat)


def _interleave(y: Tensor, m: int, runs: tuple[_Run, ...], s: list[int], out: list[int]) -> Tensor:
  """A piece's output (N, m * phases, *q) placed at o = q*s + phase: a view, zeros at the phases it does not compute."""
  d, q = len(runs), list(sym.static_shape("ConvTranspose", y.shape[2:]))
  y = y.reshape(y.shape[0], m, *(r.b - r.a for r in runs), *q).permute(0, 1, *(a for i in range(d) for a in (2 + d + i, 2 + i)))
  span = [st if qq > 1 else o for st, qq, o in zip(s, q, out)]  # one q: the phases are the output itself (a huge stride stays out)
  y = y.pad(((0, 0), (0, 0), *(p for r, sp in zip(runs, span) for p in ((0, 0), (r.a, sp - r.b)))))
  y = y.reshape(y.shape[0], m, *(qq * sp for qq, sp in zip(q, span)))
  return y[(slice(None), slice(None), *(slice(0, o) for o in out))]


def _conv_transpose(n: OnnxNode) -> Value:
  x, w = n.t(0), n.ins[1]
  if w is None: raise n.error("input 1 (the weight) is missing")
  if not x.dtype.is_float: raise n.error(f"needs a float input, got {x.dtype.name}")
  if (wt := n.t(1).dtype) != x.dtype: raise n.error(f"the input ({x.dtype.name}) and the weight ({wt.name}) have different dtypes")
  if x.ndim < 3 or w.ndim != x.ndim: raise n.error(f"input {sym.fmt_shape(x.shape)} and weight {tuple(w.shape)} need the same rank, at least 3")
  d = x.ndim - 2
  sizes = sym.static_shape("ConvTranspose (input)", x.shape[1:])
  ks = tuple(int(v) for v in sym.static_shape("ConvTranspose (weight)", w.shape))
  c, mg, k = ks[0], ks[1], list(ks[2:])
  g = int(n.attr("group", 1))
  if g < 1 or c != sizes[0] or c % g: raise n.error(f"input channels {sizes[0]}, weight {ks} and group={g} do not fit (weight: C x M/group x kernel)")
  if (kshape := n.attr("kernel_shape")) is not None and list(kshape) != k: raise n.error(f"kernel_shape {kshape} differs from the weight's {k}")
  st, dl = _ints(n, "strides", d, 1, 1), _ints(n, "dilations", d, 1, 1)
  pads, adj = _ints(n, "pads", 2 * d, 0, 0), _ints(n, "output_padding", d, 0, 0)
  want = None if n.attr("output_shape") is None else _ints(n, "output_shape", d, 1, 1)
  if bad := [i for i in range(d) if adj[i] >= max(st[i], dl[i])]:
    raise n.error(f"output_padding {adj} must be below max(stride, dilation) (axis {bad[0]})")
  auto = n.attr("auto_pad", "NOTSET")
  if auto not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"): raise n.error(f"attribute auto_pad={auto!r} is not supported")
  if auto != "NOTSET" and n.attr("pads") is not None: raise n.error(f"attributes pads and auto_pad={auto} cannot both be given")
  geo = [_geometry(n, sizes[1 + i], st[i], dl[i], k[i], adj[i], (pads[i], pads[d + i]), None if want is None else want[i], auto) for i in range(d)]
  out = [o for _, o in geo]
  bias = n.t(2) if len(n.ins) > 2 and n.ins[2] is not None else None
  if bias is not None and (bias.shape != (mg * g,) or bias.dtype != x.dtype):
    raise n.error(f"the bias ({sym.fmt_shape(bias.shape)} {bias.dtype.name}) must be ({mg * g},) {x.dtype.name}, one per output channel")
  axes = [_axis_runs(st[i], dl[i], k[i], geo[i][0], out[i]) for i in range(d)]
  if (pieces := math.prod(len(a) for a in axes)) > MAX_PIECES:
    raise n.error(f"it splits into {pieces} sub-convolutions, over MAX_PIECES = {MAX_PIECES} (strides {st}, dilations {dl}, kernel {k})")
  y: Tensor | None = None
  for runs in itertools.product(*axes):
    q = [-(-o // s) for o, s in zip(out, st)]
    win = [(r.lo, r.lo + qq + (r.idx.shape[1] - 1) * r.dl) for r, qq in zip(runs, q)]  # the input range each piece reads
    if any(hi <= 0 or lo >= size for (lo, hi), size in zip(win, sizes[1:])): continue  # only padding: zeros
    xs = x[(slice(None), slice(None), *(slice(max(lo, 0), min(hi, size)) for (lo, hi), size in zip(win, sizes[1:])))]
    p = [(max(-lo, 0), max(hi - size, 0)) for (lo, hi), size in zip(win, sizes[1:])]
    piece = xs.conv2d(_piece_weight(w, ks, g, runs), None, 1, p, [r.dl for r in runs], g)
    part = _interleave(piece, mg * g, runs, st, out)
    y = part if y is None else y + part
  if y is None:  # every output reads only padding: the bias alone, which no run-time batch size can be read from
    if not sym.is_static(x.shape[:1]): raise n.error("every output reads only padding (pads crop all the input reaches): not with a symbolic batch")
    y = Tensor.full((x.shape[0], mg * g, *out), 0.0, x.dtype)
  return y if bias is None else y + bias.reshape(1, mg * g, *[1] * d)


def _lrn(n: OnnxNode) -> Value:
  """y = x / (bias + alpha/size * sum of x**2 over channels c - (size-1)//2 .. c + ceil((size-1)/2)) ** beta."""
  x = n.t(0)
  if not x.dtype.is_float: raise n.error(f"needs a float input, got {x.dtype.name}")
  if x.ndim < 3: raise n.error(f"input {sym.fmt_shape(x.shape)} needs at least 3 dims (N, C, D1, ...)")
  size = n.attr("size")
  if not isinstance(size, int) or size < 1: raise n.error(f"attribute size={size!r} must be an integer >= 1")
  alpha, beta, bias = float(n.attr("alpha", 1e-4)), float(n.attr("beta", 0.75)), float(n.attr("bias", 1.0))
  c = sym.static_shape("LRN (channels)", x.shape[1:2])[0]
  # a window past every channel reads only zeros: clamped to the channels, so a huge size costs nothing more
  pre, post = min((size - 1) // 2, c - 1), min(size - 1 - (size - 1) // 2, c - 1)
  win, rest = pre + post + 1, x.shape[2:]
  if win <= LRN_SHIFTED_SUM:  # the window as a sum of shifted views: an elementwise kernel, twice the speed of a pool's reduce
    sq = (x * x).pad(((0, 0), (pre, post), *[(0, 0)] * len(rest)))
    total = sq[:, 0:c]
    for j in range(1, win): total = total + sq[:, j:j + c]
  else:
    sq = (x * x).reshape(x.shape[0], 1, c, *rest)
    mean = sq.avg_pool([win, *[1] * len(rest)], [1] * (1 + len(rest)), [(pre, post), *[(0, 0)] * len(rest)], True)
    total = mean.reshape(x.shape) * win
  base = total * (alpha / size) + bias
  # a positive base (the usual bias > 0, alpha >= 0) needs none of power's sign rules: one exp2 and one log2
  return x * ((base.log2() * -beta).exp2() if bias > 0 and alpha >= 0 else power(base, -beta))


_op("ConvTranspose", _conv_transpose, "auto_pad dilations group kernel_shape output_padding output_shape pads strides")
_op("LRN", _lrn, "alpha beta bias size")
