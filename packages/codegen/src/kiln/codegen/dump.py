"""KILN_DUMP_AST: what a named pass of the compile pipeline made (an AST, the options, the axis plans, the linear program, the
source), printed to stderr as the pipeline runs. `show(name, value)` is how the pipeline names its passes; it returns value.

An AST or a linear program prints one node a line, each after its sources: its number, op, dtype, its sources' numbers
(a constant the list does not hold by its value) and its arg."""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, TypeVar

from kiln.codegen import settings
from kiln.ir.errors import SettingError
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp

T = TypeVar("T")

# the passes the pipeline shows, in its order (kiln.codegen.pipeline's docstring says what each makes)
PASSES = ("verify", "widen", "tiling", "prepare", "opts", "peel", "plan", "linearize", "print")


def wanted() -> frozenset[str]:
  """The passes KILN_DUMP_AST names (`all`: every one); a SettingError naming the variable for a name that is no pass."""
  text = settings.DUMP_AST.get()
  if not text: return frozenset()
  names = {n.strip() for n in text.split(",") if n.strip()}
  if "all" in names: return frozenset(PASSES)
  if bad := sorted(names - set(PASSES)):
    raise SettingError(f"KILN_DUMP_AST names no pass {', '.join(bad)}: the pipeline's passes are {', '.join(PASSES)} (or all)")
  return frozenset(names)


def show(name: str, value: T) -> T:
  """value, printed to stderr first when KILN_DUMP_AST names the pass `name`."""
  assert name in PASSES, name
  if name in wanted(): print(f"kiln: after {name}\n{describe(value)}", file=sys.stderr, flush=True)
  return value


def describe(value: Any) -> str:
  if isinstance(value, UOp): return uop_lines(value.toposort())
  if isinstance(value, list) and value and all(isinstance(u, UOp) for u in value): return uop_lines(value)
  if isinstance(value, list): return "  " + (", ".join(str(o) for o in value) or "no options")
  if isinstance(value, tuple) and value and isinstance(value[0], dict): return _plans(value[0])  # plan_axes' (plans, vec)
  src = getattr(value, "src", None)  # a ProgramSpec: its source
  return src if isinstance(src, str) else f"  {value}"


def uop_lines(nodes: list[UOp]) -> str:
  at = {u: i for i, u in enumerate(nodes)}
  def ref(s: UOp) -> str: return str(at[s]) if s in at else repr(s.arg) if s.op is Ops.CONST else s.op.name
  return "\n".join(f"{i:5d} {u.op.name:<14} {u.dtype!s:<12} [{', '.join(ref(s) for s in u.src)}] {u.arg!r}" for i, u in enumerate(nodes))


def _plans(plans: dict[UOp, Any]) -> str:
  """Each axis's plan: the fields its options set (the rest are their defaults)."""
  lines = []
  for r, p in plans.items():
    set_ = [f"{f.name}={getattr(p, f.name)}" for f in dataclasses.fields(p) if f.name not in ("rng", "ev") and getattr(p, f.name) != f.default]
    lines.append(f"  axis {r.arg[0]} ({r.arg[1].name.lower()}): {', '.join(set_) or 'a plain loop'}")
  return "\n".join(lines)
