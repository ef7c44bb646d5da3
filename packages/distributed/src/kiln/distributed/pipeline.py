"""Pipeline stages: a plan cut at op boundaries (kiln.executor.plan_split) into stages on different workers.

A request's feeds go to Ray's object store once; each stage gets them and the results of the earlier stages it needs as
object refs, which Ray resolves on the stage's node (zero-copy there when the producer ran on the same node, one
transfer otherwise), so activations move between stages without passing through the driver. `run` returns exactly what
the single-host plan returns. Several requests in `map` overlap: stage 1 works on request i while stage 2 works on i-1.

A stage's worker that dies is restarted by Ray and rebuilds its stage; the request is run again from its first stage
(every stage is idempotent given its inputs), at most `retries` times, then NoWorkerLeft in the requests' places names
the stage and worker. A request that fails for itself fails alone, as in Replicas.map (outcomes.py): a stage passes an
earlier stage's error for it on instead of running it."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.distributed.errors import DistributedError, NoWorkerLeft
from kiln.distributed.fleet import Fleet, Started, merged_trace, progress, start_fleet
from kiln.distributed.outcomes import Outcomes
from kiln.distributed.placement import Placement
from kiln.distributed.request import prepare
from kiln.distributed.session import actor_errors, kiln_error
from kiln.executor import PlanSpec
from kiln.executor.plan_split import ACTIVATION, split
from kiln.ir.errors import KilnError

Feeds = Mapping[str, Any]
RESTART_WAIT_S = 120.0  # how long a retry waits for a dead stage's worker to come back before resubmitting


class Pipeline(Fleet):
  def __init__(self, spec: PlanSpec, stages: list[PlanSpec], started: Started, retries: int, window: int):
    super().__init__(started)
    self.spec, self.stages, self.retries, self.window = spec, stages, retries, window
    provides: dict[str, int] = {}
    self._needs: list[list[int]] = []  # per stage: the earlier stages whose results it reads
    for k, st in enumerate(stages):
      self._needs.append(sorted({provides[i.name] for i in st.inputs if i.name in provides}))
      for o in st.outputs: provides[o.name] = k
    self._final = {o.name: provides[o.name] for o in spec.outputs}
    self.retried = 0  # requests run again after a stage's worker died

  def _submit(self, feeds_ref: Any, vals: Any, profiled: bool = False) -> list[Any]:
    """Every stage's call for one group of requests (feeds_ref: their feeds; vals: their variables), each stage reading
    the earlier stages' results it needs. Profiled (one request): each stage's pair [outputs, profile]."""
    refs: list[Any] = []  # per stage: its outputs' ref (profiled: the pair)
    outs: list[Any] = []
    for k, a in enumerate(self.actors):
      earlier = [outs[j] for j in self._needs[k]]
      if profiled:
        pair = a.run_profiled.options(num_returns=2).remote(feeds_ref, vals, *earlier)
        refs.append(pair)
        outs.append(pair[0])
      else:
        refs.append(a.run_stage_many.remote(feeds_ref, vals, *earlier))
        outs.append(refs[-1])
    return refs

  def run(self, feeds: Feeds, vars: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """The plan's outputs for one request, or its own typed error raised."""
    got = self.map([feeds], vars, progress_bar=False, return_exceptions=True)[0]
    if isinstance(got, Exception): raise got
    return got  # type: ignore[no-any-return]

  def map(self, requests: Iterable[Feeds], vars: Mapping[str, int] | None = None, progress_bar: bool | None = None,
          on_result: Callable[[int], None] | None = None, per_call: int | None = None, return_exceptions: bool = False
          ) -> list[Any]:
    """Outputs for every request, in order, as Replicas.map (each request checked here first; one that fails fails alone;
    return_exceptions, RequestsFailed and ClusterLost the same). Requests travel `per_call` at a time (default: up to 8:
    one Ray call per stage for the group), with up to `window` groups in the pipeline at once; on_result(i) is called as
    request i finishes."""
    self._ray()
    if per_call is not None and per_call < 1: raise DistributedError(f"per_call must be at least 1, got {per_call}")
    requests = list(requests)
    out = Outcomes(len(requests), progress(len(requests), progress_bar, "kiln pipeline"), on_result)
    try:
      prepared: dict[int, tuple[dict[str, np.ndarray], dict[str, int]]] = {}
      for i, f in enumerate(requests):  # the variables too: later stages may not see the inputs that carry one
        try: prepared[i] = prepare(self.spec, f, vars)
        except KilnError as e: out.done(i, e)
      for i, got in self._flow(prepared, per_call, out.results): out.done(i, got)
    finally:
      out.close()
    return out.final(return_exceptions)

  def _flow(self, prepared: dict[int, tuple[dict[str, np.ndarray], dict[str, int]]], per_call: int | None, results: list[Any]
            ) -> Iterator[tuple[int, Any]]:
    """(request, outputs or error) group by group, in order; the caller's code runs between the yields, outside the
    translation of Ray's errors."""
    idx = list(prepared)
    if per_call is None: per_call = max(1, min(8, len(idx) // (self.window * 4)))
    groups = [idx[i:i + per_call] for i in range(0, len(idx), per_call)]
    inflight: list[tuple[list[int], Any, list[Any]]] = []
    nxt = 0
    with self.session.translated("pipeline", results):
      while nxt < len(groups) or inflight:
        ray = self.session.ray()  # each time round: a session that ended is ClusterLost, never a new Ray
        while nxt < len(groups) and len(inflight) < self.window:
          g = groups[nxt]
          fref = ray.put([prepared[i][0] for i in g])
          inflight.append((g, fref, self._submit(fref, [prepared[i][1] for i in g])))
          nxt += 1
        g, fref, refs = inflight.pop(0)
        yield from zip(g, self._collect(g, fref, refs, [prepared[i][1] for i in g]))

  def _collect(self, group: list[int], fref: Any, refs: list[Any], vals: list[dict[str, int]]) -> list[Any]:
    owners = sorted(set(self._final.values()))
    for attempt in range(self.retries + 1):
      try:
        by_stage = dict(zip(owners, self.session.ray().get([refs[k] for k in owners])))
        return [self._assemble(by_stage, j) for j in range(len(group))]
      except actor_errors() as e:
        stage = self._failed_stage(refs)
        if attempt == self.retries:
          label = self.labels[stage] if stage is not None else "unknown"
          return [NoWorkerLeft(f"requests {group[0]}..{group[-1]} failed {attempt + 1} times; stage {stage} ({label}) last failed: "
                               f"{type(e).__name__}: {e}", [label], stage)] * len(group)
        self.retried += len(group)
        self.session.ray()  # a session that ended is ClusterLost here, not a resubmission into a new Ray
        if stage is not None: self._await_restart(stage)
        refs = self._submit(fref, vals)  # the dead stage's worker restarts and rebuilds; the group runs again from stage 0
      except Exception as e:
        if not self.session.alive(): raise
        return [kiln_error(e, "pipeline")] * len(group)  # a stage's call itself failed: its requests fail
    raise AssertionError("unreachable")

  def _assemble(self, by_stage: dict[int, list[Any]], j: int) -> Any:
    """Request j's outputs from the stages that own them, or the error an owning stage returned for it."""
    for k in sorted(by_stage):
      if isinstance(by_stage[k][j], Exception): return by_stage[k][j]
    return {name: by_stage[k][j][name] for name, k in self._final.items()}

  def _await_restart(self, stage: int) -> None:
    """Until the stage's restarted worker answers. Ray refuses calls to an actor while it restarts (ActorUnavailableError),
    and a restart is slow on a loaded host: resubmitting at once would spend every retry on the one restart."""
    import ray.exceptions as rx
    ray, actor = self.session.ray(), self.actors[stage]
    end = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < end:
      try:
        ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, end - time.monotonic()))
        return
      except rx.ActorUnavailableError: time.sleep(0.1)
      except Exception: return  # dead for good, or still not up at the deadline: the resubmission's failure is the next attempt

  def _failed_stage(self, refs: list[Any]) -> int | None:
    ray = self.session.ray()
    for k, r in enumerate(refs):
      try: ray.get(r, timeout=0)
      except actor_errors(): return k
      except Exception: continue  # noqa: S112  (not finished, or failed for another reason: not the dead stage)
    return None

  def trace(self, feeds: Feeds, vars: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One profiled request through every stage, merged into one Chrome trace (a process lane per stage worker)."""
    ray = self._ray()
    arrays, vals = prepare(self.spec, feeds, vars)
    with self.session.translated("pipeline"):
      pairs = self._submit(ray.put(arrays), vals, profiled=True)  # stage k's [outputs, profile]: later stages read the outputs
    return merged_trace(self.gather([p[1] for p in pairs]))

  def activation_bytes(self) -> list[int]:
    """Bytes each cut hands on (the activations a stage outputs), per stage."""
    return [sum(int(o.shape[0]) for o in st.outputs if o.name.startswith(ACTIVATION)) for st in self.stages]


def pipeline(spec: PlanSpec, stages: int | Sequence[int] = 2, weights: Mapping[str, np.ndarray] | None = None,
             placement: Placement | dict[str, Any] | list[Any] | None = None, retries: int = 2, window: int = 4,
             code: str = "trusted", wait: bool = True, ready_timeout: float = 300.0, check_fit: bool = True) -> Pipeline:
  """Cut `spec` into `stages` (a count, balanced by work, or the op positions where stages 2.. start), start one worker
  per stage placed by `placement` (one per stage, e.g. [{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]).
  Stages the cluster cannot hold are a PlacementError at once, as in serve (check_fit)."""
  if not isinstance(spec, PlanSpec): raise DistributedError(f"pipeline takes a PlanSpec (plan.to_spec()), got {type(spec).__name__}")
  if window < 1: raise DistributedError(f"window must be at least 1, got {window}")
  parts = split(spec, stages if isinstance(stages, int) else list(stages))
  h = Pipeline(spec, parts, start_fleet("stage", "stages", parts, weights, placement, code, check_fit), retries, window)
  return h.started(wait, ready_timeout)
