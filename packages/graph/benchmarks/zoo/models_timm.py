"""timm: a wide spread of image architectures (num_classes=10, random weights, 64 px). Most keep their real widths; the
transformers that timm builds with depth / width arguments get small ones, and those tied to an image size get img_size=64."""
from __future__ import annotations

import importlib
from typing import Any

from zoo.spec import Built, Spec, image

SMALL_VIT = {"img_size": 64}


def timm_model(name: str, **kw: Any) -> Spec:
  def build() -> Built:
    import torch

    from zoo.tvshim import import_torchvision
    import_torchvision()  # timm imports torchvision
    import timm
    if "." not in name: return image(torch, timm.create_model(name, pretrained=False, num_classes=10, **kw))
    mod, cls = name.rsplit(".", 1)  # a class built directly, where the registered configs fix the arguments we shrink
    return image(torch, getattr(importlib.import_module(f"timm.models.{mod}"), cls)(num_classes=10, **kw))
  return Spec(f"timm/{name}", "timm", build)


SPECS = [
  # ResNet family: -d/-t stems, ResNeSt split attention, SE, selective kernel, Res2Net, NF (weight standardization), TResNet
  timm_model("resnet18d"), timm_model("resnet26t"), timm_model("resnest14d"), timm_model("seresnext26d_32x4d"), timm_model("skresnet18"),
  timm_model("res2net50_14w_8s"), timm_model("nf_resnet26"), timm_model("tresnet_m"), timm_model("botnet26t_256", **SMALL_VIT),
  # mobile / NAS CNNs
  timm_model("efficientnet_b0"), timm_model("tf_efficientnet_b0"), timm_model("efficientnetv2_rw_t"), timm_model("mixnet_s"),
  timm_model("mobilenetv4_conv_small"), timm_model("ghostnet_100"),
  timm_model("rexnet_100"), timm_model("fastvit_t8"),
  # other CNNs
  timm_model("hgnetv2_b0"), timm_model("dla34"), timm_model("dpn68"), timm_model("hrnet_w18_small"),
  timm_model("regnetz_b16"), timm_model("xception41"),
  timm_model("convnextv2_atto"), timm_model("edgenext_xx_small"), timm_model("starnet_s1"), timm_model("mambaout_femto"),
  timm_model("convmixer.ConvMixer", dim=64, depth=4, kernel_size=7, patch_size=7),
  # conv / attention hybrids, MLPs, pooling
  timm_model("mobilevit_xxs"), timm_model("mobilevitv2_050"), timm_model("poolformer_s12"), timm_model("levit_128s", **SMALL_VIT),
  timm_model("coatnet_nano_rw_224", **SMALL_VIT), timm_model("maxvit_nano_rw_256", **SMALL_VIT), timm_model("efficientvit_m0", **SMALL_VIT),
  timm_model("mixer_s16_224", **SMALL_VIT), timm_model("resmlp_12_224", **SMALL_VIT), timm_model("sequencer2d_s"),
  timm_model("swiftformer_xs"), timm_model("pvt_v2_b0"),
  # vision transformers
  timm_model("deit_tiny_distilled_patch16_224", **SMALL_VIT), timm_model("beit_base_patch16_224", img_size=64, depth=2, embed_dim=64, num_heads=2),
  timm_model("cait_xxs24_224", img_size=64, depth=2), timm_model("eva02_tiny_patch14_224", **SMALL_VIT),
  timm_model("xcit_nano_12_p16_224", **SMALL_VIT), timm_model("swin_tiny_patch4_window7_224", img_size=64, window_size=2),
  timm_model("gcvit_xxtiny", **SMALL_VIT),
  timm_model("volo_d1_224", **SMALL_VIT), timm_model("twins_svt_small", **SMALL_VIT),
]
