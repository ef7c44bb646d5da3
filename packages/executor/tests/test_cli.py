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
  assert cli.main(["bench-suite", "--quick"]) == 2
  err = capsys.readouterr().err
  assert "not part of the installed kiln-executor" in err and "scripts/bench" in err


class _EP:
  """A stand-in for an importlib.metadata entry point of the kiln.commands group."""
  def __init__(self, name, fn=None, err=None): self.name, self.fn, self.err, self.dist = name, fn, err, None
  def load(self):
    if self.err is not None: raise self.err
    return self.fn


def test_plugin_commands_dispatch_and_builtins_win(capsys, monkeypatch):
  from importlib import metadata
  seen = []
  eps = [_EP("hello", lambda argv: seen.append(argv) or 3), _EP("info", lambda argv: 99)]
  monkeypatch.setattr(metadata, "entry_points", lambda group: eps if group == "kiln.commands" else [])
  assert set(cli.plugin_commands()) == {"hello"}  # a plugin cannot take a built-in name
  assert cli.main(["hello", "a", "--flag", "-x"]) == 3 and seen == [["a", "--flag", "-x"]]


def test_plugin_that_cannot_load_is_a_message(capsys, monkeypatch):
  from importlib import metadata
  broken = [_EP("broken", err=ImportError("no module named onnx"))]
  monkeypatch.setattr(metadata, "entry_points", lambda group: broken if group == "kiln.commands" else [])
  assert cli.main(["broken"]) == 2
  err = capsys.readouterr().err
  assert "kiln broken" in err and "cannot be loaded" in err and "no module named onnx" in err and "Traceback" not in err
