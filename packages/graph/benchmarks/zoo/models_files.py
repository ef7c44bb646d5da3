"""Trained ONNX files that ship inside installed wheels: onnx's `light` model-zoo architectures (real networks, opset 9,
224 px, constant-filled weights) and onnxruntime's example models. Checked as they are, at their fixed sizes."""
from __future__ import annotations

import sysconfig
from pathlib import Path

from zoo.spec import Spec

SITE = Path(sysconfig.get_paths()["purelib"])
GLOBS = ("onnx/backend/test/data/light/*.onnx", "onnxruntime/datasets/*.onnx")

SPECS = [Spec(f"file/{p.parent.parent.name if p.parent.name == 'datasets' else 'onnx'}/{p.stem}", "onnx-file", path=str(p), exporters=())
         for g in GLOBS for p in sorted(SITE.glob(g))]
