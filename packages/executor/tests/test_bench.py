"""The benchmark's harness and the executor's kernel rows (packages/executor/benchmarks/kiln_bench), at tiny sizes: rows
judge, time and print as they should, and a wrong kiln result is a failure. No timing assertions: times on a shared
machine are the benchmark's business, never a test's. The whole table, as scripts/bench runs it: tests/test_bench.py."""
import argparse
import time

import numpy as np
import pytest
from kiln_executor_testrt import requires_cpu_runtime

pytestmark = requires_cpu_runtime()

from kiln_bench import bench, harness, rows, table  # noqa: E402


@pytest.fixture
def cachedir(tmp_path, monkeypatch):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  return tmp_path


def _bench():
  b = bench.Bench(argparse.Namespace(quick=True, sizes_scale=0.005, no_fail=False, json=None))
  b.bw, b.peak, b.ctypes_s = 1e10, 1e11, 1e-7
  return b


def test_wrong_kiln_result_is_a_failure_not_a_number(cachedir, monkeypatch):
  real = rows.kiln_call
  def corrupt(ast, bufs):
    call = real(ast, bufs)
    def run():
      call()
      bufs[0].ravel()[0] += 1.0
    return run
  monkeypatch.setattr(rows, "kiln_call", corrupt)
  b = _bench()
  for name, fn in (("add", lambda r: rows.vec_add(b, r)), ("sum", lambda r: rows.vec_sum(b, r)),
                   ("add, numpy's arrays", lambda r: rows.vec_add(b, r, user=True)),
                   ("sum, numpy's arrays", lambda r: rows.vec_sum(b, r, user=True)), ("matmul", lambda r: rows.matmul(b, r, 64, True))):
    r = b.row(name, fn, "ms")
    assert r.status == "WRONG", (name, r)
    assert r.kiln is None and r.ratio is None  # no time is reported for a wrong answer
    assert "differs from numpy" in r.note


def test_judge_slack():
  def row(kind, value, kiln=None, ratio=None):
    r = table.Row("w", "ms", kiln=kiln, ratio=ratio, target_kind=kind, target_value=value)
    r.judge()
    return r.status
  assert row("ratio", 3.0, kiln=1.0, ratio=3.1) == "PASS"
  assert row("ratio", 3.0, kiln=1.0, ratio=2.5) == "NEAR"
  assert row("ratio", 3.0, kiln=1.0, ratio=2.3) == "MISS"
  assert row("max", 2e-6, kiln=1.9e-6) == "PASS"
  assert row("max", 2e-6, kiln=2.3e-6) == "NEAR"
  assert row("max", 2e-6, kiln=2.5e-6) == "MISS"
  assert row("", 0.0, kiln=1.0) == "-"


def test_judge_checks_every_target_and_skips_missing_peers():
  def row(**kw):
    r = table.Row("w", "ms", kiln=1.0, checks=[("torch", 1.25), ("onnxruntime", 1.0), ("limit", 0.7)], **kw)
    r.judge()
    return r.status
  assert row(torch=1.3, onnxruntime=1.0, frac=0.7) == "PASS"
  assert row(torch=1.1, onnxruntime=1.5, frac=0.9) == "NEAR"  # the worst target decides
  assert row(torch=1.3, onnxruntime=0.5, frac=0.9) == "MISS"
  assert row(frac=0.8) == "PASS"  # peers not installed: only the limit is judged
  assert row() == "-"


def test_table_lines_up():
  rs = [table.Row("a", "ms", kiln=1e-3, numpy=2e-3, ratio=2.0, status="PASS"), table.Row("longer work", "us", kiln=np.float64(1e-6), status="-")]
  lines = table.table(rs).splitlines()
  assert len(lines) == 4 and len({len(line.rstrip()) for line in lines[:2]}) == 1
  assert "1 ms" in lines[2] and "2.00x" in lines[2] and "1 us" in lines[3]


def _logged(log, name, fail_on=None):
  calls = [0]
  def f():
    calls[0] += 1
    if fail_on is not None and calls[0] >= fail_on: raise RuntimeError(f"{name} broke")
    log.append(name)
  return f


def _blocks(log):
  return [x for i, x in enumerate(log) if i == 0 or log[i - 1] != x]


def test_interleaved_rounds_rotate_and_share_the_runs():
  log = []
  t = harness.Timing(warmups=1, runs=7, budget=60.0, warm_seconds=0.0, rounds=3, settle_seconds=0.0)
  calls = harness.interleaved({k: _logged(log, k) for k in "abc"}, t)
  assert _blocks(log) == list("abc" "bca" "cab")  # one block each a round, the order rotating
  for k in "abc": assert [len(block) for block in calls[k]] == [3, 2, 2], calls[k]  # 7 runs over 3 rounds
  alone = harness.interleaved({"a": _logged([], "a")}, t)
  assert [len(block) for block in alone["a"]] == [7]  # nothing to interleave: one block


def test_interleaved_takes_fewer_rounds_when_the_slowest_call_does_not_fit():
  t = harness.Timing(warmups=1, runs=10, budget=0.2, warm_seconds=0.0, rounds=5, settle_seconds=0.0, min_rounds=3)
  fast = harness.interleaved({"a": lambda: None, "b": lambda: None}, t)
  assert [len(fast[k]) for k in "ab"] == [5, 5]
  slow = harness.interleaved({"a": lambda: None, "b": lambda: time.sleep(0.05)}, t)  # 2 calls a round x 5 rounds > 0.2 s
  assert [len(slow[k]) for k in "ab"] == [3, 3] and sum(map(len, slow["a"])) == 10  # the runs left go to the rounds left


def test_interleaved_drops_a_contender_that_fails_only_when_asked():
  t = harness.Timing(warmups=1, runs=3, budget=60.0, warm_seconds=0.0, rounds=3, settle_seconds=0.0)
  dropped = []
  fns = {"a": _logged([], "a"), "b": _logged([], "b", fail_on=4), "c": _logged([], "c")}
  calls = harness.interleaved(fns, t, on_error=lambda who, e: dropped.append((who, str(e))))
  assert dropped == [("b", "b broke")] and set(calls) == {"a", "c"}
  assert all(len(calls[k]) == 3 for k in "ac")
  with pytest.raises(RuntimeError, match="b broke"):
    harness.interleaved({"a": _logged([], "a"), "b": _logged([], "b", fail_on=4)}, t)


def test_time_row_notes_a_failing_peer_and_times_the_rest_together(cachedir):
  b = _bench()
  r = table.Row("w", "ms")
  def wrong(_): raise harness.WrongResult("torch w: result differs from numpy")
  peers = {"torch": (lambda: None, wrong), "numba": (lambda: None, lambda _: None), "onnxruntime": (_logged([], "o", fail_on=3), lambda _: None)}
  got = b.time_row(r, {"kiln": lambda: None, "numpy": lambda: None}, peers)
  assert set(got) == set(r.rounds) == {"kiln", "numpy", "numba"}
  assert r.torch is None and r.onnxruntime is None and r.kiln == got["kiln"] and r.numba == got["numba"]
  assert "torch: WrongResult" in r.note and "onnxruntime: RuntimeError: o broke" in r.note
  assert all(len(v) == b.t.rounds for v in r.rounds.values())
  with pytest.raises(RuntimeError, match="k broke"):  # kiln's own error is the row's, never a note
    b.time_row(table.Row("w", "ms"), {"kiln": _logged([], "k", fail_on=3), "numpy": lambda: None})


def test_judged_on_the_median_round_and_disagreeing_rounds_are_shown():
  def row(numpy_rounds, **kw):
    r = table.Row("w", "ms", kiln=1.0, target_kind="ratio", target_value=1.0, rounds={"kiln": [1.0] * len(numpy_rounds), "numpy": numpy_rounds}, **kw)
    r.ratio = r.paired("numpy")
    r.judge()
    return r
  r = row([0.94, 1.07, 1.05, 0.7, 1.2])
  assert r.ratio == pytest.approx(1.05) and r.status == "PASS"
  assert "kiln/numpy 0.70-1.20x (median 1.05x) over 5 rounds" in r.spread and "PASS 3, NEAR 1, MISS 1" in r.spread, r.spread
  assert "rounds disagree" in r.note and "PASS~" in table.table([r])
  steady = row([1.1, 1.2, 1.3])
  assert steady.status == "PASS" and steady.spread == "" and "~" not in table.table([steady])
  # the peers' targets too, each round's ratio from that round's times; the limit scaled by each round's kiln time
  r = table.Row("w", "ms", kiln=1.0, torch=1.0, frac=0.8, checks=[("torch", 1.0), ("limit", 0.7)],
                rounds={"kiln": [1.0, 0.8, 1.25], "torch": [1.1, 0.7, 1.0]})
  r.judge()
  assert r.paired("torch") == pytest.approx(0.875) and r.status == "NEAR", r
  assert "vs torch 0.80-1.10x" in r.spread and "limit 64-100%" in r.spread, r.spread


def test_isa_hold_reads_applies_and_reports(monkeypatch):
  """--isa avx2 (kiln_bench.isa): found in argv either way, refused when unknown, applied once (the restarted process sees
  its mark and goes on), and the report line names what each peer is held to, warning when a setting changed since."""
  from kiln_bench import isa
  assert isa.requested(["--only", "x", "--isa", "avx2"]) == "avx2" and isa.requested(["--isa=avx2"]) == "avx2"
  assert isa.requested(["--only", "isa"]) is None
  monkeypatch.delenv(isa.MARK, raising=False)
  with pytest.raises(SystemExit, match="--isa must be one of avx2"): isa.apply_and_restart(["--isa", "avx512"])
  assert isa.describe() is None
  monkeypatch.setenv(isa.MARK, "avx2")
  for k, v in isa.SETTINGS["avx2"][0].items(): monkeypatch.setenv(k, v)
  isa.apply_and_restart(["--isa", "avx2"])  # already applied: returns instead of exec'ing again
  line = isa.describe()
  assert line is not None and "OPENBLAS_CORETYPE=Haswell" in line and "ATEN_CPU_CAPABILITY=avx2" in line and "WARNING" not in line
  monkeypatch.setenv("KILN_CPU", "x86-64-v4")
  assert "changed since the start: KILN_CPU" in (isa.describe() or "")
