"""Where a decode step's time goes, kernel by kernel, without Python in the measurement (dev or bench environment).

The decode plan's CPU kernels run as native sequences (kiln.runtime.cpu.sequence); CPUSequence.timed() reads the cycle
counter between its steps. This runs the step `--runs` times at `--past` cached positions, takes each kernel's median
and prints the total and the kernels grouped by name (the name says the kernel's output shape: reduce_192x18x16 is a
(192, 18, 16) output with a reduction), with bytes per second where the kernel's estimate of its memory traffic is
meaningful. CPU plans only.

Run: `$PY packages/llm/benchmarks/decode_profile.py MODEL.gguf [--past 300] [--runs 40] [--top 25]`."""
from __future__ import annotations

import argparse
import collections
import statistics

import numpy as np

from kiln.llm import load
from kiln.runtime.cpu.sequence import CPUSequence
from kiln.runtime.cpu.spin import cycles_per_us


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("model")
  ap.add_argument("--past", type=int, default=300, help="cached positions the step attends over")
  ap.add_argument("--runs", type=int, default=40)
  ap.add_argument("--top", type=int, default=25, help="kernel names to list")
  args = ap.parse_args()
  llm = load(args.model, context=max(args.past + 1, 64))
  list(llm.generate(list(range(1, 9)), max_new_tokens=2))  # builds and warms the decode plan
  plan = llm.runner.plan("decode").plan
  plan.set_vars({"past": args.past})
  seqs = [s for _, run in plan._runs for s in run if isinstance(s, CPUSequence)]
  if not seqs: raise SystemExit("this plan has no native sequences (not a CPU plan, or KILN_POOL=python)")
  rate = cycles_per_us()
  cycles: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
  with plan._enter_running():
    for _ in range(args.runs):
      for si, s in enumerate(seqs):
        for i, c in enumerate(s.timed()): cycles[(si, i)].append(int(c))
  calls = {(si, i): c for si, s in enumerate(seqs) for i, c in enumerate(s.calls)}
  by_name: dict[str, list[float]] = collections.defaultdict(list)
  for key, cs in cycles.items(): by_name[calls[key].prog.name].append(statistics.median(cs) / rate)
  total = sum(sum(v) for v in by_name.values())
  print(f"{args.model}: decode step at past={args.past}: {total:.0f} us over {len(cycles)} kernels (medians of {args.runs} runs)")
  for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
    first = next(c for c in calls.values() if c.prog.name == name)
    mb = first.prog.spec.mem_bytes / 1e6
    rate_txt = f"{mb * 1e3 / float(np.median(ts)):7.1f} GB/s" if mb < 64 else " " * 12
    print(f"{sum(ts):9.1f} us {len(ts):4d}x {float(np.median(ts)):8.2f} us each {rate_txt}  threads {first.workers}  {name}")


if __name__ == "__main__":
  main()
