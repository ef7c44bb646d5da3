"""Vector lanes that load every 2nd, 3rd or 4th element (a 2x2 pool's rows): one masked load of the span, every c-th lane
on, then the lanes picked out; never a read past the last lane's element (the inputs end at a guard page), on this host
and as AVX2 code. A stride of 5 still gathers."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import AxisType, Ops, UOp, dtypes
from kiln.runtime.cpu.compiler import host_cpu
from kiln.runtime.cpu.guard import guarded_array, guarded_copy
from kiln.runtime.cpu.machine import is_x86

needs_avx2 = pytest.mark.skipif(not (is_x86(platform.machine()) and "+avx2" in host_cpu()[1].split(",")), reason="needs an x86 host with AVX2")


def strided_copy(n: int, c: int, off: int, dt=dtypes.float32) -> UOp:
  """out[i] = x[c*i + off]; x holds exactly c*(n-1) + off + 1 elements."""
  out, x = UOp.define_global(0, dt.ptr(n)), UOp.define_global(1, dt.ptr(c * (n - 1) + off + 1))
  i = UOp.range(n, 0)
  return UOp.sink(out.index(i).store(x.index(i * c + off).load()), name=f"strided_{c}")


def max_pool(n: int, h: int, w: int) -> UOp:
  """out[b, y, x] = max over 2x2 of x[b, 2y + i, 2x + j], x of shape (n, 2h, 2w)."""
  out, x = UOp.define_global(0, dtypes.float32.ptr(n * h * w)), UOp.define_global(1, dtypes.float32.ptr(n * 4 * h * w))
  b, y, xx = UOp.range(n, 0), UOp.range(h, 1), UOp.range(w, 2)
  i, j = UOp.range(2, 3, AxisType.REDUCE), UOp.range(2, 4, AxisType.REDUCE)
  v = x.index(b * (4 * h * w) + (y * 2 + i) * (2 * w) + xx * 2 + j).load().reduce(Ops.MAX, i, j)
  return UOp.sink(out.index(b * (h * w) + y * w + xx).store(v), name="pool2")


def run(ast: UOp, out: np.ndarray, *ins: np.ndarray) -> str:
  rt = get_runtime("CPU")
  spec = rt.renderer.render(ast)
  rt.load(rt.compiler.compile(spec))([out.ctypes.data] + [a.ctypes.data for a in ins], [], wait=True)
  return spec.src


def check_all() -> None:
  rng = np.random.default_rng(3)
  for c in (2, 3, 4, 5):
    for n, off, dt, npdt in ((64, 0, dtypes.float32, np.float32), (48, 1, dtypes.float32, np.float32), (16, 2, dtypes.int8, np.int8)):
      x = guarded_copy(rng.integers(-100, 100, c * (n - 1) + off + 1).astype(npdt))  # its last element is the guard page's neighbour
      out = guarded_array(n, npdt)
      src = run(strided_copy(n, c, off, dt), out, x)
      np.testing.assert_array_equal(out, x[off::c][:n])
      assert ("@llvm.masked.load" in src) == (c != 5), (c, n, off, dt)
  x = rng.standard_normal((4, 32, 32)).astype(np.float32)
  x[1, 3, 5] = np.nan  # max propagates a NaN, as numpy's
  xg = guarded_copy(x.reshape(-1))
  out = guarded_array(4 * 16 * 16, np.float32)
  src = run(max_pool(4, 16, 16), out, xg)
  assert "@llvm.masked.load" in src
  np.testing.assert_array_equal(out.reshape(4, 16, 16), x.reshape(4, 16, 2, 16, 2).max((2, 4)))


def test_strided_lanes_load_as_one_masked_span() -> None:
  check_all()


@needs_avx2
def test_strided_lanes_on_avx2() -> None:
  env = {**os.environ, "KILN_CPU": "x86-64-v3", "KILN_CACHE": "0"}
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
          "from kiln.codegen.registry import get_runtime\nassert get_runtime('CPU').target.vector_bytes == 32\n"
          "from test_strided_loads import check_all\ncheck_all()\nprint('ok')")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
