"""Load progress: `kiln.graph.onnx.load(..., progress=)` reports what a load is doing as it goes.

`progress` is None (silent), True (a line on stderr, shown only once the load has taken over a second: a warm load
stays quiet) or a callable `progress(done, total, what)`: `what` names the stage ("converting nodes", "compiling
kernels"), `done` of `total` steps of it are finished. A stage starts with done=0 and ends with done=total. The
callable is held in a context variable for the load's duration, so the scheduler deep inside it reports without every
function between passing it on; a load in another thread reports to its own callable.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TextIO

Progress = Callable[[int, int, str], None]

SHOW_AFTER_S = 1.0  # progress=True stays silent for loads shorter than this

_current: ContextVar[Progress | None] = ContextVar("kiln_load_progress", default=None)


class StderrProgress:
  """progress=True: one self-overwriting line on a stream (stderr), from the first report after SHOW_AFTER_S on."""

  def __init__(self, stream: TextIO | None = None, after_s: float = SHOW_AFTER_S, label: str = "kiln: loading"):
    self.stream, self.after_s, self.label = stream, after_s, label
    self.start = time.perf_counter()
    self.shown = False

  def __call__(self, done: int, total: int, what: str) -> None:
    if not self.shown and time.perf_counter() - self.start < self.after_s: return
    self.shown = True
    out = self.stream or sys.stderr
    out.write(f"\r{self.label}: {what} {done}/{total}\033[K")
    out.flush()

  def close(self) -> None:
    if self.shown:
      (self.stream or sys.stderr).write("\n")
      self.shown = False


def as_progress(progress: None | bool | Progress) -> Progress | None:
  """The callable for a load's `progress=` argument (a TypeError names what else was given)."""
  if progress is None or progress is False: return None
  if progress is True: return StderrProgress()
  if callable(progress): return progress
  raise TypeError(f"progress is None, True or a callable(done, total, what), got {type(progress).__name__}")


@contextlib.contextmanager
def reporting(progress: None | bool | Progress) -> Iterator[Progress | None]:
  """Report to `progress` within the block (None keeps whatever an enclosing block reports to)."""
  cb = as_progress(progress)
  if cb is None:
    yield _current.get()
    return
  token = _current.set(cb)
  try: yield cb
  finally:
    _current.reset(token)
    if isinstance(cb, StderrProgress): cb.close()


def report(done: int, total: int, what: str) -> None:
  """Tell the current load's progress callable (if any) that `done` of `total` steps of stage `what` are finished."""
  if (cb := _current.get()) is not None: cb(done, total, what)


def active() -> bool: return _current.get() is not None
