"""Checks: plan buffers that must hold only zeros after every run, each with the message to raise when one does not.

A plan's author computes a check as a kernel like any other (kiln.graph: a Gather's out-of-range index, 0 when every
index is in range) and says what a nonzero value means; the executor knows nothing of what is checked. The kernel writes
the whole value each run, so nothing is reset between runs, and a failed check leaves the plan usable (it is not
poisoned): the next run with good inputs succeeds. Reading a check costs one host read of its few bytes per run."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.ir.errors import PlanError

VALUE = "{value}"  # the last occurrence in a check's message is replaced by the offending value
MAX_MESSAGE = 4096


class PlanCheckError(PlanError):
  """A check of the plan read nonzero after a run: the check's message with the offending value (also `.value`)."""
  def __init__(self, message: str, value: Any = None):
    super().__init__(message)
    self.value = value


def message(template: str, value: Any) -> str:
  """The template with its last `{value}` replaced (only the last: a name earlier in it may hold the same characters)."""
  head, sep, tail = template.rpartition(VALUE)
  return f"{head}{value}{tail}" if sep else f"{template} (value {value})"


class CheckReader:
  """Reads a plan's checks after a run: `checks` are (plan buffer index, message) pairs over the plan's buffers."""

  def __init__(self, buffers: Sequence[Any], checks: Sequence[tuple[int, str]]):
    self.checks = [(buffers[b], msg) for b, msg in checks]
    self._views: list[np.ndarray | None] = [None] * len(self.checks)

  def _values(self, i: int) -> np.ndarray:
    if (v := self._views[i]) is not None: return v
    buf = self.checks[i][0]
    raw = buf._host_bytes()  # zero-copy where the memory is host-visible: kept, since a built plan's memory stays put
    if raw is None: return buf.numpy()  # device memory: a copy each run
    self._views[i] = v = raw.view(buf.dtype.np)
    return v

  def raise_failed(self, error: type[PlanCheckError] = PlanCheckError) -> None:
    """Raise `error` for the first check holding a nonzero element, naming that element's value."""
    for i, (_, msg) in enumerate(self.checks):
      v = self._values(i)
      if v.size == 1 and not v.item(): continue  # the usual check, one element: a tenth of v.any()'s time
      if v.any():
        bad = v[int(np.flatnonzero(v)[0])].item()
        raise error(message(msg, bad), bad)
