"""The worker: a Ray actor holding one rebuilt plan (a replica's whole plan, or a pipeline stage), run on numpy inputs
that come through Ray's object store (zero-copy on the same node).

The plan is rebuilt in __init__, from the spec and the weights' object refs, so a worker Ray restarts after a crash
rebuilds it the same way. The spec came from the driver through Ray, which already runs the driver's code on this
worker, so its object code is trusted (`code="trusted"`): a worker on the driver's target compiles nothing.

A request that fails comes back as its error in its result's place, so the other requests of its call are kept: a kiln
error as itself (with a note naming the worker), anything else as WorkerError with this worker's traceback."""
from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.distributed.errors import DistributedError, WorkerError
from kiln.executor import PlanSpec, PortablePlan, cache_stats
from kiln.ir.errors import KilnError

Outcome = dict[str, np.ndarray] | Exception


class PlanWorker:
  def __init__(self, label: str, spec: PlanSpec, weight_refs: Mapping[str, Any], code: str = "trusted"):
    import ray
    keys = list(weight_refs)
    arrays = dict(zip(keys, ray.get([weight_refs[k] for k in keys]))) if keys else {}
    t0 = time.perf_counter()
    self.label, self.plan = label, PortablePlan(spec, arrays, code=code)  # type: ignore[arg-type]
    self.build_s = time.perf_counter() - t0
    self.runs = 0

  def run(self, feeds: Mapping[str, np.ndarray], vars: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    self.runs += 1
    return self.plan.run(feeds, vars)

  def run_many(self, requests: list[Mapping[str, np.ndarray]], vars: Mapping[str, int] | None = None) -> list[Outcome]:
    """Several requests in one call (one Ray round trip for all of them), in order; a failed one as its error."""
    return [self._outcome(self.run, f, vars) for f in requests]

  def run_stage_many(self, requests: list[Mapping[str, np.ndarray]], vars: list[Mapping[str, int]], *earlier: list[Outcome]) -> list[Outcome]:
    """A pipeline stage over a group of requests: each one's feeds, variables, and what the earlier stages returned for it
    (Ray resolves those refs before the call, zero-copy on this node). A request an earlier stage failed is passed on as
    that stage's error."""
    out: list[Outcome] = []
    for i, (feeds, v) in enumerate(zip(requests, vars)):
      got = [e[i] for e in earlier]
      if failed := next((g for g in got if isinstance(g, Exception)), None):
        out.append(failed)
        continue
      self.runs += 1
      out.append(self._outcome(lambda f, e, v: self.plan.run(self._inputs(f, e), v), feeds, got, v))
    return out

  def _outcome(self, run: Callable[..., dict[str, np.ndarray]], *args: Any) -> Outcome:
    try: return run(*args)
    except KilnError as e:
      e.add_note(f"(raised on kiln.distributed worker {self.label})")
      return _portable(e)
    except Exception as e:
      return WorkerError(f"{self.label}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

  def run_profiled(self, feeds: Mapping[str, np.ndarray], vars: Mapping[str, int] | None = None, *earlier: Mapping[str, np.ndarray]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """run (or, for a stage, one request with the earlier stages' results), kernel by kernel with each one timed; the
    records come with this worker's wall clock at the start."""
    wall = time.time()
    out, prof = self.plan.run_profiled(self._inputs(feeds, earlier), vars)
    return out, {"label": self.label, "wall_start": wall, "records": [r.as_dict() for r in prof]}

  def _inputs(self, feeds: Mapping[str, np.ndarray], earlier: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """This plan's inputs, from a request's feeds and the earlier stages' results for it (a replica: the feeds alone)."""
    env: dict[str, np.ndarray] = dict(feeds)
    for got in earlier: env.update(got)
    return {n: env[n] for n in self.plan.input_names}

  def info(self) -> dict[str, Any]:
    import ray
    return {"label": self.label, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "runs": self.runs,
            "build_s": self.build_s, "kernels": len(self.plan.plan.kernels), "cache": cache_stats()}


def _portable(e: KilnError) -> Exception:
  """e if it survives the trip to the driver (an error class whose __init__ takes more than the message may not rebuild
  from its pickle, and Ray would then fail the whole call); else a DistributedError with its type and message."""
  try: pickle.loads(pickle.dumps(e))
  except Exception: return DistributedError(f"{type(e).__name__}: {e}")
  return e
