"""kiln.llm's tokenizer of a Hugging Face folder against transformers' AutoTokenizer (bench environment; not a test).

Folders are written in code: the tests' trained byte-level BPE (tokenizer.json) with tokenizer_config.json files saying
different things (bos/eos, add_bos_token, chat templates using what transformers' template environment offers: trim_blocks,
lstrip_blocks, loop controls, tojson, raise_exception, namespace, tools). For each: encode (with and without special
tokens), decode, and apply_chat_template's text compared. A GGUF of the same vocabulary is also loaded by transformers'
own GGUF tokenizer conversion where it can (AutoTokenizer.from_pretrained(folder, gguf_file=...)) and its ids compared.

  python packages/llm/benchmarks/compare_transformers_tokenizer.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from tokenizer_case import CORPUS, gguf_bpe_fields, hf_bpe, random_texts  # noqa: E402
from tokenizers import processors  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kiln.llm.tokenizer import load_tokenizer  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief. Ünïcödé 🙂"}, {"role": "user", "content": "  Hi, \"quoted\" <b>&</b>\n"},
            {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Thanks"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TEMPLATES = {
  "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
  "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
            "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
  "blocks": """{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {%- set ns.system = m.content -%}
    {%- continue -%}
  {%- endif %}
  {% if loop.index > 10 %}{% break %}{% endif %}
[{{ m.role | upper }}] {{ m.content | trim }}
{%- endfor %}
{% if tools %}TOOLS: {{ tools | tojson }}{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}
SYSTEM: {{ ns.system }}{{ eos_token }}
{%- if add_generation_prompt %}
[ASSISTANT]{% endif %}""",
  "raises": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
            "{% endif %}{{ messages[0]['content'] }}",
}


def write_folder(path: str, template: str, add_bos: bool) -> None:
  """A folder whose tokenizer adds bos (when add_bos) as real ones do: tokenizer.json's post-processor puts it first and
  tokenizer_config.json says add_bos_token. (Where only the config says so, kiln adds bos, as llama.cpp's converter reads the
  config and transformers 4's Llama tokenizers did; transformers 5 follows the post-processor alone.)"""
  tok = hf_bpe("gpt2")
  if add_bos:
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
                                                       special_tokens=[("<|endoftext|>", bos)])
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": add_bos, "chat_template": template,
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f: json.dump(config, f)


def main() -> None:
  texts = CORPUS + random_texts(3, 200)
  failures = 0
  for name, template in TEMPLATES.items():
    for add_bos in (False, True):
      with tempfile.TemporaryDirectory() as d:
        write_folder(d, template, add_bos)
        ours, theirs = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
        bad_encode = sum(ours.encode(t) != theirs.encode(t) for t in texts)
        bad_plain = sum(ours.encode(t, add_special=False) != theirs.encode(t, add_special_tokens=False) for t in texts)
        bad_decode = sum(ours.decode(theirs.encode(t)) != theirs.decode(theirs.encode(t)) for t in texts)
        try: want = theirs.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        except Exception as e: want = f"error: {type(e).__name__}"
        try: got = ours.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
        except Exception as e: got = f"error: {type(e).__name__}"
        same_chat = got == want or (got.startswith("error") and want.startswith("error"))
        failures += bad_encode + bad_plain + bad_decode + (not same_chat)
        print(f"{name:7s} add_bos={add_bos!s:5s}  encode mismatches {bad_encode}/{len(texts)}  without specials {bad_plain}  decode {bad_decode}  "
              f"chat text equal {same_chat}" + ("" if same_chat else f"\n  kiln: {got!r}\n  transformers: {want!r}"))
  gguf_check()
  print("FAILURES", failures)


def gguf_check() -> None:
  """transformers' GGUF tokenizer conversion of the same vocabulary, where this transformers version supports it."""
  import gguf
  with tempfile.TemporaryDirectory() as d:
    fields = gguf_bpe_fields("qwen2")
    w = gguf.GGUFWriter(os.path.join(d, "t.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2")
    w.add_token_list(fields["tokenizer.ggml.tokens"]); w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"]); w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    ours = load_tokenizer(os.path.join(d, "t.gguf"))
    try: theirs = AutoTokenizer.from_pretrained(d, gguf_file="t.gguf")
    except Exception as e:
      print(f"gguf: transformers cannot convert this GGUF's tokenizer ({type(e).__name__}: {str(e)[:200]})"); return
    texts = CORPUS + random_texts(4, 200)
    bad = sum(ours.encode(t, add_special=False) != theirs.encode(t, add_special_tokens=False) for t in texts)
    print(f"gguf (qwen2 pre-tokenizer) via transformers' GGUF conversion: encode mismatches {bad}/{len(texts)}")


if __name__ == "__main__":
  main()
