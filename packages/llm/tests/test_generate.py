"""load() on a Hugging Face folder written by the test (config.json, model.safetensors, a character tokenizer), and the
LLM's logits, generate and chat against the numpy reference (reference_model.py); `kiln generate` on the same folder."""
from pathlib import Path

import numpy as np
import pytest
from reference_model import config, logits, weights, write_hf, write_tokenizer

from kiln.executor import cache_stats
from kiln.llm import LLM, load
from kiln.llm.cli import main
from kiln.llm.kv import ContextFullError

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, dict]:
  cfg = config("mistral")  # untied: random weights whose greedy tokens vary (a tied head mostly repeats the last token)
  W = weights(cfg, seed=5)
  folder = write_hf(tmp_path_factory.mktemp("mistral"), "mistral", W)
  write_tokenizer(folder, cfg.vocab_size)
  return load(folder, context=48, chunk=8), W


def _greedy(cfg, W, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
  """The reference's greedy continuation, one full forward pass per token."""
  out = list(ids)
  for _ in range(n): out.append(int(np.argmax(logits(cfg, W, np.array(out))[-1])))
  return out[len(ids):]


def test_logits_and_greedy_generation_match_the_reference(model: tuple[LLM, dict]):
  llm, W = model
  ids = llm.tokenizer.encode("hello world")
  stop = llm.tokenizer.stop_ids
  gen = list(llm.generate(ids, max_new_tokens=12, stop=[]))  # the prefill and decode plans
  ref = _greedy(llm.config, W, ids, 12)
  cut = next((i for i, t in enumerate(ref) if t in stop), len(ref))  # generate ends at the tokenizer's end-of-turn
  assert gen == ref[:cut] and len(gen) > 3
  got = llm.logits(ids)  # the plan of every row's logits
  want = logits(llm.config, W, np.array(ids))
  assert got.dtype == np.float32 and got.shape == (len(ids), llm.config.vocab_size)
  assert np.abs(got - want).max() / np.abs(want).max() <= TOL
  compiles = cache_stats()["compiles"]
  llm.logits(ids)  # the cache holds ids
  again = list(llm.generate(ids + gen[:3], max_new_tokens=5))  # continues from the cached prefix: only 3 tokens run
  assert llm.timings.prefill_tokens == 3 and cache_stats()["compiles"] == compiles
  assert again == _greedy(llm.config, W, ids + gen[:3], 5)[:len(again)]


def test_sampling_stop_and_context(model: tuple[LLM, dict]):
  llm, _ = model
  ids = llm.tokenizer.encode("abc")
  a = list(llm.generate(ids, max_new_tokens=10, temperature=1.0, top_k=20, seed=11))
  assert a == list(llm.generate(ids, max_new_tokens=10, temperature=1.0, top_k=20, seed=11))
  greedy = list(llm.generate(ids, max_new_tokens=6, stop=[]))
  assert len(greedy) == 6
  assert list(llm.generate(ids, max_new_tokens=6, stop=[greedy[2]])) == greedy[:greedy.index(greedy[2])]  # the stop token is not yielded
  assert list(llm.generate(ids, max_new_tokens=0)) == []
  long = list(llm.generate(ids, max_new_tokens=100, stop=[]))  # context 48: at most 48 - 3 tokens fit after the prompt ... plus the last, unfed
  assert len(long) <= 48 - len(ids) + 1
  with pytest.raises(ContextFullError): list(llm.generate(list(range(5)) * 10))


def test_chat_streams_the_reply_text(model: tuple[LLM, dict]):
  llm, W = model
  msgs = [{"role": "user", "content": "hi there"}]
  ids = llm.tokenizer.encode_chat(msgs)
  assert llm.tokenizer.decode(ids).startswith("<|im_start|>user\nhi there<|im_end|>")
  text = "".join(llm.chat(msgs, max_new_tokens=8))
  toks = list(llm.generate(ids, max_new_tokens=8))
  assert text == llm.tokenizer.decode(toks, skip_special=True)


def test_kiln_generate_command(model: tuple[LLM, dict], capsys: pytest.CaptureFixture):
  llm, _ = model
  folder = str(Path(llm.checkpoint.path))
  assert main([folder, "-p", "hello", "-n", "4"]) == 0
  out, err = capsys.readouterr()
  assert out.startswith("hello") and "decode" in err and "tokens/s" in err
  assert main([folder, "-p", "hi", "-n", "3", "--chat", "--temp", "0.8", "--seed", "1"]) == 0
  assert main([folder + "/nope", "-p", "x"]) == 2
  assert "kiln generate: error" in capsys.readouterr().err


def test_a_quantized_gguf_with_its_own_vocabulary(tmp_path: Path):
  """load() of a GGUF file (Q8_0 weights, Q/K rows permuted as llama.cpp's converter writes them, a byte-level BPE
  vocabulary and a chat template in its metadata): logits against the numpy reference on what the weights dequantise
  to, greedy tokens against the teacher-forced logits' argmax, text through the file's tokenizer."""
  from checkpoint_files import hf_weights, tiny_config, write_gguf
  from tokenizer_case import gguf_bpe_fields
  fields = gguf_bpe_fields("qwen2")
  cj = tiny_config("llama", vocab_size=len(fields["tokenizer.ggml.tokens"]))
  template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
  want_w = write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=3, scale=0.3), fmt=lambda n: "Q8_0",
                      meta={**fields, "tokenizer.chat_template": template})
  llm = load(tmp_path / "m.gguf", context=64)
  ids = llm.tokenizer.encode("hello world")
  assert llm.tokenizer.decode(ids) == "hello world"
  want = logits(llm.config, want_w, np.array(ids))
  assert np.abs(llm.logits(ids) - want).max() / np.abs(want).max() <= TOL
  toks = list(llm.generate(ids, max_new_tokens=8, stop=[]))
  assert len(toks) > 2
  forced = llm.logits(ids + toks).argmax(-1)[len(ids) - 1:-1]
  assert toks == [int(t) for t in forced[:len(toks)]]
  text = "".join(llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=6))
  assert text == llm.tokenizer.decode(list(llm.generate(llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}]), 6)), skip_special=True)


@pytest.mark.parametrize("model_name", ["no_vocab", "none"])
def test_a_gguf_marked_as_having_no_vocabulary_loads_without_a_tokenizer(tmp_path: Path, model_name: str):
  """llama.cpp writes tokenizer.ggml.model "no_vocab" or "none" for a model without a vocabulary (and llama.cpp loads
  such a file): load() gives it no tokenizer, as for a GGUF without the key, and runs on token ids."""
  from checkpoint_files import hf_weights, tiny_config, write_gguf
  cj = tiny_config("llama")
  want_w = write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=4, scale=0.3), meta={"tokenizer.ggml.model": model_name})
  llm = load(tmp_path / "m.gguf", context=32)
  assert llm.tokenizer is None
  ids = [3, 1, 4, 1, 5]
  want = logits(llm.config, want_w, np.array(ids))
  assert np.abs(llm.logits(ids) - want).max() / np.abs(want).max() <= TOL
  assert list(llm.generate(ids, max_new_tokens=3, stop=[])) == _greedy(llm.config, want_w, ids, 3)
