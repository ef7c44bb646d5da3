"""CPUProgram: argument checks with typed errors naming the culprit, the bind()/set_vals() fast path, concurrent calls."""
from __future__ import annotations

import platform
import threading

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.registry import get_runtime
from kiln.ir import RuntimeLaunchError, UOp, VariableBoundsError, dtypes, kernels, reference
from kiln.runtime.cpu.program import CPUProgram

RT = get_runtime("CPU")


def load(ast: UOp, opts: list[Opt] | None = None) -> CPUProgram: return RT.load(RT.compiler.compile(RT.renderer.render(ast, opts=opts)))


@pytest.fixture(scope="module")
def axpy() -> tuple[UOp, CPUProgram]:
  """out[i] = a[i] * 3 + b[i] for i < n, n in [1, 4096]: three buffers and one variable."""
  n = UOp.variable("n", 1, 4096)
  ast = kernels.elementwise(lambda a, b: a * 3.0 + b, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32), name="axpy")
  return ast, load(ast)


def bufs(seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [np.zeros(4096, np.float32), rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)]


def want(ast: UOp, bs: list[np.ndarray], n: int) -> np.ndarray: return reference.run(ast, *bs, var_vals={"n": n})[0]


def ptrs(bs: list[np.ndarray]) -> list[int]: return [b.ctypes.data for b in bs]


def test_call_matches_reference(axpy) -> None:
  ast, prog = axpy
  assert prog.spec.var_names == ["n"] and prog.spec.buf_count == 3
  for n in (1, 5, 4096):
    bs = bufs(n)
    assert prog(ptrs(bs), [n]) is None
    assert bs[0].tobytes() == want(ast, bs, n).tobytes()
  assert isinstance(prog(ptrs(bs), [7], wait=True), float)  # wait=True times the call


@pytest.mark.parametrize("count", [0, 2, 4])
def test_wrong_buffer_count(axpy, count: int) -> None:
  _, prog = axpy
  p = ptrs(bufs())
  with pytest.raises(RuntimeLaunchError, match=rf"axpy takes 3 buffers \(slots \[0, 1, 2\]\), got {count}"): prog((p + p)[:count], [4])


@pytest.mark.parametrize("bad", [0, None, "0x1000", 1.5])
def test_null_or_bad_address_names_the_slot(axpy, bad) -> None:
  _, prog = axpy
  p = ptrs(bufs())
  p[1] = bad
  with pytest.raises(RuntimeLaunchError, match=r"axpy: buffer for slot 1 is not a valid address"): prog(p, [4])
  with pytest.raises(RuntimeLaunchError, match="slot 1"): prog.bind(p, [4])


@pytest.mark.parametrize("vals", [[], [4, 5]])
def test_wrong_number_of_vals_names_the_variables(axpy, vals) -> None:
  _, prog = axpy
  with pytest.raises(RuntimeLaunchError, match=rf"axpy takes 1 variable values \['n'\], got {len(vals)}"): prog(ptrs(bufs()), vals)


@pytest.mark.parametrize("v", [0, -1, 4097, 2 ** 31])
def test_val_outside_bounds_names_the_variable(axpy, v: int) -> None:
  _, prog = axpy
  with pytest.raises(VariableBoundsError, match=rf"variable n={v} is outside bounds \[1, 4096\]"): prog(ptrs(bufs()), [v])


@pytest.mark.parametrize("v", [2.0, "4", None])
def test_val_that_is_not_an_int_is_rejected(axpy, v) -> None:
  _, prog = axpy
  with pytest.raises(VariableBoundsError, match="variable n"): prog(ptrs(bufs()), [v])


def test_numpy_integer_vals_are_accepted(axpy) -> None:
  ast, prog = axpy
  bs = bufs(3)
  prog(ptrs(bs), [np.int64(100)])
  assert bs[0].tobytes() == want(ast, bs, 100).tobytes()


def test_bind_then_call_is_the_fast_path(axpy, monkeypatch: pytest.MonkeyPatch) -> None:
  ast, prog = axpy
  bs = bufs(4)
  call = prog.bind(ptrs(bs), [10])
  monkeypatch.setattr(prog, "check", lambda *a: pytest.fail("a bound call re-validated its arguments"))
  for _ in range(3): call()
  assert bs[0].tobytes() == want(ast, bs, 10).tobytes()


def test_set_vals_rebinds_and_rejects_bad_values(axpy) -> None:
  ast, prog = axpy
  bs = bufs(5)
  call = prog.bind(ptrs(bs), [10])
  for n in (4096, 1, 333):
    bs[0][:] = 0
    call.set_vals([n])
    call()
    assert bs[0].tobytes() == want(ast, bs, n).tobytes() and not bs[0][n:].any()
  with pytest.raises(VariableBoundsError, match=r"n=5000 is outside bounds \[1, 4096\]"): call.set_vals([5000])
  with pytest.raises(RuntimeLaunchError, match="1 variable values"): call.set_vals([1, 2])
  bs[0][:] = 0
  call()  # a rejected set_vals leaves the old binding (n=333)
  assert bs[0].tobytes() == want(ast, bs, 333).tobytes()


def test_program_without_vars_or_with_const_sizes() -> None:
  ast = kernels.elementwise(lambda a: a.sqrt(), dtypes.float64, ((1000,), dtypes.float64))
  prog = load(ast)
  x = np.abs(np.random.default_rng(6).standard_normal(1000))
  out = np.zeros(1000)
  prog([out.ctypes.data, x.ctypes.data])
  assert out.tobytes() == np.sqrt(x).tobytes()
  with pytest.raises(RuntimeLaunchError, match="takes 0 variable values"): prog([out.ctypes.data, x.ctypes.data], [3])


@pytest.mark.parametrize("threaded", [False, True])
def test_eight_threads_call_one_program_at_once(axpy, threaded: bool) -> None:
  ast, prog = axpy
  if threaded: prog = load(ast, [Opt(OptOps.THREAD, 0, 3)])
  barrier, errors = threading.Barrier(8), []

  def worker(t: int) -> None:
    try:
      barrier.wait()
      for it in range(40):
        n = 1 + (t * 509 + it * 97) % 4096
        bs = bufs(t * 100 + it % 4)
        call = prog.bind(ptrs(bs), [n]) if it % 2 else None
        call() if call is not None else prog(ptrs(bs), [n])
        if bs[0].tobytes() != want(ast, bs, n).tobytes(): errors.append(f"thread {t} iteration {it} n={n}: wrong result")
    except Exception as e:  # reported below
      errors.append(f"thread {t}: {e!r}")

  ts = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
  for t in ts: t.start()
  for t in ts: t.join(120)
  assert not errors, errors[:5]


def test_many_programs_loaded_side_by_side() -> None:
  # each program owns its JIT engine: loading many and calling them in any order keeps each one's code
  progs = [(c, load(kernels.elementwise(lambda a, c=c: a + float(c), dtypes.float32, ((64,), dtypes.float32), name=f"add{c}"))) for c in range(6)]
  x = np.arange(64, dtype=np.float32)
  for c, p in reversed(progs):
    out = np.zeros(64, np.float32)
    p([out.ctypes.data, x.ctypes.data])
    assert (out == x + c).all(), c


def test_kernels_of_one_name_with_different_code_both_load_and_run() -> None:
  # the shared JIT engine keys symbols by name plus a hash of the code; a taken symbol asked for with other bytes is
  # refused (that program then gets an engine of its own)
  from kiln.codegen.registry import get_runtime
  from kiln.ir import UOp, dtypes
  from kiln.runtime.cpu.program import shared_engine
  rt = get_runtime("CPU")
  def scale(c: float) -> UOp:
    o, x = UOp.define_global(0, dtypes.float32.ptr(64)), UOp.define_global(1, dtypes.float32.ptr(64))
    i = UOp.range(64, 0)
    return UOp.sink(o.index(i).store(x.index(i).load() * c), name="same_name")
  specs = [rt.compiler.compile(rt.renderer.render(scale(c))) for c in (2.0, 3.0)]
  assert specs[0].entry_point != specs[1].entry_point and specs[0].name == specs[1].name == "same_name"
  progs = [rt.load(s) for s in specs]
  assert shared_engine().load(specs[0].entry_point, specs[1].bytes) is None
  x = np.arange(64, dtype=np.float32)
  for prog, c in zip(progs, (2.0, 3.0)):
    out = np.zeros(64, np.float32)
    prog([out.ctypes.data, x.ctypes.data])
    assert np.array_equal(out, x * np.float32(c)), prog.entry


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_streaming_stores_right_at_any_alignment(offset: int) -> None:
  """An output past the streaming threshold: a 64-byte-aligned one takes non-temporal stores, a shifted one the plain
  path; both equal numpy, and nothing past the output is written."""
  from kiln.runtime.cpu.device import STREAM_STORE_BYTES
  n = STREAM_STORE_BYTES // 4
  prog = load(kernels.elementwise(lambda a, b: a + b, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32), name="stream_add"))
  a, b = np.arange(n, dtype=np.float32), np.full(n, 0.5, np.float32)
  raw = np.full(n + 32, -7.0, np.float32)
  start = (-raw.ctypes.data % 64) // 4 + offset
  out = raw[start:start + n]
  prog([out.ctypes.data, a.ctypes.data, b.ctypes.data])
  assert np.array_equal(out, a + b) and (raw[:start] == -7.0).all() and (raw[start + n:] == -7.0).all()
  assert ("nontemporal" in prog.spec.src) == (platform.machine().lower() in ("x86_64", "amd64"))


@pytest.mark.parametrize("mnk,opts", [
  # the heuristic unrolls K = 2 whole (16 rows: two row tiles share the panel); 3 rows are one row tile, which it does not
  # pack for (nothing shares the panel), so that case names the options
  ((3, 3, 2), [Opt(OptOps.UPCAST, 1, 3), Opt(OptOps.UNROLL, 2, 2), Opt(OptOps.OUTER, 1, 1), Opt(OptOps.PACK, 2, 1)]),
  ((16, 16, 2), None), ((12, 3, 2), None),
  ((3, 8, 4), [Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.UNROLL, 2, 4), Opt(OptOps.OUTER, 1, 1), Opt(OptOps.PACK, 2, 1)])])
def test_packed_panel_read_after_it_is_packed(mnk: tuple[int, int, int], opts: list[Opt] | None) -> None:
  """With the reduce axis unrolled whole, the reads of the packed panel have a constant index: they must still come after
  the copy in each column tile (they were hoisted above it, and read stale scratch)."""
  m, n, k = mnk
  rng = np.random.default_rng(k)
  a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
  c = np.zeros((m, n), np.float32)
  prog = load(kernels.matmul(m, n, k), opts)
  assert any(o.startswith("PACK") for o in prog.spec.applied_opts), prog.spec.applied_opts
  prog([c.ctypes.data, a.ctypes.data, b.ctypes.data])
  np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [7, 13, 100, 1000])
@pytest.mark.parametrize("rows", [3, 6])
def test_overlapped_row_tile(m: int, rows: int) -> None:
  """A matmul whose row tile does not divide m ends with a tile shifted back over its neighbour (the rows they share are
  computed twice, the same bits): equal to the product with the tile dividing, nothing past C written. C += A @ B, which
  reads its output, takes a scalar tail of rows instead and adds once."""
  n, k = 40, 24
  rng = np.random.default_rng(m)
  a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
  base = [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UNROLL, 2, 2), Opt(OptOps.FMA, 2, 1)]
  outs = []
  for r in (rows, 1):
    c = np.full(m * n + 16, -3.0, np.float32)
    load(kernels.matmul(m, n, k), base + [Opt(OptOps.UNROLL, 0, r)])([c.ctypes.data, a.ctypes.data, b.ctypes.data])
    assert (c[m * n:] == -3.0).all()
    outs.append(c[:m * n])
  assert np.array_equal(outs[0], outs[1])
  np.testing.assert_allclose(outs[0].reshape(m, n), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
  ast = kernels.matmul(m, n, k)
  st = ast.src[0]
  acc = UOp.sink(st.src[0].store(st.src[0].load() + st.src[1]), name="matmul_acc")
  c = np.concatenate([np.ones(m * n, np.float32), np.full(16, -3.0, np.float32)])
  load(acc, base + [Opt(OptOps.UNROLL, 0, rows)])([c.ctypes.data, a.ctypes.data, b.ctypes.data])
  assert np.array_equal(c[:m * n], outs[0] + np.float32(1)) and (c[m * n:] == -3.0).all()


@pytest.mark.parametrize("n", [17, 100, 1000])
def test_overlapped_last_tile_and_in_place_tail(n: int) -> None:
  """A 16-lane axis of n elements: out = a * 3 overlaps its last tile, x = x * 3 (reads what it writes) keeps a scalar
  tail; both equal numpy exactly, and nothing past n is written."""
  opts = [Opt(OptOps.UPCAST, 0, 16)]
  a = np.arange(n, dtype=np.float32) - 7
  out = np.full(n + 16, -1.0, np.float32)
  load(kernels.elementwise(lambda v: v * 3.0, dtypes.float32, ((n,), dtypes.float32), name="tile3"), opts)([out.ctypes.data, a.ctypes.data])
  assert np.array_equal(out[:n], a * np.float32(3)) and (out[n:] == -1.0).all()
  x = UOp.define_global(0, dtypes.float32.ptr(n))
  i = UOp.range(n, 0)
  prog = load(UOp.sink(x.index(i).store(x.index(i).load() * 3.0), name="inplace3"), opts)
  buf = np.concatenate([a, np.full(16, -1.0, np.float32)])
  prog([buf.ctypes.data])
  assert np.array_equal(buf[:n], a * np.float32(3)) and (buf[n:] == -1.0).all()


def test_a_symbolic_axis_runs_whole_vectors_then_a_scalar_tail() -> None:
  """An output axis of symbolic size takes vector lanes (the heuristic's one vector), run as (n // w) * w elements in whole
  vectors and n % w in a scalar tail (prepare.peel), for every n: none, fewer than a vector, exactly some, a vector and
  a few. Each element is the reference's, and nothing past n is written (the buffers' rest keeps its sentinel)."""
  n = UOp.variable("n", 0, 100)
  ast = kernels.elementwise(lambda a, b: a * 3.0 + b, dtypes.float32, ((n,), dtypes.float32), ((n,), dtypes.float32), name="axpy_sym")
  prog = load(ast)
  assert any(o.startswith("UPCAST(axis=0") for o in prog.spec.applied_opts), prog.spec.applied_opts
  for size in (0, 1, 7, 8, 15, 16, 17, 33, 100):
    bs = bufs(size)
    bs[0][:] = -7.0
    prog(ptrs(bs), [size])
    ref = want(ast, bs, size)
    assert bs[0][:size].tobytes() == ref[:size].tobytes(), size
    assert (bs[0][size:] == -7.0).all(), size


def test_a_sum_along_a_symbolic_axis_of_lanes() -> None:
  """Scores against a transposed K over a symbolic count of keys, out[j] = sum_d q[d] kT[d, j]: the lanes on j (the sum's
  own order per lane, so the reference's bits), whole vectors then a tail, for counts around the vector width."""
  from kiln.ir.ops import AxisType, Ops
  n = UOp.variable("n", 0, 100)
  f32 = dtypes.float32
  o, q, kt = UOp.define_global(0, f32.ptr(100)), UOp.define_global(1, f32.ptr(16)), UOp.define_global(2, f32.ptr(1600))
  j, d = UOp.range(n, 0), UOp.range(16, 1, AxisType.REDUCE)
  ast = UOp.sink(o.index(j).store((q.index(d).load() * kt.index(d * n + j).load()).reduce(Ops.ADD, d)), name="scores_sym")
  prog = load(ast)
  assert any(o.startswith("UPCAST(axis=0") for o in prog.spec.applied_opts), prog.spec.applied_opts
  rng = np.random.default_rng(1)
  for size in (0, 3, 16, 19, 100):
    bs = [np.full(100, -7.0, np.float32), rng.standard_normal(16).astype(np.float32), rng.standard_normal(1600).astype(np.float32)]
    prog(ptrs(bs), [size])
    ref = reference.run(ast, *bs, var_vals={"n": size})[0]
    assert bs[0][:size].tobytes() == ref[:size].tobytes() and (bs[0][size:] == -7.0).all(), size


@pytest.mark.parametrize("cols", [20, None])
def test_a_tail_computes_again_a_sum_that_does_not_vary_along_its_axis(cols: int | None) -> None:
  """o[i, j] -= max_k x[i, k] with 16 lanes on j: 20 columns in place (the kernel reads what it stores, so the last vector
  cannot overlap the one before: whole vectors, then a scalar tail) or a symbolic count. The tail's loop nest is its
  own, so it computes the row max again rather than read the main nest's accumulator (LLVM refused the kernel: two
  definitions of it)."""
  from kiln.ir.ops import AxisType, Ops
  n = UOp.variable("n", 0, 40) if cols is None else cols
  f32 = dtypes.float32
  o, x = UOp.define_global(0, f32.ptr(160)), UOp.define_global(1, f32.ptr(160))
  i, j, k = UOp.range(4, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE)
  mx = x.index(i * n + k).load().reduce(Ops.MAX, k)
  ast = UOp.sink(o.index(i * n + j).store(o.index(i * n + j).load() - mx), name="sub_row_max")
  prog = load(ast, [Opt(OptOps.UPCAST, 1, 16)])
  rng = np.random.default_rng(2)
  for size in ((cols,) if cols else (0, 5, 16, 21, 40)):
    bs = [rng.standard_normal(160).astype(np.float32), rng.standard_normal(160).astype(np.float32)]
    ref = reference.run(ast, *[b.copy() for b in bs], var_vals={} if cols else {"n": size})[0]
    prog(ptrs(bs), [] if cols else [size])
    assert bs[0].tobytes() == ref.tobytes(), size


def test_a_softmax_over_a_symbolic_count_sums_in_vectors() -> None:
  """A row softmax over a symbolic count of keys, exp(x - max) / sum: no lanes on the outputs (the row's max and sum do
  not vary along them), so the max and the sum take lanes of their own, whole vectors then a scalar tail
  (reduce_lowering), for counts around the width; the sum in another order than the reference's, so to float32 rounding."""
  from kiln.ir.ops import AxisType, Ops
  n = UOp.variable("n", 1, 100)
  f32 = dtypes.float32
  o, x = UOp.define_global(0, f32.ptr(400)), UOp.define_global(1, f32.ptr(400))
  i, j, k, k2 = UOp.range(4, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE), UOp.range(n, 3, AxisType.REDUCE)
  mx = x.index(i * n + k).load().reduce(Ops.MAX, k)
  total = (x.index(i * n + k2).load() - mx).exp2().reduce(Ops.ADD, k2)
  ast = UOp.sink(o.index(i * n + j).store((x.index(i * n + j).load() - mx).exp2() / total), name="softmax_sym")
  prog = load(ast)
  ups = [o for o in prog.spec.applied_opts if o.startswith("UPCAST")]
  assert ups == ["UPCAST(axis=2, 16)", "UPCAST(axis=3, 16)"], prog.spec.applied_opts
  rng = np.random.default_rng(3)
  for size in (1, 15, 16, 17, 40, 100):
    bs = [np.full(400, -7.0, np.float32), rng.standard_normal(400).astype(np.float32)]
    prog(ptrs(bs), [size])
    ref = reference.run(ast, *bs, var_vals={"n": size})[0]
    np.testing.assert_allclose(bs[0][:4 * size], ref[:4 * size], rtol=2e-6, err_msg=str(size))
    assert (bs[0][4 * size:] == -7.0).all(), size


@pytest.mark.parametrize("bound", [512, 8])
def test_a_product_over_symbolic_rows_takes_register_tiles_where_they_fit(bound: int) -> None:
  """C = A @ B over a symbolic count of rows: where the rows' bound holds several register tiles (a dynamic export's
  sequence) the heuristic tiles them, whole tiles then a tail of rows (prepare.peel); a bound of a few rows (a dynamic
  batch of images, which ran all in the tail) keeps one row at a time. Either way each row is the product, for counts
  around the tile, and nothing past the last row is written."""
  m = UOp.variable("m", 0, bound)
  ast = kernels.matmul(m, 64, 48)
  prog = load(ast)
  tiled = any(o.startswith("UNROLL(axis=0") for o in prog.spec.applied_opts)
  assert tiled == (bound == 512), prog.spec.applied_opts
  rng = np.random.default_rng(5)
  for rows in sorted({0, 1, 5, 8, 13, 70} & set(range(bound + 1))):
    a, b = rng.standard_normal((bound, 48), dtype=np.float32), rng.standard_normal((48, 64), dtype=np.float32)
    c = np.full(bound * 64, -3.0, np.float32)
    prog([c.ctypes.data, a.ctypes.data, b.ctypes.data], [rows])
    np.testing.assert_allclose(c[:rows * 64].reshape(rows, 64), a[:rows].astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
    assert (c[rows * 64:] == -3.0).all(), rows
