"""Same-plan A/B of the runtime's serial rule (kiln.runtime.cpu.serial_rule): a split kernel over a symbolic axis runs
on the calling thread alone where its work at the bound values is small. One plan is built and the rule is switched off
and on between interleaved rounds, so both arms share every buffer and kernel: two models loaded side by side differed
by as much as the rule does (the second loaded ran faster), which an A/B of two loads cannot tell from the rule.

Zoo dynamic exports (from the zoo's cache: run `scripts/zoo` first) at batch 1 and at the zoo's resized feeds, and GGUF
decode plans. Dev or bench environment; CPU plans.

Run: `python packages/graph/benchmarks/serial_ab.py [--cache .zoo-cache] [--rounds 12] NAME|MODEL.gguf ...`, NAME as the
zoo cache's folders (hf__qwen2, tv__mobilenet_v2)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.runtime.cpu.core_trip import round_trip_ns
from kiln.runtime.cpu.sequence import step_word

ROUND_S = 0.2  # each arm's timed stretch a round


def ruled(plan: Any) -> list[Any]:
  """The plan's bound calls that carry a serial rule."""
  return [pk.bound for pk in plan.kernels if getattr(pk.bound, "rule", None) is not None]


def switch(calls: Sequence[Any], rules: dict[int, Any], on: bool) -> None:
  """The rule on (each call's own, `serial` from its bound values) or off (every chunked call split), sequences too."""
  for b in calls:
    b.rule, b.serial = (rules[id(b)] if on else None), False
    for row in b.rows: row[3] = step_word(b)
    if on: b.retune()


def ab(label: str, plan: Any, run: Callable[[], Any], rounds: int) -> None:
  calls = ruled(plan)
  rules = {id(b): b.rule for b in calls}
  ms: dict[bool, list[float]] = {True: [], False: []}
  for r in range(rounds):
    for on in ((True, False) if r % 2 == 0 else (False, True)):  # ABBA: neither arm always runs first
      switch(calls, rules, on)
      run(); run()
      t0, n = time.perf_counter(), 0
      while time.perf_counter() - t0 < ROUND_S: run(); n += 1
      ms[on].append((time.perf_counter() - t0) / n * 1e3)
  switch(calls, rules, True)
  run()
  a, b = statistics.median(ms[True]), statistics.median(ms[False])
  alone = sum(1 for c in calls if c.serial)
  print(f"{label:34s} rule on {a:8.3f} ms  off {b:8.3f} ms  on/off {a / b:.3f}  alone {alone}/{len(calls)} ruled  "
        f"hand-off {round_trip_ns() or 0:.0f} ns", flush=True)


def zoo_model(cache: Path, name: str, rounds: int) -> None:
  sys.path.insert(0, str(Path(__file__).parent))
  from zoo.check import dims_of

  from kiln.graph import onnx as konnx
  folder = cache / "onnx" / name
  path = folder / "dynamo-dynamic.onnx"
  stored = dict(np.load(folder / "feeds.npz"))
  feeds = {k.removeprefix("resized:"): v for k, v in stored.items() if k.startswith("resized:")} or stored
  dims = dims_of(path.read_bytes(), json.loads((folder / "export.json").read_text())["axes"])
  model = konnx.load(str(path), dims=dims)
  for tag, fed in (("batch 1", {k: v[:1] for k, v in feeds.items()}), ("resized " + "x".join(map(str, next(iter(feeds.values())).shape[:2])), feeds)):
    model.run(fed)
    ab(f"{name} {tag}", model.compiled.plan, lambda fed=fed: model.run(fed), rounds)


def gguf_decode(path: str, rounds: int) -> None:
  from kiln.llm import load
  llm = load(path)
  list(llm.generate(list(range(1, 49)), max_new_tokens=4))  # builds the decode plan, 52 positions cached
  plan = llm.runner.plan("decode").plan
  ab(f"{Path(path).name} decode step", plan, plan.execute, rounds)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("models", nargs="+")
  ap.add_argument("--cache", type=Path, default=Path(".zoo-cache"))
  ap.add_argument("--rounds", type=int, default=12)
  args = ap.parse_args()
  for m in args.models:
    if m.endswith(".gguf"): gguf_decode(m, args.rounds)
    else: zoo_model(args.cache, m, args.rounds)


if __name__ == "__main__":
  main()
