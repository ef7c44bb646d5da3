"""Threads: a kernel split over N chunks (THREAD opt, core_id 0..N-1) run on pools of 1, 2 and 3 workers gives exactly what
the same kernel without THREAD gives (and the reference), for elementwise, reductions over kept axes, matmul and
symbolic-size kernels. A full reduction split over threads sums in chunks: exact for integers, deterministic for floats."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kiln.runtime.cpu.bound as bound_mod
from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.pipeline import lower
from kiln.codegen.registry import get_runtime
from kiln.codegen.threads import available_cores, physical_cores
from kiln.ir import AxisType, Ops, RuntimeLaunchError, UOp, dtypes, kernels, reference
from kiln.ir.dtype import DType
from kiln.runtime.cpu.program import CPUProgram
from kiln.runtime.cpu.threads import WorkerPool, new_pool, thread_count

RT = get_runtime("CPU")
POOLS = {n: new_pool(n) for n in (1, 2, 3)}  # the kind kernels run on here (native where it can be)
PY_POOLS = {n: WorkerPool(n) for n in (1, 2, 3)}  # the Python pool's own contract: any callables, errors handed back
_progs: dict = {}


def compile_(ast: UOp, opts: list[Opt] | None) -> CPUProgram:
  key = (ast.key, None if opts is None else tuple(opts))
  if key not in _progs: _progs[key] = RT.load(RT.compiler.compile(RT.renderer.render(ast, opts=opts)))
  return _progs[key]


def run(ast: UOp, bufs: list[np.ndarray], opts: list[Opt] | None, vals: tuple[int, ...] = (), pool: int | None = None) -> list[np.ndarray]:
  out = [b.copy() for b in bufs]
  prog = compile_(ast, opts)
  if pool is None: prog([b.ctypes.data for b in out], list(vals))
  else:
    mp = pytest.MonkeyPatch()
    mp.setattr(bound_mod, "get_pool", lambda: POOLS[pool])
    try: prog([b.ctypes.data for b in out], list(vals))
    finally: mp.undo()
  return out


def heuristic(ast: UOp) -> list[Opt]:
  """The optimiser's choice for this kernel, without any thread split."""
  return [o for o in lower(ast, RT.target, None).opts if o.op is not OptOps.THREAD]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool: return a.tobytes() == b.tobytes()


def assert_threaded_equal(ast: UOp, bufs: list[np.ndarray], base: list[Opt], axis: int, outs: tuple[int, ...] = (0,), vals: tuple[int, ...] = (),
                          splits: tuple[int, ...] = (2, 3, 7), ref: bool = True) -> None:
  """Every split x pool size gives the single-thread result bit for bit (and that equals the reference: bit for bit, or
  within FMA rounding when the options fuse multiply-adds)."""
  single = run(ast, bufs, base, vals)
  if ref:
    want = reference.run(ast, *bufs, var_vals=dict(zip([v.arg[0] for v in ast.variables()], vals)))
    fused = any(o.op is OptOps.FMA for o in base)
    for o in outs:
      if fused: np.testing.assert_allclose(single[o], want[o], rtol=1e-5, atol=1e-5, err_msg=f"fused result too far from the reference (opts={base})")
      else: assert same_bits(single[o], want[o]), f"single-thread result differs from the reference (opts={base})"
  for t in splits:
    opts = [*base, Opt(OptOps.THREAD, axis, t)]
    assert compile_(ast, opts).threads == t
    for pool in (1, 2, 3):
      got = run(ast, bufs, opts, vals, pool)
      for o in outs:
        if not same_bits(got[o], single[o]):
          bad = np.nonzero(got[o].view(np.uint8) != single[o].view(np.uint8))[0]
          pytest.fail(f"THREAD({axis}, {t}) on a pool of {pool}: slot {o} differs from one thread at byte {bad[0]} ({len(bad)} bytes), opts={opts}")


def rnd(dt: DType, n: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dt.is_float: return rng.standard_normal(n).astype(dt.np)
  return rng.integers(-100, 100, n).astype(dt.np)


# ---- the Python pool itself ----
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("calls", [1, 2, 3, 17])
def test_pool_runs_every_call_once(size: int, calls: int) -> None:
  seen: list[int] = []
  lock = threading.Lock()
  def fn(i: int) -> None:
    with lock: seen.append(i)
  PY_POOLS[size].run(fn, [(i,) for i in range(calls)])
  assert sorted(seen) == list(range(calls))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_error_in_a_pool_call_reaches_the_caller(size: int) -> None:
  def fn(i: int) -> None:
    if i == 5: raise ValueError(f"call {i} failed")
  with pytest.raises(ValueError, match="call 5 failed"): PY_POOLS[size].run(fn, [(i,) for i in range(9)])
  done: list[int] = []
  PY_POOLS[size].run(lambda i: done.append(i), [(i,) for i in range(9)])  # the pool still works afterwards
  assert sorted(done) == list(range(9))


def test_thread_count_reads_kiln_threads(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("KILN_THREADS", "3")
  assert thread_count() == 3
  for bad in ("0", "-2", "many"):
    monkeypatch.setenv("KILN_THREADS", bad)
    with pytest.raises(ValueError, match="KILN_THREADS"): thread_count()


def _topology(root: Path, siblings: dict[int, str], name: str = "core_cpus_list") -> str:
  for cpu, lst in siblings.items():
    (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
    (root / f"cpu{cpu}" / "topology" / name).write_text(lst + "\n")
  return str(root)


def test_the_default_thread_count_counts_a_cores_hyperthreads_once(tmp_path: Path) -> None:
  # 4 cores with 2 hardware threads each, numbered as Linux does on x86 (cpu n and n + 4 share a core)
  smt = _topology(tmp_path / "smt", {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
  assert physical_cores(frozenset(range(8)), smt) == 4
  assert physical_cores(frozenset({0, 4}), smt) == 1  # a mask holding both threads of one core: one thread
  assert physical_cores(frozenset({0, 1, 5}), smt) == 2
  # the older kernels' file name, and ranges
  old = _topology(tmp_path / "old", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, "thread_siblings_list")
  assert physical_cores(frozenset(range(4)), old) == 2
  # no topology for a CPU (no sysfs, a container): every CPU counts
  assert physical_cores(frozenset(range(3)), str(tmp_path / "none")) == 3
  assert physical_cores(frozenset(range(3)), _topology(tmp_path / "part", {0: "0", 1: "1"})) == 3
  assert 1 <= available_cores() <= (os.cpu_count() or 1)


def test_kiln_threads_sets_the_split_and_the_pool() -> None:
  # a fresh process: the pool and the target's thread count are fixed at first use
  code = """
import numpy as np
from kiln.codegen.registry import get_runtime
from kiln.ir import dtypes, kernels, reference
from kiln.runtime.cpu.threads import get_pool
rt = get_runtime("CPU")
ast = kernels.elementwise(lambda a: a * 3 + 1, dtypes.float32, ((1 << 22,), dtypes.float32))
spec = rt.renderer.render(ast)
x = np.arange(1 << 22, dtype=np.float32); out = np.zeros_like(x)
rt.load(rt.compiler.compile(spec))([out.ctypes.data, x.ctypes.data])
assert spec.threads >= 3 and spec.slots == 0 and get_pool().size == 3, (spec.applied_opts, get_pool().size)  # chunks for 3 threads
assert (out == reference.run(ast, np.zeros_like(x), x)[0]).all()
print("ok")
"""
  r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILN_THREADS": "3"}, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ---- kernels ----
@pytest.mark.parametrize("n", [1000, 997, 1 << 16, 3])
@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.int8, dtypes.bfloat16], ids=str)
def test_elementwise(n: int, dt: DType) -> None:
  ast = kernels.elementwise(lambda a, b: a * b + a, dt, ((n,), dt), ((n,), dt), name=f"ew_{dt}_{n}")
  bufs = [np.zeros(n, dt.np), rnd(dt, n, 1), rnd(dt, n, 2)] if dt != dtypes.bfloat16 else [np.zeros(n, np.uint16)] + [
    (np.random.default_rng(s).integers(0x3F00, 0x4100, n)).astype(np.uint16) for s in (1, 2)]
  for base in ([], heuristic(ast)): assert_threaded_equal(ast, bufs, base, axis=0)


def test_elementwise_2d_thread_outer_upcast_inner() -> None:
  ast = kernels.elementwise(lambda a: a.maximum(0.0) * 2.0, dtypes.float32, ((37, 1000), dtypes.float32))
  assert_threaded_equal(ast, [np.zeros(37000, np.float32), rnd(dtypes.float32, 37000)], [Opt(OptOps.UPCAST, 1, 8)], axis=0)


@pytest.mark.parametrize("shape", [(1000, 37), (97, 1009), (5, 64)])
@pytest.mark.parametrize("op", [Ops.ADD, Ops.MAX], ids=lambda o: o.name)
def test_row_reductions(shape: tuple[int, int], op: Ops) -> None:
  m, k = shape
  ast = kernels.reduce(op, shape, dtypes.float32, axes=1)
  bufs = [np.zeros(m, np.float32), rnd(dtypes.float32, m * k, 3)]
  for base in ([], heuristic(ast)): assert_threaded_equal(ast, bufs, base, axis=0)


def test_column_reduction_threads_the_kept_axis() -> None:
  ast = kernels.reduce_sum((257, 1000), dtypes.float32, axes=0)
  # kernels.reduce numbers kept axes first: axis 0 is the kept (column) axis
  assert_threaded_equal(ast, [np.zeros(1000, np.float32), rnd(dtypes.float32, 257000, 4)], heuristic(ast), axis=0)


@pytest.mark.parametrize("mnk", [(1000, 16, 8), (97, 101, 103), (13, 1009, 7), (64, 64, 64), (1, 1000, 5)])
def test_matmul(mnk: tuple[int, int, int]) -> None:
  m, n, k = mnk
  ast = kernels.matmul(m, n, k, dtypes.float32)
  bufs = [np.zeros(m * n, np.float32), rnd(dtypes.float32, m * k, 5), rnd(dtypes.float32, k * n, 6)]
  for base in ([], heuristic(ast)): assert_threaded_equal(ast, bufs, base, axis=0, splits=(2, 3, 7) if m > 1 else (2,))


def test_matmul_1000_squared_heuristic_threads_match_one_thread() -> None:
  ast = kernels.matmul(1000, 1000, 40, dtypes.float32)
  bufs = [np.zeros(1000 * 1000, np.float32), rnd(dtypes.float32, 40000, 7), rnd(dtypes.float32, 40000, 8)]
  assert_threaded_equal(ast, bufs, heuristic(ast), axis=0, splits=(2, 3), ref=False)


def test_int_full_reduction_split_over_threads_is_exact() -> None:
  n = 100003
  o, a = UOp.define_global(0, dtypes.int32.ptr(1)), UOp.define_global(1, dtypes.int32.ptr(n))
  k = UOp.range(n, 0, AxisType.REDUCE)
  ast = UOp.sink(o.index(0).store((a.index(k).load() * 3).reduce(Ops.ADD, k)), name="isum")
  x = np.random.default_rng(9).integers(-2 ** 20, 2 ** 20, n).astype(np.int32)
  assert_threaded_equal(ast, [np.zeros(1, np.int32), x], [], axis=0)


def test_float_full_reduction_split_is_deterministic() -> None:
  # chunked partial sums add in another order than one loop: close to the reference, and the same bits on every pool size
  n = 1 << 17
  ast = kernels.reduce_sum((n,), dtypes.float32)
  bufs = [np.zeros(1, np.float32), rnd(dtypes.float32, n, 10)]
  want = reference.run(ast, *bufs)[0]
  for t in (2, 3):
    got = [run(ast, bufs, [Opt(OptOps.THREAD, 0, t)], pool=p)[0] for p in (1, 2, 3)]
    assert all(same_bits(g, got[0]) for g in got), f"THREAD {t}: result depends on the pool size: {got}"
    np.testing.assert_allclose(got[0], want, rtol=1e-4)


def _symbolic_kernels() -> tuple[UOp, UOp, UOp]:
  n = UOp.variable("n", 1, 5000)
  ew = kernels.elementwise(lambda a: a * 2.0 + 1.0, dtypes.float32, ((n,), dtypes.float32), name="sym_ew")
  rows = kernels.reduce_sum((n, 33), dtypes.float32, axes=1, name="sym_rows")
  return n, ew, rows


@pytest.mark.parametrize("which", ["ew", "rows"])
def test_symbolic_size_one_compile_many_n(which: str) -> None:
  _, ew, rows = _symbolic_kernels()
  ast = ew if which == "ew" else rows
  width = 1 if which == "ew" else 33
  x = rnd(dtypes.float32, 5000 * width, 11)
  sentinel = np.full(5000, -7.0, np.float32)
  for t in (2, 3):
    prog = compile_(ast, [Opt(OptOps.THREAD, 0, t)])
    for nv in (1, 2, 3, 7, 1000, 4999, 5000):
      single = run(ast, [sentinel, x], [], (nv,))[0]
      want = reference.run(ast, sentinel, x, var_vals={"n": nv})[0]
      assert same_bits(single, want), f"n={nv}: one thread differs from the reference"
      for pool in (1, 2, 3):
        got = run(ast, [sentinel, x], [Opt(OptOps.THREAD, 0, t)], (nv,), pool)[0]
        assert same_bits(got, single), f"{which} n={nv} THREAD {t} pool {pool}"
        assert (got[nv:] == -7.0).all(), f"n={nv}: wrote past the end"
    assert compile_(ast, [Opt(OptOps.THREAD, 0, t)]) is prog  # one program served every n


def test_bound_threaded_call_with_set_vals() -> None:
  _, ew, _ = _symbolic_kernels()
  prog = compile_(ew, [Opt(OptOps.THREAD, 0, 3)])
  x, out = rnd(dtypes.float32, 5000, 12), np.zeros(5000, np.float32)
  call = prog.bind([out.ctypes.data, x.ctypes.data], [10])
  for nv in (10, 4000, 17):
    out[:] = 0
    call.set_vals([nv])
    call()
    assert same_bits(out[:nv], x[:nv] * np.float32(2) + np.float32(1)) and not out[nv:].any()


def test_threaded_kernel_without_core_id_is_an_error() -> None:
  ast = kernels.elementwise(lambda a: a + 1.0, dtypes.float32, ((1000,), dtypes.float32))
  compiled = RT.compiler.compile(RT.renderer.render(ast, opts=[Opt(OptOps.THREAD, 0, 2)]))
  assert compiled.threads == 2 and compiled.var_names[-1] == "core_id"
  broken = compiled.model_copy(update={"var_names": []})
  with pytest.raises(RuntimeLaunchError, match="core_id"): RT.load(broken)


@pytest.mark.parametrize("mnk", [(1000, 1000, 40), (256, 101, 200)])
def test_peeled_tail_with_the_heuristic_thread_split(mnk: tuple[int, int, int]) -> None:
  # the column axis is split over threads and vectorised 32 wide; the columns past the last full vector are a scalar
  # tail that only the call with core_id 0 runs: every pool size gives the same bits, close to the reference
  m, n, k = mnk
  ast = kernels.matmul(m, n, k, dtypes.float32)
  opts = lower(ast, RT.target, None).opts
  assert any(o.op is OptOps.UPCAST and n % o.amount for o in opts) and any(o.op is OptOps.THREAD for o in opts)
  bufs = [np.zeros(m * n, np.float32), rnd(dtypes.float32, m * k, 11), rnd(dtypes.float32, k * n, 12)]
  want = reference.run(ast, *bufs)[0]
  got = [run(ast, bufs, opts, pool=p)[0] for p in (1, 2, 3)]
  assert all(same_bits(g, got[0]) for g in got)
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
