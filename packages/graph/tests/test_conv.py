"""Tensor.conv2d against a direct numpy convolution (stride, padding, dilation, groups, 1x1, 1-3 spatial dims), the
kernels it schedules (a matmul-shaped product the codegen tiles and packs, reading a padded input through the pad's bounds
test; no input kernel for a 1x1), the packed panel's masked row copies against the realized padded input (bit for bit),
Tensor.contiguous, and the ONNX Conv op against onnxruntime."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.codegen.choose import OptOps, Target, heuristic_opts
from kiln.codegen.lowering.prepare import prepare
from kiln.graph import GraphError, Tensor, compile
from kiln.graph.schedule import Compiled
from kiln.ir.ops import Ops
from kiln.ir.symbolic import simplify

RNG = np.random.default_rng(15)


def conv_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, st: list[int], pads: list[tuple[int, int]], dl: list[int],
             groups: int) -> np.ndarray:
  """float64 convolution as a sum over kernel offsets of strided slices times the weight's channel matrix."""
  x, w = x.astype(np.float64), w.astype(np.float64)
  n, d = x.shape[0], w.ndim - 2
  o, cg = w.shape[:2]
  og = o // groups
  xp = np.pad(x, ((0, 0), (0, 0), *pads))
  ks = w.shape[2:]
  out = [(xp.shape[2 + i] - (ks[i] - 1) * dl[i] - 1) // st[i] + 1 for i in range(d)]
  y = np.zeros((n, o, *out))
  for g in range(groups):
    for off in itertools.product(*(range(k) for k in ks)):
      sl = tuple(slice(off[i] * dl[i], off[i] * dl[i] + (out[i] - 1) * st[i] + 1, st[i]) for i in range(d))
      xs = xp[(slice(None), slice(g * cg, (g + 1) * cg), *sl)]
      y[:, g * og:(g + 1) * og] += np.einsum("nc...,oc->no...", xs, w[(slice(g * og, (g + 1) * og), slice(None), *off)])
  return y if b is None else y + b.astype(np.float64).reshape(1, o, *[1] * d)


def rand(*shape: int) -> np.ndarray: return RNG.uniform(-1, 1, shape).astype(np.float32)


def matmul_kernels(c: Compiled) -> list[str]:
  """The kernels the CPU heuristic gives the matmul options (a register tile with a packed panel)."""
  out = []
  for k in c.kernels:
    opts = heuristic_opts(prepare(k.ast)[0], Target(threads=2))
    if any(o.op is OptOps.PACK for o in opts) and any(o.op is OptOps.UNROLL for o in opts): out.append(k.ast.arg)
  return out


# (input shape, weight shape, stride, padding (int or (before, after) per dim), dilation, groups, bias)
CASES = [
  ((2, 4, 9, 8), (6, 4, 3, 3), 1, 1, 1, 1, True),  # same-size 3x3
  ((1, 3, 7, 5), (5, 3, 3, 3), 1, 0, 1, 1, False),  # valid, batch 1, odd sizes
  ((3, 4, 11, 10), (6, 4, 3, 2), (2, 1), ((1, 0), (2, 1)), (2, 1), 1, True),  # stride, asymmetric pads, dilation
  ((2, 5, 13, 9), (7, 5, 5, 5), 3, 2, 1, 1, True),  # 5x5 stride 3
  ((2, 8, 6, 7), (8, 4, 3, 3), 1, 1, 1, 2, True),  # two groups
  ((2, 6, 9, 7), (6, 1, 3, 3), 2, 1, 1, 6, True),  # depthwise
  ((2, 3, 8, 8), (6, 1, 3, 3), 1, 1, 1, 3, False),  # depthwise with two outputs per channel
  ((1, 3, 7, 5), (5, 3, 1, 1), 1, 0, 1, 1, True),  # 1x1
  ((2, 4, 5, 5), (4, 2, 1, 1), 1, 0, 1, 2, False),  # grouped 1x1
  ((2, 4, 9, 8), (6, 4, 1, 1), 2, 0, 1, 1, True),  # strided 1x1
  ((2, 4, 6, 6), (6, 4, 1, 1), 1, 1, 1, 1, False),  # padded 1x1
  ((1, 2, 10), (3, 2, 3), 1, 2, 2, 1, True),  # 1-d, dilated
  ((2, 2, 5, 4, 6), (3, 2, 3, 2, 3), (1, 2, 1), 1, 1, 1, True),  # 3-d
  ((32, 16, 8, 8), (32, 16, 3, 3), 1, 1, 1, 1, True),  # big enough for the threaded tile
]


def _spec(stride, padding, dilation, d: int) -> tuple[list[int], list[tuple[int, int]], list[int]]:
  st = [stride] * d if isinstance(stride, int) else list(stride)
  dl = [dilation] * d if isinstance(dilation, int) else list(dilation)
  pads = [(padding, padding)] * d if isinstance(padding, int) else [tuple(p) for p in padding]
  return st, pads, dl


@pytest.mark.parametrize("xs,ws,stride,padding,dilation,groups,bias", CASES)
@pytest.mark.parametrize("fuse", [True, False])
def test_conv_matches_numpy(xs, ws, stride, padding, dilation, groups, bias, fuse: bool) -> None:
  x, w = rand(*xs), rand(*ws)
  b = rand(ws[0]) if bias else None
  st, pads, dl = _spec(stride, padding, dilation, len(ws) - 2)
  t = Tensor.input("x", xs).conv2d(Tensor(w), None if b is None else Tensor(b), st, pads, dl, groups)
  got = compile([t], fuse=fuse).run({"x": x})[0]
  want = conv_ref(x, w, b, st, pads, dl, groups)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_kernels() -> None:
  """Which kernels each kind of conv takes: a product the heuristic tiles, reading a padded input in place (gated loads,
  no padded copy); a 1x1 reads its input as the matrix; a depthwise conv one window sum."""
  x = Tensor.input("x", (2, 8, 10, 10))
  c = compile([x.conv2d(Tensor(rand(16, 8, 3, 3)), Tensor(rand(16)), padding=1)])
  assert c.kernel_count == 2, c.plan.describe()  # product (padding read in place), bias (the graph's output)
  assert len(matmul_kernels(c)) == 1
  c = compile([x.conv2d(Tensor(rand(16, 8, 3, 3)), Tensor(rand(16)))])
  assert c.kernel_count == 2 and len(matmul_kernels(c)) == 1, c.plan.describe()
  c = compile([x.conv2d(Tensor(rand(16, 8, 3, 3)), stride=2, padding=1, dilation=2)])
  assert c.kernel_count == 3 and len(matmul_kernels(c)) == 1, c.plan.describe()  # strided: a padded copy, product, output
  c = compile([x.conv2d(Tensor(rand(16, 8, 1, 1)), Tensor(rand(16)))])
  assert c.kernel_count == 2 and len(matmul_kernels(c)) == 1, c.plan.describe()  # product, bias
  xw = Tensor.input("x", (2, 8, 10, 20))  # rows of at least BLOCK outputs: a depthwise conv stays NCHW
  c = compile([xw.conv2d(Tensor(rand(8, 1, 3, 3)), padding=1, groups=8)])
  assert c.kernel_count == 1 and matmul_kernels(c) == [], c.plan.describe()  # depthwise: the window sum, padding inline
  c = compile([x.conv2d(Tensor(rand(8, 1, 3, 3)), padding=1, groups=8)])  # narrower rows: the blocked layout
  assert c.kernel_count == 3 and matmul_kernels(c) == [], c.plan.describe()  # to blocks, the window sum, back to NCHW
  # a weight that is not an array is realized as a flat (O, C*kh*kw) matrix first: one more kernel
  w = Tensor.input("w", (16, 8, 3, 3))
  c = compile([x.conv2d(w, padding=1)])
  assert c.kernel_count == 3 and len(matmul_kernels(c)) == 1, c.plan.describe()
  xn, wn = rand(2, 8, 10, 10), rand(16, 8, 3, 3)
  np.testing.assert_allclose(c.run({"x": xn, "w": wn})[0], conv_ref(xn, wn, None, [1, 1], [(1, 1)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xs,ws,stride,padding,dilation,groups,bias", [c for c in CASES if c[3] != 0 and c[1][1] != 1])  # not depthwise
def test_padding_read_in_place_matches_the_padded_copy(monkeypatch, xs, ws, stride, padding, dilation, groups, bias) -> None:
  """A padded conv reads its input through the pad (gated loads; its packed panel masked loads) in one kernel fewer than
  the realized padded copy (conv.PAD_INLINE = False), with the same bits: the same product, only its panel copied another way."""
  import kiln.graph.conv as conv_mod
  monkeypatch.setenv("KILN_WINOGRAD", "0")  # the direct product's two ways of reading the pad (winograd.py pads one way)
  x, w = rand(*xs), rand(*ws)
  b = rand(ws[0]) if bias else None
  st, pads, dl = _spec(stride, padding, dilation, len(ws) - 2)
  got, counts = [], []
  for inline in (True, False):
    monkeypatch.setattr(conv_mod, "PAD_INLINE", inline)
    c = compile([Tensor.input("x", xs).conv2d(Tensor(w), None if b is None else Tensor(b), st, pads, dl, groups)])
    got.append(c.run({"x": x})[0])
    counts.append(c.kernel_count)
  np.testing.assert_allclose(got[0], conv_ref(x, w, b, st, pads, dl, groups), rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(got[0], got[1])
  assert counts[0] == counts[1] - 1


def _alu_max_kernels(c: Compiled) -> list[str]:
  """The kernels computing an elementwise maximum (a relu), not counting a max reduction."""
  from kiln.ir.ops import Ops
  return [k.ast.arg for k in c.kernels if any(u.op is Ops.MAX for u in k.ast.toposort())]


def test_conv_epilogue_in_the_product_kernel() -> None:
  """Batch norm, relu and a 2x2 max pool after a padded conv: the pool reads each element once, so the product's kernel
  applies batch norm and relu as its epilogue and the pool kernel is a plain max over the window; the next conv reads the
  pooled buffer through its padding (a reduction under the padding's bounds test is slower, so the pool is realized)."""
  x, w1, w2 = rand(2, 3, 12, 12), rand(8, 3, 3, 3), rand(8, 8, 3, 3)
  a, s = rand(1, 8, 1, 1), rand(1, 8, 1, 1)
  h = (Tensor.input("x", x.shape).conv2d(Tensor(w1), padding=1) * Tensor(a) + Tensor(s)).relu().max_pool([2, 2])
  c = compile([h.conv2d(Tensor(w2), padding=1)])
  assert c.kernel_count == 4, c.plan.describe()  # product+bn+relu, pool, product, the output copy
  mm = matmul_kernels(c)
  assert len(mm) == 2 and _alu_max_kernels(c) == [mm[0]], (mm, _alu_max_kernels(c))
  r = np.maximum(conv_ref(x, w1, None, [1, 1], [(1, 1)] * 2, [1, 1], 1) * a + s, 0)
  r = r.reshape(2, 8, 6, 2, 6, 2).max((3, 5))
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(r, w2, None, [1, 1], [(1, 1)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)


def test_depthwise_input_computed_once() -> None:
  """A depthwise conv reads each input element once per tap of its windows: a computed input (here a relu) is realized
  first, so the window sum reads a buffer instead of recomputing the relu per tap."""
  from kiln.ir.ops import Ops
  x, w = rand(2, 4, 6, 18), rand(4, 1, 3, 3)
  c = compile([Tensor.input("x", x.shape).relu().conv2d(Tensor(w), padding=1, groups=4)])
  sums = [k.ast.arg for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert c.kernel_count == 2 and len(sums) == 1 and sums[0] not in _alu_max_kernels(c), c.plan.describe()
  want = conv_ref(np.maximum(x, 0), w, None, [1, 1], [(1, 1)] * 2, [1, 1], 4)
  np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_depthwise_narrow_rows_vectorised(monkeypatch) -> None:
  """A depthwise conv over a 9-wide map (ConvMixer's) in NCHW takes its output rows as one 9-lane vector, not a scalar loop."""
  from kiln.graph import conv
  from kiln.ir.ops import Ops
  monkeypatch.setattr(conv, "DEPTHWISE_BLOCKED", False)
  x, w = rand(2, 4, 9, 9), rand(4, 1, 5, 5)
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), padding=2, groups=4)])
  k = next(k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort()))
  opts = heuristic_opts(prepare(k.ast)[0], Target(vector_bytes=64, threads=2))
  assert any(o.op is OptOps.UPCAST and o.amount == 9 for o in opts), opts
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, None, [1, 1], [(2, 2)] * 2, [1, 1], 4), rtol=1e-4, atol=1e-4)


# (input shape, kernel, stride, padding, dilation): depthwise convs whose output rows are narrower than
# a block, so they run in the blocked layout: channels that fill no block, one block and a half, strides, dilation, 1-d
BLOCKED = [((2, 5, 6, 6), (3, 3), 1, 1, 1), ((2, 24, 4, 4), (5, 5), 1, 4, 2), ((1, 16, 9, 8), (3, 3), 2, ((1, 0), (1, 1)), 1),
           ((2, 40, 7, 5), (5, 3), (2, 1), 2, (1, 2)), ((2, 6, 2, 2), (5, 5), 1, 2, 1), ((2, 20, 11), (7,), 1, 3, 1)]


@pytest.mark.parametrize("xs,ks,stride,padding,dilation", BLOCKED)
@pytest.mark.parametrize("weight", ["array", "input"])
def test_depthwise_blocked_matches_numpy(xs, ks, stride, padding, dilation, weight: str) -> None:
  """A depthwise conv in the blocked channel layout against numpy: channels padded to whole blocks and cropped, the pad
  read in place, a weight array reordered in numpy or a computed weight reordered by a kernel, the bias per channel."""
  x, w, b = rand(*xs), rand(xs[1], 1, *ks), rand(xs[1])
  d = len(ks)
  st, pads, dl = _spec(stride, padding, dilation, d)
  wt = Tensor(w) if weight == "array" else Tensor.input("w", w.shape)
  c = compile([Tensor.input("x", xs).conv2d(wt, Tensor(b), stride=stride, padding=padding, dilation=dilation, groups=xs[1])])
  assert any(k.ast.arg.endswith("x16") for k in c.kernels), c.plan.describe()  # the window sum over (N, C/16, *out, 16)
  got = c.run({"x": x} if weight == "array" else {"x": x, "w": w})[0]
  np.testing.assert_allclose(got, conv_ref(x, w, b, st, pads, dl, xs[1]), rtol=1e-4, atol=1e-4)


def test_depthwise_blocked_vectorised_across_channels() -> None:
  """The blocked window sum's vector is the 16 channels of a block (the last axis), whatever the rows' width."""
  from kiln.ir.ops import Ops
  x, w = rand(2, 32, 4, 4), rand(32, 1, 5, 5)
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), padding=2, groups=32)])
  k = next(k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort()))
  ast = prepare(k.ast)[0]
  last = max(u.arg[0] for u in ast.toposort() if u.op is Ops.RANGE and u.arg[1].name == "LOOP")
  for t in (Target(vector_bytes=64, threads=2), Target(vector_bytes=32, threads=2)):
    assert any(o.op is OptOps.UPCAST and o.axis == last and o.amount in (8, 16) for o in heuristic_opts(ast, t)), heuristic_opts(ast, t)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, None, [1, 1], [(2, 2)] * 2, [1, 1], 32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ks,stride,padding", [((3, 3), 2, 1), ((5, 5), 2, 2), ((3, 3), (1, 2), ((1, 0), (0, 1)))])
def test_strided_depthwise_reads_a_padded_copy(ks, stride, padding) -> None:
  """A depthwise conv strided along its rows (rows of 16+ outputs: NCHW) reads a realized padded copy of its input, so
  its window sum loads without a bounds test (strided gated loads were a gather of scalars), against numpy. A computed
  input (the relu) is realized before it is padded: padded as computed, its loads' indices were clamped (a gather)."""
  x, w, b = rand(2, 6, 9, 34), rand(6, 1, *ks), rand(6)
  st, pads, dl = _spec(stride, padding, 1, 2)
  c = compile([Tensor.input("x", x.shape).relu().conv2d(Tensor(w), Tensor(b), stride=stride, padding=padding, groups=6)])
  sums = [k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert c.kernel_count == 3 and len(sums) == 1, c.plan.describe()  # the relu, its padded copy, the window sum
  assert not any(u.op is Ops.INDEX and len(u.src) > 2 for u in sums[0].ast.toposort()), "the window sum's loads are gated"
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(np.maximum(x, 0), w, b, st, pads, dl, 6), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xs,ws,stride,padding", [((2, 3, 32, 32), (16, 3, 7, 7), 2, 3), ((1, 8, 9, 9), (8, 8, 3, 3), 2, 1),
                                                   ((1, 4, 12, 30), (8, 4, 3, 3), (1, 3), ((0, 1), (2, 2)))])
def test_strided_product_reads_a_padded_copy(xs, ws, stride, padding) -> None:
  """A padded conv strided along its rows, over at least BLOCK output positions (its product in NCHW), reads a realized
  padded copy of its input: its packed panel's rows (positions `stride` apart) load a masked span, no bounds test,
  against numpy. A ResNet stem's 7x7 at stride 2; a 3x3 at stride 2 over a 9x9 map (5x5 outputs); a stride along the rows only."""
  x, w, b = rand(*xs), rand(*ws), rand(ws[0])
  st, pads, dl = _spec(stride, padding, 1, 2)
  c = compile([Tensor.input("x", xs).conv2d(Tensor(w), Tensor(b), stride=stride, padding=padding).relu()])
  padded = tuple(n + p0 + p1 for n, (p0, p1) in zip(xs[2:], pads))
  assert [k.ast.arg for k in c.kernels if k.ast.arg.startswith("elementwise")][0] == "elementwise_" + "x".join(map(str, (*xs[:2], *padded)))
  sums = [k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert len(sums) == 1 and not any(u.op is Ops.INDEX and len(u.src) > 2 for u in sums[0].ast.toposort()), "the product's loads are gated"
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(conv_ref(x, w, b, st, pads, dl, 1), 0), rtol=1e-4, atol=1e-4)


def test_depthwise_window_rows_unrolled_where_they_slide_along_the_vector() -> None:
  """An NCHW depthwise conv's 5-tap window rows slide along its vector (each tap's load one element on): the heuristic
  unrolls them whole. In the blocked layout a tap steps a whole vector: the row keeps its loop."""
  def window_unrolls(xs: tuple[int, ...]) -> list[int]:
    c = compile([Tensor.input("x", xs).conv2d(Tensor(rand(xs[1], 1, 5, 5)), padding=2, groups=xs[1])])
    k = next(k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort()))
    ast = prepare(k.ast)[0]
    red = {u.arg[0] for u in ast.toposort() if u.op is Ops.RANGE and u.arg[1].name == "REDUCE"}
    return [o.amount for o in heuristic_opts(ast, Target(vector_bytes=64, threads=2)) if o.op is OptOps.UNROLL and o.axis in red]
  assert window_unrolls((2, 8, 6, 20)) == [5]  # NCHW (rows of 16+)
  assert window_unrolls((2, 32, 4, 4)) == []  # blocked


def test_blocked_depthwise_over_rows_of_nine_sums_three_outputs_at_once() -> None:
  """Each output of a blocked depthwise conv is a chain of dependent adds as long as its window; the heuristic unrolls an
  output axis to interleave chains, by 3 where neither 4 nor 2 divides it (ConvMixer's 9x9 maps had a single chain),
  against numpy."""
  x, w, b = rand(2, 32, 9, 9), rand(32, 1, 7, 7), rand(32)
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), padding=3, groups=32)])
  k = next(k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort()))
  ast = prepare(k.ast)[0]
  out = {u.arg[0]: u for u in ast.toposort() if u.op is Ops.RANGE and u.arg[1].name != "REDUCE"}
  opts = heuristic_opts(ast, Target(vector_bytes=64, threads=2))
  unrolls = [(int(out[o.axis].src[0].arg), o.amount) for o in opts if o.op is OptOps.UNROLL and o.axis in out]
  assert unrolls == [(9, 3)], (k.ast.arg, unrolls)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, b, [1, 1], [(3, 3)] * 2, [1, 1], 32), rtol=1e-4, atol=1e-4)


# (input shape, weight shape, stride, padding, dilation, groups): kernels with taps that read only padding
PAD_TAPS = [((2, 6, 2, 2), (6, 1, 5, 5), 1, 2, 1, 6), ((2, 8, 4, 4), (6, 8, 3, 3), 1, 12, 12, 1), ((1, 16, 2, 2), (16, 1, 7, 7), 1, 3, 1, 16),
            ((2, 4, 3, 5), (5, 4, 5, 3), 2, ((4, 1), (1, 1)), (1, 2), 1), ((2, 3, 3), (4, 3, 7), 1, ((5, 3),), 1, 1)]


@pytest.mark.parametrize("xs,ws,stride,padding,dilation,groups", PAD_TAPS)
@pytest.mark.parametrize("weight", ["array", "input"])
def test_taps_reading_only_padding_are_dropped(xs, ws, stride, padding, dilation, groups, weight: str) -> None:
  """A kernel tap that reads only padding at every output position adds zeros: the conv drops it (a weight array sliced
  in numpy, a computed one through a view), keeping the output's size, against numpy."""
  x, w, b = rand(*xs), rand(*ws), rand(ws[0])
  st, pads, dl = _spec(stride, padding, dilation, len(ws) - 2)
  wt = Tensor(w) if weight == "array" else Tensor.input("w", w.shape)
  c = compile([Tensor.input("x", xs).conv2d(wt, Tensor(b), stride=stride, padding=padding, dilation=dilation, groups=groups)])
  got = c.run({"x": x} if weight == "array" else {"x": x, "w": w})[0]
  np.testing.assert_allclose(got, conv_ref(x, w, b, st, pads, dl, groups), rtol=1e-4, atol=1e-4)


def test_an_atrous_conv_over_a_small_map_is_its_centre_tap() -> None:
  """DeepLabV3's atrous 3x3 conv of dilation 12 over a 4x4 map reads its input with the centre tap alone: a 1x1 conv,
  one product reading the input as its matrix (no window view, no padded reads)."""
  x, w = rand(2, 8, 4, 4), rand(6, 8, 3, 3)
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), padding=12, dilation=12)])
  sums = [k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert len(sums) == 1 and not any(u.op is Ops.INDEX and len(u.src) > 2 for u in sums[0].ast.toposort()), c.plan.describe()
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, None, [1, 1], [(12, 12)] * 2, [12, 12], 1), rtol=1e-4, atol=1e-4)


# (input shape, weight shape, stride, padding, groups): convs over fewer output positions than a block, whose product
# runs channels-last: 1x1 over a 2x2 map, a 3x3 over a 3x3 map, grouped, strided, 1-d
FEW_POSITIONS = [((2, 24, 2, 2), (40, 24, 1, 1), 1, 0, 1), ((1, 8, 3, 3), (12, 8, 3, 3), 1, 1, 1), ((2, 8, 3, 3), (6, 4, 1, 1), 1, 0, 2),
                 ((2, 6, 7, 6), (10, 6, 3, 3), 2, 1, 1), ((2, 5, 9), (7, 5, 3), 1, 0, 1)]


@pytest.mark.parametrize("xs,ws,stride,padding,groups", FEW_POSITIONS)
@pytest.mark.parametrize("weight", ["array", "input"])
def test_few_positions_channels_last_matches_numpy(xs, ws, stride, padding, groups, weight: str) -> None:
  """A conv over fewer output positions than a block computes its product as (g, N*P, O/g), read back as NCHW."""
  x, w, b = rand(*xs), rand(*ws), rand(ws[0])
  st, pads, dl = _spec(stride, padding, 1, len(ws) - 2)
  wt = Tensor(w) if weight == "array" else Tensor.input("w", w.shape)
  c = compile([Tensor.input("x", xs).conv2d(wt, Tensor(b), stride=stride, padding=padding, groups=groups).relu()])
  sums = [k.ast.arg for k in c.kernels if k.ast.arg.startswith("reduce")]
  assert len(sums) == 1 and sums[0].endswith(f"x{ws[0] // groups}"), c.plan.describe()  # the output channels are the last axis
  got = c.run({"x": x} if weight == "array" else {"x": x, "w": w})[0]
  np.testing.assert_allclose(got, np.maximum(conv_ref(x, w, b, st, pads, dl, groups), 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weight", ["array", "input"])
def test_few_positions_product_reads_realized_patches(weight: str) -> None:
  """A padded 3x3 conv over 3x3 maps (SqueezeNet's last expand convs) realizes its patches, (g, N*P, K), K = (*k, C/g), and
  its product reads them with plain loads: no bounds test, no division of K into channel and tap, against numpy. The
  copy writes them as (g, N*P, kh, kw * C/g): its inner axis a run of the channels-last input. Of at most 32 output
  channels (each patch read once) it reads its input in place."""
  x, w, b = rand(2, 24, 3, 3), rand(40, 24, 3, 3), rand(40)
  wt = Tensor(w) if weight == "array" else Tensor.input("w", w.shape)
  c = compile([Tensor.input("x", x.shape).conv2d(wt, Tensor(b), padding=1).relu()])
  assert "elementwise_1x18x3x72" in [k.ast.arg for k in c.kernels], c.plan.describe()
  few = compile([Tensor.input("x", x.shape).conv2d(Tensor(w[:32]), padding=1)])  # one tile of columns: read in place
  assert "elementwise_1x18x3x72" not in [k.ast.arg for k in few.kernels], few.plan.describe()
  sums = [k for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert len(sums) == 1, c.plan.describe()
  body = sums[0].ast.toposort()
  # what the lowering's simplifier leaves of each load's index (the copy's (g, N*P, kh, kw * C/g) read as (g, N*P, K))
  indices = [simplify(u.src[1]).toposort() for u in body if u.op is Ops.INDEX]
  k_divided = [u for ix in indices for u in ix
               if u.op in (Ops.IDIV, Ops.MOD) and any(r.op is Ops.RANGE and r.arg[1].name == "REDUCE" for r in u.toposort())]
  assert not any(u.op is Ops.INDEX and len(u.src) > 2 for u in body) and not k_divided
  got = c.run({"x": x} if weight == "array" else {"x": x, "w": w})[0]
  np.testing.assert_allclose(got, np.maximum(conv_ref(x, w, b, [1, 1], [(1, 1)] * 2, [1, 1], 1), 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hw,o,channels_last", [(7, 64, True), (14, 64, True), (7, 24, False), (8, 64, False), (16, 64, False)])
def test_small_maps_product_channels_last_where_it_fills_the_tile(monkeypatch, hw: int, o: int, channels_last: bool) -> None:
  """A 3x3 conv over maps of fewer than CHANNELS_LAST_POSITIONS positions, no whole number of vectors, with its weight in
  blocks of output channels (ResNet's last stage over 7x7 maps) runs its product channels-last, over patches copied from
  the input realized channels-last: (N, H+2, W+2, C). Of 24 output channels (its product would read the window view),
  over 8x8 maps (whole vectors) or over 16x16 maps it stays NCHW (Winograd off: it takes 14x14 and 16x16). Against numpy."""
  from kiln.graph import winograd
  monkeypatch.setattr(winograd, "enabled", lambda: False)
  x, w, b = rand(2, 16, hw, hw), rand(o, 16, 3, 3), rand(o)
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), padding=1).relu()])
  names = [k.ast.arg for k in c.kernels]
  sums = [k for k in names if k.startswith("reduce")]
  assert len(sums) == 1 and sums[0].endswith("x32") == channels_last, names  # channels-last: blocks of 32 output channels
  assert (f"elementwise_2x{hw + 2}x{hw + 2}x16" in names) == channels_last, names  # the input padded, channels-last
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(conv_ref(x, w, b, [1, 1], [(1, 1)] * 2, [1, 1], 1), 0), rtol=1e-4, atol=1e-4)


def test_few_positions_patches_of_a_computed_input_compute_it_once() -> None:
  """The patches of a computed input (EdgeNeXt's downsampling 2x2 conv after a layer norm) are copied from it realized: the
  copy had computed it inline, its mean over the channels once per element, against numpy."""
  x, w = rand(2, 16, 4, 4), rand(40, 16, 2, 2)
  xt = Tensor.input("x", x.shape)
  c = compile([(xt - xt.mean(1, keepdims=True)).conv2d(Tensor(w), stride=2)])
  copies = [k for k in c.kernels if k.ast.arg.startswith("elementwise_1x8x")]
  assert copies and not any(u.op is Ops.REDUCE for k in copies for u in k.ast.toposort()), c.plan.describe()
  xc = x - x.mean(1, keepdims=True)
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(xc, w, None, [2, 2], [(0, 0)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)


# (input shape, weight shape, padding, groups, the product kernel): more output channels per group than one block of the
# weight: 64 in blocks of 32, 48 (two groups) in blocks of 16, each block one contiguous run of the weight along K
BLOCKED = [((2, 16, 2, 2), (64, 16, 3, 3), 1, 1, "reduce_1x2x8x32"), ((2, 12, 2, 2), (96, 6, 1, 1), 0, 2, "reduce_2x3x8x16")]


@pytest.mark.parametrize("xs,ws,padding,groups,kernel", BLOCKED)
def test_few_positions_weight_in_blocks_of_output_channels(xs, ws, padding, groups, kernel) -> None:
  """The channels-last product of a weight array with more than one block of output channels per group runs as
  (g, O/g/block, N*P, block) over the weight stored (g, O/g/block, K, block), read back as NCHW."""
  x, w, b = rand(*xs), rand(*ws), rand(ws[0])
  c = compile([Tensor.input("x", xs).conv2d(Tensor(w), Tensor(b), padding=padding, groups=groups).relu()])
  assert [k.ast.arg for k in c.kernels if k.ast.arg.startswith("reduce")] == [kernel], c.plan.describe()
  st, pads, dl = _spec(1, padding, 1, 2)
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(conv_ref(x, w, b, st, pads, dl, groups), 0), rtol=1e-4, atol=1e-4)


def test_few_positions_weight_in_blocks_under_a_symbolic_batch() -> None:
  """Under a symbolic batch the blocked weight's product folds the images into its rows as a static batch does, (g,
  O/g/block, N*P, block): symbolic rows in whole register tiles (prepare.peel), the last shifted back or, under one
  tile's rows, repeating the last row. Every batch in the bounds: 4 rows (under a tile), 8, 12 (a tile and a shifted
  one), 16."""
  w, b = rand(64, 16, 3, 3), rand(64)
  c = compile([Tensor.input("x", ("n", 16, 2, 2), dims={"n": (1, 4)}).conv2d(Tensor(w), Tensor(b), padding=1).relu()])
  assert [k.ast.arg for k in c.kernels if k.ast.arg.startswith("reduce")] == ["reduce_1x2xnx32"], c.plan.describe()
  for n in (1, 2, 3, 4):
    x = rand(n, 16, 2, 2)
    want = np.maximum(conv_ref(x, w, b, [1, 1], [(1, 1)] * 2, [1, 1], 1), 0)
    np.testing.assert_allclose(c.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_few_positions_channels_last_under_a_symbolic_batch() -> None:
  """A static batch folds into the product's rows, (g, N*P, O/g); a symbolic one stays its outer loop, (N, g, P, O/g)."""
  w, b = rand(40, 24, 1, 1), rand(40)
  c = compile([Tensor.input("x", (2, 24, 2, 2)).conv2d(Tensor(w), Tensor(b))])
  assert [k.ast.arg for k in c.kernels if k.ast.arg.startswith("reduce")] == ["reduce_1x8x40"], c.plan.describe()
  c = compile([Tensor.input("x", ("n", 24, 2, 2), dims={"n": (1, 4)}).conv2d(Tensor(w), Tensor(b))])
  for n in (1, 3):
    x = rand(n, 24, 2, 2)
    np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, b, [1, 1], [(0, 0)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)


def max_pool_ref(r: np.ndarray, k: int, st: int) -> np.ndarray:
  o = [(n - k) // st + 1 for n in r.shape[2:]]
  return np.stack([np.stack([r[:, :, i * st:i * st + k, j * st:j * st + k].max((2, 3)) for j in range(o[1])], -1) for i in range(o[0])], -2)


@pytest.mark.parametrize("readers,moves", [("pool", True), ("pool+mean", True), ("stride 3", False), ("stride 10", False)])
def test_conv_epilogue_placement(readers: str, moves: bool) -> None:
  """Bias and relu after a conv go into the product's kernel when its readers read each element at least once (a 2x2
  pool; two readers), and stay in the reader when it reads fewer (2x2 pools whose strides skip elements)."""
  x, w, b = rand(2, 3, 12, 12), rand(8, 3, 3, 3), rand(8)
  y = Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b), padding=1).relu()
  ref = np.maximum(conv_ref(x, w, b, [1, 1], [(1, 1)] * 2, [1, 1], 1), 0)
  st = {"stride 3": 3, "stride 10": 10}.get(readers, 2)
  outs, refs = [y.max_pool([2, 2], [st, st])], [max_pool_ref(ref, 2, st)]
  if readers == "pool+mean": outs, refs = [*outs, y.mean((2, 3))], [*refs, ref.mean((2, 3))]
  c = compile(outs)
  mm = matmul_kernels(c)
  assert c.kernel_count == 1 + len(outs) and len(mm) == 1, c.plan.describe()
  assert (_alu_max_kernels(c) == mm) == moves, (mm, _alu_max_kernels(c))  # where the relu is computed
  for got, want in zip(c.run({"x": x}), refs): np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_errors() -> None:
  x = Tensor.input("x", (2, 4, 8, 8))
  with pytest.raises(GraphError, match="groups=3"): x.conv2d(Tensor(rand(6, 4, 3, 3)), groups=3)
  with pytest.raises(GraphError, match="same rank"): x.conv2d(Tensor(rand(6, 4, 3)))
  with pytest.raises(GraphError, match="pads"): x.conv2d(Tensor(rand(6, 4, 3, 3)), padding=[(1, 1)])
  with pytest.raises(GraphError, match="larger than the input"): x.conv2d(Tensor(rand(6, 4, 9, 9)))


def test_contiguous() -> None:
  a = rand(3, 4)
  t = Tensor(a)
  assert t.contiguous() is t  # data has a buffer already
  y = (t * 2).contiguous()
  assert y.contiguous() is y
  c = compile([(y + 1).sum(0)])
  assert c.kernel_count == 2, c.plan.describe()  # without the marker: one kernel
  np.testing.assert_allclose(c.run()[0], (a * 2 + 1).sum(0), rtol=1e-6)
  assert compile([((t * 2) + 1).sum(0)]).kernel_count == 1


# ---- the ONNX Conv op against onnxruntime ----
ONNX_CASES = [({}, (2, 4, 9, 8), (6, 4, 3, 3)), ({"pads": [1, 1, 1, 1]}, (1, 4, 7, 7), (8, 4, 3, 3)),
              ({"strides": [2, 2], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, (3, 4, 11, 10), (6, 4, 3, 3)),
              ({"group": 2, "pads": [1, 1, 1, 1]}, (2, 8, 6, 6), (8, 4, 3, 3)), ({"group": 6, "pads": [1, 1, 1, 1]}, (2, 6, 9, 7), (6, 1, 3, 3)),
              ({}, (2, 6, 5, 7), (9, 6, 1, 1)), ({"strides": [2, 2]}, (2, 6, 9, 7), (9, 6, 1, 1)),
              ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (2, 4, 9, 8), (6, 4, 3, 3)), ({"pads": [2, 2]}, (2, 3, 17), (5, 3, 5))]


@pytest.mark.parametrize("attrs,xs,ws", ONNX_CASES)
def test_onnx_conv(attrs: dict, xs: tuple, ws: tuple) -> None:
  onnx = pytest.importorskip("onnx")
  ort = pytest.importorskip("onnxruntime")
  from onnx import TensorProto, helper, numpy_helper

  from kiln.graph import onnx as konnx
  x, w, b = rand(*xs), rand(*ws), rand(ws[0])
  g = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)], "g",
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  m = onnx.shape_inference.infer_shapes(m)
  want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  got = konnx.load(m).run({"x": x})["y"]
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_product_whose_panel_would_leave_the_l2_sums_k_in_chunks_of_channels(monkeypatch) -> None:
  """conv._k_chunks: a packed column panel (K rows of two vectors) past half of a core's L2 is read from memory by every
  row tile, so K is summed in chunks of whole input channels, the chunks the product's outermost axis, then the
  partials; an L2 of 32 KB here (room 16 KB, 128-byte rows on AVX-512: K of 128 at most) stands in for FCN's head (K =
  18432 on a 2 MB L2). The result is the conv's."""
  from dataclasses import replace

  from kiln.codegen import registry
  from kiln.graph import conv
  host = registry.target_of("CPU")
  assert host is not None
  small = replace(host, l2_bytes=32 << 10, vector_bytes=64)
  monkeypatch.setattr(registry, "target_of", lambda device: small)
  assert conv._k_chunks(16, 9, 64) == 2 and conv._k_chunks(8, 9, 64) == 1 and conv._k_chunks(16, 9, 8) == 1
  assert conv._k_chunks(7, 40, 64) == 7 and conv._k_chunks(3, 200, 64) == 1  # a prime: each channel a chunk; none fits: one K
  x, w, b = rand(2, 256, 8, 8), rand(32, 256, 1, 1), rand(32)  # a 1x1 conv over 64 positions: its NCHW product, K 256
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), Tensor(b)).relu()])
  names = [k.ast.arg for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert "reduce_2x2x1x32x64" in names, names  # two chunks of 128 channels: (chunks, N, g, O, P)
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(conv_ref(x, w, b, [1, 1], [(0, 0)] * 2, [1, 1], 1), 0), rtol=1e-4, atol=1e-4)
  x, w = rand(2, 32, 16, 16), rand(32, 32, 3, 3)  # a padded 3x3 conv at stride 2 (no Winograd): K 288 in 4 chunks of 8 channels' taps
  c = compile([Tensor.input("x", x.shape).conv2d(Tensor(w), stride=2, padding=1)])
  names = [k.ast.arg for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]
  assert "reduce_4x2x1x32x64" in names, names
  np.testing.assert_allclose(c.run({"x": x})[0], conv_ref(x, w, None, [2, 2], [(1, 1)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)
