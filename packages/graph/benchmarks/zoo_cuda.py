"""The zoo's exports on kiln's CUDA path, on the emulated GPU of tests/cuda_emu.py (issue 40): every model the zoo has
exported (scripts/zoo fills .zoo-cache/onnx/) loaded with device="CUDA" and run with the zoo's feeds, against the same
export on kiln's CPU. A correctness sweep, not a timing: each kernel's CUDA C runs on the CPU (slowly), so it shows what a
GPU would compute, never how fast. Needs pytest (the emulated driver is the test suite's), so run it with the dev python:

  python packages/graph/benchmarks/zoo_cuda.py [--only REGEX] [--exports dynamo-fixed,dynamo-dynamic] [--cache DIR]

Each export prints one line: OK with its largest error relative to the output's scale (and the launches), or FAIL with the
error. Dynamic exports run at the zoo's resized feeds with the bounds the zoo gives their axes. KILN_CUDA_TF32=1 checks the
TF32 kernels instead (their error is TF32's, about 1e-3 a product)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[2] / "tests"))


def _feeds(d: Path, dynamic: bool) -> dict[str, np.ndarray]:
  feeds = dict(np.load(d / "feeds.npz"))
  resized = {k.split(":", 1)[1]: v for k, v in feeds.items() if k.startswith("resized:")}
  return resized if dynamic and resized else {k: v for k, v in feeds.items() if not k.startswith("resized:")}


def _outputs(out: object) -> list[np.ndarray]:
  return [np.asarray(v) for v in (out.values() if isinstance(out, dict) else out)]  # type: ignore[attr-defined]


def check(d: Path, export: str) -> str:
  """One export's line."""
  import pytest
  from cuda_emu import emulated_gpu
  from zoo.check import dims_of

  from kiln.graph import onnx as konnx
  f = d / f"{export}.onnx"
  dynamic = "dynamic" in export
  axes = json.loads((d / "export.json").read_text()).get("axes") if dynamic else None
  dims = dims_of(f.read_bytes(), axes) if axes else None
  feeds = _feeds(d, dynamic)
  t = time.perf_counter()
  cpu = konnx.load(str(f), dims=dims)
  feeds = {i.name: feeds[i.name] for i in cpu.inputs if i.name in feeds}
  want = _outputs(cpu.run(feeds))
  mp = pytest.MonkeyPatch()
  try:
    with emulated_gpu(mp, Path(tempfile.mkdtemp(prefix="kiln-zoo-cuda-"))) as (gpu, _):
      got = _outputs(konnx.load(str(f), device="CUDA", dims=dims).run(feeds))
  finally: mp.undo()
  err = max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max() / max(1e-30, np.abs(b.astype(np.float64)).max()))
            for a, b in zip(got, want) if a.size)
  return f"OK   max error {err:.2e} of the output's scale, {gpu.stats['launches']} launches, {time.perf_counter() - t:.0f} s"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--only", help="a regular expression the model's folder name must match")
  ap.add_argument("--exports", default="dynamo-fixed", help="comma-separated: dynamo-fixed, dynamo-dynamic, script-fixed, script-dynamic")
  ap.add_argument("--cache", default=str(HERE.parents[2] / ".zoo-cache"), help="the zoo's cache folder")
  args = ap.parse_args()
  os.environ.setdefault("KILN_COMPILE_THREADS", str(len(os.sched_getaffinity(0))))
  root = Path(args.cache) / "onnx"
  fails = 0
  for d in sorted(p for p in root.iterdir() if p.is_dir()):
    if args.only and not re.search(args.only, d.name): continue
    for export in args.exports.split(","):
      if not (d / f"{export}.onnx").exists(): continue
      try: line = check(d, export)
      except Exception as e:  # noqa: BLE001 (a failure is the sweep's finding: report it and go on)
        fails += 1
        line = f"FAIL {type(e).__name__}: {str(e)[:300]}"
        if os.environ.get("KILN_DEBUG"): traceback.print_exc()
      print(f"{d.name} {export}: {line}", flush=True)
  return 1 if fails else 0


if __name__ == "__main__":
  sys.exit(main())
