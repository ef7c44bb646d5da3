"""ultralytics: YOLO detection, segmentation, pose and classification models built from the yaml configs the package ships
(nc=5, random weights, 128 px: three detection levels of 16, 8 and 4 cells), exported with torch's exporters like every other
entry (not ultralytics' own exporter). The heads are put in export mode as ultralytics' exporter puts them (one tensor, or
the mask prototypes beside it, instead of a tuple with the raw level outputs) and decode their anchors in the graph
(`dynamic`: a cached anchor grid is compared with the input's shape, which torch.export would specialize on the batch).
YOLO26's NMS-free head is exported end to end as ultralytics exports it by default (its one-to-one branch, then a top-k of
the scores: at most 300 rows of box, score, class). Each output is split into its parts (boxes in pixels; scores in [0, 1];
mask coefficients or keypoints), so that the check measures the scores against their own scale, not the boxes'.
Batch norms stay unfused: the zoo calibrates them (export.exercise) so that random weights keep activations at scale."""
from __future__ import annotations

import os
from typing import Any

from zoo.spec import Built, Spec, image, wrap

SIDE = 128


def _yolo(task: str) -> Any:
  os.environ.setdefault("YOLO_OFFLINE", "1")  # no connectivity probe (a DNS lookup) and no telemetry
  os.environ.setdefault("YOLO_VERBOSE", "False")
  from zoo.tvshim import import_torchvision
  import_torchvision()  # ultralytics imports torchvision
  from ultralytics.nn import tasks
  return {"detect": tasks.DetectionModel, "segment": tasks.SegmentationModel, "pose": tasks.PoseModel,
          "classify": tasks.ClassificationModel}[task]


def yolo(name: str, cfg: str, task: str = "detect") -> Spec:
  def build() -> Built:
    import torch
    model = _yolo(task)(cfg, nc=5, verbose=False).eval()
    head = model.model[-1]
    if getattr(head, "one2one_cv2", None) is not None: model.end2end = True
    for m in model.modules():
      if hasattr(m, "export"): m.export, m.format = True, "onnx"
      if hasattr(m, "dynamic"): m.dynamic = True
    if task == "classify": return image(torch, wrap(torch, model, lambda m, x: m(x)), SIDE)  # its forward's *args would name the input
    nc = head.nc
    def parts(m: Any, x: Any) -> Any:
      y = m(x)
      y, rest = (y[0], y[1:]) if isinstance(y, (tuple, list)) else (y, ())  # a segmenter's mask prototypes come after
      if head.end2end: cuts = (y[..., :4], y[..., 4], y[..., 5], y[..., 6:])  # (batch, k, box + score + class + extra)
      else: cuts = (y[:, :4], y[:, 4:4 + nc], y[:, 4 + nc:])                # (batch, box + classes + extra, anchors)
      return tuple(c for c in cuts if c.numel()) + tuple(rest)
    return image(torch, wrap(torch, model, parts), SIDE)
  return Spec(f"yolo/{name}", "ultralytics", build)


SPECS = [
  yolo("yolov8n", "yolov8n.yaml"), yolo("yolo11n", "yolo11n.yaml"),
  yolo("yolo26n", "yolo26n.yaml"),  # NMS-free: a one-to-one head and a top-k of its scores instead of NMS
  yolo("yolov8n_seg", "yolov8n-seg.yaml", "segment"), yolo("yolo11n_pose", "yolo11n-pose.yaml", "pose"),
  yolo("yolo11n_cls", "yolo11n-cls.yaml", "classify"),
]
