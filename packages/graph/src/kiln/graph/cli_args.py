"""What kiln-graph's commands (`kiln run`, `kiln bench`, `kiln inspect`) share: the model's feeds from --input files and
--random, --dims, --threads, --device, and the one-line error with exit code 2 that every bad input ends in. What can be
checked without converting the model is checked first: --device is parsed and its runtime started (probe_device), and
--dims names are checked against the model's declared dims (model_dims), before any feed is made or the model loads.

A .npy file is untrusted (no pickles, never a FIFO). Symbolic dims not given with --dims are taken from the fed arrays,
else (random feeds) random_feeds.DEFAULT_DIM. `--threads N` sets KILN_THREADS for the process before any kernel runs: the
CPU runtime sizes its pool once, at its first plan.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.codegen import settings
from kiln.graph import model_info, random_feeds
from kiln.graph.feeds import FeedError, check_dims, did_you_mean
from kiln.graph.lazy import GraphError
from kiln.ir.errors import KilnError
from kiln.ir.files import open_regular


class UsageError(Exception):
  """Bad command-line input: printed as one line, exit code 2."""


def pairs(items: Sequence[str], what: str) -> list[tuple[str, str]]:
  out = []
  for it in items:
    name, eq, val = it.partition("=")
    if not eq or not name or not val: raise UsageError(f"{what} takes NAME=VALUE, got {it!r}")
    out.append((name, val))
  return out


def read_inputs(items: Sequence[str]) -> dict[str, np.ndarray]:
  feeds: dict[str, np.ndarray] = {}
  for name, path in pairs(items, "--input"):
    if name in feeds: raise UsageError(f"input {name!r} is given twice")
    p = Path(path)
    fd = open_regular(p, f"input {name!r}: the file", UsageError)  # a FIFO would hang np.load
    try:
      with os.fdopen(fd, "rb") as f: a = np.load(f, allow_pickle=False)  # a .npy file is untrusted: no pickles
    except Exception as e: raise UsageError(f"input {name!r}: {path} is not a readable .npy file ({type(e).__name__}: {e})") from e
    if not isinstance(a, np.ndarray): raise UsageError(f"input {name!r}: {path} holds several arrays (an .npz); give one .npy per input")
    feeds[name] = a
  return feeds


def dims(items: Sequence[str]) -> dict[str, int]:
  out = {}
  for name, val in pairs(items, "--dims"):
    try: n = int(val)
    except ValueError: raise UsageError(f"--dims {name}={val}: the size must be an integer") from None
    if n < 1: raise UsageError(f"--dims {name}={val}: the size must be >= 1")
    out[name] = n
  return out


def model_dims(items: Sequence[str], declared: Sequence[model_info.Declared]) -> dict[str, int]:
  """--dims, each name a symbolic dim the model's inputs declare (load's check, made before any feed: a typo is the first
  line, not one after the made-up feeds)."""
  given = dims(items)
  try: check_dims(given, [x for d in declared for x in d.dims or () if isinstance(x, str)])
  except FeedError as e: raise UsageError(f"--{e}") from None  # 'dims names ...': the option the user typed
  return given


def check_feeds(inputs: Sequence[model_info.Declared], feeds: Mapping[str, np.ndarray], given: Mapping[str, int]) -> dict[str, int]:
  """Names and ranks checked before anything compiles; symbolic dims not given with --dims are taken from the fed arrays."""
  names = [d.name for d in inputs]
  for k in feeds:
    if k not in names: raise UsageError(f"the model has no input {k!r}{did_you_mean(k, names)} (its inputs: {', '.join(names) or 'none'})")
  out = dict(given)
  for d in inputs:
    shape = d.dims or ()
    if d.name not in feeds:
      raise UsageError(f"input {d.name!r} (shape {tuple(shape)}) is not given: --input {d.name}=FILE.npy, or --random for made-up values")
    a = feeds[d.name]
    if a.ndim != len(shape): raise UsageError(f"input {d.name!r} has shape {a.shape}, the model takes rank {len(shape)} {tuple(shape)}")
    for i, (x, got) in enumerate(zip(shape, a.shape)):
      if isinstance(x, str):
        want = out.setdefault(x, int(got))
        if want != got: raise UsageError(f"input {d.name!r} dim {i} ({x}) is {got}, but {x} = {want}")
      elif x != got: raise UsageError(f"input {d.name!r} has shape {a.shape}, the model takes {tuple(shape)}")
  return out


def feeds(onnx: Any, proto: Any, args: argparse.Namespace, random: bool) -> tuple[dict[str, np.ndarray], dict[str, int], list[str]]:
  """The model's feeds and dims from --input, --dims and (random) made-up values for the inputs not given: (feeds, dims,
  one line per made feed saying what it holds, the defaulted dims first)."""
  declared = model_info.inputs(onnx, proto)
  given, fed = model_dims(args.dims, declared), read_inputs(args.input)
  notes: list[str] = []
  if random:
    known = dict(given)
    for d in declared:  # a dim a given file fixes sizes the made-up inputs too
      if d.name in fed and d.dims is not None and len(d.dims) == fed[d.name].ndim:
        for x, got in zip(d.dims, fed[d.name].shape):
          if isinstance(x, str): known.setdefault(x, int(got))
    todo = [d for d in declared if d.name not in fed]
    try:
      shapes, defaulted = random_feeds.sizes(todo, known)
      tables = model_info.gather_tables(proto)
      made = random_feeds.make(todo, shapes, tables)
    except random_feeds.FeedError as e: raise UsageError(str(e)) from None
    if defaulted: notes.append("symbolic dims not given with --dims: " + ", ".join(f"{k}={v}" for k, v in defaulted.items()))
    notes += random_feeds.describe(declared, made, tables)
    fed = {**fed, **made}
  return fed, check_feeds(declared, fed, given), notes


def set_threads(n: int | None) -> None:
  """--threads: kiln's CPU threads (KILN_THREADS), read when the CPU runtime starts its pool."""
  if n is None: return
  if n < 1: raise UsageError(f"--threads {n}: must be >= 1")
  settings.THREADS.set(n)


def probe_device(device: str) -> None:
  """--device parsed and its runtime started (cached for the load) before the model is read: a name that is no device
  (FOO) or a device with no runtime here (CUDA without its driver) is one line at once, not after the whole conversion."""
  from kiln.codegen.registry import get_runtime
  get_runtime(device)  # a DeviceError names the device and what it lacks: guarded() prints its first line


def add_model_args(ap: argparse.ArgumentParser) -> None:
  """The arguments every model command takes: the model, --input, --dims, --threads, --device."""
  ap.add_argument("model", help="the .onnx file (external data files beside it are mapped, not read)")
  ap.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy", help="one model input from a .npy file (repeat)")
  ap.add_argument("--dims", "-d", action="append", default=[], metavar="NAME=N",
                  help="the size of a symbolic input dim, an unnamed one as INPUT:AXIS (repeat; default: taken from the input arrays, "
                       f"else {random_feeds.DEFAULT_DIM} for made-up inputs)")
  ap.add_argument("--threads", "-t", type=int, metavar="N", help="CPU threads kiln uses (sets KILN_THREADS; default: this process's physical cores)")
  ap.add_argument("--device", default="CPU", help="the device to run on (default CPU)")


def guarded(prog: str, fn: Callable[[], int]) -> int:
  """fn's exit code, or bad input as one line `PROG: error: ...` on stderr and exit code 2 (`kiln --debug` or KILN_DEBUG=1:
  the traceback instead, as the kiln command decides for every command)."""
  from kiln.executor.cli import tracebacks
  try: return fn()
  except BrokenPipeError: raise  # `kiln inspect m.onnx | head`: the kiln command's own handler makes it quiet
  except (UsageError, KilnError, OSError) as e:
    if tracebacks(): raise
    print(f"{prog}: error: {_message(e)}", file=sys.stderr)
    return 2


def _message(e: Exception) -> str:
  if isinstance(e, UsageError | GraphError): return str(e)  # ONNXError too: the model cannot be loaded, or a feed does not fit it
  if isinstance(e, KilnError): return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"  # a layer below
  return f"{type(e).__name__}: {e}"  # --out not writable, a file vanished
