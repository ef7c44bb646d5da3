"""diffusers: the denoisers and the VAE of latent diffusion at small configs (widths 32-64, one or two layers per block),
random weights: Stable Diffusion's UNet2DConditionModel (a latent, a timestep per row and text embeddings: cross attention),
the unconditional DDPM UNet2DModel, SD3's MMDiT (SD3Transformer2DModel: joint attention over patches and text tokens) and
AutoencoderKL's encoder (image -> latent mean) and decoder (latent -> image). Batch dynamic; the text sequence too."""
from __future__ import annotations

import os
from typing import Any

from zoo.spec import BATCH, SEQ, Built, Spec, wrap

LATENT = 32  # latent side (a 256 px image in Stable Diffusion's VAE)
TEXT = 32    # text embedding width (cross_attention_dim / joint_attention_dim)


def _diffusers() -> tuple[Any, Any]:
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import torch

  from zoo.tvshim import import_torchvision
  import_torchvision()  # diffusers imports transformers, which imports torchvision
  import diffusers
  return torch, diffusers


def _timesteps(torch: Any) -> Any:
  return torch.tensor([10.0, 700.0][:BATCH])  # one per row, as a scheduler's step gives them (float: SD3's flow matching)


def _text(torch: Any, width: int = TEXT) -> Any:
  return torch.randn(BATCH, SEQ, width, generator=torch.Generator().manual_seed(2))


def unet_cond() -> Spec:
  def build() -> Built:
    torch, d = _diffusers()
    m = d.UNet2DConditionModel(sample_size=LATENT, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                               cross_attention_dim=TEXT, attention_head_dim=8, norm_num_groups=16).eval()
    ins = {"sample": torch.randn(BATCH, 4, LATENT, LATENT), "timestep": _timesteps(torch), "encoder_hidden_states": _text(torch)}
    mod = wrap(torch, m, lambda m, x, t, e: m(x, t, e, return_dict=False)[0])
    return mod, ins, {"sample": {0: "batch"}, "timestep": {0: "batch"}, "encoder_hidden_states": {0: "batch", 1: "seq"}}
  return Spec("diffusers/unet2d_condition", "diffusers", build)


def unet_ddpm() -> Spec:
  def build() -> Built:
    torch, d = _diffusers()
    m = d.UNet2DModel(sample_size=LATENT, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
                      down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                      attention_head_dim=8, norm_num_groups=16).eval()
    ins = {"sample": torch.randn(BATCH, 3, LATENT, LATENT), "timestep": _timesteps(torch)}
    return wrap(torch, m, lambda m, x, t: m(x, t, return_dict=False)[0]), ins, {k: {0: "batch"} for k in ins}
  return Spec("diffusers/unet2d_ddpm", "diffusers", build)


def sd3() -> Spec:
  def build() -> Built:
    torch, d = _diffusers()
    m = d.SD3Transformer2DModel(sample_size=LATENT, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                                num_attention_heads=4, joint_attention_dim=TEXT, caption_projection_dim=64, pooled_projection_dim=TEXT,
                                pos_embed_max_size=LATENT).eval()
    ins = {"hidden_states": torch.randn(BATCH, 4, LATENT, LATENT), "encoder_hidden_states": _text(torch),
           "pooled_projections": torch.randn(BATCH, TEXT), "timestep": _timesteps(torch)}
    mod = wrap(torch, m, lambda m, x, e, p, t: m(x, e, p, t, return_dict=False)[0])
    axes = {k: {0: "batch"} for k in ins} | {"encoder_hidden_states": {0: "batch", 1: "seq"}}
    return mod, ins, axes
  return Spec("diffusers/sd3_transformer", "diffusers", build)


def _vae(d: Any) -> Any:
  return d.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         block_out_channels=(32, 32, 64), layers_per_block=1, latent_channels=4, norm_num_groups=16, sample_size=64).eval()


def vae(part: str) -> Spec:
  """The encoder takes a 64 px image to its latent distribution's mean (16 x 16); the decoder takes a 16 x 16 latent back."""
  def build() -> Built:
    torch, d = _diffusers()
    m = _vae(d)
    if part == "encoder":
      mod = wrap(torch, m, lambda m, x: m.encode(x, return_dict=False)[0].mean)
      return mod, {"x": torch.randn(BATCH, 3, 64, 64)}, {"x": {0: "batch"}}
    return wrap(torch, m, lambda m, z: m.decode(z, return_dict=False)[0]), {"z": torch.randn(BATCH, 4, 16, 16)}, {"z": {0: "batch"}}
  return Spec(f"diffusers/vae_{part}", "diffusers", build)


SPECS = [unet_cond(), unet_ddpm(), sd3(), vae("encoder"), vae("decoder")]
