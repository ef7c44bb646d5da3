"""The `kiln` command's failures (issue 39): one line on stderr and exit code 2 for what the user can fix, 1 with a hint for
a bug, a traceback only with --debug or KILN_DEBUG; `kiln --version`; `python -m kiln` (kiln/__main__.py, shipped by
kiln-executor alone)."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from kiln.executor import cli
from kiln.ir.errors import SettingError

ROOT = Path(__file__).resolve().parents[3]


def test_a_bad_setting_is_one_line_exit_2(monkeypatch, capsys) -> None:
  monkeypatch.setenv("KILN_THREADS", "abc")
  monkeypatch.delenv("KILN_DEBUG", raising=False)
  assert cli.main(["info"]) == 2
  err = capsys.readouterr().err
  assert err == "kiln info: error: SettingError: KILN_THREADS must be a positive integer, got 'abc'\n"


def test_debug_lets_the_traceback_through(monkeypatch) -> None:
  monkeypatch.setenv("KILN_THREADS", "abc")
  monkeypatch.delenv("KILN_DEBUG", raising=False)
  with pytest.raises(SettingError): cli.main(["--debug", "info"])
  monkeypatch.setenv("KILN_DEBUG", "1")
  with pytest.raises(SettingError): cli.main(["info"])


def test_an_internal_error_is_one_line_exit_1_saying_how_to_see_it(monkeypatch, capsys) -> None:
  monkeypatch.delenv("KILN_DEBUG", raising=False)
  monkeypatch.setattr(cli, "info", lambda: [][0])
  assert cli.main([]) == 1
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and err.startswith("kiln: error: IndexError: list index out of range") and "KILN_DEBUG=1" in err


def test_version_names_every_installed_kiln_distribution(capsys) -> None:
  assert cli.main(["--version"]) == 0
  out = capsys.readouterr().out
  for dist in ("kiln-executor", "kiln-uop-ir", "kiln-codegen"):
    assert any(line.split()[:2] == [dist, version(dist)] for line in out.splitlines()), out
  assert out.splitlines()[-1].split()[0] == "python"


def test_python_dash_m_kiln() -> None:
  p = subprocess.run([sys.executable, "-m", "kiln", "--version"], capture_output=True, text=True, timeout=120)
  assert p.returncode == 0 and "kiln-executor" in p.stdout, p.stderr
  p = subprocess.run([sys.executable, "-m", "kiln", "--no-such-flag"], capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and "usage: kiln" in p.stderr and "Traceback" not in p.stderr


def test_only_the_executor_ships_kiln_main() -> None:
  """kiln is a namespace package: a kiln/__main__.py in two distributions would overwrite each other on install."""
  assert [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("packages/*/src/kiln/__main__.py"))] == ["packages/executor/src/kiln/__main__.py"]
