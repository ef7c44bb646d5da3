"""Load progress: `kiln.graph.onnx.load(..., progress=)` reports what a load is doing as it goes.

`progress` is None (silent), True (on stderr, shown only once the load has taken over a second: a warm load stays
quiet; on a terminal one line that overwrites itself, elsewhere, a log file or a pipe, one plain line as each stage
ends) or a callable `progress(done, total, what)`: `what` names the stage ("converting nodes", "compiling kernels"),
`done` of `total` steps of it are finished. A stage starts with done=0 and ends with done=total. The
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
  """progress=True, from the first report after SHOW_AFTER_S on: on a terminal one self-overwriting line (`\\r`, erase to
  the line's end); off a terminal (`isatty()` false: `2>log`, a pipe) one plain line as each stage ends, no control codes,
  so a log holds a few lines, not every step run together. `tty` overrides what the stream says."""

  def __init__(self, stream: TextIO | None = None, after_s: float = SHOW_AFTER_S, label: str = "kiln: loading", tty: bool | None = None):
    self.stream, self.after_s, self.label, self.tty = stream, after_s, label, tty
    self.start = time.perf_counter()
    self.shown = False  # the overwritten line is on the terminal: close() ends it

  def _on_terminal(self, out: TextIO) -> bool:
    if self.tty is None:
      try: self.tty = bool(out.isatty())
      except (AttributeError, ValueError): self.tty = False  # no isatty, or a closed stream
    return self.tty

  def __call__(self, done: int, total: int, what: str) -> None:
    if not self.shown and time.perf_counter() - self.start < self.after_s: return
    out = self.stream or sys.stderr
    if not self._on_terminal(out):
      if done != total: return
      out.write(f"{self.label}: {what} {done}/{total} ({time.perf_counter() - self.start:.1f} s)\n")
    else:
      self.shown = True
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
