"""Child process: build one zoo model and export it with torch.onnx.export, dynamo=True (torch's default) and dynamo=False,
at fixed sizes and with the dynamic axes its spec names. `python -m zoo.export NAME DIR` writes DIR/<variant>.onnx, the
feeds (feeds.npz: each input at the example size, and `resized` at a second size for dynamic exports) and DIR/export.json,
rewritten after every variant so that a crash or a timeout keeps what was done."""
from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from zoo.spec import resized


def variants(exporters: tuple[str, ...], dynamic: bool) -> list[str]:
  return [f"{e}/{s}" for e in exporters for s in (("fixed", "dynamic") if dynamic else ("fixed",))]


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(e: BaseException) -> str:
  """The exception's first line and, where it wraps another (torch.onnx's TorchExportError does), the innermost cause's."""
  def line(x: BaseException) -> str:
    lines = [t for t in ANSI.sub("", str(x)).strip().splitlines() if t.strip()]
    return f"{type(x).__name__}: {lines[0][:300] if lines else ''}"
  root = e
  while root.__cause__ is not None and root.__cause__ is not root: root = root.__cause__
  return line(e) if root is e else f"{line(e)} <- {line(root)}"


def dynamic_shapes(m: Any, names: list[str], axes: dict[str, dict[int, str]]) -> Any:
  """torch.export's dynamic_shapes for positional inputs: a tuple, one entry per argument, or {name: that tuple} where the
  forward takes them as *args (zoo.spec.wrap's modules)."""
  shapes = tuple(axes.get(n) or None for n in names)
  var = [p.name for p in inspect.signature(m.forward).parameters.values() if p.kind == inspect.Parameter.VAR_POSITIONAL]
  return {var[0]: shapes} if var else shapes


def export_one(torch: Any, m: Any, ins: dict[str, Any], axes: dict[str, dict[int, str]], variant: str, path: Path) -> None:
  exporter, shape = variant.split("/")
  names, args = list(ins), tuple(ins.values())
  dyn = shape == "dynamic"
  with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
    warnings.simplefilter("ignore")
    if exporter == "dynamo":
      shapes = dynamic_shapes(m, names, axes) if dyn else None
      prog = torch.onnx.export(m, args, dynamo=True, input_names=names, dynamic_shapes=shapes, verbose=False)
      import onnx
      onnx.save_model(prog.model_proto, str(path))
    else:
      torch.onnx.export(m, args, str(path), dynamo=False, input_names=names, dynamic_axes={n: axes[n] for n in names if axes.get(n)} if dyn else None)


def exercise(torch: Any, m: Any, ins: dict[str, Any]) -> None:
  """Random weights as torch's and the libraries' initializers leave them can make a check vacuous: zero-initialized heads
  (timm's MLP-Mixer, ResMLP) give all-zero outputs, layer scales of 1e-6 hide whole branches, and batch norms at their
  initial running statistics shrink activations to ~1e-10 (torchvision's MobileNets): any kernel's error then vanishes.
  So every parameter whose elements are all equal (zeros, ones, a layer scale) gets noise, and each batch norm's running
  statistics are set from one training-mode pass over the example input, as calibration would."""
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for p in m.parameters():
      if p.is_floating_point() and p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()):
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    norms = [x for x in m.modules() if isinstance(x, torch.nn.modules.batchnorm._BatchNorm) and x.track_running_stats]
    if not norms: return
    for bn in norms: bn.reset_running_stats(); bn.momentum = None  # a cumulative average: after one pass, that batch's statistics
    try:
      m.train()
      m(*ins.values())
    except Exception:  # a model whose training mode wants more (a detector wants targets): its initial statistics stay
      for bn in norms: bn.reset_running_stats()
    finally: m.eval()


def main(name: str, out: str) -> int:
  import numpy as np
  import torch

  from zoo.catalog import by_name
  torch.manual_seed(0)
  torch.set_num_threads(1)
  spec, d = by_name(name), Path(out)
  d.mkdir(parents=True, exist_ok=True)
  meta: dict[str, Any] = {"variants": {}}
  def save() -> None:
    (d / "export.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(d / "export.json.tmp", d / "export.json")
  t = time.perf_counter()
  try:
    assert spec.build is not None
    m, ins, axes = spec.build()
    exercise(torch, m, ins)
    with torch.no_grad(): m(*ins.values())  # a model that does not even run eagerly is the zoo's bug, not an export failure
  except Exception as e:
    meta["error"] = f"building or running the model in torch failed: {first_line(e)}"
    meta["traceback"] = traceback.format_exc()[-3000:]
    save()
    return 1
  feeds = {k: v.numpy() for k, v in ins.items()}
  np.savez(d / "feeds.npz", **feeds, **{f"resized:{k}": resized(k, v, axes.get(k, {})) for k, v in feeds.items()})
  meta.update(inputs=list(ins), axes={k: {str(a): kind for a, kind in v.items()} for k, v in axes.items()}, build_s=time.perf_counter() - t)
  save()
  # TorchScript first: a torch.export run leaves functions marked dynamo-optimized, which torch.jit.trace then refuses to trace
  for v in sorted(variants(spec.exporters, any(axes.values())), key=lambda v: not v.startswith("script")):
    t = time.perf_counter()
    torch._dynamo.reset()
    try:
      export_one(torch, m, ins, axes, v, d / f"{v.replace('/', '-')}.onnx")
      meta["variants"][v] = {"exported": True, "seconds": time.perf_counter() - t}
    except Exception as e:
      meta["variants"][v] = {"exported": False, "error": first_line(e), "seconds": time.perf_counter() - t}
    save()
  return 0


if __name__ == "__main__": sys.exit(main(sys.argv[1], sys.argv[2]))
