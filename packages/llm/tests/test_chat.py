"""Chat templates rendered in jinja2's sandbox: ChatML and Llama 3's template give the exact text transformers renders,
and a template reaching for Python internals or mutating its input is refused with a ChatTemplateError."""
from __future__ import annotations

import pytest
from tokenizer_case import gguf_bpe_fields, gguf_spm_fields

from kiln.llm import chat
from kiln.llm.tokenizer import CHATML, ChatTemplateError, tokenizer_from_gguf_fields

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, ça va?"}, {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "Thanks"}]

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_chatml():
  text = chat.render(CHATML, MESSAGES[:2])
  assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi, ça va?<|im_end|>\n<|im_start|>assistant\n"
  assert chat.render(CHATML, MESSAGES[:2], add_generation_prompt=False).endswith("ça va?<|im_end|>\n")


def test_llama3_template():
  text = chat.render(LLAMA3, MESSAGES, bos_token="<|begin_of_text|>")
  assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHi, ça va?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nOui.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_with_bos_is_not_given_a_second_bos():
  template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
  tok = tokenizer_from_gguf_fields(gguf_spm_fields() | {"tokenizer.chat_template": template}, "t")
  ids = tok.encode_chat([{"role": "user", "content": "hello"}])
  assert ids[0] == tok.bos_id and ids[1] != tok.bos_id and tok.decode(ids, strip_added=False) == "<s>hello"
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"


@pytest.mark.parametrize("template", [
  "{{ messages.__class__ }}",
  "{{ ''.__class__.__mro__[1].__subclasses__() }}",
  "{{ raise_exception.__globals__ }}",
  "{% set _ = messages.append({'role': 'x'}) %}",
  "{{ messages[0].update({'role': 'x'}) }}",
])
def test_sandbox_refuses(template):
  with pytest.raises(ChatTemplateError, match="sandbox refuses"):
    chat.render(template, MESSAGES)


def test_template_errors():
  with pytest.raises(ChatTemplateError, match="raised: no system role"):
    chat.render("{{ raise_exception('no system role') }}", MESSAGES)
  with pytest.raises(ChatTemplateError, match="does not compile"):
    chat.render("{% for %}", MESSAGES)
  with pytest.raises(ChatTemplateError, match="not a list"):
    chat.render(CHATML, "hello")
  with pytest.raises(ChatTemplateError, match="'role'"):
    chat.render(CHATML, [{"content": "x"}])


def test_rendering_is_bounded(monkeypatch):
  monkeypatch.setattr(chat, "MAX_RENDERED_CHARS", 1000)
  with pytest.raises(ChatTemplateError, match="MAX_RENDERED_CHARS"):
    chat.render("{% for i in range(100000) %}xxxxxxxxxx{% endfor %}", MESSAGES)


def test_transformers_environment():
  text = chat.render("{{ messages[1] | tojson }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
                     "{% generation %}[{{ messages[2].content }}]{% endgeneration %}", MESSAGES)
  assert text == '{"role": "user", "content": "Hi, ça va?"}system[Oui.]'


def test_no_template():
  spm = tokenizer_from_gguf_fields(gguf_spm_fields(), "plain.gguf")
  with pytest.raises(ChatTemplateError, match="no chat template"):
    spm.apply_chat_template(MESSAGES)
  assert spm.apply_chat_template(MESSAGES[:1], chat_template=CHATML).startswith("<|im_start|>system")
  bpe = tokenizer_from_gguf_fields(gguf_bpe_fields("gpt2"), "chatml.gguf")   # has <|im_start|> and <|im_end|>: ChatML
  assert bpe.apply_chat_template(MESSAGES[:1]) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
