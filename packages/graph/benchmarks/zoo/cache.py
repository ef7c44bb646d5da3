"""Where the zoo keeps its work (.zoo-cache/ at the repo root, which ignores itself in git): onnx/<model>/ holds a model's
exports and feeds, results/<model>.json its check results. A model is exported again only when its export key changes (the
torch-side versions, its family's module, the export code) and checked again only when its check key does (kiln's source
tree, the check code, the export, the thread count), or with --force."""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from zoo.spec import Spec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
TORCH_SIDE = ("torch", "torchvision", "timm", "transformers", "onnxscript", "onnx")
SKIP_SUFFIXES = {".so", ".pyc", ".o"}


def cache_dir(path: str | None) -> Path:
  d = Path(path) if path else ROOT / ".zoo-cache"
  d.mkdir(parents=True, exist_ok=True)
  if not (d / ".gitignore").exists(): (d / ".gitignore").write_text("*\n")  # never committed, whatever the repo's .gitignore says
  return d


def safe(name: str) -> str: return name.replace("/", "__")


def _sha(*parts: bytes | str) -> str:
  h = hashlib.sha256()
  for p in parts:
    b = p.encode() if isinstance(p, str) else p
    h.update(len(b).to_bytes(8, "little") + b)
  return h.hexdigest()[:24]


def kiln_tree_hash() -> str:
  """Every source file of the layers (packages/*/src), committed or not: a change anywhere in kiln reruns the checks."""
  parts: list[bytes | str] = []
  for f in sorted((ROOT / "packages").glob("*/src/**/*")):
    if f.is_file() and f.suffix not in SKIP_SUFFIXES and "__pycache__" not in f.parts:
      parts += [str(f.relative_to(ROOT)), f.read_bytes()]
  return _sha(*parts)


def versions() -> str:
  out = []
  for p in TORCH_SIDE:
    try: out.append(f"{p}={metadata.version(p)}")
    except metadata.PackageNotFoundError: out.append(f"{p}=-")
  return " ".join(out)


def export_key(spec: Spec, module_file: str) -> str:
  if spec.path: return _sha(spec.name, Path(spec.path).read_bytes())
  code = [(HERE / f).read_bytes() for f in ("spec.py", "export.py", "tvshim.py")]
  return _sha(spec.name, versions(), Path(module_file).read_bytes(), *code)


def check_key(tree: str, export: str, threads: int) -> str:
  """What a check's result depends on: kiln's tree, the export, the threads, the CPU kiln compiles for (KILN_CPU), OpenVINO's ISA
  ceiling, the check code."""
  isa = os.environ.get("KILN_CPU", ""), os.environ.get("ONEDNN_MAX_CPU_ISA", "")
  return _sha(tree, export, str(threads), *isa, (HERE / "check.py").read_bytes(), (HERE / "spec.py").read_bytes())


def read_json(path: Path) -> Any:
  try: return json.loads(path.read_text())
  except (OSError, ValueError): return None


def write_json(path: Path, obj: Any) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, path)
