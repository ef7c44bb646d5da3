"""vmin/vmax: exact for constants, variables and ranges; sound for every ALU op (hypothesis, checked at random points)."""
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln_ir_testgen import INT_DTYPES, NAMES, bounded_vars, consts, points

from kiln.ir import AxisType, Ops, UOp, dtypes
from kiln.ir.alu import bitcast, cast, compute_np, exec_alu
from kiln.ir.analysis import sym_int_eval
from kiln.ir.verify import verify


def test_exact_for_consts_vars_ranges():
  assert (UOp.const(dtypes.int8, -7).vmin, UOp.const(dtypes.int8, -7).vmax) == (-7, -7)
  assert (UOp.const(dtypes.float32, 1.5).vmin, UOp.const(dtypes.float32, 1.5).vmax) == (1.5, 1.5)
  v = UOp.variable("n", -3, 12)
  assert (v.vmin, v.vmax) == (-3, 12)
  r = UOp.range(v.maximum(1), 0, AxisType.REDUCE)
  assert (r.vmin, r.vmax) == (0, 11) and (UOp.range(64, 1).vmin, UOp.range(64, 1).vmax) == (0, 63)
  assert ((v < 13).vmin, (v < 13).vmax) == (True, True) and ((v < 12).vmin, (v < 12).vmax) == (False, True)
  assert ((v * 2 + 1).vmin, (v * 2 + 1).vmax) == (-5, 25) and ((v // 2).vmin, (v // 2).vmax) == (-1, 6)  # truncating
  assert ((v % 5).vmin, (v % 5).vmax) == (-3, 4)
  big = UOp.variable("b", 0, 2**31 - 1)
  assert ((big + 1).vmin, (big + 1).vmax) == (-2**31, 2**31 - 1)  # may wrap: the whole dtype
  assert (UOp.variable("f", 2049, 2049).cast(dtypes.float16).vmax) == 2048.0  # the cast rounds; bounds follow
  nan_or_one = (v < 5).where(UOp.const(dtypes.float32, 1.0), UOp.const(dtypes.float32, math.nan))
  assert (nan_or_one.vmin, nan_or_one.vmax) == (-math.inf, math.inf)
  assert (nan_or_one.cast(dtypes.int32).vmin, nan_or_one.cast(dtypes.int32).vmax) == (-2**31, 2**31 - 1)  # NaN -> 0 is outside [1, 1]


BINARY = [Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR]


@st.composite
def any_expr(draw, dt, bounds, depth=4):
  """Random graphs over every integer ALU op, comparisons, where and casts (to other ints, bool, float16/32 and back)."""
  if depth == 0 or draw(st.integers(0, 3)) == 0:
    if draw(st.booleans()): return UOp.variable(n := draw(st.sampled_from(NAMES)), *bounds[n], dtype=dt)
    return UOp.const(dt, draw(consts(dt)))
  kind = draw(st.sampled_from(["bin"] * 5 + ["neg", "where", "cast", "castf", "shiftc"]))
  x = draw(any_expr(dt, bounds, depth - 1))
  if kind == "neg": return x if dt.kind == "u" else -x
  if kind == "shiftc": return x.alu(draw(st.sampled_from([Ops.SHL, Ops.SHR])), UOp.const(dt, draw(st.integers(0, dt.bits + 2))))
  if kind == "cast":
    mid = draw(st.sampled_from([dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.bool]))
    return x.cast(mid).cast(dt)
  if kind == "castf":
    f = draw(st.sampled_from([dtypes.float16, dtypes.float32, dtypes.bfloat16]))
    return (x.cast(f) * UOp.const(f, draw(st.sampled_from([1.0, 0.5, -3.0])))).cast(dt) if draw(st.booleans()) else x.cast(f).cast(dt)
  y = draw(any_expr(dt, bounds, depth - 1))
  if kind == "where":
    c = draw(st.sampled_from([Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE]))
    return x.alu(c, y).where(x, draw(any_expr(dt, bounds, depth - 1)))
  return x.alu(draw(st.sampled_from(BINARY)), y)


def eval_all(root, env):
  vals = {}
  for u in root.toposort():
    if u.op is Ops.CONST: vals[u] = np.asarray(u.arg, compute_np(u.dtype))
    elif u.op is Ops.DEFINE_VAR: vals[u] = np.asarray(env[u.arg[0]], compute_np(u.dtype))
    elif u.op is Ops.CAST: vals[u] = cast(vals[u.src[0]], u.src[0].dtype, u.dtype)
    elif u.op is Ops.BITCAST: vals[u] = bitcast(vals[u.src[0]], u.src[0].dtype, u.dtype)
    else: vals[u] = exec_alu(u.op, u.dtype, *(vals[s] for s in u.src))
  return vals


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_bounds_are_sound_for_every_op(data):
  dt = data.draw(st.sampled_from(INT_DTYPES))
  bounds = data.draw(bounded_vars(dt))
  e = data.draw(any_expr(dt, bounds))
  for env in data.draw(points(bounds, 4)):
    for u, v in eval_all(e, env).items():
      x = v.item()
      if isinstance(x, float) and math.isnan(x): continue  # NaN has no place in an order; casts of it are still checked
      assert u.vmin <= x <= u.vmax, f"{u.op} {u.dtype}: value {x} outside [{u.vmin}, {u.vmax}] at {env}"


def test_clamps_and_bitwise_with_constants_are_tight():
  """min/max written as where (integer minimum() builds (a < b).where(a, b)) take the bounds of a min/max, not the union of
  the arms, so the natural clamp proves an index in bounds; XOR and AND with a constant keep the bits they cannot touch."""
  x, n = UOp.variable("x", -50, 500), UOp.variable("n", 1, 64)
  clamped = x.maximum(0).minimum(n - 1)
  assert (clamped.vmin, clamped.vmax) == (0, 63)
  assert ((x < n).where(n, x).vmin, (x < n).where(n, x).vmax) == (1, 500)  # max(x, n)
  assert ((x < n).where(x, n).vmin, (x < n).where(x, n).vmax) == (-50, 64)  # min(x, n)
  buf, out = UOp.define_global(1, dtypes.float32.ptr(64)), UOp.define_global(0, dtypes.float32.ptr(1))
  verify(UOp.sink(out.index(0).store(buf.index(clamped).load()), name="gather_clamped"))  # was rejected: index bounds [-50, 500]
  i = UOp.variable("i", 0, 100)
  assert ((i ^ -1).vmin, (i ^ -1).vmax) == (-101, -1)
  assert ((x ^ -1).vmin, (x ^ -1).vmax) == (-501, 49)
  assert ((i ^ 256).vmin, (i ^ 256).vmax) == (256, 383) and ((i ^ -128).vmin, (i ^ -128).vmax) == (-128, -1)
  assert ((x & 15).vmin, (x & 15).vmax) == (0, 15)


def test_a_where_on_a_bound_of_x_bounds_an_arm_affine_in_x_over_the_x_it_is_chosen_for():
  """min(2r + 1, 1499) as the simplifier writes it, (r < 749).where(2r + 1, 1499), is at most 1499, not 2047: the union of
  the arms proved a TopK's padded bitonic read (yolo26n) past its 3000-element buffer and the verifier refused the kernel."""
  r = UOp.variable("r", 0, 1023)
  assert ((e := (r < 749).where(r * 2 + 1, 1499)).vmin, e.vmax) == (1, 1499)
  assert ((e := (r < 749).where(1499, r * 2 + 1)).vmin, e.vmax) == (1499, 2047)  # the false arm: r >= 749
  assert ((e := (UOp.const(dtypes.int32, 100) < r).where(r - 100, 0)).vmin, e.vmax) == (0, 923)  # 100 < r: r - 100 >= 1
  assert ((e := (r < 749).where(r * -3, 5)).vmin, e.vmax) == (-2244, 5)  # a negative slope
  assert ((e := (UOp.const(dtypes.int32, 100) < r).where(0, r + 1)).vmin, e.vmax) == (0, 101)  # the false arm of 100 < r: r <= 100
  x8 = UOp.variable("x8", 0, 10, dtype=dtypes.int8)  # a step that wraps in int8 (x * 30 for x >= 5): the arm's own bounds
  assert ((e := (x8 < 9).where(x8 * 30 - 100, 0)).vmin, e.vmax) == (dtypes.int8.min, dtypes.int8.max)
  buf, out = UOp.define_global(1, dtypes.float32.ptr(3000)), UOp.define_global(0, dtypes.float32.ptr(1))
  i = UOp.variable("b", 0, 1) * 1500 + (r < 749).where(r * 2 + 1, 1499)
  verify(UOp.sink(out.index(0).store(buf.index(i).load()), name="bitonic_pad_read"))  # was rejected: proven only in [1, 3547]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(INT_DTYPES), st.data())
def test_min_max_and_constant_bitwise_bounds_are_sound(dt, data):
  lo_a, lo_b = (data.draw(st.integers(int(dt.min), int(dt.max))) for _ in range(2))
  a = UOp.variable("a", lo_a, data.draw(st.integers(lo_a, int(dt.max))), dtype=dt)
  b = UOp.variable("b", lo_b, data.draw(st.integers(lo_b, int(dt.max))), dtype=dt)
  k = UOp.const(dt, data.draw(consts(dt)))
  exprs = [(a < b).where(a, b), (a < b).where(b, a), (b < a).where(a, b), a ^ k, k ^ a, a & k, a.minimum(b).maximum(k)]
  for _ in range(8):
    env = {"a": data.draw(st.integers(a.arg[1], a.arg[2])), "b": data.draw(st.integers(b.arg[1], b.arg[2]))}
    for e in exprs:
      v = sym_int_eval(e, env)
      assert e.vmin <= v <= e.vmax, f"{e} = {v} at {env} outside [{e.vmin}, {e.vmax}]"


def test_exact_int_bounds_see_what_terms_share() -> None:
  """vmin/vmax bound each node alone; exact_int_bounds evaluates at every point: j - j % 16 (a peeled vector axis's
  shifted index) is within [0, 112], which the interval bounds cannot prove."""
  from kiln.ir.analysis import exact_int_bounds
  j = UOp.range(128, 1)
  e = j - j % 16
  assert (e.vmin, e.vmax) == (-15, 127)
  assert exact_int_bounds(e) == (0, 112)
  k = UOp.range(5, 2)
  assert exact_int_bounds((e.minimum(111) + j % 16) * 3 - k) == (-4, 378)
  assert exact_int_bounds(j + UOp.variable("n", 0, 4)) is None  # another leaf
  assert exact_int_bounds(j * UOp.range(1024, 3)) is None  # more points than the limit
  assert exact_int_bounds(j * UOp.range(1024, 3), limit=1 << 17) == (0, 127 * 1023)
