"""Import torchvision beside CPU torch. The registry's torchvision is a CUDA build whose _C.so does not load against the CPU
torch wheel; its import then registers fake kernels for torchvision::nms and ::qnms, which fails unless those operators
exist. Define them first, nms with a plain torch implementation so that detection models run eagerly (the exporters map
torchvision::nms to ONNX NonMaxSuppression through torchvision's own registration)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _nms(torch: Any, boxes: Any, scores: Any, iou: float) -> Any:
  order, keep = scores.argsort(descending=True), []
  area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
  alive = torch.ones(len(order), dtype=torch.bool)
  for i in range(len(order)):
    if not alive[i]: continue
    a = order[i]
    keep.append(a)
    rest = order[i + 1:]
    lt = torch.maximum(boxes[a, :2], boxes[rest, :2])
    rb = torch.minimum(boxes[a, 2:], boxes[rest, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    alive[i + 1:] &= inter / (area[a] + area[rest] - inter) <= iou
  return torch.stack(keep) if keep else torch.zeros(0, dtype=torch.int64)


def _has_nms() -> None:
  """torchvision's check that its C++ operators loaded, for nms: a def, not a lambda, as the TorchScript exporter scripts
  the function that calls it."""


def import_torchvision() -> Any:
  import torch
  if not hasattr(torch.ops.torchvision, "nms"):
    spec = importlib.util.find_spec("torchvision")  # finds the package without importing it
    so = next(Path(spec.origin).parent.glob("_C*.so"), None) if spec and spec.origin else None
    try:
      if so is None: raise OSError("no torchvision/_C")
      torch.ops.load_library(str(so))  # a build that matches torch defines its operators itself
    except OSError:
      lib = torch.library.Library("torchvision", "FRAGMENT")
      lib.define("nms" + _SCHEMA)
      lib.define("qnms" + _SCHEMA)
      lib.impl("nms", lambda b, s, iou: _nms(torch, b, s, iou), "CPU")
      import_torchvision.lib = lib  # type: ignore[attr-defined]  # a Library unregisters its operators when collected
  import torchvision
  import torchvision.ops.boxes as boxes
  if not torchvision.extension._has_ops(): boxes._assert_has_ops = _has_nms  # nms is defined above; roi_align falls back to Python
  return torchvision
