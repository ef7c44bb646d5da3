"""torchvision: classification (num_classes=10), segmentation, detection and optical flow, random weights. CNNs keep their
real widths (their size is in the weights, not the work at 64 px); transformers (vit, swin, maxvit) get small configs;
alexnet and vgg run at 224 px (their adaptive pool is then the identity) with a narrow classifier; six common CNNs run at
224 px as well (tv/NAME@224), the size users feed them."""
from __future__ import annotations

from typing import Any

from zoo.spec import BATCH, Built, Spec, image, wrap

N = 10  # classes


def _tv() -> tuple[Any, Any]:
  import torch

  from zoo.tvshim import import_torchvision
  return torch, import_torchvision()


def classifier(name: str, side: int = 64, **kw: Any) -> Spec:
  """A classifier at `side` px, named tv/NAME, or tv/NAME@SIDE away from the zoo's usual 64 px."""
  def build() -> Built:
    torch, tv = _tv()
    return image(torch, getattr(tv.models, name)(weights=None, num_classes=N, **kw), side)
  return Spec(f"tv/{name}" + (f"@{side}" if side not in (64, 96) else ""), "torchvision", build)


def narrow_head(name: str) -> Spec:
  """alexnet / vgg at 224 px with their classifier's 4096-wide layers cut to 64 (the 25088x4096 matrix alone is 400 MB)."""
  def build() -> Built:
    torch, tv = _tv()
    m = getattr(tv.models, name)(weights=None, num_classes=N)
    fc = [i for i, l in enumerate(m.classifier) if isinstance(l, torch.nn.Linear)]
    m.classifier[fc[0]] = torch.nn.Linear(m.classifier[fc[0]].in_features, 64)
    m.classifier[fc[1]] = torch.nn.Linear(64, 64)
    m.classifier[fc[2]] = torch.nn.Linear(64, N)
    return image(torch, m, 224)
  return Spec(f"tv/{name}", "torchvision", build)


def small(name: str, make: str, **kw: Any) -> Spec:
  """A transformer built from its class with a small config; a string value "tv:dotted.name" names a torchvision class."""
  def build() -> Built:
    torch, tv = _tv()
    args = {k: make_cls(tv, v[3:]) if isinstance(v, str) and v.startswith("tv:") else v for k, v in kw.items()}
    return image(torch, make_cls(tv, make)(num_classes=N, **args))
  return Spec(f"tv/{name}", "torchvision", build)


def make_cls(tv: Any, dotted: str) -> Any:
  obj = tv
  for part in dotted.split("."): obj = getattr(obj, part)
  return obj


def segmentation(name: str) -> Spec:
  def build() -> Built:
    torch, tv = _tv()
    kw = {} if name.startswith("lraspp") else {"aux_loss": False}
    m = getattr(tv.models.segmentation, name)(weights=None, weights_backbone=None, num_classes=5, **kw)
    return image(torch, wrap(torch, m, lambda m, x: m(x)["out"]))
  return Spec(f"tv/{name}", "torchvision", build)


def detection(name: str, side: int, **kw: Any) -> Spec:
  """A detector takes a list of images and returns boxes, scores, labels per image: one image in, its three tensors out
  (fixed batch 1: the number of boxes depends on the data)."""
  def build() -> Built:
    torch, tv = _tv()
    m = getattr(tv.models.detection, name)(weights=None, weights_backbone=None, num_classes=5, **kw).eval()
    def fn(m: Any, x: Any) -> Any:
      o = m([x[0]])[0]
      return o["boxes"], o["scores"], o["labels"]
    return wrap(torch, m, fn), {"x": torch.rand(1, 3, side, side)}, {}
  return Spec(f"tv/{name}", "torchvision", build)


def raft() -> Spec:
  def build() -> Built:
    torch, tv = _tv()
    m = tv.models.optical_flow.raft_small(weights=None)
    ins = {"image1": torch.randn(BATCH, 3, 128, 128), "image2": torch.randn(BATCH, 3, 128, 128)}  # its correlation pyramid needs 128 px
    return wrap(torch, m, lambda m, a, b: m(a, b, num_flow_updates=3)[-1]), ins, {k: {0: "batch"} for k in ins}
  return Spec("tv/raft_small", "torchvision", build)


def video(name: str) -> Spec:
  def build() -> Built:
    torch, tv = _tv()
    m = getattr(tv.models.video, name)(weights=None, num_classes=N).eval()
    return m, {"x": torch.randn(BATCH, 3, 4, 32, 32)}, {"x": {0: "batch"}}
  return Spec(f"tv/{name}", "torchvision", build)


SPECS = [
  classifier("resnet18"), classifier("resnet50"), classifier("resnext50_32x4d"), classifier("wide_resnet50_2"),
  classifier("mobilenet_v2"), classifier("mobilenet_v3_small"), classifier("mobilenet_v3_large"),
  classifier("efficientnet_b0"), classifier("efficientnet_v2_s"), classifier("regnet_x_400mf"), classifier("regnet_y_400mf"),
  classifier("densenet121"), classifier("googlenet", aux_logits=False, init_weights=False),
  classifier("inception_v3", side=96, aux_logits=False, init_weights=False), classifier("squeezenet1_1"),
  classifier("shufflenet_v2_x0_5"), classifier("mnasnet0_5"), classifier("convnext_tiny"),
  narrow_head("alexnet"), narrow_head("vgg11_bn"),
  small("vit", "models.vision_transformer.VisionTransformer", image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128),
  small("swin", "models.swin_transformer.SwinTransformer", patch_size=[4, 4], embed_dim=32, depths=[2, 2, 2], num_heads=[2, 2, 4],
        window_size=[4, 4]),
  small("swin_v2", "models.swin_transformer.SwinTransformer", patch_size=[4, 4], embed_dim=32, depths=[2, 2, 2], num_heads=[2, 2, 4],
        window_size=[4, 4], block="tv:models.swin_transformer.SwinTransformerBlockV2",
        downsample_layer="tv:models.swin_transformer.PatchMergingV2"),
  small("maxvit", "models.maxvit.MaxVit", input_size=(64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32],
        block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0),
  segmentation("deeplabv3_mobilenet_v3_large"), segmentation("fcn_resnet50"), segmentation("lraspp_mobilenet_v3_large"),
  detection("fasterrcnn_mobilenet_v3_large_320_fpn", 128, min_size=128, max_size=128),
  detection("retinanet_resnet50_fpn", 128, min_size=128, max_size=128),
  detection("ssdlite320_mobilenet_v3_large", 320),
  raft(), video("r3d_18"),
  # at the 224 px users feed them: maps of 112, 56, 28, 14 and 7, a stem over 224x224, where 64 px gives 32 down to 2
  *(classifier(n, side=224) for n in ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "squeezenet1_1", "densenet121")),
]
