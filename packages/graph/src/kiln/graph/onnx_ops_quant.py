"""The ONNX quantization operators, registered in onnx_ops.OPS (onnx.py imports this module for that): QuantizeLinear,
DequantizeLinear, DynamicQuantizeLinear, MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv, each computed the way
onnxruntime's CPU kernels compute it, so the integer results match it bit for bit:

| step             | how                                                                                                       |
|------------------|-----------------------------------------------------------------------------------------------------------|
| quantize         | x / scale in float32 (float16 widened first), clamped to [qmin - zp, qmax - zp] as MAXPS/MINPS clamp     |
|                  | (a NaN becomes qmin), rounded half to even, plus zp                                                       |
| dequantize       | float32(int32(x) - int32(zp)) * float32(scale), rounded once to the output type                          |
| integer products | int32 operands, zero points taken off first, summed in int32 (ONNX lets that sum wrap; onnxruntime's does) |
| requantize       | float32(int32 sum) * (scale_a * scale_b / scale_y, in the scales' type), then as quantize                 |

A node whose inputs are all constants folds at load (numpy, the same arithmetic): a QDQ model's DequantizeLinear of a
constant int8 weight becomes a float32 weight, so the model runs at float speed; activations quantize and dequantize at
run time in kiln kernels. There are no int8 kernels yet: an integer product is an int32 product.

kiln has int8, uint8, int16, uint16 and int32; the float8, float4, int4 and int2 types ONNX also quantizes to are refused
by name (a graph input of such a type is refused by the loader already).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kiln.graph.onnx_ops import OnnxNode, Value, _norm, _op, _spatial
from kiln.graph.onnx_ops_act import _round
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import DType, dtypes
from kiln.ir.errors import IRTypeError
from kiln.ir.kernels import Dim

QUANT_TYPES = (dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16)  # what QuantizeLinear makes here
DEQUANT_TYPES = (*QUANT_TYPES, dtypes.int32)  # what DequantizeLinear reads here
PRODUCT_TYPES = (dtypes.int8, dtypes.uint8)  # the operands of MatMulInteger, ConvInteger and the QLinear ops
ONNX_FLOATS = {1: dtypes.float32, 10: dtypes.float16, 16: dtypes.bfloat16}  # TensorProto element type -> dtype
ONNX_QUANTS = {2: dtypes.uint8, 3: dtypes.int8, 4: dtypes.uint16, 5: dtypes.int16}
PRECISIONS = {1: dtypes.float32, 10: dtypes.float16}  # QuantizeLinear's `precision` (the division's type) kiln computes


# ---- inputs: their dtypes and shapes ----
def _in(n: OnnxNode, i: int, what: str) -> Value:
  v = n.ins[i] if i < len(n.ins) else None
  if v is None: raise n.error(f"input {i} ({what}) is missing")
  return v


def _opt(n: OnnxNode, i: int) -> Value | None: return n.ins[i] if i < len(n.ins) else None


def _dtype(n: OnnxNode, v: Value, what: str) -> DType:
  if isinstance(v, Tensor): return v.dtype
  try: return dtypes.from_numpy(v.dtype)
  except IRTypeError: raise n.error(f"{what} is {v.dtype.name}, a type kiln has no dtype for") from None


def _need(n: OnnxNode, v: Value, what: str, allowed: tuple[DType, ...]) -> DType:
  dt = _dtype(n, v, what)
  if dt not in allowed: raise n.error(f"{what} is {dt.name}; this operator takes {', '.join(d.name for d in allowed)} here")
  return dt


def _need_float(n: OnnxNode, v: Value, what: str) -> DType:
  dt = _dtype(n, v, what)
  if not dt.is_float: raise n.error(f"{what} is {dt.name}; it must be a float type")
  return dt


def _code_dtype(n: OnnxNode, attr: str, table: dict[int, DType]) -> DType | None:
  """The dtype an element-type attribute names (None when absent or 0), refused by name where kiln does not compute it."""
  code = int(n.attr(attr, 0))
  if not code: return None
  if code in table: return table[code]
  try: name = n.stored.onnx.TensorProto.DataType.Name(code)
  except ValueError: name = "no ONNX element type"
  raise n.error(f"{attr}={code} ({name}) is not supported: kiln computes {', '.join(d.name for d in table.values())} here")


def _shape(v: Value) -> tuple[Dim, ...]: return tuple(v.shape)


def _ints(shape: tuple[Dim, ...]) -> tuple[int, ...] | None:
  return None if any(not isinstance(d, int) for d in shape) else tuple(int(d) for d in shape)  # type: ignore[arg-type]


def _size(shape: tuple[Dim, ...]) -> int | None:
  return None if (s := _ints(shape)) is None else math.prod(s)


def _is(d: Dim, e: Dim) -> bool: return isinstance(d, int) and isinstance(e, int) and d == e  # equal fixed sizes


def _const(*vs: Value | None) -> bool: return all(v is None or isinstance(v, np.ndarray) for v in vs)


def _tensor(v: Value) -> Tensor: return v if isinstance(v, Tensor) else Tensor(np.asarray(v))


# ---- how a scale or zero point maps onto x: per tensor, per axis, or in blocks along an axis ----
class Grain:
  """Per tensor (axis None), per axis (block 0), or blocked (each scale covers `block` consecutive elements of axis; then
  x's shape is fixed, and `fixed` holds it)."""
  def __init__(self, x_shape: tuple[Dim, ...], axis: int | None, block: int = 0, fixed: tuple[int, ...] = ()):
    self.x_shape, self.axis, self.block, self.fixed = x_shape, axis, block, fixed

  def spread(self, v: Value) -> Value:
    """v reshaped (or, blocked, repeated) so that it broadcasts against x."""
    if self.axis is None: return v.reshape(())
    a, nd = self.axis, len(self.x_shape)
    if not self.block: return v.reshape((1,) * a + (-1,) + (1,) * (nd - a - 1))
    d, b = self.fixed[a], self.block
    si = -(-d // b)
    if si == 1: return v  # one block covers the axis: it broadcasts
    if isinstance(v, np.ndarray): return np.repeat(v, b, a)[(slice(None),) * a + (slice(0, d),)]
    shp = tuple(si if i == a else e for i, e in enumerate(self.fixed))  # the scale's shape (_grain)
    t = v.unsqueeze(a + 1).expand(shp[:a + 1] + (b,) + shp[a + 1:]).reshape(shp[:a] + (si * b,) + shp[a + 1:])
    return t if si * b == d else t.slice([0], [d], [a])


def _grain(n: OnnxNode, x: Value, s: Value, z: Value | None) -> Grain:
  """The granularity the scale's shape says (ONNX: scalar, 1-D along `axis`, or blocked: x's shape with axis divided
  into ceil(D / block_size)); the zero point must have the scale's shape."""
  xs, ss = _shape(x), _shape(s)
  if z is not None and _shape(z) != ss and not (_size(ss) == 1 and _size(_shape(z)) == 1):
    raise n.error(f"the zero point's shape {_shape(z)} differs from the scale's {ss}")
  block = int(n.attr("block_size", 0))
  if block < 0: raise n.error(f"block_size {block} is negative")
  if block:
    a = _norm(int(n.attr("axis", 1)), len(xs), n)
    if (xi := _ints(xs)) is None: raise n.error(f"blocked quantization needs x's shape {xs} fixed")
    want = tuple(-(-d // block) if i == a else d for i, d in enumerate(xi))
    if ss != want: raise n.error(f"block_size {block} on axis {a} of x {xs} needs a scale of shape {want}, got {ss}")
    return Grain(xs, a, block, xi)
  if len(ss) <= 1 and _size(ss) == 1:
    n.attr("axis")
    return Grain(xs, None)
  a = _norm(int(n.attr("axis", 1)), len(xs), n)
  if len(ss) != 1 or not _is(xs[a], ss[0]):
    raise n.error(f"a scale of shape {ss} is neither a scalar nor one per element of axis {a} of x {xs} (a blocked scale needs block_size)")
  return Grain(xs, a)


# ---- the shared arithmetic: saturating round-half-to-even into a quantized type ----
def _to_q(n: OnnxNode, v: Tensor, z: Tensor | None, out: DType) -> Tensor:
  """round(v) + z saturated to out, v float32: clamped first to [qmin - z, qmax - z] as MAXPS/MINPS do (a NaN takes
  the bound), so the rounding sees a bounded value and the cast is exact."""
  zf: Tensor | float = 0.0 if z is None else z.cast(dtypes.float32)
  lo, hi = float(out.min) - zf, float(out.max) - zf
  v = (v > lo).where(v, lo)
  v = (v < hi).where(v, hi)
  return (_round(n, v) + zf).cast(out)


def _np_to_q(v: np.ndarray, z: np.ndarray | None, out: DType) -> np.ndarray:
  zf = np.float32(0) if z is None else z.astype(np.float32)
  lo, hi = np.float32(out.min) - zf, np.float32(out.max) - zf
  v = np.where(v > lo, v, lo)
  v = np.where(v < hi, v, hi)
  return (np.rint(v) + zf).astype(out.np)


# ---- QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear ----
def _quant_type(n: OnnxNode, z: Value | None) -> DType:
  """The zero point's type, else output_dtype (opset 21), else uint8; both given must agree."""
  named = _code_dtype(n, "output_dtype", ONNX_QUANTS)
  if z is None: return named or dtypes.uint8
  zdt = _need(n, z, "the zero point", QUANT_TYPES)
  if named is not None and named != zdt: raise n.error(f"output_dtype {named.name} differs from the zero point's type {zdt.name}")
  return zdt


def _quantize(n: OnnxNode) -> Value:
  x, s, z = _in(n, 0, "x"), _in(n, 1, "y_scale"), _opt(n, 2)
  _need_float(n, x, "input x")
  _need_float(n, s, "the scale")
  out = _quant_type(n, z)
  n.attr("saturate")  # float8 only: kiln has no float8 type
  # the division's type: `precision` (opset 23), else float32 as onnxruntime (float16 inputs widened, not divided in float16)
  prec = _code_dtype(n, "precision", PRECISIONS) or dtypes.float32
  g = _grain(n, x, s, z)
  sz, zz = g.spread(s), None if z is None else g.spread(z)
  if isinstance(x, np.ndarray) and isinstance(sz, np.ndarray) and _const(zz):
    with np.errstate(all="ignore"): v = (x.astype(prec.np) / sz.astype(prec.np)).astype(np.float32)
    return _np_to_q(v, zz, out)  # type: ignore[arg-type]
  v = (_tensor(x).cast(prec) / _tensor(sz).cast(prec)).cast(dtypes.float32)
  return _to_q(n, v, None if zz is None else _tensor(zz), out)


def _dequantize(n: OnnxNode) -> Value:
  x, s, z = _in(n, 0, "x"), _in(n, 1, "x_scale"), _opt(n, 2)
  xdt = _need(n, x, "input x", DEQUANT_TYPES)
  sdt = _need_float(n, s, "the scale")
  if z is not None and (zdt := _dtype(n, z, "the zero point")) != xdt: raise n.error(f"the zero point is {zdt.name}, x {xdt.name}")
  if xdt == dtypes.int32 and z is not None and not (isinstance(z, np.ndarray) and not z.any()):
    raise n.error("an int32 x takes no zero point (ONNX: it is 0), or only a constant 0")
  out = _code_dtype(n, "output_dtype", ONNX_FLOATS) or sdt
  g = _grain(n, x, s, z)
  sz, zz = g.spread(s), None if z is None else g.spread(z)
  if isinstance(x, np.ndarray) and isinstance(sz, np.ndarray) and _const(zz) and out != dtypes.bfloat16:  # a QDQ weight: a float constant
    xi = x.astype(np.int32) if zz is None else x.astype(np.int32) - zz.astype(np.int32)  # type: ignore[union-attr]
    return (xi.astype(np.float32) * sz.astype(np.float32)).astype(out.np)
  xi_t = _tensor(x).cast(dtypes.int32)
  if zz is not None: xi_t = xi_t - _tensor(zz).cast(dtypes.int32)
  return (xi_t.cast(dtypes.float32) * _tensor(sz).cast(dtypes.float32)).cast(out)


def _dynamic_quantize(n: OnnxNode) -> list[Value]:
  """uint8 with scale and zero point from x's range widened to hold 0, as onnxruntime: scale (max - min) / 255 (1 for an
  all-zero x), zero point round(min(max(0 - min / scale, ...))) with std::min/std::max's NaN rule; then QuantizeLinear."""
  x = _in(n, 0, "x")
  if _dtype(n, x, "input x") != dtypes.float32: raise n.error(f"input x is {_dtype(n, x, 'input x').name}; it must be float32")
  if isinstance(x, np.ndarray):
    with np.errstate(all="ignore"):
      mn, mx = min(np.float32(x.min()), np.float32(0)), max(np.float32(x.max()), np.float32(0))
      scale = np.float32(1) if mx == mn else np.float32((mx - mn) / np.float32(255))
      izp = np.float32(0) - np.float32(mn / scale)
      izp = izp if izp < 255 else np.float32(255)  # std::min(255, izp)
      zq = np.asarray(np.rint(izp if 0 < izp else np.float32(0))).astype(np.uint8)  # std::max(0, .)
      return [_np_to_q((x / scale).astype(np.float32), zq, dtypes.uint8), np.asarray(scale, np.float32), zq]
  t = _tensor(x)
  tmn, tmx = t.min().minimum(0.0), t.max().maximum(0.0)
  tscale = tmx.eq(tmn).where(1.0, (tmx - tmn) / 255.0)
  tizp = 0.0 - tmn / tscale
  tizp = (tizp < 255.0).where(tizp, 255.0)
  tzp = _round(n, (tizp > 0.0).where(tizp, 0.0)).cast(dtypes.uint8)
  return [_to_q(n, t / tscale, tzp, dtypes.uint8), tscale, tzp]


# ---- integer products: zero points per tensor, per row of a, per column of b, per output channel of a conv ----
Spread = Callable[[Value], Value]


def _per_row(n: OnnxNode, a: tuple[Dim, ...], what: str) -> Spread:
  """ONNX's a-side parameter: a scalar, M values for a (M, K) a, or (..., M, 1) for a batched one."""
  def spread(v: Value) -> Value:
    vs = _shape(v)
    if _size(vs) == 1: return v.reshape(())
    if len(a) >= 2 and len(vs) == 1 and _is(a[-2], vs[0]): return v.reshape(-1, 1)
    if len(vs) == len(a) >= 2 and _is(vs[-1], 1) and _is(a[-2], vs[-2]) and all(_is(d, 1) or _is(e, d) for d, e in zip(vs[:-2], a[:-2])):
      return v
    raise n.error(f"{what} of shape {vs} is neither a scalar nor one per row of a {a} (M values, or shape (..., M, 1))")
  return spread


def _per_col(n: OnnxNode, b: tuple[Dim, ...], what: str) -> Spread:
  """ONNX's b-side parameter: a scalar, N values for a (K, N) b, or (..., 1, N) for a batched one."""
  def spread(v: Value) -> Value:
    vs = _shape(v)
    if _size(vs) == 1: return v.reshape(())
    if len(b) >= 2 and len(vs) == 1 and _is(b[-1], vs[0]): return v
    if len(vs) == len(b) >= 2 and _is(vs[-2], 1) and _is(b[-1], vs[-1]) and all(_is(d, 1) or _is(e, d) for d, e in zip(vs[:-2], b[:-2])):
      return v
    raise n.error(f"{what} of shape {vs} is neither a scalar nor one per column of b {b} (N values, or shape (..., 1, N))")
  return spread


def _per_tensor(n: OnnxNode, what: str) -> Spread:
  def spread(v: Value) -> Value:
    if _size(_shape(v)) != 1: raise n.error(f"{what} of shape {_shape(v)} must be a scalar (per tensor)")
    return v.reshape(())
  return spread


def _per_out_channel(n: OnnxNode, m: Dim, rank: int, lead: int, what: str) -> Spread:
  """A conv's weight-side parameter: a scalar or M values, laid along dim `lead` of a rank-`rank` tensor."""
  def spread(v: Value) -> Value:
    vs = _shape(v)
    if _size(vs) == 1: return v.reshape(())
    if len(vs) == 1 and _is(m, vs[0]): return v.reshape((1,) * lead + (-1,) + (1,) * (rank - lead - 1))
    raise n.error(f"{what} of shape {vs} is neither a scalar nor one per output channel ({m})")
  return spread


def _centered(n: OnnxNode, v: Value, z: Value | None, spread: Spread, what: str) -> Value:
  """int32(v) - int32(z): numpy when both are constants (a weight folds at load), else Tensor ops."""
  if z is not None:
    if (zdt := _dtype(n, z, f"{what}'s zero point")) != (vdt := _dtype(n, v, what)):
      raise n.error(f"{what}'s zero point is {zdt.name}, {what} {vdt.name}")
    z = spread(z)
  if isinstance(v, np.ndarray) and _const(z): return v.astype(np.int32) - (0 if z is None else z.astype(np.int32))  # type: ignore[union-attr]
  t = _tensor(v).cast(dtypes.int32)
  return t if z is None else t - _tensor(z).cast(dtypes.int32)


def _multiplier(n: OnnxNode, scales: list[tuple[Value, Spread]]) -> Value:
  """s0 * s1 / s2 (each spread), in the scales' one float type as onnxruntime (float32) and ONNX's reference (float16)
  compute it, widened to float32: the factor an int32 sum is requantized by."""
  dts = {_need_float(n, s, "a scale") for s, _ in scales}
  if len(dts) > 1: raise n.error(f"the scales have different types {sorted(d.name for d in dts)}")
  (a, fa), (b, fb), (y, fy) = scales
  sa, sb, sy = fa(a), fb(b), fy(y)
  if isinstance(sa, np.ndarray) and isinstance(sb, np.ndarray) and isinstance(sy, np.ndarray) and dts != {dtypes.bfloat16}:
    with np.errstate(all="ignore"): return np.asarray(sa * sb / sy).astype(np.float32)
  return (_tensor(sa) * _tensor(sb) / _tensor(sy)).cast(dtypes.float32)


def _requantize(n: OnnxNode, acc: Tensor, mult: Value, z: Value | None, like: Value) -> Tensor:
  """The QLinear ops' output: float32(acc) * mult, saturated into the output zero point's type (x's without one)."""
  out = _need(n, z if z is not None else like, "the output zero point", PRODUCT_TYPES)
  zz = None if z is None else _tensor(_per_tensor(n, "the output zero point")(z))
  return _to_q(n, acc.cast(dtypes.float32) * _tensor(mult), zz, out)


def _matmul_integer(n: OnnxNode) -> Value:
  a, b = _in(n, 0, "A"), _in(n, 1, "B")
  _need(n, a, "A", PRODUCT_TYPES), _need(n, b, "B", PRODUCT_TYPES)
  ai = _centered(n, a, _opt(n, 2), _per_row(n, _shape(a), "a_zero_point"), "A")
  bi = _centered(n, b, _opt(n, 3), _per_col(n, _shape(b), "b_zero_point"), "B")
  return _tensor(ai) @ _tensor(bi)


def _qlinear_matmul(n: OnnxNode) -> Value:
  a, b = _in(n, 0, "a"), _in(n, 3, "b")
  _need(n, a, "a", PRODUCT_TYPES), _need(n, b, "b", PRODUCT_TYPES)
  rows, cols, one = _per_row(n, _shape(a), "a's scale"), _per_col(n, _shape(b), "b's scale"), _per_tensor(n, "y_scale")
  ai = _centered(n, a, _opt(n, 2), _per_row(n, _shape(a), "a_zero_point"), "a")
  bi = _centered(n, b, _opt(n, 5), _per_col(n, _shape(b), "b_zero_point"), "b")
  mult = _multiplier(n, [(_in(n, 1, "a_scale"), rows), (_in(n, 4, "b_scale"), cols), (_in(n, 6, "y_scale"), one)])
  return _requantize(n, _tensor(ai) @ _tensor(bi), mult, _opt(n, 7), a)


def _int_conv(n: OnnxNode, x: Value, w: Value, bias: Value | None) -> Tensor:
  """The int32 convolution of centered operands (padding adds 0: the zero point, centered), attributes as Conv's."""
  xt, wt = _tensor(x), _tensor(w)
  kernel = list(n.attr("kernel_shape") or wt.shape[2:])
  if tuple(kernel) != tuple(wt.shape[2:]): raise n.error(f"kernel_shape {kernel} differs from the weight's {wt.shape[2:]}")
  st, dl, pads = _spatial(n, xt, kernel)
  return xt.conv2d(wt, None if bias is None else _tensor(bias), st, pads, dl, int(n.attr("group", 1)))


def _conv_operands(n: OnnxNode, xi: int, wi: int, xzi: int, wzi: int) -> tuple[Value, Value, Value]:
  x, w = _in(n, xi, "x"), _in(n, wi, "w")
  _need(n, x, "x", PRODUCT_TYPES), _need(n, w, "w", PRODUCT_TYPES)
  ws = _shape(w)
  if len(ws) < 3: raise n.error(f"the weight's shape {ws} has no spatial dims")
  xc = _centered(n, x, _opt(n, xzi), _per_tensor(n, "x_zero_point"), "x")
  wc = _centered(n, w, _opt(n, wzi), _per_out_channel(n, ws[0], len(ws), 0, "w_zero_point"), "w")
  return x, xc, wc


def _conv_integer(n: OnnxNode) -> Value:
  _, xc, wc = _conv_operands(n, 0, 1, 2, 3)
  return _int_conv(n, xc, wc, None)


def _qlinear_conv(n: OnnxNode) -> Value:
  x, xc, wc = _conv_operands(n, 0, 3, 2, 5)
  m, rank = _shape(wc)[0], len(_shape(x))
  bias = _opt(n, 8)
  if bias is not None:
    _need(n, bias, "the bias", (dtypes.int32,))
    if len(_shape(bias)) != 1 or not _is(m, _shape(bias)[0]): raise n.error(f"the bias's shape {_shape(bias)} is not ({m},)")
  mult = _multiplier(n, [(_in(n, 1, "x_scale"), _per_tensor(n, "x_scale")),
                         (_in(n, 4, "w_scale"), _per_out_channel(n, m, rank, 1, "w_scale")), (_in(n, 6, "y_scale"), _per_tensor(n, "y_scale"))])
  return _requantize(n, _int_conv(n, xc, wc, bias), mult, _opt(n, 7), x)


_CONV_ATTRS = "auto_pad dilations group kernel_shape pads strides"
_op("QuantizeLinear", _quantize, "axis block_size output_dtype precision saturate")
_op("DequantizeLinear", _dequantize, "axis block_size output_dtype")
_op("DynamicQuantizeLinear", _dynamic_quantize)
_op("MatMulInteger", _matmul_integer)
_op("ConvInteger", _conv_integer, _CONV_ATTRS)
_op("QLinearMatMul", _qlinear_matmul)
_op("QLinearConv", _qlinear_conv, _CONV_ATTRS)
