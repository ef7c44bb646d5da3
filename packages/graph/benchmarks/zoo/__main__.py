"""`scripts/zoo [--only REGEX] [-j N] [--force] [--resume] [--cold] [--markdown FILE] [--threads N] [--timeout S] [--list]`: export the zoo's
models, check each export on kiln against onnxruntime, print the report (and write it with --markdown). Bench env only."""
from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # Python puts a folder it runs first: its module names would shadow others
sys.path.insert(0, str(_HERE.parent))  # `python packages/graph/benchmarks/zoo` as well as `-m zoo`

from zoo import cache, catalog, report, runner  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="scripts/zoo", description=__doc__)
  p.add_argument("--only", help="run the entries whose name matches this regular expression (re.search)")
  p.add_argument("-j", "--jobs", type=int, default=1, help="models at once (each in its own processes)")
  p.add_argument("--force", action="store_true", help="export and check again even where the cache is current")
  p.add_argument("--markdown", help="write the report to this file")
  p.add_argument("--threads", type=int, help="threads for kiln (KILN_THREADS) and onnxruntime alike (default: the cores this process "
                 "may use over --jobs, so a model is checked on threads as a user runs it: kernels overlapped on threads and split into "
                 "chunks run only there)")
  p.add_argument("--timeout", type=float, default=300, help="seconds one export's check may take (load, runs, timing)")
  p.add_argument("--export-timeout", type=float, default=900, help="seconds all exports of one model may take")
  p.add_argument("--cache", help="cache directory (default .zoo-cache at the repo root)")
  p.add_argument("--cold", action="store_true", help="load with an empty kiln kernel cache (a fresh KILN_CACHE_DIR per run): cold load times")
  p.add_argument("--resume", action="store_true", help="skip every entry with a cached result, current or not (finish a cut-off run)")
  p.add_argument("--list", action="store_true", help="list the entries and exit")
  p.add_argument("--report-only", action="store_true", help="report from the cache, running nothing")
  p.add_argument("--avx2", action="store_true", help="hold kiln and the peers to AVX2 on an AVX-512 host: KILN_CPU=x86-64-v3 (unless "
                 "set), OpenVINO ONEDNN_MAX_CPU_ISA=AVX2 (onnxruntime has no such switch: its MLAS picks kernels by CPUID)")
  opts = p.parse_args(argv)
  if opts.threads is None: opts.threads = max(1, len(os.sched_getaffinity(0)) // max(1, opts.jobs))
  return opts


# what --avx2 sets: kiln's target, and oneDNN's ceiling in OpenVINO's CPU plugin (its convolutions and matmuls; a few of its
# own elementwise emitters still use AVX-512, and onnxruntime cannot be held)
AVX2_ENV = {"KILN_CPU": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def peers_held() -> str:
  """The header's words on the peers' ISA."""
  if os.environ.get("ONEDNN_MAX_CPU_ISA"):
    return f"OpenVINO held by ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}, onnxruntime not held (no switch)"
  return "peers on the host's ISA"


def main(argv: list[str]) -> int:
  opts = parse(argv)
  if opts.avx2:
    for k, v in AVX2_ENV.items(): os.environ.setdefault(k, v)  # inherited by every check's process
  todo = [(s, f) for s, f in catalog.entries() if not opts.only or re.search(opts.only, s.name)]
  if opts.list:
    for s, _ in todo: print(f"{s.family:14} {s.name}")
    print(f"{len(todo)} entries")
    return 0
  tree = cache.kiln_tree_hash()
  if opts.cold:
    runner.COLD["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-kiln-cache-")
    atexit.register(shutil.rmtree, runner.COLD["KILN_CACHE_DIR"], True)
  recs, t0 = [], time.time()
  if opts.report_only:
    recs = [r for s, _ in todo if (r := cache.read_json(cache.cache_dir(opts.cache) / "results" / f"{cache.safe(s.name)}.json"))]
  else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally below: no child left running
    pool = ThreadPoolExecutor(max(1, opts.jobs))
    try:
      futs = {pool.submit(runner.run_model, s, f, opts, tree): s for s, f in todo}
      for i, fut in enumerate(as_completed(futs), 1):
        rec = fut.result()
        recs.append(rec)
        sts = " ".join(f"{v}={r['status']}" for v, r in sorted(rec["results"].items()))
        print(f"[{i}/{len(todo)} {time.time() - t0:6.0f}s] {rec['name']}{' (cached)' if rec.get('cached') else ''}: {sts}", flush=True)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
      runner.kill_all()
  target = f"kiln compiled for KILN_CPU={os.environ['KILN_CPU']}" if os.environ.get("KILN_CPU") else "kiln compiled for the host CPU"
  header = (f"{len(recs)} entries; kiln source tree {tree}; {cache.versions()}; {opts.threads} thread(s) for kiln, onnxruntime and "
            f"OpenVINO; {target}; {peers_held()}" + (f"; only {opts.only!r}" if opts.only else ""))
  md = report.markdown(recs, header)
  if opts.markdown: Path(opts.markdown).write_text(md + "\n")
  print(md)
  bad = sum(r["status"] in ("WRONG", "CRASH", "TIMEOUT") for rec in recs for r in rec["results"].values())
  return 1 if bad else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
