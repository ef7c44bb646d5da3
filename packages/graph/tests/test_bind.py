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


def _appending(ctx: int = CTX, seq: int = 2, dtype=np.float32):  # type: ignore[no-untyped-def]
  """A cache the plan appends to itself: k reads the first ctx rows (past of them), k_rows is the whole buffer of ctx + seq
  rows, and each run writes x * 2 + 1 at row past (Tensor.write_rows)."""
  store = np.zeros((ctx + seq, 3), dtype)
  buf = Buffer.from_numpy(store)
  k = Tensor.input("k", ("past", 3), dims={"past": (0, ctx)}, dtype=dtype)
  rows = Tensor.input("k_rows", (ctx + seq, 3), dtype=dtype)
  x = Tensor.input("x", (seq, 3))
  new = x * 2 + 1
  out = k.float().sum(0, keepdims=True) + new.sum(0, keepdims=True)  # reads the cache before this run's rows
  c = compile([out], bind={"k": buf.view(0, ctx * 3), "k_rows": buf}, writes=[rows.write_rows(new, k.shape[0])])
  return store, c


def test_a_plan_writes_its_rows_into_a_bound_buffer():
  store, c = _appending()
  rng = np.random.default_rng(1)
  past, compiles = 0, None
  for _ in range(5):
    x = rng.standard_normal((2, 3)).astype(np.float32)
    before = store.copy()
    (out,) = c.run({"x": x}, vars={"past": past})
    if compiles is None: compiles = cache_stats()["compiles"]
    np.testing.assert_allclose(out[0], before[:past].astype(np.float64).sum(0) + (x * 2 + 1).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(store[past:past + 2], x * 2 + 1)  # written in place, at row past
    np.testing.assert_array_equal(store[:past], before[:past])  # and nothing else
    np.testing.assert_array_equal(store[past + 2:], before[past + 2:])
    past += 2
  assert cache_stats()["compiles"] == compiles  # one compile for every past
  (out,) = c.run({"x": np.zeros((2, 3), np.float32)}, vars={"past": CTX})  # the last rows: the slack the buffer keeps for them
  np.testing.assert_array_equal(store[CTX:], np.ones((2, 3), np.float32))


def test_a_plan_with_a_bound_variable_runs_profiled():
  """run_profiled takes vars as run does (a decode plan's past: it raised GraphError for the unbound variable)."""
  store, c = _appending()
  x = np.ones((2, 3), np.float32)
  (out,), prof = c.run_profiled({"x": x}, vars={"past": 4})
  np.testing.assert_array_equal(store[4:6], x * 2 + 1)
  assert len(prof) >= 2 and any(r.name.startswith("write") for r in prof) and out.shape == (1, 3)


def test_written_rows_take_the_targets_dtype():
  store, c = _appending(dtype=np.float16)
  c.run({"x": np.full((2, 3), 0.1, np.float32)}, vars={"past": 3})
  np.testing.assert_array_equal(store[3:5], np.full((2, 3), np.float16(np.float32(0.1) * 2 + 1)))


def test_write_rows_refusals():
  k = Tensor.input("k", ("past", 3), dims={"past": (0, CTX)})
  rows = Tensor.input("k_rows", (CTX + 2, 3))
  x = Tensor.input("x", (2, 3))
  with pytest.raises(GraphError, match="named input of static shape"): k.write_rows(x, 0)  # a symbolic target
  with pytest.raises(GraphError, match="named input of static shape"): (rows * 1).write_rows(x, 0)
  with pytest.raises(GraphError, match="other dims are the target's"): rows.write_rows(Tensor.input("y", (2, 4)), 0)
  with pytest.raises(GraphError, match="do not fit"): rows.write_rows(x, k.shape[0] + 1)  # past + 1 + 2 rows may pass CTX + 2
  with pytest.raises(GraphError, match="do not fit"): rows.write_rows(x, CTX + 1)
  with pytest.raises(GraphError, match="must be bound"): compile([k.sum(0)], bind={"k": Buffer.from_numpy(np.zeros((CTX, 3), np.float32))},
                                                                writes=[rows.write_rows(x, k.shape[0])])
  with pytest.raises(GraphError, match="write_rows results"): compile([x * 2], writes=[x])
