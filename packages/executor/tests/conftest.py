from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))  # kiln_bench: beside src/, not installed
import kiln_executor_testrt as testrt

from kiln.codegen.registry import _registered, register_runtime, unregister_runtime
from kiln.executor import cache, debug


@pytest.fixture
def cpu(tmp_path, monkeypatch):
  """The real CPU runtime with a fresh memory cache and a private disk cache, for one test (test_tune.py has its own)."""
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  cache.clear_memory_cache()
  yield
  cache.clear_memory_cache()


@pytest.fixture
def rt(tmp_path, monkeypatch):
  """The numpy test runtime registered as "CPU", a fresh memory cache and a private disk cache, for one test."""
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  prev = _registered.get("CPU")
  testrt.reset()
  testrt.install()
  cache.clear_memory_cache()
  level = debug.DEBUG
  debug.set_level(0)
  yield testrt
  debug.set_level(level)
  cache.clear_memory_cache()
  if prev is not None: register_runtime("CPU", prev)
  else: unregister_runtime("CPU")
