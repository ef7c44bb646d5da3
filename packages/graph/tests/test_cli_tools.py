"""`kiln inspect`, `kiln bench` and `kiln run`'s --random, --runs, --threads, --profile and --trace (issue 39), on tiny ONNX
models made in tmp_path: the printed fields, made-up feeds within range (checked against numpy on the same feeds), every
refused node at once, the ONNX nodes each kernel covers, and bad input as one line with exit code 2."""
from __future__ import annotations

import json
from importlib.metadata import entry_points

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.executor import cli as kiln_cli  # noqa: E402
from kiln.graph import cli as run_cli  # noqa: E402
from kiln.graph import cli_bench, cli_inspect, model_info, random_feeds  # noqa: E402

W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.array([0.5, -1.0, 2.0], np.float32)
EMB = np.arange(21, dtype=np.float32).reshape(7, 3)  # 7 token ids


def _save(path, g, opsets=(("", 17),)) -> str:
  m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], producer_name="kiln-test", producer_version="1.0")
  m.ir_version = 8
  p = str(path)
  onnx.save(m, p)
  return p


def mlp(tmp_path) -> str:
  """y = relu(x @ W + B) (named nodes), z = sum(x, -1) (an unnamed node): x (batch, 4)."""
  g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm0"), helper.make_node("Add", ["mm", "b"], ["a"], name="add0"),
                         helper.make_node("Relu", ["a"], ["y"], name="relu0"), helper.make_node("ReduceSum", ["x", "ax"], ["z"], keepdims=0)],
                        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
                         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch"])],
                        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b"), numpy_helper.from_array(np.array([-1], np.int64), "ax")])
  return _save(tmp_path / "mlp.onnx", g)


def embedder(tmp_path) -> str:
  """e = EMB[input_ids] * attention_mask: token ids into a 7-row table, an int64 mask."""
  g = helper.make_graph([helper.make_node("Gather", ["emb", "input_ids"], ["g"], name="embed"),
                         helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT, name="cast"),
                         helper.make_node("Unsqueeze", ["mf", "axes"], ["mu"], name="unsq"), helper.make_node("Mul", ["g", "mu"], ["e"], name="mul")],
                        "emb", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                                helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                        [helper.make_tensor_value_info("e", TensorProto.FLOAT, ["batch", "seq", 3])],
                        [numpy_helper.from_array(EMB, "emb"), numpy_helper.from_array(np.array([-1], np.int64), "axes")])
  return _save(tmp_path / "emb.onnx", g)


def test_registered_through_entry_points() -> None:
  eps = {ep.name: ep.value for ep in entry_points(group="kiln.commands")}
  assert eps.get("bench") == "kiln.graph.cli_bench:main" and eps.get("inspect") == "kiln.graph.cli_inspect:main"
  assert {"bench", "inspect", "run"} <= set(kiln_cli.plugin_commands())


def test_a_layered_command_without_its_layer_says_what_to_install(capsys, monkeypatch) -> None:
  monkeypatch.setattr(kiln_cli, "plugin_commands", dict)
  assert kiln_cli.main(["bench", "m.onnx"]) == 2
  err = capsys.readouterr().err
  assert "kiln bench" in err and "kiln-graph[onnx]" in err and len(err.strip().splitlines()) == 1


def test_inspect_prints_what_the_model_declares(tmp_path, capsys) -> None:
  assert cli_inspect.main([mlp(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "producer: kiln-test 1.0" in out and "opsets: ai.onnx 17" in out and "4 nodes, 3 initializers" in out
  assert "x  (batch, 4)  float32" in out and "y  (batch, 3)  float32" in out and "z  (batch,)  float32" in out
  census = {ln.split()[0]: ln.split()[1:] for ln in out[out.index("operators"):].splitlines()[1:5]}
  assert census == {"MatMul": ["1"], "Add": ["1"], "Relu": ["1"], "ReduceSum": ["1"]}
  assert "supports every node" in out and "built" not in out


def test_inspect_build_names_the_onnx_nodes_of_each_kernel(tmp_path, capsys) -> None:
  assert cli_inspect.main([mlp(tmp_path), "--build", "--dims", "batch=3"]) == 0
  out = capsys.readouterr().out
  assert "built at batch=3" in out and "2 kernels in 1 plan" in out and "peak buffer memory" in out
  rows = out[out.index("kernels and the ONNX nodes"):].splitlines()[1:]
  assert any(r.endswith("mm0 (MatMul), add0 (Add), relu0 (Relu)") for r in rows), rows  # the bias and relu fuse into the product
  assert any(r.endswith("<ReduceSum z> (ReduceSum)") for r in rows), rows  # an unnamed node: by its op and first output


def test_inspect_lists_every_refused_node_at_once(tmp_path, capsys) -> None:
  g = helper.make_graph([helper.make_node("Shrink", ["x"], ["a"], name="s1"), helper.make_node("Det", ["a"], ["b"], name="d1"),
                         helper.make_node("Relu", ["b"], ["c"], name="ok"), helper.make_node("Custom", ["c"], ["y"], name="c1", domain="com.acme")],
                        "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
  p = _save(tmp_path / "bad.onnx", g, (("", 17), ("com.acme", 1)))
  assert cli_inspect.main([p, "--build"]) == 0
  out = capsys.readouterr().out
  assert "refuses 3 node(s)" in out
  for what in ("node s1 (Shrink): operator Shrink is not supported", "node d1 (Det): operator Det is not supported",
               "node c1 (Custom): domain 'com.acme' is not supported"):
    assert what in out
  assert "com.acme.Custom     1  *" in out and "Det" in out and "not built" in out


def test_random_feeds_keep_ids_in_range_and_masks_on(tmp_path) -> None:
  m = onnx.load(embedder(tmp_path))
  declared = model_info.inputs(onnx, m)
  assert model_info.gather_tables(m) == {"input_ids": 7}
  shapes, defaulted = random_feeds.sizes(declared, {"seq": 50})
  assert shapes == {"input_ids": (1, 50), "attention_mask": (1, 50)} and defaulted == {"batch": random_feeds.DEFAULT_DIM}
  feeds = random_feeds.make(declared, shapes, model_info.gather_tables(m))
  ids, mask = feeds["input_ids"], feeds["attention_mask"]
  assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 7 and len(np.unique(ids)) > 1
  assert mask.dtype == np.int64 and (mask == 1).all()
  again = random_feeds.make(declared, shapes, model_info.gather_tables(m))
  assert np.array_equal(again["input_ids"], ids)  # seeded: kiln and every peer get the same values


def test_run_random_gives_numpys_answer(tmp_path, capsys) -> None:
  p = embedder(tmp_path)
  assert run_cli.main([p, "--random", "--dims", "seq=5", "--out", str(tmp_path / "out")]) == 0
  out = capsys.readouterr().out
  assert "made up: symbolic dims not given with --dims: batch=1" in out
  assert "input_ids (1, 5) int64: ids in [0, 7)" in out and "attention_mask (1, 5) int64: all ones" in out
  m = onnx.load(p)
  declared = model_info.inputs(onnx, m)
  feeds = random_feeds.make(declared, random_feeds.sizes(declared, {"seq": 5})[0], model_info.gather_tables(m))
  np.testing.assert_array_equal(np.load(tmp_path / "out" / "e.npy"), EMB[feeds["input_ids"]])


def test_run_runs_profile_and_trace_speak_onnx(tmp_path, capsys, monkeypatch) -> None:
  monkeypatch.setenv("KILN_THREADS", "1")  # --threads sets it: the pool of this process may already be started
  trace = tmp_path / "t.json"
  assert run_cli.main([mlp(tmp_path), "--random", "--runs", "3", "--threads", "1", "--trace", str(trace)]) == 0
  out = capsys.readouterr().out
  assert "2 more: median" in out and "best" in out
  prof = out[out.index("per-kernel profile"):]
  assert "mm0 (MatMul), add0 (Add), relu0 (Relu)" in prof and "<ReduceSum z> (ReduceSum)" in prof
  totals = prof[prof.index("time per ONNX operator"):].split("\n\n")[0].splitlines()[2:]
  by_op = {ln.split()[0]: ln.split()[1:] for ln in totals}
  assert set(by_op) == {"MatMul", "ReduceSum", "Add", "Relu"}
  assert float(by_op["Add"][0]) == 0 and by_op["Add"][2:] == ["1", "1"]  # fused into the MatMul's kernel, which is charged to MatMul
  assert float(by_op["MatMul"][0]) > 0 and float(by_op["ReduceSum"][0]) > 0
  events = json.loads(trace.read_text())["traceEvents"]
  assert len(events) == 2 and {e["args"]["onnx_op"] for e in events} == {"MatMul", "ReduceSum"}
  mm = next(e for e in events if e["args"]["onnx_op"] == "MatMul")
  assert mm["name"].startswith("MatMul mm0 [") and mm["args"]["onnx_nodes"] == ["mm0 (MatMul)", "add0 (Add)", "relu0 (Relu)"]


def test_bench_prints_latency_and_loads(tmp_path, capsys) -> None:
  assert cli_bench.main([mlp(tmp_path), "--runs", "3", "--warmup", "1", "--dims", "batch=2"]) == 0
  out = capsys.readouterr().out
  assert "x (2, 4) float32: standard normal" in out and "kernels compiled: 2 cold, 0 warm" in out
  assert "3 runs each after 1 warm-up runs" in out
  assert "items/s: runs/s x 2, the leading dim of input 'x'" in out and "p99 of fewer than 100 runs is about the slowest" in out
  head, row = out.splitlines()[-2:]
  for col in ("load cold", "load warm", "p50 ms", "p90 ms", "p99 ms", "runs/s", "items/s", "runs"): assert col in head
  cells = row.split()
  assert cells[0] == "kiln" and cells[-3] == "3" and all(float(c) > 0 for c in (cells[1], cells[3], cells[5], cells[6], cells[7], cells[8]))
  assert abs(float(cells[9]) - 2 * float(cells[8])) < 0.2, row  # items/s: runs/s x the batch (each printed to 0.1)


def test_bench_no_cold_loads_once_from_the_caches(tmp_path, capsys) -> None:
  """--no-cold: one load from the caches as they are (a second bench of the same model compiles nothing), no cold column."""
  from kiln.executor.cache import clear_memory_cache
  path = mlp(tmp_path)
  for compiled in ("2", "0"):
    with cli_bench.settings.CACHE_DIR.temporarily(str(tmp_path / "cache")):
      clear_memory_cache()  # what another process finds: the disk cache only
      assert cli_bench.main([path, "--runs", "2", "--warmup", "0", "--dims", "batch=2", "--no-cold"]) == 0
    out = capsys.readouterr().out
    assert f"kernels compiled: {compiled} (--no-cold: the caches as they are)" in out, out
    cells = out.splitlines()[-1].split()
    assert cells[0] == "kiln" and cells[1] == "-" and float(cells[3]) > 0  # no cold load; the load's time in the warm column


def test_bench_compare_runs_the_installed_peers(tmp_path, capsys) -> None:
  pytest.importorskip("onnxruntime")
  assert cli_bench.main([mlp(tmp_path), "--runs", "2", "--warmup", "0", "--compare"]) == 0
  out = capsys.readouterr().out
  rows = {ln.split()[0]: ln for ln in out.splitlines()[-3:]}
  assert set(rows) == {"kiln", "onnxruntime", "openvino"}
  ort = rows["onnxruntime"].split()
  assert ort[-2].endswith("x") and float(ort[-1]) < 1e-5  # vs kiln, and its outputs agree with kiln's
  from kiln.graph.bench_peers import PEERS
  if not next(p for p in PEERS if p.name == "openvino").installed(): assert rows["openvino"].split()[1:] == ["not", "installed"]
  else: assert float(rows["openvino"].split()[-1]) < 1e-5


def test_a_bad_device_or_dims_name_is_refused_before_anything_is_made_or_loaded(tmp_path, capsys, monkeypatch) -> None:
  from kiln.codegen import registry
  from kiln.graph import onnx as konnx
  from kiln.ir.errors import DeviceError
  def no_driver(spec: object) -> object: raise DeviceError("CUDA launch needs a driver: none here")
  monkeypatch.setitem(registry._registered, "CUDA", no_driver)  # CUDA as a machine without its driver has it, wherever this runs
  monkeypatch.setattr(registry, "_instances", {})
  def never(*a: object, **k: object) -> None: raise AssertionError("the model was loaded")
  monkeypatch.setattr(konnx, "load", never)
  p = embedder(tmp_path)
  for argv, says in ((["--device", "FOO"], "DeviceError: invalid device 'FOO'"), (["--device", "CUDA"], "DeviceError: CUDA launch needs a driver"),
                     (["--dims", "bacth=3"], "--dims names 'bacth' (did you mean 'batch'?), which is no symbolic dim")):
    assert run_cli.main([p, "--random", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kiln run: error: {says}") and len(err.strip().splitlines()) == 1, (argv, out, err)  # no 'made up:' first
  assert cli_bench.main([p, "--device", "GPU"]) == 2 and "DeviceError: CUDA launch needs a driver" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [(["--runs", "0"], "--runs 0: must be >= 1"), (["--time", "-1"], "--time -1.0: must be > 0"),
                                        (["--threads", "0"], "--threads 0: must be >= 1"), (["--input", "q=nope.npy"], "input 'q'"),
                                        (["--dims", "batch=x"], "must be an integer")])
def test_bench_bad_input_is_one_line(tmp_path, capsys, argv, says) -> None:
  assert cli_bench.main([mlp(tmp_path), *argv]) == 2
  err = capsys.readouterr().err
  assert says in err and err.startswith("kiln bench: error:") and len(err.strip().splitlines()) == 1, err
