"""The distributed layer's errors: each names the worker and, for pipelines, the stage. Nothing of Ray's leaves the layer:
a Ray error is one of these, and a kiln error raised in a worker comes back as itself."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.ir.errors import KilnError


class DistributedError(KilnError):
  """Work on Ray could not be done: no cluster, a bad placement, a request no worker could finish."""


class NoWorkerLeft(DistributedError):
  """A request failed on every worker that could run it (they died and were not brought back in time)."""

  def __init__(self, message: str, workers: list[str], stage: int | None = None):
    super().__init__(message)
    self.workers, self.stage = workers, stage


class PlacementError(DistributedError):
  """The cluster cannot hold the workers asked for (too few CPUs, no GPU, no node with a resource): said at once, with
  what was asked and what the cluster has, instead of waiting for resources that no node has."""


class ClusterLost(DistributedError):
  """The Ray session the workers were started in ended (ray.shutdown(), or the driver lost the cluster). `results` holds
  what had come back (None for the rest); kiln never starts another Ray to go on."""

  def __init__(self, message: str, results: Sequence[Any] = ()):
    super().__init__(message)
    self.results = list(results)


class WorkerError(DistributedError):
  """A request raised an error on its worker that is not a kiln error (a bug, or an error of a library under kiln): its
  type, message and the worker's traceback."""


class RequestsFailed(DistributedError, ExceptionGroup):
  """Some requests of a `map` failed; every other one ran. `results` is the whole list in request order with each failed
  request's error in its place, `errors` maps request index -> error; as an ExceptionGroup, `except* PlanSpecError`
  catches by the requests' own error types."""

  def __new__(cls, message: str, errors: Mapping[int, Exception], results: Sequence[Any]) -> RequestsFailed:
    return super().__new__(cls, message, [errors[i] for i in sorted(errors)])

  def __init__(self, message: str, errors: Mapping[int, Exception], results: Sequence[Any]):
    super().__init__(message, [errors[i] for i in sorted(errors)])
    self.errors, self.results = dict(errors), list(results)

