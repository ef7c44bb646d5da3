"""A plan's stretch of CPU kernels as one native call (sequence.py): every kernel has a task entry; a sequence of
unsplit, split, finishing (split reduction) and scratch-taking kernels gives the bits the calls give one by one, on
pools of 1 to 4 threads; it follows set_vals and share_scratch made after it was built; where it cannot be (one call,
KILN_POOL=python, object code without a task entry) there is none."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kiln.runtime.cpu.bound as bound_mod
import kiln.runtime.cpu.sequence as sequence_mod
from kiln.codegen.choose import Target
from kiln.codegen.registry import get_runtime
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import UOp, dtypes, kernels, reference
from kiln.runtime.cpu.bound import CPUBoundCall
from kiln.runtime.cpu.native_pool import NativePool, native_pool_supported
from kiln.runtime.cpu.program import CPUProgram
from kiln.runtime.cpu.sequence import CPUSequence, sequence_calls

pytestmark = pytest.mark.skipif(not native_pool_supported(), reason="sequences run on the native pool: Linux on x86-64 or AArch64")

RT = get_runtime("CPU")
F32 = dtypes.float32
BIG, M, K, C = (1 << 22) + 4096, 128, 256, 256


def load(ast: UOp, target: Target | None = None) -> CPUProgram:
  return RT.load(RT.compiler.compile((LLVMRenderer(target) if target is not None else RT.renderer).render(ast)))


@pytest.fixture(scope="module")
def pools():
  made = {n: NativePool(n, spin=50) for n in (1, 2, 4)}
  yield made
  for p in made.values(): p.close()


@pytest.fixture(scope="module")
def progs() -> dict[str, tuple[UOp, CPUProgram]]:
  n = UOp.variable("n", 1, 4096)
  asts = {
    "axpy": kernels.elementwise(lambda a, b: a * 3.0 + b, F32, ((n,), F32), ((n,), F32), name="axpy"),  # unsplit, a variable
    "scale": kernels.elementwise(lambda a: a * 0.5 + 1.0, F32, ((BIG,), F32), name="scale"),  # split
    "total": kernels.reduce_sum((BIG,), F32),  # split, with a finishing call
    "product": kernels.matmul(M, C, K),  # split, packs panels into its scratch
  }
  target = Target(vector_bytes=RT.target.vector_bytes, threads=2, cores=2, min_work_per_thread=1 << 10)
  made = {k: (a, load(a, target if k == "product" else None)) for k, a in asts.items()}
  assert made["axpy"][1].threads == 1 and made["scale"][1].threads > 1
  assert made["total"][1].finish_call and made["product"][1].scratch_bytes, {k: p.spec.applied_opts for k, (_, p) in made.items()}
  return made


class Chain:
  """axpy(n) -> scale -> total, and a product beside them: each kernel reads the one before, so order shows."""

  def __init__(self, progs: dict[str, tuple[UOp, CPUProgram]], n: int):
    rng = np.random.default_rng(n)
    self.a, self.b = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    self.y, self.big, self.out = np.zeros(4096, np.float32), rng.standard_normal(BIG).astype(np.float32), np.zeros(1, np.float32)
    self.x, self.w, self.mm = (rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, C)).astype(np.float32),
                               np.zeros((M, C), np.float32))
    p = {k: v[1] for k, v in progs.items()}
    # scale works in place on big, whose first 4096 floats axpy wrote: the sum depends on every kernel having run in turn
    self.calls = [p["axpy"].bind([self.big.ctypes.data, self.a.ctypes.data, self.b.ctypes.data], [n]),
                  p["scale"].bind([self.big.ctypes.data, self.big.ctypes.data]),
                  p["total"].bind([self.out.ctypes.data, self.big.ctypes.data]),
                  p["product"].bind([self.mm.ctypes.data, self.x.ctypes.data, self.w.ctypes.data])]

  def result(self) -> bytes: return self.big.tobytes() + self.out.tobytes() + self.mm.tobytes()


def _on_pool(monkeypatch: pytest.MonkeyPatch, pool: NativePool) -> None:
  monkeypatch.setattr(bound_mod, "get_pool", lambda: pool)
  monkeypatch.setattr(sequence_mod, "get_pool", lambda: pool)


def test_every_kernel_has_a_task_entry_that_runs_it(progs) -> None:
  """An unsplit kernel's task takes its arguments from the block and ignores the slot."""
  ast, prog = progs["axpy"]
  rng = np.random.default_rng(1)
  a, b, out = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32), np.zeros(4096, np.float32)
  call = prog.bind([out.ctypes.data, a.ctypes.data, b.ctypes.data], [1000])
  assert prog.task and call.block is not None and call.block.tolist() == [*call.bufs, 1000]
  ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(prog.task)(call.block_at, 7)
  assert out.tobytes() == reference.run(ast, np.zeros(4096, np.float32), a, b, var_vals={"n": 1000})[0].tobytes()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_sequence_gives_the_bits_of_its_calls_one_by_one(progs, pools, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
  _on_pool(monkeypatch, pools[size])
  one_by_one, together = Chain(progs, 1000), Chain(progs, 1000)
  for c in one_by_one.calls: c()
  seq = sequence_calls(together.calls)
  assert isinstance(seq, CPUSequence) and seq.pooled == (size > 1)
  for _ in range(2):  # twice: the chunk counters are reset by the sequence, not left claimed by its first run
    together.big[:] = Chain(progs, 1000).big
    seq()
  assert together.result() == one_by_one.result()
  np.testing.assert_allclose(together.mm, together.x.astype(np.float64) @ together.w, rtol=1e-4, atol=1e-4)


def test_a_sequence_follows_set_vals_and_shared_scratch(progs, pools, monkeypatch: pytest.MonkeyPatch) -> None:
  _on_pool(monkeypatch, pools[2])
  chain = Chain(progs, 1000)
  seq = sequence_calls(chain.calls)
  assert seq is not None
  fresh = Chain(progs, 1000).big  # the inputs before any run
  chain.calls[0].set_vals([17])
  at = chain.calls[3].block_at
  CPUBoundCall.share_scratch(chain.calls)  # the product's scratch moves to a shared arena, written into its block in place
  assert chain.calls[3].scratch is chain.calls[2].scratch and chain.calls[3].block_at == at
  seq()
  want = Chain(progs, 17)
  want.big[:] = fresh
  want.a[:], want.b[:] = chain.a, chain.b
  for c in want.calls: c()
  assert chain.big.tobytes() == want.big.tobytes() and chain.out.tobytes() == want.out.tobytes()
  np.testing.assert_allclose(chain.mm, chain.x.astype(np.float64) @ chain.w, rtol=1e-4, atol=1e-4)


def test_no_sequence_where_there_cannot_be_one(progs, monkeypatch: pytest.MonkeyPatch) -> None:
  chain = Chain(progs, 10)
  assert sequence_calls(chain.calls[:1]) is None  # one call: calling it is as fast
  monkeypatch.setenv("KILN_POOL", "python")
  assert sequence_calls(chain.calls) is None
  monkeypatch.delenv("KILN_POOL")
  monkeypatch.setattr(chain.calls[1].prog, "task_fn", None)  # object code from before every kernel had a task entry
  assert sequence_calls(Chain(progs, 10).calls) is None


def test_a_writer_sets_a_variable_in_blocks_of_many_pages(progs, monkeypatch: pytest.MonkeyPatch) -> None:
  """vals_writer: one value into every call's block at once, however the blocks fall on pages (a page of 8 words here:
  each axpy block is 4, so three calls span two pages); the calls then run with it, and read it back as their vals."""
  import kiln.runtime.cpu.blocks as blocks_mod
  monkeypatch.setattr(blocks_mod, "PAGE_WORDS", 8)
  monkeypatch.setattr(blocks_mod, "_page", None)
  ast, prog = progs["axpy"]
  rng = np.random.default_rng(4)
  arrays = [[np.zeros(4096, np.float32), rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)]
            for _ in range(3)]
  calls = [prog.bind([a.ctypes.data for a in arr], [4096]) for arr in arrays]
  assert len({c.block.base.ctypes.data for c in calls}) == 2  # type: ignore[union-attr]
  write = CPUBoundCall.vals_writer([(c, 0) for c in calls])
  assert write is not None
  write(77)
  for c, arr in zip(calls, arrays):
    assert c.vals == [77]
    c()
    assert arr[0].tobytes() == reference.run(ast, np.zeros(4096, np.float32), *arr[1:], var_vals={"n": 77})[0].tobytes()


def test_a_timed_run_gives_each_steps_cycles(progs, pools, monkeypatch: pytest.MonkeyPatch) -> None:
  """timed(): the cycle counter between steps, one count per kernel, and still the results of a plain run."""
  _on_pool(monkeypatch, pools[2])
  plain, timed = Chain(progs, 1000), Chain(progs, 1000)
  sequence_calls(plain.calls)()  # type: ignore[misc]
  seq = sequence_calls(timed.calls)
  assert seq is not None
  cycles = seq.timed()
  assert cycles.shape == (4,) and (cycles > 0).all()
  assert cycles[2] > cycles[0]  # a sum over 4M floats takes longer than 1000 multiply-adds
  assert timed.result() == plain.result()
