"""Chat templates: the jinja2 template a model's files carry (tokenizer_config.json's chat_template, chat_template.jinja, or a
GGUF's tokenizer.chat_template) writes a conversation as the model was trained to read it.

Templates are untrusted code, rendered in jinja2's ImmutableSandboxedEnvironment (no attribute starting with "_", no method
that mutates a list or dict); here reaching for an unsafe attribute is a ChatTemplateError at once instead of jinja2's
silent undefined. The environment is transformers' (trim_blocks, lstrip_blocks, loop controls, the {% generation %} tag,
a tojson that keeps non-ASCII and does not escape HTML, raise_exception, strftime_now), and the variables are theirs:
messages, add_generation_prompt, bos_token, eos_token ("" where the model has none), plus what the caller passes (tools,
documents, ...). A rendering that writes more than MAX_RENDERED_CHARS stops with a ChatTemplateError. (A template can still
loop a long time without writing: the sandbox caps range() at 100,000 items but not nested loops.)

A model without a template: ChatML (CHATML, the template of Qwen2, SmolLM2 and many fine-tunes) where its vocabulary has
ChatML's "<|im_start|>" and "<|im_end|>" tokens, as llama.cpp falls back to; otherwise a ChatTemplateError (kiln does not
guess a format the model never saw).
"""
from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kiln.llm.tokenizer_limits import MAX_RENDERED_CHARS, MAX_TEMPLATE_CHARS, ChatTemplateError, limit

if TYPE_CHECKING:
  from kiln.llm.tokenizer_base import Tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _raise_exception(message: Any) -> None:
  raise ChatTemplateError(f"the chat template raised: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> Any:
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}, which marks the assistant's text: rendered as its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.Scope(body, lineno=lineno)

  class Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
      raise ChatTemplateError(f"the chat template reached for {attribute!r} of a {type(obj).__name__}, which the sandbox refuses")

    def call(self, context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
      from jinja2.exceptions import SecurityError
      try:
        return super().call(context, obj, *args, **kwargs)
      except SecurityError as e:
        raise ChatTemplateError(f"the chat template made a call the sandbox refuses: {e}") from e

  env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, Generation])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
  """The jinja2 template of source, checked against MAX_TEMPLATE_CHARS; a syntax error is a ChatTemplateError."""
  from jinja2 import TemplateError
  limit("the chat template's characters", len(source), "MAX_TEMPLATE_CHARS", MAX_TEMPLATE_CHARS, ChatTemplateError)
  try:
    return _environment().from_string(source)
  except TemplateError as e:
    raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def render(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
  """source rendered for the conversation: messages (each a mapping with "role" and "content") and the variables."""
  from jinja2 import TemplateError
  from jinja2.exceptions import SecurityError
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise ChatTemplateError(f"messages is a {type(messages).__name__}, not a list of {{'role': ..., 'content': ...}} mappings")
  for m in messages:
    if not isinstance(m, Mapping) or "role" not in m:
      raise ChatTemplateError(f"a message is {m!r:.80}, not a mapping with a 'role'")
  template = compile_template(source)
  parts: list[str] = []
  written = 0
  try:
    for part in template.generate(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables):
      written += len(part)
      if written > MAX_RENDERED_CHARS: limit("the rendered chat's characters", written, "MAX_RENDERED_CHARS", MAX_RENDERED_CHARS, ChatTemplateError)
      parts.append(part)
  except SecurityError as e:
    raise ChatTemplateError(f"the chat template did something the sandbox refuses: {e}") from e
  except TemplateError as e:
    raise ChatTemplateError(f"the chat template failed: {e}") from e
  return "".join(parts)


def template_of(tokenizer: Tokenizer) -> str:
  """The tokenizer's template, or the ChatML fallback (see the module's doc), or a ChatTemplateError."""
  if tokenizer.chat_template is not None: return tokenizer.chat_template
  if tokenizer.token_to_id("<|im_start|>") is not None and tokenizer.token_to_id("<|im_end|>") is not None: return CHATML
  raise ChatTemplateError(f"{tokenizer.source}: the model carries no chat template and its vocabulary has no ChatML tokens to fall back "
                          "to; pass a template's text as chat_template=")


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
  source = extra.pop("chat_template", None) or template_of(tokenizer)
  names = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
  variables: dict[str, Any] = {k: (tokenizer.id_to_token(v) if v is not None else "") for k, v in names.items()}
  variables.update(extra)
  return render(source, messages, add_generation_prompt, **variables)
