"""The model zoo's pure parts (packages/graph/benchmarks/zoo: the rest needs torch and runs only in the bench env): how a
result is compared with onnxruntime's, how refusals are grouped and ranked, and the totals."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zoo import report  # noqa: E402
from zoo.check import TOL, rel_error  # noqa: E402


@pytest.mark.parametrize("got, want, bad", [
  ([1.0, 2.0], [1.0, 2.0], False),
  ([100.0, 2.0 + 1e-4], [100.0, 2.0], False),       # relative to the output's scale (100), not to each element
  ([1.0, 2.01], [1.0, 2.0], True),
  ([np.nan, 1.0], [np.nan, 1.0], False),            # NaN where onnxruntime has NaN is no error
  ([np.nan, 1.0], [0.0, 1.0], True),
  ([np.inf, 1.0], [np.inf, 1.0], False),
  ([-np.inf, 1.0], [np.inf, 1.0], True),
  ([3, 4], [3, 4], False),                           # integers exactly
  ([3, 5], [3, 4], True),
])
def test_rel_error(got: list[float], want: list[float], bad: bool) -> None:
  g, w = np.array(got), np.array(want)
  if g.dtype.kind == "i": g, w = g.astype(np.int64), w.astype(np.int64)
  assert (rel_error(g, w) > TOL) == bad


def rec(name: str, **results: tuple[str, str]) -> dict:
  return {"name": name, "family": "f", "results": {v.replace("__", "/"): {"variant": v, "status": s, "message": m} for v, (s, m) in results.items()}}


def test_refusals_group_by_operator_and_rank_by_models() -> None:
  recs = [
    rec("a", dynamo__fixed=("REFUSED", "node /layer1/Resize_3 (Resize): mode 'cubic' is not supported"),
        script__fixed=("REFUSED", "node Resize_17 (Resize): mode 'cubic' is not supported")),
    rec("b", dynamo__fixed=("REFUSED", "node /x/Resize (Resize, opset 20): mode 'cubic' is not supported"), script__fixed=("OK", "")),
    rec("c", dynamo__fixed=("REFUSED", "2 nodes use what kiln does not support:\n  node n0 (NonZero): operator NonZero is not supported\n"
                                       "  node /r (Resize, opset 20): mode 'cubic' is not supported"),
        script__fixed=("CRASH", "at load: KeyError: 3")),
  ]
  assert report.group("node /a/b_12 (Pad): pads 'val_12' has 3 values") == ("Pad", "pads '…' has N values")
  assert report.group("input 'x' dim 0 is symbolic") == ("(model)", "input 'x' dim N is symbolic")
  lines = report.refusals(recs)
  rows = [l for l in lines if l.startswith("| ") and not l.startswith("| models")]
  assert rows[0].startswith("| 3 | 4 | Resize | mode 'cubic' is not supported | a, b, c |")  # three models, four exports, one group
  assert rows[1].startswith("| 1 | 1 | NonZero |")
  md = report.markdown(recs, "test")
  assert "| dynamo/fixed | 0 | 3 | 0 | 0 | 0 |" in md and "| script/fixed | 1 | 1 | 0 | 0 | 1 |" in md  # OK, REFUSED, TIES, WRONG, CRASH
  assert "- CRASH or TIMEOUT in some export: **1**" in md and "**CRASH** at load: KeyError: 3" in md
