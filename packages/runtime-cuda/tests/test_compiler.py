"""CUDA C -> PTX and a fatbin (sm_90 SASS + PTX) with nvcc; CompileError with the log and the offending source line."""
import re

import pytest

from kiln.codegen.spec import CompiledSpec, ProgramSpec
from kiln.ir import UOp, dtypes
from kiln.ir.errors import CompileError
from kiln.runtime.cuda import compiler as cmod
from kiln.runtime.cuda.compiler import CUDACompiler, source_excerpt

from .conftest import requires_nvcc
from .kernels import BROKEN, EW_BF16, EW_F32, EW_F64, EW_HALF, EW_I32, GROUP_SUM, SYMBOLIC
from .test_driver import fatbin_entries

KERNELS = {"ew_f32": EW_F32, "ew_f64": EW_F64, "ew_i32": EW_I32, "ew_half": EW_HALF, "ew_bf16": EW_BF16, "group_sum": GROUP_SUM,
           "sym2d": SYMBOLIC}


@requires_nvcc
@pytest.mark.parametrize("name", list(KERNELS))
def test_nvcc_ptx_and_cubin_for_sm90(nvcc_compiler, name):
  ptx, fatbin = nvcc_compiler.compile_src(KERNELS[name], name)
  assert re.search(r"^\.target sm_90\b", ptx, re.M) and f".entry {name}(" in ptx
  assert sorted(fatbin_entries(fatbin) or []) == [("elf", 90), ("ptx", 90)] and name.encode() in fatbin  # SASS + PTX
  assert nvcc_compiler.compile_ptx(KERNELS[name], name) == ptx  # cached: same result, no second nvcc run


@requires_nvcc
def test_compile_program_spec(nvcc_compiler):
  n = UOp.variable("n", 1, 1 << 20)
  ast = UOp.sink(UOp.define_global(0, dtypes.float32.ptr()).index(0).store(1.0))
  spec = ProgramSpec(name="group_sum", src=GROUP_SUM, device="CUDA", ast=ast, global_size=(n, 1, 1), local_size=(256, 1, 1),  # type: ignore[arg-type]
                     vars=[{"name": "n", "min": 1, "max": 1 << 20}], var_names=["n"], globals=[0, 1], outs=[0], ins=[1], buf_count=2)  # type: ignore[list-item]
  c = nvcc_compiler.compile(spec)
  assert fatbin_entries(c.bytes) and c.src == GROUP_SUM and c.compiler == nvcc_compiler.cache_key
  assert (c.var_names, c.buf_count, c.global_size, str(c.device)) == (["n"], 2, (n, 1, 1), "CUDA:0")
  assert CompiledSpec.model_validate_json(c.model_dump_json()) == c


@requires_nvcc
def test_cache_key_names_version_and_arch(monkeypatch):
  c = CUDACompiler("sm_90", backend="nvcc")
  assert re.fullmatch(r"nvcc-V\d+\.\d+\.\d+-sm_90", c.cache_key)
  monkeypatch.setenv("KILN_CUDA_ARCH", "sm_80")
  assert CUDACompiler().arch == "sm_80" and CUDACompiler().cache_key.endswith("-sm_80")
  monkeypatch.delenv("KILN_CUDA_ARCH")
  assert CUDACompiler().arch == "sm_90"


def test_bad_arch_and_backend():
  with pytest.raises(CompileError, match="sm_9x"): CUDACompiler("sm_9x")
  with pytest.raises(CompileError, match="backend"): CUDACompiler(backend="clang")


@requires_nvcc
def test_compile_error_has_log_and_source_line(nvcc_compiler):
  with pytest.raises(CompileError) as ei: nvcc_compiler.compile_src(BROKEN, "broken")
  e = ei.value
  assert "undefined_thing" in e.log and "error" in e.log
  assert ">   3 |   data0[i] = undefined_thing[i] * 2.0f;" in e.source_lines
  assert "    2 |   int i = threadIdx.x;" in e.source_lines  # context around it
  assert "broken" in str(e) and "undefined_thing" in str(e)


def test_source_excerpt():
  src = "\n".join(f"line{i}" for i in range(1, 21))
  out = source_excerpt(src, "k.cu(5): error: a\nk.cu(15): error: b\nk.cu(99): error: outside")
  assert out.splitlines() == ["    4 | line4", ">   5 | line5", "    6 | line6", "   ...", "   14 | line14", ">  15 | line15", "   16 | line16"]
  assert source_excerpt(src, "no line numbers here") == ""


def test_no_compiler_at_all_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(cmod, "find_nvcc", lambda: None)
  monkeypatch.setattr(cmod.NVRTC, "find", staticmethod(lambda: None))
  with pytest.raises(CompileError, match="no CUDA compiler found"): CUDACompiler().compile_src(EW_F32, "ew_f32")
  with pytest.raises(CompileError, match="NVRTC was not found"): CUDACompiler(backend="nvrtc").compile_src(EW_F32, "ew_f32")


@pytest.mark.skipif(cmod.NVRTC.find() is None, reason="libnvrtc.so is not installed")
def test_nvrtc_backend(monkeypatch):
  c = CUDACompiler("sm_90", backend="nvrtc")
  ptx, cubin = c.compile_src(EW_F32, "ew_f32")
  assert ".entry ew_f32(" in ptx and cubin[:4] == b"\x7fELF" and c.cache_key.startswith("nvrtc-")
  with pytest.raises(CompileError) as ei: c.compile_src(BROKEN, "broken")
  assert "undefined_thing" in ei.value.log and ">   3 |" in ei.value.source_lines


def test_9_nvrtc_is_found_where_pip_installs_it(monkeypatch, tmp_path):
  monkeypatch.setattr(cmod, "cuda_home", lambda: None)
  monkeypatch.setattr(cmod.ctypes.util, "find_library", lambda name: None)
  for sub, lib in (("cu13", "libnvrtc.so.13"), ("cuda_nvrtc", "libnvrtc.so.12")):  # CUDA 13 wheels, then CUDA 12 wheels
    site = tmp_path / sub / "site-packages"
    (site / "nvidia" / sub / "lib").mkdir(parents=True)
    (site / "nvidia" / sub / "lib" / lib).write_bytes(b"")
    monkeypatch.setattr(cmod.sys, "path", ["/nonexistent", str(site)])
    assert cmod.NVRTC.find() == str(site / "nvidia" / sub / "lib" / lib)
  monkeypatch.setattr(cmod.sys, "path", [])
  with pytest.raises(CompileError, match="pip install nvidia-cuda-nvrtc` \\(CUDA 13"): CUDACompiler(backend="nvrtc").compile_src(EW_F32, "ew_f32")
