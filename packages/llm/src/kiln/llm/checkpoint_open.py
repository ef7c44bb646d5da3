"""`open_checkpoint(path)`: the Checkpoint (kiln.llm.checkpoint) at path, a GGUF file (kiln.llm.gguf_checkpoint) or a
Hugging Face folder (kiln.llm.hf). It has a module of its own, above both formats, because each format imports the
Checkpoint base: the base cannot import them back without a loop."""
from __future__ import annotations

import os

from kiln.llm.checkpoint import Checkpoint
from kiln.llm.errors import CheckpointError
from kiln.llm.gguf_checkpoint import GGUFCheckpoint
from kiln.llm.hf import HFCheckpoint

__all__ = ["open_checkpoint"]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
  """The checkpoint at path: a GGUF file, or a Hugging Face folder (config.json and safetensors weights)."""
  try: p = os.path.abspath(os.fspath(path))
  except TypeError: raise CheckpointError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}") from None
  if os.path.isdir(p): return HFCheckpoint(p)
  if not os.path.exists(p): raise CheckpointError(f"checkpoint {p} does not exist")
  return GGUFCheckpoint(p)
