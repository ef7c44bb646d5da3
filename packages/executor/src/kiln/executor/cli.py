"""The `kiln` command: `kiln info [--settings]`, `kiln demo`, `kiln bench-suite` (kiln's benchmark, from a checkout), and the
commands other kiln layers add through the entry-point group `kiln.commands` (`kiln run`, `kiln bench MODEL` and `kiln
inspect`, from kiln-graph): an entry point names a `main(argv) -> int`. The executor never imports those layers itself; it
finds them installed, as it finds runtimes through `kiln.devices`."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.ir.errors import KilnError

# the benchmark lives in the source tree (the repository's benchmarks/, with the executor's rows in packages/executor/benchmarks),
# never in the wheel
_UP = Path(__file__).resolve().parents  # packages/executor/src/kiln/executor/ in a checkout: its root is five folders up
BENCH_DIR = (_UP[5] if len(_UP) > 5 else _UP[-1]) / "benchmarks"
BENCH_MODULE = "stack_bench.main"


def _fmt_bytes(n: int) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if n < 1024 or unit == "GB": return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
    n /= 1024  # type: ignore[assignment]
  return f"{n} B"


def info() -> int:
  from kiln.codegen import settings
  from kiln.codegen.registry import available_devices, get_runtime
  from kiln.codegen.threads import core_trip_ns, thread_count
  from kiln.executor import cache
  from kiln.executor.version import __version__
  print(f"kiln {__version__}  (python {sys.version.split()[0]})")
  print(f"  versions:   {cache.kiln_versions() or 'unknown'}")
  devs = available_devices()
  print(f"  devices:    {', '.join(devs) or 'none (install kiln-runtime-cpu)'}")
  for d in devs:
    if d == "DISK": continue
    try:
      rt = get_runtime(d)
      print(f"    {d:<6} ok: compiler {getattr(rt.compiler, 'cache_key', '?')}, host_parallel_safe={rt.host_parallel_safe}")
    except Exception as e:  # a device whose runtime is installed but cannot start (no GPU, no driver) is still listed
      print(f"    {d:<6} unavailable: {str(e).splitlines()[0][:120]}")
  try:
    import llvmlite.binding as llvm
    print(f"  LLVM:       {'.'.join(map(str, llvm.llvm_version_info))} (llvmlite {importlib.import_module('llvmlite').__version__})")
    try: print(f"  LLVM host:  {llvm.get_process_triple()}, cpu {llvm.get_host_cpu_name()}")
    except Exception: pass  # noqa: S110
  except ImportError: print("  LLVM:       llvmlite not installed")
  print(f"  CPU:        {cache.cpu_name()}")
  if "CPU" in devs:
    try:  # the CPU code is built for: the host, or the one KILN_CPU names (its vector width and registers steer the tiles)
      cpu: Any = get_runtime("CPU")  # the CPU runtime's own attributes, beyond the Runtime protocol
      t, choice = cpu.target, cpu.compiler.choice
      print(f"  target:     cpu {choice.cpu} ({'KILN_CPU' if choice.from_env else 'host'}), "
            f"{t.vector_bytes}-byte vectors x {t.vector_registers} registers, "
            f"L1d {_fmt_bytes(t.l1d_bytes)}, L2 {_fmt_bytes(t.l2_bytes)}, L3 {_fmt_bytes(t.l3_bytes)}, {t.cores} cores")
      trip = core_trip_ns()
      print(f"  core trip:  {'-' if trip is None else f'{trip:.0f} ns'}  (a cache line between two threads' cores and back, now: "
            "what a split kernel's hand-offs cost)")
    except Exception as e:  # the devices line above already says why the CPU runtime cannot start
      print(f"  target:     unavailable ({str(e).splitlines()[0][:120]})")
  flags = cache.cpu_fingerprint().partition("|")[2].split()
  simd = [f for f in flags if f.startswith(("avx", "sse4", "fma", "neon", "asimd", "f16c", "amx"))]
  print(f"  features:   {' '.join(simd) if simd else '-'}  ({len(flags)} flags)")
  print(f"  threads:    {thread_count()} ({'KILN_THREADS' if settings.THREADS.is_set() else 'default: physical cores this process may use'})")
  cdir, n, size = cache.disk_cache_info()
  print(f"  cache:      {cdir}  ({n} kernels, {_fmt_bytes(size)}){'' if cache.disk_cache_enabled() else '  [disabled: KILN_CACHE=0]'}")
  return 0


def info_settings() -> int:
  """Every KILN_* setting of the installed kiln packages: its value (or default), then what it does and what it takes."""
  from kiln.ir.settings import installed
  print("kiln settings (KILN_* environment variables, each declared in its package's settings module)")
  for module, declared in installed().items():
    print(f"  {module}")
    for s in declared:
      print(f"    {s.name:<22} {s.shown()}")
      print(f"    {'':<22}   {s.doc}; takes {s.takes}")
  return 0


def _dispatch(module: str, argv: Sequence[str]) -> int:
  name = f"kiln.executor.{module}"
  if importlib.util.find_spec(name) is None:
    print(f"kiln {module}: {name} is not installed in this version of kiln-executor", file=sys.stderr)
    return 2
  ret = importlib.import_module(name).main(list(argv))
  return int(ret or 0)


def bench_suite(argv: Sequence[str]) -> int:
  """kiln's benchmark (kernels and models against numpy, torch, onnxruntime, ...), from a checkout; a model's is `kiln bench MODEL`."""
  if not (BENCH_DIR / "stack_bench").is_dir():
    print("kiln bench-suite: the benchmark is not part of the installed kiln-executor; it lives in kiln's source tree: "
          "from a checkout run scripts/bench (or python benchmarks/run.py)", file=sys.stderr)
    return 2
  if str(BENCH_DIR) not in sys.path: sys.path.insert(0, str(BENCH_DIR))
  return int(importlib.import_module(BENCH_MODULE).main(list(argv)) or 0)


BUILTIN = ("info", "demo", "bench-suite")
# commands a layer above adds: named here only to say what to install where that layer is missing
LAYERED = {"run": "kiln-graph[onnx]", "bench": "kiln-graph[onnx]", "inspect": "kiln-graph[onnx]"}
# their one line in `kiln --help`, which lists a layer's commands without importing it
ABOUT = {"run": "run an ONNX model: outputs, --profile, --random inputs", "bench": "time an ONNX model (--compare: onnxruntime, OpenVINO)",
         "inspect": "an ONNX model's inputs, outputs, operators and what kiln refuses",
         "generate": "generate text with a language model (GGUF file or Hugging Face folder)"}


def plugin_commands() -> dict[str, Any]:
  """The `kiln.commands` entry points of the installed distributions, by name; a built-in name cannot be taken."""
  from importlib.metadata import entry_points
  return {ep.name: ep for ep in entry_points(group="kiln.commands") if ep.name not in BUILTIN}


def _plugin(ep: Any, argv: Sequence[str]) -> int:
  dist = getattr(getattr(ep, "dist", None), "name", None) or "its distribution"
  try: fn = ep.load()
  except Exception as e:  # an installed layer that cannot import (a missing extra, a broken install) is a message, not a traceback
    print(f"kiln {ep.name}: the command from {dist} cannot be loaded ({type(e).__name__}: {e})", file=sys.stderr)
    return 2
  return int(fn(list(argv)) or 0)


def _main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="kiln", description="kiln: a kernel compiler and runtime",
                               epilog="A failing command prints one line and exits with 2; --debug (before the command) or KILN_DEBUG=1 "
                               "shows the traceback.")
  ap.add_argument("--version", action="store_true", help="print the version of every installed kiln distribution")
  ap.add_argument("--debug", action="store_true", help="let a failing command's traceback through (as KILN_DEBUG=1 does)")
  sub = ap.add_subparsers(dest="cmd")
  info_p = sub.add_parser("info", help="devices, LLVM, CPU features, threads, kernel cache (--settings: the KILN_* settings)")
  info_p.add_argument("--settings", action="store_true", help="list every KILN_* setting with its value")
  sub.add_parser("demo", help="run the MLP inference demo", add_help=False)
  sub.add_parser("bench-suite", help="run kiln's benchmark (from a kiln checkout; a model's: kiln bench MODEL)", add_help=False)
  plugins = plugin_commands()
  for name, ep in sorted(plugins.items()):
    dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed layer"
    sub.add_parser(name, help=f"{ABOUT[name] + ' ' if name in ABOUT else ''}(from {dist}: kiln {name} --help)", add_help=False)
  first = next((a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("-")), None)
  if first in LAYERED and first not in plugins:
    print(f"kiln {first}: comes with kiln-graph, which is not installed here: pip install \"{LAYERED[first]}\"", file=sys.stderr)
    return 2
  args, rest = ap.parse_known_args(argv)
  if args.version: return versions()
  if args.cmd in (None, "info"):
    if rest: ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return info_settings() if getattr(args, "settings", False) else info()
  if args.cmd in plugins: return _plugin(plugins[args.cmd], rest)
  return bench_suite(rest) if args.cmd == "bench-suite" else _dispatch(args.cmd, rest)


def versions() -> int:
  """`kiln --version`: every installed kiln distribution, its version and whether it is an editable install."""
  from importlib.metadata import distributions
  found: dict[str, str] = {}
  for d in distributions():
    name = (d.metadata["Name"] or "").strip()
    if name.lower().replace("_", "-") == "kiln" or name.lower().replace("_", "-").startswith("kiln-"):
      editable = '"editable": true' in (d.read_text("direct_url.json") or "").replace("'", '"').lower()
      found.setdefault(name, f"{d.version}{'  (editable)' if editable else ''}")
  if not found: print("kiln: no kiln distribution is installed (running from a source tree?)")
  w = max(map(len, found), default=0)
  for name in sorted(found): print(f"{name:<{w}}  {found[name]}")
  print(f"{'python':<{w}}  {sys.version.split()[0]}")
  return 0


_debug_flag = False  # `kiln --debug CMD` was given (main sets it before running CMD)


def debugging(argv: Sequence[str]) -> bool:
  """A failing command shows its traceback: `--debug` before the command, or KILN_DEBUG set to 1 or more."""
  if "--debug" in argv[:next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))]: return True
  return tracebacks()


def tracebacks() -> bool:
  """Whether a failing command lets its traceback through (`kiln --debug CMD`, or KILN_DEBUG >= 1): the one answer every
  command's error handler asks, kiln-graph's one-line errors too."""
  from kiln.codegen import settings
  if _debug_flag: return True
  try: return bool(settings.DEBUG.get())
  except KilnError: return False  # a malformed KILN_DEBUG is reported by whatever reads it


def one_line(argv: Sequence[str], e: BaseException) -> tuple[str, int]:
  """A command's failure as the one line it prints and its exit code: 2 for what the user can fix (a kiln error, a setting,
  a file, a value), 1 for anything else (a bug in kiln: the line says how to see the traceback)."""
  cmd = next((a for a in argv if not a.startswith("-")), None)
  msg = str(e).strip() or type(e).__name__
  head = f"kiln{' ' + cmd if cmd else ''}: error: "
  if isinstance(e, KilnError | OSError): return f"{head}{type(e).__name__}: {msg}", 2
  return f"{head}{type(e).__name__}: {msg} (an internal error; kiln --debug {cmd or ''} ... or KILN_DEBUG=1 prints the traceback)", 1


def check_settings() -> None:
  """The settings every command reads (kiln-codegen's and the executor's: KILN_THREADS, KILN_CACHE, ...) read once before it
  starts, so a bad value is the same one-line error whatever the command goes on to do (a model too small to start the
  thread pool never read KILN_THREADS). Other layers' settings are checked where they are read."""
  from kiln.codegen import settings as codegen_settings
  from kiln.executor import settings as executor_settings
  from kiln.ir.settings import declared
  for module in (codegen_settings, executor_settings):
    for s in declared(module): s.get()


def main(argv: Sequence[str] | None = None) -> int:
  """The `kiln` console script (and `python -m kiln`): the exit code; a failure is one line on stderr, no traceback."""
  global _debug_flag
  args = list(sys.argv[1:] if argv is None else argv)
  _debug_flag = "--debug" in args[:next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))]
  try:
    if next((a for a in args if not a.startswith("-")), "info") != "info": check_settings()  # info --settings shows a bad one
    return _main(args)
  except BrokenPipeError:  # `kiln info | head`: a closed pipe is not an error
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  except KeyboardInterrupt:
    print("kiln: interrupted", file=sys.stderr)
    return 130
  except Exception as e:
    if tracebacks(): raise
    line, code = one_line(args, e)
    print(line, file=sys.stderr)
    return code


if __name__ == "__main__": sys.exit(main())
