"""The verifier: dtype and structure rules for every op of a kernel AST, and the static bounds proof of every INDEX.

Iterative throughout (a 10,000-deep graph verifies). Every IRVerifyError names the node: its op, dtype, arg and a short path
from the SINK (`SINK.src[0] STORE .src[0] INDEX`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.errors import IRVerifyError
from kiln.ir.ops import AxisType, GroupOp, Ops
from kiln.ir.symbolic import simplify
from kiln.ir.uop import UOp


class _Ctx:
  def __init__(self, root: UOp, allow_lowered: bool):
    self.root, self.allow_lowered = root, allow_lowered
    self.slots: dict[int, UOp] = {}  # what was defined so far, to reject a second definition
    self.vnames: dict[str, UOp] = {}
    self.axes: dict[Any, UOp] = {}
    self.parent: dict[UOp, tuple[UOp, int]] = {}  # first parent found breadth-first: a shortest path for messages
    q, seen = [root], {root}
    for u in q:
      for i, s in enumerate(u.src):
        if s not in seen: seen.add(s); self.parent[s] = (u, i); q.append(s)

  def path(self, u: UOp, depth: int = 5) -> str:
    steps: list[str] = []
    cur = u
    while cur in self.parent and len(steps) < depth:
      p, i = self.parent[cur]
      steps.append(f".src[{i}] {cur.op.name}")
      cur = p
    head = cur.op.name if cur is self.root else "..."
    return head + "".join(reversed(steps))

  def fail(self, u: UOp, msg: str) -> None:
    arg = "" if u.arg is None else f", arg={u.arg!r}"
    raise IRVerifyError(f"{u.op.name} ({u.dtype}{arg}) at {self.path(u)}: {msg}")


def _sdt(u: UOp) -> DType | None:
  """The scalar value dtype of u, or None for pointers and void."""
  return u.dtype if u.dtype.kind not in "vp" else None


def _check_const(c: _Ctx, u: UOp) -> None:
  dt, v = u.dtype, u.arg
  if u.src: c.fail(u, "a CONST has no sources")
  if dt.kind in "vp" or dt.count != 1: c.fail(u, "a CONST needs a scalar value dtype")
  if dt.is_bool and not isinstance(v, bool): c.fail(u, f"a bool constant must hold a bool, got {v!r}")
  if dt.is_int and (isinstance(v, bool) or not isinstance(v, int) or not dt.min <= v <= dt.max): c.fail(u, f"{v!r} is not a {dt} value")
  if dt.is_float and not isinstance(v, float): c.fail(u, f"a float constant must hold a float, got {v!r}")


def _check_alu(c: _Ctx, u: UOp) -> None:
  op, dt = u.op, u.dtype
  arity = 1 if op in GroupOp.Unary else 2 if op in GroupOp.Binary else 3
  if len(u.src) != arity: c.fail(u, f"{op.name} takes {arity} operand(s), got {len(u.src)}")
  for s in u.src:
    if _sdt(s) is None: c.fail(u, f"operand {s.op.name} has dtype {s.dtype}, not a value (load pointers, index buffers)")
  vals = u.src[1:] if op is Ops.WHERE else u.src
  odt = vals[0].dtype
  if any(s.dtype != odt for s in vals): c.fail(u, f"operands must share one dtype, got {', '.join(str(s.dtype) for s in vals)}")
  if op in GroupOp.Comparison:
    if dt != dtypes.bool.vec(odt.count): c.fail(u, f"a comparison produces bool, not {dt}")
  elif dt != odt: c.fail(u, f"result dtype {dt} differs from the operands' {odt}")
  if op is Ops.WHERE and u.src[0].dtype != dtypes.bool.vec(odt.count): c.fail(u, f"the WHERE condition must be bool, got {u.src[0].dtype}")
  if op in GroupOp.FloatOnly and not odt.is_float: c.fail(u, f"{op.name} takes floats only, got {odt}")
  if op in GroupOp.IntOnly and not odt.is_int: c.fail(u, f"{op.name} takes integers only, got {odt}")
  if op in GroupOp.Bitwise and not (odt.is_int or odt.is_bool): c.fail(u, f"{op.name} takes integers or bools only, got {odt}")
  if op is Ops.NEG and odt.is_bool: c.fail(u, "NEG does not take a bool (use XOR with True)")
  if op is Ops.DOT4 and odt.scalar() != dtypes.int32: c.fail(u, f"DOT4 takes int32 words of four bytes, got {odt}")


def _check_index(c: _Ctx, u: UOp) -> None:
  if len(u.src) not in (2, 3): c.fail(u, f"INDEX takes (buffer, index[, gate]), got {len(u.src)} sources")
  buf, idx = u.src[0], u.src[1]
  if buf.op is not Ops.DEFINE_GLOBAL: c.fail(u, f"INDEX must index a DEFINE_GLOBAL, got {buf.op.name}")
  if u.dtype != buf.dtype: c.fail(u, f"INDEX dtype must be its buffer's {buf.dtype}")
  if (d := _sdt(idx)) is None or not d.is_int or d.count != 1: c.fail(u, f"the index must be a scalar integer, got {idx.dtype}")
  if len(u.src) == 3:
    if u.src[2].dtype != dtypes.bool: c.fail(u, f"the gate must be bool, got {u.src[2].dtype}")
    return  # a gated access never touches memory where the gate is false: no proof needed
  size = buf.dtype.size  # type: ignore[attr-defined]
  if size < 0: return
  lo, hi = idx.vmin, idx.vmax
  if lo >= 0 and hi < size: return
  s = simplify(idx)  # vmin/vmax of the raw graph can be loose; a simplified index (same value) may prove more
  if s.vmin >= 0 and s.vmax < size: return
  c.fail(u, f"index into slot {buf.arg} is proven only in [{lo}, {hi}] but the buffer has {size} elements (valid: [0, {size - 1}]); "
            "fix the index or gate the access")


def _check_sink(c: _Ctx, u: UOp) -> None:
  if u is not c.root: c.fail(u, "a SINK may only be the root of a kernel")
  if u.dtype != dtypes.void: c.fail(u, "a SINK has dtype void")
  for i, s in enumerate(u.src):
    if s.op is not Ops.STORE: c.fail(u, f"a SINK holds STOREs only; src[{i}] is {s.op.name} ({s.dtype})")


def _check_define_global(c: _Ctx, u: UOp) -> None:
  if not isinstance(u.dtype, PtrDType) or u.src: c.fail(u, "a DEFINE_GLOBAL has a pointer dtype and no sources")
  if isinstance(u.arg, bool) or not isinstance(u.arg, int) or u.arg < 0: c.fail(u, "the slot must be an int >= 0")
  if (o := c.slots.setdefault(u.arg, u)) is not u: c.fail(u, f"slot {u.arg} is also defined as {o.dtype}: one DEFINE_GLOBAL per slot")


def _check_define_var(c: _Ctx, u: UOp) -> None:
  if not (isinstance(u.arg, tuple) and len(u.arg) == 3 and isinstance(u.arg[0], str)): c.fail(u, "a DEFINE_VAR arg is (name, min, max)")
  if (d := _sdt(u)) is None or not d.is_int or u.src: c.fail(u, "a DEFINE_VAR is an integer with no sources")
  name, lo, hi = u.arg
  if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi): c.fail(u, f"variable {name} needs int bounds min <= max")
  if (o := c.vnames.setdefault(name, u)) is not u: c.fail(u, f"variable {name} is also defined as [{o.arg[1]}, {o.arg[2]}] ({o.dtype})")


def _check_bind(c: _Ctx, u: UOp) -> None:
  if len(u.src) != 2 or u.src[0].op is not Ops.DEFINE_VAR or u.src[1].op is not Ops.CONST: c.fail(u, "a BIND is (DEFINE_VAR, CONST)")
  v, k = u.src
  if not (u.dtype == v.dtype == k.dtype): c.fail(u, f"BIND dtypes differ: {u.dtype}, variable {v.dtype}, value {k.dtype}")
  if not v.arg[1] <= k.arg <= v.arg[2]: c.fail(u, f"variable {v.arg[0]}={k.arg} is outside bounds [{v.arg[1]}, {v.arg[2]}]")


def _check_range(c: _Ctx, u: UOp) -> None:
  if len(u.src) != 1 or (d := _sdt(u.src[0])) is None or not d.is_int: c.fail(u, "a RANGE has one integer end")
  if (d := _sdt(u)) is None or not d.is_int: c.fail(u, "a RANGE has an integer dtype")
  if not (isinstance(u.arg, tuple) and len(u.arg) == 2 and isinstance(u.arg[1], AxisType)): c.fail(u, "a RANGE arg is (axis_id, AxisType)")
  if any(n.op is Ops.RANGE for n in u.src[0].toposort()): c.fail(u, "a RANGE end may not depend on another RANGE")
  if (o := c.axes.setdefault(u.arg[0], u)) is not u:
    c.fail(u, f"axis id {u.arg[0]} is also used by a RANGE with end {o.src[0]!r} ({o.arg[1]}): one range per axis id")


def _check_load(c: _Ctx, u: UOp) -> None:
  if len(u.src) != 1 or u.src[0].op is not Ops.INDEX: c.fail(u, "a LOAD loads one INDEX")
  if u.dtype != u.src[0].dtype.base: c.fail(u, f"a LOAD from a {u.src[0].dtype} buffer has dtype {u.src[0].dtype.base}")  # type: ignore[attr-defined]


def _check_store(c: _Ctx, u: UOp) -> None:
  if len(u.src) != 2 or u.src[0].op is not Ops.INDEX: c.fail(u, "a STORE is (INDEX, value)")
  if u.dtype != dtypes.void: c.fail(u, "a STORE has dtype void")
  base = u.src[0].dtype.base  # type: ignore[attr-defined]
  if u.src[1].dtype != base: c.fail(u, f"stores a {u.src[1].dtype} value into a {base} buffer (slot {u.src[0].src[0].arg}); cast it")


def _check_reduce(c: _Ctx, u: UOp) -> None:
  if u.arg not in GroupOp.ReduceOps: c.fail(u, f"the reduce op must be ADD, MUL or MAX, got {u.arg!r}")
  if len(u.src) < 2: c.fail(u, "a REDUCE closes at least one RANGE")
  for i, r in enumerate(u.src[1:], 1):
    if r.op is not Ops.RANGE: c.fail(u, f"REDUCE sources after the value must be RANGEs; src[{i}] is {r.op.name}")
  if _sdt(u.src[0]) is None or u.dtype != u.src[0].dtype: c.fail(u, f"a REDUCE has its value's dtype ({u.src[0].dtype})")


def _check_cast(c: _Ctx, u: UOp) -> None:
  if len(u.src) != 1 or (sd := _sdt(u.src[0])) is None or (d := _sdt(u)) is None: c.fail(u, "a CAST converts one value to a value dtype")
  elif sd.count != d.count: c.fail(u, f"a CAST may not change the vector width ({sd} -> {d})")


def _check_bitcast(c: _Ctx, u: UOp) -> None:
  if len(u.src) != 1 or (sd := _sdt(u.src[0])) is None or (d := _sdt(u)) is None: c.fail(u, "a BITCAST reinterprets one value")
  elif sd.nbytes != d.nbytes: c.fail(u, f"a BITCAST needs equal sizes ({sd}: {sd.nbytes} bytes, {d}: {d.nbytes} bytes)")


def _check_lowered(c: _Ctx, u: UOp) -> None:
  if not c.allow_lowered: c.fail(u, f"{u.op.name} appears only after lowering, not in a kernel AST")


# op -> the rule its nodes must satisfy; an op with no rule is unknown to kernel ASTs
_RULES: dict[Ops, Callable[[_Ctx, UOp], None]] = {
  Ops.SINK: _check_sink, Ops.DEFINE_GLOBAL: _check_define_global, Ops.DEFINE_VAR: _check_define_var, Ops.BIND: _check_bind,
  Ops.CONST: _check_const, Ops.RANGE: _check_range, Ops.INDEX: _check_index, Ops.LOAD: _check_load, Ops.STORE: _check_store,
  Ops.REDUCE: _check_reduce, Ops.CAST: _check_cast, Ops.BITCAST: _check_bitcast,
  **dict.fromkeys(GroupOp.ALU, _check_alu), **dict.fromkeys(GroupOp.Lowered, _check_lowered),
}


def _check_node(c: _Ctx, u: UOp) -> None:
  if (rule := _RULES.get(u.op)) is None: c.fail(u, f"unknown op {u.op!r}")
  else: rule(c, u)
  if u.op is not Ops.SINK and any(s.op is Ops.STORE for s in u.src): c.fail(u, "a STORE may only be a source of the SINK")


def verify(ast: UOp, allow_lowered: bool = False) -> None:
  """Check a kernel AST (a SINK of STOREs); raise IRVerifyError naming the first offending node. allow_lowered admits SPECIAL & co."""
  if not isinstance(ast, UOp): raise IRVerifyError(f"verify() needs a UOp, got {type(ast).__name__}")
  c = _Ctx(ast, allow_lowered)
  if ast.op is not Ops.SINK: c.fail(ast, "a kernel's root must be a SINK of STOREs")
  for u in ast.toposort(): _check_node(c, u)
