"""kiln.graph.onnx.load(..., progress=): a callable hears every stage from 0 to its total, True writes to stderr only
once a load has taken over a second, and anything else is refused."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx_case import N, f32, model  # noqa: E402

from kiln.graph import onnx as konnx  # noqa: E402
from kiln.graph.progress import StderrProgress, reporting  # noqa: E402


def _model() -> object:
  return model([N("Relu", ["x"], ["r"]), N("Mul", ["r", "w"], ["m"]), N("ReduceSum", ["m"], ["y"], keepdims=0)],
               {"x": f32(4, 8)}, {"y": np.float32}, {"w": f32(4, 8)})


def test_a_callable_hears_each_stage_from_zero_to_its_total() -> None:
  calls: list[tuple[int, int, str]] = []
  m = konnx.load(_model(), progress=lambda done, total, what: calls.append((done, total, what)))
  assert m.plan is not None
  stages = list(dict.fromkeys(w for _, _, w in calls))
  assert stages == ["converting nodes", "compiling kernels"], calls
  for stage in stages:
    got = [(d, t) for d, t, w in calls if w == stage]
    assert got[0][0] == 0 and got[-1][0] == got[-1][1] > 0, (stage, got)
    assert [d for d, _ in got] == sorted(d for d, _ in got), got


def test_true_is_silent_for_a_fast_load_and_shows_after_its_delay() -> None:
  out = io.StringIO()
  quiet = StderrProgress(out, after_s=60)
  with reporting(quiet): konnx.load(_model())
  assert out.getvalue() == ""
  shown = StderrProgress(out, after_s=0)
  with reporting(shown): konnx.load(_model())
  text = out.getvalue()
  assert "compiling kernels" in text and text.endswith("\n"), text


class _Terminal(io.StringIO):
  def isatty(self) -> bool: return True


def test_true_off_a_terminal_writes_a_plain_line_per_stage_and_on_one_overwrites() -> None:
  log = io.StringIO()  # isatty() is false: `kiln run ... 2>log`
  with reporting(StderrProgress(log, after_s=0)): konnx.load(_model())
  lines = log.getvalue().splitlines()
  assert "\r" not in log.getvalue() and "\033" not in log.getvalue(), log.getvalue()
  got = [m.groups() if (m := re.fullmatch(r"kiln: loading: ([a-z ]+) (\d+)/(\d+) \(\d+\.\d s\)", ln)) else ln for ln in lines]
  assert got == [("converting nodes", "3", "3"), ("compiling kernels", "1", "1")], lines  # each stage once, as it ends
  term = _Terminal()
  with reporting(StderrProgress(term, after_s=0)): konnx.load(_model())
  text = term.getvalue()
  assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") > 2 and "\033[K" in text, text


def test_progress_of_another_type_is_refused() -> None:
  with pytest.raises(TypeError, match="progress is None, True or a callable"): konnx.load(_model(), progress="yes")
