"""The packages' modules import each other without a loop, counting the imports inside functions (a lazy import only
hides a loop from Python's import order, not from a reader). The one circle allowed is the IR's: UOp's convenience
methods (`.substitute`, `.simplify`) call the layer's own passes, which take UOps, as tinygrad's do. Imports under `if
TYPE_CHECKING:` are not counted (they never run). Only the source is parsed (ast): nothing is imported."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (importer, imported): the lazy imports in kiln.ir.uop's convenience methods of the passes that import kiln.ir.uop
ALLOWED = {("kiln.ir.uop", "kiln.ir.rewrite"), ("kiln.ir.uop", "kiln.ir.symbolic")}


def module_name(f: Path) -> str:
  parts = f.relative_to(f.parents[len(f.parts) - f.parts.index("src") - 2]).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
  """Every node but those under `if TYPE_CHECKING:`."""
  stack = [tree]
  while stack:
    n = stack.pop()
    yield n
    for c in ast.iter_child_nodes(n):
      if isinstance(c, ast.If) and "TYPE_CHECKING" in ast.unparse(c.test):
        stack.extend(c.orelse)
        continue
      stack.append(c)


def imports(tree: ast.AST, name: str, is_pkg: bool, mods: set[str]) -> set[str]:
  """The package modules this module imports anywhere in its body (module level or inside functions)."""
  out: set[str] = set()
  for n in _runtime_nodes(tree):
    if isinstance(n, ast.Import): out.update(a.name for a in n.names)
    elif isinstance(n, ast.ImportFrom):
      base = n.module or ""
      if n.level:
        pkg = name.split(".") if is_pkg else name.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - (n.level - 1)] + ([base] if base else []))
      subs = [f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in mods]
      out.update(subs if len(subs) == len(n.names) else [*subs, base])  # `from pkg import submodule` imports the submodule
  return {m for m in out if m in mods} - {name}


def import_graph() -> dict[str, set[str]]:
  files = sorted(ROOT.glob("packages/*/src/kiln/**/*.py"))
  names = {f: module_name(f) for f in files}
  mods = set(names.values())
  return {names[f]: imports(ast.parse(f.read_text(), str(f)), names[f], f.name == "__init__.py", mods) for f in files}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's, iterative)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on: set[str] = set()
  out: list[list[str]] = []
  for root in sorted(g):
    if root in index: continue
    work = [(root, iter(sorted(g[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on.add(w)
          work.append((w, iter(sorted(g.get(w, ())))))
        elif w in on: low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work: low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          x = stack.pop()
          on.discard(x)
          comp.append(x)
          if x == v: break
        if len(comp) > 1: out.append(sorted(comp))
  return out


def test_no_import_cycle_between_modules() -> None:
  g = import_graph()
  assert len(g) > 100 and "kiln.ir.uop" in g and "kiln.executor.builder" in g
  for a, b in ALLOWED: assert b in g[a], f"the allowed edge {a} -> {b} is gone: drop it from ALLOWED"
  knots = {frozenset(c) for c in cycles({m: deps - {b for a, b in ALLOWED if a == m} for m, deps in g.items()})}
  assert not knots, "import cycles (lazy imports counted):\n" + "\n".join(" <-> ".join(sorted(c)) for c in knots)


def test_the_cycle_finder_sees_a_lazy_loop() -> None:
  mods = {"p.a", "p.b", "p.c"}
  a = ast.parse("import p.b\n")
  b = ast.parse("def f():\n  from p import c\n")
  c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  import p.b\ndef g():\n  from p.a import x\n")
  g = {"p.a": imports(a, "p.a", False, mods), "p.b": imports(b, "p.b", False, mods), "p.c": imports(c, "p.c", False, mods)}
  assert g == {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
  assert cycles(g) == [["p.a", "p.b", "p.c"]]
  assert cycles({"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.a"}}) == []
