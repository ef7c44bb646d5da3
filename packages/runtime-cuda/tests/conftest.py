import shutil

import pytest

from kiln.runtime.cuda.compiler import CUDACompiler, find_nvcc

requires_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
requires_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no host C++ compiler")


@pytest.fixture(scope="session")
def nvcc_compiler() -> CUDACompiler:
  return CUDACompiler("sm_90", backend="nvcc")  # one instance: its in-process cache compiles each source once per session


@pytest.fixture(autouse=True, scope="session")
def _emu_cache(tmp_path_factory):
  # a session-private build cache for the emulator, so test runs never touch ~/.cache
  mp = pytest.MonkeyPatch()
  mp.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("kiln-cache")))
  yield
  mp.undo()
