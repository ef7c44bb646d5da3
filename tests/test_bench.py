"""kiln's benchmark as scripts/bench and `kiln bench-suite` run it: the executor's rows and the rows spanning layers
(benchmarks/stack_bench) as one table, at tiny sizes. It runs, checks every kiln result, prints every row; no timing
assertions (times on a shared machine are the benchmark's business, never a test's). And its layout: the executor's
benchmark folder imports no layer above the executor and none of the root's rows, and no benchmark module imports
another in a loop, lazily or not."""
import ast
import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXECUTOR_BENCH = ROOT / "packages" / "executor" / "benchmarks" / "kiln_bench"
STACK_BENCH = ROOT / "benchmarks" / "stack_bench"
ROWS = ("float32 add", "float32 add, numpy's arrays", "float32 sum", "float32 sum, numpy's arrays",
        "matmul", "dispatch: 100-kernel plan", "dispatch: 1-kernel execute()", "compile: cold",
        "compile: memory-cache hit", "compile: disk hit, new process", "MLP 784-512-512-10", "MLP plan peak buffer memory",
        "x128 float32, 1 kernel", "x1024 float32, 1 kernel", "layernorm ", "exp ", "gelu ", "encoder layer h384", "encoder layer tuned",
        "BERT encoder 2L", "load+compile: cold", "BERT 2L peak memory", "small CNN", "safetensors load",
        "float32, in turn with numpy A@B", "1-kernel softmax", "two Python threads", "plan after 100 ms idle",
        "CPU time after execute() returns", "replicas: ", "pipeline: ")
TINY = ["--quick", "--sizes-scale", "0.005"]


def _imports(path: Path) -> set[str]:
  """Every module a file imports, at module level or inside a function (`from a import b` gives a and a.b)."""
  out: set[str] = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import): out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module: out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return out


def _bench_modules() -> dict[str, set[str]]:
  """kiln_bench.* and stack_bench.* modules -> the modules they import."""
  return {f"{pkg.name}.{f.stem}": _imports(f) for pkg in (EXECUTOR_BENCH, STACK_BENCH) for f in sorted(pkg.glob("*.py")) if f.stem != "__init__"}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle among graph's modules (first repeated at the end), or None."""
  state: dict[str, int] = {}
  def visit(m: str, path: list[str]) -> list[str] | None:
    state[m] = 1
    for d in sorted(graph[m]):
      if state.get(d) == 1: return path[path.index(d):] + [d]
      if d not in state and (c := visit(d, path + [d])): return c
    state[m] = 2
    return None
  for m in sorted(graph):
    if m not in state and (c := visit(m, [m])): return c
  return None


def test_bench_layout_points_down_without_loops():
  mods = _bench_modules()
  assert {"kiln_bench.harness", "kiln_bench.bench", "kiln_bench.rows", "stack_bench.graph_rows", "stack_bench.ray_rows"} <= set(mods)
  for m, deps in mods.items():
    if m.startswith("kiln_bench."):
      up = sorted(d for d in deps if any(d == x or d.startswith(x + ".") for x in ("kiln.graph", "kiln.distributed", "stack_bench", "onnx", "ray")))
      assert not up, f"{m} is the executor's benchmark, yet imports {up}: rows spanning layers belong in benchmarks/stack_bench"
  graph = {m: {d for d in deps if d in mods} for m, deps in mods.items()}
  assert _cycle(graph) is None, f"benchmark modules import each other in a loop: {' -> '.join(_cycle(graph) or [])}"


def test_cycle_finder_finds_a_lazy_loop():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.fixture
def kiln_bench_cli(tmp_path, monkeypatch):
  """`kiln bench-suite` with a private kernel cache (needs the CPU runtime), and the harness importable as the command finds
  it: benchmarks/ on the path, whose stack_bench puts the executor's kiln_bench there (as benchmarks/run.py does)."""
  pytest.importorskip("kiln.runtime.cpu")
  if str(ROOT / "benchmarks") not in sys.path: sys.path.insert(0, str(ROOT / "benchmarks"))
  import stack_bench  # noqa: F401
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  from kiln.executor import cli
  return cli


def test_bench_runs_and_prints_every_row(kiln_bench_cli, tmp_path, capsys):
  from kiln_bench import table
  out_json = tmp_path / "bench.json"
  rc = kiln_bench_cli.main(["bench-suite", *TINY, "--no-fail", "--json", str(out_json)])
  out = capsys.readouterr().out
  assert rc == 0, out  # --no-fail: only a wrong result or an error could fail it
  for col in table.COLS: assert col in out
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
  # kiln and numpy in the same 3 rounds (--quick), the ratio the median of the rounds' quotients
  assert set(mlp["rounds"]) == {"kiln", "numpy"} and all(len(v) == 3 for v in mlp["rounds"].values()), mlp["rounds"]
  assert mlp["ratio"] == pytest.approx(statistics.median(n / k for n, k in zip(mlp["rounds"]["numpy"], mlp["rounds"]["kiln"])))
  for r in data["rows"]:
    for who in r["rounds"]:
      if who in table.COLUMNS: assert r[who] is not None and len(r["rounds"][who]) == len(r["rounds"]["kiln"]), r


def test_only_runs_the_matching_rows(kiln_bench_cli, capsys):
  rc = kiln_bench_cli.main(["bench-suite", *TINY, "--no-fail", "--only", "^(softmax|EXP )"])
  out = capsys.readouterr().out
  assert rc == 0, out
  body = out[out.index("work "):]
  lines = body.splitlines()
  assert sum(x.startswith("softmax ") for x in lines) == 2 and sum(x.startswith("exp ") for x in lines) == 1, out
  for other in ("matmul", "MLP", "layernorm", "gelu", "dispatch", "encoder"): assert other not in body, other
