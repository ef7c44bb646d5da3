"""ResNet-50 and a BERT-base-shaped encoder in plain torch (no torchvision or transformers: the GPU machine has neither),
with random weights, and their ONNX export through the TorchScript exporter (dynamo=False: no onnxscript needed).

Sizes are arguments so that the same code makes the small twins the CPU dry run and compute-sanitizer use."""
from __future__ import annotations

import math
from typing import Any


def resnet(torch: Any, layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> Any:
  """torchvision's resnet50 (v1.5: the stride on the 3x3 conv of a bottleneck), eval mode, BatchNorm statistics random."""
  nn = torch.nn

  class Bottleneck(nn.Module):
    def __init__(s, cin: int, mid: int, stride: int):
      super().__init__()
      cout = 4 * mid
      s.c1, s.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
      s.c2, s.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
      s.c3, s.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
      s.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) if stride != 1 or cin != cout else None
    def forward(s, x: Any) -> Any:
      y = torch.relu(s.b1(s.c1(x)))
      y = torch.relu(s.b2(s.c2(y)))
      y = s.b3(s.c3(y))
      return torch.relu(y + (x if s.down is None else s.down(x)))

  class ResNet(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
      blocks, cin = [], width
      for i, n in enumerate(layers):
        mid = width * 2 ** i
        for j in range(n):
          blocks.append(Bottleneck(cin, mid, 2 if i > 0 and j == 0 else 1))
          cin = 4 * mid
      s.blocks, s.fc = nn.Sequential(*blocks), nn.Linear(cin, classes)
    def forward(s, x: Any) -> Any: return s.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(s.blocks(s.stem(x)), 1), 1))

  return _randomised(torch, ResNet())


def bert(torch: Any, layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 30522, max_pos: int = 512) -> Any:
  """BERT-base's encoder (post-LN, exact GELU, 4x MLP) over token ids: word + position + token-type embeddings, LayerNorm,
  `layers` encoder layers; returns the last hidden states. No attention mask (every position attends to every other)."""
  nn = torch.nn

  class Layer(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.qkv, s.o, s.ln1 = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)
      s.f1, s.f2, s.ln2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)
    def forward(s, x: Any) -> Any:
      b, t, _ = x.shape
      q, k, v = s.qkv(x).reshape(b, t, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
      att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hidden // heads), -1)
      x = s.ln1(x + s.o((att @ v).transpose(1, 2).reshape(b, t, hidden)))
      return s.ln2(x + s.f2(torch.nn.functional.gelu(s.f1(x))))

  class Bert(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.word, s.pos, s.typ = nn.Embedding(vocab, hidden), nn.Embedding(max_pos, hidden), nn.Embedding(2, hidden)
      s.ln, s.layers = nn.LayerNorm(hidden, eps=1e-12), nn.ModuleList([Layer() for _ in range(layers)])
    def forward(s, ids: Any) -> Any:
      pos = torch.arange(ids.shape[1], device=ids.device)
      x = s.ln(s.word(ids) + s.pos(pos)[None] + s.typ.weight[0])
      for layer in s.layers: x = layer(x)
      return x

  return _randomised(torch, Bert())


def _randomised(torch: Any, m: Any) -> Any:
  """Eval mode, with BatchNorm statistics and LayerNorm/BatchNorm affines random (fresh modules have the identity), and
  linear/conv weights scaled so that activations keep their size through the depth (errors are then comparable)."""
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for mod in m.modules():
      if isinstance(mod, torch.nn.BatchNorm2d):
        mod.running_mean.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
        mod.running_var.copy_(torch.rand(mod.num_features, generator=g) * 0.5 + 0.75)
        mod.weight.copy_(torch.rand(mod.num_features, generator=g) * 0.5 + 0.5)
        mod.bias.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
      elif isinstance(mod, torch.nn.LayerNorm):
        mod.weight.copy_(torch.rand(mod.normalized_shape, generator=g) * 0.5 + 0.75)
        mod.bias.copy_(torch.randn(mod.normalized_shape, generator=g) * 0.1)
      elif isinstance(mod, torch.nn.Conv2d | torch.nn.Linear):
        fan_in = mod.weight[0].numel()
        mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * math.sqrt(1.0 / fan_in))
        if mod.bias is not None: mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.05)
      elif isinstance(mod, torch.nn.Embedding): mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * 0.5)
  return m.eval()


def example(torch: Any, kind: str, batch: int, image: int = 224, seq: int = 128, vocab: int = 30522) -> Any:
  """A batch of inputs: images (batch, 3, image, image) float32, or token ids (batch, seq) int64."""
  g = torch.Generator().manual_seed(1)
  if kind == "resnet": return torch.randn(batch, 3, image, image, generator=g)
  return torch.randint(0, vocab, (batch, seq), generator=g)


def export(torch: Any, m: Any, x: Any, path: str, opset: int = 17) -> None:
  """m(x) to ONNX at path with the batch dim named "batch" (kiln loads it at a fixed size per batch: dims={"batch": n})."""
  with torch.no_grad():
    torch.onnx.export(m, (x,), path, dynamo=False, opset_version=opset, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
