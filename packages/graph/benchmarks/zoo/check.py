"""Child process: load each of one model's ONNX exports with kiln.graph.onnx and run it against onnxruntime on the same
file. `python -m zoo.check JOB.json PROGRESS` reads the job ({"threads": n, "core_trips": round trips between cores seen
so far, "variants": {variant: {"onnx", "feeds", "axes"}}})
and appends one JSON line to PROGRESS before each variant ({"begin": variant}) and one after ({"result": {...}}), so the
parent knows which variant was running when this process crashed or hung, and reruns the rest in a fresh one.

A result's status: OK (every output matches at every feed, within TOL of the output's scale or NOISE times the
model's float32 noise floor, whichever is larger; a detector's rows may come in another order, see same_rows, and the
result then says "reordered"), TIES (a detector whose only differences are a few detections tied within float noise with
onnxruntime's, which kept the other box: not a match, not a wrong answer, listed apart), REFUSED (kiln's typed
ONNXError, at load or at run), WRONG (an output or its shape differs), CRASH (any other exception), NO-REF
(onnxruntime itself cannot run the file). Timing: kiln and onnxruntime on the same thread count, in interleaved rounds,
median milliseconds, rounds on cores placed far apart left out while they can be (Cores)."""
from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

TOL = 1e-4          # largest |kiln - onnxruntime| allowed, relative to the output's largest magnitude, unless the model's noise is larger:
MESSAGE = 6000      # characters of a refusal kept: kiln lists every node it cannot take, one a line
NOISE = 5           # times how far onnxruntime moves from itself with its graph optimizations off (the model's float32 noise floor)
TIE_ROWS = 0.02     # at most this share of a detector's rows may be a tie broken the other way (status TIES)
ROUNDS = (3, 15)    # timing rounds: at least, at most
ROUND_BUDGET = 1.0  # seconds of every engine's runs after which no more rounds start (past the minimum)
# a round times each engine in a block: its first run after settle (kept apart: what a call after an idle spell costs),
# then untimed runs until WARM s have passed since the block began, then BLOCK timed runs. After an idle spell a 2-vCPU VM
# ran kiln's and onnxruntime's next runs slow for several milliseconds, by up to 1.8x (clocks, caches and the pool's
# workers coming back), and that, not the engine, set a block of four runs' median; on an Intel KVM host both engines
# took about ten calls, 30-40 ms, to come back after 0.3 s idle (ResNet-18: 20-49 ms first, 3.5 ms steady), and a 10 ms
# warm-up left the timed runs inside that climb
BLOCK = 3
WARM = 0.05
# before each block: wait, polling every SETTLE[0] s and at most SETTLE[1] s, until this process's threads use under
# QUIET of a core. onnxruntime's pool spins for 30-40 ms after a run; kiln's next block then shared a core with it and
# timed up to 2x slow (a 4 ms VAE encoder at 6 ms), and discarding one run of the block did not cover the spin.
SETTLE = (0.005, 0.25)
QUIET = 0.2
# before each round, with more than one thread: a cache line's round trip between two cores (kiln.runtime.cpu.core_trip).
# A VM's host may move its vCPUs for seconds at a time: onto distant cores (a 2-vCPU VM: 330-530 ns against its usual
# 67-75), where split work slows, kiln's more than onnxruntime's (a 0.75 ms CNN ran at 1.4 ms, onnxruntime's 0.72 at 1.1),
# or onto the two hardware threads of one core (36-38 ns), where every engine slows. A round whose trip is more than
# FAR times off the usual one (the lower quartile of those the zoo has seen) is not counted: it waits FAR_WAIT s for the usual
# placement, at most FAR_BUDGET s an export; after that such rounds count, and the result says how many (far_rounds).
FAR = 1.6
FAR_WAIT, FAR_BUDGET = 0.5, 30.0


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
  """max |got - want| / max |want|, NaN and infinities matched by position (both NaN or the same infinity is no error)."""
  g, w = np.asarray(got), np.asarray(want)
  if g.dtype.kind not in "fc" or w.dtype.kind not in "fc":
    return 0.0 if np.array_equal(g, w) else float(np.mean(g != w)) + 1.0  # integers and bools: exact, or at least 1
  g, w = g.astype(np.float64), w.astype(np.float64)
  same = (np.isnan(g) & np.isnan(w)) | (g == w)
  if np.any(~same & ~(np.isfinite(g) & np.isfinite(w))): return float("inf")
  fin = np.abs(w[np.isfinite(w)])
  scale = max(float(fin.max()) if fin.size else 0.0, 1e-6)
  with np.errstate(invalid="ignore"): d = np.where(same, 0.0, np.abs(g - w))  # inf - inf where both are the same infinity
  return float(d.max()) / scale if d.size else 0.0


def first_line(e: BaseException) -> str:
  lines = [x for x in str(e).strip().splitlines() if x.strip()]
  return f"{type(e).__name__}: {lines[0][:400] if lines else ''}"


def settle() -> None:
  """Return once no thread of this process (a peer's spinning pool) has used more than QUIET of a core for SETTLE[0] s,
  or after SETTLE[1] s."""
  end = time.perf_counter() + SETTLE[1]
  while time.perf_counter() < end:
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(SETTLE[0])
    if time.process_time() - cpu < QUIET * (time.perf_counter() - wall): return


class Cores:
  """Whether this round's cores are placed as usual (see FAR), and what the rounds that were timed saw."""

  def __init__(self, threads: int, seen: list[float]):
    from kiln.runtime.cpu.core_trip import round_trip_ns
    self.probe = round_trip_ns if threads > 1 else None
    self.seen, self.waited, self.far_rounds, self.trips = list(seen), 0.0, 0, list[float]()

  def ready(self) -> bool:
    """True: time this round (the usual placement, one thread, or the wait spent: then it counts as far). False: waited,
    ask again."""
    trip = self.probe() if self.probe is not None else None
    if trip is None: return True
    self.seen.append(trip)
    usual = float(np.percentile(self.seen, 25))  # low: a spell placed apart can outnumber the usual trips
    if not usual / FAR <= trip <= usual * FAR:
      if self.waited < FAR_BUDGET:
        time.sleep(FAR_WAIT)
        self.waited += FAR_WAIT
        return False
      self.far_rounds += 1
    self.trips.append(trip)
    return True

  def result(self) -> dict[str, Any]:
    if not self.trips: return {}
    return {"core_trip_ns": statistics.median(self.trips), "core_trips_seen": self.seen[-50:], "far_rounds": self.far_rounds,
            "far_wait_s": self.waited}


def timed(f: Any) -> float:
  t = time.perf_counter()
  f()
  return (time.perf_counter() - t) * 1e3


def check(variant: str, job: dict[str, Any], threads: int, partial: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
  """One export on kiln against onnxruntime, then timed beside it and OpenVINO. `partial` gets kiln's result before OpenVINO
  loads the model: a peer that kills the process (OpenVINO held to AVX2 segfaults on some models) leaves kiln's result."""
  import onnxruntime as ort

  from kiln.graph import ONNXError
  from kiln.graph import onnx as konnx
  data = open(job["onnx"], "rb").read()
  feeds = [{k: np.asarray(v) for k, v in f.items()} for f in job_feeds(job)]
  r: dict[str, Any] = {"variant": variant, "bytes": len(data)}
  try:
    import onnx
    r["ops"] = sorted({f"{n.domain + '.' if n.domain not in ('', 'ai.onnx') else ''}{n.op_type}" for n in onnx.load_from_string(data).graph.node})
  except Exception: r["ops"] = []
  try:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    want = [sess.run(None, f) for f in feeds]
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds[0])
    r["ort_noise"] = max((rel_error(a, b) for a, b in zip(plain, want[0]) if isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                          and a.shape == b.shape), default=0.0)  # a ZipMap's list of dicts has no noise to measure
  except Exception as e:
    return r | {"status": "NO-REF", "message": f"onnxruntime cannot run it: {first_line(e)}"}
  t = time.perf_counter()
  try: km = konnx.load(data, dims=dims_of(data, job["axes"]) if job.get("axes") else None)
  except ONNXError as e: return r | {"status": "REFUSED", "message": str(e).strip()[:MESSAGE], "load_s": time.perf_counter() - t}
  except Exception as e:
    return r | {"status": "CRASH", "message": f"at load: {first_line(e)}", "traceback": traceback.format_exc()[-2500:]}
  r["load_s"] = time.perf_counter() - t
  r["kernels"] = len(km.plan.kernels) if km.plan is not None else 0
  errs, bad = [], []
  for i, (f, w) in enumerate(zip(feeds, want)):
    try: got = list(km.run(f).values())
    except ONNXError as e: return r | {"status": "REFUSED", "message": f"at run: {str(e).strip()[:MESSAGE]}"}
    except Exception as e: return r | {"status": "CRASH", "message": f"at run: {first_line(e)}", "traceback": traceback.format_exc()[-2500:]}
    if len(got) != len(w): bad.append(f"feed {i}: {len(got)} outputs, onnxruntime gives {len(w)}")
    for j, (g, ww) in enumerate(zip(got, w)):
      if g.shape != ww.shape: bad.append(f"feed {i} output {j}: shape {g.shape}, onnxruntime {ww.shape}")
      else: errs.append(rel_error(g, ww))
  r["rel_err"] = max(errs, default=0.0)
  tol = max(TOL, NOISE * r["ort_noise"])  # a model whose own float32 rounding moves its output that much (ill-conditioned)
  if not bad and r["rel_err"] > tol:  # a detector whose rows differ only by order or by a tie broken the other way
    how = [same_rows(list(km.run(f).values()), w, tol) for f, w in zip(feeds, want)]
    if "ties" in how and None not in how:
      return r | {"status": "TIES", "message": "a detection whose score and label tie with onnxruntime's (within the tolerance) "
                  "has another box: NMS kept the other of two anchors whose scores differ by float noise"}
    if how and all(h == "reordered" for h in how): r["reordered"], r["rel_err"] = True, 0.0
  if bad or r["rel_err"] > tol:
    return r | {"status": "WRONG", "message": "; ".join(bad) or f"max |kiln - onnxruntime| is {r['rel_err']:.2e} of the output's scale "
                f"(onnxruntime without its graph optimizations moves {r['ort_noise']:.1e})"}
  f0 = feeds[0]
  partial(r | {"status": "OK", "message": ""})
  ov = openvino(job["onnx"], f0, threads, want[0], r)
  engines = {"kiln": lambda: km.run(f0), "ort": lambda: sess.run(None, f0)}
  if ov is not None: engines["ov"] = lambda: ov(f0)
  times: dict[str, list[float]] = {e: [] for e in engines}
  firsts: dict[str, list[float]] = {e: [] for e in engines}
  spent = 0.0
  cores = Cores(threads, job.get("core_trips", []))
  while len(times["kiln"]) < ROUNDS[1] and (len(times["kiln"]) < ROUNDS[0] or spent < ROUND_BUDGET):
    if not cores.ready(): continue
    for name, run in engines.items():
      settle()
      began = time.perf_counter()
      firsts[name].append(timed(run))
      while time.perf_counter() - began < WARM: run()
      ts = [timed(run) for _ in range(BLOCK)]
      times[name].append(statistics.median(ts))
      spent += time.perf_counter() - began
  for name in engines:
    r[f"{name}_ms"], r[f"{name}_first_ms"] = statistics.median(times[name]), statistics.median(firsts[name])
  kt = times["kiln"]
  r |= {"rounds": len(kt)} | cores.result()
  # a run after the timed ones is checked too: a race between kernels on threads may spare the first run or only it
  later = max((rel_error(g, w) for g, w in zip(km.run(f0).values(), want[0]) if g.shape == np.shape(w)), default=0.0)
  if later > tol and not r.get("reordered"):
    return r | {"status": "WRONG", "message": f"a run after {len(kt)} timed ones is {later:.2e} of the output's scale from onnxruntime "
                f"(the first run: {r['rel_err']:.2e})"}
  return r | {"status": "OK", "message": ""}


def openvino(path: str, feeds: dict[str, np.ndarray], threads: int, want: list[Any], r: dict[str, Any]) -> Any:
  """OpenVINO (float32 hint, the same threads: kiln.graph.bench_peers) on the model, timed beside kiln where it loads and agrees
  with onnxruntime (within TOL of each output's scale); r gets why not (ov_error) or how far it is (ov_rel_err). None: not timed."""
  from kiln.graph.bench_peers import PEERS
  peer = next(p for p in PEERS if p.name == "openvino")
  if not peer.installed(): return None
  try:
    run = peer.load(path, {k: tuple(v.shape) for k, v in feeds.items()}, threads)
    got = run(feeds)
  except Exception as e:
    r["ov_error"] = first_line(e)[:MESSAGE]
    return None
  pairs = [(np.asarray(g), w) for g, w in zip(got, want) if isinstance(w, np.ndarray)]
  if len(got) != len(want) or any(g.shape != w.shape for g, w in pairs):
    r["ov_error"] = "its outputs differ in number or shape from onnxruntime's"
    return None
  r["ov_rel_err"] = max((rel_error(g, w) for g, w in pairs), default=0.0)
  return run


def same_rows(got: list[np.ndarray], want: list[np.ndarray], tol: float) -> str | None:
  """For a detector (outputs sharing a leading dim: one row per detection, e.g. boxes (n, 4), scores (n,), labels (n,)):
  "reordered" when kiln's rows are onnxruntime's, each within tol of its output's scale, in another order (a perfect
  matching: rows sorted by scores that tie within float noise land elsewhere); "ties" when, beyond that, at most
  TIE_ROWS of the rows differ and each such kiln row has an unmatched onnxruntime row with the same score and label (within
  tol) and only its box differs (two anchors whose scores tie within an ulp: which one NMS keeps turns on that ulp).
  None otherwise, and always when any other output differs in place."""
  rows = [j for j, w in enumerate(want) if w.ndim >= 1 and w.shape[0] > 1 and w.shape[0] == want[0].shape[0] and w.dtype.kind in "fiub"]
  if len(rows) < 2: return None
  if any(rel_error(g, w) > tol for j, (g, w) in enumerate(zip(got, want)) if j not in rows): return None
  n = want[0].shape[0]
  def joint(outs: list[np.ndarray], cols: list[int]) -> np.ndarray:
    return np.concatenate([outs[j].reshape(n, -1).astype(np.float64) / max(float(np.abs(want[j]).max()), 1e-30) for j in cols], 1)
  def matching(close: np.ndarray) -> dict[int, int]:  # onnxruntime's row -> kiln's row, as many as match (Kuhn's algorithm)
    match: dict[int, int] = {}
    def place(i: int, seen: set[int]) -> bool:
      for k in map(int, np.flatnonzero(close[i])):
        if k in seen: continue
        seen.add(k)
        if k not in match or place(match[k], seen):
          match[k] = i
          return True
      return False
    for i in range(len(close)): place(i, set())
    return match
  m = matching(np.abs(joint(got, rows)[:, None, :] - joint(want, rows)[None, :, :]).max(-1) <= tol)
  if len(m) == n: return "reordered"
  keys = [j for j in rows if want[j].ndim == 1]  # a row's score and label; the rest (its box) may differ in a tie
  left_k, left_o = sorted(set(range(n)) - set(m.values())), sorted(set(range(n)) - set(m))
  if not keys or len(keys) == len(rows) or len(left_k) > max(1, int(TIE_ROWS * n)): return None
  tied = np.abs(joint(got, keys)[left_k][:, None, :] - joint(want, keys)[left_o][None, :, :]).max(-1) <= tol
  return "ties" if len(matching(tied)) == len(left_k) else None


def job_feeds(job: dict[str, Any]) -> list[dict[str, np.ndarray]]:
  if "feeds" not in job: return [random_feeds(job["onnx"])]
  z = np.load(job["feeds"])
  fixed = {k: z[k] for k in z.files if not k.startswith("resized:")}
  return [fixed, {k: z[f"resized:{k}"] for k in fixed}] if job.get("axes") else [fixed]


def dims_of(data: bytes, axes: dict[str, dict[str, str]]) -> dict[str, tuple[int, int]]:
  """kiln's dims for a dynamic export: each input dim the exporter left symbolic gets the bounds of the kind (batch, seq) the
  spec gave its axis, whatever name the exporter chose for it."""
  import onnx

  from zoo.spec import BOUNDS
  dims = {}
  for vi in onnx.load_from_string(data).graph.input:
    for i, d in enumerate(vi.type.tensor_type.shape.dim):
      if d.dim_param and (kind := axes.get(vi.name, {}).get(str(i))): dims[d.dim_param] = BOUNDS[kind]
  return dims


def random_feeds(path: str) -> dict[str, np.ndarray]:
  """Feeds for an ONNX file from its inputs' types: floats normal, integers zero (ids and indices stay in range)."""
  import onnx
  m = onnx.load(path, load_external_data=False)
  inits = {i.name for i in m.graph.initializer}
  rng, out = np.random.default_rng(0), {}
  for vi in m.graph.input:
    if vi.name in inits: continue
    tt = vi.type.tensor_type
    dt = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
    shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim]
    out[vi.name] = rng.standard_normal(shape).astype(dt) if np.dtype(dt).kind == "f" else np.zeros(shape, dt)
  return out


def main(job_path: str, progress: str) -> int:
  job = json.load(open(job_path))
  threads = int(job.get("threads", 1))
  with open(progress, "a") as p:
    for variant, spec in job["variants"].items():
      p.write(json.dumps({"begin": variant, "t": time.time()}) + "\n")
      p.flush()
      def partial(r: dict[str, Any]) -> None:
        p.write(json.dumps({"partial": r}) + "\n")
        p.flush()
      try: r = check(variant, spec, threads, partial)
      except Exception as e:
        r = {"variant": variant, "status": "CRASH", "message": f"in the zoo's check: {first_line(e)}", "traceback": traceback.format_exc()[-2500:]}
      p.write(json.dumps({"result": r}) + "\n")
      p.flush()
  return 0


if __name__ == "__main__": sys.exit(main(sys.argv[1], sys.argv[2]))
