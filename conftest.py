"""Repository-wide pytest hooks: the reliability counts (bad-input catalogue, fuzz cases) printed at the end of the run, and a
private XDG_CONFIG_HOME for the whole run (the disk cache's key lives there: tests and the processes they start must never
write the user's real ~/.config, which may also be read-only on CI)."""
import os
import tempfile
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
  if "KILN_TEST_CONFIG_HOME" not in os.environ:  # once per run; subprocesses inherit both variables
    d = tempfile.mkdtemp(prefix="kiln-test-config-")
    os.environ["KILN_TEST_CONFIG_HOME"] = os.environ["XDG_CONFIG_HOME"] = d
  # the plan cache keys a model on its bytes, arguments, code and settings, never on a module constant a test patches (a
  # limit lowered to see a refusal): off for the run, on in the tests of it (test_plan_cache.py)
  os.environ.setdefault("KILN_PLAN_CACHE", "0")


@pytest.fixture
def plan_cache_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
  """The plan cache on (the run turns it off: pytest_configure), in a fresh cache directory; its plans/ area."""
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("KILN_CACHE", "1")
  monkeypatch.setenv("KILN_PLAN_CACHE", "1")
  return tmp_path / "cache" / "plans"


@pytest.fixture(scope="session")
def kiln_counts(request: pytest.FixtureRequest) -> dict[str, int]:
  """Counters a test adds to (the fuzzer's cases); printed by pytest_terminal_summary."""
  return request.config.__dict__.setdefault("_kiln_counts", {})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Under pytest-xdist (`scripts/test` runs `-n auto --dist loadgroup`), each test file runs whole on one worker, so a
  module-scoped fixture (an emulator build, a compiled model) is built once; the distributed tests share one group, so
  one worker starts the session's Ray cluster, not each."""
  for item in items:
    path = str(item.path)
    group = "ray" if f"{os.sep}distributed{os.sep}tests{os.sep}" in path else path
    item.add_marker(pytest.mark.xdist_group(group))


def pytest_sessionfinish(session: pytest.Session) -> None:
  if hasattr(session.config, "workeroutput"):  # an xdist worker hands its counters to the controller
    session.config.workeroutput["kiln_counts"] = dict(session.config.__dict__.get("_kiln_counts", {}))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
  counts = node.config.__dict__.setdefault("_kiln_counts", {})
  for k, v in getattr(node, "workeroutput", {}).get("kiln_counts", {}).items(): counts[k] = counts.get(k, 0) + v


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
  reports = [r for k in ("passed", "failed") for r in terminalreporter.stats.get(k, []) if getattr(r, "when", "") == "call"]
  cat = [r for r in reports if "test_bad_input.py::" in r.nodeid]
  c = config.__dict__.get("_kiln_counts", {})
  if not cat and not c: return
  terminalreporter.section("kiln reliability")
  if cat: terminalreporter.write_line(f"bad-input catalogue: {len(cat)} malformed inputs checked ({sum(r.passed for r in cat)} passed)")
  if c:
    terminalreporter.write_line(f"differential fuzzer: {c.get('kernel_cases', 0)} kernel cases ({c.get('cpu_runs', 0)} CPU runs, "
                                f"{c.get('cuda_runs', 0)} CUDA emulation runs), {c.get('index_cases', 0)} index expressions, "
                                f"{c.get('graph_programs', 0)} tensor programs, {c.get('onnx_graphs', 0)} ONNX graphs, ONNX edge cases: "
                                f"{c.get('onnx_gather_cases', 0)} gathers, {c.get('onnx_extdata_cases', 0)} external data"
                                + (f", {c['onnx_boundary_cases']} 2**31 reductions" if c.get("onnx_boundary_cases") else ""))
