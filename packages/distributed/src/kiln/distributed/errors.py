"""The distributed layer's errors: each names the worker and, for pipelines, the stage."""
from __future__ import annotations

from kiln.ir.errors import KilnError


class DistributedError(KilnError):
  """Work on Ray could not be done: no cluster, a bad placement, a request no worker could finish."""


class NoWorkerLeft(DistributedError):
  """A request failed on every worker that could run it (they died and were not brought back in time)."""

  def __init__(self, message: str, workers: list[str], stage: int | None = None):
    super().__init__(message)
    self.workers, self.stage = workers, stage
