"""compile(bind=): an input read in place from a Buffer the caller owns (a KV cache), with a variable only it has given to
run(vars=); rows the caller writes between runs are seen by the next run, and nothing is copied into the buffer."""
import numpy as np
import pytest

from kiln.executor import Buffer, cache_stats
from kiln.graph import GraphError, Tensor, compile

CTX = 16


def _graph() -> tuple[np.ndarray, object]:
  cache = np.zeros((CTX, 3), np.float32)
  k = Tensor.input("k", ("past", 3), dims={"past": (0, CTX)})
  x = Tensor.input("x", ("seq", 3), dims={"seq": (1, 4)})
  both = Tensor.cat([k, x], 0)  # past + seq rows
  c = compile([both.sum(0), x * 2], bind={"k": Buffer.from_numpy(cache)})
  return cache, c


def test_a_bound_input_is_read_in_place_at_the_given_past():
  cache, c = _graph()
  assert [i.name for i in c.inputs] == ["x"]  # run() feeds only x
  rng = np.random.default_rng(0)
  past, rows = 0, []
  compiles = None
  for seq in (3, 1, 1, 4, 2):
    x = rng.standard_normal((seq, 3)).astype(np.float32)
    total, doubled = c.run({"x": x}, vars={"past": past})
    if compiles is None: compiles = cache_stats()["compiles"]
    want = np.concatenate([cache[:past], x]).astype(np.float64).sum(0)
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(doubled, x * 2)
    cache[past:past + seq] = x  # the caller appends the step's rows itself
    rows.append(x)
    past += seq
  assert cache_stats()["compiles"] == compiles  # one compile for every past
  np.testing.assert_array_equal(cache[:past], np.concatenate(rows))


def test_bind_and_vars_refusals():
  cache, c = _graph()
  x = np.ones((1, 3), np.float32)
  with pytest.raises(GraphError, match="past"): c.run({"x": x})  # no feed gives past
  with pytest.raises(GraphError, match="outside the bounds"): c.run({"x": x}, vars={"past": CTX + 1})
  with pytest.raises(GraphError, match="no variable 'nope'"): c.run({"x": x}, vars={"past": 0, "nope": 1})
  with pytest.raises(GraphError, match="the feeds give seq = 1"): c.run({"x": x}, vars={"past": 0, "seq": 2})
  k = Tensor.input("k", ("past", 3), dims={"past": (0, CTX)})
  with pytest.raises(GraphError, match="48 elements"): compile([k.sum(0)], bind={"k": Buffer.from_numpy(np.zeros((CTX, 2), np.float32))})
  with pytest.raises(GraphError, match="float32 buffer"): compile([k.sum(0)], bind={"k": Buffer.from_numpy(np.zeros((CTX, 3), np.int32))})
  with pytest.raises(GraphError, match="no input named"): compile([k.sum(0)], bind={"k": Buffer.from_numpy(cache), "q": Buffer.from_numpy(cache)})
