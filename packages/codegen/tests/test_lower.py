"""Lowering, the optimiser's choices and option checks, and the shape of the linear program."""
from __future__ import annotations

import pytest

from kiln.codegen.choose import Opt, OptOps, Target, affine_coeff, heuristic_opts, reassociated_opts
from kiln.codegen.pipeline import lower
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import AxisType, CodegenError, Ops, UOp, dtypes, kernels
from kiln.ir.analysis import free_ranges

F32 = dtypes.float32
CPU = Target(device="CPU", vector_bytes=64, threads=2, min_work_per_thread=1 << 12)


def add_kernel(n: int) -> UOp:
  o, a, b = (UOp.define_global(i, F32.ptr(n)) for i in range(3))
  i = UOp.range(n, 0)
  return UOp.sink(o.index(i).store(a.index(i).load() + b.index(i).load()), name="add")


def matmul(m: int, n: int, k: int) -> UOp:
  c, a, b = UOp.define_global(0, F32.ptr(m * n)), UOp.define_global(1, F32.ptr(m * k)), UOp.define_global(2, F32.ptr(k * n))
  i, j, r = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  return UOp.sink(c.index(i * n + j).store((a.index(i * k + r).load() * b.index(r * n + j).load()).reduce(Ops.ADD, r)), name="matmul")


def full_sum(n: int) -> UOp:
  o, x = UOp.define_global(0, F32.ptr(1)), UOp.define_global(1, F32.ptr(n))
  r = UOp.range(n, 0, AxisType.REDUCE)
  return UOp.sink(o.index(0).store(x.index(r).load().reduce(Ops.ADD, r)), name="sum")


def centered(m: int, n: int) -> UOp:
  """out[i, j] = x[i, j] - max_k x[i, k]: the max depends on i only, so it belongs outside the j loop."""
  o, x = UOp.define_global(0, F32.ptr(m * n)), UOp.define_global(1, F32.ptr(m * n))
  i, j, k = UOp.range(m, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE)
  return UOp.sink(o.index(i * n + j).store(x.index(i * n + j).load() - x.index(i * n + k).load().reduce(Ops.MAX, k)), name="centered")


def symbolic_scale() -> UOp:
  n = UOp.variable("n", 1, 4096)
  o, x = UOp.define_global(0, F32.ptr(4096)), UOp.define_global(1, F32.ptr(4096))
  i = UOp.range(n, 0)
  return UOp.sink(o.index(i).store(x.index(i).load() * 2.0), name="scale")


def check_linear(uops: list[UOp]) -> None:
  """Every value is defined before use, loops and ifs nest properly, accumulators exist before they are touched."""
  defined: set[UOp] = set()
  open_: list[UOp] = []
  for u in uops:
    for s in u.src:
      if s.op is not Ops.CONST and not (s.op is Ops.VECTORIZE and all(x.op is Ops.CONST for x in s.src)):
        assert s in defined, f"{u.op} uses {s.op} before it is defined"
    if u.op in (Ops.RANGE, Ops.IF): open_.append(u)
    if u.op in (Ops.ENDRANGE, Ops.ENDIF): assert open_.pop() is u.src[0], "scopes close out of order"
    defined.add(u)
  assert not open_, "a scope was never closed"


# ---- the heuristic ----
def test_elementwise_is_vectorised_and_threaded():
  opts = heuristic_opts(add_kernel(1 << 16), CPU)
  assert Opt(OptOps.UPCAST, 0, 16) in opts and Opt(OptOps.THREAD, 0, 2) in opts


def test_small_kernels_stay_on_one_thread():
  assert all(o.op is not OptOps.THREAD for o in heuristic_opts(add_kernel(256), CPU))


def test_avx2_width_is_eight_floats():
  assert Opt(OptOps.UPCAST, 0, 8) in heuristic_opts(add_kernel(1 << 16), Target(vector_bytes=32, threads=1))


def test_matmul_gets_register_tiling():
  opts = heuristic_opts(matmul(256, 256, 256), CPU)
  assert Opt(OptOps.UPCAST, 1, 32) in opts  # the contiguous output axis in two vectors of lanes
  assert Opt(OptOps.UNROLL, 0, 8) in opts and Opt(OptOps.UNROLL, 2, 2) in opts  # rows and the reduce unrolled
  # the 256 columns are 8 tiles of 32: 8 chunks for the threads to claim, one tile each
  assert {Opt(OptOps.OUTER, 1, 1), Opt(OptOps.PACK, 2, 1), Opt(OptOps.FMA, 2, 1), Opt(OptOps.THREAD, 1, 8)} <= set(opts)


def tile(t: Target, m: int = 1024) -> tuple[int, int]:
  """(rows, vector width) of the heuristic's register tile for an m x 1024 x 1024 float32 product."""
  opts = heuristic_opts(matmul(m, 1024, 1024), t)
  return (next((o.amount for o in opts if o.op is OptOps.UNROLL and o.axis == 0), 1), next(o.amount for o in opts if o.op is OptOps.UPCAST))


def test_target_registers_follow_the_vector_width_unless_given():
  assert Target(vector_bytes=64).vector_registers == 32 and Target(vector_bytes=32).vector_registers == 16
  assert Target(vector_bytes=16).vector_registers == 16 and Target(vector_bytes=16, vector_registers=32).vector_registers == 32
  assert Target(vector_bytes=32) == Target(vector_bytes=32, vector_registers=16)  # the derived value is the field's value


@pytest.mark.parametrize("t,want", [
  (Target(vector_bytes=64, threads=2), (8, 32)),  # AVX-512: 16 accumulators + 2 loads + 1 broadcast of 32 registers, as before
  (Target(vector_bytes=32), (6, 16)),  # AVX2: 8 rows x 2 vectors would need 19 of 16 registers and spill
  (Target(vector_bytes=32, vector_registers=32), (8, 16)),
  (Target(vector_bytes=16, vector_registers=32), (8, 8)),  # aarch64 NEON: 32 registers
  (Target(vector_bytes=16, vector_registers=8), (2, 8))])
def test_register_tile_fits_the_register_file(t: Target, want: tuple[int, int]):
  rows, width = tile(t)
  vecs = width // (t.vector_bytes // 4)
  assert (rows, width) == want and rows * vecs + vecs + 1 <= t.vector_registers
  assert tile(t, 1000) == want  # 1000 rows: the last tile is shifted back over its neighbour (prepare.peel)
  assert tile(t, want[0])[0] == want[0]
  # rows the most that fit do not divide: the count, down to 12 accumulators, whose tiles compute the fewest rows (each
  # tile's loads of B as a row more): 20 rows in 3 tiles of 7, not 8; 36 (a ViT's 2 x 18 tokens) in 6 of 6, not 5 of 8
  assert tile(t, 20)[0] == (7 if want[0] == 8 else want[0]) and tile(t, 36)[0] == (6 if want[0] == 8 else want[0])


def accumulate(ast: UOp) -> UOp:
  """C += A @ B: the product's store also reads C, so a recomputed row would read what it wrote."""
  st = ast.src[0]
  return UOp.sink(st.src[0].store(st.src[0].load() + st.src[1]), name="matmul_acc")


def test_sixteen_registers_tile_six_rows():
  # 6 rows x 2 vectors: 12 accumulators + 2 loads + 1 broadcast of AVX2's 16 registers (8 accumulators stall on FMA latency)
  assert tile(Target(vector_bytes=32), 1536) == (6, 16) and tile(Target(vector_bytes=32), 12) == (6, 16)
  assert tile(Target(vector_bytes=32), 1024) == (6, 16)  # 6 does not divide: the last tile overlaps the one before
  # a product that reads its output cannot recompute rows: a row count that divides
  rows = [o.amount for o in heuristic_opts(accumulate(matmul(1024, 1024, 1024)), Target(vector_bytes=32)) if o.op is OptOps.UNROLL and o.axis == 0]
  assert rows == [4]
  # 32 registers: 8 rows, but 12 rows are two tiles of 6 (two of 8 would compute 16)
  assert tile(Target(vector_bytes=64), 1536) == (8, 32) and tile(Target(vector_bytes=64), 12)[0] == 6


def test_overlapped_row_tile_lowers_to_whole_tiles():
  # 1000 rows in tiles of 6: 167 tiles, the last starting at row 994 (rows 994-995 computed twice, the same bits)
  lk = lower(matmul(1000, 64, 32), Target(vector_bytes=32))
  assert sorted(u.src[1].arg for u in lk.uops if u.op is Ops.RANGE and u.arg[1] is AxisType.LOOP) == [4, 167]  # 64 columns: 4 of 16


def test_small_matmul_stays_on_one_thread():
  opts = heuristic_opts(matmul(64, 64, 48), CPU)  # 196K multiply-adds: waking a worker costs more than it saves
  assert not any(o.op is OptOps.THREAD for o in opts) and Opt(OptOps.UPCAST, 1, 32) in opts


def test_narrow_matmul_output_is_one_vector_of_its_width():
  opts = heuristic_opts(matmul(256, 10, 512), CPU)  # an MLP's last layer: 10 columns are one 10-lane vector
  assert Opt(OptOps.UPCAST, 1, 10) in opts
  assert Opt(OptOps.UPCAST, 1, 8) in heuristic_opts(matmul(256, 8, 512), CPU)  # a power of two stays as it is
  # past one vector: a whole vector and one shifted back over it, where 4-lane or scalar steps would cost more (17: a ViT's
  # 16 patches and its class token, all scalar before), but 24 stays three 8-lane steps (half a vector costs half)
  assert Opt(OptOps.UPCAST, 1, 16) in heuristic_opts(matmul(256, 20, 512), CPU)
  assert Opt(OptOps.UPCAST, 1, 16) in heuristic_opts(matmul(256, 17, 64), CPU)
  assert Opt(OptOps.UPCAST, 1, 8) in heuristic_opts(matmul(256, 24, 512), CPU)
  assert Opt(OptOps.UPCAST, 1, 8) in heuristic_opts(matmul(256, 12, 512), Target(device="CPU", vector_bytes=32, threads=2))  # AVX2: 8 + 8
  # two vectors' worth or more that no power of two divides: one vector, the last one overlapped (it had no vectors at all)
  assert Opt(OptOps.UPCAST, 1, 16) in heuristic_opts(matmul(256, 43, 512), CPU)
  assert Opt(OptOps.UPCAST, 1, 16) in heuristic_opts(matmul(256, 43, 512), Target(device="CPU", vector_bytes=32, threads=2))  # AVX2: two


def test_packed_matmul_reads_its_panel_from_scratch():
  spec = LLVMRenderer(CPU).render(matmul(256, 512, 256))
  # 16 column chunks, one K x 32 panel per thread (2 slots)
  assert spec.threads == 16 and spec.slots == 2 and spec.scratch_bytes == 2 * 256 * 32 * 4 and not spec.finish
  lk = lower(matmul(256, 512, 256), CPU)
  b_loads = [u for u in lk.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0].arg == 2]
  assert b_loads and all(u.dtype == F32.vec(32) for u in b_loads)  # b is only read to pack it
  assert any(u.op is Ops.FMA for u in lk.uops)


def test_full_reduction_splits_its_reduce_axis():
  opts = heuristic_opts(full_sum(1 << 20), CPU)
  # four vectors of accumulators, 16 chunks (1M elements at 30,000 a chunk at least, capped at 16 on a small host)
  assert Opt(OptOps.UPCAST, 0, 64) in opts and Opt(OptOps.THREAD, 0, 16) in opts
  spec = LLVMRenderer(CPU).render(full_sum(1 << 20))
  assert spec.threads == 16 and spec.finish and spec.scratch_bytes == 16 * 64 * 4 and spec.var_names == ["core_id"]  # a partial a chunk


def test_symbolic_sizes_take_one_vector_and_a_scalar_tail():
  """An output axis of symbolic size takes one vector of lanes; prepare.peel makes it whole vectors over (n // 16) * 16
  elements and a scalar tail over n % 16 (runtime-cpu's tests run it for sizes around the width)."""
  from kiln.codegen.lowering.prepare import peel
  opts = heuristic_opts(symbolic_scale(), CPU)
  assert [o for o in opts if o.op is OptOps.UPCAST] == [Opt(OptOps.UPCAST, 0, 16)]
  peeled = peel(symbolic_scale(), opts)
  assert peeled is not None and peeled[1] == 1 and len([s for s in peeled[0].src if s.op is Ops.STORE]) == 2
  assert LLVMRenderer(CPU).render(symbolic_scale()).applied_opts


def test_gpu_target_maps_axes_to_threads():
  gpu = Target(device="CUDA", vector_bytes=0)
  assert heuristic_opts(add_kernel(1 << 16), gpu) == [Opt(OptOps.LOCAL, 0, 256)]
  # a full sum: 16 elements per thread before the tree, over as many blocks as that gives (two stages), one block when small
  assert heuristic_opts(full_sum(1 << 16), gpu) == [Opt(OptOps.GROUP, 0, 256), Opt(OptOps.BLOCKS, 0, 16)]
  assert heuristic_opts(full_sum(1000), gpu) == [Opt(OptOps.GROUP, 0, 256)]


def test_inline_polynomial_bodies_take_two_vectors():
  # exp/erf/tanh are latency-bound chains per lane: a second independent vector fills the pipes; a plain add keeps one
  from kiln.codegen.choose import heuristic
  from kiln.codegen.render import llvm_math
  assert heuristic._POLY_OPS == frozenset(llvm_math.BODIES)  # the heuristic's list is the renderer's (choose cannot import render)
  def ew(f): return kernels.elementwise(f, dtypes.float32, ((4096,), dtypes.float32))
  for t, lanes in ((Target(vector_bytes=32), 8), (Target(vector_bytes=64), 16)):
    assert Opt(OptOps.UPCAST, 0, 2 * lanes) in heuristic_opts(ew(lambda x: x.exp2()), t)
    assert Opt(OptOps.UPCAST, 0, 2 * lanes) in heuristic_opts(ew(lambda x: x * 0.5 * ((x * 0.7071).erf() + 1.0)), t)
    assert Opt(OptOps.UPCAST, 0, lanes) in heuristic_opts(ew(lambda x: x + 1.0), t)
    assert Opt(OptOps.UPCAST, 0, lanes) in heuristic_opts(ew(lambda x: x.sqrt()), t)  # one instruction, not a polynomial


def test_heuristic_is_deterministic():
  assert LLVMRenderer(CPU).render(matmul(64, 64, 64)).src == LLVMRenderer(CPU).render(matmul(64, 64, 64)).src


# ---- explicit options are checked ----
@pytest.mark.parametrize("opts, msg", [
  ([Opt(OptOps.UPCAST, 7, 4)], "axis 7"),
  ([Opt(OptOps.UNROLL, 2, 3)], "must divide"),  # a reduce axis (an output axis's last tile overlaps or peels instead)
  ([Opt(OptOps.UPCAST, 0, 2), Opt(OptOps.UPCAST, 1, 2)], "only one axis can be vectorised"),
  ([Opt(OptOps.UPCAST, 0, 2), Opt(OptOps.UNROLL, 0, 2)], "already split"),
  ([Opt(OptOps.THREAD, 2, 2)], "full reduction"),
  ([Opt(OptOps.LOCAL, 0, 32)], "GPU option"),
])
def test_bad_options_are_named(opts: list[Opt], msg: str):
  with pytest.raises(CodegenError, match=msg): lower(matmul(16, 16, 16), CPU, opts)


def test_opt_amount_must_be_positive():
  with pytest.raises(CodegenError, match="positive"): Opt(OptOps.UNROLL, 0, 0)


def test_a_kernel_is_a_sink():
  with pytest.raises(CodegenError, match="SINK"): lower(UOp.const(F32, 1.0), CPU)


# ---- the linear program ----
@pytest.mark.parametrize("ast", [add_kernel(1024), matmul(32, 48, 20), full_sum(4096), centered(8, 24), symbolic_scale()], ids=lambda a: a.arg)
@pytest.mark.parametrize("heuristic", [True, False])
def test_linear_program_is_well_formed(ast: UOp, heuristic: bool):
  check_linear(lower(ast, CPU, None if heuristic else []).uops)


def test_reduce_is_hoisted_out_of_the_loop_it_does_not_use():
  uops = lower(centered(8, 24), CPU, []).uops
  loops = [u for u in uops if u.op is Ops.RANGE]
  assert [lp.arg[1] for lp in loops] == [AxisType.LOOP, AxisType.REDUCE, AxisType.LOOP]  # i, then max over k, then j
  assert uops.index(loops[1]) < uops.index(loops[2])


def test_register_tiles_share_one_reduce_loop():
  lk = lower(matmul(64, 64, 64), CPU, [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.UNROLL, 0, 4), Opt(OptOps.UNROLL, 2, 4)])
  assert sum(u.op is Ops.RANGE and u.arg[1] is AxisType.REDUCE for u in lk.uops) == 1
  accs = [u for u in lk.uops if u.op is Ops.DEFINE_ACC]
  assert len(accs) == 4 and all(a.dtype == F32.vec(16) for a in accs)
  assert sum(u.op is Ops.ACC_STORE for u in lk.uops) == 16  # 4 accumulators x 4 unrolled reduce steps


def test_contiguous_lanes_load_as_vectors_and_strided_ones_gather():
  lk = lower(matmul(16, 16, 16), CPU, [Opt(OptOps.UPCAST, 1, 16)])
  vec_loads = [u for u in lk.uops if u.op is Ops.LOAD and u.dtype == F32.vec(16) and u.src[0].op is Ops.INDEX]
  assert len(vec_loads) == 1 and vec_loads[0].src[0].src[0].arg == 2  # b[k, j:j+16] is contiguous; a[i, k] is broadcast
  lk = lower(matmul(16, 16, 16), CPU, [Opt(OptOps.UPCAST, 0, 4)])  # rows in lanes: a[i*16+k] is strided
  assert any(u.op is Ops.VECTORIZE and all(s.op is Ops.LOAD for s in u.src) for u in lk.uops)


def test_a_gather_of_contiguous_runs_loads_each_run(monkeypatch):
  """Lanes that read a few runs of consecutive elements (Winograd's 4x4 tiles read back into rows: out[r, 4t + s] =
  y[s, r, t]) load each run as one vector and pick the lanes from them; with RUN_LANES = 0 the lanes are one gather (a
  vector index), and without gathers (VECTOR_GATHERS) a scalar load each."""
  from kiln.codegen.lowering import expand
  out, y = UOp.define_global(0, F32.ptr(8 * 16)), UOp.define_global(1, F32.ptr(4 * 8 * 4))
  r, lane = UOp.range(8, 0), UOp.range(16, 1)
  ast = UOp.sink(out.index(r * 16 + lane).store(y.index((lane % 4) * 32 + r * 4 + lane // 4).load()), name="tiles")
  def y_loads() -> list[UOp]:
    lk = lower(ast, CPU, [Opt(OptOps.UPCAST, 1, 16)])
    return [u for u in lk.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0].arg == 1]
  assert sorted(u.dtype.count for u in y_loads()) == [4, 4, 4, 4]
  monkeypatch.setattr(expand, "RUN_LANES", 0)
  assert [(u.dtype.count, u.src[0].src[1].dtype.count) for u in y_loads()] == [(16, 16)]
  monkeypatch.setattr(expand, "VECTOR_GATHERS", False)
  assert [u.dtype.count for u in y_loads()] == [1] * 16


def test_pool_columns_share_one_span():
  """A 2x2 pool vectorised along x reads its left (2x) and right (2x + 1) columns as one span each row: the same masked
  load address, the even lanes on for one and the odd lanes for the other, so the max runs on full vectors."""
  out, x = UOp.define_global(0, F32.ptr(2 * 8 * 16)), UOp.define_global(1, F32.ptr(2 * 16 * 32))
  b, y, xx = UOp.range(2, 0), UOp.range(8, 1), UOp.range(16, 2)
  i, j = UOp.range(2, 3, AxisType.REDUCE), UOp.range(2, 4, AxisType.REDUCE)
  v = x.index(b * 512 + (y * 2 + i) * 32 + xx * 2 + j).load().reduce(Ops.MAX, i, j)
  ast = UOp.sink(out.index(b * 128 + y * 16 + xx).store(v), name="pool2")
  lk = lower(ast, CPU, [Opt(OptOps.UPCAST, 2, 16), Opt(OptOps.UNROLL, 3, 2), Opt(OptOps.UNROLL, 4, 2)])
  spans = [u for u in lk.uops if u.op is Ops.LOAD and u.dtype == F32.vec(32)]
  masks = {}
  for ld in spans: masks.setdefault(ld.src[0].src[1], []).append(tuple(bool(m.arg) for m in ld.src[0].src[2].src))
  even = tuple(k % 2 == 0 for k in range(32))
  assert len(spans) == 4 and len(masks) == 2, masks  # two rows, each one address
  assert all(sorted(m) == sorted([even, tuple(not e for e in even)]) for m in masks.values()), masks


def test_reassociating_row_sums_vectorise_the_reduce_axis():
  """A row sum vectorised along its rows gathers every load: by default it keeps one lane per row (the reference's order
  of additions); a caller that takes another order gets whole-row vectors on the reduce axis. A column sum, contiguous
  along its output, is the same either way."""
  from kiln.codegen.lowering.prepare import prepare
  rows = prepare(kernels.reduce(Ops.ADD, (256, 64), F32, axes=1))[0]
  upcasts = lambda opts: [(o.axis, o.amount) for o in opts if o.op is OptOps.UPCAST]  # noqa: E731
  red = next(r.arg[0] for r in rows.toposort() if r.op is Ops.RANGE and r.arg[1] is AxisType.REDUCE)
  assert upcasts(heuristic_opts(rows, CPU)) == [(1 - red, 16)]  # the output axis (ids 0 and 1)
  assert upcasts(heuristic_opts(rows, CPU, reassociate=True)) == [(red, 64)]  # four vectors of accumulators
  cols = prepare(kernels.reduce(Ops.ADD, (64, 256), F32, axes=0))[0]
  assert heuristic_opts(cols, CPU, reassociate=True) == heuristic_opts(cols, CPU)
  assert reassociated_opts(rows, CPU) == heuristic_opts(rows, CPU, reassociate=True) and reassociated_opts(cols, CPU) is None


def test_metadata():
  spec = LLVMRenderer(CPU).render(symbolic_scale())
  assert spec.var_names == ["n"] and [(v.name, v.min, v.max) for v in spec.vars] == [("n", 1, 4096)]
  assert spec.globals == [0, 1] and spec.outs == [0] and spec.ins == [1] and spec.buf_count == 2
  assert [(a.slot, a.dtype, a.size) for a in spec.args] == [(0, "float32", 4096), (1, "float32", 4096)]
  spec = LLVMRenderer(CPU).render(matmul(128, 128, 128))
  assert spec.var_names == ["core_id"] and spec.global_size == (2, 1, 1) and spec.applied_opts
  assert spec.flops == 2 * 128 ** 3


def test_free_ranges():
  i, k = UOp.range(4, 0), UOp.range(4, 1, AxisType.REDUCE)
  x = UOp.define_global(0, F32.ptr(16))
  red = x.index(i * 4 + k).load().reduce(Ops.ADD, k)
  assert free_ranges(red) == {i} and free_ranges(red + x.index(k).load()) == {i, k}


def test_affine_coeff():
  i, j = UOp.range(8, 0), UOp.range(8, 1)
  assert affine_coeff(i * 8 + j, j) == 1 and affine_coeff(i * 8 + j, i) == 8 and affine_coeff((i * 8 + j) // 2, j) is None


# ---- LLVM IR parses and verifies ----
def test_llvm_ir_verifies_with_llvmlite():
  llvm = pytest.importorskip("llvmlite.binding")
  llvm.initialize_native_target()
  llvm.initialize_native_asmprinter()
  for ast in (add_kernel(1024), matmul(32, 48, 20), full_sum(4096), centered(8, 24), symbolic_scale()):
    for opts in (None, []):
      src = LLVMRenderer(CPU).render(ast, opts).src
      llvm.parse_assembly(src).verify()


@pytest.mark.parametrize("opts, msg", [
  ([Opt(OptOps.GROUP, 0, 64)], "output axis"),
  ([Opt(OptOps.GROUP, 2, 48)], "power of two"),
])
def test_bad_gpu_options_are_named(opts: list[Opt], msg: str):
  with pytest.raises(CodegenError, match=msg): lower(matmul(16, 16, 16), Target(device="CUDA", vector_bytes=0), opts)


def test_group_with_local_is_refused():
  o, x = UOp.define_global(0, F32.ptr(4)), UOp.define_global(1, F32.ptr(4 * 64))
  i, r = UOp.range(4, 0), UOp.range(64, 1, AxisType.REDUCE)
  ast = UOp.sink(o.index(i).store(x.index(i * 64 + r).load().reduce(Ops.ADD, r)), name="rows")
  with pytest.raises(CodegenError, match="LOCAL"):
    lower(ast, Target(device="CUDA", vector_bytes=0), [Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.GROUP, 1, 64)])


def test_group_needs_every_output_axis_on_the_grid():
  o, x = UOp.define_global(0, F32.ptr(16)), UOp.define_global(1, F32.ptr(16 * 64))
  a, b, c, d = (UOp.range(2, i) for i in range(4))
  r = UOp.range(64, 4, AxisType.REDUCE)
  out = ((a * 2 + b) * 2 + c) * 2 + d
  ast = UOp.sink(o.index(out).store(x.index(out * 64 + r).load().reduce(Ops.ADD, r)), name="four_axes")
  with pytest.raises(CodegenError, match="grid"): lower(ast, Target(device="CUDA", vector_bytes=0), [Opt(OptOps.GROUP, 4, 64)])
  lower(ast, Target(device="CUDA", vector_bytes=0), [])  # the four axes without a GROUP are fine


def test_each_thread_packs_into_its_own_panel_even_when_an_inner_axis_is_split():
  opts = [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.OUTER, 1, 1), Opt(OptOps.PACK, 2, 1), Opt(OptOps.THREAD, 0, 2)]
  lk = lower(matmul(64, 64, 32), CPU, opts)
  packs = [u for u in lk.uops if u.op is Ops.STORE and u.src[0].src[0].arg == -1]
  # the chunk writes its panel at the start of its thread's scratch; the entry hands each thread (slot) its own
  assert packs and not any(any(x.op is Ops.SPECIAL for x in p.src[0].toposort()) for p in packs)
  assert lk.slots == 2 and lk.slot_bytes == 32 * 16 * 4 and lk.scratch_bytes == 2 * lk.slot_bytes
  src = LLVMRenderer(CPU).render(matmul(64, 64, 32), opts).src
  assert f"%off = mul i64 %slot64, {lk.slot_bytes}" in src and "atomicrmw add ptr %claim, i32 1" in src


def test_a_one_element_output_axis_is_still_a_full_reduction():
  o, x = UOp.define_global(0, F32.ptr(1)), UOp.define_global(1, F32.ptr(1 << 20))
  i, r = UOp.range(1, 0), UOp.range(1 << 20, 1, AxisType.REDUCE)
  ast = UOp.sink(o.index(i).store(x.index(i * 0 + r).load().reduce(Ops.ADD, r)), name="sum_keepdims")
  spec = LLVMRenderer(CPU).render(ast)
  assert spec.threads == 16 and spec.finish and any(o.startswith("THREAD(axis=1") for o in spec.applied_opts)


def test_a_vector_axis_the_width_does_not_divide_is_peeled_into_a_scalar_tail():
  opts = heuristic_opts(matmul(1000, 1000, 64), CPU)
  assert Opt(OptOps.UPCAST, 1, 32) in opts  # the full width, though 32 does not divide 1000
  lk = lower(matmul(1000, 1000, 64), CPU)  # C is not read: whole tiles, the last one overlapping
  assert all(u.src[1].dtype == F32.vec(32) for u in lk.uops if u.op is Ops.STORE and u.src[0].src[0].arg == 0)
  # C += A @ B reads C: a scalar tail instead
  c, a, b = UOp.define_global(0, F32.ptr(1000 * 1000)), UOp.define_global(1, F32.ptr(1000 * 64)), UOp.define_global(2, F32.ptr(64 * 1000))
  i, j, r = UOp.range(1000, 0), UOp.range(1000, 1), UOp.range(64, 2, AxisType.REDUCE)
  prod = (a.index(i * 64 + r).load() * b.index(r * 1000 + j).load()).reduce(Ops.ADD, r)
  lk = lower(UOp.sink(c.index(i * 1000 + j).store(c.index(i * 1000 + j).load() + prod), name="matmul_acc"), CPU, opts)
  stores = [u for u in lk.uops if u.op is Ops.STORE and u.src[0].src[0].arg == 0]
  assert any(s.src[1].dtype == F32.vec(32) for s in stores) and any(s.src[1].dtype == F32 for s in stores)  # main and tail
  # THREAD splits the column axis, which the tail does not have: the tail runs once, in the call with core_id 0
  ifs = [u for u in lk.uops if u.op is Ops.IF]
  assert len(ifs) == 1 and ifs[0].src[0].op is Ops.CMPEQ and ifs[0].src[0].src[0].arg == "core_id"


# ---- streaming stores (CPU: outputs past the caches) ----
STREAM = Target(device="CPU", vector_bytes=64, threads=2, min_work_per_thread=1 << 12, stream_store_bytes=1 << 20)


def test_big_output_streams_behind_an_alignment_check():
  src = LLVMRenderer(STREAM).render(add_kernel(1 << 18)).src  # 1 MiB out
  assert "!nontemporal" in src and "align 64, !nontemporal" in src
  assert "and i64 %stream0.a64.p, 63" in src  # the base is checked once: a 64-byte-aligned one takes the whole vector
  assert "and i64 %stream0.a16.p, 15" in src  # a 16-byte-aligned one (numpy's, malloc's) the vector's 16-byte pieces
  assert src.count("store <4 x float>") == 4 and src.count("store <4 x float> %") == src.count("align 16, !nontemporal")
  for k in (4, 8, 12): assert f"getelementptr inbounds float, ptr %t6, i32 {k}" in src  # each piece at its own lanes
  assert src.count("store <16 x float>") == 2 and "call void @llvm.x86.sse.sfence()" in src  # the streamed one and the plain one
  assert src.index("%stream0.a16 = ") < src.index("br label %loop0")  # the flags are computed before the loop


@pytest.mark.parametrize("dt,piece", [(dtypes.float64, "<2 x double>"), (dtypes.bfloat16, "<8 x i16>"), (dtypes.bool, "<16 x i8>")], ids=str)
def test_streamed_pieces_are_16_bytes_of_the_memory_type(dt, piece: str):
  n = (1 << 20) // dt.itemsize
  o, a, b = (UOp.define_global(i, dt.ptr(n)) for i in range(3))
  i = UOp.range(n, 0)
  src = LLVMRenderer(STREAM).render(UOp.sink(o.index(i).store(a.index(i).load() + b.index(i).load()), name="add")).src
  assert src.count(f"store {piece}") == 4 and src.count(f"store {piece}") == src.count("align 16, !nontemporal")


def test_small_or_unaligned_outputs_use_plain_stores():
  assert "nontemporal" not in LLVMRenderer(STREAM).render(add_kernel(1 << 17)).src  # 512 KiB: stays in the caches
  assert "nontemporal" not in LLVMRenderer(CPU).render(add_kernel(1 << 18)).src  # streaming off
  # rows of 1000: a 16-lane store at i*1000 + j*16 (the last tile at i*1000 + 984) is not always on a 64-byte boundary,
  # so it never streams whole, but always on a 16-byte one: its 16-byte pieces stream on a 16-byte-aligned base
  o, a = UOp.define_global(0, F32.ptr(1000 * 1000)), UOp.define_global(1, F32.ptr(1000 * 1000))
  i, j = UOp.range(1000, 0), UOp.range(1000, 1)
  rows = UOp.sink(o.index(i * 1000 + j).store(a.index(i * 1000 + j).load() * 2.0), name="rows")
  spec = LLVMRenderer(STREAM).render(rows, [Opt(OptOps.UPCAST, 1, 16)])
  assert "align 64, !nontemporal" not in spec.src and "%stream0.a64" not in spec.src and "store <16 x float>" in spec.src
  assert spec.src.count("align 16, !nontemporal") == 4
  spec = LLVMRenderer(STREAM).render(rows, [Opt(OptOps.UPCAST, 1, 8)])  # 8 lanes: 1000 is a multiple, 32-byte aligned
  assert "store <8 x float>" in spec.src and "align 32, !nontemporal" in spec.src
  # rows of 1001: only 4-byte aligned, so no streaming tier at all
  o, a = UOp.define_global(0, F32.ptr(1001 * 1000)), UOp.define_global(1, F32.ptr(1001 * 1000))
  rows = UOp.sink(o.index(i * 1001 + j).store(a.index(i * 1001 + j).load() * 2.0), name="rows")
  assert "nontemporal" not in LLVMRenderer(STREAM).render(rows, [Opt(OptOps.UPCAST, 1, 16)]).src


def test_peeled_axis_overlaps_its_last_tile_unless_the_output_is_read():
  lk = lower(matmul(64, 100, 48), CPU, [Opt(OptOps.UPCAST, 1, 32), Opt(OptOps.UNROLL, 0, 8)])
  stores = [u for u in lk.uops if u.op is Ops.STORE and u.src[0].src[0].arg == 0]
  assert stores and all(u.src[1].dtype == F32.vec(32) for u in stores)  # 4 whole tiles, the last shifted back: no scalar tail
  x = UOp.define_global(0, F32.ptr(100))
  i = UOp.range(100, 0)
  inplace = UOp.sink(x.index(i).store(x.index(i).load() * 2.0), name="double")  # reads what it writes: a scalar tail
  stores = [u for u in lower(inplace, CPU, [Opt(OptOps.UPCAST, 0, 16)]).uops if u.op is Ops.STORE]
  assert {u.src[1].dtype.count for u in stores} == {16, 1}


def test_nsw_only_where_bounds_prove_no_signed_wrap():
  """Integer ADD/SUB/MUL render `nsw` where the operands' bounds prove the exact result fits (index arithmetic, so LLVM
  widens i32 addresses term by term and shares a base pointer across a register tile's rows), and plain where it may
  wrap (kiln's integer arithmetic wraps by definition: nsw there would make the overflow poison)."""
  from kiln.codegen.render.llvm import no_signed_wrap
  i, n = UOp.range(1024, 0), UOp.variable("n", 0, 2**20)
  assert no_signed_wrap(i * 1152 + 384) and no_signed_wrap((i * 1152 + 384).src[0]) and no_signed_wrap(n - i)
  x = UOp.variable("x", -2**31, 2**31 - 1)
  assert not no_signed_wrap(x + 1) and not no_signed_wrap(x * 2) and not no_signed_wrap(x - 1) and not no_signed_wrap(n * n * n)
  assert not no_signed_wrap(UOp.variable("u", 0, 5).cast(dtypes.uint32) + UOp.const(dtypes.uint32, 1))  # unsigned: never nsw
  src = LLVMRenderer(Target(vector_bytes=32)).render(kernels.matmul(64, 64, 64)).src
  assert " add nsw i32 " in src or " mul nsw i32 " in src


def test_nothing_under_an_empty_constant_range_is_left_to_run():
  """Under a range of constant size 0 a load becomes a zero and a REDUCE its identity (prepare.drop_empty): nothing is left
  to be hoisted out of the zero-trip loop (an UPCAST of such an axis once read 8 lanes of a 1-element buffer at the
  kernel's entry). The buffer keeps its parameter."""
  from kiln.codegen.lowering.prepare import drop_empty
  out, x = UOp.define_global(0, dtypes.float32.ptr(4)), UOp.define_global(1, dtypes.float32.ptr(1))
  i, e, r = UOp.range(4, 0), UOp.range(0, 1), UOp.range(0, 2, AxisType.REDUCE)
  empty_store = out.index(e).store(x.index(e).load())
  kept = out.index(i).store(x.index(r).load().reduce(Ops.ADD, r) + 1.0)
  got = drop_empty(UOp.sink(empty_store, kept))
  assert len(got.src) == 2 and not any(n.op in (Ops.REDUCE, Ops.LOAD) for n in got.toposort())
  lk = lower(UOp.sink(empty_store), Target(), [Opt(OptOps.UPCAST, 1, 8)])
  assert [g.arg for g in lk.globals] == [0, 1] and not any(u.op is Ops.LOAD for u in lk.uops)


def test_a_batched_product_with_few_column_tiles_splits_its_batch():
  """A conv as a batched product (32 images, 128 x 576 @ 576 x 64 each): 64 columns are 2 tiles, so the chunks come from
  the 32 images instead; a plain product keeps its column tiles."""
  n, o, p, k = 32, 128, 64, 576
  w, x, y = UOp.define_global(1, F32.ptr(o * k)), UOp.define_global(2, F32.ptr(n * k * p)), UOp.define_global(0, F32.ptr(n * o * p))
  b, i, j, r = UOp.range(n, 0), UOp.range(o, 1), UOp.range(p, 2), UOp.range(k, 3, AxisType.REDUCE)
  ast = UOp.sink(y.index((b * o + i) * p + j).store((w.index(i * k + r).load() * x.index((b * k + r) * p + j).load()).reduce(Ops.ADD, r)), name="bmm")
  opts = heuristic_opts(ast, CPU)
  assert Opt(OptOps.OUTER, 2, 1) in opts and any(o.op is OptOps.THREAD and o.axis == 0 and o.amount >= 8 for o in opts), opts
  assert any(o.op is OptOps.THREAD and o.axis == 1 for o in heuristic_opts(matmul(512, 512, 512), CPU))  # columns, as before


def test_small_reduce_windows_unroll_whole():
  """A 2x2 max pool's window loops (2 trips each) are unrolled whole; a 5-trip window and a matmul's reduce are not."""
  def pool(k: int) -> UOp:
    o, x = UOp.define_global(0, F32.ptr(32 * 16 * 16)), UOp.define_global(1, F32.ptr(32 * 40 * 40))
    c, y, xx = UOp.range(32, 0), UOp.range(16, 1), UOp.range(16, 2)
    i, j = UOp.range(k, 3, AxisType.REDUCE), UOp.range(k, 4, AxisType.REDUCE)
    v = x.index(c * 1600 + (y * 2 + i) * 40 + xx * 2 + j).load().reduce(Ops.MAX, i, j)
    return UOp.sink(o.index(c * 256 + y * 16 + xx).store(v), name="pool")
  opts = heuristic_opts(pool(2), CPU)
  assert Opt(OptOps.UNROLL, 3, 2) in opts and Opt(OptOps.UNROLL, 4, 2) in opts
  assert not any(o.op is OptOps.UNROLL and o.axis in (3, 4) for o in heuristic_opts(pool(5), CPU))  # (its output rows are)
  assert not any(o.op is OptOps.UNROLL and o.axis == 2 and o.amount > 2 for o in heuristic_opts(matmul(64, 64, 3), CPU))



def window_sum(k: int, blocked: bool) -> UOp:
  """A depthwise conv's window sum over 8x8 maps of 32 channels, k x k taps: blocked, (2, 8, 8, 16) per block with the
  16 channels contiguous (the vector, each tap a whole vector on); NCHW, (32, 8, 16) with the rows contiguous."""
  o, x, wt = UOp.define_global(0, F32.ptr(32 * 8 * 16)), UOp.define_global(1, F32.ptr(32 * 24 * 24)), UOp.define_global(2, F32.ptr(32 * k * k))
  i, j = UOp.range(k, 3, AxisType.REDUCE), UOp.range(k, 4, AxisType.REDUCE)
  if blocked:
    b, y, xx, c = UOp.range(2, 0), UOp.range(8, 1), UOp.range(8, 2), UOp.range(16, 5)
    v = (x.index(((b * 24 + y + i) * 24 + xx + j) * 16 + c).load() * wt.index((b * k * k + i * k + j) * 16 + c).load()).reduce(Ops.ADD, i, j)
    return UOp.sink(o.index(((b * 8 + y) * 8 + xx) * 16 + c).store(v), name="blocked")
  ch, y, xx = UOp.range(32, 0), UOp.range(8, 1), UOp.range(16, 2)
  v = (x.index((ch * 24 + y + i) * 24 + xx + j).load() * wt.index(ch * k * k + i * k + j).load()).reduce(Ops.ADD, i, j)
  return UOp.sink(o.index((ch * 8 + y) * 16 + xx).store(v), name="nchw")


def test_a_window_sum_along_the_vector_keeps_independent_outputs():
  """A window sum whose vector is one output per lane (a blocked depthwise conv's 16 channels) adds its k*k taps in one
  chain per output: the innermost other output axis is unrolled by 4, four independent chains sharing each weight load.
  An NCHW window sum unrolled along its vector in part (a 5x5's rows slide along it, its rows stay a loop) is not."""
  assert Opt(OptOps.UNROLL, 2, 4) in heuristic_opts(window_sum(5, True), CPU)
  assert Opt(OptOps.UNROLL, 2, 4) in heuristic_opts(window_sum(3, True), CPU)  # the 3x3 window unrolled whole
  assert not any(o.op is OptOps.UNROLL and o.axis in (0, 1) for o in heuristic_opts(window_sum(5, False), CPU))

def stacked(pieces: int, rest: int = 4096, pad: bool = False) -> UOp:
  """out[e, i] = piece e at i: a stack of `pieces` rows as a chain of selects on e (what kiln.graph renders for a CAT of
  rows), piece k being x[i] * (k + 1); pad: WHERE(e < 1, x[i], 0) instead, a pad's zeros."""
  out, x = UOp.define_global(0, F32.ptr(pieces * rest)), UOp.define_global(1, F32.ptr(rest))
  e, i = UOp.range(pieces, 0), UOp.range(rest, 1)
  v = x.index(i).load()
  if pad: val = (e < 1).where(v, UOp.const(F32, 0.0))
  else:
    val = v * float(pieces)
    for k in reversed(range(pieces - 1)): val = (e < k + 1).where(v * float(k + 1), val)
  return UOp.sink(out.index(e * rest + i).store(val), name=f"stack{pieces}")


def test_an_axis_that_selects_among_stacked_pieces_unrolls_whole():
  """A small output axis that a chain of selects tests (a stack) is unrolled whole, so each copy's chain folds to its own
  piece, and the thread split moves to the next axis; a pad's select (one arm a constant) and a stack past SELECT_UNROLL
  copies keep their loop. (Values: kiln-graph's test_winograd runs stacks through it against numpy.)"""
  from kiln.codegen.choose.heuristic import SELECT_UNROLL
  opts = heuristic_opts(stacked(36), CPU)
  assert Opt(OptOps.UNROLL, 0, 36) in opts and not any(o.op is OptOps.THREAD and o.axis == 0 for o in opts), opts
  assert any(o.op is OptOps.THREAD and o.axis == 1 for o in opts), opts
  assert not any(o.op is OptOps.UNROLL for o in heuristic_opts(stacked(2, pad=True), CPU))
  assert not any(o.op is OptOps.UNROLL for o in heuristic_opts(stacked(SELECT_UNROLL + 1, rest=64), CPU))


def test_an_axis_that_selects_among_long_pieces_keeps_its_loop():
  """Two pieces of 24 rows each (GhostNet's depthwise conv over a ghost module's concatenation of 48 channels): unrolled
  whole, each of the 48 copies held the conv's whole tap body (an 11,000-line kernel, 2.2 s to render); in a loop each
  row selects between two loads. Pieces of at most SELECT_RUN rows on average still unroll."""
  from kiln.codegen.choose.heuristic import SELECT_RUN
  out, x = UOp.define_global(0, F32.ptr(48 * 256)), UOp.define_global(1, F32.ptr(256))
  e, i = UOp.range(48, 0), UOp.range(256, 1)
  v = x.index(i).load()
  two = UOp.sink(out.index(e * 256 + i).store((e < 24).where(v * 2.0, v * 3.0)), name="halves")
  assert not any(o.op is OptOps.UNROLL and o.axis == 0 for o in heuristic_opts(two, CPU))
  short = v * 7.0
  for k in reversed(range(1, 48 // SELECT_RUN)): short = (e < k * SELECT_RUN).where(v * float(k), short)  # 6 pieces of 8 rows
  assert Opt(OptOps.UNROLL, 0, 48) in heuristic_opts(UOp.sink(out.index(e * 256 + i).store(short), name="sixths"), CPU)


def test_an_unrolled_copy_of_a_stack_holds_only_its_own_piece():
  """expand.unrolled folds a select whose integer test the copy's constants decide, so each copy of a stack's axis holds
  its own piece (the others are not in its graph for the lowering to walk); a float compare of constants keeps its select."""
  from kiln.codegen.lowering.expand import unrolled
  v = UOp(Ops.DEFINE_VAR, dtypes.index, (), ("unroll.0", 0, 2))
  x = UOp.define_global(1, F32.ptr(16))
  p = [x.index(UOp.const(dtypes.index, k)).load() * float(k + 1) for k in range(3)]
  chain = (v < 1).where(p[0], (v < 2).where(p[1], p[2]))
  for k in range(3):
    got = unrolled(chain, {v: k})
    assert got is p[k] and not any(n.op is Ops.WHERE for n in got.toposort())
  test = UOp(Ops.CMPLT, dtypes.bool, (UOp.const(F32, 1.0), UOp.const(F32, 2.0)))  # raw: the builder would fold it
  f = UOp(Ops.WHERE, F32, (test, p[0] + v.cast(F32), p[1]))
  assert any(n.op is Ops.WHERE for n in unrolled(f, {v: 1}).toposort())
