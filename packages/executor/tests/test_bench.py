"""Smoke tests of `kiln bench` at tiny sizes: it runs, checks every kiln result, prints every row. No timing assertions:
times on a shared machine are the benchmark's business, never a test's."""
import argparse
import json

import numpy as np
import pytest
from kiln_executor_testrt import requires_cpu_runtime

pytestmark = requires_cpu_runtime()

from kiln_bench import rows as bench  # noqa: E402

from kiln.executor import cli  # noqa: E402

ROWS = ("float32 add", "float32 add, numpy's arrays", "float32 sum", "float32 sum, numpy's arrays",
        "matmul", "dispatch: 100-kernel plan", "dispatch: 1-kernel execute()", "compile: cold",
        "compile: memory-cache hit", "compile: disk hit, new process", "MLP 784-512-512-10", "MLP plan peak buffer memory",
        "x128 float32, 1 kernel", "x1024 float32, 1 kernel", "layernorm ", "exp ", "gelu ", "encoder layer h384", "encoder layer tuned",
        "BERT encoder 2L", "load+compile: cold", "BERT 2L peak memory", "small CNN", "safetensors load",
        "float32, in turn with numpy A@B", "1-kernel softmax", "two Python threads", "plan after 100 ms idle",
        "CPU time after execute() returns", "replicas: ", "pipeline: ")
TINY = ["--quick", "--sizes-scale", "0.005"]


@pytest.fixture
def cachedir(tmp_path, monkeypatch):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  return tmp_path


def test_bench_runs_and_prints_every_row(cachedir, capsys):
  out_json = cachedir / "bench.json"
  rc = cli.main(["bench", *TINY, "--no-fail", "--json", str(out_json)])
  out = capsys.readouterr().out
  assert rc == 0, out  # --no-fail: only a wrong result or an error could fail it
  for col in bench.COLS: assert col in out
  for row in ROWS: assert row in out, f"row {row!r} missing:\n{out}"
  assert out.count("matmul ") >= 4  # 256, 1000, 1024 and 2048, scaled
  assert out.count("layernorm ") >= 2  # rows of 384 and 768
  for word in ("limit, memory read:", "limit, memory add:", "limit, compute:", "numba:", "tinygrad:", "torch:", "onnxruntime:", "BLAS:"):
    assert word in out
  data = json.loads(out_json.read_text())
  assert len(data["rows"]) == len(ROWS) + 4  # matmul at 4 sizes, layernorm at 2
  for r in data["rows"]:
    assert r["status"] in ("PASS", "NEAR", "MISS", "-"), r  # never WRONG or ERROR
    assert r["kiln"] is not None and r["kiln"] > 0, r
  assert data["limits"]["memory_bandwidth"]["bytes_per_s"] > 0
  assert data["limits"]["fma_peak"]["flops_per_s"] > 0
  mlp = next(r for r in data["rows"] if r["work"].startswith("MLP 784"))
  assert mlp["numpy"] > 0 and mlp["ratio"] > 0


def test_only_runs_the_matching_rows(cachedir, capsys):
  rc = cli.main(["bench", *TINY, "--no-fail", "--only", "^(softmax|EXP )"])
  out = capsys.readouterr().out
  assert rc == 0, out
  body = out[out.index("work "):]
  lines = body.splitlines()
  assert sum(x.startswith("softmax ") for x in lines) == 2 and sum(x.startswith("exp ") for x in lines) == 1, out
  for other in ("matmul", "MLP", "layernorm", "gelu", "dispatch", "encoder"): assert other not in body, other


def _bench():
  b = bench.Bench(argparse.Namespace(quick=True, sizes_scale=0.005, no_fail=False, json=None))
  b.bw, b.peak, b.ctypes_s = 1e10, 1e11, 1e-7
  return b


def test_wrong_kiln_result_is_a_failure_not_a_number(cachedir, monkeypatch):
  real = bench.kiln_call
  def corrupt(ast, bufs):
    call = real(ast, bufs)
    def run():
      call()
      bufs[0].ravel()[0] += 1.0
    return run
  monkeypatch.setattr(bench, "kiln_call", corrupt)
  b = _bench()
  for name, fn in (("add", b.add), ("sum", b.sum), ("add, numpy's arrays", lambda r: b.add(r, user=True)),
                   ("sum, numpy's arrays", lambda r: b.sum(r, user=True)), ("matmul", lambda r: b.matmul(r, 64, True))):
    r = b.row(name, fn, "ms")
    assert r.status == "WRONG", (name, r)
    assert r.kiln is None and r.ratio is None  # no time is reported for a wrong answer
    assert "differs from numpy" in r.note


def test_judge_slack():
  def row(kind, value, kiln=None, ratio=None):
    r = bench.Row("w", "ms", kiln=kiln, ratio=ratio, target_kind=kind, target_value=value)
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
    r = bench.Row("w", "ms", kiln=1.0, checks=[("torch", 1.25), ("onnxruntime", 1.0), ("limit", 0.7)], **kw)
    r.judge()
    return r.status
  assert row(torch=1.3, onnxruntime=1.0, frac=0.7) == "PASS"
  assert row(torch=1.1, onnxruntime=1.5, frac=0.9) == "NEAR"  # the worst target decides
  assert row(torch=1.3, onnxruntime=0.5, frac=0.9) == "MISS"
  assert row(frac=0.8) == "PASS"  # peers not installed: only the limit is judged
  assert row() == "-"


def test_table_lines_up():
  rows = [bench.Row("a", "ms", kiln=1e-3, numpy=2e-3, ratio=2.0, status="PASS"), bench.Row("longer work", "us", kiln=np.float64(1e-6), status="-")]
  lines = bench.table(rows).splitlines()
  assert len(lines) == 4 and len({len(line.rstrip()) for line in lines[:2]}) == 1
  assert "1 ms" in lines[2] and "2.00x" in lines[2] and "1 us" in lines[3]
