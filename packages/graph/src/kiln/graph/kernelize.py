"""Kernelize: one kernel from the graph: the UOp AST that computes a realized node, with every node that is not realized inlined
as an expression of the output's loop indices (movement ops become index arithmetic, reductions nested REDUCEs)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kiln.graph.dims import add, dmin, mul, negative, reshape_groups, same
from kiln.graph.lazy import GraphError, Node
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.kernels import Dim, flat_index
from kiln.ir.ops import AxisType, Ops
from kiln.ir.rewrite import substitute
from kiln.ir.uop import UOp

ZERO = UOp.const(dtypes.index, 0)
# a node inlined at more distinct indices than this in one kernel is realized: each index computes it again, and chains of
# concatenations with slices of each other (DPN's dense paths: both halves of a block read the one before) double its
# indices per level, so rendering grew as 2**depth; above every window a kernel unrolls (a Winograd tile's 36, a 7x7 tap)
MAX_INDICES = 64


def _clamp(i: UOp, n: Dim) -> UOp:
  # a size that may be 0 (a KV cache's past) clamps to 0 last, so the index stays provably in its buffer (read, never used)
  return i.maximum(0).minimum(n - 1) if dmin(n) >= 1 else i.minimum(n - 1).maximum(0)


def compute_dtype(dt: DType) -> DType:
  """The dtype a kernel computes a node of dtype `dt` in: 16-bit floats in float32 (loads cast up, arithmetic and every sum's
  accumulator in float32, one rounding where the value is stored), as onnxruntime and torch do on a CPU; 16 bits are a
  storage format, what halves the memory traffic. Every other dtype computes in itself."""
  return dtypes.float32 if dt in (dtypes.float16, dtypes.bfloat16) else dt


def stored_dtype(n: Node, outputs: AbstractSet[Node], wide: bool) -> DType:
  """The dtype of a realized node's buffer: its own, except that where `wide` (a CPU, which has no 16-bit arithmetic, so 16
  bits would only save memory traffic) a 16-bit float computed by the graph and read only by the graph's own kernels is
  kept in float32, as onnxruntime keeps a float16 model's intermediates on a CPU: the values stay exact between kernels,
  and inputs, weights and outputs keep their dtype."""
  if wide and compute_dtype(n.dtype) != n.dtype and n.op != "BUFFER" and n not in outputs: return compute_dtype(n.dtype)
  return n.dtype


def _narrow(v: UOp, dt: DType) -> UOp:
  """v, computed in compute_dtype(dt), rounded to dt (a load cast up is its load again)."""
  if v.dtype == dt: return v
  widened = v.op is Ops.CAST and v.src[0].dtype == dt and v.dtype == compute_dtype(dt)
  return v.src[0] if widened else v.cast(dt)


def _exact(v: UOp, dt: DType) -> UOp:
  """v at the value a node of dtype dt holds, in its compute dtype: a 16-bit value rounded to 16 bits and cast up again."""
  return v if compute_dtype(dt) == dt else _narrow(v, dt).cast(compute_dtype(dt))


# ops whose result jumps as an operand crosses a value (a comparison, a truncation): they read 16-bit operands rounded to
# 16 bits, so they decide what the stored values would decide (a floor of 2.9999 that float16 holds as 3.0 is 3)
_EXACT_OPERANDS = frozenset({Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.TRUNC})


def strides(shape: Sequence[Dim]) -> tuple[Dim, ...]: return _strides(tuple(shape))


@lru_cache(maxsize=1 << 14)  # dims are hash-consed: a decoder's layers ask for the same strides kernel after kernel
def _strides(shape: tuple[Dim, ...]) -> tuple[Dim, ...]:
  out: list[Dim] = []
  acc: Dim = 1
  for d in reversed(shape):
    out.append(acc)
    acc = mul(acc, d)
  return tuple(out[::-1])


def _is1(d: Dim) -> bool: return isinstance(d, int) and d == 1


def _written_at(n: Node) -> UOp:
  """Where a WRITE node's element 0 is in its target's buffer: row `at` of rows of the value's other dims."""
  off = mul(n.arg, *n.shape[1:])
  return off if isinstance(off, UOp) else UOp.const(dtypes.index, off)


@dataclass(frozen=True)
class _Split:
  """An index entry a reshape made by splitting lin: (lin // stride) % dim, where the % is left out on a group's first dim."""
  lin: UOp; stride: Dim; dim: Dim; first: bool


class Splits:
  """The entries reshapes split, so a load can put them back together: with a symbolic stride the verifier's interval
  bounds cannot prove (r // s) * s + r % s < b * s, but r < b * s it can (a merge of (batch, seq) read as (batch*seq))."""
  def __init__(self) -> None: self.of: dict[UOp, _Split] = {}

  def flat(self, idx: tuple[UOp, ...], shape: tuple[Dim, ...]) -> UOp:
    """flat_index(idx, shape), a run of entries that split one lin over exactly these dims (with a symbolic one) read as lin."""
    if not self.of: return flat_index(idx, shape)
    out_i: list[UOp] = []
    out_s: list[Dim] = []
    k = 0
    while k < len(idx):
      if (run := self._run(idx, shape, k)) is not None:
        m, lin = run
        out_i.append(lin); out_s.append(mul(*shape[k:m + 1]))
        k = m + 1
        continue
      out_i.append(idx[k]); out_s.append(shape[k])
      k += 1
    return flat_index(tuple(out_i), tuple(out_s))

  def _run(self, idx: tuple[UOp, ...], shape: tuple[Dim, ...], k: int) -> tuple[int, UOp] | None:
    """(m, lin) when idx[k..m] are lin split over shape[k..m] (the first without %, the last with stride 1)."""
    sp = self.of.get(idx[k])
    if sp is None or not sp.first: return None
    m = None
    for j in range(k, len(idx)):
      e = self.of.get(idx[j])
      if e is None or e.lin is not sp.lin or (j > k and e.first): return None
      if same(e.stride, 1):
        m = j
        break
    if m is None or m == k: return None
    symbolic = False
    for j in range(k, m + 1):
      e = self.of[idx[j]]
      if not (shape[j] is e.dim or isinstance(shape[j], int) and isinstance(e.dim, int) and shape[j] == e.dim): return None
      if not same(e.stride, mul(*shape[j + 1:m + 1])): return None
      symbolic = symbolic or isinstance(e.stride, UOp) or isinstance(e.dim, UOp)
    return (m, sp.lin) if symbolic else None

  def reshape_index(self, idx: tuple[UOp, ...], out_shape: tuple[Dim, ...], in_shape: tuple[Dim, ...]) -> tuple[UOp, ...]:
    """The source index of a reshape, group by group (dims whose products match), so a merge or split costs one // and %.
    What it depends on is idx, the shapes and what this kernel knows of idx's entries, so it is cached on those (a decoder's
    layers render the same reshapes kernel after kernel), and a hit records the same splits a computation would."""
    known = tuple(self.of.get(i) for i in idx) if self.of else None
    res, made = _reshape_index(idx, out_shape, in_shape, known)
    for e, sp in made: self.of.setdefault(e, sp)
    return res

  def _reshape_index(self, idx: tuple[UOp, ...], out_shape: tuple[Dim, ...], in_shape: tuple[Dim, ...]) -> tuple[UOp, ...]:
    res: list[UOp] = []
    for oi, ij in reshape_groups(out_shape, in_shape):
      lin = self.flat(tuple(idx[k] for k in oi), tuple(out_shape[k] for k in oi))
      sub = tuple(in_shape[k] for k in ij)
      for n, (k, s) in enumerate(zip(ij, strides(sub))):
        v = lin if _is1(s) or lin is ZERO else lin // s
        outer = all(_is1(d) for d in sub[:n])  # the group's outermost dim needs no %
        e = ZERO if _is1(in_shape[k]) or v is ZERO else v if outer else v % in_shape[k]
        if outer and isinstance(s, UOp) and e is not ZERO:  # lin // seq < dim always; the clamp lets interval bounds prove it
          e = e.minimum(in_shape[k] - 1)
        if e is not ZERO and lin is not ZERO: self.of.setdefault(e, _Split(lin, s, in_shape[k], outer))
        res.append(e)
    return tuple(res[:len(in_shape)])


@lru_cache(maxsize=1 << 14)
def _reshape_index(idx: tuple[UOp, ...], out_shape: tuple[Dim, ...], in_shape: tuple[Dim, ...],
                   known: tuple[_Split | None, ...] | None) -> tuple[tuple[UOp, ...], tuple[tuple[UOp, _Split], ...]]:
  """Splits.reshape_index for a kernel that knows `known` of idx's entries: the index, and the splits it records."""
  sp = Splits()
  if known is not None: sp.of = {i: k for i, k in zip(idx, known) if k is not None}
  before = dict(sp.of)
  res = sp._reshape_index(idx, out_shape, in_shape)
  return res, tuple((e, v) for e, v in sp.of.items() if e not in before)


@lru_cache(maxsize=1 << 10)  # ASTs are hash-consed: a model's repeated layers render the same kernel again
def _globals_of(ast: UOp) -> frozenset[UOp]: return frozenset(u for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL)


@dataclass
class Kernel:
  """A rendered kernel: the AST, the nodes whose buffers fill its slots (slot 0: the node it computes), and what each
  inlined node rendered to (the scheduler's fusion checks read it)."""
  node: Node
  ast: UOp
  slots: list[Node]
  rendered: dict[Node, set[UOp]] = field(default_factory=dict)
  analysis: Any = None  # the scheduler's _Analysis, made once per rendering
  offenders: set[Node] = field(default_factory=set)
  op_id: int | None = None  # its op in the plan built from it (GraphPlan), as a profile's records name it


class Kernelizer:
  def __init__(self, node: Node, realized: set[Node], stored: Callable[[Node], DType] | None = None):
    self.node, self.realized = node, realized
    self.stored = stored or (lambda n: n.dtype)  # a realized node's buffer dtype (stored_dtype)
    self.slots: list[Node] = [node]
    self.globals: dict[Node, UOp] = {}
    self.memo: dict[tuple[Node, tuple[UOp, ...]], UOp] = {}
    self.rendered: dict[Node, set[UOp]] = {}
    self.axis = 0
    self.offenders: set[Node] = set()  # REDUCEs found on the fly that must be realized (loaded as if they were, meanwhile)
    self.reduce_at: dict[Node, tuple[UOp, ...]] = {}
    self.rr: dict[UOp, bool] = {}
    self.splits = Splits()
    self.indices: dict[Node, int] = {}  # distinct indices each inlined node was rendered at (MAX_INDICES)

  def _in_reduce(self, u: UOp) -> bool:
    """Whether an index varies over a reduce range (the value is inside some reduction's body)."""
    if (hit := self.rr.get(u)) is None:
      hit = self.rr[u] = any(x.op is Ops.RANGE and x.arg[1] is AxisType.REDUCE for x in u.toposort())
    return hit

  def _range(self, n: Dim, kind: AxisType) -> UOp:
    self.axis += 1
    return UOp.range(n, self.axis - 1, kind)

  def _global(self, n: Node) -> UOp:
    if (g := self.globals.get(n)) is None:
      if n is not self.node: self.slots.append(n)
      size = n.src[0].max_numel if n.op == "WRITE" else n.max_numel  # a write stores into its target's buffer
      g = self.globals[n] = UOp.define_global(self.slots.index(n), self.stored(n).ptr(size))
    return g

  def kernel(self) -> Kernel:
    n = self.node
    idx = tuple(ZERO if d == 1 else self._range(d, AxisType.LOOP) for d in n.shape)
    out = self._global(n)
    if n.op == "WRITE":  # value's rows at row `at` of the target (Tensor.write_rows)
      val = _narrow(self.render(n.src[1], idx), self.stored(n))
      ast = UOp.sink(out.index(flat_index(idx, n.shape) + _written_at(n)).store(val), name=self._name())
    else:
      val = _narrow(self.render(n, idx, top=True), self.stored(n))
      ast = UOp.sink(out.index(flat_index(idx, n.shape)).store(val), name=self._name())
    ast, slots = self._drop_unread(ast)
    if neg := {d for m in (n, *self.rendered, *slots) for d in negative(m.shape)}:  # run() has checked them >= 0: say so to the verifier
      ast = substitute(ast, {d: d.maximum(0) for d in neg})
    return Kernel(n, ast, slots, self.rendered, offenders=self.offenders)

  def _name(self) -> str:
    """What the kernel does and over what shape, not where it sits in the plan: the name is part of the AST the kernel
    cache keys on, so the same kernel twice (a transformer's layers, an RNN's steps) is compiled once."""
    kinds = {m.op for m in self.rendered} | {self.node.op}
    tag = "reduce" if "REDUCE" in kinds else "gather" if "GATHER" in kinds else "write" if "WRITE" in kinds else "elementwise"
    return f"{tag}_{'x'.join(str(d) if isinstance(d, int) else 'n' for d in self.node.shape) or '1'}"  # n: a symbolic dim

  def _drop_unread(self, ast: UOp) -> tuple[UOp, list[Node]]:
    """The slots the AST still reads, renumbered in order: a value that folded away (a slice of nothing but a pad's
    zeros) leaves its input unread, and a plan binds exactly the buffers a kernel's DEFINE_GLOBALs name."""
    used = _globals_of(ast)
    kept = [s for s in self.slots if self.globals[s] in used]
    if len(kept) == len(self.slots): return ast, self.slots
    renum: dict[UOp, UOp] = {}
    for i, s in enumerate(kept):
      if (g := self.globals[s]).arg != i:
        assert isinstance(g.dtype, PtrDType)  # made by _global, always a pointer
        renum[g] = UOp.define_global(i, g.dtype)
    return (substitute(ast, renum) if renum else ast), kept

  def render(self, n: Node, idx: tuple[UOp, ...], top: bool = False) -> UOp:
    if not top and (n in self.realized or n.op == "BUFFER"): return self._load(n, idx)
    key = (n, idx)
    if (hit := self.memo.get(key)) is not None: return hit
    if n.op == "REDUCE" and not top and (self.reduce_at.setdefault(n, idx) != idx or any(self._in_reduce(i) for i in idx)):
      # a reduction at two indices, or inside another's body: it gets its own kernel (checked here, so that the
      # first render of a whole graph stays linear in its size instead of nesting every reduction in every other)
      self.offenders.add(n)
      return self._load(n, idx)
    if not top:
      if (seen := self.indices.get(n, 0)) >= MAX_INDICES:
        self.offenders.add(n)
        return self._load(n, idx)
      self.indices[n] = seen + 1
    out = self._render(n, idx)
    self.memo[key] = out
    self.rendered.setdefault(n, set()).add(out)
    return out

  def _load(self, n: Node, idx: tuple[UOp, ...], valid: UOp | None = None) -> UOp:
    """n's element at idx from its buffer (gated by valid), in n's compute dtype."""
    return self._load_flat(n, self.splits.flat(idx, n.shape), valid)

  def _reshaped(self, n: Node) -> Node:
    """The node n is a reshape of (through reshapes computed inline), else n itself."""
    while n.op == "VIEW" and n.arg[0] == "reshape" and n not in self.realized and n is not self.node: n = n.src[0]
    return n

  def _load_flat(self, n: Node, at: UOp, valid: UOp | None = None) -> UOp:
    """n's element at the flat index `at` of its buffer (gated by valid), in n's compute dtype."""
    if n.op == "WRITE": at = at + _written_at(n)  # a written value is read back from where it was written
    ix = self._global(n).index(at) if valid is None else self._global(n).index(at, valid)
    return ix.load().cast(compute_dtype(n.dtype))

  def _render(self, n: Node, idx: tuple[UOp, ...]) -> UOp:
    """n's value at idx in compute_dtype(n.dtype); kernel() rounds it to n.dtype where it is stored."""
    cdt = compute_dtype(n.dtype)
    if n.op == "BUFFER": return self._load(n, idx)  # a BUFFER computed into its own output: a copy
    if n.op == "IOTA": return idx[0].cast(n.dtype).cast(cdt)  # the element's own index along the one axis
    if n.op == "CONST":  # a UOp: a symbolic dim's value
      # a 16-bit constant is taken in the compute dtype as its node holds it: Tensor.full rounded a user's value already,
      # and a composite's own constant (Tensor._exact) stays exact
      return n.arg.cast(n.dtype).cast(cdt) if isinstance(n.arg, UOp) else UOp.const(cdt, n.arg)
    if n.op == "ALU":
      srcs = [self.render(s, idx) for s in n.src]
      if n.arg is Ops.CAST: return _narrow(srcs[0], n.src[0].dtype).cast(n.dtype).cast(cdt)  # a cast converts the stored value
      if n.arg in _EXACT_OPERANDS: srcs = [_exact(v, s.dtype) for v, s in zip(srcs, n.src)]
      return srcs[0].alu(n.arg, *srcs[1:])
    if n.op == "REDUCE":
      op, axes = n.arg
      s = n.src[0]
      rng = {a: self._range(s.shape[a], AxisType.REDUCE) for a in axes if s.shape[a] != 1}
      v = self.render(s, tuple(rng.get(a, i) for a, i in enumerate(idx)))
      return v.reduce(op, *rng.values()) if rng else v
    if n.op == "VIEW": return self._view(n, idx)
    if n.op == "GATHER":
      table, ind = n.src
      ax, k = n.arg[0], len(ind.shape)
      iv = self.render(ind, idx[ax:ax + k]).cast(dtypes.index)
      size = table.shape[ax]
      # negative indices count from the end; the clamp keeps an index out of range inside the table's memory, and the
      # plan's check of these indices (index_check.py) makes that run an IndexOutOfRangeError, never a clamped answer
      iv = _clamp((iv < 0).where(iv + size, iv), size)
      return self.render(table, (*idx[:ax], iv, *idx[ax + k:]))
    if n.op == "CAT":
      ax = n.arg
      offs: list[Dim] = [0]
      for s in n.src: offs.append(add(offs[-1], s.shape[ax]))  # symbolic pieces: past, then past + seq
      acc: UOp | None = None
      for k in reversed(range(len(n.src))):
        s = n.src[k]
        sub = ZERO if _is1(s.shape[ax]) else _clamp(idx[ax] - offs[k], s.shape[ax])
        v = self.render(s, (*idx[:ax], sub, *idx[ax + 1:]))
        acc = v if acc is None else (idx[ax] < offs[k + 1]).where(v, acc)
      assert acc is not None
      return acc
    raise GraphError(f"cannot render a {n.op} node")

  def _view(self, n: Node, idx: tuple[UOp, ...]) -> UOp:
    kind, p = n.arg
    s = n.src[0]
    if kind == "reshape": return self.render(s, self.splits.reshape_index(idx, n.shape, s.shape))
    if kind == "permute":
      src_idx: list[UOp] = [ZERO] * len(idx)
      for d, o in enumerate(p): src_idx[o] = idx[d]
      return self.render(s, tuple(src_idx))
    if kind == "expand": return self.render(s, tuple(ZERO if sd == 1 else i for i, sd in zip(idx, s.shape)))
    if kind == "shrink":  # p: (start, step) per dim
      return self.render(s, tuple(ZERO if sd == 1 else i * st + b for i, (b, st), sd in zip(idx, p, s.shape)))
    if kind == "window":  # p: (stride, dilation) per window dim; n.shape = (*lead, *out, *kernel), src = (*lead, *in)
      d = len(p)
      lead = len(s.shape) - d
      outs, ks = idx[lead:lead + d], idx[lead + d:]
      win = tuple(o * st + k * dl if sd != 1 else ZERO for o, k, (st, dl), sd in zip(outs, ks, p, s.shape[lead:]))
      return self.render(s, (*idx[:lead], *win))
    if kind == "pad":  # p: (before per dim, value)
      before, value = p
      valid: UOp | None = None
      sub: list[UOp] = []
      raw: list[UOp] = []
      for i, b, sd in zip(idx, before, s.shape):
        if b == 0 and sd == n.shape[len(sub)]:
          sub.append(i); raw.append(i); continue
        j = i - b
        ok = (j >= 0) & (j < sd)
        valid = ok if valid is None else valid & ok
        sub.append(ZERO if sd == 1 else _clamp(j, sd))
        raw.append(ZERO if sd == 1 else j)
      base = self._reshaped(s)
      if valid is not None and (base in self.realized or base.op == "BUFFER") and base is not self.node:
        # a buffer read under the pad's bounds test: a gated load at the unclamped index (it reads nothing outside), so
        # the index stays affine in the output's lanes and a conv's packed panel copies each row run as one masked load.
        # Through reshapes too (a conv's product read as NCHW): a reshape keeps the flat index
        v = self._load(s, tuple(raw), valid) if base is s else self._load_flat(base, self.splits.flat(tuple(raw), s.shape), valid)
      else: v = self.render(s, tuple(sub))
      return v if valid is None else valid.where(v, UOp.const(n.dtype, value).cast(compute_dtype(n.dtype)))
    raise GraphError(f"unknown view {kind}")

