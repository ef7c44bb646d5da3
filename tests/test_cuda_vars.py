"""Runtime variables a CUDA kernel reads from device memory (kiln.codegen.render.cuda_vars, kiln.runtime.cuda.device_vars),
on the emulated GPU of cuda_emu.py: a plan over a symbolic length gives numpy's answer at every length in its bounds while
its kernels' arguments and grids stay as bound (what lets a CUDA graph of them be launched as built, step after step);
only the values cross the bus. Nothing here ran on a GPU."""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cuda_emu import emulated_gpu  # noqa: E402

from kiln.codegen.render import cuda_vars  # noqa: E402
from kiln.graph.tensor import Tensor, compile  # noqa: E402
from kiln.ir.dtype import dtypes  # noqa: E402
from kiln.ir.ops import Ops  # noqa: E402
from kiln.ir.uop import UOp  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no host C++ compiler to emulate CUDA")


@pytest.fixture
def gpu(monkeypatch, tmp_path):
  monkeypatch.setenv("KILN_COMPILE_THREADS", "2")
  with emulated_gpu(monkeypatch, tmp_path) as (g, _): yield g


def _calls(c) -> list:  # type: ignore[no-untyped-def]
  return [p for p in c.plan.prepared_ops if hasattr(p, "kernel")]


def test_a_length_read_from_memory_keeps_every_launch_as_bound(gpu) -> None:
  """Row sums of the first n rows, n in [1, 300], and their softmax over n: every kernel takes n from memory (its grid at
  n = 300 is a few blocks); each run with a new n copies n's slots in one span and changes no kernel's arguments or grid."""
  x = Tensor.input("x", ("n", 8), dims={"n": (1, 300)})
  s = (x * 2).sum(-1)
  c = compile([s, (s - s.max()).exp() / (s - s.max()).exp().sum()], "CUDA")
  calls = _calls(c)
  assert calls and all(p.kernel.program.spec.vars_in_memory for p in calls if p.kernel.var_names)
  assert all("kiln_vars[0]" in (p.kernel.program.spec.src or "") for p in calls if p.kernel.var_names)
  bound = [(p.bound.arg_buf, p.bound.grid) for p in calls]
  for n in (300, 1, 17, 256):
    xv = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
    before = dict(gpu.stats)
    got = c.run({"x": xv})
    want = (xv * 2).sum(-1)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], np.exp(want - want.max()) / np.exp(want - want.max()).sum(), rtol=1e-5, atol=1e-6)
    assert [(p.bound.arg_buf, p.bound.grid) for p in calls] == bound  # nothing to update in a graph of them
    assert gpu.stats["htod"] - before["htod"] == 2, (gpu.stats, before)  # x, then the variables' span


def test_a_grid_that_would_idle_too_many_blocks_keeps_its_variables_as_arguments(gpu) -> None:
  """n up to 16M elements: at the upper bound the grid is 65536 blocks of 256, too many to launch idle at n = 5, so the
  kernel takes n as an argument (its grid follows n) and still gives numpy's answer."""
  x = Tensor.input("x", ("n",), dims={"n": (1, 1 << 24)})
  c = compile([x * 3 + 1], "CUDA")
  ks = [p.kernel for p in _calls(c) if p.kernel.var_names]
  assert ks and not any(k.program.spec.vars_in_memory for k in ks)
  for n in (5, 4099):
    xv = np.arange(n, dtype=np.float32)
    np.testing.assert_allclose(c.run({"x": xv})[0], xv * 3 + 1)


def test_only_a_grid_that_never_shrinks_as_its_variables_grow_is_fixed_at_their_bounds() -> None:
  """grid_c renders +, * by a constant of at least 0, / by a constant above 0 and max, as C; a difference (a grid that
  shrinks as n grows: its upper bound is not its largest), a division by a variable or a product of two variables is
  refused (None), and such a kernel keeps its arguments."""
  n, m = UOp.variable("n", 0, 100), UOp.variable("m", -3, 10)
  names = {n: "n", m: "m"}
  assert cuda_vars.grid_c((n + -1) // 256 + 1, names) == "(((n + -1) / 256) + 1)"
  assert cuda_vars.grid_c(n.maximum(4) * 2, names) == "(max(n, 4) * 2)"
  assert cuda_vars.grid_c(m + n, names) == "(m + n)"
  assert cuda_vars.grid_c(UOp.const(dtypes.int32, 100) - n, names) is None
  assert cuda_vars.grid_c(UOp(Ops.IDIV, dtypes.int32, (UOp.const(dtypes.int32, 100), n)), names) is None
  assert cuda_vars.grid_c(n * m, names) is None
  assert cuda_vars.grid_c(n * -2, names) is None


def test_a_new_value_reaches_the_kernels_reading_memory_through_one_writer(gpu, monkeypatch) -> None:
  """A plan's variable reaches every kernel that reads it from memory by one write into the arena's host copies
  (CUDABoundCall.vals_writer): no call's set_vals and no resize of its symbolic sizes per run (a decode step's host time:
  60 such calls cost about 3 ms on an H200's host). A kernel taking the same variable as an argument (its grid follows
  n) is still set by set_vals. Both plans give numpy's answer at every n."""
  from kiln.executor.prepared import PreparedKernel
  from kiln.runtime.cuda.driver import CUDABoundCall
  set_vals, resized = [], []
  real_set, real_resize = CUDABoundCall.set_vals, PreparedKernel.resize
  monkeypatch.setattr(CUDABoundCall, "set_vals", lambda self, *a, **k: (set_vals.append(self), real_set(self, *a, **k))[1])
  monkeypatch.setattr(PreparedKernel, "resize", lambda self: (resized.append(self), real_resize(self))[1])
  rows = Tensor.input("x", ("n", 8), dims={"n": (1, 300)})
  s = (rows * 2).sum(-1)
  small = compile([s, (s - s.max()).exp() / (s - s.max()).exp().sum()], "CUDA")  # every grid follows n, fixed at 300
  assert any(p.symbolic_sizes for p in _calls(small)) and all(p.kernel.program.spec.vars_in_memory for p in _calls(small) if p.kernel.var_names)
  x = Tensor.input("x", ("n",), dims={"n": (1, 1 << 24)})
  mixed = compile([x * 3 + 1, x.sum()], "CUDA")  # the elementwise grid follows n as an argument; the sum reads n from memory
  calls = [p for p in _calls(mixed) if p.kernel.var_names]
  as_args = [p for p in calls if not p.kernel.program.spec.vars_in_memory]
  assert as_args and len(as_args) < len(calls), [(p.name, p.kernel.program.spec.vars_in_memory) for p in calls]
  for n in (5, 299, 70000, 3):
    del set_vals[:], resized[:]
    if n <= 300:
      xv = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
      got, want = small.run({"x": xv}), (xv * 2).sum(-1)
      np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(got[1], np.exp(want - want.max()) / np.exp(want - want.max()).sum(), rtol=1e-5, atol=1e-6)
      assert not set_vals and not resized, (n, len(set_vals), len(resized))
      del set_vals[:], resized[:]
    xv = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got = mixed.run({"x": xv})
    np.testing.assert_allclose(got[0], xv * 3 + 1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], xv.astype(np.float64).sum(), rtol=1e-4, atol=1e-4)
    assert {id(b) for b in set_vals} == {id(p.bound) for p in as_args}, n
