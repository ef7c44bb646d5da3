"""transformers beyond one encoder's hidden state: an encoder-decoder's decoder step (T5, BART: token ids, their padding
mask, the encoder's hidden states and its padding mask; causal self attention and cross attention, no KV cache), detection
(DETR on a timm ResNet-18, YOLOS: class logits and boxes), depth (DPT) and a conformer speech encoder (wav2vec2-conformer,
rotary and relative positions). Small configs as in models_hf (2 layers, width 64), random weights. The decoder step's
token sequence and the encoder's share the dynamic `seq` dim (one name for both in the export)."""
from __future__ import annotations

from typing import Any

from zoo.models_hf import VISION, V, _tf, hf_audio
from zoo.spec import BATCH, SEQ, Built, Spec, image, wrap

D = 64  # model width


def decoder_step(name: str, model: str, config: str, **cfg: Any) -> Spec:
  def build() -> Built:
    torch, tf = _tf()
    c = getattr(tf, config)(**cfg)
    c.use_cache = False
    dec = getattr(tf, model)(c).get_decoder().eval()
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - 4:] = 0  # the second row's last steps padded, in the decoder's tokens and the encoder's alike
    ins = {"input_ids": torch.randint(1, V, (BATCH, SEQ), generator=g), "attention_mask": mask,
           "encoder_hidden_states": torch.randn(BATCH, SEQ, D, generator=g), "encoder_attention_mask": mask.clone()}
    def fn(m: Any, ids: Any, am: Any, enc: Any, em: Any) -> Any:
      return m(input_ids=ids, attention_mask=am, encoder_hidden_states=enc, encoder_attention_mask=em, return_dict=False)[0]
    axes = {k: {0: "batch", 1: "seq"} for k in ins}
    return wrap(torch, dec, fn), ins, axes
  return Spec(f"hf/{name}", "transformers", build)


def detector(name: str, model: str, config: str, side: int = 64, **cfg: Any) -> Spec:
  """A set-prediction detector: class logits and boxes for each of its queries (no NMS), batch dynamic."""
  def build() -> Built:
    torch, tf = _tf()
    m = getattr(tf, model)(getattr(tf, config)(**cfg)).eval()
    mod, ins, axes = image(torch, wrap(torch, m, lambda m, x: (lambda o: (o.logits, o.pred_boxes))(m(pixel_values=x))), side)
    return mod, {"pixel_values": ins["x"]}, {"pixel_values": axes["x"]}
  return Spec(f"hf/{name}", "transformers", build)


def depth(name: str, model: str, config: str, side: int = 64, **cfg: Any) -> Spec:
  """A depth head's last layer is a ReLU. On random weights its input is nearly constant over the map (the features are
  small beside each conv's random bias) and where that constant is negative the output is all zero, a vacuous check
  (hf/dpt at the export's seed): the last ReLU is left out, so the head's output is checked as it is before it."""
  def build() -> Built:
    torch, tf = _tf()
    m = getattr(tf, model)(getattr(tf, config)(**cfg)).eval()
    assert isinstance(m.head.head[-1], torch.nn.ReLU), m.head.head
    m.head.head[-1] = torch.nn.Identity()
    mod, ins, axes = image(torch, wrap(torch, m, lambda m, x: m(pixel_values=x).predicted_depth), side)
    return mod, {"pixel_values": ins["x"]}, {"pixel_values": axes["x"]}
  return Spec(f"hf/{name}", "transformers", build)


CONFORMER: dict[str, Any] = {"hidden_size": D, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "conv_dim": (32, 32, 32),
             "conv_stride": (5, 2, 2), "conv_kernel": (10, 3, 3), "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
             "conv_depthwise_kernel_size": 7}

SPECS = [
  decoder_step("t5_decoder", "T5Model", "T5Config", vocab_size=V, d_model=D, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
               decoder_start_token_id=0),
  decoder_step("bart_decoder", "BartModel", "BartConfig", vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128),
  detector("detr", "DetrForObjectDetection", "DetrConfig", use_timm_backbone=True, backbone="resnet18", use_pretrained_backbone=False,
           num_channels=3, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
           encoder_ffn_dim=128, decoder_ffn_dim=128, num_queries=20, num_labels=5),
  detector("yolos", "YolosForObjectDetection", "YolosConfig", num_detection_tokens=10, num_labels=5,
           **(VISION | {"image_size": [64, 64]})),
  depth("dpt", "DPTForDepthEstimation", "DPTConfig", **(VISION | {"num_hidden_layers": 4}), backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[16, 32, 64, 64], fusion_hidden_size=32, head_hidden_size=16, reassemble_factors=[4, 2, 1, 0.5]),
  hf_audio("wav2vec2_conformer_rotary", "Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", (1600,), "input_values",
           position_embeddings_type="rotary", **CONFORMER),
  hf_audio("wav2vec2_conformer_relative", "Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", (1600,), "input_values",
           position_embeddings_type="relative", **CONFORMER),
]
