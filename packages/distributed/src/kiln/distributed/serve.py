"""Replicas (data parallel): N workers each holding the whole plan; requests are spread over them.

A request that fails because its worker died (Ray restarts it and it rebuilds its plan) is sent again to another
replica, preferring one it has not failed on; plans are idempotent given their inputs, so a retried request gives the
same result. The caller sees each result exactly once, in request order, or NoWorkerLeft naming every worker it failed
on when `retries` attempts are spent."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.distributed.errors import DistributedError, NoWorkerLeft
from kiln.distributed.fleet import Fleet, actor_errors, merged_trace, progress, put_weights, ray_module, start_worker
from kiln.distributed.placement import Placement, placements
from kiln.executor import PlanSpec
from kiln.executor.portable import check_feeds, infer_vars

Feeds = Mapping[str, Any]


class Replicas(Fleet):
  def __init__(self, spec: PlanSpec, actors: list[Any], labels: list[str], retries: int, window: int, keep: list[Any]):
    super().__init__(actors, labels, keep)
    self.spec, self.retries, self.window = spec, retries, window
    self._next = 0
    self.retried = 0  # requests sent again after their worker died

  # ---- one request, many requests ----
  def run(self, feeds: Feeds, vars: Mapping[str, int] | None = None, shard: bool = False) -> dict[str, np.ndarray]:
    """The plan's outputs for one request. shard=True cuts the request's batch (axis 0 of every input, which must be
    the same runtime variable) into one part per replica, runs the parts at once and joins the outputs."""
    if shard: return self._sharded(feeds, vars)
    return self.map([feeds], vars, progress_bar=False, per_call=1)[0]

  def map(self, requests: Sequence[Feeds], vars: Mapping[str, int] | None = None, progress_bar: bool | None = None,
          on_result: Callable[[int], None] | None = None, per_call: int | None = None) -> list[dict[str, np.ndarray]]:
    """Outputs for every request, in order. Requests go to the replicas `per_call` at a time in one Ray call (default:
    up to 8, so that every replica still gets several calls: Ray's cost per call, a few hundred microseconds of the
    driver's time, is shared), at most `window` calls in flight per replica; a replica that is free takes the next
    call, so faster replicas take more. on_result(i) is called as request i's result arrives."""
    ray = ray_module()
    if not self.actors: raise DistributedError("these replicas were shut down")
    for f in requests: check_feeds(self.spec, f, vars)  # a bad request fails here, before any is sent
    n = len(requests)
    if per_call is None: per_call = max(1, min(8, n // (len(self.actors) * self.window * 4)))
    if per_call < 1: raise DistributedError(f"per_call must be at least 1, got {per_call}")
    results: list[dict[str, np.ndarray] | None] = [None] * n
    calls = [list(range(i, min(i + per_call, n))) for i in range(0, n, per_call)]
    failed_on: list[list[int]] = [[] for _ in calls]
    inflight: dict[Any, tuple[int, int]] = {}  # ref -> (call, replica)
    load = [0] * len(self.actors)
    todo = list(range(len(calls)))[::-1]
    bar = progress(n, progress_bar, "kiln replicas")
    try:
      while todo or inflight:
        while todo:
          r = self._pick(load, failed_on[todo[-1]])
          if r is None: break
          c = todo.pop()
          ref = self.actors[r].run_many.remote([requests[i] for i in calls[c]], vars)
          inflight[ref] = (c, r)
          load[r] += 1
        done, _ = ray.wait(list(inflight), num_returns=1)
        c, r = inflight.pop(done[0])
        load[r] -= 1
        try: got = ray.get(done[0])
        except actor_errors() as e:
          failed_on[c].append(r)
          if len(failed_on[c]) > self.retries:
            names = [self.labels[j] for j in failed_on[c]]
            raise NoWorkerLeft(f"requests {calls[c][0]}..{calls[c][-1]} failed on every try ({', '.join(names)}); "
                               f"last error: {type(e).__name__}: {e}", names) from e
          todo.append(c)
          self.retried += len(calls[c])
          continue
        for i, out in zip(calls[c], got):
          results[i] = out
          if on_result is not None: on_result(i)
        bar.update(len(calls[c]))
    finally:
      bar.close()
      for ref in inflight: ray.cancel(ref)
    return results  # type: ignore[return-value]

  def _pick(self, load: list[int], failed: list[int]) -> int | None:
    """The next replica with room, round robin, avoiding those this request already failed on while others remain."""
    k = len(self.actors)
    for avoid in (set(failed), set()):
      for step in range(k):
        r = (self._next + step) % k
        if load[r] < self.window and r not in avoid:
          self._next = (r + 1) % k
          return r
    return None

  def _sharded(self, feeds: Feeds, vars: Mapping[str, int] | None) -> dict[str, np.ndarray]:
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    heads = {io.shape[0] if io.shape else None for io in self.spec.inputs}
    if len(heads) != 1 or not isinstance(var := next(iter(heads)), str) or var not in self.spec.variables:
      raise DistributedError("shard=True needs every input's first dim to be one runtime variable (a symbolic batch); "
                             f"the inputs' first dims are {sorted(map(str, heads))}")
    if bad := [o.name for o in self.spec.outputs if not o.shape or o.shape[0] != var]:
      raise DistributedError(f"shard=True needs every output's first dim to be {var}; outputs {bad} are not")
    batch = infer_vars(self.spec, arrays, vars)[var]
    parts = np.array_split(np.arange(batch), min(len(self.actors), batch))
    reqs = [{k: a[p[0]:p[-1] + 1] for k, a in arrays.items()} for p in parts]
    part_vars = {k: v for k, v in (vars or {}).items() if k != var}
    outs = self.map(reqs, part_vars, progress_bar=False, per_call=1)
    return {o.name: np.concatenate([x[o.name] for x in outs], axis=0) for o in self.spec.outputs}

  # ---- visibility ----
  def trace(self, feeds: Feeds, vars: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One profiled request on every replica, merged into one Chrome trace (a process lane per replica)."""
    ray = ray_module()
    got = ray.get([a.run_profiled.remote(feeds, vars) for a in self.actors])
    return merged_trace(p for _, p in got)


def serve(spec: PlanSpec, replicas: int = 2, weights: Mapping[str, np.ndarray] | None = None,
          placement: Placement | dict[str, Any] | list[Any] | None = None, retries: int | None = None, window: int = 2,
          code: str = "trusted", wait: bool = True, ready_timeout: float = 300.0) -> Replicas:
  """Start `replicas` workers, each rebuilding `spec` (with `weights`, the arrays export() handed back), placed by
  `placement` (one for all, or one per replica). Returns the handle whose run/map spread requests over them."""
  if not isinstance(spec, PlanSpec): raise DistributedError(f"serve takes a PlanSpec (plan.to_spec()), got {type(spec).__name__}")
  if not isinstance(replicas, int) or replicas < 1: raise DistributedError(f"replicas must be a positive int, got {replicas!r}")
  if window < 1: raise DistributedError(f"window must be at least 1, got {window}")
  ray = ray_module()
  refs = put_weights(weights)
  spec_ref = ray.put(spec)
  places = placements(placement, replicas, "replicas")
  labels = [f"replica-{i}" for i in range(replicas)]
  actors = [start_worker(label, spec_ref, refs, p, code) for label, p in zip(labels, places)]
  h = Replicas(spec, actors, labels, 2 * replicas if retries is None else retries, window, [spec_ref, refs])
  return h.started(wait, ready_timeout)
