"""transformers: models built from their configs at small sizes (2 layers, width 64, vocab 1000), random weights. Text
models take input_ids and attention_mask (the mask stays an input; the second row is padded), batch and sequence dynamic;
each returns its first output (last hidden state or logits), without a KV cache."""
from __future__ import annotations

from typing import Any

from zoo.spec import BATCH, Built, Spec, image, text, wrap

V = 1000  # vocab
BERTISH: dict[str, Any] = {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "max_position_embeddings": 128}
DECODER: dict[str, Any] = {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "max_position_embeddings": 128}
VISION: dict[str, Any] = {"image_size": 64, "patch_size": 16, "num_channels": 3, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128}


def _tf() -> tuple[Any, Any]:
  import torch

  from zoo.tvshim import import_torchvision
  import_torchvision()  # transformers imports torchvision where it is installed
  import transformers
  return torch, transformers


def _first(m: Any, *xs: Any, names: tuple[str, ...]) -> Any:
  return m(**dict(zip(names, xs)), return_dict=False)[0]


def hf_text(name: str, model: str, config: str, mask: bool = True, **cfg: Any) -> Spec:
  def build() -> Built:
    torch, tf = _tf()
    c = getattr(tf, config)(**cfg)
    if hasattr(c, "use_cache"): c.use_cache = False
    m = getattr(tf, model)(c).eval()
    mod, ins, axes = text(torch, m, V, mask=mask)
    names = tuple(ins)
    return wrap(torch, mod, lambda m, *xs: _first(m, *xs, names=names)), ins, axes
  return Spec(f"hf/{name}", "transformers", build)


def hf_vision(name: str, model: str, config: str, side: int = 64, **cfg: Any) -> Spec:
  def build() -> Built:
    torch, tf = _tf()
    m = getattr(tf, model)(getattr(tf, config)(**cfg)).eval()
    mod, ins, axes = image(torch, wrap(torch, m, lambda m, x: m(pixel_values=x, return_dict=False)[0]), side)
    return mod, {"pixel_values": ins["x"]}, {"pixel_values": axes["x"]}
  return Spec(f"hf/{name}", "transformers", build)


def hf_audio(name: str, model: str, config: str, shape: tuple[int, ...], input_name: str, **cfg: Any) -> Spec:
  """An audio encoder: features (whisper: mel bins x frames, fixed length) or raw samples (wav2vec2), batch dynamic."""
  def build() -> Built:
    torch, tf = _tf()
    c = getattr(tf, config)(**cfg)
    m = getattr(tf, model)(c).eval()
    if model == "WhisperModel": m = m.get_encoder()
    return (wrap(torch, m, lambda m, x: m(x, return_dict=False)[0]), {input_name: torch.randn(BATCH, *shape)}, {input_name: {0: "batch"}})
  return Spec(f"hf/{name}", "transformers", build)


SPECS = [
  hf_text("bert", "BertModel", "BertConfig", **BERTISH),
  hf_text("roberta", "RobertaModel", "RobertaConfig", **BERTISH),
  hf_text("distilbert", "DistilBertModel", "DistilBertConfig", vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
          max_position_embeddings=128),
  hf_text("albert", "AlbertModel", "AlbertConfig", embedding_size=32, **BERTISH),
  hf_text("electra", "ElectraModel", "ElectraConfig", embedding_size=32, **BERTISH),
  hf_text("deberta", "DebertaModel", "DebertaConfig", **BERTISH),
  hf_text("deberta_v2", "DebertaV2Model", "DebertaV2Config", **BERTISH),
  hf_text("mobilebert", "MobileBertModel", "MobileBertConfig", vocab_size=V, hidden_size=64, embedding_size=32, num_hidden_layers=2,
          num_attention_heads=4, intermediate_size=64, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2),
  hf_text("mpnet", "MPNetModel", "MPNetConfig", **BERTISH),
  hf_text("gpt2", "GPT2Model", "GPT2Config", vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=128),
  hf_text("gpt_neox", "GPTNeoXModel", "GPTNeoXConfig", **BERTISH),
  hf_text("opt", "OPTModel", "OPTConfig", vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
          max_position_embeddings=128, word_embed_proj_dim=64),
  hf_text("bloom", "BloomModel", "BloomConfig", vocab_size=V, hidden_size=64, n_layer=2, n_head=4),
  hf_text("llama", "LlamaForCausalLM", "LlamaConfig", **DECODER),
  hf_text("qwen2", "Qwen2Model", "Qwen2Config", **DECODER),
  hf_text("qwen3", "Qwen3Model", "Qwen3Config", head_dim=16, **DECODER),
  hf_text("mistral", "MistralModel", "MistralConfig", **DECODER),
  hf_text("phi", "PhiModel", "PhiConfig", **DECODER),
  hf_text("phi3", "Phi3Model", "Phi3Config", pad_token_id=0, **DECODER),
  hf_text("gemma", "GemmaModel", "GemmaConfig", head_dim=16, **DECODER),
  hf_text("gemma2", "Gemma2Model", "Gemma2Config", head_dim=16, sliding_window=8, **DECODER),
  hf_text("t5_encoder", "T5EncoderModel", "T5Config", vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
  hf_text("bart", "BartModel", "BartConfig", vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128),
  hf_text("clip_text", "CLIPTextModel", "CLIPTextConfig", **BERTISH),
  hf_vision("clip_vision", "CLIPVisionModel", "CLIPVisionConfig", **VISION),
  hf_vision("vit", "ViTModel", "ViTConfig", **VISION),
  hf_vision("deit", "DeiTModel", "DeiTConfig", **VISION),
  hf_vision("beit", "BeitModel", "BeitConfig", use_relative_position_bias=True, **VISION),
  hf_vision("dinov2", "Dinov2Model", "Dinov2Config", **VISION),
  hf_vision("segformer", "SegformerForSemanticSegmentation", "SegformerConfig", num_labels=5, hidden_sizes=[16, 32, 64, 64],
            num_attention_heads=[1, 2, 2, 4], depths=[1, 1, 1, 1], decoder_hidden_size=64),
  hf_vision("convnext", "ConvNextModel", "ConvNextConfig", hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1]),
  hf_vision("swin", "SwinModel", "SwinConfig", image_size=64, embed_dim=16, depths=[1, 1, 1], num_heads=[1, 2, 4], window_size=4),
  hf_audio("whisper_encoder", "WhisperModel", "WhisperConfig", (16, 32), "input_features", vocab_size=V, pad_token_id=0, num_mel_bins=16,
           d_model=64, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
           encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
           max_source_positions=16, max_target_positions=32),
  hf_audio("wav2vec2", "Wav2Vec2Model", "Wav2Vec2Config", (1600,), "input_values", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
           num_conv_pos_embedding_groups=4),
]
