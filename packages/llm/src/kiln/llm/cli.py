"""`kiln generate MODEL -p "..." [-n 64] [--temp 0.7] [--top-k K] [--top-p P] [--seed S] [--chat] [--threads N] [--context N]`:
load a GGUF file or a Hugging Face folder, stream the generated text to stdout, then print the prefill and decode
tokens/s (and the time to first token) on stderr. Registered with the `kiln` command through the entry-point group
`kiln.commands`. A bad model or argument is one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="kiln generate", description="Generate text with a language model (GGUF file or Hugging Face folder).")
  ap.add_argument("model", help="a .gguf file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
  ap.add_argument("-p", "--prompt", required=True, help="the prompt (with --chat: the user's message)")
  ap.add_argument("-n", "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)")
  ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
  ap.add_argument("--top-k", type=int, default=None)
  ap.add_argument("--top-p", type=float, default=None)
  ap.add_argument("--repeat-penalty", type=float, default=1.0)
  ap.add_argument("--seed", type=int, default=None)
  ap.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt as one user message")
  ap.add_argument("--system", default=None, help="with --chat: a system message before it")
  ap.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (sets KILN_THREADS; default: this process's physical cores)")
  ap.add_argument("--context", type=int, default=None, metavar="N", help="positions the KV cache holds (default: the model's, at most 2048)")
  return ap


def run(args: argparse.Namespace) -> int:
  from kiln.llm.api import load
  t0 = time.perf_counter()
  llm = load(args.model, context=args.context)
  tok = llm._tok()
  t1 = time.perf_counter()
  from kiln.graph.progress import reporting
  with reporting(True):  # a line on stderr while the plans compile, once that has taken a second (the first run of a model)
    llm.runner.plan("prefill"); llm.runner.plan("decode")  # compiled (or found in the plan cache) before the clock starts
  t2 = time.perf_counter()
  sampling = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed, repetition_penalty=args.repeat_penalty)
  if args.chat:
    msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
    pieces = llm.chat(msgs, max_new_tokens=args.max_new_tokens, **sampling)
  else:
    ids = tok.encode(args.prompt)
    sys.stdout.write(args.prompt)
    pieces = tok.stream(llm.generate(ids, max_new_tokens=args.max_new_tokens, **sampling), skip_special=True)
  for piece in pieces:
    sys.stdout.write(piece)
    sys.stdout.flush()
  sys.stdout.write("\n")
  t = llm.timings
  print(f"load {t1 - t0:.2f} s, compile {t2 - t1:.2f} s; prefill {t.prefill_tokens} tokens at "
        f"{t.rate(t.prefill_tokens, t.prefill_s):.1f} tokens/s (first token {t.first_token_s * 1e3:.0f} ms), "
        f"decode {t.decode_tokens} tokens at {t.rate(t.decode_tokens, t.decode_s):.1f} tokens/s", file=sys.stderr)
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)  # argparse errors exit 2 with a usage line
  if args.threads is not None and args.threads < 1: parser().error("--threads must be at least 1")
  from kiln.graph.cli_args import guarded, set_threads
  set_threads(args.threads)  # KILN_THREADS, read when the CPU runtime's pool starts, which nothing has started yet
  return guarded("kiln generate", lambda: run(args))
