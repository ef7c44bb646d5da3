from kiln.executor import cli


def test_info(rt, capsys):
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  for word in ("devices:", "CPU", "LLVM", "threads:", "cache:"): assert word in out


def test_missing_subcommand_module(rt, capsys, monkeypatch):
  monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
  assert cli.main(["demo"]) == 2
  assert "not installed" in capsys.readouterr().err


def test_bench_outside_a_checkout_says_what_to_run(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(cli, "BENCH_DIR", tmp_path / "benchmarks")  # an installed wheel: no benchmarks folder beside src/
  assert cli.main(["bench", "--quick"]) == 2
  err = capsys.readouterr().err
  assert "not part of the installed kiln-executor" in err and "scripts/bench" in err
