"""all-MiniLM-L6-v2 (sentence-transformers' most downloaded model) as a user exports it: transformers' BertModel built from
that checkpoint's config (6 layers, hidden 384, 12 heads, intermediate 1536, vocab 30522) with random weights (no
download), exported by torch's default exporter with its attention mask, batch and sequence dynamic; plus .npy feeds of
batch 8 x 128 tokens, the last rows padded as a sentence batch is. Issue 37's target compares kiln with OpenVINO f32 on it:

  $BPY packages/graph/benchmarks/minilm_export.py OUT_DIR
  kiln bench OUT_DIR/minilm.onnx -i input_ids=OUT_DIR/input_ids.npy -i attention_mask=OUT_DIR/attention_mask.npy \
      -i token_type_ids=OUT_DIR/token_type_ids.npy --threads 2 --compare

Bench environment only (torch, transformers)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

CONFIG = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
          "max_position_embeddings": 512, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "type_vocab_size": 2}
BATCH, SEQ = 8, 128


def main(out: Path) -> None:
  import torch
  sys.path.insert(0, str(Path(__file__).parent))
  from zoo.tvshim import import_torchvision
  import_torchvision()  # transformers imports torchvision where it is installed
  import transformers
  torch.manual_seed(0)
  model = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
  rng = np.random.default_rng(0)
  ids = rng.integers(1000, CONFIG["vocab_size"], (BATCH, SEQ), dtype=np.int64)
  mask = np.ones((BATCH, SEQ), np.int64)
  for r in range(BATCH // 2, BATCH): mask[r, SEQ - 16 * (r - BATCH // 2 + 1):] = 0  # half the rows padded, 16 to 64 tokens
  ids[mask == 0] = 0
  types = np.zeros_like(ids)
  feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
  out.mkdir(parents=True, exist_ok=True)
  for k, v in feeds.items(): np.save(out / f"{k}.npy", v)

  class Wrapped(torch.nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.m = model

    def forward(self, input_ids: object, attention_mask: object, token_type_ids: object) -> object:
      return self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=False)[0]

  args = tuple(torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
  dyn = {k: {0: "batch", 1: "seq"} for k in feeds}
  torch.onnx.export(Wrapped().eval(), args, str(out / "minilm.onnx"), input_names=list(feeds), output_names=["last_hidden_state"],
                    dynamic_axes=dyn, dynamo=True)
  print(f"wrote {out / 'minilm.onnx'} and feeds of {BATCH} x {SEQ}")


if __name__ == "__main__":
  main(Path(sys.argv[1] if len(sys.argv) > 1 else "minilm"))
