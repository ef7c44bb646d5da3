"""Recognise a kernel that is one matrix product, C[b, i, j] = f(sum_k A[b, i, k] * B[b, k, j], ...), so a renderer can give it
a tiled kernel of its own (render/cuda_matmul.py) instead of the generic lowering. What matches: one STORE whose value is an
elementwise epilogue f (bias, activation, residual, the cast to the output's dtype; loads indexed by the output ranges) of
one REDUCE(ADD) over one range of a product of two loads (each loaded value optionally cast to the sum's dtype); constant
sizes, except the outermost batch axis's, which may be symbolic (a dynamic batch: the grid follows it, the kernel's body
does not read it); the output's index, and the batch axes' part of each operand's, affine in the ranges (ranges, constants, +, - and
multiplication by a constant). An operand whose matrix part is not a stride per axis (a convolution read as a product,
implicit GEMM: A[pixel, k] at the pixel's row and column and k's channel and tap taken apart by // and %, and a padded
input's gate, which reads 0 outside the image) keeps that part as an expression of its two matrix ranges
(`Operand.expr`, `Operand.gate`), which the tiled kernel computes element by element. Anything else (a second sum, a
symbolic matrix size, a gathered index, a batch axis inside such an expression) is None: the generic path runs it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kiln.ir.dtype import DType, PtrDType
from kiln.ir.ops import AxisType, GroupOp, Ops
from kiln.ir.uop import UOp


@dataclass(frozen=True)
class Operand:
  slot: int
  dtype: DType  # the element type in memory
  offset: int  # elements from the buffer's start at b = i = j = k = 0
  batch: tuple[int, ...]  # element stride per batch axis (0: broadcast)
  rows: int  # stride along the operand's first matrix axis (A: i, B: k, C: i)
  cols: int  # along the second (A: k, B: j, C: j)
  # where the matrix part is not rows * r0 + cols * r1: (r0, r1, that part as an index expression of the two ranges); rows
  # and cols are then 0. gate: the load reads 0 where it is false (an expression of r0 and r1 too)
  expr: tuple[UOp, UOp, UOp] | None = None
  gate: UOp | None = None

  @property
  def affine(self) -> bool: return self.expr is None and self.gate is None


@dataclass(frozen=True)
class Contraction:
  m: int
  n: int
  k: int
  batch: tuple[int | UOp, ...]  # sizes of the batch axes, outermost first (the outermost's may be symbolic)
  a: Operand
  b: Operand
  c: Operand
  acc: DType  # the sum's dtype
  # the stored value as an expression of the sum (`reduce`) and of loads indexed by the output ranges only (bias, residual,
  # activation, the cast to the output's dtype); its ranges: i, j and the batch axes (`ranges`, in that order)
  value: UOp | None = None
  reduce: UOp | None = None
  ranges: tuple[UOp, ...] = ()
  extra: tuple[int, ...] = ()  # slots the epilogue reads

  @property
  def epilogue(self) -> bool:
    """More than the sum cast to the output's dtype."""
    v = self.value
    return v is not None and v is not self.reduce and not (v.op is Ops.CAST and v.src[0] is self.reduce)

  @property
  def batches(self) -> int:
    """How many matrices, at most (a symbolic batch at its upper bound)."""
    p = 1
    for s in self.batch: p *= s if isinstance(s, int) else int(s.vmax)
    return p

  @property
  def batch_grid(self) -> int | UOp:
    """How many matrices: the product of the batch sizes, symbolic where the outermost is."""
    p: int | UOp = 1
    for s in self.batch: p = s * p if isinstance(s, UOp) else p * s
    return p

  @property
  def variables(self) -> list[UOp]:
    """The DEFINE_VARs the batch sizes name (the launch's arguments), by name."""
    vs = {u for s in self.batch if isinstance(s, UOp) for u in s.toposort() if u.op is Ops.DEFINE_VAR}
    return sorted(vs, key=lambda v: v.arg[0])


def linear(idx: UOp) -> dict[UOp | None, int] | None:
  """idx as {range: coefficient, None: constant} when it is affine in ranges with constant coefficients, else None."""
  memo: dict[UOp, dict[UOp | None, int] | None] = {}
  for u in idx.toposort():
    s = [memo.get(x) for x in u.src]
    if u.op is Ops.CONST and isinstance(u.arg, int) and not isinstance(u.arg, bool): r: dict[UOp | None, int] | None = {None: int(u.arg)}
    elif u.op is Ops.RANGE: r = {u: 1}
    elif u.op in (Ops.ADD, Ops.SUB) and None not in s:
      sign = 1 if u.op is Ops.ADD else -1
      r = dict(s[0])  # type: ignore[arg-type]
      for key, v in s[1].items(): r[key] = r.get(key, 0) + sign * v  # type: ignore[union-attr]
    elif u.op is Ops.MUL and None not in s:
      const = [x for x in s if x is not None and set(x) == {None}]
      if not const: r = None
      else:
        f, other = const[0][None], s[1] if s[0] is const[0] else s[0]
        r = {key: v * f for key, v in other.items()}  # type: ignore[union-attr]
    elif u.op is Ops.CAST and u.dtype.is_int and u.dtype.itemsize >= 4 and s[0] is not None: r = s[0]
    else: r = None
    memo[u] = r
  return memo[idx]


def _additive(u: UOp, scale: int, out: list[tuple[UOp, int]]) -> None:
  """u's additive terms (term, factor): sums and differences split, multiplication by a constant carried to the terms."""
  if u.op in (Ops.ADD, Ops.SUB):
    _additive(u.src[0], scale, out)
    _additive(u.src[1], -scale if u.op is Ops.SUB else scale, out)
  elif u.op is Ops.MUL and (c := next((x for x in u.src if x.op is Ops.CONST and type(x.arg) is int), None)) is not None:
    _additive(u.src[1] if u.src[0] is c else u.src[0], scale * int(c.arg), out)
  else: out.append((u, scale))


@dataclass(frozen=True)
class _Index:
  """A load's index as affine coefficients (`coef`, as linear's) of its linear terms plus the sum of the rest (`rest`, None
  where there is none), and its gate (None: not gated)."""
  coef: dict[UOp | None, int]
  rest: UOp | None
  gate: UOp | None

  @functools.cached_property
  def ranges(self) -> frozenset[UOp]:
    """The ranges the index or the gate reads (found once: match asks for every output range)."""
    out = {r for r, v in self.coef.items() if r is not None and v}
    for u in (self.rest, self.gate):
      if u is not None: out |= {x for x in u.toposort() if x.op is Ops.RANGE}
    return frozenset(out)

  def uses(self, r: UOp) -> bool: return r in self.ranges


def _index(idx: UOp, gate: UOp | None) -> _Index | None:
  """idx (and the gate) split as _Index; None where an expression holds what an index may not (a load: a gathered index)."""
  if any(x.op not in _INDEX_OPS for u in (idx, gate) if u is not None for x in _walk(u)): return None
  if (lin := linear(idx)) is not None and gate is None: return _Index(lin, None, None)
  coef: dict[UOp | None, int] = {}
  rest: UOp | None = None
  terms: list[tuple[UOp, int]] = []
  _additive(idx, 1, terms)
  for t, f in terms:
    if (lt := linear(t)) is not None:
      for key, v in lt.items(): coef[key] = coef.get(key, 0) + f * v
    else: rest = (t if f == 1 else t * f) if rest is None else rest + (t if f == 1 else t * f)
  return _Index(coef, rest, gate)


def _walk(u: UOp) -> list[UOp]:
  """u's nodes, not looking into a range's size (a symbolic batch's variable is the range's, not the index's)."""
  out, seen, stack = [], set(), [u]
  while stack:
    x = stack.pop()
    if x in seen: continue
    seen.add(x)
    out.append(x)
    if x.op is not Ops.RANGE: stack.extend(x.src)
  return out


# what an operand's index and gate may hold: index arithmetic and comparisons of the ranges
_INDEX_OPS = frozenset({Ops.RANGE, Ops.CONST, Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CAST, Ops.CMPLT, Ops.CMPNE,
                        Ops.CMPEQ, Ops.AND, Ops.OR, Ops.XOR, Ops.WHERE})


def _load(u: UOp, acc: DType) -> tuple[UOp, UOp, UOp | None] | None:
  """(DEFINE_GLOBAL, index, gate or None) of a value that is a load, or a load cast to the sum's dtype; gated either in
  the index or as where(gate, load, 0) (a pad kiln-graph does not realize)."""
  if u.op is Ops.CAST and u.dtype == acc: u = u.src[0]
  if u.op is Ops.WHERE and u.src[2].op is Ops.CONST and u.src[2].arg == 0 and (inner := _load(u.src[1], acc)) is not None:
    g, idx, gate = inner
    return g, idx, u.src[0] if gate is None else (u.src[0] & gate)
  if u.op is not Ops.LOAD or len(u.src) != 1 or u.src[0].op is not Ops.INDEX or len(u.src[0].src) not in (2, 3): return None
  g, idx = u.src[0].src[0], u.src[0].src[1]
  if g.op is not Ops.DEFINE_GLOBAL or not isinstance(g.dtype, PtrDType): return None
  return g, idx, (u.src[0].src[2] if len(u.src[0].src) == 3 else None)


def _size(r: UOp) -> int | None: return int(r.src[0].arg) if r.src[0].op is Ops.CONST else None


def _symbolic(r: UOp) -> bool:
  """A range over a size of variables and constants only, + and * (a dynamic batch, times a constant where axes merged)."""
  s = r.src[0]
  return all(u.op in (Ops.DEFINE_VAR, Ops.CONST, Ops.ADD, Ops.MUL) for u in s.toposort())


# what an epilogue may hold besides the sum: values the CUDA printer renders per output element
_EPILOGUE_OPS = GroupOp.ALU | {Ops.CONST, Ops.CAST, Ops.BITCAST, Ops.LOAD, Ops.INDEX, Ops.DEFINE_GLOBAL, Ops.RANGE}


def _epilogue(val: UOp, outs: set[UOp], gc: UOp) -> tuple[UOp, list[UOp]] | None:
  """(the one REDUCE the stored value is built on, the epilogue's other globals), when everything else in it is elementwise
  on loads indexed by output ranges only (not the output buffer itself: another thread's element may not be written yet)."""
  reduces: list[UOp] = []
  globals_: list[UOp] = []
  seen: set[UOp] = set()
  stack = [val]
  while stack:
    u = stack.pop()
    if u in seen: continue
    seen.add(u)
    if u.op is Ops.REDUCE:
      reduces.append(u)
      continue  # the sum's own subtree is the contraction's
    if u.op not in _EPILOGUE_OPS: return None
    if u.op is Ops.RANGE:
      if u not in outs: return None
      continue  # its size (a symbolic batch's variable) is the range's, not the epilogue's
    if u.op is Ops.INDEX and (len(u.src) != 2 or u.src[0].op is not Ops.DEFINE_GLOBAL or u.src[0] is gc): return None
    if u.op is Ops.DEFINE_GLOBAL and u not in globals_: globals_.append(u)
    stack.extend(u.src)
  return (reduces[0], globals_) if len(reduces) == 1 else None


def match(ast: UOp) -> Contraction | None:
  if ast.op is not Ops.SINK or len(ast.src) != 1 or (st := ast.src[0]).op is not Ops.STORE or st.src[0].op is not Ops.INDEX: return None
  gc, cidx, val = st.src[0].src[0], st.src[0].src[1], st.src[1]
  if gc.op is not Ops.DEFINE_GLOBAL or not isinstance(gc.dtype, PtrDType) or (fc := linear(cidx)) is None: return None
  outs = [r for r in fc if r is not None]
  if (ep := _epilogue(val, set(outs), gc)) is None: return None
  red, extra = ep
  if red.arg is not Ops.ADD or len(red.src) != 2 or red.src[1].op is not Ops.RANGE: return None
  kr, prod, acc = red.src[1], red.src[0], red.dtype
  if not acc.is_float or prod.op is not Ops.MUL: return None
  la, lb = _load(prod.src[0], acc), _load(prod.src[1], acc)
  if la is None or lb is None or gc in (la[0], lb[0]): return None  # A and B may be one buffer (q and k of a fused projection)
  fa, fb = _index(la[1], la[2]), _index(lb[1], lb[2])
  if fa is None or fb is None or (kk := _size(kr)) is None: return None
  if any(r.arg[1] is not AxisType.LOOP for r in outs): return None
  if any(r is not kr and r not in fc for f in (fa, fb) for r in f.ranges): return None  # every range is an output's or k
  if fc.get(kr, 0) or not fa.uses(kr) or not fb.uses(kr): return None
  i_axes = [r for r in outs if fa.uses(r) and not fb.uses(r)]
  j_axes = [r for r in outs if fb.uses(r) and not fa.uses(r)]
  if not i_axes or not j_axes: return None
  # more than one: an axis the other operand broadcasts over (a batched 1x1 conv's images, which its weight does not have)
  # is a batch axis of stride 0 there; the matrix axis is the one the output is most contiguous along
  ri, rj = (min(axes, key=lambda r: abs(fc[r])) for axes in (i_axes, j_axes))
  batch = sorted((r for r in outs if r is not ri and r is not rj), key=lambda r: r.arg[0])
  if not fc.get(ri, 0) or not fc.get(rj, 0) or _size(ri) is None or _size(rj) is None: return None
  if any(_size(r) is None and (i or not _symbolic(r)) for i, r in enumerate(batch)): return None  # only the outermost symbolic

  def operand(g: UOp, f: _Index, r0: UOp, r1: UOp) -> Operand | None:
    assert isinstance(g.dtype, PtrDType)
    base = dict(slot=int(g.arg), dtype=g.dtype.base, offset=f.coef.get(None, 0), batch=tuple(f.coef.get(r, 0) for r in batch))
    if f.rest is None and f.gate is None: return Operand(**base, rows=f.coef.get(r0, 0), cols=f.coef.get(r1, 0))  # type: ignore[arg-type]
    inner = {x for u in (f.rest, f.gate) if u is not None for x in u.toposort()}
    if any(r in inner for r in batch): return None  # a batch axis's offset is a stride
    part = f.rest if f.rest is not None else UOp.const(r0.dtype, 0)
    for r in (r0, r1):
      if c := f.coef.get(r, 0): part = part + r * c
    return Operand(**base, rows=0, cols=0, expr=(r0, r1, part), gate=f.gate)  # type: ignore[arg-type]
  if any(g in (la[0], lb[0]) for g in extra): return None  # an operand read again in the epilogue: keep it simple, generic
  oa, ob, oc = operand(la[0], fa, ri, kr), operand(lb[0], fb, kr, rj), operand(gc, _Index(fc, None, None), ri, rj)
  if oa is None or ob is None or oc is None: return None
  sizes = tuple(r.src[0] if (n := _size(r)) is None else n for r in batch)
  con = Contraction(m=_size(ri) or 0, n=_size(rj) or 0, k=kk, batch=sizes, a=oa, b=ob, c=oc, acc=acc,
                    value=val, reduce=red, ranges=(ri, rj, *batch), extra=tuple(int(g.arg) for g in extra))
  return con if con.a.dtype == con.b.dtype else None  # mixed input dtypes: the generic kernel
