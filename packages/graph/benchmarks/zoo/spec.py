"""What one zoo entry is: a name, a family, and either a builder (a torch module with named example inputs and the axes of
each input that a dynamic export leaves symbolic) or the path of an ONNX file. Builders run in the export child only."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# the symbolic dims a dynamic export names, and the bounds kiln is given for them (dims={"batch": (1, 8), ...})
BOUNDS = {"batch": (1, 8), "seq": (1, 64)}
BATCH = 2      # example batch: 2, not 1, so that torch.export does not specialize the batch dim to a constant
IMAGE = 64     # example image side
SEQ = 16       # example sequence length

# (module, {input name: example tensor}, {input name: {axis: "batch" | "seq"}})
Built = tuple[Any, dict[str, Any], dict[str, dict[int, str]]]


@dataclass(frozen=True)
class Spec:
  name: str                                   # "family/model", unique; also the cache file's stem
  family: str                                 # torchvision, timm, transformers, onnx-file
  build: Callable[[], Built] | None = None    # None for an ONNX file
  path: str | None = None                     # an ONNX file shipped in a wheel (checked as it is, fixed sizes)
  exporters: tuple[str, ...] = ("dynamo", "script")
  note: str = field(default="", compare=False)


def image(torch: Any, module: Any, side: int = IMAGE, channels: int = 3) -> Built:
  """An image model: one NCHW float input `x` with a dynamic batch."""
  return module.eval(), {"x": torch.randn(BATCH, channels, side, side)}, {"x": {0: "batch"}}


def text(torch: Any, module: Any, vocab: int, seq: int = SEQ, mask: bool = True, extra: dict[str, Any] | None = None) -> Built:
  """A text model: `input_ids` and `attention_mask` (the second row padded at its end), batch and sequence dynamic."""
  g = torch.Generator().manual_seed(0)
  ins: dict[str, Any] = {"input_ids": torch.randint(1, vocab, (BATCH, seq), generator=g)}
  if mask:
    m = torch.ones(BATCH, seq, dtype=torch.int64)
    m[1, seq - 4:] = 0
    ins["attention_mask"] = m
  ins.update(extra or {})
  return module.eval(), ins, {k: {0: "batch", 1: "seq"} for k in ins}


def resized(name: str, a: Any, axes: dict[int, str]) -> Any:
  """The dynamic export's second feed: one more batch row (the first again) and, where the sequence is dynamic, 3 fewer steps."""
  import numpy as np
  out = np.concatenate([a, a[:1]], 0) if axes.get(0) == "batch" else a
  for ax, kind in axes.items():
    if kind == "seq": out = np.take(out, np.arange(out.shape[ax] - 3), axis=ax)
  return out


def wrap(torch: Any, m: Any, fn: Callable[..., Any]) -> Any:
  """A module whose forward is fn(m, *inputs): one tensor (or a tuple of them) out of a model that returns a dict, a list or
  a ModelOutput, or that takes its inputs another way (a detector's list of images, keyword arguments)."""
  class Wrapped(torch.nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.m = m
    def forward(s, *xs: Any) -> Any: return fn(s.m, *xs)
  return Wrapped().eval()
