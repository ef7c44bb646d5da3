"""What a `map` hands back: every request's result or its own typed error, in request order.

One bad request never costs the others: a request refused on the driver (its names, shapes or dtypes) is never sent, one
that fails on its worker (a kiln error the plan raised, such as a check's PlanCheckError) comes back as that error, and
every other request runs. `map(..., return_exceptions=True)` returns the list with each failed request's error in its
place (asyncio.gather's option); by default map raises RequestsFailed once every request has finished, holding the same
list, so a caller who did not ask for errors in the list still loses no result."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.distributed.errors import RequestsFailed


class Outcomes:
  def __init__(self, n: int, bar: Any, on_result: Callable[[int], None] | None):
    self.results: list[Any] = [None] * n
    self.errors: dict[int, Exception] = {}
    self._bar, self._on_result = bar, on_result

  def done(self, i: int, got: Any) -> None:
    """Request i finished: its outputs, or its error (which the worker returns in the outputs' place)."""
    self.results[i] = got
    if isinstance(got, Exception): self.errors[i] = got
    self._bar.update(1)
    if self._on_result is not None: self._on_result(i)

  def close(self) -> None: self._bar.close()

  def final(self, return_exceptions: bool) -> list[Any]:
    if not self.errors or return_exceptions: return self.results
    first = min(self.errors)
    raise RequestsFailed(f"{len(self.errors)} of {len(self.results)} requests failed (the others ran; RequestsFailed.results "
                         f"holds every result); the first, request {first}: {type(self.errors[first]).__name__}: {self.errors[first]}",
                         self.errors, self.results)
