"""Serving when something is wrong (kiln issue 41 items 10-12): a bad request fails alone and typed, a Ray session that
ends mid-map is one ClusterLost (and no second Ray), a fleet the cluster cannot hold is refused at once, and the
README's example runs as written."""
from __future__ import annotations

import importlib
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from encoder import encoder, feeds, same  # noqa: E402
from ray_driver import connect  # noqa: E402

from kiln.distributed import ClusterLost, DistributedError, PlacementError, RequestsFailed, pipeline, serve  # noqa: E402
from kiln.executor.portable import check_feeds  # noqa: E402
from kiln.ir.errors import PlanSpecError  # noqa: E402

# the modules (kiln.distributed's names serve and pipeline are the functions)
serve_module, pipeline_module = (importlib.import_module(f"kiln.distributed.{m}") for m in ("serve", "pipeline"))
HOSTS = [{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]
README = Path(__file__).parent.parent / "README.md"


def _requests() -> tuple[list[dict], list[dict | None]]:
  """Six requests, 2 with float64 ids (the plan takes int32: refused) and 4 with a mask one column short; the wanted
  outputs of the good ones (None for the bad)."""
  c = encoder()
  reqs: list[dict] = [feeds(1 + i, seed=40 + i) for i in range(6)]
  reqs[2] = {"ids": reqs[2]["ids"].astype(np.float64), "mask": reqs[2]["mask"]}
  reqs[4] = {"ids": reqs[4]["ids"], "mask": reqs[4]["mask"][:, :15]}
  return reqs, [None if i in (2, 4) else dict(zip(["pooled", "hidden"], c.run(q))) for i, q in enumerate(reqs)]


def _check(got: list, wants: list) -> None:
  for g, w in zip(got, wants):
    if w is not None: same(g, w)
  assert isinstance(got[2], PlanSpecError) and "'ids' has dtype float64, the plan takes int32" in str(got[2]), got[2]
  assert isinstance(got[4], PlanSpecError) and "dim 1" in str(got[4]), got[4]


def test_a_bad_request_fails_alone_and_typed(cluster, bert, monkeypatch) -> None:
  spec, weights, f, want = bert
  reqs, wants = _requests()
  with serve(spec, replicas=2, weights=weights, placement=HOSTS) as r:
    runs = sum(i["runs"] for i in r.info())
    got = r.map(reqs, progress_bar=False, return_exceptions=True)
    _check(got, wants)
    assert sum(i["runs"] for i in r.info()) == runs + 4  # the bad ones were refused here, never sent
    # by default the map raises once every request is done, and loses no result
    with pytest.raises(RequestsFailed, match="2 of 6 requests failed") as e: r.map(reqs, progress_bar=False)
    assert sorted(e.value.errors) == [2, 4] and isinstance(e.value, DistributedError)
    _check(e.value.results, wants)
    typed, rest = e.value.split(PlanSpecError)  # an ExceptionGroup: except* PlanSpecError catches the requests' errors
    assert typed is not None and len(typed.exceptions) == 2 and rest is None
    # one request: its own error, raised on the driver (no Ray wrapper); other dtypes of the same kind are cast
    with pytest.raises(PlanSpecError, match="dtype float64") as one: r.run(reqs[2])
    assert not isinstance(one.value, ray.exceptions.RayError)
    same(r.run({"ids": f["ids"].astype(np.int64), "mask": f["mask"].astype(np.float64)}), want)
    # a kiln error raised by a worker's plan run comes back as itself, in its request's place: here the driver's dtype
    # check is taken away, so the float64 request reaches the worker's PortablePlan, which refuses it
    monkeypatch.setattr(serve_module, "prepare", lambda spec, feeds, vars: check_feeds(spec, feeds, vars))
    got = r.map(reqs, progress_bar=False, return_exceptions=True, per_call=3)
    _check(got, wants)
    assert "raised on kiln.distributed worker replica-" in "".join(getattr(got[2], "__notes__", []))
  monkeypatch.setattr(pipeline_module, "prepare", lambda spec, feeds, vars: check_feeds(spec, feeds, vars))
  with pipeline(spec, stages=2, weights=weights, placement=HOSTS) as p:  # stage 0 refuses it, stage 1 passes that on
    _check(p.map(reqs, progress_bar=False, return_exceptions=True, per_call=2), wants)
    with pytest.raises(RequestsFailed): p.map(reqs, progress_bar=False)


def test_ray_shutdown_mid_map_is_one_typed_error(cluster, bert, reconnect) -> None:
  """ray.shutdown() while a map runs, from its own callback and from another thread: ClusterLost with the results that
  came back, and never a second Ray (Ray's calls would start one, then fail with 'No owner found for object')."""
  spec, weights, f, want = bert
  reqs = [feeds(1 + i % 4, seed=i) for i in range(60)]
  r = serve(spec, replicas=2, weights=weights, placement=HOSTS)
  finished = itertools.count(1)
  def stop(i: int) -> None:  # at the third result, whichever request it is: calls come back in any order across replicas
    if next(finished) == 3: ray.shutdown()
  with pytest.raises(ClusterLost, match="has ended") as e: r.map(reqs, progress_bar=False, per_call=1, on_result=stop)
  assert not ray.is_initialized()
  done = [x for x in e.value.results if x is not None]
  assert 3 <= len(done) < len(reqs) and all(isinstance(x, dict) for x in done)
  with pytest.raises(ClusterLost): r.run(f)  # the fleet's workers went with the session
  assert not ray.is_initialized()
  r.shutdown()  # nothing left to stop: no error
  # again from another thread, while the map waits on Ray (Ray raises SystemExit in the waiting call)
  connect(reconnect)
  r = serve(spec, replicas=2, weights=weights, placement=HOSTS)
  timer = threading.Timer(0.05, ray.shutdown)
  def stop_soon(i: int) -> None:
    if i == 0: timer.start()
  with pytest.raises(ClusterLost): r.map(reqs * 20, progress_bar=False, per_call=1, on_result=stop_soon)
  timer.join()
  assert not ray.is_initialized()
  import ray._private.auto_init_hook as hook
  assert hook.enable_auto_connect  # Ray's auto-init was off only while the fleet's calls ran


def test_a_fleet_the_cluster_cannot_hold_fails_at_once(cluster, bert) -> None:
  spec, weights, _, _ = bert
  t0 = time.perf_counter()
  with pytest.raises(PlacementError, match=r"4 replicas ask for CPU 4 in all \(replica-0: CPU 1; .*\), and the cluster has CPU 2, "
                                           r"host0 1, host1 1 \(2 nodes: "):
    serve(spec, replicas=4, weights=weights)
  with pytest.raises(PlacementError, match=r"2 stages ask for CPU 2, host1 2 in all"):
    pipeline(spec, stages=2, weights=weights, placement=HOSTS[1])
  assert time.perf_counter() - t0 < 5  # at once: it waited ready_timeout (300 s) before
  with serve(spec, replicas=4, weights=weights, placement={"num_cpus": 0.5}) as r:  # what the message suggests fits
    assert len(r.info()) == 4


def _readme_example() -> str:
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert blocks, "README.md has no python example"
  return blocks[0]


def test_readme_example_runs_as_written(cluster, tmp_path) -> None:
  """The README's first python block, run as a script by another driver joining the test cluster (RAY_ADDRESS, which
  ray.init() reads); a few lines after it check what it made."""
  code = _readme_example() + """
from pathlib import Path
from kiln.ir.errors import PlanSpecError
assert len(ys) == len(requests) and ys[0]["probs"].shape == (8, 10)
assert isinstance(got[3], PlanSpecError) and all(isinstance(g, dict) for g in got[:3])
assert y["probs"].shape == (32, 10) and Path("trace.json").stat().st_size > 0
print("README OK")
"""
  env = dict(os.environ, RAY_ADDRESS=cluster.address, KILN_CACHE_DIR=cluster.kiln_env["KILN_CACHE_DIR"])
  env.pop("RAY_JOB_CONFIG_JSON_ENV_VAR", None)
  p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
  assert p.returncode == 0 and "README OK" in p.stdout, p.stderr[-3000:]
