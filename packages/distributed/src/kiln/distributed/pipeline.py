"""Pipeline stages: a plan cut at op boundaries (kiln.executor.plan_split) into stages on different workers.

A request's feeds go to Ray's object store once; each stage gets them and the results of the earlier stages it needs as
object refs, which Ray resolves on the stage's node (zero-copy there when the producer ran on the same node, one
transfer otherwise), so activations move between stages without passing through the driver. `run` returns exactly what
the single-host plan returns. Several requests in `map` overlap: stage 1 works on request i while stage 2 works on i-1.

A stage's worker that dies is restarted by Ray and rebuilds its stage; the request is run again from its first stage
(every stage is idempotent given its inputs), at most `retries` times, then NoWorkerLeft names the stage and worker."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.distributed.errors import DistributedError, NoWorkerLeft
from kiln.distributed.fleet import Fleet, actor_errors, merged_trace, progress, put_weights, ray_module, start_worker
from kiln.distributed.placement import Placement, placements
from kiln.executor import PlanSpec
from kiln.executor.plan_split import ACTIVATION, split
from kiln.executor.portable import check_feeds

Feeds = Mapping[str, Any]


class Pipeline(Fleet):
  def __init__(self, spec: PlanSpec, stages: list[PlanSpec], actors: list[Any], labels: list[str], retries: int, window: int,
               keep: list[Any]):
    super().__init__(actors, labels, keep)
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

  def _vars(self, feeds: Feeds, vars: Mapping[str, int] | None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    return check_feeds(self.spec, feeds, vars)  # the variables too: later stages may not see the inputs that carry one

  def run(self, feeds: Feeds, vars: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    return self.map([feeds], vars, progress_bar=False)[0]

  def map(self, requests: Sequence[Feeds], vars: Mapping[str, int] | None = None, progress_bar: bool | None = None,
          on_result: Callable[[int], None] | None = None, per_call: int | None = None) -> list[dict[str, np.ndarray]]:
    """Outputs for every request, in order. Requests travel `per_call` at a time (default: up to 8, as Replicas.map: one
    Ray call per stage for the group), with up to `window` groups in the pipeline at once; on_result(i) is called as
    request i's result arrives."""
    ray = ray_module()
    if not self.actors: raise DistributedError("this pipeline was shut down")
    prepared = [self._vars(f, vars) for f in requests]
    n = len(requests)
    if per_call is None: per_call = max(1, min(8, n // (self.window * 4)))
    if per_call < 1: raise DistributedError(f"per_call must be at least 1, got {per_call}")
    groups = [list(range(i, min(i + per_call, n))) for i in range(0, n, per_call)]
    out: list[dict[str, np.ndarray]] = []
    inflight: list[tuple[list[int], Any, list[Any]]] = []
    nxt = 0
    bar = progress(n, progress_bar, "kiln pipeline")
    try:
      while nxt < len(groups) or inflight:
        while nxt < len(groups) and len(inflight) < self.window:
          g = groups[nxt]
          fref = ray.put([prepared[i][0] for i in g])
          inflight.append((g, fref, self._submit(fref, [prepared[i][1] for i in g])))
          nxt += 1
        g, fref, refs = inflight.pop(0)
        out += self._collect(g, fref, refs, [prepared[i][1] for i in g])
        bar.update(len(g))
        if on_result is not None:
          for i in g: on_result(i)
    finally:
      bar.close()
    return out

  def _collect(self, group: list[int], fref: Any, refs: list[Any], vals: list[dict[str, int]]) -> list[dict[str, np.ndarray]]:
    ray = ray_module()
    owners = sorted(set(self._final.values()))
    for attempt in range(self.retries + 1):
      try:
        by_stage = dict(zip(owners, ray.get([refs[k] for k in owners])))
        return [{name: by_stage[k][j][name] for name, k in self._final.items()} for j in range(len(group))]
      except actor_errors() as e:
        stage = self._failed_stage(refs)
        if attempt == self.retries:
          label = self.labels[stage] if stage is not None else "unknown"
          raise NoWorkerLeft(f"requests {group[0]}..{group[-1]} failed {attempt + 1} times; stage {stage} ({label}) last failed: "
                             f"{type(e).__name__}: {e}", [label], stage) from e
        self.retried += len(group)
        refs = self._submit(fref, vals)  # the dead stage's worker restarts and rebuilds; the group runs again from stage 0
    raise AssertionError("unreachable")

  def _failed_stage(self, refs: list[Any]) -> int | None:
    ray = ray_module()
    for k, r in enumerate(refs):
      try: ray.get(r, timeout=0)
      except actor_errors(): return k
      except Exception: continue  # noqa: S112  (not finished, or failed for another reason: not the dead stage)
    return None

  def trace(self, feeds: Feeds, vars: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One profiled request through every stage, merged into one Chrome trace (a process lane per stage worker)."""
    ray = ray_module()
    arrays, vals = self._vars(feeds, vars)
    pairs = self._submit(ray.put(arrays), vals, profiled=True)  # stage k's [outputs, profile]: later stages read the outputs
    return merged_trace(ray.get([p[1] for p in pairs]))

  def activation_bytes(self) -> list[int]:
    """Bytes each cut hands on (the activations a stage outputs), per stage."""
    return [sum(int(o.shape[0]) for o in st.outputs if o.name.startswith(ACTIVATION)) for st in self.stages]


def pipeline(spec: PlanSpec, stages: int | Sequence[int] = 2, weights: Mapping[str, np.ndarray] | None = None,
             placement: Placement | dict[str, Any] | list[Any] | None = None, retries: int = 2, window: int = 4,
             code: str = "trusted", wait: bool = True, ready_timeout: float = 300.0) -> Pipeline:
  """Cut `spec` into `stages` (a count, balanced by work, or the op positions where stages 2.. start), start one worker
  per stage placed by `placement` (one per stage, e.g. [{"resources": {"host0": 1}}, {"resources": {"host1": 1}}])."""
  if not isinstance(spec, PlanSpec): raise DistributedError(f"pipeline takes a PlanSpec (plan.to_spec()), got {type(spec).__name__}")
  if window < 1: raise DistributedError(f"window must be at least 1, got {window}")
  ray = ray_module()
  parts = split(spec, stages if isinstance(stages, int) else list(stages))
  refs = put_weights(weights)
  places = placements(placement, len(parts), "stages")
  labels = [f"stage-{k}" for k in range(len(parts))]
  actors, keep = [], [refs]
  for label, part, p in zip(labels, parts, places):
    mine = {e.weight.key: refs[e.weight.key] for e in part.storages if e.weight is not None and e.weight.kind == "object" and e.weight.key in refs}
    keep.append(part_ref := ray.put(part))
    actors.append(start_worker(label, part_ref, mine, p, code))
  h = Pipeline(spec, parts, actors, labels, retries, window, keep)
  return h.started(wait, ready_timeout)
