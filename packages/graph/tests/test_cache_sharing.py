"""The disk cache hits where nothing that shapes the code changed (issue 39): a kernel compiled with the default thread
count is a hit under KILN_THREADS=1 and 2, and for the same code installed elsewhere with fresh mtimes (a wheel beside
an editable install), each in a new process sharing one cache directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, numpy as np
import kiln.codegen
from kiln.executor import cache
from kiln.graph import Tensor, compile
x = Tensor.input("x", (192, 256), "float32")
w = Tensor(np.arange(256 * 160, dtype=np.float32).reshape(256, 160) % 7 - 3)
out = compile([(x @ w).relu()]).run({"x": np.ones((192, 256), np.float32)})[0]
print(json.dumps({**cache.cache_stats(), "codegen": kiln.codegen.__file__, "sum": float(out.sum())}))
"""

LAYERS = ["uop-ir/src/kiln/ir", "codegen/src/kiln/codegen", "executor/src/kiln/executor", "runtime-cpu/src/kiln/runtime/cpu",
          "graph/src/kiln/graph"]


def _child(env: dict[str, str]) -> dict:
  r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.strip().splitlines()[-1])


def _installed_elsewhere(site: Path) -> None:
  """The layers' .py files copied under `site` as a wheel lays them out, with new mtimes (copyfile, not copy2)."""
  packages = Path(__file__).resolve().parents[2]
  for layer in LAYERS:
    src = packages / layer
    shutil.copytree(src, site / "kiln" / layer.split("/src/kiln/")[1], copy_function=shutil.copyfile,
                    ignore=shutil.ignore_patterns("__pycache__", ".mypy_cache", "*.pyc"))


def test_thread_count_and_install_kind_share_kernel_entries(tmp_path: Path) -> None:
  base = {k: v for k, v in os.environ.items() if k not in ("KILN_THREADS", "PYTHONPATH")}
  env = {**base, "KILN_CACHE_DIR": str(tmp_path / "cache"), "KILN_CACHE": "1"}
  first = _child(env)
  assert first["compiles"] > 0 and first["disk_hits"] == 0, first
  for threads in ("1", "2"):
    again = _child({**env, "KILN_THREADS": threads})
    assert again["compiles"] == 0 and again["disk_hits"] == first["compiles"] and again["sum"] == first["sum"], (threads, again)
  site = tmp_path / "site"
  _installed_elsewhere(site)
  wheel = _child({**env, "PYTHONPATH": str(site), "KILN_THREADS": "1"})
  assert wheel["codegen"].startswith(str(site)), wheel  # the copy ran, not the editable install
  assert wheel["compiles"] == 0 and wheel["disk_hits"] == first["compiles"] and wheel["sum"] == first["sum"], wheel
  # an edit to the copy's code is a miss: the stamp follows content, not only where it is installed
  with open(site / "kiln" / "codegen" / "choose" / "heuristic.py", "a") as f: f.write("\n# an edit\n")
  edited = _child({**env, "PYTHONPATH": str(site)})
  assert edited["compiles"] == first["compiles"] and edited["disk_hits"] == 0, edited


@pytest.mark.parametrize("threads", ["1", "3"])
def test_the_cpu_target_ignores_kiln_threads(threads: str, monkeypatch: pytest.MonkeyPatch) -> None:
  from kiln.codegen.threads import available_cores
  from kiln.runtime.cpu.device import cpu_target
  monkeypatch.setenv("KILN_THREADS", threads)
  t = cpu_target()
  assert t.threads == t.cores == available_cores()
