from kiln.executor import cli


def test_info(rt, capsys):
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  for word in ("devices:", "CPU", "LLVM", "threads:", "cache:"): assert word in out


def test_missing_subcommand_module(rt, capsys, monkeypatch):
  monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
  assert cli.main(["demo"]) == 2
  assert "not installed" in capsys.readouterr().err
