"""Every zoo entry, by family, with the module file that defines it (part of its export key)."""
from __future__ import annotations

import importlib

from zoo.spec import Spec

FAMILIES = ("models_tv", "models_timm", "models_hf", "models_hf_tasks", "models_ultralytics", "models_diffusers", "models_smp", "models_files")


def entries() -> list[tuple[Spec, str]]:
  out = []
  for fam in FAMILIES:
    mod = importlib.import_module(f"zoo.{fam}")
    out += [(s, str(mod.__file__)) for s in mod.SPECS]
  names = [s.name for s, _ in out]
  if len(set(names)) != len(names): raise ValueError(f"duplicate zoo names: {sorted({n for n in names if names.count(n) > 1})}")
  return out


def by_name(name: str) -> Spec:
  for s, _ in entries():
    if s.name == name: return s
  raise KeyError(f"no zoo entry {name!r}")
