"""The deterministic heuristic that picks a kernel's options from its prepared AST and the target (the machine model):
vector widths, register tiles, thread splits, GPU blocks. kiln.codegen.choose.choice.choose_opts asks it when no list is
given; an explicit list overrides it."""
from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.codegen.choose.axis_plan import _loads, kept_twins
from kiln.codegen.choose.base import GPU_WARP, Opt, OptOps, Target, affine_coeff, axis_bound, axis_size
from kiln.codegen.choose.layout_unrolls import transposed_reads, window_steps
from kiln.codegen.threads import chunk_count, per_core
from kiln.ir.analysis import free_ranges, free_ranges_of, reads_stored
from kiln.ir.dtype import dtypes
from kiln.ir.ops import Ops
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp


def _out_width(size: int | None, want: int, lanes: int, lane_bytes: int, overlap: bool) -> int:
  """An output axis may take the full width even when it does not divide the size: the lowering ends it with a whole
  vector shifted back over its neighbour (`overlap`: the kernel reads no buffer it writes) or peels the rest into a scalar
  tail (prepare.peel). An axis of at most one vector is one vector of its own size (a 256x512 @ 512x10 product: 130 us
  with 2-lane pieces, 30 us as one 10-lane vector; a depthwise conv's 9-wide rows were scalar loops; past one vector,
  LLVM's odd-sized vectors got slower, not faster). Past one vector, an axis takes one whole vector where that costs
  less (_cover_cost) than the widest width that divides it: 17 columns on AVX-512 (a vision transformer's 16 patches
  and its class token) were 17 scalar columns, 43 had no vectors at all, 20 were 4-lane pieces."""
  if size is None: return 1
  if size >= 2 * want: return want
  if 2 < size <= lanes and _pick_width(size, want) < size: return size
  w = _pick_width(size, want)
  if size > lanes and w < lanes and _cover_cost(size, lanes, lane_bytes, overlap) < _cover_cost(size, w, lane_bytes, overlap): return lanes
  return w


DATAPATH_BYTES = 32  # a vector step narrower than this costs as much as one this wide: no AVX2 or AVX-512 core's datapath is narrower


def _cover_cost(size: int, width: int, lane_bytes: int, overlap: bool) -> int:
  """What covering an axis of `size` elements with `width`-lane steps costs: each step its bytes, at least DATAPATH_BYTES,
  the last partial step a whole vector shifted back (overlap) or one scalar step per element left. A full vector
  costs twice a half one (Zen 4 runs 512-bit operations as two 256-bit halves): AVX-512's 24 columns stay three 8-lane
  steps (16 and an overlapped 16 measured 0.9x), 20 take 16 and an overlapped 16 (1.4x the five 4-lane steps)."""
  whole, rest = divmod(size, width)
  if rest and overlap: whole, rest = whole + 1, 0
  return whole * max(width * lane_bytes, DATAPATH_BYTES) + rest * DATAPATH_BYTES


def _pick_width(size: int | None, lanes: int) -> int:
  if size is None: return 1
  w = lanes
  while w > 1 and size % w: w //= 2
  return w


# an output axis of fewer units than this shares them unevenly over a few cores (3 over 2: one does two), so the threads
# split another with at least twice as many (_thread_axis); a thread count this does not know may be any
FEW_UNITS = 8
# a packed product whose threads split its rows: each chunk packs every panel of its columns again (a panel is packed per
# column tile, for the rows of one chunk), so the split takes one chunk a core, each packing each panel once, or more
# chunks only where each still holds PACKED_ROWS rows, a whole number of chunks a core (3 chunks on 2 cores: one core
# computes two while the other waits; SqueezeNet's 1000-row classifier ran a third slower). W (256x1024) @ X (1024x196)
# on 2 cores: 32 chunks 0.94 ms, 4 chunks 0.54 ms, 2 chunks 0.47 ms. 0: as many chunks as any split gets
PACKED_ROWS = 256
SPLIT_REDUCED_ONLY = True  # threads split only output axes every reduction varies over, where any (_reduced_along); False: any
MIN_ACCUMULATORS = 12  # a register tile's accumulators that keep enough multiply-adds in flight (_tile_rows)


def _tile_rows(registers: int, vecs: int, size: int | None, overlap: bool) -> int:
  """Rows of a matmul register tile: rows*vecs accumulators, vecs loads of B and one broadcast of A must fit the vector
  registers, or the inner loop spills (AVX2's 16 with 8 rows x 2 vectors: 77-121 stack references, half the GFLOP/s of
  4 rows). At most 8 (the most ever measured to pay). The most rows that fit (16 registers: 6 rows of 2 vectors, 12
  accumulators, enough multiply-adds in flight to cover FMA latency: 960 and 1536 went from 0.85-0.88x to 0.99-1.02x
  OpenBLAS's Haswell kernel, 8 accumulators stall; 32 registers: 8). When the kernel reads no buffer it writes (`overlap`),
  the lowering ends a row axis the tile does not divide with a tile shifted back over its neighbour (prepare.peel), so
  any size of at least one tile takes them, as the count of rows, from the most that fit down to the fewest that keep
  MIN_ACCUMULATORS, whose tiles compute the fewest rows, each tile's loads of B counted as one row more (a ViT's 2 x 18
  tokens: 6 tiles of 6, not 5 of 8 of which the last recomputes 4 rows: 68 -> 73 GFLOP/s); otherwise a count that
  divides the axis: the most that fit, else a power of two. An axis of no more rows than fit is one tile of them all
  (a decode step's attention context, 3 queries a key head: one row at a time ran 3 chains of multiply-adds over the
  cache one after another, each bound by their latency: 6.8 -> 2.9 us a layer at 300 cached positions)."""
  vecs = max(vecs, 1)
  rows = min(8, max(1, (registers - vecs - 1) // vecs))
  if size is not None and 2 <= size <= rows: return size
  if size is not None and overlap and size > rows:
    fewest = min(rows, max(1, -(-MIN_ACCUMULATORS // vecs)))
    return min(range(fewest, rows + 1), key=lambda r: (-(-size // r) * (r + 1), -r))
  if size is not None and size % rows == 0: return rows
  return _pick_width(size, 1 << (rows.bit_length() - 1))


_POLY_OPS = frozenset({Ops.EXP2, Ops.LOG2, Ops.ERF, Ops.TANH})  # llvm_math.BODIES (a test keeps them equal; render imports choose)


def heuristic_opts(ast: UOp, target: Target, reassociate: bool = False) -> list[Opt]:
  """Deterministic choices: vector width on the contiguous axis, register tiling for matmul-like kernels, a thread split
  where each thread gets enough work. Kernels with several stores of different loops keep it simple. reassociate: the
  caller takes float sums in another order (kiln.graph's reductions have none), so a reduction whose loads the output's
  lanes would gather is vectorised along its own axis instead (_contiguous_reduce); by default a row reduction keeps
  one lane per output, summing in the reference's order."""
  stores = [s for s in ast.src if s.op is Ops.STORE]
  if len(stores) != 1: return []
  st = stores[0]
  out_axes = sorted(free_ranges(st), key=lambda r: r.arg[0])
  reduces = [u for u in st.toposort() if u.op is Ops.REDUCE]
  red_axes = sorted({r for red in reduces for r in red.src[1:]}, key=lambda r: r.arg[0])
  if target.vector_bytes == 0: return _gpu_opts(st, out_axes, red_axes, reduces, target)
  opts: list[Opt] = []
  dt = st.src[1].dtype
  lanes = max(1, target.vector_bytes // dt.itemsize) if dt.kind != "p" else 1
  idx = st.src[0].src[1]
  inner = out_axes[-1] if out_axes else None
  vec_axis: UOp | None = None
  # a matmul-like kernel whose columns are symbolic gets no register tile (no vector runs on a symbolic axis): it takes the
  # choices of any other reduction (its dot products along the reduce, or lanes on another output axis, _read_along)
  mm = _matmul_like(st, out_axes, red_axes, reduces) and inner is not None and axis_size(inner) is not None
  # two vectors for a register tile, and for a body with an inline polynomial (exp, erf, tanh...): each lane's chain is
  # latency-bound, so a second independent vector fills the pipes (4M-float exact GELU on AVX2: 1.19x with 16 lanes)
  vecs = 2 if mm or any(u.op in _POLY_OPS for u in st.toposort()) else 1
  overlap = not reads_stored(ast)
  row = _contiguous_reduce(reduces, inner, lanes) if reassociate and not mm and inner is not None else None
  if row is not None: opts.append(row)
  elif inner is not None and affine_coeff(idx, inner) == 1:
    lane_axis = inner if mm or (other := _read_along(reduces, out_axes, inner, lanes)) is None else other
    # a symbolic axis takes one vector of lanes: prepare.peel runs whole vectors, then a scalar tail, each store copied for
    # it; a REDUCE that does not vary along the axis (a softmax's max and sum under its outputs) would be lowered twice
    if (size := axis_size(lane_axis)) is None: w = lanes if all(lane_axis in free_ranges(red) for red in reduces) else 1
    else: w = _out_width(size, lanes * vecs, lanes, dt.itemsize, overlap)
    if w > 1:
      opts.append(Opt(OptOps.UPCAST, lane_axis.arg[0], w))
      vec_axis = lane_axis
  if vec_axis is not None and mm:
    # register tile of rows x two vectors, the B panel packed per column tile (no cache-set conflicts on power-of-two
    # strides), columns outermost so each thread packs its own panels, fused multiply-adds
    outer, k = matmul_rows(st), red_axes[0]
    assert outer is not None
    rows = axis_size(outer)
    # symbolic rows (a dynamic export's sequence) take whole tiles and a tail of rows (prepare.peel), where the columns
    # need no tail of their own (only one axis gets one) and the rows' bound holds several tiles: a dynamic batch of a
    # few images ran all in the tail, each row again over the panels (mobilenet_v3_large at batch 3: 2.5 -> 3.2 ms)
    u = _tile_rows(target.vector_registers, w // lanes, rows, overlap) if rows is not None else \
      _tile_rows(target.vector_registers, w // lanes, 1 << 20, False) if (axis_size(vec_axis) or 1) % w == 0 else 1
    if rows is None and int(outer.src[0].vmax) < 4 * u: u = 1
    if u > 1: opts.append(Opt(OptOps.UNROLL, outer.arg[0], u))
    if (ku := window_steps(st, outer, vec_axis, k) or _pick_width(axis_size(k), 2)) > 1: opts.append(Opt(OptOps.UNROLL, k.arg[0], ku))
    opts.append(Opt(OptOps.OUTER, vec_axis.arg[0], 1))
    ksize, rows = axis_size(k), axis_size(outer)
    # a panel read by one row tile only (an RNN step's 8 rows of H @ R^T) is copied for nothing: each element once either way
    # (the 200-step bidirectional LSTM's gate kernels packed 512 KB of R^T a step: 12 -> 10 ms a run)
    reused = rows is None or rows > max(u, 1)
    if reused and ksize is not None and ksize * w * dt.itemsize * max(target.threads, 1) <= (8 << 20): opts.append(Opt(OptOps.PACK, k.arg[0], 1))
    if dt.is_float and dt.itemsize >= 4: opts.append(Opt(OptOps.FMA, k.arg[0], 1))
    out_axes = [vec_axis] + [a for a in out_axes if a is not vec_axis]  # thread the outermost loop
    # ... unless a batch axis (neither rows nor columns: a conv's images, attention's heads) has more units than the
    # column tiles: chunks of it pack no panel twice either, and there are more of them to share (a 64-column conv
    # over 32 images had 2 chunks, static halves in effect)
    batch = max((a for a in out_axes if a is not vec_axis and a is not outer and axis_size(a)), key=lambda a: axis_size(a) or 0, default=None)
    if batch is not None and (axis_size(batch) or 0) > (axis_size(vec_axis) or 0) // w:
      out_axes = [batch] + [a for a in out_axes if a is not batch]
  if vec_axis is not None and not mm: opts += _nested_upcasts(reduces, vec_axis, target)
  # no lanes on a symbolic inner axis whose rows' reductions do not vary along it (a softmax over a dynamic export's
  # keys): those reductions still take lanes of their own
  elif row is None and vec_axis is None and not mm and inner is not None and axis_size(inner) is None:
    opts += _nested_upcasts(reduces, None, target)
  if vec_axis is not None and not mm and not reduces: opts += transposed_reads(st, out_axes, vec_axis, w, lanes)
  if not mm:
    keeps = _keeps(st, reduces, vec_axis)
    opts += keeps + _interleaved_rows(reduces, keeps, out_axes, vec_axis, lanes)
  if not mm and out_axes: opts += _small_windows(red_axes, {o.axis for o in opts}, reduces, vec_axis)
  if not mm and INDEPENDENT_OUTPUTS: opts += _independent_outputs(reduces, out_axes, vec_axis, opts)
  selects = _selected_axes(st, out_axes, {o.axis for o in opts}) if not mm else []
  opts += selects
  if vec_axis is None and not out_axes and len(red_axes) == 1 and len(reduces) == 1:
    r = red_axes[0]
    w = 1
    # four vectors of lanes: four independent accumulators keep enough loads in flight to stream from memory
    if all(affine_coeff(ld.src[0].src[1], r) == 1 for ld in _loads(reduces[0].src[0])) and (w := _pick_width(axis_size(r), lanes * 4)) > 1:
      opts.append(Opt(OptOps.UPCAST, r.arg[0], w))
    size = axis_size(r)
    # chunks, not threads: the split is the same for any thread count, so the partials fold to the same bits
    if _may_split(target) and size is not None and size >= 2 * _split_work(target, lanes, False, w > 1) and size // w >= 2:
      opts.append(Opt(OptOps.THREAD, r.arg[0], chunk_count(size, size // w, target.vector_bytes, target.cores)))
  if vec_axis is not None and axis_size(vec_axis) is None:  # only one axis gets a tail (prepare.peel): others' splits divide
    sizes = {r.arg[0]: axis_size(r) for r in out_axes}
    opts = [o for o in opts if not (o.op in (OptOps.UPCAST, OptOps.UNROLL) and (n := sizes.get(o.axis)) is not None and n % o.amount)]
  # threads: split the outermost output axis into chunks the threads claim when the whole kernel is big enough
  # (an axis unrolled whole to fold its selects has one unit: the next one is split)
  if _may_split(target) and (threaded := _reduced_along([a for a in out_axes if all(o.axis != a.arg[0] for o in selects)], st, reduces)):
    work = _work(out_axes, reduces)
    first = _thread_axis(threaded, opts)
    units = _units(first, opts)
    tiled = vec_axis is not None and mm
    if work >= 2 * _split_work(target, lanes, tiled, vec_axis is not None) and (units is None or units >= 2):
      n = chunk_count(work, units, target.vector_bytes, target.cores, fused=tiled)
      if PACKED_ROWS and tiled and first is matmul_rows(st) and any(o.op is OptOps.PACK for o in opts):
        n = max(2, min(n, per_core(max(target.cores, (axis_size(first) or 0) // PACKED_ROWS), target.cores)))
      opts.append(Opt(OptOps.THREAD, first.arg[0], n))
  return opts


def _split_work(target: Target, lanes: int, tiled: bool, vectorised: bool) -> int:
  """Element-ops a thread's share of a split kernel must exceed: target.min_work_per_thread core cycles, times what a
  core does in one: a register-tiled product two vectors of multiply-adds, other vectorised code about a quarter of a
  vector (the loads, stores and index arithmetic around each lane op), scalar code one. A kernel under twice that runs
  whole: handing half of it to a worker would cost about what it saves."""
  return target.min_work_per_thread * (2 * lanes if tiled else max(lanes // 4, 1) if vectorised else 1)


def _may_split(target: Target) -> bool: return max(target.threads, target.cores) > 1  # one core: chunks would only cost claims


def _units(a: UOp, opts: list[Opt]) -> int | None:
  """The units a thread split of output axis a hands out: its size over its last UPCAST's or UNROLL's amount (None: symbolic)."""
  if (n := axis_size(a)) is None: return None
  steps = [o.amount for o in opts if o.axis == a.arg[0] and o.op in (OptOps.UPCAST, OptOps.UNROLL)]
  return n // (steps[-1] if steps else 1)


def _reduced_along(axes: list[UOp], st: UOp, reduces: list[UOp]) -> list[UOp]:
  """The output axes every reduction varies over, where there are any: a chunk of an axis a reduction does not vary over
  computes it again (RAFT's instance norms split along each map's rows summed the map in each of 16 chunks: 6-7 ms)."""
  free = free_ranges_of(st.toposort()) if reduces and SPLIT_REDUCED_ONLY else {}
  return ([a for a in axes if all(a in free[r] for r in reduces)] or axes) if free else axes


def _thread_axis(threaded: list[UOp], opts: list[Opt]) -> UOp:
  """The output axis the threads split: the first, unless its units are fewer than FEW_UNITS and another's are at least
  twice as many; then the one with the most. A conv's blocked product over a 14x14 map had 3 blocks of 32 output
  channels to share (2 of 3 on one of two cores) where its 196 positions are 24 row tiles."""
  first = threaded[0]
  if (u := _units(first, opts)) is None or u >= FEW_UNITS: return first
  # a symbolic axis counts as SYMBOLIC_GUESS units (a dynamic export's rows: the channels-last product of an image stem
  # over a symbolic batch ran on one thread, its 32 output channels one unit)
  units = lambda a: g if (g := _units(a, opts)) is not None else SYMBOLIC_GUESS
  most = max(threaded, key=units)
  return most if units(most) >= 2 * max(u, 1) else first


def _read_along(reduces: list[UOp], out_axes: list[UOp], inner: UOp, lanes: int) -> UOp | None:
  """Another output axis for the lanes, where every load in a reduction's body gathers along the store's contiguous
  axis (`inner`) and reads contiguously along that one: its loads run once per reduction step, the store once per
  output, so lanes that scatter the store beat lanes that gather every load (PVTv2's and SegFormer's depthwise conv
  over (C, H*W) written as (H*W, C) for the next linear layer: 9 taps gathered with stride H*W, 789 -> 190 us on
  AVX-512). None where any reading load would gather either way, or no such axis has a vector's worth of elements."""
  lds = [ld for red in reduces for ld in _loads(red.src[0]) if len(ld.src[0].src) >= 2]
  along = [ld for ld in lds if inner in ld.src[0].src[1].toposort()]
  if not along or any(affine_coeff(ld.src[0].src[1], inner) in (0, 1) for ld in along): return None
  for a in reversed(out_axes):
    if a is inner or (n := axis_size(a)) is None or n < lanes: continue
    reads = [ld for ld in lds if a in ld.src[0].src[1].toposort()]
    if reads and all(affine_coeff(ld.src[0].src[1], a) == 1 for ld in reads): return a
  return None


def _contiguous_reduce(reduces: list[UOp], inner: UOp, lanes: int) -> Opt | None:
  """The UPCAST of a reduction's own axis, where vectors along the output's inner axis would gather every load (lanes a
  row apart: a global pool's channels, a row sum) and the reduce axis reads each load's row contiguously: whole-vector
  loads into up to four vectors of accumulators, their lanes folded once per output (another order of additions).
  CNN bench global average pool, 32x128 maps of 64, hot on 2-core Zen 4: 50 -> 20 us. Of several reduce axes (a mean
  over rows and columns, as torch's dynamo export writes an adaptive pool) the innermost: a SiLU's pool over 32x32 maps
  of 32 channels took 110 us gathering across channels. Where the inner axis is symbolic (no vectors along it at all), a
  load that does not vary along it may take part too: a decode step's attention scores, each a dot product of a query
  row with a cached key row, were scalar chains of multiply-adds over the head's 64 values."""
  if len(reduces) != 1: return None
  r = max(reduces[0].src[1:], key=lambda a: a.arg[0])  # of several (a pool over rows and columns), the innermost
  lds = _loads(reduces[0].src[0])
  if not lds or (size := axis_size(r)) is None or size < lanes: return None
  along = (1,) if axis_size(inner) is None else (0, 1)  # coefficients on the inner axis a load may not have
  if any(len(ld.src[0].src) != 2 or affine_coeff(ld.src[0].src[1], inner) in along or affine_coeff(ld.src[0].src[1], r) != 1 for ld in lds):
    return None
  if all(affine_coeff(ld.src[0].src[1], inner) == 0 for ld in lds): return None  # nothing would be gathered
  return Opt(OptOps.UPCAST, r.arg[0], next(m * lanes for m in (4, 2, 1) if size >= m * lanes and size % (m * lanes) < lanes))


def reassociable(ast: UOp, target: Target) -> bool:
  """Whether heuristic_opts(ast, target, reassociate=True) can differ from the default for a prepared AST: a CPU kernel of
  one store whose reduction the output's lanes would gather (_contiguous_reduce's own test, no heuristic run)."""
  stores = [s for s in ast.src if s.op is Ops.STORE]
  if target.vector_bytes == 0 or len(stores) != 1 or (dt := stores[0].src[1].dtype).kind == "p": return False
  out_axes = sorted(free_ranges(stores[0]), key=lambda r: r.arg[0])
  reduces = [u for u in stores[0].toposort() if u.op is Ops.REDUCE]
  return bool(out_axes) and _contiguous_reduce(reduces, out_axes[-1], max(1, target.vector_bytes // dt.itemsize)) is not None


def reassociated_opts(ast: UOp, target: Target) -> list[Opt] | None:
  """heuristic_opts(ast, target, reassociate=True) for a prepared AST where it differs from the default, else None."""
  if not reassociable(ast, target): return None
  opts = heuristic_opts(ast, target, reassociate=True)
  return opts if opts != heuristic_opts(ast, target) else None


def _work_terms(out_axes: list[UOp], reduces: list[UOp]) -> list[list[UOp]]:
  """What a kernel's element-ops count, as the axes whose sizes multiply in each term: one op per output element, and
  each REDUCE's trip count over the output axes it varies along (a row reduce runs once a row, a matmul's once an
  element)."""
  return [list(out_axes)] + [sorted(free_ranges(red) | set(red.src[1:]), key=lambda r: r.arg[0]) for red in reduces]


def _work(out_axes: list[UOp], reduces: list[UOp]) -> int:
  """Element-ops of a kernel (_work_terms), a symbolic axis counted as SYMBOLIC_GUESS."""
  return sum(math.prod(axis_size(r) or SYMBOLIC_GUESS for r in term) for term in _work_terms(out_axes, reduces))


SYMBOLIC_GUESS = 1024  # what the split choice takes a symbolic axis's size for; split_rule tells the runtime the truth


def _work_expr(out_axes: list[UOp], reduces: list[UOp]) -> UOp:
  """Element-ops of a kernel (_work_terms) as an int64 expression of its variables: each symbolic axis its own size."""
  total = UOp.const(dtypes.int64, 0)
  for term in _work_terms(out_axes, reduces):
    n = UOp.const(dtypes.int64, 1)
    for r in term: n = n * (UOp.const(dtypes.int64, s) if (s := axis_size(r)) is not None else r.src[0].cast(dtypes.int64))
    total = total + n
  return simplify(total)


def split_rule(ast: UOp, target: Target, opts: Sequence[Opt]) -> tuple[UOp, int] | None:
  """For a CPU kernel split into chunks (a THREAD among its opts) whose work depends on its variables: (its element-ops
  as an expression of them, the element-ops under which the runtime runs it on the calling thread alone). The split was
  chosen with each symbolic axis taken as SYMBOLIC_GUESS; at run time a dynamic export's batch of 1 or a decode step's
  few cached positions make many such kernels too small to hand part to another core, so the runtime runs those alone
  (the chunks are the same, one thread claims them all). The threshold is one thread's least share (_split_work), not
  the twice that a compile-time split needs: there, splitting also costs the code its chunk loop and partials; here the
  code is the same either way and only the hand-off is saved (with twice the share, dynamic transformer exports at a
  few tokens ran slower than never going alone). A register-tiled product is judged at the tile's rate only where its
  panels are reused (_reused_tile). None: not split, or its work is fixed."""
  stores = [s for s in ast.src if s.op is Ops.STORE]
  if target.vector_bytes == 0 or len(stores) != 1 or not any(o.op is OptOps.THREAD for o in opts): return None
  st = stores[0]
  out_axes = sorted(free_ranges(st), key=lambda r: r.arg[0])
  reduces = [u for u in st.toposort() if u.op is Ops.REDUCE]
  if all(axis_size(r) is not None for r in [*out_axes, *(a for red in reduces for a in red.src[1:])]): return None
  dt = st.src[1].dtype
  lanes = max(1, target.vector_bytes // dt.itemsize) if dt.kind != "p" else 1
  outs = {a.arg[0] for a in out_axes}
  if (work := _work_expr(out_axes, reduces)).op is Ops.CONST: return None  # a symbolic axis beside an empty one: no work
  vectorised = any(o.op is OptOps.UPCAST and o.axis in outs for o in opts)
  return work, _split_work(target, lanes, _reused_tile(st, opts), vectorised)


def _reused_tile(st: UOp, opts: Sequence[Opt]) -> bool:
  """Whether a register-tiled product's element-ops run at the tile's rate: its panels are reused by more rows than one
  tile holds. A product of a few fixed rows, all in one tile (a decode step's attention context: 3 queries a key head
  over the cached positions), loads each panel element for those rows alone and streams like any vectorised kernel."""
  if not any(o.op is OptOps.OUTER for o in opts): return False
  if (rows := matmul_rows(st)) is None or (n := axis_size(rows)) is None: return True
  tile = next((o.amount for o in opts if o.op is OptOps.UNROLL and o.axis == rows.arg[0]), 1)
  return n > tile


def _nested_upcasts(reduces: list[UOp], vec_axis: UOp | None, target: Target) -> list[Opt]:
  """A row reduce under the vectorised output axis (softmax's max and sum, a layernorm's mean and variance) runs once per
  row, not per lane: without its own UPCAST it is a scalar loop. Vectorise its axis when it reads its row contiguously:
  up to four vectors of accumulators (independent adds keep the loads streaming), folded in a fixed order. A REDUCE that
  varies along the output's lanes (its accumulator is a vector of those already), or holds a REDUCE over its own axis,
  keeps its loop."""
  lane_dep = {r for red in reduces if vec_axis is not None and vec_axis in free_ranges(red) for r in red.src[1:]}
  out: list[Opt] = []
  for red in reduces:
    if len(red.src) != 2 or (r := red.src[1]) in lane_dep or any(o.axis == r.arg[0] for o in out): continue
    body = red.src[0]
    if any(n.op is Ops.REDUCE and r in free_ranges(n) for n in body.toposort()): continue
    uses = [ld for ld in _loads(body) if r in ld.src[0].toposort()]
    if not uses or any(len(ld.src[0].src) != 2 or affine_coeff(ld.src[0].src[1], r) != 1 for ld in uses): continue
    lanes = max(1, target.vector_bytes // red.dtype.itemsize)
    # the widest that leaves a scalar tail under one vector (a row of 127 floats: 15 vectors and 7 scalars, not 3 and 31)
    # (two vectors at most for a body with an inline polynomial: four chains of exp spill AVX2's 16 registers)
    most = (2, 1) if any(u.op in _POLY_OPS for u in body.toposort()) else (4, 2, 1)
    # a symbolic axis: one vector, then the scalar tail (reduce_lowering), so a short row is mostly whole vectors
    size = axis_size(r)
    w = lanes if size is None else next((m * lanes for m in most if size >= m * lanes and size % (m * lanes) < lanes), 1)
    if w > 1: out.append(Opt(OptOps.UPCAST, r.arg[0], min(w, 64)))
  return out


SMALL_WINDOW = 4  # reduce axes of at most this many trips (a 2x2 pool, a 3x3 window sum) are unrolled whole


def _small_windows(red_axes: list[UOp], taken: set[int], reduces: list[UOp], vec_axis: UOp | None) -> list[Opt]:
  """A reduce loop of 2-4 trips (a pool's window rows and columns) unrolled whole, up to 16 copies in all: its loop
  branches cost as much as its body (the CNN bench's 2x2 max pools with batch norm: 116 -> 100 us and 89 -> 81 us, hot,
  2-core Zen 4), and the order of operations stays the same. A window row that slides along the output's vector (a load
  moves with it as with the vector's lanes: an NCHW depthwise conv's 5x5 and 7x7 taps) is unrolled up to
  SLIDING_WINDOW trips: a 5x5 depthwise conv over 144 maps of 16x16, 120-150 -> 82-87 us (1 thread). A window whose
  taps step a whole vector apart (the blocked layout's) measured slower unrolled, and keeps its loop."""
  sliding = _sliding_axis(red_axes, reduces, vec_axis)
  out: list[Opt] = []
  copies = 1
  for r in ([sliding] if sliding is not None else []) + [r for r in red_axes if r is not sliding]:
    limit = SLIDING_WINDOW if r is sliding else SMALL_WINDOW
    if r.arg[0] in taken or (size := axis_size(r)) is None or not 1 < size <= limit or copies * size > 16: continue
    out.append(Opt(OptOps.UNROLL, r.arg[0], size))
    copies *= size
  return out


SLIDING_WINDOW = 8  # a window row sliding along the vector unrolled whole up to this many trips (_small_windows)

# a vectorised sum of many steps keeps this many outputs' accumulators at once (_independent_outputs); 0: one
INDEPENDENT_OUTPUTS = 4


def _independent_outputs(reduces: list[UOp], out_axes: list[UOp], vec_axis: UOp | None, opts: list[Opt]) -> list[Opt]:
  """UNROLL by INDEPENDENT_OUTPUTS (else 2, else 3: the first that divides it) the innermost other output axis of a REDUCE
  that varies along the vector, where the REDUCE takes at least as many steps: each step's add waits for the last one's
  (a chain as long as the window, its latency, not the pipes, the limit: a blocked depthwise conv's 5x5 window, a vector
  of 16 channels per output, ran at a sixth of the multiply-adds' rate), and the copies' chains are independent; a
  weight load the copies share is loaded once. A 5x5 window in the blocked layout 32 -> 20 us, an NCHW 3x3 over 32x32
  maps 90 -> 57 us. Not where a copy's body holds an inline polynomial (registers), nor where the window is unrolled in
  part (an NCHW row unrolled along the vector, its rows a loop: 74 -> 87-93 us for a 5x5 over 16x16 maps). An axis of 9
  (ConvMixer's 9x9 maps) had no copies: by 3, its blocked 7x7 depthwise conv 28 -> 17 us."""
  if vec_axis is None or len(reduces) != 1 or (red := reduces[0]).op is not Ops.REDUCE or vec_axis not in free_ranges(red): return []
  if any(u.op in _POLY_OPS for u in red.src[0].toposort()): return []
  taken = {o.axis for o in opts}
  unrolled = {r.arg[0] in taken for r in red.src[1:] if (axis_size(r) or 0) > 1}
  if len(unrolled) > 1: return []  # some of the window unrolled, some a loop
  steps = 1
  for r in red.src[1:]: steps *= axis_size(r) or 1024
  if steps < INDEPENDENT_OUTPUTS: return []
  for a in reversed(out_axes):
    if a is vec_axis or a not in free_ranges(red): continue
    if a.arg[0] in taken or (n := axis_size(a)) is None: return []
    # 3 only where 2 does not divide: by 3 rather than 2, a decode step's block dot products (18 blocks a row) ran 1.5x slower
    u = next((u for u in (INDEPENDENT_OUTPUTS, 2, 3) if u > 1 and n % u == 0), 0)
    return [Opt(OptOps.UNROLL, a.arg[0], u)] if u else []
  return []


def _sliding_axis(red_axes: list[UOp], reduces: list[UOp], vec_axis: UOp | None) -> UOp | None:
  """The innermost reduce axis when a load moves one element per trip of it as it does per lane of the vector (a window
  sliding along the row the vector covers; the weight, the same for every lane, moves with the tap alone)."""
  if vec_axis is None or not red_axes or len(reduces) != 1: return None
  r = red_axes[-1]
  ok = any(affine_coeff(ld.src[0].src[1], r) == 1 and affine_coeff(ld.src[0].src[1], vec_axis) == 1 for ld in _loads(reduces[0].src[0]))
  return r if ok else None


SELECT_UNROLL = 64  # the most copies an output axis that selects among pieces is unrolled into (_selected_axes)
SELECT_RUN = 8  # ... and only where its pieces are at most this long on average


def _selected_axes(st: UOp, out_axes: list[UOp], taken: set[int]) -> list[Opt]:
  """UNROLL whole a small output axis that selects among pieces (a concatenation renders as a chain of selects on its
  index: WHERE(axis < offset, piece, rest)), up to SELECT_UNROLL copies in all: in each copy the index is a constant, the
  chain folds to its own piece, and copies share what their pieces share. A Winograd transform stacks 36 sums of a
  window's elements: with the axis in a loop every element ran all 36 (3.1 ms), unrolled each runs its own (0.15 ms,
  against 0.30 ms for the transform as a dense 36 x 36 product; 32 maps of 16x16 at batch 32, 2-core Zen 4). Only where the
  pieces are short (SELECT_RUN elements on average): each copy holds the kernel's whole body, and GhostNet's depthwise
  conv over two concatenated 24-channel halves unrolled 48 copies of its taps (11,000 IR lines, 2.2 s to render), where
  in a loop each element selects between two loads."""
  cuts: dict[UOp, set[int]] = {}
  for n in st.toposort():
    if n.op is not Ops.WHERE or (c := n.src[0]).op is not Ops.CMPLT or c.src[1].op is not Ops.CONST: continue
    if any(a.op is Ops.CONST for a in n.src[1:]): continue  # a pad's zeros: a select per element is all it costs
    if (a := c.src[0]) in out_axes and a.arg[0] not in taken: cuts.setdefault(a, set()).add(c.src[1].arg)
  out: list[Opt] = []
  copies = 1
  for a in sorted(cuts, key=lambda r: r.arg[0]):
    if (size := axis_size(a)) is None or copies * size > SELECT_UNROLL: continue
    if size > SELECT_RUN * (len(cuts[a]) + 1): continue  # long pieces: a select per element costs less than the copies
    out.append(Opt(OptOps.UNROLL, a.arg[0], size))
    copies *= size
  return out


def _keeps(st: UOp, reduces: list[UOp], vec_axis: UOp | None) -> list[Opt]:
  """KEEP where a row REDUCE's body holds an inline polynomial the store computes again (softmax: exp once per element,
  not twice; 8192 rows of 128 on AVX2: 1.10 -> 0.60-0.67 ms, 1024 of 1024: 0.85 -> 0.61-0.71 ms). A body without one is
  cheaper to recompute than to store and reload; a REDUCE that varies along the output's lanes would need a row per lane."""
  out: list[Opt] = []
  for red in reduces:
    if len(red.src) != 2 or (vec_axis is not None and vec_axis in free_ranges(red)): continue
    if not any(u.op in _POLY_OPS for u in red.src[0].toposort()): continue
    if kept_twins(st, red) and all(o.axis != red.src[1].arg[0] for o in out): out.append(Opt(OptOps.KEEP, red.src[1].arg[0], 1))
  return out


KEEP_ROW_VECTORS = 16  # kept rows of at most this many vectors interleave in pairs (_interleaved_rows)


def _interleaved_rows(reduces: list[UOp], keeps: list[Opt], out_axes: list[UOp], vec_axis: UOp | None, lanes: int) -> list[Opt]:
  """UNROLL by 2 the innermost output axis a kept row REDUCE varies along (an even count of rows), where the row is at most
  KEEP_ROW_VECTORS vectors: a short row is a chain of dependent steps (fold the max, exp, fold the sum, divide) that
  leaves the pipes idle, and two rows' chains fill them (each copy keeps its own row). Softmax on 2-core Zen 4, AVX-512:
  rows of 64 1.17x, of 128 1.09-1.21x, of 256 1.07x, of 512 0.99x (so none there); AVX2: rows of 64 1.06x, of 128 1.02x.
  Layernorm keeps nothing (its body is cheaper to recompute) and gained nothing from it."""
  for k in keeps:
    red = next(r for r in reduces if len(r.src) == 2 and r.src[1].arg[0] == k.axis)
    if (size := axis_size(red.src[1])) is None or size > KEEP_ROW_VECTORS * lanes: continue
    rows = [a for a in out_axes if a is not vec_axis and a in free_ranges(red) and (n := axis_size(a)) is not None and n % 2 == 0]
    if rows: return [Opt(OptOps.UNROLL, rows[-1].arg[0], 2)]
  return []


def _matmul_like(st: UOp, out_axes: list[UOp], red_axes: list[UOp], reduces: list[UOp]) -> bool: return matmul_rows(st) is not None


def operand_load(u: UOp) -> UOp | None:
  """u's LOAD when u is a load, or a load under a bounds test that gives a constant outside (a padded conv's input:
  WHERE(valid, LOAD(buffer, index, gate valid), 0), or WHERE(out, 0, LOAD(...)) where the only test left is one bound, as
  simplified: a strided 1-d conv whose windows pass only the start, Whisper's second conv); else None."""
  if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX: return u
  if u.op is Ops.WHERE:
    for ld, c in ((u.src[1], u.src[2]), (u.src[2], u.src[1])):
      if ld.op is Ops.LOAD and ld.src[0].op is Ops.INDEX and c.op is Ops.CONST: return ld
  return None


def matmul_rows(st: UOp) -> UOp | None:
  """The row axis of a matmul-like store: one ADD reduce over one axis of a product of two loads (or loads under a bounds
  test, `operand_load`), the innermost output axis
  read by one load only and a row axis by the other only. The row axis is the innermost such output axis, not
  necessarily the one before the columns: attention's context ctx[b, i, h, e] = sum_j p[b, h, i, j] v[b, j, h, e] has its
  rows in i, with the heads h (read by both) between (register-tiled: 17 -> 5x GFLOP/s). None when not matmul-like."""
  out_axes = sorted(free_ranges(st), key=lambda r: r.arg[0])
  reduces = [u for u in st.toposort() if u.op is Ops.REDUCE]
  if len(out_axes) < 2 or len(reduces) != 1 or reduces[0].arg is not Ops.ADD or len(reduces[0].src) != 2: return None
  v = reduces[0].src[0]
  if v.op is not Ops.MUL or not all(operand_load(s) is not None for s in v.src): return None
  a, b = (set(s.toposort()) for s in v.src)
  cols = out_axes[-1]
  if (cols in a) == (cols in b): return None
  rows_load = b if cols in a else a  # the rows come from the load the columns do not
  other = a if rows_load is b else b
  return next((r for r in reversed(out_axes[:-1]) if r in rows_load and r not in other), None)


# GPU reductions: how the heuristic cuts them (render/cuda_c.py's kiln_block_* combine a block's partials)
GPU_MIN_GROUP_ROW = 32  # a row shorter than a warp keeps one thread per output (LOCAL): a tree would idle most lanes
GPU_PER_THREAD = 4  # a row's block doubles while each thread still folds at least this many elements before the tree
GPU_FULL_PER_THREAD = 16  # a full reduction's threads fold at least this many elements each before the tree ...
GPU_MAX_BLOCKS = 1024  # ... over at most this many blocks (the last block folds their partials: 4 per thread at 256)


def _gpu_opts(st: UOp, out_axes: list[UOp], red_axes: list[UOp], reduces: list[UOp], target: Target) -> list[Opt]:
  if out_axes and (rows := _gpu_rows(st, out_axes, reduces, target)) is not None: return rows
  if out_axes:
    inner = out_axes[-1]
    size = axis_size(inner)
    loc = min(target.local_size, size) if size is not None else target.local_size
    return [Opt(OptOps.LOCAL, inner.arg[0], max(loc, 1))]
  # a full reduction: the block's threads share each REDUCE's axis (a full variance's mean and sum of squares: two trees,
  # one block); REDUCEs over several axes, or nested along another's axis, keep their loops
  if not reduces or any(len(red.src) != 2 or free_ranges(red) for red in reduces) or len(red_axes) != len(reduces): return []
  if max(axis_size(r) or 1 << 20 for r in red_axes) < 64: return []
  g = target.local_size
  opts = [Opt(OptOps.GROUP, r.arg[0], g) for r in red_axes]
  # two stages: many blocks each fold a slice (the whole GPU, not one SM), the last to finish folds their partials
  if len(reduces) == 1 and (size := axis_size(red_axes[0])) is not None and (nb := min(GPU_MAX_BLOCKS, size // (g * GPU_FULL_PER_THREAD))) >= 2:
    opts.append(Opt(OptOps.BLOCKS, red_axes[0].arg[0], nb))
  return opts


def _gpu_rows(st: UOp, out_axes: list[UOp], reduces: list[UOp], target: Target) -> list[Opt] | None:
  """One block per row: the output axes the REDUCEs vary along (the rows: up to three) go to the grid, each REDUCE's axis
  to the block's threads (GROUP) and one more output axis, which no REDUCE varies along, is shared by the same threads
  (SPREAD: softmax's and layernorm's columns, which read the row's results from the tree). None where that does not fit:
  a matmul (its own tiling), a REDUCE over several axes or over another REDUCE's axis, a reduce axis whose loads are
  not contiguous (a column sum: one thread per output reads coalesced), rows shorter than a warp."""
  if not reduces or matmul_rows(st) is not None or any(len(red.src) != 2 for red in reduces): return None
  rows = {r for red in reduces for r in free_ranges(red)}
  if not rows <= set(out_axes) or len(rows) > 3: return None
  rest = [a for a in out_axes if a not in rows]
  if len(rest) > 1: return None
  sizes = []
  for red in reduces:
    r = red.src[1]
    uses = [ld for ld in _loads(red.src[0]) if r in ld.src[0].toposort()]
    if not uses or any(len(ld.src[0].src) != 2 or affine_coeff(ld.src[0].src[1], r) != 1 for ld in uses): return None
    sizes.append(axis_size(r))
  grid = sorted(rows, key=lambda a: a.arg[0], reverse=True)
  if any(axis_bound(a) > target.max_grid[d] for d, a in enumerate(grid) if d > 0): return None
  longest = None if None in sizes else max(s for s in sizes if s is not None)
  if longest is not None and longest < GPU_MIN_GROUP_ROW: return None
  if (few := _few_long_rows(rows, rest, reduces, longest, target)) is not None: return few
  g = GPU_WARP
  while g < target.local_size and (longest is None or g * 2 * GPU_PER_THREAD <= longest): g *= 2
  opts = [Opt(OptOps.GROUP, r.arg[0], g) for r in sorted({red.src[1] for red in reduces}, key=lambda a: a.arg[0])]
  opts += [Opt(OptOps.SPREAD, a.arg[0], g) for a in rest]
  # short rows (one warp each): a block of one warp is tiny and short-lived (an SM holds at most 32 blocks: half its threads),
  # so a block stacks local_size / 32 rows of the grid's row axis, one warp each (threadIdx.y)
  stack = target.local_size // GPU_WARP
  if g == GPU_WARP and stack > 1 and grid and (n := axis_size(grid[0])) is not None and n >= 4 * stack:  # no grid: one row
    opts.append(Opt(OptOps.LOCAL, grid[0].arg[0], stack))
  return opts


GPU_FEW_ROWS = 32  # this many rows or fewer, each long enough for two blocks, are cut over blocks too (BLOCKS per row)


def _few_long_rows(rows: set[UOp], rest: list[UOp], reduces: list[UOp], longest: int | None, target: Target) -> list[Opt] | None:
  """A tiny output axis over long rows (2 rows of 10^6): a block per row would leave most of the GPU idle, so each row is
  cut over blocks as a full reduction is, the rows on the grid's y and z (one REDUCE, at most two row axes, no SPREAD)."""
  if len(reduces) != 1 or rest or len(rows) > 2 or longest is None: return None
  n = 1
  for a in rows: n *= axis_size(a) or GPU_FEW_ROWS + 1
  g = target.local_size
  if n > GPU_FEW_ROWS or (nb := min(GPU_MAX_BLOCKS // n, longest // (g * GPU_FULL_PER_THREAD))) < 2: return None
  r = reduces[0].src[1]
  return [Opt(OptOps.GROUP, r.arg[0], g), Opt(OptOps.BLOCKS, r.arg[0], nb)]
