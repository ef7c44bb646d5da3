"""kiln.distributed on a real two-node Ray cluster on loopback (kiln issue 18)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from encoder import encoder, feeds, same  # noqa: E402

from kiln.distributed import DistributedError, NoWorkerLeft, Placement, PlacementError, RequestsFailed, merged_trace, pipeline, serve, write_trace  # noqa: E402
from kiln.executor import PlanSpec, PortablePlan  # noqa: E402
from kiln.executor.planspec import KernelEntry  # noqa: E402
from kiln.ir.errors import PlanSpecError, VariableBoundsError  # noqa: E402


def test_spec_round_trips_through_json(bert) -> None:
  spec, weights, f, want = bert
  assert spec.kernel_count() > 40 and [i.name for i in spec.inputs] == ["ids", "mask"]
  assert spec.outputs[0].shape == ["batch", 64] and spec.variables == {"batch": (1, 8)}
  same(PortablePlan(PlanSpec.from_json(spec.to_json()), weights).run(f), want)


def test_pipeline_two_hosts_bit_identical_and_compiles_nothing(cluster, bert, tmp_path) -> None:
  spec, weights, f, want = bert
  hosts = [Placement(resources={"host0": 1}), Placement(resources={"host1": 1})]
  with pipeline(spec, stages=2, weights=weights, placement=hosts) as p:
    assert len(p.stages) == 2 and all(n > 0 for n in p.activation_bytes()[:1])
    same(p.run(f), want)
    info = p.info()
    assert len({i["node_id"] for i in info}) == 2  # one stage per simulated host
    # every kernel from the spec's object code, none compiled: one load per distinct kernel (repeated layers share one)
    distinct = [len({e.compiled for e in st.ops if isinstance(e, KernelEntry)}) for st in p.stages]
    for i, d in zip(info, distinct): assert i["cache"]["compiles"] == 0 and i["cache"]["spec_loads"] == d > 0 and d <= i["kernels"], i
    assert sum(i["kernels"] for i in info) == spec.kernel_count()
    # several requests overlap in the pipeline, each with its own batch size; results in order
    reqs = [feeds(b, seed=b) for b in (1, 4, 2, 8, 5)]
    c = encoder()
    for got, r in zip(p.map(reqs, progress_bar=False), reqs): same(got, dict(zip(["pooled", "hidden"], c.run(r))))
    trace = p.trace(f)
    lanes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert lanes == {0: "stage-0", 1: "stage-1"}
    kernels = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(kernels) == spec.kernel_count() and {e["pid"] for e in kernels} == {0, 1}
    assert json.loads(write_trace(trace, tmp_path / "t.json").read_text()) == trace


def test_replicas_spread_requests_in_order(cluster, bert, capsys) -> None:
  spec, weights, f, want = bert
  c = encoder()
  reqs = [feeds(b, seed=10 + i) for i, b in enumerate((2, 3, 1, 8, 4, 2, 6, 3))]
  with serve(spec, replicas=2, weights=weights, placement=[{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]) as r:
    got = r.map(reqs, progress_bar=False)
    for g, q in zip(got, reqs): same(g, dict(zip(["pooled", "hidden"], c.run(q))))
    runs = [i["runs"] for i in r.info()]
    assert sum(runs) == len(reqs) and min(runs) >= 1  # both replicas took work
    # one request's batch cut over both replicas gives the whole batch's result
    big = feeds(8, seed=99)
    same(r.run(big, shard=True), dict(zip(["pooled", "hidden"], c.run(big))))
    trace = merged_trace([])
    assert trace["traceEvents"] == []
    r.map(reqs[:3], progress_bar=True)  # a terminal gets a tqdm bar (asked for here: the tests' stderr is no terminal)
    err = capsys.readouterr().err
    assert "kiln replicas" in err and "3/3" in err
    assert {e["args"]["name"] for e in r.trace(f)["traceEvents"] if e["ph"] == "M"} == {"replica-0", "replica-1"}


def _wait_back(fleet) -> list[dict]:
  deadline = time.time() + 120
  while True:
    try: return fleet.info()
    except Exception:
      if time.time() > deadline: raise
      time.sleep(0.5)


def test_a_dying_replica_loses_no_request(cluster, bert) -> None:
  """A replica killed while it holds requests is restarted by Ray; its requests are sent to the other replica, and every
  result comes back once, in order, correct."""
  spec, weights, f, want = bert
  c = encoder()
  reqs = [feeds(1 + i % 8, seed=200 + i) for i in range(200)]  # the stream of 200
  wants = [dict(zip(["pooled", "hidden"], c.run(q))) for q in reqs]
  seen: list[int] = []
  with serve(spec, replicas=2, weights=weights, placement=[{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]) as r:
    def kill_after_three(i: int) -> None:
      seen.append(i)
      if len(seen) == 3: ray.kill(r.actors[1], no_restart=False)  # it holds up to `window` requests right now
    got = r.map(reqs, progress_bar=False, on_result=kill_after_three)
    assert sorted(seen) == list(range(len(reqs))) and len(got) == len(reqs)
    assert r.retried >= 1  # the killed replica's requests were sent again
    for g, w in zip(got, wants): same(g, w)
    assert len(_wait_back(r)) == 2  # Ray restarted it and it rebuilt its plan
    same(r.run(f), want)


def test_a_dying_stage_loses_no_request(cluster, bert) -> None:
  spec, weights, f, want = bert
  c = encoder()
  reqs = [feeds(1 + i % 8, seed=300 + i) for i in range(12)]
  wants = [dict(zip(["pooled", "hidden"], c.run(q))) for q in reqs]
  with pipeline(spec, stages=2, weights=weights, placement=[{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]) as p:
    def kill_second_stage(i: int) -> None:
      if i == 1: ray.kill(p.actors[1], no_restart=False)  # requests 2.. are in the pipeline (window 4)
    got = p.map(reqs, progress_bar=False, on_result=kill_second_stage)
    assert p.retried >= 1
    for g, w in zip(got, wants): same(g, w)
    same(p.run(f), want)


def _wait_dead(actor, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
  """Until a killed actor answers no call (Ray's own readiness call fails with the actor's death)."""
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    try: ray.get(actor.__ray_ready__.remote(), timeout=10)
    except ray.exceptions.RayActorError: return
    time.sleep(0.05)
  raise AssertionError(f"the killed actor still answers after {timeout} s")


def test_no_replica_left_is_a_typed_error(cluster, bert) -> None:
  spec, weights, f, _ = bert
  r = serve(spec, replicas=1, weights=weights, placement={"resources": {"host1": 1}}, retries=1)
  ray.kill(r.actors[0], no_restart=True)
  _wait_dead(r.actors[0])  # ray.kill is asynchronous: a request sent at once could still be served (seen once in a local CI run)
  with pytest.raises(NoWorkerLeft, match="failed 2 times, on replica-0;") as e: r.run(f)
  assert e.value.workers == ["replica-0"]  # each worker once, however often the request failed on it
  r.shutdown()
  with pytest.raises(DistributedError, match="shut down"): r.run(f)


def test_placement_by_node_and_by_resources(cluster, bert) -> None:
  spec, weights, f, want = bert
  nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
  assert len(nodes) == 2
  with serve(spec, replicas=2, weights=weights, placement=[Placement(node_id=nodes[1]), Placement(node_id=nodes[0])]) as r:
    assert [i["node_id"] for i in r.info()] == [nodes[1], nodes[0]]
    same(r.run(f), want)
  host_of = {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("host")) for n in ray.nodes() if n["Alive"]}
  with pipeline(spec, stages=2, weights=weights, placement=[{"resources": {"host1": 1}}, {"resources": {"host0": 1}}]) as p:
    assert [host_of[i["node_id"]] for i in p.info()] == ["host1", "host0"]
  # no node has a GPU or a host2: the worker cannot start, and the error says so at once, with what the cluster has
  t0 = time.perf_counter()
  with pytest.raises(PlacementError, match=r"replica-0 asks for CPU 1, GPU 1, and no node has that; the cluster has CPU 2, host0 1, host1 1"):
    serve(spec, replicas=1, weights=weights, placement=Placement(num_gpus=1))
  with pytest.raises(PlacementError, match="replica-0 asks for CPU 1, host2 1, and no node has that"):
    serve(spec, replicas=1, weights=weights, placement={"resources": {"host2": 1}})
  with pytest.raises(PlacementError, match="is pinned to node 0123, which is not an alive node"):
    pipeline(spec, stages=2, weights=weights, placement=[{}, {"node_id": "0123"}])
  assert time.perf_counter() - t0 < 5
  # it fits the cluster but not now (another fleet holds host1): that waits, up to ready_timeout, and says what is free
  with serve(spec, replicas=1, weights=weights, placement={"resources": {"host1": 1}}):
    with pytest.raises(DistributedError, match=r"replica-0 did not start within 1 s: it asks for CPU 1, host1 1, .*free now: CPU 1, host0 1"):
      serve(spec, replicas=1, weights=weights, placement={"resources": {"host1": 1}}, ready_timeout=1)


def test_bad_arguments(cluster, bert) -> None:
  spec, weights, f, _ = bert
  from kiln.graph.tensor import Tensor, compile
  fixed_spec, fixed_w = compile([Tensor.input("x", (4, 8)).relu()]).export(["y"])
  with serve(fixed_spec, replicas=1, weights=fixed_w) as r:
    x = np.arange(32, dtype=np.float32).reshape(4, 8) - 16
    np.testing.assert_array_equal(r.run({"x": x})["y"], np.maximum(x, 0))
    with pytest.raises(DistributedError, match="first dim to be one runtime variable"): r.run({"x": x}, shard=True)
    # bad requests fail in the caller, typed, and are never sent; the good ones run
    runs = r.info()[0]["runs"]
    with pytest.raises(RequestsFailed, match="1 of 2 requests failed") as e: r.map([{"x": x}, {"x": x[:, :7]}])
    assert list(e.value.errors) == [1] and isinstance(e.value.errors[1], PlanSpecError) and "dim 1" in str(e.value.errors[1])
    np.testing.assert_array_equal(e.value.results[0]["y"], np.maximum(x, 0))
    with pytest.raises(PlanSpecError, match=r"feeds \['z'\] are not inputs"): r.run({"x": x, "z": x})
    with pytest.raises(PlanSpecError, match="is not an array"): r.run({"x": [[1.0], [1.0, 2.0]]})
    with pytest.raises(PlanSpecError, match="a request is a mapping"): r.run(x)  # type: ignore[arg-type]
    assert r.info()[0]["runs"] == runs + 1
  with pipeline(spec, stages=2, weights=weights) as p:
    with pytest.raises(VariableBoundsError, match=r"dim 0 \(batch\) is 9, outside the bounds \[1, 8\]"): p.run(feeds(9))
  with pytest.raises(DistributedError, match="PlanSpec"): serve({"not": "a spec"}, replicas=1)  # type: ignore[arg-type]
  with pytest.raises(DistributedError, match="positive"): serve(spec, replicas=0)
  with pytest.raises(DistributedError, match="placements for"): pipeline(spec, stages=2, weights=weights, placement=[{}])
  with pytest.raises(DistributedError, match="bad placement {'num_cpu': 1}"): serve(spec, replicas=1, placement={"num_cpu": 1})
  with pytest.raises(DistributedError, match="did not start"):  # a weight missing: the worker says which
    serve(spec, replicas=1, weights={})
