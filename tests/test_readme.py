"""README.md's code blocks run as written (issue 39). Its python blocks run in order in one namespace (later blocks use what
earlier ones made), its sh blocks line by line with bash, in a folder holding the `model.onnx` and `x.npy` the README
says stand for the reader's (x: (batch, 4) -> y = relu(x @ W + b): (batch, 3)), with this environment's `kiln` first on
PATH. A block the README marks `<!-- not run: why -->` on the line before it is not run, and must say why; every other
block must be run (a block of another language is an error, so none is skipped silently). The install command, which
cannot run here, is checked for what it must name: every layer the meta-package pins, each by its folder, and the
meta-package with its onnx extra."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- not run: (?P<why>.*?)-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def blocks() -> list[tuple[str, str, str | None]]:
  """(language, body, why it is not run or None) for every fenced block of README.md, in order."""
  return [(m["lang"], m["body"], m["why"]) for m in FENCE.finditer((ROOT / "README.md").read_text())]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
  onnx = pytest.importorskip("onnx")
  from onnx import TensorProto, helper, numpy_helper
  w = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5) / 10
  nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
  g = helper.make_graph(nodes, "readme", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0.5, -1, 0], np.float32), "b")])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  d = tmp_path_factory.mktemp("readme")
  onnx.save(m, str(d / "model.onnx"))
  np.save(d / "x.npy", np.ones((2, 4), np.float32))
  return d


def test_every_block_is_run_or_says_why_not() -> None:
  found = blocks()
  assert len(found) >= 8, "README.md lost its examples?"
  for lang, body, why in found:
    assert why is None or why.strip(), f"a block marked not run must say why:\n{body}"
    assert why is not None or lang in ("python", "sh"), f"a {lang or 'plain'} block would be skipped silently: mark it or make it python/sh\n{body}"


def test_python_blocks_run_in_order(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.chdir(folder)
  ns: dict[str, object] = {"__name__": "readme"}
  code = [body for lang, body, why in blocks() if lang == "python" and why is None]
  for i, body in enumerate(code): exec(compile(body, f"README.md python block {i + 1}", "exec"), ns)  # noqa: S102
  A, B, C = (np.asarray(ns[k]) for k in "ABC")
  np.testing.assert_allclose(C, A @ B, rtol=1e-4)  # the blocks' own claim: == A @ B
  y = np.asarray(ns["y"])
  assert y.shape == (8, 3) and y.dtype == np.float32 and (y >= 0).all()


def test_sh_blocks_run(folder: Path) -> None:
  env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
  lines = [ln for lang, body, why in blocks() if lang == "sh" and why is None for ln in body.splitlines() if ln.strip()]
  assert any(ln.startswith("kiln run") for ln in lines) and any(ln.startswith("kiln inspect") for ln in lines)
  for ln in lines:
    p = subprocess.run(["bash", "-c", ln], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"README: {ln}\n{p.stdout}\n{p.stderr}"
  assert (folder / "out" / "y.npy").is_file()
  np.testing.assert_allclose(np.load(folder / "out" / "y.npy"), np.maximum(np.ones((2, 4)) @ ((np.arange(12).reshape(4, 3) - 5) / 10)
                                                                           + [0.5, -1, 0], 0), rtol=1e-6)


def test_install_command_names_every_layer() -> None:
  """The documented install from a clone: one pip command with each pinned layer's folder and the meta-package with its onnx
  extra (pip install . alone cannot resolve the pins: the layers are on no index)."""
  line = next(ln for lang, body, _ in blocks() if lang == "sh" for ln in body.splitlines() if ln.startswith("pip install ./packages/"))
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  pinned = {re.split(r"[=<>\[ ]", r)[0] for r in meta["dependencies"]}
  args = shlex.split(line)[2:]
  named = set()
  for a in args:
    if a.startswith("./packages/"):
      named.add(tomllib.loads((ROOT / a / "pyproject.toml").read_text())["project"]["name"])
  assert named == pinned, f"the README's install names {sorted(named)}, the meta-package pins {sorted(pinned)}"
  assert ".[onnx]" in args and "onnx" in meta["optional-dependencies"]
