"""`kiln run`'s refusals end to end through the `kiln` command (issue 39's list): each one line on stderr and exit code 2,
no traceback; `kiln --debug` lets the traceback through. In process (kiln.executor.cli.main), on a one-node model."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from kiln.executor import cli  # noqa: E402
from kiln.ir.errors import DeviceError  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
  d = tmp_path_factory.mktemp("cli_errors")
  g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  onnx.save(m, str(d / "m.onnx"))
  np.save(d / "x.npy", np.ones((2, 4), np.float32))
  np.save(d / "x64.npy", np.ones((2, 4)))
  (d / "bad.onnx").write_bytes(b"\x08\x07 not a model")
  return {k: str(d / f) for k, f in {"model": "m.onnx", "x": "x.npy", "x64": "x64.npy", "bad": "bad.onnx", "missing": "none.onnx"}.items()}


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], want: str) -> None:
  assert cli.main(argv) == 2, argv
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("kiln run: error: "), err
  assert want in err, err


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv("KILN_DEBUG", raising=False)
  monkeypatch.delenv("KILN_THREADS", raising=False)


def test_each_refusal_is_one_line_exit_2(files, capsys) -> None:
  run = ["run", files["model"], "-i", f"x={files['x']}"]
  _one_line(capsys, [*run, "--device", "FOO"], "unknown device kind 'FOO'")
  _one_line(capsys, ["run", files["missing"], "--random"], "does not exist")
  _one_line(capsys, ["run", files["bad"], "--random"], "not a valid ONNX model")
  _one_line(capsys, ["run", files["model"], "-i", f"x={files['x64']}"], "dtype float64, the model takes float32")
  _one_line(capsys, [*run, "--dims", "btach=2"], "dims names 'btach' (did you mean 'batch'?)")
  _one_line(capsys, ["run", files["model"], "-i", f"X={files['x']}"], "no input 'X' (did you mean 'x'?)")


def test_a_bad_setting_is_one_line_in_a_fresh_process(files) -> None:
  """KILN_THREADS is read when the CPU runtime starts: in this process it has (python -m kiln, the same command)."""
  env = {k: v for k, v in os.environ.items() if k != "KILN_DEBUG"} | {"KILN_THREADS": "abc"}
  p = subprocess.run([sys.executable, "-m", "kiln", "run", files["model"], "--random"], capture_output=True, text=True, env=env, timeout=300)
  assert p.returncode == 2 and p.stderr == "kiln run: error: SettingError: KILN_THREADS must be a positive integer, got 'abc'\n", p.stderr


def test_cuda_without_pycuda_is_one_line(files, capsys) -> None:
  if importlib.util.find_spec("pycuda") is not None or "pycuda" in sys.modules: pytest.skip("pycuda (or its stand-in) is here")
  _one_line(capsys, ["run", files["model"], "-i", f"x={files['x']}", "--device", "CUDA"], "kiln-runtime-cuda[driver]")


def test_without_onnx_it_says_what_to_install(files, capsys, monkeypatch) -> None:
  monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx fails, as where the extra is not installed
  _one_line(capsys, ["run", files["model"], "--random"], 'pip install "kiln-graph[onnx]"')


def test_debug_shows_the_traceback(files, monkeypatch) -> None:
  with pytest.raises(DeviceError): cli.main(["--debug", "run", files["model"], "--random", "--device", "FOO"])
  monkeypatch.setenv("KILN_DEBUG", "1")
  with pytest.raises(DeviceError): cli.main(["run", files["model"], "--random", "--device", "FOO"])
