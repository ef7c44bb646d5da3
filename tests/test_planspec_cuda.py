"""A CUDA plan written as a PlanSpec and rebuilt (kiln issue 18), over the recording stand-in for pycuda.driver (no GPU
here): the kernels are compiled with nvcc once, the rebuild loads the spec's cubins (no compile) and launches the same
kernels on the same grid with the same buffers' roles; code="compile" compiles them again."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cuda_standin import driver_tests, installed  # noqa: E402

from kiln.codegen import registry
from kiln.executor import Buffer, ExecutionPlanBuilder, PlanSpec, PortablePlan, cache
from kiln.executor.planspec import export
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.runtime.cuda.compiler import find_nvcc

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
  mod = driver_tests()
  calls: list = []
  drv = mod.make_fake_driver(calls, cc=(9, 0))
  with installed(mod, monkeypatch, tmp_path, drv): yield calls


def _launches(calls: list) -> list[tuple]:
  return [(c[1], c[2], c[3]) for c in calls if c[0] == "launch"]  # (kernel, grid, block)


def test_cuda_plan_round_trip(fake_cuda) -> None:
  calls = fake_cuda
  w = np.arange(32 * 16, dtype=np.float32).reshape(32, 16) / 100
  b = ExecutionPlanBuilder("CUDA")
  x = b.add_buffer(Buffer("CUDA", 8 * 32, dtypes.float32))
  bw = b.add_buffer(Buffer("CUDA", w.size, dtypes.float32).copyin(w))
  h, y = b.add_buffer(Buffer("CUDA", 8 * 16, dtypes.float32)), b.add_buffer(Buffer("CUDA", 8 * 16, dtypes.float32))
  b.add_kernel(kernels.matmul(8, 16, 32), [h, x, bw])
  b.add_kernel(kernels.elementwise(lambda v: v.maximum(0.0), dtypes.float32, ((8 * 16,), dtypes.float32), name="relu"), [y, h])
  b.set_outputs([y])
  plan = b.build()
  compiles = cache.cache_stats()["compiles"]
  assert compiles >= 2
  plan.execute()
  first = _launches(calls)
  assert len(first) == 2
  spec, arrays = export(plan, {"x": x}, {"y": y}, {"x": [8, 32], "y": [8, 16]})
  assert spec.device == "CUDA:0" and {e.device for e in spec.storages} == {"CUDA:0"}
  assert len(arrays) == 1 and next(iter(arrays.values())).nbytes == w.nbytes  # the weight, read back from the device
  back = PlanSpec.from_json(spec.to_json())
  cache.clear_memory_cache()
  loads = cache.cache_stats()["spec_loads"]
  calls.clear()
  p = PortablePlan(back, arrays, code="trusted", verify=False)  # the stand-in's copies do not move bytes: no digest to match
  assert cache.cache_stats()["compiles"] == compiles and cache.cache_stats()["spec_loads"] == loads + 2
  assert [c for c in calls if c[0] == "module_from_buffer"], "the spec's cubins were not loaded"
  p.run({"x": np.ones((8, 32), np.float32)})
  assert _launches(calls) == first  # the same kernels, grids and blocks
  cache.clear_memory_cache()
  PortablePlan(back, arrays, code="compile", verify=False)
  assert cache.cache_stats()["compiles"] == compiles + 2


def test_tf32_switch_is_part_of_the_kernel_cache_key(fake_cuda, monkeypatch) -> None:
  """KILN_CUDA_TF32 changes what a float32 matmul renders to, so flipping it mid-process must not reuse the other kernel from
  the memory cache (a bench once timed the float32 kernel under the TF32 row), nor from the disk cache (the fingerprint)."""
  from kiln.executor.cache import compile_kernel
  ast = kernels.matmul(256, 256, 256)
  monkeypatch.delenv("KILN_CUDA_TF32", raising=False)
  plain = compile_kernel(ast, "CUDA")
  monkeypatch.setenv("KILN_CUDA_TF32", "1")
  tf32 = compile_kernel(ast, "CUDA")
  assert tf32 is not plain
  assert "tf32" in tf32.compiled.applied_opts[0] and "tf32" not in plain.compiled.applied_opts[0]
  assert "tf32=1" in registry.get_runtime("CUDA").fingerprint
  monkeypatch.setenv("KILN_CUDA_TF32", "0")
  assert compile_kernel(ast, "CUDA") is plain
