"""segmentation-models-pytorch: its decoders on small encoders (resnet18, mobilenet_v2, efficientnet-b0, mit_b0), random
weights (encoder_weights=None), 5 classes, 64 px, batch dynamic: U-Net and U-Net++ (skip connections, upsampling), FPN,
DeepLabV3+ (atrous convs, ASPP's image pooling), PSPNet (pyramid pooling), MAnet (attention blocks) and SegFormer.
PSPNet runs at 96 px: its pyramid pools its 1/8 map to 1, 2, 3 and 6 cells, and TorchScript's exporter takes an adaptive
pool only where the output size divides the input's (12 cells; at 64 px, 8 cells, it refuses the 3 and the 6)."""
from __future__ import annotations

from typing import Any

from zoo.spec import Built, Spec, image


def smp_model(arch: str, encoder: str, side: int = 64, **kw: Any) -> Spec:
  def build() -> Built:
    import torch

    from zoo.tvshim import import_torchvision
    import_torchvision()  # smp imports timm, which imports torchvision
    import segmentation_models_pytorch as smp
    return image(torch, getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, classes=5, **kw), side)
  return Spec(f"smp/{arch.lower()}_{encoder.replace('-', '_')}", "smp", build)


SPECS = [
  smp_model("Unet", "resnet18"), smp_model("UnetPlusPlus", "mobilenet_v2"), smp_model("FPN", "resnet18"),
  smp_model("DeepLabV3Plus", "mobilenet_v2"), smp_model("PSPNet", "resnet18", side=96), smp_model("MAnet", "efficientnet-b0"),
  smp_model("Segformer", "mit_b0"),
]
