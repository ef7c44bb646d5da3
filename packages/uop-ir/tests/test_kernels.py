"""Kernel builders: slot order, shapes, broadcasting, symbolic sizes; every kernel verifies and matches numpy."""
import numpy as np
import pytest

from kiln.ir import AxisType, IRError, Ops, UOp, dtypes
from kiln.ir import kernels as K
from kiln.ir.reference import run
from kiln.ir.verify import verify

RNG = np.random.default_rng(1)
F32 = dtypes.float32


def globals_of(k: UOp) -> dict[int, UOp]: return {u.arg: u for u in k.toposort() if u.op is Ops.DEFINE_GLOBAL}


@pytest.mark.parametrize("sa,sb", [((3, 4), (4,)), ((2, 1, 5), (3, 1)), ((), (2, 3)), ((1,), (1,)), ((4, 1), (1, 4))])
def test_elementwise_broadcasting(sa, sb):
  k = K.elementwise(lambda x, y: x * 2.0 - y, F32, (sa, F32), (sb, F32), name="ew")
  verify(k)
  assert k.arg == "ew"
  a, b = RNG.standard_normal(sa).astype(np.float32), RNG.standard_normal(sb).astype(np.float32)
  exp = a * 2 - b
  g = globals_of(k)
  assert [g[s].dtype.size for s in range(3)] == [max(exp.size, 1), max(a.size, 1), max(b.size, 1)]  # slot 0 out, then inputs
  np.testing.assert_allclose(run(k, np.zeros(exp.size, np.float32), a, b)[0], exp.ravel(), rtol=1e-6)


def test_elementwise_mixed_dtypes_and_casts():
  k = K.elementwise(lambda x, y: x.cast(F32) + y, dtypes.float16, ((5,), dtypes.int8), ((5,), F32))
  verify(k)
  a, b = np.arange(-2, 3, dtype=np.int8), np.full(5, 0.5, np.float32)
  assert run(k, np.zeros(5, np.float16), a, b)[0].tolist() == (a + b).astype(np.float16).tolist()
  kc = K.elementwise(lambda x: 7, dtypes.int32, ((3,), F32))  # a Python number result becomes a constant
  assert run(kc, np.zeros(3, np.int32), np.zeros(3, np.float32))[0].tolist() == [7, 7, 7]


def test_broadcast_errors():
  with pytest.raises(IRError, match="broadcast"): K.broadcast_shape((3,), (4,))
  n, m = UOp.variable("n", 1, 8), UOp.variable("m", 1, 8)
  with pytest.raises(IRError, match="broadcast"): K.broadcast_shape((n,), (m,))
  assert K.broadcast_shape((n, 1), (1, 3)) == (n, 3)
  with pytest.raises(IRError): K.elementwise(lambda x: x, F32, ((0,), F32))
  with pytest.raises(IRError, match="axis"): K.reduce_sum((3, 4), F32, 2)


@pytest.mark.parametrize("op,ref", [(Ops.ADD, np.sum), (Ops.MAX, np.max), (Ops.MUL, np.prod)])
@pytest.mark.parametrize("axes", [0, -1, (0, 1), None])
def test_reduce_builders(op, ref, axes):
  shape = (3, 4, 2)
  k = K.reduce(op, shape, F32, axes, keepdims=True)
  verify(k)
  x = RNG.uniform(0.5, 1.5, shape).astype(np.float32)
  exp = ref(x, axis=axes, keepdims=True)
  assert K.reduced_shape(shape, axes, True) == exp.shape
  np.testing.assert_allclose(run(k, np.zeros(exp.size, np.float32), x)[0], exp.ravel(), rtol=1e-5)
  rs = [u for u in k.toposort() if u.op is Ops.RANGE]
  assert all(r.arg[1] is AxisType.REDUCE for r in rs if any(r in red.src[1:] for red in k.toposort() if red.op is Ops.REDUCE))


def test_reduce_with_fn_and_acc_dtype():
  k = K.reduce_sum((6,), dtypes.int8, fn=lambda v: v.cast(dtypes.int32) * v.cast(dtypes.int32), acc_dtype=dtypes.int32)
  verify(k)
  x = np.array([100, -100, 3, 4, 5, 6], np.int8)
  assert run(k, np.zeros(1, np.int32), x)[0][0] == int((x.astype(np.int32) ** 2).sum())


def test_symbolic_leading_dim():
  n = UOp.variable("n", 1, 64)
  k = K.reduce_max((n, 5), F32, 1)
  verify(k)
  assert globals_of(k)[1].dtype.size == 64 * 5  # declared at the variable's maximum
  for nv in (1, 17):
    x = RNG.standard_normal((nv, 5)).astype(np.float32)
    np.testing.assert_array_equal(run(k, np.zeros(nv, np.float32), x, var_vals={"n": nv})[0], x.max(1))
  ks = K.reduce_sum((n, 5), F32, 0)  # reduce over the symbolic dim itself
  verify(ks)
  x = RNG.standard_normal((9, 5)).astype(np.float32)
  np.testing.assert_allclose(run(ks, np.zeros(5, np.float32), x, var_vals={"n": 9})[0], x.sum(0), rtol=1e-5)


def test_matmul_slots_shapes_and_symbolic_m():
  k = K.matmul(3, 4, 5)
  verify(k)
  g = globals_of(k)
  assert [g[s].dtype.size for s in range(3)] == [12, 15, 20]
  m = UOp.variable("m", 1, 16)
  km = K.matmul(m, 4, 5, batch=(2,))
  verify(km)
  a, b = RNG.standard_normal((2, 6, 5)).astype(np.float32), RNG.standard_normal((2, 5, 4)).astype(np.float32)
  np.testing.assert_allclose(run(km, np.zeros(48, np.float32), a, b, var_vals={"m": 6})[0], (a @ b).ravel(), rtol=1e-5, atol=1e-6)
  kh = K.matmul(2, 2, 64, dtypes.float16, acc_dtype=F32)  # accumulate half products in float32
  ah, bh = np.full((2, 64), 1.0, np.float16), np.full((64, 2), 33.0, np.float16)
  assert run(kh, np.zeros(4, np.float16), ah, bh)[0].tolist() == [2112.0] * 4


def test_softmax_builders_verify_and_match():
  n = UOp.variable("n", 1, 8)
  for k in [K.softmax((n, 6), F32), *K.softmax_parts((n, 6), F32)]: verify(k)
  x = RNG.standard_normal((5, 6)).astype(np.float32)
  e = np.exp(x - x.max(1, keepdims=True))
  got = run(K.softmax((n, 6), F32), np.zeros(30, np.float32), x, var_vals={"n": 5})[0]
  np.testing.assert_allclose(got, (e / e.sum(1, keepdims=True)).ravel(), rtol=1e-5, atol=1e-7)
  assert [k.arg for k in K.softmax_parts((3, 6), F32)] == ["softmax_max", "softmax_exp", "softmax_sum", "softmax_div"]
