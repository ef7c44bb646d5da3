"""`kiln run model.onnx --input NAME=FILE.npy ... [--dims name=N] [--profile] [--out DIR]`: an ONNX model on kiln from the
command line. Registered with the `kiln` command through the entry-point group `kiln.commands` (kiln-executor's CLI finds
it installed; the executor never imports kiln.graph).

Prints each output's shape, dtype and statistics (min, max, mean); `--out DIR` also writes each output as DIR/NAME.npy;
`--profile` runs once more kernel by kernel and prints the per-kernel profile. A model with a run-time If runs several
plans (kiln.graph.program): the kernel count sums them all, the profile lists the kernels of the branches taken; so does
one with a shape computed at run time, compiled from there on for each value (kiln.graph.specialise). A
symbolic dim with no name is given as INPUT:AXIS (`--dims x:0=4`), as kiln.graph.onnx.load takes it. Bad input (a
missing or unreadable file, an unknown input name, a wrong shape or dtype, a model kiln cannot load) is one line on
stderr and exit code 2, no traceback.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.graph.lazy import GraphError
from kiln.ir.errors import KilnError
from kiln.ir.files import open_regular


class UsageError(Exception):
  """Bad command-line input: printed as one line, exit code 2."""


def _pairs(items: Sequence[str], what: str) -> list[tuple[str, str]]:
  out = []
  for it in items:
    name, eq, val = it.partition("=")
    if not eq or not name or not val: raise UsageError(f"{what} takes NAME=VALUE, got {it!r}")
    out.append((name, val))
  return out


def _read_inputs(items: Sequence[str]) -> dict[str, np.ndarray]:
  feeds: dict[str, np.ndarray] = {}
  for name, path in _pairs(items, "--input"):
    if name in feeds: raise UsageError(f"input {name!r} is given twice")
    p = Path(path)
    fd = open_regular(p, f"input {name!r}: the file", UsageError)  # a FIFO would hang np.load
    try:
      with os.fdopen(fd, "rb") as f: a = np.load(f, allow_pickle=False)  # a .npy file is untrusted: no pickles
    except Exception as e: raise UsageError(f"input {name!r}: {path} is not a readable .npy file ({type(e).__name__}: {e})") from e
    if not isinstance(a, np.ndarray): raise UsageError(f"input {name!r}: {path} holds several arrays (an .npz); give one .npy per input")
    feeds[name] = a
  return feeds


def _dims(items: Sequence[str]) -> dict[str, int]:
  out = {}
  for name, val in _pairs(items, "--dims"):
    try: n = int(val)
    except ValueError: raise UsageError(f"--dims {name}={val}: the size must be an integer") from None
    if n < 1: raise UsageError(f"--dims {name}={val}: the size must be >= 1")
    out[name] = n
  return out


def _model_inputs(m: object) -> list[tuple[str, list[int | str]]]:
  """The model's graph inputs (not initializers) and their dims, a name for a symbolic one: its dim_param, or for a dim
  with no name (or a declared -1) its input's name and axis, "x:0", the key kiln.graph.onnx.load takes it by."""
  g = m.graph  # type: ignore[attr-defined]
  inits = {i.name for i in g.initializer}
  return [(vi.name, [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else (d.dim_param or f"{vi.name}:{i}")
                     for i, d in enumerate(vi.type.tensor_type.shape.dim)])
          for vi in g.input if vi.name not in inits]


def _check_feeds(inputs: list[tuple[str, list[int | str]]], feeds: dict[str, np.ndarray], dims: dict[str, int]) -> dict[str, int]:
  """Names and ranks checked before anything compiles; symbolic dims not given with --dims are taken from the fed arrays."""
  names = [n for n, _ in inputs]
  for k in feeds:
    if k not in names: raise UsageError(f"the model has no input {k!r} (its inputs: {', '.join(names) or 'none'})")
  dims = dict(dims)
  for name, shape in inputs:
    if name not in feeds: raise UsageError(f"input {name!r} (shape {tuple(shape)}) is not given: --input {name}=FILE.npy")
    a = feeds[name]
    if a.ndim != len(shape): raise UsageError(f"input {name!r} has shape {a.shape}, the model takes rank {len(shape)} {tuple(shape)}")
    for i, (d, got) in enumerate(zip(shape, a.shape)):
      if isinstance(d, str):
        want = dims.setdefault(d, int(got))
        if want != got: raise UsageError(f"input {name!r} dim {i} ({d}) is {got}, but {d} = {want}")
      elif d != got: raise UsageError(f"input {name!r} has shape {a.shape}, the model takes {tuple(shape)}")
  return dims


def _stats(a: np.ndarray) -> str:
  if a.size == 0: return "empty"
  v = a.astype(np.float64) if a.dtype.kind in "biuf" else None
  if v is None: return f"dtype {a.dtype} (no statistics)"
  fin = np.isfinite(v)
  extra = "" if fin.all() else f", {int((~fin).sum())} not finite"
  v = v[fin] if not fin.all() and fin.any() else v
  return f"min {v.min():.6g}  max {v.max():.6g}  mean {v.mean():.6g}{extra}"


def _file_name(name: str) -> str:
  """An output name as a safe file name (ONNX names may hold '/', ':' or be '..')."""
  safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")
  return (safe or "output") + ".npy"


def run(args: argparse.Namespace) -> int:
  from kiln.graph import onnx as konnx
  feeds = _read_inputs(args.input)
  proto, directory = konnx.read(args.model)  # read once, through every size and file check
  dims = _check_feeds(_model_inputs(proto), feeds, _dims(args.dims))
  t0 = time.perf_counter()
  model = konnx.load(proto, device=args.device, dims=dims, directory=directory)
  t1 = time.perf_counter()
  outs = model.run(feeds)
  t2 = time.perf_counter()
  plans = model.plans  # one, or a program's segments (a run-time If: both sides of each branch; a specialisation: those compiled so far)
  counts = [len(p.kernels) for p in plans]
  what = "both sides of its run-time branches" if model.program is None or not model.program.specialisations() else \
    "its segments, and the rest of the model compiled for the values this run computed"
  where = f" in {len(plans)} plans ({' + '.join(map(str, counts))}: {what})" if len(plans) > 1 else ""
  print(f"{args.model}: {sum(counts)} kernels{where}, load + compile {(t1 - t0) * 1e3:.0f} ms, run {(t2 - t1) * 1e3:.1f} ms")
  w = max(len(n) for n in outs) if outs else 0
  for name, a in outs.items(): print(f"  {name:<{w}}  {str(a.shape):<16} {a.dtype!s:<8} {_stats(a)}")
  if args.out:
    d = Path(args.out)
    d.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    for name, a in outs.items():
      fn = _file_name(name)
      while fn in used: fn = fn[:-4] + "_.npy"
      used.add(fn)
      np.save(d / fn, a)
      print(f"  wrote {d / fn}")
  if args.profile:
    prof = model.run_profiled(feeds)[1] if plans else None
    if not plans: print("profile: every output is a constant, no kernels ran")
    elif not prof: print("profile: the branches these inputs take run no kernels")
    else:
      taken = ", the branches these inputs take" if len(plans) > 1 else ""
      print(f"\nper-kernel profile (one run, kernel by kernel{taken}; {prof.total_time * 1e3:.2f} ms in kernels):")
      print(prof.table())
  return 0


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="kiln run", description="Run an ONNX model on kiln: load, fuse, compile, run; print the outputs.")
  ap.add_argument("model", help="the .onnx file (external data files beside it are mapped, not read)")
  ap.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy", help="one model input from a .npy file (repeat)")
  ap.add_argument("--dims", "-d", action="append", default=[], metavar="NAME=N",
                  help="the size of a symbolic input dim, an unnamed one as INPUT:AXIS (repeat; default: taken from the input arrays)")
  ap.add_argument("--profile", action="store_true", help="print the per-kernel profile of one more run")
  ap.add_argument("--out", "-o", metavar="DIR", help="write each output to DIR/NAME.npy")
  ap.add_argument("--device", default="CPU", help="the device to run on (default CPU)")
  return ap


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)  # argparse errors exit 2 with a usage line
  try: return run(args)
  except UsageError as e: msg = str(e)
  except GraphError as e: msg = str(e)  # ONNXError too: the model cannot be loaded, or a feed does not fit it
  except KilnError as e:  # a layer below: device, memory, cache
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
  except OSError as e: msg = f"{type(e).__name__}: {e}"  # --out not writable, a file vanished
  print(f"kiln run: error: {msg}", file=sys.stderr)
  return 2
