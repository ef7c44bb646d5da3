"""Read windows: a kernel that reads only part of a buffer, from an element lo > 0 on, reads a view of that part instead,
its indices rebased to the view's start. Kernels that differ only in where they read (an RNN's steps, each reading its
own time step of one input projection) then render the same AST, and the kernel cache compiles it once (a 200-step
bidirectional LSTM: 403 kernels, each compiled).

| before                                              | after                                                        |
|-----------------------------------------------------|--------------------------------------------------------------|
| slot s: the buffer (n elements), read at i in [lo, hi] | slot s: a view of hi - lo + 1 elements at lo, read at i - lo |

The window comes from the bounds of every index into the slot (the symbolic simplifier's vmin/vmax, so it holds for
any value of a runtime variable). A slot read through a gated index (a pad's bounds test: the raw index may run past
either end, the gate keeps the lanes out) stays whole, as does one the kernel writes, one read from element 0, and one
whose bounds leave the buffer (no window is ever larger than what it views).

A rebased index is simplified, so the same read at two offsets folds to one AST, unless that loses the proof that it stays
inside the window: the simplifier keeps values, not bounds (a CAT piece's clamp min(max(5 - r, 0), 2) becomes
where(3 < r, 5 - r, 2), and a where's bounds are both arms', [0, 5]). Then the index is the plain difference, whose
bounds are exactly the original's moved down by lo."""
from __future__ import annotations

from kiln.ir.dtype import PtrDType
from kiln.ir.ops import Ops
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp

Window = tuple[int, int]  # (first element, element count) of the view a slot reads


def _rebase(i: UOp, lo: int, hi: int) -> UOp:
  """i - lo, simplified where that still proves it in [0, hi - lo]."""
  s = simplify(i - lo)
  return s if isinstance(s.vmin, int) and isinstance(s.vmax, int) and 0 <= s.vmin and s.vmax <= hi - lo else i - lo


def read_windows(ast: UOp) -> tuple[UOp, dict[int, Window]]:
  """The AST with each read-only slot read from an element lo > 0 on rebased to a view, and {slot: (lo, count)}."""
  nodes = ast.toposort()
  stored = {u.src[0].src[0].arg for u in nodes if u.op is Ops.STORE and u.src[0].op is Ops.INDEX}
  by_slot: dict[int, list[UOp]] = {}
  for u in nodes:
    if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL and u.src[0].arg not in stored: by_slot.setdefault(u.src[0].arg, []).append(u)
  windows: dict[int, Window] = {}
  views: dict[int, UOp] = {}
  for slot, idxs in by_slot.items():
    g = idxs[0].src[0]
    if any(len(i.src) > 2 for i in idxs) or not isinstance(g.dtype, PtrDType): continue  # gated: the raw index may leave the buffer
    lo, hi = min(i.src[1].vmin for i in idxs), max(i.src[1].vmax for i in idxs)
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo <= 0 or (g.dtype.size > 0 and hi >= g.dtype.size): continue
    windows[slot] = (lo, hi - lo + 1)
    views[slot] = UOp.define_global(slot, g.dtype.base.ptr(hi - lo + 1))
  if not windows: return ast, windows
  # rebuilt bottom-up, so an index that loads through another windowed read (a gather's index from its indices' buffer)
  # is rebased over the rebased read, never over the whole buffer's (a slot bound to a view must not be read whole)
  new: dict[UOp, UOp] = {}
  for u in nodes:
    src = tuple(new[s] for s in u.src)
    if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL and (w := windows.get(u.src[0].arg)) is not None:
      new[u] = views[u.src[0].arg].index(_rebase(src[1], w[0], w[0] + w[1] - 1), *src[2:])
    else: new[u] = u if all(a is b for a, b in zip(src, u.src)) else u.replace(src=src)
  return new[ast], windows
