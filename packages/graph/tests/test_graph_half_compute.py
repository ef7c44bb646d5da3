"""float16 / bfloat16 nodes are computed in float32 and rounded to 16 bits where they are stored (kernelize.compute_dtype):
sums accumulate in float32, an elementwise chain rounds once, and what decides on a value (a comparison, a truncation, a
cast) reads the 16-bit value the node holds. On a CPU, intermediates between kernels are stored in float32
(kernelize.stored_dtype)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import Tensor, compile
from kiln.graph.kernelize import compute_dtype
from kiln.ir.dtype import bf16_bits_to_f32, dtypes, f32_to_bf16_bits
from kiln.ir.ops import Ops

RNG = np.random.default_rng(16)


def run(t: Tensor) -> np.ndarray: return compile([t]).run()[0]


def test_the_compute_dtype_of_each_storage_dtype() -> None:
  assert compute_dtype(dtypes.float16) == compute_dtype(dtypes.bfloat16) == dtypes.float32
  for dt in (dtypes.float32, dtypes.float64, dtypes.int8, dtypes.int64, dtypes.bool): assert compute_dtype(dt) == dt


def test_a_long_float16_sum_accumulates_in_float32() -> None:
  """Column sums of 4096 values near 0.5 (one accumulator each, not split into partial sums): a float16 accumulator's
  spacing grows to 2 on the way, and adding 0.5 at a time then loses up to 1 each step."""
  x = RNG.uniform(0.25, 0.75, (4096, 3)).astype(np.float16)
  got = run(Tensor(x).sum(0))
  want = np.float16(x.astype(np.float64).sum(0))
  assert got.dtype == np.float16
  np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), np.spacing(want) * 1.01)  # within an ulp


def test_a_long_bfloat16_sum_accumulates_in_float32() -> None:
  x = bf16_bits_to_f32(f32_to_bf16_bits(RNG.uniform(0.25, 0.75, (512, 3)).astype(np.float32)))  # bfloat16 values
  got = bf16_bits_to_f32(run(Tensor(x).cast(dtypes.bfloat16).contiguous().sum(0)))  # summed from a bfloat16 buffer
  want = bf16_bits_to_f32(f32_to_bf16_bits(x.astype(np.float64).sum(0).astype(np.float32)))
  np.testing.assert_allclose(got, want, rtol=2 ** -7)  # one bfloat16 ulp


def test_a_float16_softmax_is_within_an_ulp_or_two_of_float64() -> None:
  x = RNG.normal(0, 2, (4, 1024)).astype(np.float16)
  got = run(Tensor(x).softmax(-1))
  e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
  assert got.dtype == np.float16
  np.testing.assert_allclose(got.astype(np.float64), e / e.sum(-1, keepdims=True), rtol=2e-3, atol=1e-7)  # the stored sum and output: two roundings


def test_an_elementwise_chain_rounds_once_where_stored_and_the_buffers_stay_16_bit() -> None:
  """x * a + b * c in float32, one rounding: bit for bit what numpy gives in float32 then float16 (float16 products are
  exact in float32), where a float16 op per step rounds three times."""
  x, a, b, c = (RNG.uniform(-4, 4, 4096).astype(np.float16) for _ in range(4))
  out = Tensor(x) * Tensor(a) + Tensor(b) * Tensor(c)
  f = [v.astype(np.float32) for v in (x, a, b, c)]
  np.testing.assert_array_equal(run(out), (f[0] * f[1] + f[2] * f[3]).astype(np.float16))
  (k,) = compile([out]).kernels
  assert {s.dtype for s in k.slots} == {dtypes.float16}  # memory holds float16; the arithmetic is float32
  assert {u.dtype for u in k.ast.toposort() if u.op in (Ops.ADD, Ops.MUL)} == {dtypes.float32}


def test_comparisons_truncations_and_casts_read_the_16_bit_value() -> None:
  """x * 3 is just below 1 in float32 and exactly 1 in float16: the node holds 1, so it equals 1 and truncates to 1; a cast
  to float16 and back inside one kernel still rounds."""
  x = np.float16(0.33325)  # x * 3 = 0.99975586 in float32
  assert np.float32(x) * 3 < 1 and np.float16(np.float32(x) * 3) == 1
  t = Tensor(np.full(4, x, np.float16)) * 3.0
  assert run(t.eq(1.0)).all()
  np.testing.assert_array_equal(run(t._unary(Ops.TRUNC)), np.ones(4, np.float16))
  y = RNG.uniform(-1, 1, 64).astype(np.float32)
  np.testing.assert_array_equal(run(Tensor(y).cast(dtypes.float16).cast(dtypes.float32) * 1.0), y.astype(np.float16).astype(np.float32))


def test_float16_intermediates_stay_float32_between_kernels_on_a_cpu() -> None:
  """A float16 product feeding another product is realized (its own kernel); on a CPU its buffer holds float32
  (kernelize.stored_dtype), so the chain rounds once, at the output, as onnxruntime's CPU does. Rounded to float16 in between
  (the first product near 64, the second summing it with signs that cancel), about 1 output in 6 is off by an ulp or more.
  Its own generator: drawn from the module's, the data followed which tests a worker ran first, and 9 draws in 300 hold an
  output near 0 whose float32 sums' own rounding (partial sums near 500) is more than its float16 ulp."""
  rng = np.random.default_rng(16)
  x, w1 = rng.uniform(0.9, 1.1, (16, 64)).astype(np.float16), rng.uniform(0, 2, (64, 64)).astype(np.float16)
  w2 = rng.uniform(-1, 1, (64, 16)).astype(np.float16)
  c = compile([Tensor(x) @ Tensor(w1) @ Tensor(w2)])
  got = c.run()[0]
  want = np.float16(x.astype(np.float64) @ w1.astype(np.float64) @ w2.astype(np.float64))
  assert got.dtype == np.float16
  assert [b.size for b in c.plan.buffers if b.dtype == dtypes.float32] == [16 * 64]  # the first product's; inputs and output float16
  off = np.abs(got.astype(np.float64) - want) > np.spacing(np.abs(want)) * 1.01
  assert not off.any(), off.mean()


def test_bfloat16_constants_and_arrays_hold_their_values() -> None:
  """A Python number beside a bfloat16 tensor, and an array made bfloat16, hold their values (numpy's stand-in for bfloat16
  is uint16 bits: 0.5 cast to it was 0, so x * 0.5 was 0 and exp, x * log2(e) under the hood, was 2**x)."""
  x = np.array([-3, -0.5, 0, 0.5, 3], np.float32)
  t = Tensor(x).cast(dtypes.bfloat16)
  bf = lambda a: bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, np.float32)))  # noqa: E731
  np.testing.assert_array_equal(bf16_bits_to_f32(run(t * 0.5)), bf(x * 0.5))
  np.testing.assert_allclose(bf16_bits_to_f32(run(t.exp())), np.exp(bf(x)), rtol=2 ** -8)
  np.testing.assert_array_equal(bf16_bits_to_f32(run(Tensor(x, dtypes.bfloat16) + 0)), bf(x))


def test_a_bfloat16_input_takes_numpys_bfloat16_arrays() -> None:
  ml_dtypes = pytest.importorskip("ml_dtypes")
  x = np.array([1.5, -2.25, 3.0], np.float32)
  c = compile([Tensor.input("x", (3,), dtypes.bfloat16) * 2])
  got = c.run({"x": x.astype(ml_dtypes.bfloat16)})[0]
  np.testing.assert_array_equal(bf16_bits_to_f32(got), x * 2)
