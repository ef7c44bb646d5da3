"""The worker: a Ray actor holding one rebuilt plan (a replica's whole plan, or a pipeline stage), run on numpy inputs
that come through Ray's object store (zero-copy on the same node).

The plan is rebuilt in __init__, from the spec and the weights' object refs, so a worker Ray restarts after a crash
rebuilds it the same way. The spec came from the driver through Ray, which already runs the driver's code on this
worker, so its object code is trusted (`code="trusted"`): a worker on the driver's target compiles nothing."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.executor import PlanSpec, PortablePlan, cache_stats


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

  def run_many(self, requests: list[Mapping[str, np.ndarray]], vars: Mapping[str, int] | None = None) -> list[dict[str, np.ndarray]]:
    """Several requests in one call (one Ray round trip for all of them), in order."""
    return [self.run(f, vars) for f in requests]

  def run_stage_many(self, requests: list[Mapping[str, np.ndarray]], vars: list[Mapping[str, int]], *earlier: list[Mapping[str, np.ndarray]]
                     ) -> list[dict[str, np.ndarray]]:
    """A pipeline stage over a group of requests: each one's feeds, variables, and what the earlier stages returned for it
    (Ray resolves those refs before the call, zero-copy on this node)."""
    out = []
    for i, (feeds, v) in enumerate(zip(requests, vars)):
      self.runs += 1
      out.append(self.plan.run(self._inputs(feeds, [got[i] for got in earlier]), v))
    return out

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
