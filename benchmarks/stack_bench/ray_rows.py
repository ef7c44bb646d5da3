"""The benchmark's distributed row (issue 18): a stream of encoder requests served by kiln-distributed replicas on a local
Ray cluster, 2 replicas against 1, each replica one kiln thread (KILN_THREADS=1 in the workers' environment).

The model is a BERT-style encoder built with kiln.graph (`encoder`, also what kiln-distributed's tests run): token and
position embeddings, per layer a fused QKV projection split into heads, masked attention, output projection + residual
+ layernorm, a GELU FFN + residual + layernorm, masked mean pooling. Every replica's answers are checked against the
same plan run in this process before anything is timed. Rounds alternate 1 and 2 replicas; the row gives medians.
"""
from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any

import numpy as np

from kiln_bench.bench import Bench
from kiln_bench.harness import WrongResult
from kiln_bench.table import Row

REPLICAS = "replicas: encoder request stream, 2 vs 1 replica (1 thread each)"
PIPELINE = "pipeline: the same stream, 2 stages vs 1 replica"


def encoder(layers: int = 6, hid: int = 64, heads: int = 4, ffn: int = 256, seq: int = 16, vocab: int = 100, max_batch: int = 8,
            seed: int = 18) -> Any:
  """A kiln.graph Compiled with inputs ids (batch, seq) int32 and mask (batch, seq) float32, outputs pooled (batch, hid)
  and the last hidden state (batch, seq, hid); the batch is symbolic, 1..max_batch."""
  from kiln.graph.tensor import Tensor, compile
  rng = np.random.default_rng(seed)
  def w(*s: int, scale: float = 0.1) -> Tensor: return Tensor((rng.standard_normal(s) * scale).astype(np.float32))
  dims = {"batch": (1, max_batch)}
  ids = Tensor.input("ids", ("batch", seq), np.int32, dims=dims)
  mask = Tensor.input("mask", ("batch", seq), np.float32, dims=dims)
  dh = hid // heads
  h = (w(vocab, hid, scale=0.5).embedding(ids) + w(seq, hid)).layernorm(w(hid) + 1, w(hid))
  add_mask = ((1.0 - mask) * -10000.0).reshape(-1, 1, 1, seq)
  for _ in range(layers):
    qkv = h.linear(w(3 * hid, hid), w(3 * hid))
    q, k, v = (qkv[:, :, i * hid:(i + 1) * hid].reshape(-1, seq, heads, dh).permute(0, 2, 1, 3) for i in range(3))
    att = (q @ k.transpose(-1, -2) * (1 / np.sqrt(dh)) + add_mask).softmax(-1)
    ctx = (att @ v).permute(0, 2, 1, 3).reshape(-1, seq, hid)
    h = (ctx.linear(w(hid, hid), w(hid)) + h).layernorm(w(hid) + 1, w(hid))
    h = (h.linear(w(ffn, hid), w(ffn)).gelu().linear(w(hid, ffn), w(hid)) + h).layernorm(w(hid) + 1, w(hid))
  m = mask.reshape(-1, seq, 1)
  return compile([(h * m).sum(1) / m.sum(1), h])


def requests(n: int, batch: int, seq: int = 16, vocab: int = 100, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """n requests of `batch` sequences with padded tails of random lengths."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    lengths = seq - rng.integers(0, seq // 2, batch)
    out.append({"ids": rng.integers(0, vocab, (batch, seq)).astype(np.int32),
                "mask": (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)})
  return out


def replicas(b: Bench, r: Row, pipe: Row) -> None:
  """The replicas row, and beside it (pipe, report only) the same stream through the plan cut into 2 pipeline stages."""
  import ray

  from kiln.distributed import pipeline, serve
  n, batch, layers, hid, seq = (20, 2, 2, 32, 16) if b.args.quick else (200, 4, 6, 128, 64)
  model = encoder(layers=layers, hid=hid, heads=4, ffn=4 * hid, seq=seq, vocab=1000, max_batch=batch)
  spec, weights = model.export(["pooled", "hidden"])
  reqs = requests(n, batch, seq=seq, vocab=1000)
  want = [model.run(q) for q in reqs[:8]]
  started = not ray.is_initialized()
  # address="local": a Ray of its own, never the cluster /tmp/ray/ray_current_cluster names (another process's, which
  # may be gone: two pytest workers, one running the distributed tests' cluster, hung the other here)
  if started: ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                       runtime_env={"env_vars": {"KILN_THREADS": "1", "KILN_CACHE_DIR": os.environ.get("KILN_CACHE_DIR", "")}})
  try:
    # all fleets stay up so rounds can alternate: 5 workers on Ray's 2 logical CPUs, so each asks for 0.4 of one (Ray does
    # not pin cores; an idle fleet's workers wait in their queues while another fleet runs)
    # (a cluster this process joined before, as the distributed tests' two 1-CPU nodes in the same pytest session: as
    # much of one as fits all five workers on its smallest node, so none waits for resources that never free up)
    place = {"num_cpus": 0.4 if started else min(0.4, min(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]) / 5)}
    fleets: dict[Any, Any] = {k: serve(spec, replicas=k, weights=weights, placement=place, ready_timeout=120) for k in (1, 2)}
    fleets["pipe"] = pipeline(spec, stages=2, weights=weights, placement=place, ready_timeout=120)
    for k, f in fleets.items():  # correct first: every replica's answers against this process's plan
      got = f.map(reqs[:8], progress_bar=False)
      for g, w_ in zip(got, want):
        for name, arr in zip(("pooled", "hidden"), w_):
          if not np.allclose(g[name], arr, rtol=1e-4, atol=1e-5): raise WrongResult(f"{k} replica(s): {name} differs from the local plan")
    times: dict[Any, list[float]] = {1: [], 2: [], "pipe": []}
    for _ in range(1 if b.args.quick else 3):
      for k in (1, 2, "pipe"):
        t0 = time.perf_counter()
        fleets[k].map(reqs, progress_bar=False)
        times[k].append(time.perf_counter() - t0)
    info = fleets[2].info()
    for f in fleets.values(): f.shutdown()
  finally:
    if started: ray.shutdown()
  t1, t2 = statistics.median(times[1]), statistics.median(times[2])
  r.kiln, r.ratio = t2, t1 / t2
  flops = spec_flops(spec) * n
  r.achieved = f"{n / t2:.0f} req/s (1 replica {n / t1:.0f}); {flops / t2 / 1e9:.1f} GFLOP/s"
  r.limit = f"{os.cpu_count()} cores"
  r.target, r.target_kind, r.target_value = ">= 1.7x 1 replica's req/s", "ratio", 1.7
  tp = statistics.median(times["pipe"])
  pipe.kiln, pipe.ratio, pipe.status = tp, t1 / tp, "-"
  pipe.achieved = f"{n / tp:.0f} req/s (1 replica {n / t1:.0f})"
  pipe.limit, pipe.target = f"{os.cpu_count()} cores", "(report)"
  pipe.note = ("the same stream through the plan cut in 2 stages (balanced by flops and bytes), a worker each, map()'s defaults "
               "(groups of up to 8 requests, one Ray call per stage a group, up to 4 groups in the pipeline); rounds "
               f"{', '.join(f'{t:.2f}' for t in times['pipe'])} s; ratio: 1 replica's time over the pipeline's")
  compiles = [i["cache"]["compiles"] for i in info]
  r.note = (f"{n} requests of batch {batch}, seq {seq}, {layers} layers h{hid} ffn{4 * hid} (kiln.graph encoder, {spec.kernel_count()} kernels); "
            f"map()'s defaults (up to 8 requests a Ray call, at most 2 calls in flight per replica); medians of {len(times[1])} "
            "alternating rounds: 1 replica "
            f"{', '.join(f'{t:.2f}' for t in times[1])} s, 2 replicas {', '.join(f'{t:.2f}' for t in times[2])} s; kiln column: "
            f"2 replicas' time for the stream; ratio: 1 replica's time over 2's; 2-replica workers compiled {compiles} kernels "
            "(their target has 1 thread, the driver's 2, so the first worker compiles for it and the others read the disk cache)")


def spec_flops(spec: Any) -> float:
  """The plan's estimated flops per run, from its kernels' compiled specs."""
  from kiln.executor.spec_access import compiled_doc
  return float(sum(compiled_doc(op).get("flops", 0) for op in spec.ops if op.kind == "kernel"))


def run(b: Bench) -> None:
  import importlib.util
  if importlib.util.find_spec("kiln.distributed") is None: return  # not in this environment: the row is absent
  if not b.wanted(REPLICAS): return
  pipe = Row(PIPELINE, "ms")
  b.row(REPLICAS, functools.partial(replicas, b, pipe=pipe), "ms")
  if pipe.kiln is None: pipe.status, pipe.note = "ERROR", "not measured: the replicas row failed"
  b.rows.append(pipe)
