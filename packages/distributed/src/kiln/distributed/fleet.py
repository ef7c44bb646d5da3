"""What replicas and pipelines share: starting workers on Ray with their placements, the weights put in the object
store once, retry bookkeeping, progress bars, worker info and one merged Chrome trace."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

import numpy as np

from kiln.distributed.errors import DistributedError
from kiln.distributed.placement import Placement
from kiln.executor import PlanSpec

# Ray restarts a dead worker without limit; kiln retries the request itself (on another replica where there is one),
# so Ray must not re-run a call on its own (max_task_retries 0): each result reaches the caller exactly once
_RESTARTS = -1


def ray_module() -> Any:
  try:
    import ray
  except ImportError as e: raise DistributedError(f"kiln.distributed needs ray ({e}); pip install kiln-distributed") from None
  if not ray.is_initialized(): raise DistributedError("no Ray cluster: call ray.init(...) (or ray.init(address=...) to join one) first")
  return ray


def actor_errors() -> tuple[type[BaseException], ...]:
  import ray.exceptions as rx
  return (rx.RayActorError, rx.ActorUnavailableError, rx.WorkerCrashedError)


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
  """Workers and their labels. Subclasses run requests on them."""

  def __init__(self, actors: list[Any], labels: list[str], keep: list[Any]):
    self.actors, self.labels = actors, labels
    self._keep = keep  # the object refs the workers were made from: Ray needs them again to restart a worker that died

  def info(self) -> list[dict[str, Any]]:
    """Each worker's pid, node, runs, build time, kernel count and kernel-cache counts (compiles, spec_loads, ...)."""
    ray = ray_module()
    return list(ray.get([a.info.remote() for a in self.actors]))

  def wait_ready(self, timeout: float = 300.0) -> None:
    """Block until every worker has rebuilt its plan. A worker that cannot (its plan fails to rebuild, or no node has
    the resources its placement asks for) raises here, naming itself."""
    import ray.exceptions as rx
    ray = ray_module()
    for a, label in zip(self.actors, self.labels):
      try: ray.get(a.info.remote(), timeout=timeout)
      except rx.GetTimeoutError:
        raise DistributedError(f"worker {label} did not start within {timeout:g} s: no node may have the resources its placement asks "
                               "for (ray status shows pending demands)") from None
      except Exception as e: raise DistributedError(f"worker {label} did not start: {e}") from e

  def started(self, wait: bool, timeout: float) -> Self:
    """This fleet, once every worker is ready when `wait` (a fleet that cannot start is shut down, then the error raised)."""
    if wait:
      try: self.wait_ready(timeout)
      except DistributedError:
        self.shutdown()
        raise
    return self

  def shutdown(self) -> None:
    ray = ray_module()
    for a in self.actors: ray.kill(a, no_restart=True)
    self.actors, self._keep = [], []

  def __enter__(self) -> Fleet: return self
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
  p.write_text(json.dumps(trace))
  return p
