"""The compile pipeline (kiln.codegen.pipeline): the renderers' render is compile_ast, and KILN_DUMP_AST prints what the named
passes made to stderr."""
from __future__ import annotations

import pytest

from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.dump import PASSES
from kiln.codegen.pipeline import compile_ast, lower
from kiln.codegen.render.cuda import CUDARenderer
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import CodegenError, SettingError, kernels
from kiln.ir.dtype import dtypes
from kiln.ir.ops import Ops

CPU = LLVMRenderer(Target(device="CPU", vector_bytes=32, threads=1))
H100 = CUDARenderer(Target(device="CUDA", vector_bytes=0, threads=1, gpu_arch=90, gpu_sms=132))


def _add(n: int = 1003):
  return kernels.elementwise(lambda a, b: a + b, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32), name="add")


def _dumps(err: str) -> list[str]: return [line.removeprefix("kiln: after ") for line in err.splitlines() if line.startswith("kiln: after ")]


def test_render_is_the_pipeline() -> None:
  ast = _add()
  assert CPU.render(ast).src == compile_ast(ast, CPU).src
  assert CPU.render(ast, [Opt(OptOps.UPCAST, 0, 8)]).src == compile_ast(ast, CPU, [Opt(OptOps.UPCAST, 0, 8)]).src


def test_dump_prints_the_named_passes_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
  monkeypatch.delenv("KILN_DUMP_AST", raising=False)
  CPU.render(_add())
  assert capsys.readouterr().err == ""
  monkeypatch.setenv("KILN_DUMP_AST", "prepare, linearize")
  CPU.render(_add())
  err = capsys.readouterr().err
  assert _dumps(err) == ["prepare", "linearize"]
  prepared, linear = err.split("kiln: after linearize")
  assert " SINK " in prepared and " STORE " in prepared  # the AST, one node a line, the SINK last
  assert " RANGE " in linear and " ENDRANGE " in linear and " SINK " not in linear  # the linear program


def test_dump_all_follows_the_path_taken(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
  """`all`: the CPU's generic path (1003 is no multiple of 8 lanes: peeled) shows every pass but tiling; a CUDA matrix product
  takes the tiled kernel (tiling, then print) unless options are given."""
  monkeypatch.setenv("KILN_DUMP_AST", "all")
  spec = CPU.render(_add())
  err = capsys.readouterr().err
  assert _dumps(err) == [p for p in PASSES if p != "tiling"]
  assert "UPCAST(axis=0, 8)" in err and spec.src in err
  mm = kernels.matmul(256, 256, 256, dtypes.float16, acc_dtype=dtypes.float32)
  H100.render(mm)
  err = capsys.readouterr().err
  assert _dumps(err) == ["verify", "tiling", "print"]
  assert "TILED_MATMUL(mma" in err
  H100.render(mm, [])
  assert "tiling" not in _dumps(capsys.readouterr().err)


def test_the_tiled_product_is_an_option() -> None:
  """The heuristic's choice for a covered product is a TILE option, and asking for it gives the same kernel; a TILE the
  kernel cannot take is a CodegenError naming why (the tiles themselves run in runtime-cuda's test_tiled_matmul.py)."""
  mm = kernels.matmul(256, 256, 256, dtypes.float16, acc_dtype=dtypes.float32)
  assert H100.render(mm, [Opt(OptOps.TILE, 0, 4)]).src == H100.render(mm).src  # 128x128x32 tensor cores: the heuristic's
  assert H100.render(mm, [Opt(OptOps.TILE, 0, 2)]).applied_opts == ["TILED_MATMUL(simt 128x64x8)"]
  f32 = kernels.matmul(64, 64, 64, dtypes.float32)
  bad = [([Opt(OptOps.TILE, 0, 4)], "does not fit this product: tensor cores need sm_80"), ([Opt(OptOps.TILE, 0, 6)], "TF32 allowed"),
         ([Opt(OptOps.TILE, 0, 7)], "numbered 1 to 6"), ([Opt(OptOps.TILE, 0, 1), Opt(OptOps.LOCAL, 0, 32)], "only option"),
         ([Opt(OptOps.TILE, 1, 1)], "only option, on axis 0")]
  for opts, why in bad:
    with pytest.raises(CodegenError, match=why): H100.render(f32, opts)
  with pytest.raises(CodegenError, match="is not a tiled matrix product"): H100.render(_add(), [Opt(OptOps.TILE, 0, 1)])
  with pytest.raises(CodegenError, match="is not a tiled matrix product"): CPU.render(f32, [Opt(OptOps.TILE, 0, 1)])
  with pytest.raises(CodegenError, match="which the generic lowering does not print"): lower(f32, CPU.target, [Opt(OptOps.TILE, 0, 1)])


def test_a_name_that_is_no_pass_is_one_setting_error(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("KILN_DUMP_AST", "prepare,lowr")
  with pytest.raises(SettingError, match=r"^KILN_DUMP_AST names no pass lowr: the pipeline's passes are verify, widen, "):
    CPU.render(_add())


def test_a_kernel_is_a_sink() -> None:
  store = _add().src[0]
  assert store.op is Ops.STORE
  for r in (CPU, H100):
    with pytest.raises(CodegenError, match="a kernel is a SINK of STOREs, got Ops.STORE"): r.render(store)
