"""KEEP: a row REDUCE leaves its per-element values in per-thread scratch and the store reads them back (softmax computes
each exp once, not twice). The values are the same computation, so results are bit-identical with and without it."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.pipeline import lower
from kiln.codegen.registry import get_runtime
from kiln.ir import CodegenError, UOp, dtypes, kernels
from kiln.ir.ops import Ops
from kiln.runtime.cpu.program import CPUProgram

RT = get_runtime("CPU")
F32 = dtypes.float32
GUARD = 16  # floats past the output that must stay untouched


def load(ast: UOp, opts: list[Opt] | None = None) -> CPUProgram: return RT.load(RT.compiler.compile(RT.renderer.render(ast, opts=opts)))


def run(ast: UOp, x: np.ndarray, opts: list[Opt] | None) -> tuple[np.ndarray, list[str]]:
  out = np.full(x.size + GUARD, -7.0, np.float32)
  prog = load(ast, opts)
  prog([out.ctypes.data, x.ctypes.data], global_size=prog.spec.global_size or (1, 1, 1))
  assert (out[x.size:] == -7.0).all(), "KEEP wrote past the output"
  return out[:x.size].reshape(x.shape), list(prog.spec.applied_opts)


def np_softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def heuristic(ast: UOp, threads: int = 1) -> list[Opt]:
  return lower(ast, Target(vector_bytes=32, threads=threads, min_work_per_thread=64)).opts


# (8, 16) and (3, 8): the row is one vector, so the store reads the kept row at an index no loop varies (it was once read
# before the REDUCE wrote it)
@pytest.mark.parametrize("shape", [(8, 128), (5, 127), (3, 1024), (4, 1), (2, 7), (64, 33), (1, 200), (8, 16), (3, 8), (1, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_keep_is_bit_identical(shape: tuple[int, int], threads: int) -> None:
  rng = np.random.default_rng(shape[1])
  x = (rng.standard_normal(shape) * 4).astype(np.float32)
  ast = kernels.softmax(shape, F32)
  opts = heuristic(ast, threads)
  keep = [o for o in opts if o.op is OptOps.KEEP]
  if shape[1] > 1: assert keep, opts  # the heuristic keeps the row of exps wherever the row is a loop
  kept, applied = run(ast, x, opts)
  assert not keep or any(a.startswith("KEEP") for a in applied), applied
  plain, _ = run(ast, x, [o for o in opts if o.op is not OptOps.KEEP])
  assert np.array_equal(kept, plain)
  np.testing.assert_allclose(kept, np_softmax(x), rtol=2e-6, atol=1e-9)


def test_keep_computes_exp_once() -> None:
  ast = kernels.softmax((16, 128), F32)
  opts = heuristic(ast)
  t = Target(vector_bytes=32)
  def exps(o: list[Opt]) -> int: return sum(u.op is Ops.EXP2 for u in lower(ast, t, o).uops)
  copies = int(np.prod([o.amount for o in opts if o.op is OptOps.UNROLL]))  # rows interleaved: one exp per row copy
  assert copies == 2 and exps(opts) == copies and exps([o for o in opts if o.op is not OptOps.KEEP]) == 2 * copies


def test_keep_with_scalar_loops_and_an_unroll_of_its_axis() -> None:
  """No vectors at all, and the reduce axis unrolled: each copy stores its own element."""
  shape = (6, 40)
  x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
  ast = kernels.softmax(shape, F32)
  axes = sorted({r.arg[0] for r in ast.toposort() if r.op is Ops.RANGE})
  red = [u for u in ast.toposort() if u.op is Ops.REDUCE and u.arg is Ops.ADD][0].src[1].arg[0]
  got, _ = run(ast, x, [Opt(OptOps.UNROLL, red, 4), Opt(OptOps.KEEP, red, 1)])
  want, _ = run(ast, x, [Opt(OptOps.UNROLL, red, 4)])
  assert np.array_equal(got, want) and len(axes) == 4
  np.testing.assert_allclose(got, np_softmax(x), rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("shape,unrolls", [((8, 128), {0: 2}), ((6, 40), {0: 3}), ((4, 6, 24), {0: 2, 1: 3}), ((2, 4, 16), {1: 4})])
@pytest.mark.parametrize("threads", [1, 2])
def test_keep_under_an_unrolled_output_axis(shape: tuple[int, ...], unrolls: dict[int, int], threads: int) -> None:
  """Rows interleaved (an UNROLL of output axes the kept REDUCE varies along): each unrolled copy keeps its own row of the
  per-thread scratch, so the results are bit-identical with the rows computed twice, nothing is written past the output,
  and the scratch holds one row per copy."""
  x = (np.random.default_rng(len(shape)).standard_normal(shape) * 4).astype(np.float32)
  ast = kernels.softmax(shape, F32)
  red = [u for u in ast.toposort() if u.op is Ops.REDUCE and u.arg is Ops.ADD][0].src[1].arg[0]
  base = [Opt(OptOps.UNROLL, a, n) for a, n in unrolls.items()] + ([Opt(OptOps.THREAD, 0, 2)] if threads > 1 else [])
  kept, applied = run(ast, x, base + [Opt(OptOps.KEEP, red, 1)])
  assert any(a.startswith("KEEP") for a in applied), applied
  plain, _ = run(ast, x, base)
  assert np.array_equal(kept, plain)
  np.testing.assert_allclose(kept, np_softmax(x.reshape(-1, shape[-1])).reshape(shape), rtol=2e-6, atol=1e-9)
  copies = int(np.prod(list(unrolls.values())))
  spec = RT.renderer.render(ast, opts=base + [Opt(OptOps.KEEP, red, 1)])
  assert spec.scratch_bytes >= copies * shape[-1] * 4 * (1 if threads == 1 else min(threads, RT.target.threads)), spec.scratch_bytes


def test_short_kept_rows_are_interleaved_in_pairs() -> None:
  """The heuristic unrolls the row axis by 2 where a kept row is at most KEEP_ROW_VECTORS vectors and the rows are even in
  number (opt._interleaved_rows): softmax rows of 128 on 8 lanes (16 vectors), not rows of 256, an odd row count, or a
  layernorm-like body that keeps nothing."""
  def unrolls(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(o.axis, o.amount) for o in heuristic(kernels.softmax(shape, F32)) if o.op is OptOps.UNROLL]
  assert unrolls((64, 128)) == [(0, 2)] and unrolls((4, 6, 64)) == [(1, 2)]
  assert unrolls((64, 256)) == [] and unrolls((63, 128)) == [] and unrolls((3, 5, 64)) == []


def test_keep_refused_where_it_cannot_apply() -> None:
  t = Target(vector_bytes=32)
  sm = kernels.softmax((8, 64), F32)
  red = [u for u in sm.toposort() if u.op is Ops.REDUCE and u.arg is Ops.ADD][0].src[1].arg[0]
  with pytest.raises(CodegenError, match="KEEP needs a reduce axis"): lower(sm, t, [Opt(OptOps.KEEP, 0, 1)])
  rs = kernels.reduce_sum((8, 64), F32, 1, keepdims=True)
  rax = [u for u in rs.toposort() if u.op is Ops.REDUCE][0].src[1].arg[0]
  with pytest.raises(CodegenError, match="no store computes again"): lower(rs, t, [Opt(OptOps.KEEP, rax, 1)])
  with pytest.raises(CodegenError, match="CPU option"): lower(sm, Target(device="CUDA", vector_bytes=0), [Opt(OptOps.KEEP, red, 1)])


def test_plain_reductions_keep_nothing() -> None:
  """A body without an inline polynomial is cheaper to compute again than to store and reload (a row's max, x[j] - mean):
  no KEEP for it, while the softmax's exp is kept."""
  sm = kernels.softmax((8, 64), F32)
  keeps = [o.axis for o in heuristic(sm) if o.op is OptOps.KEEP]
  assert keeps == [u.src[1].arg[0] for u in sm.toposort() if u.op is Ops.REDUCE and u.arg is Ops.ADD]
  def centred(x: UOp, m: UOp) -> UOp: return x - m
  ast = kernels.elementwise(centred, F32, ((8, 64), F32), ((8, 1), F32))
  assert not any(o.op is OptOps.KEEP for o in heuristic(ast))
