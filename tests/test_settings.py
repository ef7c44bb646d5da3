"""Settings: every KILN_* environment variable the packages' code names is declared in a package's settings module and
read only through kiln.ir.settings; a bad value is one SettingError naming the variable and what it takes; `kiln info
--settings` lists them all with their values."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.executor.cli import main
from kiln.ir.errors import SettingError
from kiln.ir.settings import Setting, flag, installed, integer

ROOT = Path(__file__).resolve().parents[1]
SRC = sorted(ROOT.glob("packages/*/src/kiln/**/*.py"))
NAME = re.compile(r"\bKILN_[A-Z0-9_]*[A-Z0-9]\b")
# preprocessor names in C/CUDA source kiln generates or ships, not environment variables
C_MACROS = {"KILN_DYNAMIC_SHARED", "KILN_MMA", "KILN_EMU_KERNEL", "KILN_EMU_OS_THREADS"}
HELPER = ROOT / "packages/uop-ir/src/kiln/ir/settings.py"


def declared() -> dict[str, Setting]:
  out: dict[str, Setting] = {}
  for module, settings in installed().items():
    for s in settings:
      assert s.name not in out, f"{s.name} is declared twice (in {module} and elsewhere): one home per setting"
      out[s.name] = s
  return out


def test_every_kiln_name_in_the_source_is_declared() -> None:
  names = declared()
  assert len(names) >= 20 and {"KILN_CACHE", "KILN_CPU", "KILN_TUNE", "KILN_WINOGRAD", "KILN_CUDA_TF32"} <= set(names)
  used: dict[str, set[str]] = {}
  for f in SRC:
    for n in NAME.findall(f.read_text()): used.setdefault(n, set()).add(str(f.relative_to(ROOT)))
  undeclared = {n: sorted(fs) for n, fs in used.items() if n not in names and n not in C_MACROS}
  assert not undeclared, f"KILN_* names used but declared in no settings module: {undeclared}"
  # the C++ launcher's getenv too
  for h in ROOT.glob("packages/*/src/kiln/**/*.h"):
    for n in re.findall(r'getenv\("(KILN_[A-Z0-9_]+)"\)', h.read_text()): assert n in names, f"{h}: {n} is not declared"


def test_no_kiln_variable_is_read_around_the_helper() -> None:
  direct = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*["']KILN_""")
  bad = [f"{f.relative_to(ROOT)}:{i}" for f in SRC if f != HELPER for i, line in enumerate(f.read_text().splitlines(), 1)
         if direct.search(line)]
  assert not bad, f"KILN_* read from os.environ directly (use the package's settings module): {bad}"


def test_a_bad_value_is_one_setting_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
  s = declared()
  monkeypatch.setenv("KILN_THREADS", "0")
  with pytest.raises(SettingError, match=r"^KILN_THREADS must be a positive integer, got '0'$"): s["KILN_THREADS"].get()
  monkeypatch.setenv("KILN_GUARD", "maybe")
  with pytest.raises(SettingError, match=r"^KILN_GUARD must be 1 or 0 \(true/false, yes/no, on/off\), got 'maybe'$"): s["KILN_GUARD"].get()
  monkeypatch.setenv("KILN_TUNE_BUDGET", "inf")
  with pytest.raises(SettingError, match="KILN_TUNE_BUDGET must be a positive number of seconds, got 'inf'"): s["KILN_TUNE_BUDGET"].get()
  monkeypatch.setenv("KILN_POOL", "Native")  # choices are spelled exactly
  with pytest.raises(SettingError, match="KILN_POOL must be one of native, python, got 'Native'"): s["KILN_POOL"].get()
  monkeypatch.setenv("KILN_CPU", "pentium9")  # the names this host's LLVM targets are listed
  with pytest.raises(SettingError, match=r"KILN_CPU must be .*, got 'pentium9' \(accepted here: .+\)"): s["KILN_CPU"].get()
  assert issubclass(SettingError, ValueError)  # callers that caught the ValueError some of these raised still do


def test_unset_or_empty_is_the_default_and_values_are_read_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
  on, n = flag("KILN_TEST_FLAG", True, "a test flag"), integer("KILN_TEST_INT", 7, "a test number", 1)
  monkeypatch.delenv("KILN_TEST_FLAG", raising=False)
  assert on.get() is True and not on.is_set()
  monkeypatch.setenv("KILN_TEST_FLAG", "  ")  # an unresolved CI variable
  assert on.get() is True
  for text, want in (("0", False), ("OFF", False), ("no", False), ("Yes", True), ("1", True)):
    monkeypatch.setenv("KILN_TEST_FLAG", text)
    assert on.get() is want, text
  monkeypatch.setenv("KILN_TEST_INT", " 12 ")
  assert n.get() == 12 and n.shown() == "12"
  monkeypatch.setenv("KILN_TEST_INT", "1.5")
  with pytest.raises(SettingError, match=r"^KILN_TEST_INT must be a whole number >= 1, got '1.5'$"): n.get()


def test_a_secret_is_never_echoed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
  from kiln.codegen import diskcache
  monkeypatch.setenv("KILN_CACHE_KEY", "zz" * 32)
  with pytest.raises(SettingError, match="KILN_CACHE_KEY must be hex digits") as ei: diskcache.cache_key()
  assert "zz" not in str(ei.value)
  assert main(["info", "--settings"]) == 0
  out = capsys.readouterr().out
  assert "KILN_CACHE_KEY         (set)" in out and "zz" not in out


def test_kiln_info_settings_lists_every_setting_with_its_value(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
  names = declared()
  for n in names: monkeypatch.delenv(n, raising=False)
  monkeypatch.setenv("KILN_SPIN_US", "250")
  monkeypatch.setenv("KILN_EMU_MODE", "coroutines")
  assert main(["info", "--settings"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert {"  kiln.codegen.settings", "  kiln.executor.settings", "  kiln.graph.settings", "  kiln.runtime.cpu.settings",
          "  kiln.runtime.cuda.settings"} <= set(lines)
  rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines if ln.startswith("    KILN_")}
  assert set(rows) == set(names)
  assert rows["KILN_SPIN_US"] == "250" and rows["KILN_CACHE"] == "True (default)" and rows["KILN_CPU"] == "(unset)"
  assert rows["KILN_EMU_MODE"] == "BAD: KILN_EMU_MODE must be one of fibers, threads, got 'coroutines'"  # listed, not raised
  assert all(f"; takes {s.takes}" in "\n".join(lines) for s in names.values())


def test_set_and_temporarily_check_the_value_and_restore_it(monkeypatch: pytest.MonkeyPatch) -> None:
  n = integer("KILN_TEST_INT", 7, "a test number", 1)
  monkeypatch.setenv("KILN_TEST_INT", "3")
  with n.temporarily(5): assert n.get() == 5
  assert n.get() == 3
  with pytest.raises(RuntimeError), n.temporarily(None):
    assert not n.is_set() and n.get() == 7
    raise RuntimeError  # put back however the block ends
  assert n.raw() == "3"
  with pytest.raises(SettingError, match=r"^KILN_TEST_INT must be a whole number >= 1, got '0'$"): n.set(0)
  assert n.raw() == "3"  # a refused value leaves the variable as it was
  n.set(9)
  assert n.get() == 9
  n.set(None)
  assert not n.is_set()
