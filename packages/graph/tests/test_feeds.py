"""Model's documented inputs/outputs and run()'s strict feeds (issue 39): unknown, missing and extra names, dtypes refused
unless cast=True (and then only where every value survives), a wrong shape or a dim out of its bounds, outputs= and out=,
and load(dims=) naming no dim of the model. One small model (y = relu(src @ W), n = count of ids as int64) loaded once with a symbolic batch."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_case import helper, model  # noqa: F401  (skips the module without onnx/onnxruntime)

from kiln.graph import onnx as konnx
from kiln.graph.feeds import FeedError, TensorInfo

W = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5) / 10


@pytest.fixture(scope="module")
def km() -> konnx.Model:
  g = helper.make_graph([helper.make_node("MatMul", ["src", "w"], ["mm"]), helper.make_node("Relu", ["mm"], ["y"]),
                         helper.make_node("Add", ["ids", "one"], ["n"])], "g",
                        [helper.make_tensor_value_info("src", 1, ["batch", 4]), helper.make_tensor_value_info("ids", 7, [2])],
                        [helper.make_tensor_value_info("y", 1, ["batch", 3]), helper.make_tensor_value_info("n", 7, [2])],
                        [helper.make_tensor(name="w", data_type=1, dims=[4, 3], vals=W.ravel().tolist()),
                         helper.make_tensor(name="one", data_type=7, dims=[1], vals=[1])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  return konnx.load(m, dims={"batch": (1, 8)})


X = np.array([[1, -2, 3, 0.5], [-1, 0, 2, 4], [0, 1, 0, 1]], np.float32)
IDS = np.array([3, 7], np.int64)


def test_inputs_and_outputs_are_named_shaped_and_typed(km) -> None:
  assert km.inputs == [TensorInfo("src", ("batch", 4), np.dtype(np.float32)), TensorInfo("ids", (2,), np.dtype(np.int64))]
  assert km.outputs == [TensorInfo("y", ("batch", 3), np.dtype(np.float32)), TensorInfo("n", (2,), np.dtype(np.int64))]
  name, shape, dtype = km.inputs[0]  # still unpacks as the (name, shape, dtype) tuples it was
  assert (name, shape, dtype) == ("src", ("batch", 4), np.float32) and str(km.inputs[0]) == "src (batch, 4) float32"


def test_run_matches_numpy(km) -> None:
  got = km.run({"src": X, "ids": IDS})
  np.testing.assert_allclose(got["y"], np.maximum(X @ W, 0), rtol=1e-6)
  np.testing.assert_array_equal(got["n"], IDS + 1)


def test_names_unknown_missing_and_extra(km) -> None:
  with pytest.raises(FeedError, match=r"no input 'srC' \(did you mean 'src'\?\)"): km.run({"srC": X, "ids": IDS})
  with pytest.raises(FeedError, match=r"no input 'mask'; its inputs: src, ids"): km.run({"src": X, "ids": IDS, "mask": IDS})
  with pytest.raises(FeedError, match=r"model input 'ids' \(\(2,\) int64\) was not fed"): km.run({"src": X})
  with pytest.raises(FeedError, match=r"'src' .*'ids' .* were not fed"): km.run({})
  with pytest.raises(FeedError, match="mapping"): km.run([X, IDS])  # type: ignore[arg-type]


def test_a_differing_dtype_is_refused_unless_cast(km) -> None:
  with pytest.raises(FeedError, match=r"input 'src' has dtype float64, the model takes float32.*cast=True"):
    km.run({"src": X.astype(np.float64), "ids": IDS})
  with pytest.raises(FeedError, match=r"input 'ids' has dtype int32, the model takes int64"): km.run({"src": X, "ids": IDS.astype(np.int32)})
  got = km.run({"src": X.astype(np.float64), "ids": IDS.astype(np.int32)}, cast=True)
  np.testing.assert_allclose(got["y"], np.maximum(X @ W, 0), rtol=1e-6)
  np.testing.assert_array_equal(got["n"], IDS + 1)
  got = km.run({"src": X.astype(np.float16), "ids": np.array([3.0, 7.0])}, cast=True)  # whole floats make integers
  np.testing.assert_array_equal(got["n"], IDS + 1)


@pytest.mark.parametrize(("src", "ids", "why"), [(X[0], IDS, r"input 'src' has shape \(4,\), the model takes rank 2 \(batch, 4\)"),
                                                 (X[:, :3], IDS, r"input 'src' has shape \(3, 3\), the model takes \(batch, 4\) \(dim 1\)"),
                                                 (X, IDS[:1], r"input 'ids' has shape \(1,\), the model takes \(2,\)"),
                                                 (np.zeros((9, 4), np.float32), IDS, r"dim 0 \(batch\) is 9, outside the bounds \[1, 8\]")])
def test_a_wrong_shape_or_a_dim_out_of_bounds_is_a_feed_error(km, src, ids, why) -> None:
  with pytest.raises(FeedError, match=why): km.run({"src": src, "ids": ids})


@pytest.mark.parametrize(("ids", "why"), [(np.array([3.5, 7.0]), "fractions"), (np.array([np.nan, 1.0]), "NaN"),
                                          (np.array([2**63, 1], np.uint64), "run from 1 to 9223372036854775808"),
                                          (np.array([1e19, 1.0]), "int64 holds"), (np.array(["3", "7"]), "only between numbers")])
def test_cast_refuses_a_value_that_would_change(km, ids, why) -> None:
  with pytest.raises(FeedError, match=why): km.run({"src": X, "ids": ids}, cast=True)


def test_cast_refuses_overflow_to_infinity(km) -> None:
  with pytest.raises(FeedError, match="infinite in float32"): km.run({"src": np.full((1, 4), 1e39), "ids": IDS}, cast=True)


def test_outputs_selects_in_order(km) -> None:
  got = km.run({"src": X, "ids": IDS}, outputs=["n", "y"])
  assert list(got) == ["n", "y"]
  assert list(km.run({"src": X, "ids": IDS}, outputs=["n"])) == ["n"]
  with pytest.raises(FeedError, match=r"no output 'Y' \(did you mean 'y'\?\)"): km.run({"src": X, "ids": IDS}, outputs=["Y"])
  with pytest.raises(FeedError, match="list of output names"): km.run({"src": X, "ids": IDS}, outputs="y")  # type: ignore[arg-type]


def test_out_writes_into_the_callers_arrays(km) -> None:
  y, n = np.full((3, 3), -7, np.float32), np.zeros(2, np.int64)
  got = km.run({"src": X, "ids": IDS}, out={"y": y, "n": n})
  assert got["y"] is y and got["n"] is n
  np.testing.assert_allclose(y, np.maximum(X @ W, 0), rtol=1e-6)
  np.testing.assert_array_equal(n, IDS + 1)
  km.run({"src": X[:1] * 2, "ids": IDS}, out={"y": y[:1]})  # a view is written in place too
  np.testing.assert_allclose(y[0], np.maximum(2 * X[0] @ W, 0), rtol=1e-6)


def test_out_is_checked_before_anything_is_written(km) -> None:
  y = np.full((3, 3), -7, np.float32)
  feeds = {"src": X, "ids": IDS}
  with pytest.raises(FeedError, match=r"out\['y'\] has shape \(2, 3\), this run's output 'y' is \(3, 3\)"): km.run(feeds, out={"y": y[:2]})
  with pytest.raises(FeedError, match=r"out\['n'\] has shape \(3,\), output 'n' is \(2,\)"): km.run(feeds, out={"y": y, "n": np.zeros(3, np.int64)})
  with pytest.raises(FeedError, match=r"out\['y'\] has dtype float64, output 'y' is float32"): km.run(feeds, out={"y": y.astype(np.float64)})
  with pytest.raises(FeedError, match="which outputs= does not select"): km.run(feeds, outputs=["n"], out={"y": y})
  with pytest.raises(FeedError, match="read-only"): km.run(feeds, out={"y": np.broadcast_to(y, (3, 3))})
  assert (y == -7).all()  # nothing written by any refused call


def test_dims_naming_no_dim_of_the_model_is_an_error() -> None:
  m = model([helper.make_node("Relu", ["x"], ["y"])], {"x": np.zeros((2, 4), np.float32)}, {"y": np.float32})
  m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
  assert konnx.load(m, dims={"batch": 3}).inputs[0].shape == (3, 4)
  with pytest.raises(FeedError, match=r"dims names 'btach' \(did you mean 'batch'\?\), which is no symbolic dim.*'batch'"):
    konnx.load(m, dims={"batch": 3, "btach": 3})
  with pytest.raises(FeedError, match="no symbolic dims"):
    konnx.load(model([helper.make_node("Relu", ["x"], ["y"])], {"x": np.zeros((2, 4), np.float32)}, {"y": np.float32}), dims={"batch": 3})


def test_outputs_are_the_callers_and_feeds_may_be_strided(km) -> None:
  """run copies the inputs into the plan's buffers through arrays made once (a strided feed too) and returns copies of its
  outputs: a later run, of another batch, changes neither the first run's results nor reads a stale input."""
  big = np.tile(X, (2, 1))
  first = km.run({"src": X[:, ::1], "ids": IDS})
  strided = np.asfortranarray(big)[::2]  # not contiguous: rows 0, 2, 4 of big
  second = km.run({"src": strided, "ids": IDS[::-1].copy()})
  np.testing.assert_allclose(first["y"], np.maximum(X @ W, 0), rtol=1e-6)
  np.testing.assert_array_equal(first["n"], IDS + 1)
  np.testing.assert_allclose(second["y"], np.maximum(big[::2] @ W, 0), rtol=1e-6)
  np.testing.assert_array_equal(second["n"], IDS[::-1] + 1)
  again = km.run({"src": X[:1], "ids": IDS})  # a smaller batch fills the buffer's front
  np.testing.assert_allclose(again["y"], np.maximum(X[:1] @ W, 0), rtol=1e-6)
  np.testing.assert_allclose(first["y"], np.maximum(X @ W, 0), rtol=1e-6)


def test_a_fixed_shape_model_fed_exactly_runs_without_the_checks_pass() -> None:
  """A model of fixed shapes fed a dict of exactly its inputs, each of its dtype and shape, copies them straight into the
  plan (Model._run_exact); the outputs are the caller's own arrays (a second run leaves the first's alone), and every
  other feed still gets the full checks and their typed errors."""
  g = helper.make_graph([helper.make_node("MatMul", ["src", "w"], ["mm"]), helper.make_node("Relu", ["mm"], ["y"])], "g",
                        [helper.make_tensor_value_info("src", 1, [3, 4])], [helper.make_tensor_value_info("y", 1, [3, 3])],
                        [helper.make_tensor(name="w", data_type=1, dims=[4, 3], vals=W.ravel().tolist())])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  km = konnx.load(m)
  first = km.run({"src": X})["y"]
  assert km._exact and km.compiled is not None and km.compiled._exact  # the exact path ran
  np.testing.assert_allclose(first, np.maximum(X @ W, 0), rtol=1e-6)
  km.run({"src": -X})
  np.testing.assert_allclose(first, np.maximum(X @ W, 0), rtol=1e-6)
  with pytest.raises(FeedError, match="dtype float64"): km.run({"src": X.astype(np.float64)})
  with pytest.raises(FeedError, match="shape"): km.run({"src": X[:2]})
  with pytest.raises(FeedError, match="not fed"): km.run({})
  with pytest.raises(FeedError, match="srcc"): km.run({"src": X, "srcc": X})
  np.testing.assert_allclose(km.run({"src": X.T.copy().T})["y"], first, rtol=1e-6)  # not C-contiguous: copied in all the same
