"""The tuner's candidate generator (kiln.codegen.choose.search): pure, deterministic, heuristic first, lists the lowering takes."""
import pytest

from kiln.codegen.choose import Opt, OptOps, Target, heuristic_opts
from kiln.codegen.choose.search import Knob, Space, candidates, space
from kiln.codegen.lowering.prepare import prepare
from kiln.codegen.pipeline import lower
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import CodegenError
from kiln.ir.uop import UOp

AVX512 = Target(vector_bytes=64, threads=2)
AVX2 = Target(vector_bytes=32, threads=1)
GPU = Target(device="CUDA", vector_bytes=0)


def test_heuristic_first_and_deterministic():
  for ast in (kernels.matmul(64, 48, 32), kernels.elementwise(lambda x: x * 2.0, dtypes.float32, ((16, 64), dtypes.float32)),
              kernels.reduce_sum((1 << 18,), dtypes.float32)):
    for t in (AVX512, AVX2, GPU):
      c = candidates(ast, t)
      assert c[0] == heuristic_opts(prepare(ast)[0], t)
      assert c == candidates(ast, t) and len({tuple(x) for x in c}) == len(c)


def test_matmul_space():
  sp = space(kernels.matmul(32, 64, 64), AVX512)
  knobs = {(k.op, k.axis): k.choices for k in sp.knobs}
  assert knobs[(OptOps.UNROLL, 0)] == (8, 1, 2, 4)  # tile rows, heuristic's first
  assert knobs[(OptOps.UNROLL, 2)][1:] == (1, 4) and knobs[(OptOps.PACK, 2)] == (1, 0)
  assert knobs[(OptOps.THREAD, 1)] == (0, 4, 2, 8)  # too small for the heuristic to split: try 4 chunks (two a thread), 2 and 8
  assert knobs[(OptOps.UPCAST, 1)] == (32, 16)  # two vectors or one
  order = sp.ordered()
  assert order[0] == sp.origin and [sum(i != 0 for i in c) for c in order] == sorted(sum(i != 0 for i in c) for c in order)
  # AVX2: 16 registers, the heuristic tiles 6 rows (the last tile overlaps); no thread knob on one thread
  sp2 = space(kernels.matmul(64, 64, 64), AVX2)
  assert {(k.op, k.axis): k.choices for k in sp2.knobs}[(OptOps.UNROLL, 0)] == (6, 1, 2, 4, 8)
  assert not any(k.op is OptOps.THREAD for k in sp2.knobs)


def test_candidates_lower_or_reject():
  ast = kernels.matmul(32, 32, 32)
  ok = 0
  for opts in candidates(ast, AVX512):
    try: lower(ast, AVX512, opts); ok += 1
    except CodegenError: pass
  assert ok >= len(candidates(ast, AVX512)) // 2


def test_other_kernels():
  ew = space(kernels.elementwise(lambda x: x + 1.0, dtypes.float32, ((32, 256), dtypes.float32)), AVX2)
  assert [(k.op, k.choices) for k in ew.knobs] == [(OptOps.UPCAST, (8, 4, 16, 32))]
  red = space(kernels.reduce_sum((1 << 20,), dtypes.float32), AVX512)
  assert red.knobs[0].op is OptOps.UPCAST and 16 in red.knobs[0].choices and 128 in red.knobs[0].choices
  gpu = space(kernels.elementwise(lambda x: x + 1.0, dtypes.float32, ((4096,), dtypes.float32)), GPU)
  assert gpu.knobs and gpu.knobs[0].op is OptOps.LOCAL
  a, b = UOp.define_global(0, dtypes.float32.ptr(8)), UOp.define_global(1, dtypes.float32.ptr(8))
  i, j = UOp.range(8, 0), UOp.range(8, 1)
  two = UOp.sink(a.index(i).store(UOp.const(dtypes.float32, 1.0)), b.index(j).store(UOp.const(dtypes.float32, 2.0)), name="two")
  assert candidates(two, AVX512) == [heuristic_opts(prepare(two)[0], AVX512)]  # several stores: the heuristic only


@pytest.mark.parametrize("idx,want", [((0, 0), ["UPCAST(axis=1, 8)", "THREAD(axis=0, 2)"]), ((1, 1), ["UPCAST(axis=1, 4)"]),
                                      ((0, 1), ["UPCAST(axis=1, 8)"])])
def test_space_opts_replace_in_place(idx, want):
  sp = Space((Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.THREAD, 0, 2)), (Knob(OptOps.UPCAST, 1, (8, 4)), Knob(OptOps.THREAD, 0, (2, 0))))
  assert [str(o) for o in sp.opts(idx)] == want


def test_a_tiled_product_searches_its_tiles():
  """A matrix product CUDA prints as the tiled kernel: the candidates are the tiles that fit it, the heuristic's first."""
  from kiln.codegen.choose.tiling import TILES
  from kiln.codegen.render.cuda import CUDARenderer
  from kiln.codegen.render.cuda_matmul import covers
  h100 = Target(device="CUDA", vector_bytes=0, gpu_arch=90, gpu_sms=132)
  for ast, tiles in ((kernels.matmul(256, 256, 256, dtypes.float16, acc_dtype=dtypes.float32), (4, 1, 2, 3, 5)),
                     (kernels.matmul(64, 64, 64), (3, 1, 2))):
    c = candidates(ast, h100, covers(ast, h100))
    assert c == [[Opt(OptOps.TILE, 0, n)] for n in tiles]
    assert [CUDARenderer(h100).render(ast, o).applied_opts for o in c] == [[str(TILES[n - 1])] for n in tiles]
