"""The tokenizers' errors and the limits on the untrusted files they are made from, in a module below both tokenizer_base
(the Tokenizer API, whose apply_chat_template renders through chat.py) and chat.py (which raises ChatTemplateError and
checks the template limits), so neither imports the other back.

Limits (each over-limit value is a TokenizerError naming the file, the field and the limit):
  MAX_VOCAB               kiln.llm.limits's: tokens in a vocabulary
  MAX_TOKEN_BYTES         65,536    one token's text (real vocabularies' longest are runs of a few hundred spaces)
  MAX_MERGES              2**22     BPE merge rules (about one per token in real files)
  MAX_TEMPLATE_CHARS      1 MiB     a chat template (real ones are a few KB, tool-calling ones tens of KB)
  MAX_RENDERED_CHARS      64 MiB    what one rendering of a chat template may write (a loop that writes without end stops)
  MAX_TOKENIZER_JSON_BYTES 256 MiB  tokenizer.json (a 256k-token vocabulary's is about 35 MB)
  MAX_TOKENIZER_CONFIG_BYTES 16 MiB tokenizer_config.json, generation_config.json, chat_template.jinja
"""
from __future__ import annotations

from kiln.llm.errors import LLMError
from kiln.llm.limits import MAX_VOCAB

MAX_TOKEN_BYTES = 1 << 16
MAX_MERGES = 1 << 22
MAX_TEMPLATE_CHARS = 1 << 20
MAX_RENDERED_CHARS = 64 << 20
MAX_TOKENIZER_JSON_BYTES = 256 << 20
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20

__all__ = ["MAX_MERGES", "MAX_RENDERED_CHARS", "MAX_TEMPLATE_CHARS", "MAX_TOKENIZER_CONFIG_BYTES", "MAX_TOKENIZER_JSON_BYTES",
           "MAX_TOKEN_BYTES", "MAX_VOCAB", "ChatTemplateError", "TokenizerError", "limit"]


class TokenizerError(LLMError):
  """A tokenizer could not be made or used: a malformed or over-limit vocabulary, an unsupported tokenizer model or
  pre-tokenizer, an id outside the vocabulary. The message names the file and the field."""


class ChatTemplateError(TokenizerError):
  """A chat template is missing, malformed, over a limit, raised an error (raise_exception) or reached for something the
  sandbox refuses (attributes such as __class__, methods that mutate)."""


def limit(what: str, value: int, name: str, maximum: int, error: type[TokenizerError] | None = None) -> None:
  if value > maximum: raise (error or TokenizerError)(f"{what} is {value}, over {name} = {maximum}")
