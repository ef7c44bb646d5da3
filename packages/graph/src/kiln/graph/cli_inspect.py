"""`kiln inspect model.onnx [--build] [--dims name=N] [--device CPU]`: what is inside an ONNX model and what kiln makes of it.

Without compiling anything: the producer, IR version and opsets, the inputs and outputs with their dims (a symbolic dim
by its name; one with no name as INPUT:AXIS, the key --dims takes), the op census (nodes per operator type, subgraphs
included) with each operator marked as kiln supports it or not, and every node kiln would refuse at load, all of them at
once (the check kiln.graph.onnx.load makes). `--build` then loads and compiles the model (symbolic dims: their --dims
value, else random_feeds.DEFAULT_DIM) and adds the kernel count, the plans' peak buffer memory, and the ONNX nodes each
kernel covers (onnx_profile.py). Exit code 0 whether or not kiln supports the model; bad input is one line and code 2.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from kiln.graph import cli_args, model_info, onnx_profile, random_feeds


def _describe(onnx: Any, m: Any, path: str) -> list[str]:
  from kiln.graph.onnx_ops import OPS
  producer = " ".join(x for x in (m.producer_name, m.producer_version) if x) or "unknown"
  ops = ", ".join(f"{d} {v}" for d, v in model_info.opsets(m).items())
  lines = [f"{path}", f"  producer: {producer}; IR version {m.ir_version}; opsets: {ops or 'none'}",
           f"  graph: {m.graph.name or '-'}, {len(m.graph.node)} nodes, {len(m.graph.initializer)} initializers"]
  for what, vals in (("inputs", model_info.inputs(onnx, m)), ("outputs", model_info.outputs(onnx, m))):
    lines.append(f"  {what}:")
    lines += [f"    {d.shown()}" for d in vals] or ["    none"]
  counts = model_info.census(m)
  lines.append(f"  operators ({len(counts)} types, {sum(counts.values())} nodes; * kiln has no converter):")
  w = max([len(op) for op in counts] + [1])
  lines += [f"    {op:<{w}} {n:>5}{'' if op in OPS else '  *'}" for op, n in sorted(counts.items(), key=lambda t: (-t[1], t[0]))]
  return lines


def _build(args: argparse.Namespace, m: Any, directory: str | None) -> list[str]:
  from kiln.graph import onnx as konnx
  declared = model_info.inputs(konnx._onnx(), m)
  given = cli_args.model_dims(args.dims, declared)
  _, defaulted = random_feeds.sizes(declared, given)
  dims = {**given, **defaulted}
  t = time.perf_counter()
  model = konnx.load(m, device=args.device, dims=dims, directory=directory, progress=True)
  ms = (time.perf_counter() - t) * 1e3
  plans = model.plans
  at = f" at {', '.join(f'{k}={v}' for k, v in dims.items())}" if dims else ""
  lines = [f"  built{at} in {ms:.0f} ms: {sum(len(p.kernels) for p in plans)} kernels in {len(plans)} plan{'s' if len(plans) != 1 else ''}, "
           f"peak buffer memory {sum(p.memory_bytes for p in plans) / 1e6:.2f} MB"]
  nodes = onnx_profile.nodes_of(model)
  if nodes is None:
    lines.append("  (a model that branches or specialises at run time: its kernels are not mapped to ONNX nodes)" if plans else
                 "  every output is a constant: no kernels")
    return lines
  lines.append("  kernels and the ONNX nodes each covers:")
  names = {k.id: k.kernel.entry_point for k in model.plan.kernels}
  w = max([len(n) for n in names.values()] + [6])
  for op, (covered, _) in sorted(nodes.items()):
    lines.append(f"    {op:>4}  {names.get(op, '?'):<{w}}  {onnx_profile.names(covered)}")
  return lines


def inspect(args: argparse.Namespace) -> int:
  from kiln.graph import onnx as konnx
  if args.build: cli_args.probe_device(args.device)  # before anything prints: a bad --device is the one line
  m, directory = konnx.read(args.model)  # every size and file check load makes, and onnx.checker
  lines = _describe(konnx._onnx(), m, args.model)
  bad = model_info.refused(m)
  lines.append(f"  kiln: {'supports every node (subgraphs are checked as they convert)' if not bad else f'refuses {len(bad)} node(s):'}")
  lines += [f"    {b}" for b in bad]
  print("\n".join(lines))
  if args.build and not bad:
    cli_args.set_threads(args.threads)
    print("\n".join(_build(args, m, directory)))
  elif args.build: print("  --build: not built (kiln refuses the nodes above)")
  return 0


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="kiln inspect", description="What an ONNX model holds and what kiln makes of it: inputs, outputs, "
                                                                  "opsets, op census, every node kiln would refuse; --build adds its kernels.")
  ap.add_argument("model", help="the .onnx file")
  ap.add_argument("--build", "-b", action="store_true", help="also compile it: kernel count, peak memory, the ONNX nodes each kernel covers")
  ap.add_argument("--dims", "-d", action="append", default=[], metavar="NAME=N",
                  help=f"with --build: the size of a symbolic input dim (repeat; default {random_feeds.DEFAULT_DIM})")
  ap.add_argument("--threads", "-t", type=int, metavar="N", help="with --build: CPU threads kiln uses (sets KILN_THREADS)")
  ap.add_argument("--device", default="CPU", help="with --build: the device to compile for (default CPU)")
  return ap


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  return cli_args.guarded("kiln inspect", lambda: inspect(args))
