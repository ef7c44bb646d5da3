"""Each distribution declares exactly what its source imports, and imports point down the layer table only.

Static and fast (no venv, no network): every file under a package's src/ is parsed with `ast`, and every import
(`import x`, `from x import y`, relative imports, and `importlib.import_module("x")` / `__import__("x")` with a literal
name) is mapped to the distribution that provides it. Then, per package:

- an import of another distribution must be declared in `[project].dependencies` (the standard library is free);
- a distribution declared only in an extra (pycuda, the `driver` extra) may be imported only lazily (inside a function)
  or guarded (inside `try: ... except ImportError`), never at module level; the same holds for the few optional probes
  listed in OPTIONAL_PROBES with their reasons (`kiln info` reporting llvmlite's version; the benchmark's peers live
  outside src/, in packages/executor/benchmarks and benchmarks/);
- every declared dependency, and every extra's, must be imported somewhere (no dead requirements);
- a kiln layer imports only the layers below it (docs/architecture.md): kiln.ir nothing, kiln.codegen only kiln.ir, a
  runtime kiln.ir and kiln.codegen (never another runtime or the executor), the executor kiln.ir and kiln.codegen
  (it finds runtimes through the entry-point group `kiln.devices`), the graph layer kiln.ir, kiln.codegen and the executor,
  kiln.llm (language models) the graph layer and those below it.

And for the family: one version (every version.py and the meta-package's agree), sibling requirements are compatible
ranges that contain it, and the meta-package pins the exact set.

`test_checker_catches_a_bad_package` runs the same checker over a deliberately bad package, so this test can fail.
tests/test_layers_install.py checks the other side: that each layer really installs and imports alone."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Package:
  folder: str  # under packages/
  dist: str
  module: str  # its import package
  may_import: frozenset[str]  # the kiln distributions it may import (the layers below it)


IR, CODEGEN, CPU, CUDA, EXECUTOR, GRAPH = "kiln-uop-ir", "kiln-codegen", "kiln-runtime-cpu", "kiln-runtime-cuda", "kiln-executor", "kiln-graph"
DISTRIBUTED, LLM = "kiln-distributed", "kiln-llm"
PACKAGES = [
  Package("uop-ir", IR, "kiln.ir", frozenset()),
  Package("codegen", CODEGEN, "kiln.codegen", frozenset({IR})),
  Package("runtime-cpu", CPU, "kiln.runtime.cpu", frozenset({IR, CODEGEN})),
  Package("runtime-cuda", CUDA, "kiln.runtime.cuda", frozenset({IR, CODEGEN})),
  Package("executor", EXECUTOR, "kiln.executor", frozenset({IR, CODEGEN})),
  Package("graph", GRAPH, "kiln.graph", frozenset({IR, CODEGEN, EXECUTOR})),
  Package("distributed", DISTRIBUTED, "kiln.distributed", frozenset({IR, EXECUTOR})),
  Package("llm", LLM, "kiln.llm", frozenset({IR, CODEGEN, EXECUTOR, GRAPH})),
]
KILN_MODULES = {p.module: p.dist for p in PACKAGES}
KILN_NAMESPACES = {"kiln", "kiln.runtime"}  # PEP 420 namespaces: importing them names no distribution
THIRD_PARTY = {"numpy": "numpy", "pydantic": "pydantic", "pydantic_core": "pydantic-core", "llvmlite": "llvmlite", "pycuda": "pycuda",
               "numba": "numba", "tinygrad": "tinygrad", "threadpoolctl": "threadpoolctl", "onnx": "onnx",
               "ray": "ray", "tqdm": "tqdm", "cuda": "cuda-python", "gguf": "gguf", "tokenizers": "tokenizers", "jinja2": "jinja2",
               "onnxruntime": "onnxruntime", "openvino": "openvino"}
# distributions that must never be a base dependency: only this extra of this package may declare them
EXTRA_ONLY = {"pycuda": (CUDA, "driver"), "onnx": (GRAPH, "onnx"), "cuda-python": (CUDA, "cuda-python")}
# undeclared distributions a package may import lazily or guarded (never at module level), each with its reason;
# anything else undeclared fails
OPTIONAL_PROBES = {
  (EXECUTOR, "llvmlite"): "`kiln info` prints the LLVM version when kiln-runtime-cpu (and so llvmlite) is installed, inside try/except ImportError",
  (GRAPH, "onnxruntime"): "`kiln bench --compare` times onnxruntime beside kiln when the user has it installed (a peer, never a dependency)",
  (GRAPH, "openvino"): "`kiln bench --compare` times OpenVINO beside kiln when the user has it installed (a peer, never a dependency)",
}
IMPORT_FUNCS = {"import_module", "__import__"}


@dataclass(frozen=True)
class Imp:
  module: str
  where: str  # file:line
  kind: str  # "eager" (module level), "lazy" (inside a function), "guarded" (try/except ImportError), "typing" (if TYPE_CHECKING)


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
  if handler.type is None: return True
  types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
  names = {t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "" for t in types}
  return bool(names & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def scan_file(path: Path, module: str, is_pkg: bool, rel: str) -> list[Imp]:
  """Every import in one file. `module` is the file's dotted name (for relative imports), `rel` the path to report."""
  out: list[Imp] = []
  package = module if is_pkg else module.rpartition(".")[0]

  def add(name: str, node: ast.AST, kind: str) -> None:
    out.append(Imp(name, f"{rel}:{getattr(node, 'lineno', 0)}", kind))

  def visit(node: ast.AST, kind: str) -> None:
    if isinstance(node, ast.Import):
      for a in node.names: add(a.name, node, kind)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        name = ".".join(base + ([node.module] if node.module else []))
      else:
        name = node.module or ""
      if name in KILN_NAMESPACES:  # `from kiln import codegen` imports the module kiln.codegen
        for a in node.names: add(f"{name}.{a.name}", node, kind)
      else:
        add(name, node, kind)
    elif isinstance(node, ast.Call):
      f = node.func
      fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
      if fname in IMPORT_FUNCS and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        if not node.args[0].value.startswith("."): add(node.args[0].value, node, kind)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
      inner = kind if kind in ("guarded", "typing") else "lazy"
      for child in ast.iter_child_nodes(node): visit(child, inner)
    elif isinstance(node, ast.Try | ast.TryStar):
      guarded = "guarded" if any(_catches_import_error(h) for h in node.handlers) and kind != "typing" else kind
      for child in node.body: visit(child, guarded)
      for child in [*node.handlers, *node.orelse, *node.finalbody]: visit(child, kind)
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
      for child in node.body: visit(child, "typing")
      for child in node.orelse: visit(child, kind)
    else:
      for child in ast.iter_child_nodes(node): visit(child, kind)

  visit(ast.parse(path.read_text(), filename=str(path)), "eager")
  return out


def scan_package(src: Path) -> list[Imp]:
  """Every import under a src/ folder."""
  imps: list[Imp] = []
  for f in sorted(src.rglob("*.py")):
    parts = f.relative_to(src).with_suffix("").parts
    is_pkg = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_pkg else parts)
    imps += scan_file(f, module, is_pkg, str(f.relative_to(src.parent)))
  return imps


def dist_of(module: str) -> str | None:
  """The distribution that provides `module`: None for the standard library and the kiln namespaces; raises for an unknown one."""
  if module in KILN_NAMESPACES: return None
  if module == "kiln" or module.startswith("kiln."):
    for prefix in sorted(KILN_MODULES, key=len, reverse=True):
      if module == prefix or module.startswith(prefix + "."): return KILN_MODULES[prefix]
    raise KeyError(f"{module} is in no kiln distribution")
  top = module.split(".")[0]
  if top in sys.stdlib_module_names or top == "__future__": return None
  if top in THIRD_PARTY: return THIRD_PARTY[top]
  raise KeyError(f"{module}: unknown top-level module {top!r} (add it to THIRD_PARTY with its distribution)")


def _requirements(pyproject: dict) -> tuple[dict[str, Requirement], dict[str, dict[str, Requirement]]]:
  proj = pyproject["project"]
  base = {_norm(r.name): r for r in map(Requirement, proj.get("dependencies", []))}
  extras = {e: {_norm(r.name): r for r in map(Requirement, reqs)} for e, reqs in proj.get("optional-dependencies", {}).items()}
  return base, extras


def check_package(pkg: Package, folder: Path) -> list[str]:
  """Every problem with one package's declared dependencies against its imports, as readable lines (empty: fine)."""
  problems: list[str] = []
  pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
  base, extras = _requirements(pyproject)
  in_extra = {d: e for e, reqs in extras.items() for d in reqs}
  by_dist: dict[str, list[Imp]] = {}
  for imp in scan_package(folder / "src"):
    try: d = dist_of(imp.module)
    except KeyError as e:
      problems.append(f"{pkg.dist}: {imp.where}: {e.args[0]}")
      continue
    if d is not None and d != pkg.dist: by_dist.setdefault(_norm(d), []).append(imp)
  for d, imps in sorted(by_dist.items()):
    first = ", ".join(sorted({f"{i.where} ({i.module})" for i in imps})[:3])
    if d.startswith("kiln-"):
      if d not in pkg.may_import:
        problems.append(f"{pkg.dist}: imports {d} from a layer above or beside it (allowed: {sorted(pkg.may_import) or 'no kiln package'}): {first}")
      elif d not in base:
        problems.append(f"{pkg.dist}: imports {d} but does not declare it in [project].dependencies: {first}")
      continue
    if d in base: continue
    if d in in_extra:
      eager = [i for i in imps if i.kind == "eager"]
      if eager:
        problems.append(f"{pkg.dist}: {d} is only in the extra [{in_extra[d]}] but is imported at module level (import it lazily): "
                        + ", ".join(sorted({i.where for i in eager})))
      continue
    if (pkg.dist, d) in OPTIONAL_PROBES and all(i.kind != "eager" for i in imps): continue
    problems.append(f"{pkg.dist}: imports {d} but does not declare it: {first}")
  for d in sorted(base):
    if d not in by_dist: problems.append(f"{pkg.dist}: declares {d} in [project].dependencies but never imports it")
    if d in EXTRA_ONLY: problems.append(f"{pkg.dist}: {d} must not be a base dependency (only the extra [{EXTRA_ONLY[d][1]}] of {EXTRA_ONLY[d][0]})")
  for d, ex in sorted(in_extra.items()):
    if d.startswith("kiln-"): continue  # an extra of a sibling (kiln[cuda]) re-exports it; nothing to import
    if d not in by_dist: problems.append(f"{pkg.dist}: declares {d} in the extra [{ex}] but never imports it")
    if d in EXTRA_ONLY and EXTRA_ONLY[d] != (pkg.dist, ex):
      problems.append(f"{pkg.dist}: {d} belongs only in the extra [{EXTRA_ONLY[d][1]}] of {EXTRA_ONLY[d][0]}")
  for d, (owner, extra) in EXTRA_ONLY.items():
    if pkg.dist == owner and d not in extras.get(extra, {}): problems.append(f"{pkg.dist}: the extra [{extra}] must declare {d}")
  return problems


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.folder)
def test_declared_dependencies_match_imports(pkg: Package) -> None:
  problems = check_package(pkg, ROOT / "packages" / pkg.folder)
  assert not problems, "\n".join(problems)


def test_every_package_folder_is_listed() -> None:
  folders = {p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")}
  assert folders == {p.folder for p in PACKAGES}, "a package folder is missing from PACKAGES (or PACKAGES names one that is gone)"


# --- the family's versions -----------------------------------------------------------------------------------------------


def _version_of(path: Path) -> str:
  """__version__ from a version.py, read with ast (the way hatch reads it: no import)."""
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
      assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str), f"{path}: __version__ must be a string literal"
      return node.value.value
  raise AssertionError(f"{path}: no __version__")


def _hatch_version_file(folder: Path) -> Path:
  pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
  assert "version" in pyproject["project"].get("dynamic", []), f"{folder}: the version must be dynamic (read from version.py)"
  assert "version" not in pyproject["project"], f"{folder}: a static [project].version would shadow version.py"
  return folder / pyproject["tool"]["hatch"]["version"]["path"]


def family_versions() -> dict[str, str]:
  out = {}
  for p in PACKAGES:
    folder = ROOT / "packages" / p.folder
    path = _hatch_version_file(folder)
    assert path == folder / "src" / Path(*p.module.split(".")) / "version.py", f"{p.dist}: [tool.hatch.version] must read its own version.py"
    out[p.dist] = _version_of(path)
  out["kiln"] = _version_of(_hatch_version_file(ROOT))
  return out


def test_versions_agree() -> None:
  versions = family_versions()
  assert len(set(versions.values())) == 1, f"the family's versions disagree: {versions}"
  Version(versions["kiln"])  # a valid PEP 440 version


def _compatible_range(v: Version) -> SpecifierSet:
  """The range a layer accepts of a sibling at version v: same minor while 0.x, same major from 1.0."""
  upper = f"{v.major}.{v.minor + 1}" if v.major == 0 else f"{v.major + 1}.0"
  return SpecifierSet(f">={v.major}.{v.minor},<{upper}")


def test_sibling_requirements_are_compatible_ranges() -> None:
  version = Version(family_versions()["kiln"])
  want = _compatible_range(version)
  for p in PACKAGES:
    base, extras = _requirements(tomllib.loads((ROOT / "packages" / p.folder / "pyproject.toml").read_text()))
    for req in [*base.values(), *(r for reqs in extras.values() for r in reqs.values())]:
      if not _norm(req.name).startswith("kiln"): continue
      assert req.specifier == want, f"{p.dist}: requires {req}; siblings take the compatible range {want}"
      assert version in req.specifier, f"{p.dist}: {req} excludes the family's own version {version}"


def test_meta_package_pins_the_family() -> None:
  version = family_versions()["kiln"]
  base, extras = _requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
  core = {p.dist for p in PACKAGES} - {DISTRIBUTED, LLM}  # Ray is heavy: kiln-distributed is the extra kiln[distributed]; kiln-llm kiln[llm]
  assert set(base) == core, f"the meta-package must depend on exactly the six core layers, has {sorted(base)}"
  for d, req in base.items():
    assert str(req.specifier) == f"=={version}" and not req.extras and req.marker is None, f"kiln: {req} must be {d}=={version}"
  cuda = extras.get("cuda", {})
  assert set(cuda) == {CUDA} and str(cuda[CUDA].specifier) == f"=={version}" and cuda[CUDA].extras == {"driver"}, \
    f"kiln[cuda] must be {CUDA}[driver]=={version}, is {[str(r) for r in cuda.values()]}"
  dist = extras.get("distributed", {})
  assert set(dist) == {DISTRIBUTED} and str(dist[DISTRIBUTED].specifier) == f"=={version}", \
    f"kiln[distributed] must be {DISTRIBUTED}=={version}, is {[str(r) for r in dist.values()]}"
  llm = extras.get("llm", {})
  assert set(llm) == {LLM} and str(llm[LLM].specifier) == f"=={version}", f"kiln[llm] must be {LLM}=={version}, is {[str(r) for r in llm.values()]}"


# --- packaging metadata that every distribution carries --------------------------------------------------------------


@pytest.mark.parametrize("folder", [*(f"packages/{p.folder}" for p in PACKAGES), "."], ids=lambda f: f.rpartition("/")[2] or "meta")
def test_packaging_metadata(folder: str) -> None:
  d = ROOT / folder
  pyproject = tomllib.loads((d / "pyproject.toml").read_text())
  proj = pyproject["project"]
  assert pyproject["build-system"]["build-backend"] == "hatchling.build"
  assert proj["requires-python"] == ">=3.11"
  assert proj["license"] == "MIT" and proj.get("license-files") == ["LICENSE"] and (d / "LICENSE").is_file()
  assert "MIT License" in (d / "LICENSE").read_text()
  assert proj["readme"] == "README.md" and (d / "README.md").is_file()
  assert (d / "CHANGELOG.md").is_file(), f"{folder}: no CHANGELOG.md"
  classifiers = set(proj.get("classifiers", []))
  assert {"Programming Language :: Python :: 3.11", "Development Status :: 3 - Alpha"} <= classifiers
  assert ("Typing :: Typed" in classifiers) == (folder != "."), "the layers ship py.typed; the meta-package ships no code"
  assert not any(c.startswith("License ::") for c in classifiers), "the license is the SPDX expression; license classifiers are deprecated"


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.folder)
def test_py_typed_and_namespace(pkg: Package) -> None:
  src = ROOT / "packages" / pkg.folder / "src"
  assert (src / Path(*pkg.module.split(".")) / "py.typed").is_file(), f"{pkg.dist}: no py.typed in {pkg.module}"
  for ns in KILN_NAMESPACES:
    assert not (src / Path(*ns.split(".")) / "__init__.py").exists(), f"{pkg.dist}: {ns} must stay a PEP 420 namespace (no __init__.py)"


def test_meta_package_ships_no_code() -> None:
  wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
  assert wheel.get("bypass-selection") is True and not wheel.get("packages") and not wheel.get("include")


# --- the checker itself can fail -------------------------------------------------------------------------------------

BAD_PYPROJECT = """
[project]
name = "kiln-codegen"
dependencies = ["kiln-uop-ir>=0.1,<0.2", "pydantic>=2", "requests"]
[project.optional-dependencies]
driver = ["pycuda"]
"""
BAD_SOURCE = '''
import importlib
import json
import numpy as np                          # undeclared
import pycuda.driver                        # extra only (and another package's extra), at module level
from kiln.executor import plan              # a layer above
from kiln import runtime                    # namespace: fine
from ..ir import uop                        # relative, resolves to kiln.ir: declared, fine
try:
  import llvmlite                           # guarded but undeclared (the probe allowance is the executor's only)
except ImportError:
  llvmlite = None

def lazy():
  importlib.import_module("kiln.runtime.cpu.device")   # beside it, by name
  import yaml                               # unknown module
'''


def test_checker_catches_a_bad_package(tmp_path: Path) -> None:
  (tmp_path / "pyproject.toml").write_text(BAD_PYPROJECT)
  mod = tmp_path / "src" / "kiln" / "codegen"
  mod.mkdir(parents=True)
  (mod / "bad.py").write_text(BAD_SOURCE)
  problems = "\n".join(check_package(Package("codegen", CODEGEN, "kiln.codegen", frozenset({IR})), tmp_path))
  expected = [
    r"imports numpy but does not declare it: src/kiln/codegen/bad.py:4 \(numpy\)",
    r"pycuda is only in the extra \[driver\] but is imported at module level.*bad.py:5",
    r"imports kiln-executor from a layer above or beside it.*bad.py:6",
    r"imports kiln-runtime-cpu from a layer above or beside it.*bad.py:15 \(kiln.runtime.cpu.device\)",
    r"imports llvmlite but does not declare it: .*bad.py:10",
    r"bad.py:16: yaml: unknown top-level module 'yaml'",
    r"declares pydantic in \[project\].dependencies but never imports it",
    r"declares requests in \[project\].dependencies but never imports it",
    r"pycuda belongs only in the extra \[driver\] of kiln-runtime-cuda",
  ]
  for pattern in expected: assert re.search(pattern, problems), f"checker missed: {pattern}\n--- it said:\n{problems}"
  assert "imports kiln-uop-ir" not in problems and "json" not in problems and "(kiln.runtime)" not in problems, problems
  assert len(problems.splitlines()) == len(expected), problems


def test_checker_passes_a_good_package(tmp_path: Path) -> None:
  (tmp_path / "pyproject.toml").write_text('[project]\nname = "kiln-runtime-cuda"\ndependencies = ["kiln-codegen>=0.1,<0.2", "numpy"]\n'
                                           '[project.optional-dependencies]\ndriver = ["pycuda"]\ncuda-python = ["cuda-python"]\n')
  mod = tmp_path / "src" / "kiln" / "runtime" / "cuda"
  mod.mkdir(parents=True)
  (mod / "ok.py").write_text("from __future__ import annotations\nimport importlib\nimport numpy\nfrom kiln.codegen import spec\n"
                             "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  import pycuda\n"
                             "def f():\n  return importlib.import_module('pycuda.driver')\n"
                             "def g():\n  return importlib.import_module('cuda.bindings.driver')\n")
  pkg = Package("runtime-cuda", CUDA, "kiln.runtime.cuda", frozenset({IR, CODEGEN}))
  assert check_package(pkg, tmp_path) == []
  # the same package with pycuda moved from the extra into the base dependencies
  (tmp_path / "pyproject.toml").write_text('[project]\nname = "kiln-runtime-cuda"\ndependencies = ["kiln-codegen>=0.1,<0.2", "numpy", "pycuda"]\n')
  problems = check_package(pkg, tmp_path)
  assert any("pycuda must not be a base dependency" in p for p in problems), problems
  assert any("the extra [driver] must declare pycuda" in p for p in problems), problems
