"""The ONNX activation and elementwise-maths operators beyond onnx_ops' core set, each built from kiln.graph Tensor ops and
registered in onnx_ops.OPS with the attributes it understands (onnx.py imports this module for that).

Each operator is a pair: a Tensor form, and a numpy form used when every input is a load-time constant (the node folds, as
onnx_ops' handlers do). Floor, Ceil and Round are built on the IR's TRUNC (exact), Cos on Sin (_cos says how accurate), Mod
on the IR's integer MOD (exact) or, for floats, an exact fmod in float64 (_fmod)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.graph import onnx_limits as lim
from kiln.graph.onnx_ops import OnnxNode, Value, _op
from kiln.graph.tensor import Tensor, broadcast_shapes
from kiln.ir.dtype import DType, dtypes
from kiln.ir.ops import Ops

TFn = Callable[..., Tensor]  # (node, *inputs as Tensors, None for an omitted optional one) -> Tensor
NFn = Callable[..., Any]  # (node, *inputs as numpy arrays or None) -> array


def _ew(tfn: TFn, nfn: NFn, floats: bool = True) -> Callable[[OnnxNode], Value]:
  """A handler: nfn when every given input is a numpy constant (folded at load time), else tfn on Tensors. floats: ONNX's
  type constraint allows float inputs only; any other is refused by name rather than computed in a type the op lacks."""
  def run(n: OnnxNode) -> Value:
    given = [v for v in n.ins if isinstance(v, np.ndarray)]
    if given and len(given) == sum(v is not None for v in n.ins):
      if floats and given[0].dtype.kind != "f": raise n.error(f"needs a float input, got {given[0].dtype}")
      _fold_limit(n, given)
      with np.errstate(all="ignore"): out = np.asarray(nfn(n, *n.ins))
      return out if out.dtype == np.bool_ else out.astype(given[0].dtype)
    ts = [None if v is None else n.t(i) for i, v in enumerate(n.ins)]
    x = ts[0] if ts else None
    if floats and x is not None and not x.dtype.is_float: raise n.error(f"needs a float input, got {x.dtype.name}")
    return tfn(n, *ts)
  return run


def _fold_limit(n: OnnxNode, arrs: list[np.ndarray]) -> None:
  """A fold that broadcasts (PRelu, Xor, Mod, Clip) makes at most onnx_limits' MAX_FOLDED_ELEMENTS beyond its inputs."""
  size = math.prod(np.broadcast_shapes(*(a.shape for a in arrs)))
  if size > max(a.size for a in arrs):
    lim.limit(f"node {n.name} ({n.op}): a load-time fold's element count", size, "MAX_FOLDED_ELEMENTS", lim.MAX_FOLDED_ELEMENTS)


def _same(n: OnnxNode, x: Tensor, other: Tensor, what: str) -> None:
  if x.dtype != other.dtype: raise n.error(f"{what} is {other.dtype.name}, the input {x.dtype.name} (ONNX gives them one type)")


def _trunc(x: Tensor) -> Tensor: return x._unary(Ops.TRUNC)  # the IR's float TRUNC; Tensor has no method for it


# ---- activations ----
def _log1p(u: Tensor) -> Tensor:
  """log(1 + u) for u in [0, 1], Goldberg's form log(w) * u / (w - 1), w = 1 + u: the quotient cancels w's rounding, so the
  relative error stays a few ulp where log(w) alone loses every digit of a small u; w == 1 means u < half an ulp: u."""
  w = u + 1.0
  return w.eq(1.0).where(u, w.log() * u / (w - 1.0))


def _softplus(x: Tensor) -> Tensor:
  """log(1 + e^x) as max(x, 0) + log1p(e^-|x|): e^x never overflows, and the tail for very negative x keeps its digits."""
  return x.maximum(0.0) + _log1p((-x.abs()).exp())


def _np_softplus(x: np.ndarray) -> np.ndarray: return np.logaddexp(x, np.zeros_like(x))


def _prelu(n: OnnxNode, x: Tensor, s: Tensor) -> Tensor:
  if broadcast_shapes(x.shape, s.shape, op="PRelu") != x.shape:
    raise n.error(f"slope {s.shape} does not broadcast to the input {x.shape} (ONNX broadcasts it to the input only)")
  _same(n, x, s, "slope")
  return (x < 0).where(x * s, x)


def _np_prelu(n: OnnxNode, x: np.ndarray, s: np.ndarray) -> np.ndarray:
  if np.broadcast_shapes(x.shape, s.shape) != x.shape: raise n.error(f"slope {s.shape} does not broadcast to the input {x.shape}")
  return np.where(x < 0, x * s, x)


def _elu(n: OnnxNode, x: Tensor) -> Tensor:  # e^min(x, 0): the branch where() drops computes no inf
  return (x < 0).where((x.minimum(0.0).exp() - 1.0) * float(n.attr("alpha", 1.0)), x)


SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875  # ONNX's defaults (float32 values)


def _selu(n: OnnxNode, x: Tensor) -> Tensor:
  a, g = float(n.attr("alpha", SELU_ALPHA)), float(n.attr("gamma", SELU_GAMMA))
  return (x > 0).where(x, x.minimum(0.0).exp() * a - a) * g


def _np_selu(n: OnnxNode, x: np.ndarray) -> np.ndarray:
  a, g = n.attr("alpha", SELU_ALPHA), n.attr("gamma", SELU_GAMMA)
  return np.where(x > 0, x, np.exp(np.minimum(x, 0)) * a - a) * g


def _celu(n: OnnxNode, x: Tensor) -> Tensor:  # ONNX's formula as written: an e^(x/a) that overflows is dropped by the min (inf -> 0)
  a = float(n.attr("alpha", 1.0))
  return x.maximum(0.0) + (((x / a).exp() - 1.0) * a).minimum(0.0)


def _np_celu(n: OnnxNode, x: np.ndarray) -> np.ndarray:
  a = n.attr("alpha", 1.0)
  return np.maximum(x, 0) + np.minimum((np.exp(x / np.float32(a)) - 1) * a, 0)


def _hard_sigmoid(x: Tensor, alpha: float, beta: float) -> Tensor: return (x * alpha + beta).maximum(0.0).minimum(1.0)


def _np_hard_sigmoid(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
  return np.minimum(np.maximum(x * np.float32(alpha) + np.float32(beta), 0), 1)


# ---- Clip: bounds are attributes before opset 11, optional scalar inputs from it on ----
_FINITE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}


def _clip_limits(dt: DType) -> tuple[float | int, float | int]:
  """ONNX's default bounds: the type's lowest and largest *finite* values (an inf input becomes -+FLT_MAX, as onnxruntime)."""
  if dt.is_float: return -_FINITE_MAX[dt.name], _FINITE_MAX[dt.name]
  return dt.min, dt.max  # type: ignore[return-value]


def _clip_bound(n: OnnxNode, x: Tensor, b: Tensor | None, attr: str, lo: bool) -> Tensor | float | int:
  if n.opset < 11:
    v = n.attr(attr)
    return _clip_limits(x.dtype)[0 if lo else 1] if v is None else float(v)
  if attr in n.attrs: raise n.error(f"attribute {attr} is an input from opset 11 on")
  if b is None: return _clip_limits(x.dtype)[0 if lo else 1]
  _same(n, x, b, f"bound {attr}")
  if any(d != 1 for d in b.shape): raise n.error(f"bound {attr} must be a scalar, got shape {b.shape}")
  return b.reshape(())


def _clip(n: OnnxNode, x: Tensor, lo: Tensor | None = None, hi: Tensor | None = None) -> Tensor:
  """min(max(x, lo), hi): maximum/minimum propagate a NaN x; lo > hi gives hi everywhere, as ONNX says."""
  return x.maximum(_clip_bound(n, x, lo, "min", True)).minimum(_clip_bound(n, x, hi, "max", False))


def _np_clip(n: OnnxNode, x: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> np.ndarray:
  dl, dh = _clip_limits(dtypes.from_numpy(x.dtype))
  if n.opset < 11: lo, hi = np.asarray(n.attr("min", dl), x.dtype), np.asarray(n.attr("max", dh), x.dtype)
  return np.minimum(np.maximum(x, dl if lo is None else lo.reshape(())), dh if hi is None else hi.reshape(()))


# ---- rounding, sign, predicates ----
def _floor(n: OnnxNode, x: Tensor) -> Tensor:
  t = _trunc(x)
  return (t > x).where(t - 1.0, t)


def _ceil(n: OnnxNode, x: Tensor) -> Tensor:
  t = _trunc(x)
  return (t < x).where(t + 1.0, t)


def _round(n: OnnxNode, x: Tensor) -> Tensor:
  """Half to even: x - trunc(x) is exact, so a tie is seen exactly; it moves away from zero when trunc(x) is odd."""
  t = _trunc(x)
  d = (x - t).abs()
  odd = (_trunc(t * 0.5) * 2.0).ne(t)
  away = (d > 0.5) | (d.eq(0.5) & odd)
  return away.where((x < 0).where(t - 1.0, t + 1.0), t)


def _sign(n: OnnxNode, x: Tensor) -> Tensor:
  if x.dtype.is_bool: raise n.error("needs a numeric input, got bool")
  s = (x > 0).cast(x.dtype) if x.dtype.is_unsigned else (x > 0).cast(x.dtype) - (x < 0).cast(x.dtype)
  return x.ne(x).where(x, s) if x.dtype.is_float else s  # Sign(NaN) is NaN in onnxruntime


def _isinf(n: OnnxNode, x: Tensor) -> Tensor:
  pos, neg = n.attr("detect_positive", 1), n.attr("detect_negative", 1)
  if pos and neg: return x.abs().eq(math.inf)
  if pos or neg: return x.eq(math.inf if pos else -math.inf)
  return Tensor.full(x.shape, False, dtypes.bool)


def _np_isinf(n: OnnxNode, x: np.ndarray) -> np.ndarray:
  return (np.isposinf(x) & bool(n.attr("detect_positive", 1))) | (np.isneginf(x) & bool(n.attr("detect_negative", 1)))


def _xor(n: OnnxNode, a: Tensor, b: Tensor) -> Tensor:
  if not (a.dtype.is_bool and b.dtype.is_bool): raise n.error(f"needs bool inputs, got {a.dtype.name} and {b.dtype.name}")
  return a ^ b


def _np_xor(n: OnnxNode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  if a.dtype != np.bool_ or b.dtype != np.bool_: raise n.error(f"needs bool inputs, got {a.dtype} and {b.dtype}")
  return np.logical_xor(a, b)


# ---- Cos ----
def _cos(n: OnnxNode, x: Tensor) -> Tensor:
  """1 - 2 sin^2(x/2), computed in float64 (x/2 is exact) and rounded back: absolute error a few 1e-16 for any x, so a float32
  result is correctly rounded (<= 0.5 ulp against numpy's double cos over 1.4M inputs of every magnitude), beside cos's zeros
  too, where the formula in float32 is off by ~2e-7 absolute and sin(x + pi/2) loses |x| 2^-53 (all of it past |x| ~ 1e16).
  A float64 x gets that absolute error (3e-16 measured), so only relative accuracy next to the zeros suffers."""
  s = (x.cast(dtypes.float64) * 0.5).sin()
  return (1.0 - s * s * 2.0).cast(x.dtype)


# ---- Mod ----
def _fmod(a: Tensor, b: Tensor) -> Tensor:
  """C fmod (the dividend's sign), exact, for float16/bfloat16/float32 a and b, computed in float64 on |a| and |b|.
  A pass takes r -= q |b|, q = trunc(r / |b|) split Veltkamp-wise into hi (29 bits) + lo (24 bits): hi |b| and lo |b| are
  exact doubles, and so are both differences (r keeps <= 25 significant bits), so r stays exactly congruent to |a| mod |b|.
  The double quotient is off by at most q 2^-53 + 1, so a pass shrinks r by 2^52: 1 pass covers float16's quotients
  (< 2^40), 6 passes float32's and bfloat16's (< 2^277); the last leaves r in [-|b|, 2|b|), which two steps bring to
  [0, |b|). b = 0 or an infinite a give NaN (0/0, inf - inf), as fmod; an infinite b gives a back."""
  ra, rb = a.cast(dtypes.float64).abs(), b.cast(dtypes.float64).abs()
  r = ra
  for _ in range(1 if a.dtype == dtypes.float16 else 6):
    q = _trunc(r / rb)
    c = q * float(2 ** 24 + 1)
    hi = c - (c - q)
    r = (r - hi * rb) - (q - hi) * rb
  r = (r < 0).where(r + rb, r)
  r = (r >= rb).where(r - rb, r)
  r = (rb.eq(math.inf) & (ra < math.inf)).where(ra, r)  # 0 * inf made a NaN above
  return (a < 0).where(-r, r).cast(a.dtype)


def _mod(n: OnnxNode) -> Value:
  fmod = int(n.attr("fmod", 0))
  a, b = n.ins[0], n.ins[1]
  if a is None or b is None: raise n.error("needs two inputs")
  is_float = a.dtype.kind == "f" if isinstance(a, np.ndarray) else a.dtype.is_float
  if is_float and not fmod and n.opset < 28: raise n.error("fmod=0 on float inputs: ONNX requires fmod=1 for floats before opset 28")
  if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
    _fold_limit(n, [a, b])
    with np.errstate(all="ignore"): return np.asarray((np.fmod if fmod else np.mod)(a, b)).astype(a.dtype)
  ta, tb = n.t(0), n.t(1)
  _same(n, ta, tb, "the divisor")
  if ta.dtype == dtypes.float64: raise n.error("float64 Mod is not supported: an exact fmod needs products wider than float64")
  if ta.dtype.is_float:
    r = _fmod(ta, tb)
    if fmod: return r
    return (r.ne(0) & ((r < 0) ^ (tb < 0))).where(r + tb, r)  # fmod=0 (opset 28 on floats): the divisor's sign, as numpy's mod
  if not ta.dtype.is_int: raise n.error(f"needs numeric inputs, got {ta.dtype.name}")
  r = ta._bin(Ops.MOD, tb)  # the IR's integer MOD: C's remainder (exact; a zero divisor gives 0 where ONNX leaves it undefined)
  if fmod or ta.dtype.is_unsigned: return r
  return (r.ne(0) & ((r < 0) ^ (tb < 0))).where(r + tb, r)  # Python's modulo: the divisor's sign (r + b cannot overflow)


# ---- registration: op, handler, attributes ----
_op("Clip", _ew(_clip, _np_clip, floats=False), "min max")
_op("LeakyRelu", _ew(lambda n, x: (x < 0).where(x * float(n.attr("alpha", 0.01)), x),
                     lambda n, x: np.where(x < 0, x * np.float32(n.attr("alpha", 0.01)), x)), "alpha")
_op("PRelu", _ew(_prelu, _np_prelu, floats=False))
_op("Elu", _ew(_elu, lambda n, x: np.where(x < 0, (np.exp(np.minimum(x, 0)) - 1) * np.float32(n.attr("alpha", 1.0)), x)), "alpha")
_op("Selu", _ew(_selu, _np_selu), "alpha gamma")
_op("Celu", _ew(_celu, _np_celu), "alpha")
_op("ThresholdedRelu", _ew(lambda n, x: (x > float(n.attr("alpha", 1.0))).where(x, 0.0),
                           lambda n, x: np.where(x > n.attr("alpha", 1.0), x, 0)), "alpha")
_op("Softplus", _ew(lambda n, x: _softplus(x), lambda n, x: _np_softplus(x)))
_op("Softsign", _ew(lambda n, x: x / (x.abs() + 1.0), lambda n, x: x / (np.abs(x) + 1)))
_op("HardSigmoid", _ew(lambda n, x: _hard_sigmoid(x, float(n.attr("alpha", 0.2)), float(n.attr("beta", 0.5))),
                       lambda n, x: _np_hard_sigmoid(x, n.attr("alpha", 0.2), n.attr("beta", 0.5))), "alpha beta")
_op("HardSwish", _ew(lambda n, x: x * _hard_sigmoid(x, 1 / 6, 0.5), lambda n, x: x * _np_hard_sigmoid(x, 1 / 6, 0.5)))
_op("Mish", _ew(lambda n, x: x * _softplus(x).tanh(), lambda n, x: x * np.tanh(_np_softplus(x))))
_op("Sin", _ew(lambda n, x: x.sin(), lambda n, x: np.sin(x)))
_op("Cos", _ew(_cos, lambda n, x: np.cos(x)))
_op("Floor", _ew(_floor, lambda n, x: np.floor(x)))
_op("Ceil", _ew(_ceil, lambda n, x: np.ceil(x)))
_op("Round", _ew(_round, lambda n, x: np.round(x)))  # numpy rounds half to even too
_op("Sign", _ew(_sign, lambda n, x: np.sign(x), floats=False))
_op("IsNaN", _ew(lambda n, x: x.ne(x), lambda n, x: np.isnan(x)))
_op("IsInf", _ew(_isinf, _np_isinf), "detect_negative detect_positive")
_op("Xor", _ew(_xor, _np_xor, floats=False))
_op("Mod", _mod, "fmod")
