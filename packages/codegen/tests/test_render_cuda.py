"""CUDA C renderer: the conformance set renders (every op of the kernel AST), the ABI and ProgramSpec metadata, and where nvcc
is installed the CUDA C compiles to PTX for sm_90 (in two batched nvcc runs, one per core)."""
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.codegen import Opt, OptOps, ProgramSpec
from kiln.codegen.conformance import cases
from kiln.codegen.render import CUDARenderer
from kiln.ir import UOp, dtypes, kernels
from kiln.ir.errors import CodegenError
from kiln.ir.ops import Ops

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.access("/usr/local/bin/nvcc", os.X_OK) else None)
CASES = cases()


@pytest.fixture(scope="module")
def rendered() -> dict[str, ProgramSpec]:
  r = CUDARenderer()
  return {c.name: r.render(c.ast, c.opts) for c in CASES}


def test_every_op_renders(rendered):
  seen = {u.op for c in CASES for u in c.ast.toposort()}
  assert seen >= {Ops.CAST, Ops.BITCAST, Ops.WHERE, Ops.MULACC, Ops.REDUCE, Ops.DEFINE_VAR, Ops.INDEX} | set(Ops.__members__[o] for o in (
    "NEG", "EXP2", "LOG2", "SIN", "SQRT", "RECIPROCAL", "TRUNC", "ADD", "SUB", "MUL", "FDIV", "IDIV", "MOD", "MAX", "CMPLT", "CMPEQ", "CMPNE",
    "AND", "OR", "XOR", "SHL", "SHR"))
  for name, spec in rendered.items():
    assert 'extern "C" __global__ void __launch_bounds__(' in spec.src, name
    assert "CUDA" in str(spec.device), name


def test_abi_and_spec():
  n = UOp.variable("n", 1, 1 << 24)  # a grid of 65536 blocks at the bound: n stays an argument (cuda_vars.py)
  spec = CUDARenderer().render(kernels.reduce_sum((n, 7), dtypes.float32, 1))
  assert re.search(r'extern "C" __global__ void __launch_bounds__\(256\) sum\(float\* __restrict__ data0, const float\* __restrict__ data1, int n\)',
                   spec.src), spec.src
  assert "blockIdx.x" in spec.src and "threadIdx.x" in spec.src and "cuda_fp16" not in spec.src and "cuda_bf16" not in spec.src
  assert spec.var_names == ["n"] and spec.globals == [0, 1] and spec.outs == [0] and spec.ins == [1]
  assert spec.local_size == (256, 1, 1) and isinstance(spec.global_size[0], UOp)
  from kiln.codegen import sym_eval
  assert sym_eval(spec.global_size[0], {"n": 257}) == 2 and sym_eval(spec.global_size[0], {"n": 256}) == 1
  assert spec.applied_opts == ["LOCAL(axis=0, 256)"]
  assert ProgramSpec.model_validate_json(spec.model_dump_json()).src == spec.src
  assert not spec.vars_in_memory


def test_variables_read_from_memory_abi():
  """n of at most 300: the grid at the bound is two blocks, so the kernel reads n from its variables' device array (after
  the buffers), and blocks past the grid n gives return at once (the runtime launches the bound's grid:
  kiln.codegen.render.cuda_vars)."""
  n = UOp.variable("n", 1, 300)
  spec = CUDARenderer().render(kernels.reduce_sum((n, 7), dtypes.float32, 1))
  assert spec.vars_in_memory and spec.var_names == ["n"]
  assert re.search(r'sum\(float\* __restrict__ data0, const float\* __restrict__ data1, const int\* __restrict__ kiln_vars\) \{\n'
                   r'  int n = kiln_vars\[0\];\n  if \(blockIdx.x >= \(unsigned\)\(\(\(\(n \+ -1\) / 256\) \+ 1\)\)\) return;', spec.src), spec.src
  assert ProgramSpec.model_validate_json(spec.model_dump_json()).vars_in_memory


def test_half_bf16_headers_only_when_used():
  h = CUDARenderer().render(kernels.elementwise(lambda a: a * a, dtypes.float16, ((8,), dtypes.float16))).src
  b = CUDARenderer().render(kernels.elementwise(lambda a: a * a, dtypes.bfloat16, ((8,), dtypes.bfloat16))).src
  assert "#include <cuda_fp16.h>" in h and "cuda_bf16" not in h and "half* __restrict__ data0" in h
  assert "#include <cuda_bf16.h>" in b and "cuda_fp16" not in b and "__nv_bfloat16* __restrict__ data0" in b


def test_group_reduction_uses_shared_memory():
  spec = CUDARenderer().render(kernels.reduce_sum((1000,), dtypes.float32))
  assert "__shared__ float" in spec.src and "__syncthreads();" in spec.src and spec.local_size == (256, 1, 1) and spec.global_size == (1, 1, 1)
  assert spec.applied_opts == ["GROUP(axis=0, 256)"]


def test_group_partials_combine_in_a_tree_not_a_serial_fold():
  # the block's 256 partials: warp butterflies and one slot per warp (8), not 256 slots that thread 0 folds in a loop
  src = CUDARenderer().render(kernels.reduce_sum((1000,), dtypes.float32)).src
  assert "__shared__ float red0[8];" in src and "kiln_block_sum_float32(" in src and "__shfl_xor_sync(mask, v, o)" in src
  assert not re.search(r"for \(int ridx\d+ = 0; ridx\d+ < 256;", src)
  # softmax's rows: the max and the sum each a tree whose result every thread uses, the columns over the block's threads
  sm = CUDARenderer().render(kernels.softmax((64, 1024), dtypes.float32))
  assert sm.global_size == (64, 1, 1) and sm.local_size == (256, 1, 1) and sm.src.count("kiln_block_") >= 4
  assert "lidx0 == 0" not in sm.src  # every thread stores its own columns


def test_full_reduction_over_blocks_declares_module_slots():
  spec = CUDARenderer().render(kernels.reduce_max((1 << 20,), dtypes.float16))
  assert spec.applied_opts == ["GROUP(axis=0, 256)", "BLOCKS(axis=0, 256)"] and spec.global_size == (256, 1, 1)
  assert re.search(r"__device__ float kiln_k_max_grid\d+\[256\] = \{0\};", spec.src)  # half reduces in float registers
  assert re.search(r"__device__ unsigned int kiln_k_max_grid\d+_done\[1\] = \{0\};", spec.src)
  assert "atomicAdd(done, 1u)" in spec.src and re.search(r"if \(v\d+\) \{\n\s+data0\[0\]", spec.src)  # thread 0 of the last block


def test_gated_grid_reads_nothing_past_the_end():
  # a block past the end of a LOCAL axis must not load: every global load is predicated on the grid gate
  src = CUDARenderer().render(kernels.elementwise(lambda a: a + 1.0, dtypes.float32, ((300,), dtypes.float32))).src
  assert re.search(r"= v\d+ \? data1\[", src), src


def test_stores_of_different_sizes_share_the_grid():
  a, b, x = UOp.define_global(0, dtypes.float32.ptr(10)), UOp.define_global(1, dtypes.float32.ptr(20)), UOp.define_global(2, dtypes.float32.ptr(20))
  i, j = UOp.range(10, 0), UOp.range(20, 1)
  spec = CUDARenderer().render(UOp.sink(a.index(i).store(x.index(i).load()), b.index(j).store(x.index(j).load())))
  assert spec.global_size == (20, 1, 1) and "< 10" in spec.src


def test_names_and_rejections():
  spec = CUDARenderer().render(kernels.reduce_max((4, 8), dtypes.float32, 1))  # "max" would clash with CUDA's max()
  assert spec.name == "k_max" and " k_max(" in spec.src
  with pytest.raises(CodegenError): CUDARenderer().render(kernels.reduce_sum((64,), dtypes.float32), [Opt(OptOps.UPCAST, 0, 4)])
  with pytest.raises(CodegenError): CUDARenderer().render(kernels.reduce_sum((64,), dtypes.float32), [Opt(OptOps.THREAD, 0, 4)])


def _batch(specs: list[ProgramSpec]) -> str:
  """Many kernels in one translation unit: each in its own namespace (helpers repeat), kernels renamed apart, headers once."""
  incs, parts = set(), []
  for i, s in enumerate(specs):
    lines = s.src.splitlines()
    incs |= {ln for ln in lines if ln.startswith("#include")}
    body = "\n".join(ln for ln in lines if not ln.startswith("#include")).replace(f" {s.name}(", f" {s.name}_{i}(")
    parts.append(f"namespace t{i} {{\n{body}\n}}")
  return "\n".join([*sorted(incs), *parts, ""])


@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed")
def test_nvcc_ptx_sm90(rendered):
  specs = list(rendered.values())
  halves = [specs[0::2], specs[1::2]]
  with tempfile.TemporaryDirectory() as d:
    def build(k: int) -> tuple[int, subprocess.CompletedProcess]:
      cu = os.path.join(d, f"batch{k}.cu")
      with open(cu, "w") as f: f.write(_batch(halves[k]))
      cmd = [NVCC, "-arch=sm_90", "--ptx", "-o", os.path.join(d, f"batch{k}.ptx"), cu]
      return k, subprocess.run(cmd, capture_output=True, text=True, check=False)
    with ThreadPoolExecutor(2) as ex: results = list(ex.map(build, range(2)))
    for k, r in results:
      assert r.returncode == 0, f"nvcc failed on batch {k}:\n{r.stderr[-4000:]}"
      with open(os.path.join(d, f"batch{k}.ptx")) as f: ptx = f.read()
      for i, s in enumerate(halves[k]): assert f".entry {s.name}_{i}(" in ptx, s.name


def test_unroll_of_a_gpu_output_axis_is_refused_not_dropped():
  """An output axis goes to the grid (one element per thread): UNROLL there was once reported as applied and silently
  dropped; now it is an error naming the option. On a reduce axis it still unrolls the thread's loop."""
  from kiln.codegen.choose import Opt, OptOps
  from kiln.ir import kernels
  from kiln.ir.dtype import dtypes
  from kiln.ir.errors import CodegenError
  r = CUDARenderer()
  ew = kernels.elementwise(lambda v: v * 2.0, dtypes.float32, ((4096,), dtypes.float32))
  with pytest.raises(CodegenError, match=r"UNROLL\(axis=0, 4\): on a GPU an output axis goes to the grid"):
    r.render(ew, [Opt(OptOps.LOCAL, 0, 128), Opt(OptOps.UNROLL, 0, 4)])
  rows = kernels.reduce_sum((64, 32), dtypes.float32, 1)
  plain = r.render(rows, [Opt(OptOps.LOCAL, 0, 64)])
  unrolled = r.render(rows, [Opt(OptOps.LOCAL, 0, 64), Opt(OptOps.UNROLL, 1, 4)])
  assert unrolled.src.count("data1[") == 4 * plain.src.count("data1[")  # four loads per trip of the reduce loop


def test_a_symbolic_row_axis_goes_on_the_grid_when_its_bound_fits():
  """(n, 4096) elementwise with n <= 4096: the rows are the grid's y (the bound fits its 65535 blocks), so a large n spreads
  over the GPU instead of looping inside 16 blocks; with a bound past 65535 they stay a loop."""
  n = UOp.variable("n", 1, 4096)
  spec = CUDARenderer().render(kernels.elementwise(lambda v: v * 3.0, dtypes.float32, ((n, 4096), dtypes.float32)))
  assert spec.global_size[0] == 16 and isinstance(spec.global_size[1], UOp) and spec.global_size[1].arg[0] == "n", spec.global_size
  big = UOp.variable("n", 1, 1 << 17)
  spec = CUDARenderer().render(kernels.elementwise(lambda v: v * 3.0, dtypes.float32, ((big, 4096), dtypes.float32)))
  assert spec.global_size == (16, 1, 1) and "for (" in spec.src, spec.global_size
