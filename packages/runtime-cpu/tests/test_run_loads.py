"""Vector lanes whose indices differ by constants and fall in a few contiguous runs (Winograd's tiles put back in rows:
each 4x4 tile's row s of 4 planes, lanes x%4 = s reading plane s at x//4) load one vector a run and pick their lanes
out, instead of one scalar load a lane; never a read past the last lane's element (the inputs end at a guard page), on
this host and as AVX2 code. Lanes that read scattered elements, or runs of 2, still gather."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import UOp, dtypes
from kiln.runtime.cpu.compiler import host_cpu
from kiln.runtime.cpu.guard import guarded_array, guarded_copy
from kiln.runtime.cpu.machine import is_x86

needs_avx2 = pytest.mark.skipif(not (is_x86(platform.machine()) and "+avx2" in host_cpu()[1].split(",")), reason="needs an x86 host with AVX2")


def tiles_back(rows: int, tiles: int, planes: int, lanes_apart: int) -> UOp:
  """out[y, x] = src[x % planes, y, x // planes * lanes_apart], src of shape (planes, rows, tiles * lanes_apart) holding
  exactly the elements the last lane reads: runs of `planes` lanes when lanes_apart is 1, single elements otherwise."""
  w = tiles * planes
  size = (planes - 1) * rows * tiles * lanes_apart + (rows - 1) * tiles * lanes_apart + (tiles - 1) * lanes_apart + 1
  out, src = UOp.define_global(0, dtypes.float32.ptr(rows * w)), UOp.define_global(1, dtypes.float32.ptr(size))
  y, x = UOp.range(rows, 0), UOp.range(w, 1)
  v = src.index((x % planes) * (rows * tiles * lanes_apart) + y * (tiles * lanes_apart) + (x // planes) * lanes_apart).load()
  return UOp.sink(out.index(y * w + x).store(v), name=f"tiles_back_{lanes_apart}")


def run(ast: UOp, out: np.ndarray, *ins: np.ndarray) -> str:
  rt = get_runtime("CPU")
  spec = rt.renderer.render(ast)
  rt.load(rt.compiler.compile(spec))([out.ctypes.data] + [a.ctypes.data for a in ins], [], wait=True)
  return spec.src


def scalar_loads(src: str) -> int: return len(re.findall(r"= load float,", src))


def check_all() -> None:
  rng = np.random.default_rng(5)
  for rows, tiles, planes in ((8, 4, 4), (5, 2, 4), (3, 8, 2)):
    for apart in (1, 3):
      x = rng.standard_normal((planes, rows, tiles * apart)).astype(np.float32).reshape(-1)
      x = x[: (planes - 1) * rows * tiles * apart + (rows - 1) * tiles * apart + (tiles - 1) * apart + 1]  # the last lane's element is last
      xg, out = guarded_copy(x), guarded_array(rows * tiles * planes, np.float32)
      src = run(tiles_back(rows, tiles, planes, apart), out, xg)
      full = np.zeros(planes * rows * tiles * apart, np.float32)
      full[: x.size] = x
      want = full.reshape(planes, rows, tiles, apart)[..., 0].transpose(1, 2, 0).reshape(rows, tiles * planes)
      np.testing.assert_array_equal(out.reshape(rows, -1), want)
      # a vector of the row's lanes (the target's width at most) reads runs of vector / planes lanes: vector loads from
      # MIN_RUN (4) on; runs of 2 and single elements gather
      run_ = min(tiles * planes, get_runtime("CPU").target.vector_bytes // 4) // planes
      assert (scalar_loads(src) == 0 and f"load <{run_} x float>" in src) == (apart == 1 and run_ >= 4), (rows, tiles, planes, apart)


def test_runs_load_as_vectors() -> None:
  check_all()


@needs_avx2
def test_runs_on_avx2() -> None:
  env = {**os.environ, "KILN_CPU": "x86-64-v3", "KILN_CACHE": "0"}
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
          "from kiln.codegen.registry import get_runtime\nassert get_runtime('CPU').target.vector_bytes == 32\n"
          "from test_run_loads import check_all\ncheck_all()\nprint('ok')")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
