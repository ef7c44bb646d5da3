"""The scheduler's rules (schedule.py): which nodes of a kernel get a buffer of their own (are *realized*).

Every node that is not realized is inlined into each kernel that reads it (kernelize.py). Starting from the outputs
alone, kernels are rendered and checked; a node that breaks a rule below is realized and the kernels are rendered
again, until no rule is broken. A node's *placement* in a kernel is the set of loops its value is computed under: the
ranges it varies over, plus, where one of them is a reduce range, the placement of the REDUCE that closes it (a value
inside a reduction's body runs once per step of every loop around it); for a REDUCE also every output loop outside
its innermost one. Its *recompute factor* is the trip count of its placement over the trip count of its own ranges.

| rule                                                                                  | why                                             |
|---------------------------------------------------------------------------------------|-------------------------------------------------|
| a REDUCE that varies over another reduction's range (a matmul feeding a reduction)    | nested reductions would recompute it per step   |
| a REDUCE with recompute factor > 1 (a column sum read in a row loop)                   | its whole reduction would run again per element |
| a REDUCE rendered at two different indices in one kernel, or inlined into two kernels  | computed twice                                  |
| an elementwise, gather or concat node with recompute factor > 1 (a GELU feeding a matmul) | recomputed per step of the reduction reading it |
| a concatenation's piece that holds a reduction or a gather                             | computed for every element of the concatenation |
| a SIN, EXP2, LOG2, ERF or TANH under loops it does not vary over, HOIST_MIN repeats or more (RoPE sin) | computed per trip of them |

The elementwise rule holds only where the kernel computes the node more times than it has elements: -x over a Tile that
a ReduceMin reads varies over fewer loops than it runs under, but realized it would be a buffer of every repeat (a
2**32-element Tile of three values: 34 GB), so it stays inline.

Only the topmost offending node on each path is realized per round (its inputs then fuse into its own kernel), and a
realized REDUCE pulls up with it the chain of same-shape elementwise ops that are its sole consumers (a matmul's bias,
activation and residual become its epilogue, not the next kernel's prologue). Before all this, the chain after a conv's
realized product moves into the product's kernel when its readers read each element at least once (epilogue.py).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from kiln.codegen.choose.heuristic import SELECT_UNROLL
from kiln.graph.kernelize import Kernel
from kiln.graph.lazy import Node
from kiln.ir.analysis import free_ranges_of
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp

# a concatenation that a kernel reduces over other axes than its own, this many elements or more an output, is realized
# first (_cat_pooled); 0: never
POOLED_CAT_MIN = 16
# a transcendental computed again under loops it does not vary over (RoPE's sin of position x frequency, varying over
# the sequence and the head dim, inside a kernel's batch and head loops) is realized where that saves this many
# evaluations or more (at the variables' upper bounds); 0: never
HOISTED = frozenset({Ops.SIN, Ops.EXP2, Ops.LOG2, Ops.ERF, Ops.TANH})
HOIST_MIN = 1 << 12


def _trips(rs: set[UOp]) -> int:
  out = 1
  for r in rs: out *= int(r.src[0].vmax)  # a symbolic range counts at its upper bound
  return out


class _Analysis:
  """Placement and recompute factors of the UOps of one kernel."""
  def __init__(self, ast: UOp):
    topo = ast.toposort()
    self.free = free_ranges_of(topo)
    self.owner = {r: u for u in topo if u.op is Ops.REDUCE for r in u.src[1:]}
    self.cache: dict[UOp, frozenset[UOp]] = {}

  def placement(self, u: UOp) -> frozenset[UOp]:
    if (hit := self.cache.get(u)) is not None: return hit
    out = set(self.free.get(u, frozenset()))
    for r in list(out):
      if r.arg[1] is AxisType.REDUCE and r in self.owner: out |= self.placement(self.owner[r]) | set(self.owner[r].src[1:])
    if u.op is Ops.REDUCE:
      loops = [r.arg[0] for r in out if r.arg[1] is AxisType.LOOP]
      if loops:
        top = max(loops)
        out |= {r for r in self.free_all_loops() if r.arg[0] < top}
    self.cache[u] = res = frozenset(out)
    return res

  def free_all_loops(self) -> set[UOp]:
    return {r for rs in self.free.values() for r in rs if r.arg[1] is AxisType.LOOP}

  def evaluations(self, u: UOp) -> int:
    """How many times the kernel computes u: the trip count of its placement (a realized node computes each of its own
    elements once instead)."""
    return _trips(set(self.placement(u)))

  def factor(self, u: UOp) -> float: return self.evaluations(u) / _trips(set(self.free.get(u, frozenset())))

  def repeats(self, u: UOp) -> int:
    """How many times u is computed again: the trip count of the kernel's loops that enclose u's innermost loop but
    that u does not vary over (the renderer places u inside its innermost loop, so those loops repeat it)."""
    mine = self.placement(u)
    loops = [r.arg[0] for r in mine if r.arg[1] is AxisType.LOOP]
    if not loops: return 1
    inner = max(loops)
    return _trips({r for r in self.free_all_loops() if r.arg[0] < inner and r not in mine})

  def in_reduce_body(self, u: UOp) -> bool: return any(r.arg[1] is AxisType.REDUCE for r in self.free.get(u, frozenset()))


# an analysis depends on the kernel's AST alone, and ASTs are hash-consed: a model's repeated layers render the same kernel
# again and again (each round of the scheduler renders again the kernels a realized node changed); cleared when a
# schedule is done
@functools.lru_cache(maxsize=1 << 10)
def analysis_of(ast: UOp) -> _Analysis: return _Analysis(ast)


def _offends(n: Node, uops: set[UOp], an: _Analysis, kernels_of: Mapping[Node, int]) -> bool:
  if n.op == "REDUCE":
    reds = [u for u in uops if u.op is Ops.REDUCE]
    if not reds: return False  # a reduction over size-1 axes only is its source
    return len(reds) > 1 or kernels_of.get(n, 0) > 1 or any(an.in_reduce_body(u) or an.factor(u) > 1 for u in reds)
  if n.op in ("ALU", "GATHER", "CAT") and n.arg is not Ops.CAST:
    return any(an.factor(u) > 1 and an.evaluations(u) > n.max_numel for u in uops if u.op is not Ops.CONST) \
      or n.arg in HOISTED and _repeated(uops, an)
  return False


def _repeated(uops: set[UOp], an: _Analysis) -> bool:
  """Whether a transcendental's evaluations repeated under loops it does not vary over come to HOIST_MIN or more."""
  return HOIST_MIN > 0 and any((k := an.repeats(u)) > 1 and (k - 1) * _trips(set(an.placement(u))) >= HOIST_MIN
                               for u in uops if u.op in HOISTED)


def lift(n: Node, cons: Mapping[Node, list[Node]], realized: set[Node]) -> Node:
  """A REDUCE to realize takes along its epilogue: sole consumers that are elementwise of the same shape."""
  if n.op != "REDUCE": return n
  while len(c := cons.get(n, [])) == 1:
    p = c[0]
    if p in realized or not (p.op == "ALU" and p.shape == n.shape or p.op == "VIEW" and p.arg[0] == "reshape"): break
    n = p
  while n.op == "VIEW" and n.src: n = n.src[0]  # a trailing reshape stays a view of the buffer
  return n


def offenders(kernels: Mapping[Node, Kernel], cons: Mapping[Node, list[Node]], realized: set[Node],
               kernels_of: Mapping[Node, int] | None) -> set[Node]:
  new: set[Node] = set()
  for k in kernels.values():
    if k.analysis is None: k.analysis = analysis_of(k.ast)
    an = k.analysis
    stack, seen = [k.node], {k.node}
    while stack:  # top-down: the first offender on each path
      n = stack.pop()
      if n is not k.node and (n in k.offenders or n in k.rendered and (_offends(n, k.rendered[n], an, kernels_of or {})
                                                                        or n.op == "CAT" and _cat_pooled(n, cons, k))):
        new.add(lift(n, cons, realized))
        continue
      if n.op == "CAT" and n in k.rendered: new |= {lift(p, cons, realized) for p in _costly_pieces(n, k, realized)}
      for s in n.src:
        if s not in seen and s not in realized and s.op != "BUFFER" and (s in k.rendered or s in k.offenders):
          seen.add(s); stack.append(s)
  return new - realized


def _cat_pooled(cat: Node, cons: Mapping[Node, list[Node]], k: Kernel) -> bool:
  """Whether kernel k reduces the concatenation over axes other than its own, through elementwise ops of its shape (a
  squeeze-and-excitation's global pool over a mixed conv's branches, MixNet's and GhostNet's). Each element is read once,
  so nothing offends by count; but the kernel's vector runs along the kept concatenation axis, and every lane then
  selected its piece with a clamped index of its own: a gather per lane (a piece from a blocked depthwise conv added a
  division and a remainder by 16 to each), 2,000 scalar loads unrolled in one pool and 3 s to compile it. Realized, the
  concatenation is copied once (in place where its pieces store into it, cat_place) and the pool reads a plain buffer.
  Only where the pool sums POOLED_CAT_MIN elements or more an output: over fewer the copy gathers as much as the pool
  did. A reduction over the concatenation's own axis (a conv's product over concatenated channels) keeps reading it in
  place: its pieces are runs of its K."""
  todo, seen = [cat], {cat}
  while todo:
    for c in cons.get(todo.pop(), []):
      if c in seen or c not in k.rendered: continue
      seen.add(c)
      if c.op == "REDUCE" and cat.arg not in c.arg[1]:
        summed = [cat.shape[a] for a in c.arg[1]]
        if POOLED_CAT_MIN and all(isinstance(d, int) for d in summed) and math.prod(summed) >= POOLED_CAT_MIN: return True
      if c.op == "ALU" and c.shape == cat.shape: todo.append(c)
  return False


def sibling_reductions(k: Kernel) -> list[Node]:
  """The reductions of a settled kernel k side by side with the one it keeps (k's own node where that is a reduction, else the
  first rendered), as many outputs as it and neither reading the other: an MLP's gate and up products read by
  silu(gate) * up. One kernel of two products gets no product's tiling and ran several times slower than each product in
  its own kernel with the elementwise work in the second's epilogue. A chain stays (softmax's sum reads its max, a
  variance its mean), and so does a small one beside a big one (a masked mean's count beside its sum)."""
  reds = [n for n, uops in k.rendered.items() if n.op == "REDUCE" and any(u.op is Ops.REDUCE for u in uops)]
  if len(reds) < 2: return []
  keep = k.node if k.node in reds else reds[0]
  below = {r: _reductions_below(r, k) for r in reds}
  return [r for r in reds if r is not keep and r.max_numel == keep.max_numel and r not in below[keep] and keep not in below[r]]


def _reductions_below(n: Node, k: Kernel) -> set[Node]:
  """The reductions rendered in kernel k that n reads, directly or through other rendered nodes."""
  out: set[Node] = set()
  seen, todo = {n}, [n]
  while todo:
    for s in todo.pop().src:
      if s in seen or s not in k.rendered: continue
      seen.add(s)
      todo.append(s)
      if s.op == "REDUCE": out.add(s)
  return out


def _costly_pieces(cat: Node, k: Kernel, realized: set[Node]) -> list[Node]:
  """The pieces of a concatenation that hold a reduction or a gather, each below its views: a concatenation renders as
  selects among its pieces, and a vector kernel computes every piece for every element (a select is not a branch), so a
  piece's reduction or gathers ran over the whole output (SegFormer's head: a linear layer and three bilinear resizes
  concatenated along the channels, each computed for all 256 channels where it gives 64). Realized, each runs over its
  own piece, and the concatenation selects among loads. Not along an axis the codegen unrolls whole (SELECT_UNROLL: a
  Winograd transform's 16 or 36 stacked sums), where each copy folds to its own piece."""
  if (n := cat.shape[cat.arg]) is not None and isinstance(n, int) and n <= SELECT_UNROLL: return []
  out = []
  for p in cat.src:
    while p.op == "VIEW" and p not in realized: p = p.src[0]
    if p in realized or p.op == "BUFFER" or p not in k.rendered: continue
    seen, todo = {p}, [p]
    while todo:
      n = todo.pop()
      if n.op in ("REDUCE", "GATHER"):
        out.append(p)
        break
      for q in n.src:
        if q not in seen and q not in realized and q in k.rendered: seen.add(q); todo.append(q)
  return out
