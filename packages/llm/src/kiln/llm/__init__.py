"""kiln-llm: language models from GGUF and Hugging Face checkpoints, generating text on kiln-graph."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.llm.version import __version__

if TYPE_CHECKING:
  from kiln.llm.api import LLM, load

__all__ = ["LLM", "__version__", "load"]


def __getattr__(name: str) -> Any:
  # the API (the checkpoint readers, the tokenizer) is imported on first use: kiln.ir.settings.installed imports every
  # package's settings module, and so this package, to key cached plans, on every model load
  if name in ("LLM", "load"):
    from kiln.llm import api
    return getattr(api, name)
  raise AttributeError(f"module 'kiln.llm' has no attribute {name!r}")
