"""kiln.llm's errors, in a module of their own so every module of the layer can raise them without importing the others."""
from __future__ import annotations

from kiln.ir.errors import KilnError


class LLMError(KilnError, ValueError):
  """Base of every error kiln.llm raises on purpose; the message names what was wrong."""


class CheckpointError(LLMError):
  """A checkpoint (a GGUF file or a Hugging Face folder) cannot be opened: missing, malformed, truncated, over a limit of
  kiln.llm.limits, or holding a weight type kiln cannot read. The message names the file and the field or tensor."""


class UnsupportedArchitecture(CheckpointError):
  """The checkpoint is of a model architecture kiln.llm does not run; the message names it and the supported ones."""
