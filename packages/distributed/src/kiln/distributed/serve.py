"""Replicas (data parallel): N workers each holding the whole plan; requests are spread over them.

A request that fails because its worker died (Ray restarts it and it rebuilds its plan) is sent again to another
replica, preferring one it has not failed on; plans are idempotent given their inputs, so a retried request gives the
same result. The caller sees each result exactly once, in request order; a request whose `retries` attempts are spent
gets NoWorkerLeft in its place, naming each worker it failed on. A request that fails for itself (refused on the driver,
or a kiln error its plan run raised on the worker) fails alone: outcomes.py says what map returns then."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from kiln.distributed.errors import DistributedError, NoWorkerLeft
from kiln.distributed.fleet import Fleet, Started, merged_trace, progress, start_fleet
from kiln.distributed.outcomes import Outcomes
from kiln.distributed.placement import Placement
from kiln.distributed.request import prepare
from kiln.distributed.session import actor_errors, kiln_error
from kiln.executor import PlanSpec
from kiln.executor.portable import infer_vars
from kiln.ir.errors import KilnError

Feeds = Mapping[str, Any]


class Replicas(Fleet):
  def __init__(self, spec: PlanSpec, started: Started, retries: int, window: int):
    super().__init__(started)
    self.spec, self.retries, self.window = spec, retries, window
    self._next = 0
    self.retried = 0  # requests sent again after their worker died

  # ---- one request, many requests ----
  def run(self, feeds: Feeds, vars: Mapping[str, int] | None = None, shard: bool = False) -> dict[str, np.ndarray]:
    """The plan's outputs for one request, or its own typed error raised. shard=True cuts the request's batch (axis 0
    of every input, which must be the same runtime variable) into one part per replica, runs the parts at once and joins
    the outputs."""
    if shard: return self._sharded(feeds, vars)
    return _one(self.map([feeds], vars, progress_bar=False, per_call=1, return_exceptions=True))

  def map(self, requests: Iterable[Feeds], vars: Mapping[str, int] | None = None, progress_bar: bool | None = None,
          on_result: Callable[[int], None] | None = None, per_call: int | None = None, return_exceptions: bool = False
          ) -> list[Any]:
    """Outputs for every request, in order. Each request is checked here first (names, shapes, dtypes: a bad one is never
    sent); one that fails, here or on its worker, fails alone and every other request runs. Then with return_exceptions
    the list holds each failed request's error (a kiln error) in its place; without, RequestsFailed is raised, which
    holds that list (`.results`) and the errors by index (`.errors`).

    Requests go to the replicas `per_call` at a time in one Ray call (default: up to 8, so that every replica still gets
    several calls: Ray's cost per call, a few hundred microseconds of the driver's time, is shared), at most `window`
    calls in flight per replica; a replica that is free takes the next call, so faster replicas take more.
    on_result(i) is called as request i finishes (with its result or its error). If the Ray session ends meanwhile
    (ray.shutdown()), ClusterLost holds what had come back."""
    self._ray()
    if per_call is not None and per_call < 1: raise DistributedError(f"per_call must be at least 1, got {per_call}")
    requests = list(requests)
    out = Outcomes(len(requests), progress(len(requests), progress_bar, "kiln replicas"), on_result)
    try:
      sent: dict[int, dict[str, np.ndarray]] = {}
      for i, f in enumerate(requests):
        try: sent[i] = prepare(self.spec, f, vars)[0]
        except KilnError as e: out.done(i, e)
      for i, got in self._spread(sent, vars, per_call, out.results): out.done(i, got)
    finally:
      out.close()
    return out.final(return_exceptions)

  def _spread(self, sent: dict[int, dict[str, np.ndarray]], vars: Mapping[str, int] | None, per_call: int | None,
              results: list[Any]) -> Iterator[tuple[int, Any]]:
    """(request, outputs or error) as each call comes back. The caller's own code (on_result) runs between the yields,
    outside the translation of Ray's errors."""
    idx = list(sent)
    if per_call is None: per_call = max(1, min(8, len(idx) // (len(self.actors) * self.window * 4)))
    calls = [idx[i:i + per_call] for i in range(0, len(idx), per_call)]
    failed_on: list[list[int]] = [[] for _ in calls]
    inflight: dict[Any, tuple[int, int]] = {}  # ref -> (call, replica)
    load = [0] * len(self.actors)
    todo = list(range(len(calls)))[::-1]
    with self.session.translated("replicas", results):
      try:
        while todo or inflight:
          ray = self.session.ray()  # each time round: a session that ended is ClusterLost, never a new Ray
          while todo:
            r = self._pick(load, failed_on[todo[-1]])
            if r is None: break
            c = todo.pop()
            inflight[self.actors[r].run_many.remote([sent[i] for i in calls[c]], vars)] = (c, r)
            load[r] += 1
          done, _ = ray.wait(list(inflight), num_returns=1)
          c, r = inflight.pop(done[0])
          load[r] -= 1
          try: got = ray.get(done[0])
          except actor_errors() as e:
            failed_on[c].append(r)
            if len(failed_on[c]) <= self.retries:
              todo.append(c)
              self.retried += len(calls[c])
              continue
            got = [self._no_worker_left(calls[c], failed_on[c], e)] * len(calls[c])
          except Exception as e:
            if not self.session.alive(): raise
            got = [kiln_error(e, self.labels[r])] * len(calls[c])  # the call itself failed on its worker: its requests fail
          yield from zip(calls[c], got)
      finally:
        if inflight and self.session.alive():
          for ref in inflight: self.session.ray().cancel(ref)

  def _no_worker_left(self, call: list[int], failed_on: list[int], e: BaseException) -> NoWorkerLeft:
    names = list(dict.fromkeys(self.labels[j] for j in failed_on))  # each worker once, in the order it failed
    return NoWorkerLeft(f"requests {call[0]}..{call[-1]} failed {len(failed_on)} times, on {', '.join(names)}; "
                        f"last error: {type(e).__name__}: {e}", names)

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
    arrays = prepare(self.spec, feeds, vars)[0]  # the whole request checked, so an error names it, not a part
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
    outs = [_one([o]) for o in self.map(reqs, part_vars, progress_bar=False, per_call=1, return_exceptions=True)]
    return {o.name: np.concatenate([x[o.name] for x in outs], axis=0) for o in self.spec.outputs}

  # ---- visibility ----
  def trace(self, feeds: Feeds, vars: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One profiled request on every replica, merged into one Chrome trace (a process lane per replica)."""
    self._ray()
    arrays = prepare(self.spec, feeds, vars)[0]
    return merged_trace(p for _, p in self.gather([a.run_profiled.remote(arrays, vars) for a in self.actors]))


def _one(outcome: list[Any]) -> dict[str, np.ndarray]:
  """A one-request map's result, or its error raised."""
  if isinstance(got := outcome[0], Exception): raise got
  return got  # type: ignore[no-any-return]


def serve(spec: PlanSpec, replicas: int = 2, weights: Mapping[str, np.ndarray] | None = None,
          placement: Placement | dict[str, Any] | list[Any] | None = None, retries: int | None = None, window: int = 2,
          code: str = "trusted", wait: bool = True, ready_timeout: float = 300.0, check_fit: bool = True) -> Replicas:
  """Start `replicas` workers, each rebuilding `spec` (with `weights`, the arrays export() handed back), placed by
  `placement` (one for all, or one per replica). Returns the handle whose run/map spread requests over them. A fleet the
  cluster cannot hold (4 replicas of 1 CPU on 2 CPUs, a GPU where there is none) is a PlacementError at once, naming what
  was asked and what the cluster has; check_fit=False skips that (an autoscaling cluster adds nodes for what waits)."""
  if not isinstance(spec, PlanSpec): raise DistributedError(f"serve takes a PlanSpec (plan.to_spec()), got {type(spec).__name__}")
  if not isinstance(replicas, int) or replicas < 1: raise DistributedError(f"replicas must be a positive int, got {replicas!r}")
  if window < 1: raise DistributedError(f"window must be at least 1, got {window}")
  started = start_fleet("replica", "replicas", [spec] * replicas, weights, placement, code, check_fit)
  h = Replicas(spec, started, 2 * replicas if retries is None else retries, window)
  return h.started(wait, ready_timeout)
