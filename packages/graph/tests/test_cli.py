"""`kiln run`: the command kiln-graph registers with the executor's `kiln` CLI (entry-point group kiln.commands), on a tiny
ONNX model in tmp_path: outputs' statistics, --out, --profile, symbolic dims, and bad input as one line with exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.executor import cli as kiln_cli  # noqa: E402
from kiln.graph import cli  # noqa: E402

W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.array([0.5, -1.0, 2.0], np.float32)


def tiny_model(path, batch: int | str = 2) -> str:
  """y = relu(x @ W + B), z = sum(x, -1): x (batch, 4)."""
  g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["a"]),
                         helper.make_node("Relu", ["a"], ["y"]), helper.make_node("ReduceSum", ["x", "ax"], ["z/sum"], keepdims=0)],
                        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3]),
                         helper.make_tensor_value_info("z/sum", TensorProto.FLOAT, [batch])],
                        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b"), numpy_helper.from_array(np.array([-1], np.int64), "ax")])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  p = str(path / "tiny.onnx")
  onnx.save(m, p)
  return p


def npy(path, name: str, a: np.ndarray) -> str:
  p = str(path / name)
  np.save(p, a)
  return p


X = np.array([[1, -2, 3, 0.5], [-1, 0, 2, 4]], np.float32)


def test_registered_through_entry_point() -> None:
  eps = {ep.name: ep.value for ep in entry_points(group="kiln.commands")}
  assert eps.get("run") == "kiln.graph.cli:main"
  assert "run" in kiln_cli.plugin_commands()


def test_run_prints_stats_and_writes_outputs(tmp_path, capsys) -> None:
  m, x = tiny_model(tmp_path), npy(tmp_path, "x.npy", X)
  rc = kiln_cli.main(["run", m, "--input", f"x={x}", "--out", str(tmp_path / "out")])
  out = capsys.readouterr().out
  assert rc == 0, out
  y, z = np.maximum(X @ W + B, 0), X.sum(-1)
  assert " 2 kernels" in out
  line = next(ln for ln in out.splitlines() if ln.strip().startswith("y "))
  assert "(2, 3)" in line and "float32" in line and f"max {y.max():.6g}" in line and f"mean {y.mean():.6g}" in line and f"min {y.min():.6g}" in line
  np.testing.assert_allclose(np.load(tmp_path / "out" / "y.npy"), y, rtol=1e-6)
  np.testing.assert_allclose(np.load(tmp_path / "out" / "z_sum.npy"), z, rtol=1e-6)  # "/" in a name never leaves DIR


def test_profile(tmp_path, capsys) -> None:
  m, x = tiny_model(tmp_path), npy(tmp_path, "x.npy", X)
  assert cli.main([m, "-i", f"x={x}", "--profile"]) == 0
  out = capsys.readouterr().out
  assert "per-kernel profile" in out and "GFLOP/s" in out and "total" in out
  table = out[out.index("per-kernel profile"):].split("\n      total")[0].splitlines()[2:]
  assert len(table) >= 1 and all("CPU" in ln for ln in table)


def test_symbolic_dims_from_inputs_or_flag(tmp_path, capsys) -> None:
  m = tiny_model(tmp_path, batch="batch")
  x3 = np.concatenate([X, X[:1]])
  assert cli.main([m, "-i", f"x={npy(tmp_path, 'x3.npy', x3)}"]) == 0
  assert "(3, 3)" in capsys.readouterr().out
  assert cli.main([m, "-i", f"x={npy(tmp_path, 'x3.npy', x3)}", "--dims", "batch=3"]) == 0
  capsys.readouterr()
  assert cli.main([m, "-i", f"x={npy(tmp_path, 'x3.npy', x3)}", "--dims", "batch=2"]) == 2
  assert "batch = 2" in capsys.readouterr().err


@pytest.mark.parametrize("case,needle", [
  ("missing_file", "the file does not exist"), ("fifo_input", "the file is a FIFO"), ("dir_model", "is a directory"),
  ("fifo_model", "is a FIFO"), ("future_opset", "opset 99"), ("unknown_device", "DeviceError"),
  ("unknown_name", "has no input 'q'"), ("wrong_shape", "has shape (2, 5)"),
  ("wrong_rank", "rank 2"), ("not_given", "is not given"), ("bad_pair", "NAME=VALUE"), ("not_npy", "not a readable .npy"),
  ("missing_model", "the model file does not exist"), ("bad_model", "not a valid ONNX model"),
  ("bad_dims", "must be an integer"),
  ("wrong_dtype", "dtype"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case: str, needle: str) -> None:
  m, x = tiny_model(tmp_path), npy(tmp_path, "x.npy", X)
  bad_model = tmp_path / "bad.onnx"
  bad_model.write_bytes(b"definitely not protobuf" * 4)
  junk = tmp_path / "junk.npy"
  junk.write_bytes(b"junk")
  args = {"missing_file": [m, "-i", f"x={tmp_path / 'nope.npy'}"], "unknown_name": [m, "-i", f"x={x}", "-i", f"q={x}"],
          "wrong_shape": [m, "-i", f"x={npy(tmp_path, 'x5.npy', np.zeros((2, 5), np.float32))}"],
          "wrong_rank": [m, "-i", f"x={npy(tmp_path, 'x1.npy', np.zeros(4, np.float32))}"], "not_given": [m],
          "bad_pair": [m, "-i", x], "not_npy": [m, "-i", f"x={junk}"], "missing_model": [str(tmp_path / "nope.onnx"), "-i", f"x={x}"],
          "bad_model": [str(bad_model), "-i", f"x={x}"], "bad_dims": [m, "-i", f"x={x}", "--dims", "batch=two"],
          "wrong_dtype": [m, "-i", f"x={npy(tmp_path, 'xb.npy', np.zeros((2, 4), np.bool_))}"]}.get(case)
  if case == "fifo_input": os.mkfifo(tmp_path / "fifo.npy")
  if case == "fifo_model": os.mkfifo(tmp_path / "fifo.onnx")
  if case == "future_opset":
    proto = onnx.load(m)
    proto.opset_import[0].version = 99
    onnx.save(proto, m)
  args = {"fifo_input": [m, "-i", f"x={tmp_path / 'fifo.npy'}"], "dir_model": [str(tmp_path), "-i", f"x={x}"],
          "fifo_model": [str(tmp_path / "fifo.onnx"), "-i", f"x={x}"], "future_opset": [m, "-i", f"x={x}"],
          "unknown_device": [m, "-i", f"x={x}", "--device", "NOPE"]}.get(case, args)
  assert args is not None
  assert cli.main(args) == 2  # a FIFO must not block: the test would hang
  cap = capsys.readouterr()
  assert cap.err.startswith("kiln run: error:") and needle in cap.err, cap.err
  assert "Traceback" not in cap.err and len(cap.err.strip().splitlines()) == 1


def test_console_script_subprocess(tmp_path) -> None:
  """The installed `kiln` command, in a new process: the executor's CLI finds `run` through the entry point."""
  m, x = tiny_model(tmp_path), npy(tmp_path, "x.npy", X)
  code = "import sys; from kiln.executor.cli import main; sys.exit(main(sys.argv[1:]))"
  p = subprocess.run([sys.executable, "-c", code, "run", m, "-i", f"x={x}"], capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and "y " in p.stdout, p.stderr
  p = subprocess.run([sys.executable, "-c", code, "run", m, "-i", f"q={x}"], capture_output=True, text=True, timeout=300)
  assert p.returncode == 2 and "has no input 'q'" in p.stderr and "Traceback" not in p.stderr
  p = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and "run" in p.stdout


def branchy_model(path) -> str:
  """z = If(c, tanh(e), sqrt(e)) + e with e = exp(x): c is a fed input, so the If is chosen at run time (a program: several
  plans, both sides compiled at load). x's two dims have no name (silero_vad's): each is keyed by input and axis, x:0 and x:1."""
  def side(op: str, out: str) -> object:
    return helper.make_graph([helper.make_node(op, ["e"], [out])], out, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
  g = helper.make_graph([helper.make_node("Exp", ["x"], ["e"]),
                         helper.make_node("If", ["c"], ["y"], then_branch=side("Tanh", "t"), else_branch=side("Sqrt", "s"), name="if1"),
                         helper.make_node("Add", ["y", "e"], ["z"])], "branchy",
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None]),
                         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, None])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  p = str(path / "branchy.onnx")
  onnx.save(m, p)
  return p


@pytest.mark.parametrize("c", [True, False])
def test_run_time_if_counts_every_plan_and_profiles_the_branch_taken(tmp_path, capsys, c: bool) -> None:
  from kiln.graph import onnx as konnx
  m = branchy_model(tmp_path)
  x = X[:, :3] / 4
  feeds = {"x": x, "c": np.array(c)}
  args = [m, "-i", f"x={npy(tmp_path, 'x.npy', x)}", "-i", f"c={npy(tmp_path, 'c.npy', feeds['c'])}", "--profile", "-o", str(tmp_path / "out")]
  assert cli.main(args + ([] if c else ["--dims", "x:1=3"])) == 0  # two unnamed dims of different sizes do not clash
  out = capsys.readouterr().out
  e = np.exp(x)
  np.testing.assert_allclose(np.load(tmp_path / "out" / "z.npy"), (np.tanh(e) if c else np.sqrt(e)) + e, rtol=1e-5)
  km = konnx.load(m, dims={"x:0": 2, "x:1": 3})
  counts = [len(p.kernels) for p in km.plans]
  assert km.plan is None and len(counts) > 1 and all(counts)
  assert f": {sum(counts)} kernels in {len(counts)} plans ({' + '.join(map(str, counts))}:" in out, out
  assert "per-kernel profile" in out and "the branches these inputs take" in out, out
  table = out[out.index("per-kernel profile"):].split("\n      total")[0].splitlines()[2:]
  assert len(table) == len(km.run_profiled(feeds)[1]) > 0 and all("CPU" in ln for ln in table)
