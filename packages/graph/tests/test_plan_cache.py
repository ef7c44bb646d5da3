"""The plan cache (kiln.executor.plan_cache, kiln.graph.onnx_plan_cache): loading a model again rebuilds its whole plan
from the cache, giving the same outputs bit for bit; a change to the model, its dims or a setting that shapes plans is a
miss; an altered, torn or foreign entry is a miss that still loads the right model, never a crash or a wrong answer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.executor.cache import cache_stats  # noqa: E402
from kiln.graph import GraphError, Tensor, compile  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

RNG = np.random.default_rng(7)


def _model(scale: float = 1.0, batch: str | int = 1) -> onnx.ModelProto:
  """Conv + BatchNormalization (folded) + Relu + Gemm, a constant output and an input an initializer gives a value."""
  w = (RNG.standard_normal((4, 3, 3, 3)) * scale).astype(np.float32)
  inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.linspace(0.5, 1.5, 4, dtype=np.float32), "g"),
           numpy_helper.from_array(np.linspace(-0.2, 0.2, 4, dtype=np.float32), "b"),
           numpy_helper.from_array(np.linspace(0.0, 0.3, 4, dtype=np.float32), "mu"),
           numpy_helper.from_array(np.linspace(1.0, 2.0, 4, dtype=np.float32), "var"),
           numpy_helper.from_array(RNG.standard_normal((64, 5)).astype(np.float32), "fc"),
           numpy_helper.from_array(np.array([2.0], np.float32), "k"), numpy_helper.from_array(np.arange(3, dtype=np.int64), "c0")]
  nodes = [helper.make_node("Conv", ["x", "w"], ["cv"], pads=[1, 1, 1, 1], strides=[2, 2]),
           helper.make_node("BatchNormalization", ["cv", "g", "b", "mu", "var"], ["bn"]),
           helper.make_node("Relu", ["bn"], ["r"]), helper.make_node("Mul", ["r", "k"], ["rk"]),
           helper.make_node("Flatten", ["rk"], ["f"]), helper.make_node("MatMul", ["f", "fc"], ["y"]),
           helper.make_node("Add", ["c0", "c0"], ["c"])]
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8]),
                                     helper.make_tensor_value_info("k", TensorProto.FLOAT, [1])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5]),
                         helper.make_tensor_value_info("c", TensorProto.INT64, [3])],
                        inits)
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  return m


X = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)


@pytest.fixture
def cache(plan_cache_dir: Path) -> Path: return plan_cache_dir  # the repository's conftest.py


def _load(model: object, **kw: object) -> tuple[konnx.Model, bool]:
  """The loaded model and whether the plan cache gave it."""
  before = cache_stats()["plan_hits"]
  m = konnx.load(model, **kw)  # type: ignore[arg-type]
  return m, cache_stats()["plan_hits"] > before


def _same(a: konnx.Model, b: konnx.Model, feeds: dict[str, np.ndarray]) -> None:
  got, want = a.run(feeds), b.run(feeds)
  assert list(got) == list(want) == ["y", "c"]
  for n in got: np.testing.assert_array_equal(got[n], want[n])


def test_a_second_load_is_a_hit_with_the_same_outputs(cache: Path, tmp_path: Path) -> None:
  path = tmp_path / "m.onnx"
  onnx.save(_model(), path)
  first, hit = _load(str(path))
  assert not hit and len(list(cache.glob("*.json"))) == 1 and len(list(cache.glob("*.bin"))) == 1
  again, hit = _load(str(path))
  assert hit and again.compiled is not None and again.compiled.kernels == []
  _same(again, first, {"x": X})
  want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X, "k": np.array([2.0], np.float32)})
  np.testing.assert_allclose(again.run({"x": X})["y"], want[0], rtol=1e-5, atol=1e-5)
  assert again.run({"x": X, "k": np.array([2.0], np.float32)})["c"].tolist() == [0, 2, 4]  # the default is still checked
  with pytest.raises(konnx.ONNXError, match="initializer"): again.run({"x": X, "k": np.array([3.0], np.float32)})
  assert [n for n, *_ in again.inputs] == ["x"] and again.output_names == ["y", "c"] and again.nodes == first.nodes
  assert again.outputs == first.outputs and again.inputs == first.inputs
  from kiln.graph.onnx_profile import nodes_of
  assert nodes_of(again) == nodes_of(first) and any(o.op_type == "Conv" for os_, _ in nodes_of(again).values() for o in os_)  # a profile's ONNX names
  bytes_hit = _load(path.read_bytes())[1]
  assert bytes_hit  # the same content given as bytes: the same key


def test_a_model_loaded_with_bounds_is_kept_for_every_size_within_them(cache: Path, tmp_path: Path) -> None:
  """Symbolic dims: the kept plan carries its shapes as polynomials in the variables (a batch, a sum of two dims), and the
  rebuilt one runs each size within the bounds as the loaded one does, with the same refusals outside them."""
  path = tmp_path / "m.onnx"
  onnx.save(_model(batch="n"), path)
  first, hit = _load(str(path), dims={"n": (1, 4)})
  assert not hit
  again, hit = _load(str(path), dims={"n": (1, 4)})
  assert hit and again.compiled is not None and again.compiled.kernels == [] and list(again.compiled.variables) == ["n"]
  assert again.inputs == first.inputs and again.outputs == first.outputs
  for n in (1, 3, 4):
    _same(again, first, {"x": np.repeat(X, n, 0) * np.arange(1, n + 1, dtype=np.float32)[:, None, None, None]})
  with pytest.raises(konnx.ONNXError, match="bounds"): again.run({"x": np.repeat(X, 5, 0)})
  assert not _load(str(path), dims={"n": (1, 8)})[1]  # other bounds: another plan
  a, b, c = (Tensor.input(name, (name, 3), dims={name: (0, 6)}) for name in ("p", "q", "r"))
  cat = Tensor.cat([a, b, c], 0)[1:]  # p + q + r - 1 rows: a sum, checked >= 0 at run time
  first = compile([cat * 2], cache="sum-dims")
  again = compile([cat * 2], cache="sum-dims")
  assert again.kernels == [] and again.sizes == first.sizes and again.outputs[0][1] == first.outputs[0][1]
  feeds = {n: np.full((k, 3), k, np.float32) for n, k in (("p", 2), ("q", 0), ("r", 3))}
  for g, w in zip(again.run(feeds), first.run(feeds)): np.testing.assert_array_equal(g, w)
  with pytest.raises(GraphError): again.run({n: np.zeros((0, 3), np.float32) for n in "pqr"})  # 0 + 0 + 0 - 1 rows


def test_what_the_plan_depends_on_is_part_of_the_key(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
  path = tmp_path / "m.onnx"
  onnx.save(_model(batch="n"), path)
  base, _ = _load(str(path), dims={"n": 1})
  assert _load(str(path), dims={"n": 1})[1]
  assert not _load(str(path), dims={"n": 2})[1]  # other dims
  monkeypatch.setenv("KILN_WINOGRAD", "0")
  assert not _load(str(path), dims={"n": 1})[1]  # a setting that shapes plans
  monkeypatch.delenv("KILN_WINOGRAD")
  monkeypatch.setenv("KILN_THREADS", "1")
  assert _load(str(path), dims={"n": 1})[1]  # one that does not
  from kiln.graph import plan_keys
  for layer in ("kiln.graph", "kiln.executor"):  # the code that converts and schedules: another version of it is a miss
    plan_keys.stamp(layer)
    with monkeypatch.context() as mp:
      mp.setitem(plan_keys._stamps, layer, "edited")
      assert not _load(str(path), dims={"n": 1})[1]
  onnx.save(_model(scale=3.0, batch="n"), path)  # the same file rewritten with other weights (its size unchanged)
  changed, hit = _load(str(path), dims={"n": 1})
  assert not hit
  want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X, "k": np.array([2.0], np.float32)})
  np.testing.assert_allclose(changed.run({"x": X})["y"], want[0], rtol=1e-5, atol=1e-5 * np.abs(want[0]).max())  # sums to ~250: float32's order
  assert not np.allclose(changed.run({"x": X})["y"], base.run({"x": X})["y"])
  assert not _load(str(path), dims={"n": (1, 4)})[1]


def _entry(cache: Path) -> tuple[Path, Path]:
  (j,) = cache.glob("*.json")
  return j, j.with_suffix(".bin")


@pytest.mark.parametrize("damage", ["flip_weight", "flip_weight_after_a_hit", "truncate_weights", "drop_weights", "link_weights", "alter_json",
                                    "truncate_json", "another_key", "foreign_format"])
def test_a_damaged_entry_is_a_miss_that_loads_the_right_model(cache: Path, damage: str) -> None:
  model = _model()
  ref, _ = _load(model)
  j, b = _entry(cache)
  if damage == "flip_weight_after_a_hit":  # a hit seals the verified file's stat; a write changes its ctime
    assert _load(model)[1] and json.loads(j.read_text())["verified"]
  data = bytearray(b.read_bytes())
  if damage.startswith("flip_weight"):
    st = b.stat()
    data[len(data) // 2] ^= 0x40
    b.write_bytes(bytes(data))
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and mtime as before
  elif damage == "truncate_weights": b.write_bytes(bytes(data[: len(data) // 2]))
  elif damage == "drop_weights": b.unlink()
  elif damage == "link_weights":
    other = b.with_name("elsewhere")
    other.write_bytes(bytes(data))
    b.unlink()
    os.symlink(other, b)
  elif damage == "alter_json":  # valid JSON whose MAC no longer verifies
    obj = json.loads(j.read_text())
    obj["meta"]["nodes"] += 1
    j.write_text(json.dumps(obj))
  elif damage == "truncate_json": j.write_bytes(j.read_bytes()[:100])
  elif damage == "another_key":  # a genuine entry of another model moved to this one's name
    other = _model(scale=2.0)
    _load(other)
    (oj,) = [p for p in cache.glob("*.json") if p != j]
    oj.replace(j)
    oj.with_suffix(".bin").replace(b)
  else:
    from kiln.codegen import diskcache
    area = diskcache.DiskCache("plans", "plan cache", cache.parent)
    obj = area.load_json(j.name)
    assert obj is not None
    area.store_json(j.name, {**obj, "format": 99})
  got, hit = _load(model)
  assert not hit
  _same(got, ref, {"x": X})
  assert _load(model)[1]  # stored again: the next load hits


def test_kiln_cache_0_keeps_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("KILN_CACHE", "0")
  model = _model()
  _load(model)
  assert not _load(model)[1] and not cache.exists()


def test_the_least_recently_used_plans_go_past_the_bound(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
  a, b = _model(), _model()
  _load(a)
  (ja, _) = _entry(cache)
  monkeypatch.setenv("KILN_PLAN_CACHE_BYTES", str(sum(p.stat().st_size for p in cache.iterdir()) + 1000))  # room for one entry
  _load(b)
  assert not ja.exists() and len(list(cache.glob("*.json"))) == 1
  assert _load(b)[1] and not _load(a)[1]


def test_a_hit_keeps_the_run_time_index_checks(cache: Path) -> None:
  from kiln.graph.lazy import IndexOutOfRangeError
  table = RNG.standard_normal((10, 4)).astype(np.float32)
  g = helper.make_graph([helper.make_node("Gather", ["t", "ids"], ["y"], name="tok_emb")], "g",
                        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
                        [numpy_helper.from_array(table, "t")])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  _load(m)
  hit, was_hit = _load(m)
  assert was_hit
  np.testing.assert_array_equal(hit.run({"ids": np.array([1, 9, -1])})["y"], table[[1, 9, -1]])
  with pytest.raises(IndexOutOfRangeError, match=r"node tok_emb \(Gather\).*index 10 is out of range"): hit.run({"ids": np.array([0, 10, 2])})


def test_a_path_that_is_no_regular_file_is_refused_as_before(cache: Path, tmp_path: Path) -> None:
  fifo = tmp_path / "m.onnx"
  os.mkfifo(fifo)  # hashing it for the key must not block on it: load refuses it as it always has
  with pytest.raises(konnx.ONNXError, match="not a regular file"): konnx.load(str(fifo))
  with pytest.raises(konnx.ONNXError, match="does not exist"): konnx.load(str(tmp_path / "absent.onnx"))
