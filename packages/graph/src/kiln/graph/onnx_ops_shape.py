"""The ONNX padding, tiling, masking, index-reduction, normalisation and extra reduction operators beyond onnx_ops' core
set, built from kiln.graph Tensor ops and registered in onnx_ops.OPS with the attributes each understands (onnx.py imports
this module for that). Every size, count and axis they take is a constant when the node converts: known at load, or
computed at run time and read back by a run, which converts the rest of the model for its value (specialise.py). Pad's
constant_value computed at run time is a value in the kernel; Tile's repeats may be a Shape's symbolic dims."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import shape_values as sv
from kiln.graph.onnx_ops import OnnxNode, Value, _axes_of, _norm, _op
from kiln.graph.tensor import Tensor
from kiln.ir.kernels import Dim


def _static(n: OnnxNode, x: Tensor, axes: list[int] | range, why: str) -> list[int]:
  """The sizes of x's axes, which must be fixed (a symbolic dim is refused, naming the node)."""
  out = []
  for a in axes:
    d = x.shape[a]
    if not isinstance(d, int): raise n.error(f"axis {a} of {x.shape} is symbolic ({sym.fmt(d)}): {why} needs a fixed size")
    out.append(d)
  return out


# ---- Pad: constant, edge and reflect modes; negative pads crop ----
def _pad_axis(x: Tensor, a: int, before: int, after: int, mode: str, n: OnnxNode) -> Tensor:
  d = x.shape[a]
  assert isinstance(d, int)
  if before < 0 or after < 0:  # a negative pad removes elements
    x = x.slice([max(-before, 0)], [d - max(-after, 0)], [a])
    d -= max(-before, 0) + max(-after, 0)
    before, after = max(before, 0), max(after, 0)
  if before == after == 0: return x
  if d == 0: raise n.error(f"mode {mode!r} cannot pad axis {a}: it has no elements left")
  parts = []
  if mode == "edge":
    def edge(i: int, k: int) -> Tensor:
      e = x.slice([i], [i + 1], [a])
      return e.expand(tuple(k if j == a else s for j, s in enumerate(e.shape)))
    parts = [edge(0, before)] * bool(before) + [x] + [edge(d - 1, after)] * bool(after)
  else:  # reflect: the mirror image without the edge element itself (numpy's "reflect")
    if before >= d or after >= d: raise n.error(f"mode 'reflect' pads of ({before}, {after}) need axis {a} longer than the pad, got {d}")
    if before: parts.append(x.slice([before], [0], [a], [-1]))
    parts.append(x)
    # the end, Python's way: -(d + 1) runs through element 0, where d - 2 - after would be -1 (the last)
    if after: parts.append(x.slice([d - 2], [d - 2 - after if d - 2 - after >= 0 else -(d + 1)], [a], [-1]))
  return Tensor.cat(parts, a)


def _pad(n: OnnxNode) -> Value:
  x = n.t(0)
  mode = n.attr("mode", "constant")
  if mode not in ("constant", "edge", "reflect"): raise n.error(f"attribute mode={mode!r} is not supported (constant, edge, reflect)")
  value: float | Tensor
  if n.opset < 11: pads, value, axes = list(n.attr("pads") or []), float(n.attr("value", 0.0)), None
  else:
    pads = [int(v) for v in n.const(1, "pads").reshape(-1)]
    cv = n.ins[2] if len(n.ins) > 2 else None
    value = cv if isinstance(cv, Tensor) else 0.0 if cv is None or not cv.size else cv.reshape(-1)[0].item()
    ax = n.opt_const(3, "axes")
    axes = None if ax is None else [_norm(int(v), x.ndim, n) for v in ax.reshape(-1)]
  axes = list(range(x.ndim)) if axes is None else axes
  if len(pads) != 2 * len(axes): raise n.error(f"{len(pads)} pads for {len(axes)} axes (two per axis: all befores, then all afters)")
  per = dict(zip(axes, zip(pads[:len(axes)], pads[len(axes):])))
  _static(n, x, [a for a, (b, e) in per.items() if (b or e) and (mode != "constant" or b < 0 or e < 0)], "Pad")  # constant: seq + 2
  if mode == "constant" and isinstance(value, Tensor):  # computed at run time: in the kernel, a select where the pads are
    if value.numel != 1: raise n.error(f"input 2 (constant_value) has shape {value.shape}: one element")
    inside = _padded(Tensor.full(x.shape, True, "bool"), per, mode, False, n)
    return inside.where(_padded(x, per, mode, 0, n), value.reshape(()).cast(x.dtype))
  return _padded(x, per, mode, 0.0 if isinstance(value, Tensor) else value, n)


def _padded(x: Tensor, per: dict[int, tuple[int, int]], mode: str, value: float | bool, n: OnnxNode) -> Tensor:
  """x with axis a padded by per[a] = (before, after) in mode (a negative pad crops)."""
  if mode == "constant" and all(b >= 0 and e >= 0 for b, e in per.values()):
    return x.pad([per.get(a, (0, 0)) for a in range(x.ndim)], value)
  for a, (b, e) in per.items():
    if b == e == 0: continue  # an axis left alone may be symbolic (a batch)
    if mode == "constant":
      x = _pad_axis(x, a, min(b, 0), min(e, 0), mode, n)  # crop first, then pad with the value
      x = x.pad([(max(b, 0), max(e, 0)) if j == a else (0, 0) for j in range(x.ndim)], value)
    else: x = _pad_axis(x, a, b, e, mode, n)
  return x


def _tile(n: OnnxNode) -> Value:
  """Tile; a repeat count may be a Shape's symbolic dim (timm's xcit tiles its positional encoding by the batch): the
  axis then becomes a product of dims (a monomial: a sum repeated, (seq - 1) * 4, is no dim a reshape can make)."""
  x = n.t(0)
  reps = [sv.dim(r) for r in np.asarray(n.const(1, "repeats")).reshape(-1)]
  if len(reps) != x.ndim or any(isinstance(r, int) and r < 0 for r in reps):
    raise n.error(f"repeats [{', '.join(sym.fmt(r) for r in reps)}] do not fit rank {x.ndim} (one count >= 0 per axis)")
  if any(sv.fixed(r, 0) for r in reps): raise n.error(f"repeats [{', '.join(sym.fmt(r) for r in reps)}] make an empty tensor (not supported)")
  for a, r in enumerate(reps):
    if sv.fixed(r, 1): continue
    d = x.shape[a]
    if not (sym.is_mono(d) and sym.is_mono(r)) and not (sv.fixed(d, 1) or sv.fixed(r, 1)):
      raise n.error(f"axis {a} ({sym.fmt(d)}) repeated {sym.fmt(r)} times is {sym.fmt(sym.mul(d, r))}: a sum times another dim is no dim a "
                    "reshape can make")
    x = _repeat(x, a, r)
  return x


def _repeat(x: Tensor, a: int, r: Dim) -> Tensor:
  """The whole of axis a r times over: a new axis of r copies before it, expanded, and the two merged by a reshape."""
  u = x.unsqueeze(a)
  u = u.expand(tuple(r if j == a else s for j, s in enumerate(u.shape)))
  return u.reshape(tuple(x.shape[:a]) + (sym.mul(r, x.shape[a]),) + tuple(x.shape[a + 1:]))


def _trilu(n: OnnxNode) -> Value:
  x = n.t(0)
  if x.ndim < 2: raise n.error(f"input {x.shape} needs rank >= 2")
  d = _diagonals(x.shape[-2], x.shape[-1])
  k = n.ins[1] if len(n.ins) > 1 else None
  if isinstance(k, Tensor):  # fed at run time: k moves the diagonal, never the shape
    if k.numel != 1 or not k.dtype.is_int: raise n.error(f"input 1 (k) must be one integer, got {k.dtype.name} {k.shape}")
    kt = k.reshape(()).cast(d.dtype)
    keep = (d > kt - 1) if n.attr("upper", 1) else (d < kt + 1)
  else:
    kk = 0 if k is None else int(k.reshape(-1)[0])
    keep = (d > kk - 1) if n.attr("upper", 1) else (d < kk + 1)
  return keep.where(x, Tensor.full((), 0, x.dtype))


def _diagonals(rows: Dim, cols: Dim) -> Tensor:
  """j - i over a (rows, cols) grid, from the loops' own indices (either size may be symbolic: a dynamic sequence)."""
  return Tensor.arange(cols).reshape(1, cols) - Tensor.arange(rows).reshape(rows, 1)


def _argext(kind: str) -> Callable[[OnnxNode], Value]:
  """ArgMax/ArgMin: the first (or, with select_last_index, the last) index of the axis' extreme, as int64. NaN compares
  with nothing here, so a slice holding NaN gives the index of its largest (smallest) number, where onnxruntime's may differ."""
  def run(n: OnnxNode) -> Value:
    x = n.t(0)
    a = _norm(n.attr("axis", 0), x.ndim, n)
    keep, last = bool(n.attr("keepdims", 1)), bool(n.attr("select_last_index", 0))
    (d,) = _static(n, x, [a], kind)
    ext = x.max(a, keepdims=True) if kind == "ArgMax" else x.min(a, keepdims=True)
    iota = Tensor(np.arange(d, dtype=np.int64).reshape(tuple(d if j == a else 1 for j in range(x.ndim))))
    hit = x.eq(ext)
    idx = hit.where(iota, Tensor.full((), -1, np.int64)).max(a, keepdims=keep) if last else \
        hit.where(iota, Tensor.full((), d, np.int64)).min(a, keepdims=keep)
    return idx
  return run


def _instance_norm(n: OnnxNode) -> Value:
  x = n.t(0)
  if x.ndim < 3: raise n.error(f"input {x.shape} needs rank >= 3 (N, C, spatial...)")
  shape = (1, -1) + (1,) * (x.ndim - 2)
  y = x.layernorm(None, None, tuple(range(2, x.ndim)), float(n.attr("epsilon", 1e-5)))
  return y * n.t(1).reshape(shape) + n.t(2).reshape(shape)


def _lp_norm(n: OnnxNode) -> Value:
  x = n.t(0).float()
  a, p = _norm(n.attr("axis", -1), x.ndim, n), int(n.attr("p", 2))
  if p not in (1, 2): raise n.error(f"attribute p={p} is not supported (1, 2)")
  nrm = x.abs().sum(a, keepdims=True) if p == 1 else (x * x).sum(a, keepdims=True).sqrt()
  return x / nrm.eq(0).where(1.0, nrm)  # an all-zero slice stays 0 (onnxruntime), not 0 / 0


# ---- reductions made of others ----
def _log_sum_exp(x: Tensor, ax: tuple[int, ...], keep: bool) -> Tensor:
  """log(sum(exp(x))) around the max, so a large x does not overflow exp; an all -inf slice gives -inf, not NaN."""
  m = x.max(ax, keepdims=True)
  safe = m.eq(float("-inf")).where(0.0, m)
  out = (x - safe).exp().sum(ax, keepdims=True).log() + safe
  return out if keep else out.squeeze(ax)


REDUCERS: dict[str, Callable[[Tensor, tuple[int, ...], bool], Tensor]] = {
  "ReduceL1": lambda x, ax, k: x.abs().sum(ax, k),
  "ReduceL2": lambda x, ax, k: (x.float() * x.float()).sum(ax, k).sqrt(),
  "ReduceSumSquare": lambda x, ax, k: (x * x).sum(ax, k),
  "ReduceLogSum": lambda x, ax, k: x.float().sum(ax, k).log(),
  "ReduceLogSumExp": lambda x, ax, k: _log_sum_exp(x.float(), ax, k),
}


def _reduce_by(op: str) -> Callable[[OnnxNode], Value]:
  def run(n: OnnxNode) -> Value:
    x = n.t(0)
    axes = _axes_of(n, 18)
    if not axes:
      if n.attr("noop_with_empty_axes", 0): return x
      axes = list(range(x.ndim))
    return REDUCERS[op](x, tuple(_norm(a, x.ndim, n) for a in axes), bool(n.attr("keepdims", 1)))
  return run


def _cumsum(n: OnnxNode) -> Value:
  """A prefix sum as a masked sum over a second copy of the axis: out[i] = sum of x[j] for j <= i (j < i exclusive; the
  mirror for reverse). O(L^2) work for an axis of L, which is what position ids from an attention mask need; the sums
  run in index order, as onnxruntime's do."""
  x = n.t(0)
  a = _norm(int(n.const(1, "axis").reshape(-1)[0]), x.ndim, n)
  d = x.shape[a]
  dj = _diagonals(d, d)  # j - i
  excl, rev = bool(n.attr("exclusive", 0)), bool(n.attr("reverse", 0))
  mask = (dj > 0 if excl else dj > -1) if rev else (dj < 0 if excl else dj < 1)
  order = [k for k in range(x.ndim) if k != a] + [a]
  xt = x.permute(order).unsqueeze(-2)  # (..., 1, L): x[..., j]
  xt = xt.expand(tuple(xt.shape[:-2]) + (d, d))
  s = mask.where(xt, Tensor.full((), 0, x.dtype)).sum(-1)  # (..., L): over j for each i
  return s.permute([order.index(k) for k in range(x.ndim)])


def _size(n: OnnxNode) -> Value:
  x = n.ins[0]
  shape = x.shape if x is not None else ()
  if not sym.is_static(shape): raise n.error(f"input {shape} has symbolic dims: its Size is known only at run time (not supported)")
  return np.asarray(int(np.prod(sym.static_shape("Size", shape), dtype=np.int64)), np.int64)


def _depth_space(to_space: bool) -> Callable[[OnnxNode], Value]:
  """DepthToSpace (DCR or CRD) and SpaceToDepth on NCHW, as a reshape, a permute and a reshape."""
  def run(n: OnnxNode) -> Value:
    x = n.t(0)
    if x.ndim != 4: raise n.error(f"input {x.shape} must be NCHW (rank 4)")
    b = int(n.attr("blocksize", 0))
    if b < 1: raise n.error("attribute blocksize is required (>= 1)")
    N, C, H, W = _static(n, x, range(4), n.op)
    if to_space:
      if C % (b * b): raise n.error(f"channels {C} are not a multiple of blocksize^2 = {b * b}")
      c = C // (b * b)
      if n.attr("mode", "DCR") == "DCR": return x.reshape(N, b, b, c, H, W).permute(0, 3, 4, 1, 5, 2).reshape(N, c, H * b, W * b)
      if n.attr("mode") != "CRD": raise n.error(f"attribute mode={n.attr('mode')!r} is not supported (DCR, CRD)")
      return x.reshape(N, c, b, b, H, W).permute(0, 1, 4, 2, 5, 3).reshape(N, c, H * b, W * b)
    if H % b or W % b: raise n.error(f"spatial {H}x{W} is not a multiple of blocksize {b}")
    blocks = x.reshape(N, C, H // b, b, W // b, b)
    if n.attr("mode", "DCR") == "DCR": return blocks.permute(0, 3, 5, 1, 2, 4).reshape(N, C * b * b, H // b, W // b)
    if n.attr("mode") != "CRD": raise n.error(f"attribute mode={n.attr('mode')!r} is not supported (DCR, CRD)")
    return blocks.permute(0, 1, 3, 5, 2, 4).reshape(N, C * b * b, H // b, W // b)  # CRD: channel-major, the block's offset minor
  return run



# ---- Einsum: one broadcast product summed over the contracted letters (the graph Tensor.matmul builds); a letter repeated in a
# term takes that operand's diagonal first ----
def _einsum_terms(n: OnnxNode, ops: list[Tensor]) -> tuple[list[str], str]:
  """The equation's operand terms and output, each letter one axis: '...' becomes placeholder letters (right-aligned,
  numpy's broadcasting), an implicit output is the broadcast dims then the letters used once, in alphabetical order."""
  eq = str(n.attr("equation") or "").replace(" ", "")
  lhs, arrow, rhs = eq.partition("->")
  terms = lhs.split(",")
  if not eq or len(terms) != len(ops): raise n.error(f"equation {eq!r} does not name {len(ops)} operands")
  dots = [op.ndim - (len(t) - 3) if "..." in t else 0 for t, op in zip(terms, ops)]
  width = max(dots, default=0)
  ph = "".join(chr(0x391 + i) for i in range(width))  # Greek capitals: never einsum letters
  out_terms = []
  for t, op, k in zip(terms, ops, dots):
    t = t.replace("...", ph[width - k:]) if "..." in t else t
    if (t and not t.isalpha()) or len(t) != op.ndim: raise n.error(f"term {t!r} of {eq!r} does not fit operand {op.shape}")
    out_terms.append(t)
  if arrow: out = rhs.replace("...", ph)
  else:
    once = [c for c in sorted(set("".join(out_terms))) if "".join(out_terms).count(c) == 1 and c not in ph]
    out = ph + "".join(once)
  if (out and not out.isalpha()) or len(set(out)) != len(out) or any(c not in "".join(out_terms) for c in out):
    raise n.error(f"output {rhs!r} of {eq!r} names a letter twice or one no operand has")
  return out_terms, out


def _diagonal(n: OnnxNode, op: Tensor, t: str) -> tuple[Tensor, str]:
  """An operand whose term repeats a letter ('ii'): its diagonal along those axes, the letter once (last). The two axes
  moved last and merged, every (size + 1)-th element of the merged axis is the diagonal: a strided view, no copy."""
  while (c := next((c for c in t if t.count(c) > 1), None)) is not None:
    i, j = t.index(c), t.index(c, t.index(c) + 1)
    d = sym.static_dim("Einsum", op.shape, i)
    if op.shape[j] != d: raise n.error(f"letter {c!r} of term {t!r} has sizes {sym.fmt(op.shape[i])} and {sym.fmt(op.shape[j])}")
    rest = [k for k in range(op.ndim) if k not in (i, j)]
    op = op.permute(rest + [i, j]).reshape(*[op.shape[k] for k in rest], d * d).slice([0], [d * d], [len(rest)], [d + 1])
    t = "".join(t[k] for k in rest) + c
  return op, t


def _einsum(n: OnnxNode) -> Value:
  ops = [n.t(i) for i in range(len(n.ins))]
  if not ops: raise n.error("no operands")
  terms, out = _einsum_terms(n, ops)
  ops, terms = map(list, zip(*(_diagonal(n, op, t) for op, t in zip(ops, terms))))
  sizes: dict[str, Dim] = {}  # a symbolic dim (batch, seq) is one UOp wherever it stands, so the same letter matches
  for t, op in zip(terms, ops):
    for c, d in zip(t, op.shape):
      if sizes.get(c, 1) != 1 and d != 1 and sizes[c] is not d and sizes[c] != d:
        raise n.error(f"letter {c!r} has sizes {sym.fmt(sizes[c])} and {sym.fmt(d)}")
      if d != 1 or c not in sizes: sizes[c] = d
  summed = [c for c in dict.fromkeys("".join(terms)) if c not in out]
  if len(ops) == 2:  # matmul's layout, (batch, rows, contracted, columns): the codegen tiles it as a matrix product
    a, b = terms
    full = [c for c in out if c in a and c in b] + [c for c in out if c in a and c not in b] + summed + [c for c in out if c not in a]
  else: full = list(out) + summed
  prod: Tensor | None = None
  for t, op in zip(terms, ops):
    mine = sorted(t, key=full.index)
    x = op.permute([t.index(c) for c in mine]) if list(mine) != list(t) else op
    x = x.reshape(tuple(x.shape[mine.index(c)] if c in t else 1 for c in full))  # its letters in place, 1 for the others
    x = x.expand(tuple(sizes[c] for c in full))
    prod = x if prod is None else prod * x
  assert prod is not None
  if summed: prod = prod.sum(tuple(full.index(c) for c in summed))
  kept = [c for c in full if c not in summed]
  return prod.permute([kept.index(c) for c in out]) if kept != list(out) else prod


_op("Pad", _pad, "mode pads value"); _op("Tile", _tile); _op("Trilu", _trilu, "upper")
_op("ArgMax", _argext("ArgMax"), "axis keepdims select_last_index"); _op("ArgMin", _argext("ArgMin"), "axis keepdims select_last_index")
_op("InstanceNormalization", _instance_norm, "epsilon"); _op("LpNormalization", _lp_norm, "axis p")
for _name in REDUCERS: _op(_name, _reduce_by(_name), "axes keepdims noop_with_empty_axes")
_op("CumSum", _cumsum, "exclusive reverse"); _op("Size", _size)
_op("DepthToSpace", _depth_space(True), "blocksize mode"); _op("SpaceToDepth", _depth_space(False), "blocksize mode")
_op("Einsum", _einsum, "equation")
