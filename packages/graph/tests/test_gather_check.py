"""Gather's indices checked at run time as onnxruntime checks them (issue 41 item 3): an index outside [-n, n) is an
IndexOutOfRangeError naming the gather and the index, never a clamped row; negative indices wrap as ONNX says."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.executor import PortablePlan
from kiln.executor.checks import PlanCheckError
from kiln.executor.plan_split import run_in_order, split
from kiln.executor.planspec import PlanSpec
from kiln.graph.lazy import GraphError, IndexOutOfRangeError
from kiln.graph.tensor import Tensor, compile

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)


def _embedding(dtype: type = np.int64, n: int = 3):  # noqa: ANN202
  ids = Tensor.input("ids", (n,), dtype)
  return compile([Tensor(TABLE).gather(ids, 0, name="emb")])


def test_out_of_range_index_is_an_error_naming_the_gather_and_the_index() -> None:
  c = _embedding()
  with pytest.raises(IndexOutOfRangeError, match=r"emb \(axis 0 of \(10, 4\)\): index 1000 is out of range \[-10, 10\)") as e:
    c.run({"ids": np.array([1, 5, 1000])})
  assert e.value.value == 1000 and isinstance(e.value, GraphError) and isinstance(e.value, PlanCheckError)
  with pytest.raises(IndexOutOfRangeError, match=r"index -11 is out of range \[-10, 10\)"): c.run({"ids": np.array([0, -11, 2])})
  with pytest.raises(IndexOutOfRangeError, match="index 10 is"): c.run({"ids": np.array([10, 0, 0])})


def test_negative_indices_wrap_and_edges_are_in_range() -> None:
  c = _embedding()
  for ids in ([-10, 9, 0], [-1, -5, 3]):
    np.testing.assert_array_equal(c.run({"ids": np.array(ids)})[0], np.take(TABLE, ids, 0))


def test_a_good_run_after_a_bad_one_works() -> None:
  c = _embedding()
  with pytest.raises(IndexOutOfRangeError): c.run({"ids": np.array([1, 5, 1000])})
  np.testing.assert_array_equal(c.run({"ids": np.array([1, 5, 9])})[0], TABLE[[1, 5, 9]])
  with pytest.raises(IndexOutOfRangeError): c.run_profiled({"ids": np.array([-11, 0, 0])})
  np.testing.assert_array_equal(c.run_profiled({"ids": np.array([2, 2, 2])})[0][0], TABLE[[2, 2, 2]])


def test_wide_and_narrow_index_dtypes() -> None:
  # 2**32 + 1 in 32-bit index arithmetic is 1: the check reads the int64 value itself
  with pytest.raises(IndexOutOfRangeError, match="index 4294967297 is"): _embedding(np.int64).run({"ids": np.array([0, 2**32 + 1, 0])})
  with pytest.raises(IndexOutOfRangeError, match="index -9223372036854775808 is"):
    _embedding(np.int64).run({"ids": np.array([0, np.iinfo(np.int64).min, 0])})
  with pytest.raises(IndexOutOfRangeError, match="index 4294967295 is"): _embedding(np.uint32).run({"ids": np.array([0, 2**32 - 1, 1], np.uint32)})
  with pytest.raises(IndexOutOfRangeError, match="index -128 is"): _embedding(np.int8).run({"ids": np.array([0, -128, 1], np.int8)})
  np.testing.assert_array_equal(_embedding(np.int32).run({"ids": np.array([-10, 9, 3], np.int32)})[0], np.take(TABLE, [-10, 9, 3], 0))


def test_computed_indices_are_checked() -> None:
  ids = Tensor.input("ids", (2, 2), np.int32)
  c = compile([Tensor(TABLE).gather(ids + 1, 0, name="shifted")])
  np.testing.assert_array_equal(c.run({"ids": np.array([[0, 8], [-11, 3]], np.int32)})[0], np.take(TABLE, [[1, 9], [-10, 4]], 0))
  with pytest.raises(IndexOutOfRangeError, match="shifted .*index 10 is"): c.run({"ids": np.array([[0, 9], [1, 2]], np.int32)})


def test_gather_along_an_inner_axis() -> None:
  x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  idx = Tensor.input("i", (2,), np.int64)
  c = compile([Tensor(x).gather(idx, 2)])
  np.testing.assert_array_equal(c.run({"i": np.array([-4, 3])})[0], np.take(x, [-4, 3], 2))
  with pytest.raises(IndexOutOfRangeError, match=r"gather \(axis 2 of \(2, 3, 4\)\): index 4 is out of range \[-4, 4\)"):
    c.run({"i": np.array([4, 0])})


def test_constant_indices_are_checked_when_the_gather_is_made() -> None:
  with pytest.raises(IndexOutOfRangeError, match=r"index 1000 is out of range \[-10, 10\)"): Tensor(TABLE).gather(Tensor(np.array([1, 1000])))
  assert compile([Tensor(TABLE).gather(Tensor(np.array([-10, 9])))]).kernel_count == 1  # no check kernel: nothing left to check
  with pytest.raises(GraphError, match="empty"): Tensor(np.zeros((0, 3), np.float32)).gather(Tensor.input("i", (2,), np.int64))


def test_symbolic_batch_checks_only_the_rows_of_the_run() -> None:
  ids = Tensor.input("ids", ("batch", 4), np.int64, dims={"batch": (1, 8)})
  c = compile([Tensor(TABLE).embedding(ids)])
  bad = np.zeros((6, 4), np.int64)
  bad[5, 2] = 77
  with pytest.raises(IndexOutOfRangeError, match="index 77 is"): c.run({"ids": bad})
  good = np.arange(8, dtype=np.int64).reshape(2, 4)  # the buffer's rows past 2 still hold the bad run's 77
  np.testing.assert_array_equal(c.run({"ids": good})[0], TABLE[good])


def test_an_exported_plan_keeps_the_check() -> None:
  c = _embedding()
  spec, weights = c.export(["y"])
  assert [o.name for o in spec.outputs] == ["y"] and len(spec.checks) == 1
  back = PlanSpec.from_json(spec.to_json())
  assert back == spec
  p = PortablePlan(back, weights)
  assert p.output_names == ["y"]
  with pytest.raises(PlanCheckError, match=r"emb \(axis 0 of \(10, 4\)\): index 1000 is out of range \[-10, 10\)") as e:
    p.run({"ids": np.array([1, 5, 1000])})
  assert e.value.value == 1000
  got = p.run({"ids": np.array([-10, 9, 0])})
  assert list(got) == ["y"]
  np.testing.assert_array_equal(got["y"], np.take(TABLE, [-10, 9, 0], 0))


def test_pipeline_stages_keep_the_check() -> None:
  ids = Tensor.input("ids", (3,), np.int64)
  w = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
  y = ((Tensor(TABLE).gather(ids, 0, name="emb") @ Tensor(w)).relu() @ Tensor(w)).relu()
  spec, weights = compile([y]).export(["y"])
  stages = split(spec, 2)
  assert sum(len(s.checks) for s in stages) == 1
  plans = [PortablePlan(s, weights) for s in stages]
  with pytest.raises(PlanCheckError, match="index -11 is"): run_in_order(spec, plans, {"ids": np.array([0, -11, 0])})
  assert run_in_order(spec, plans, {"ids": np.array([0, 1, 2])})["y"].shape == (3, 4)
