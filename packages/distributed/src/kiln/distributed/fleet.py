"""What replicas and pipelines share: starting workers on Ray with their placements, the weights put in the object
store once, retry bookkeeping, progress bars, worker info and one merged Chrome trace."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Self

import numpy as np

from kiln.distributed.errors import DistributedError
from kiln.distributed.placement import Placement, check_fits, placements, resources_text
from kiln.distributed.session import Session, ray_module
from kiln.executor import PlanSpec

# Ray restarts a dead worker without limit; kiln retries the request itself (on another replica where there is one),
# so Ray must not re-run a call on its own (max_task_retries 0): each result reaches the caller exactly once
_RESTARTS = -1


def put_weights(weights: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
  """The weights in Ray's object store, once for every worker (workers on the driver's node read them zero-copy)."""
  ray = ray_module()
  return {k: ray.put(np.ascontiguousarray(v)) for k, v in (weights or {}).items()}


def start_worker(label: str, spec: PlanSpec, refs: Mapping[str, Any], place: Placement, code: str) -> Any:
  from kiln.distributed.worker import PlanWorker
  ray = ray_module()
  actor_cls = ray.remote(PlanWorker)
  try:
    return actor_cls.options(name=None, max_restarts=_RESTARTS, max_task_retries=0, max_concurrency=1,
                             **place.actor_options()).remote(label, spec, dict(refs), code)
  except (ValueError, TypeError) as e: raise DistributedError(f"worker {label}: bad placement {place}: {e}") from None


class Started(NamedTuple):
  session: Session
  actors: list[Any]
  labels: list[str]
  places: list[Placement]
  keep: list[Any]


def start_fleet(kind: str, what: str, parts: Sequence[PlanSpec], weights: Mapping[str, np.ndarray] | None, placement: Any, code: str,
                check_fit: bool) -> Started:
  """One worker per part (a replica's whole spec, or a stage), labelled kind-0, kind-1, ..., once the cluster is known
  to be able to hold them all (check_fit; else a PlacementError before any is started)."""
  session = Session()
  ray = session.ray()
  places = placements(placement, len(parts), what)
  labels = [f"{kind}-{k}" for k in range(len(parts))]
  with session.translated(what):
    if check_fit: check_fits(places, labels, what, ray.nodes())
    refs = put_weights(weights)
    put: dict[int, Any] = {}  # one object per distinct part: replicas share their spec
    actors = []
    for label, part, p in zip(labels, parts, places):
      mine = {e.weight.key: refs[e.weight.key] for e in part.storages if e.weight is not None and e.weight.kind == "object" and e.weight.key in refs}
      if id(part) not in put: put[id(part)] = ray.put(part)
      actors.append(start_worker(label, put[id(part)], mine, p, code))
  return Started(session, actors, labels, places, [refs, *put.values()])


def progress(total: int, enabled: bool | None, desc: str) -> Any:
  """A tqdm bar when asked, or by default when standard error is a terminal; else a stand-in that does nothing."""
  if enabled is None: enabled = sys.stderr.isatty()
  if not enabled: return _NoBar()
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, unit="req")


class _NoBar:
  def update(self, n: int = 1) -> None: pass
  def close(self) -> None: pass


class Fleet:
  """Workers, their labels and placements, and the Ray session they live in. Subclasses run requests on them."""

  def __init__(self, started: Started):
    self.session, self.actors, self.labels, self.places = started.session, started.actors, started.labels, started.places
    self._keep = started.keep  # the object refs the workers were made from: Ray needs them again to restart a worker that died

  def _ray(self) -> Any:
    """The ray module, while this fleet's workers and session are up."""
    if not self.actors: raise DistributedError(f"this {type(self).__name__.lower()} fleet was shut down")
    return self.session.ray()

  def gather(self, refs: list[Any]) -> list[Any]:
    """ray.get of one ref per worker: a worker's error as a kiln error naming it, the session's end as ClusterLost."""
    ray, out = self.session.ray(), []
    for ref, label in zip(refs, self.labels):
      with self.session.translated(label): out.append(ray.get(ref))
    return out

  def info(self) -> list[dict[str, Any]]:
    """Each worker's pid, node, runs, build time, kernel count and kernel-cache counts (compiles, spec_loads, ...)."""
    self._ray()
    return self.gather([a.info.remote() for a in self.actors])

  def wait_ready(self, timeout: float = 300.0) -> None:
    """Block until every worker has rebuilt its plan. A worker that cannot (its plan fails to rebuild, or the resources
    its placement asks for stay taken) raises here, naming itself."""
    import ray.exceptions as rx
    ray = self.session.ray()
    for a, label, place in zip(self.actors, self.labels, self.places):
      with self.session.translated(label):
        try: ray.get(a.info.remote(), timeout=timeout)
        except rx.GetTimeoutError:
          raise DistributedError(f"worker {label} did not start within {timeout:g} s: it asks for {resources_text(place.demand())}, which the "
                                 f"cluster has but not free (free now: {resources_text(ray.available_resources())}); other work holds it, or "
                                 "the workers do not pack onto the nodes (ray status shows pending demands)") from None
        except rx.RayError as e: raise DistributedError(f"worker {label} did not start: {e}") from e

  def started(self, wait: bool, timeout: float) -> Self:
    """This fleet, once every worker is ready when `wait` (a fleet that cannot start is shut down, then the error raised)."""
    if wait:
      try: self.wait_ready(timeout)
      except DistributedError:
        self.shutdown()
        raise
    return self

  def shutdown(self) -> None:
    """Stop the workers (nothing to stop once the Ray session has ended: its workers ended with it)."""
    actors, self.actors, self._keep = self.actors, [], []
    if not actors or not self.session.alive(): return
    ray = self.session.ray()
    with self.session.translated("shutdown"):
      for a in actors: ray.kill(a, no_restart=True)

  def __enter__(self) -> Self: return self
  def __exit__(self, *exc: Any) -> None: self.shutdown()


def merged_trace(profiles: Iterable[dict[str, Any]]) -> dict[str, Any]:
  """Per-worker profiles (PlanWorker.run_profiled's second result) as one Chrome trace: one process lane per worker,
  named by its label, on a shared time axis (each worker's wall clock at its start)."""
  profs = list(profiles)
  if not profs: return {"traceEvents": [], "displayTimeUnit": "ns"}
  t0 = min(p["wall_start"] for p in profs)
  events: list[dict[str, Any]] = []
  for pid, p in enumerate(profs):
    events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": p["label"]}})
    off = (p["wall_start"] - t0) * 1e6
    for r in p["records"]:
      events.append({"name": r["name"], "cat": "kernel", "ph": "X", "ts": off + r["start"] * 1e6, "dur": r["time"] * 1e6, "pid": pid,
                     "tid": r.get("thread", 0), "args": {"op": r["op_id"], "level": r["level"], "bytes": r["bytes"], "flops": r["flops"],
                                                         "GB/s": round(r["gbs"], 3), "GFLOP/s": round(r["gflops"], 3)}})
  return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_trace(trace: dict[str, Any], path: str | Path) -> Path:
  p = Path(path)
  try: p.write_text(json.dumps(trace))
  except OSError as e: raise DistributedError(f"cannot write the trace to {p}: {e}") from None
  return p
