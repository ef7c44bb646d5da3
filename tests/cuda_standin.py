"""kiln-runtime-cuda's stand-in for pycuda.driver (its tests/test_driver.py, loaded by path: it is no installed module) for
the suite's cross-layer CUDA tests, with the install and the teardown checks their fixtures share."""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.codegen import registry
from kiln.executor import cache

_DRIVER_TESTS = Path(__file__).resolve().parents[1] / "packages" / "runtime-cuda" / "tests" / "test_driver.py"


def driver_tests() -> ModuleType:
  """runtime-cuda's tests/test_driver.py as a module (make_fake_driver, install_standin, ...)."""
  spec = importlib.util.spec_from_file_location("kiln_cuda_driver_tests", _DRIVER_TESTS)
  assert spec is not None and spec.loader is not None
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@contextmanager
def installed(mod: ModuleType, monkeypatch: Any, tmp_path: Path, drv: Any) -> Iterator[None]:
  """drv as the pycuda.driver kiln imports, with fresh kernel caches; after the test, the CUDA runtime is dropped and
  pycuda's context rules must have held (no context left pushed, no frees refused)."""
  mod.install_standin(monkeypatch, tmp_path, drv)
  cache.clear_memory_cache()
  yield
  registry.unregister_runtime("CUDA")
  cache.clear_memory_cache()
  assert drv._problems() == []
