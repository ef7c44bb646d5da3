"""Runs the zoo: for each entry, its exports (a child process, `zoo.export`) and its checks (a child process, `zoo.check`,
watched: a variant past the timeout is killed and recorded as TIMEOUT, a child that dies mid-variant as CRASH, and the
variants left run in a fresh child). Results are cached per model (cache.py); -j runs that many models at once."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zoo import cache
from zoo.export import variants
from zoo.spec import Spec

POLL_S = 0.25
LIVE: set[subprocess.Popen[Any]] = set()  # children running now: each in its own session, so killed by kill_all, not by a signal to us


class Stopped(Exception):
  """The run is being stopped: no new child."""


_stop = False


def start(args: list[str], out: Any, threads: int) -> subprocess.Popen[Any]:
  if _stop: raise Stopped
  p = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=child_env(threads), start_new_session=True)
  LIVE.add(p)
  return p


def kill_all() -> None:
  global _stop
  _stop = True
  for p in list(LIVE): kill(p)


COLD: dict[str, str] = {}  # KILN_CACHE_DIR for --cold: an empty kernel cache, so load times include compiling every kernel


def child_env(threads: int) -> dict[str, str]:
  env = dict(os.environ) | COLD
  env["PYTHONPATH"] = os.pathsep.join([str(cache.HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
  env.update(KILN_THREADS=str(threads), OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
  return env


def kill(p: subprocess.Popen[Any]) -> None:
  try: os.killpg(p.pid, signal.SIGKILL)  # the child's own session: its helpers (a compiler it started) go too
  except ProcessLookupError: pass
  p.wait()
  LIVE.discard(p)


def tail(path: Path, n: int = 1500) -> str:
  try: return path.read_text(errors="replace")[-n:]
  except OSError: return ""


def export(spec: Spec, key: str, d: Path, timeout: float, force: bool, threads: int) -> dict[str, Any]:
  meta = cache.read_json(d / "export.json")
  if not force and meta and meta.get("key") == key: return meta  # type: ignore[no-any-return]
  shutil.rmtree(d, ignore_errors=True)
  d.mkdir(parents=True)
  log = d / "export.log"
  t = time.perf_counter()
  with open(log, "w") as out:
    p = start(["zoo.export", spec.name, str(d)], out, threads)
    try: p.wait(timeout)
    except subprocess.TimeoutExpired: pass
    kill(p)
  meta = cache.read_json(d / "export.json") or {"variants": {}}
  if p.returncode != 0 and "error" not in meta:
    how = f"timed out after {timeout:.0f} s" if time.perf_counter() - t >= timeout else f"died ({p.returncode})"
    meta["cut"], meta["error_tail"] = f"the export process {how}", tail(log)
    if "axes" not in meta: meta["error"] = meta["cut"]
    else:
      for v in variants(spec.exporters, any(meta["axes"].values())): meta["variants"].setdefault(v, {"exported": False, "error": meta["cut"]})
  meta["key"] = key
  cache.write_json(d / "export.json", meta)
  return meta  # type: ignore[no-any-return]


# the latest round trips between two cores the checks saw (check.Cores): a child that starts while its cores are placed
# unusually still knows what usual is
TRIPS: list[float] = []


def check(jobs: dict[str, dict[str, Any]], threads: int, timeout: float, work: Path) -> dict[str, dict[str, Any]]:
  """Runs the checks of `jobs` (variant -> job) in child processes, restarting after a crash or a timeout."""
  results: dict[str, dict[str, Any]] = {}
  while left := [v for v in jobs if v not in results]:
    job, progress, log = work / "job.json", work / "progress.jsonl", work / "check.log"
    job.write_text(json.dumps({"threads": threads, "core_trips": TRIPS[-200:], "variants": {v: jobs[v] for v in left}}))
    progress.write_text("")
    current: str | None = None
    partial: dict[str, Any] | None = None  # the current variant's result before its peers ran (kiln loaded and matched)
    began = 0.0
    with open(log, "w") as out:
      p = start(["zoo.check", str(job), str(progress)], out, threads)
      seen = 0
      while True:
        rc = p.poll()
        lines = progress.read_text().splitlines()
        for line in lines[seen:]:
          try: ev = json.loads(line)
          except ValueError: break  # a line still being written
          seen += 1
          if "begin" in ev: current, began, partial = ev["begin"], time.time(), None
          elif "partial" in ev: partial = ev["partial"]
          else:
            results[ev["result"]["variant"]], current = ev["result"], None
            TRIPS.extend(ev["result"].get("core_trips_seen", []))
        if rc is not None:
          LIVE.discard(p)
          break
        if current is not None and time.time() - began > timeout:
          kill(p)
          results[current] = {"variant": current, "status": "TIMEOUT", "message": f"no result after {timeout:.0f} s"}
          current = None
          break
        time.sleep(POLL_S)
    if current is not None:  # died inside a variant
      sig = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
      if partial is not None:  # in a peer, after kiln had matched onnxruntime: kiln's result stands, untimed
        results[current] = partial | {"ov_error": f"OpenVINO's process died ({sig}); nothing was timed"}
      else: results[current] = {"variant": current, "status": "CRASH", "message": f"the process died ({sig})", "log": tail(log)}
    elif not any(v in results for v in left):  # no variant even began: a fresh child would fail the same way
      msg = f"the check process ended ({p.returncode}) before any variant: {tail(log, 300)}"
      for v in left: results[v] = {"variant": v, "status": "CRASH", "message": msg}
  return results


def run_model(spec: Spec, module_file: str, opts: Any, tree: str) -> dict[str, Any]:
  """One entry, under its lock: two runs sharing a cache (two people, or -j across two commands) never work on the same
  entry at once, and the second one finds the first one's result."""
  root = cache.cache_dir(opts.cache)
  (root / "locks").mkdir(exist_ok=True)
  with open(root / "locks" / cache.safe(spec.name), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return _run_model(spec, module_file, opts, tree, root)


def _run_model(spec: Spec, module_file: str, opts: Any, tree: str, root: Path) -> dict[str, Any]:
  res_path = root / "results" / f"{cache.safe(spec.name)}.json"
  ekey = cache.export_key(spec, module_file)
  ckey = cache.check_key(tree, ekey, opts.threads)
  old = cache.read_json(res_path)
  if old and not opts.force and (old.get("check_key") == ckey or opts.resume): return old | {"cached": True}  # type: ignore[no-any-return]
  rec: dict[str, Any] = {"name": spec.name, "family": spec.family, "export_key": ekey, "check_key": ckey, "results": {}}
  jobs: dict[str, dict[str, Any]] = {}
  if spec.path: jobs["file"] = {"onnx": spec.path}
  else:
    d = root / "onnx" / cache.safe(spec.name)
    meta = export(spec, ekey, d, opts.export_timeout, opts.force, opts.threads)
    rec["export"] = {k: v for k, v in meta.items() if k in ("error", "cut", "build_s")}
    if "error" in meta:
      rec["results"]["build"] = {"variant": "build", "status": "EXPORT-FAIL", "message": meta["error"]}
    for v, m in meta.get("variants", {}).items():
      if not m.get("exported"):
        rec["results"][v] = {"variant": v, "status": "EXPORT-FAIL", "message": m.get("error") or meta.get("cut", "not exported"),
                             "export_s": m.get("seconds")}
        continue
      axes = meta["axes"] if v.endswith("/dynamic") else None
      jobs[v] = {"onnx": str(d / f"{v.replace('/', '-')}.onnx"), "feeds": str(d / "feeds.npz"), "axes": axes}
  with tempfile.TemporaryDirectory(prefix="zoo-") as work:
    rec["results"].update(check(jobs, opts.threads, opts.timeout, Path(work)))
  cache.write_json(res_path, rec)
  return rec
