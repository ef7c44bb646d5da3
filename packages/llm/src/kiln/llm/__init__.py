"""kiln-llm: language models from GGUF and Hugging Face checkpoints, generating text on kiln-graph."""
from kiln.llm.api import LLM, load
from kiln.llm.version import __version__

__all__ = ["LLM", "__version__", "load"]
