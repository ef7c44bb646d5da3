"""A loaded ONNX model's kernels and profiles in the model's own terms: the ONNX nodes each kernel covers (provenance.py),
and a profile's time totalled per ONNX operator type.

A kernel's time is charged to one operator in the totals, its primary node's (provenance.primary: the node whose
reduction it computes, else the first it computes), so the totals add up to the kernels' time; the table's
`kernels` column counts every kernel an operator's nodes took part in, fused or not.

The kernel-to-node map covers a model compiled to one plan. A model that branches or specialises at run time (a Program of
several plans, whose profile's op ids repeat from plan to plan) is profiled without it: `nodes_of` returns None.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from kiln.graph.provenance import Origin, kernel_origins, primary


def nodes_of(model: Any) -> dict[int, tuple[list[Origin], Origin | None]] | None:
  """Plan op id -> (the ONNX nodes the kernel covers, its primary node), for a model with one plan; None otherwise."""
  if model.program is not None or model.compiled is None: return None
  if model.compiled.origins is not None: return dict(model.compiled.origins)  # rebuilt by the plan cache: the entry kept them
  return {k.op_id: (kernel_origins(k), primary(k)) for k in model.compiled.kernels if k.op_id is not None}


def names(origins: Sequence[Origin], width: int = 0) -> str:
  """The nodes as 'name (Op), ...'; cut at width characters with a count of the rest (0: never cut)."""
  parts = [f"{o.name} ({o.op_type})" for o in origins]
  text = ", ".join(parts) or "-"
  if not width or len(text) <= width: return text
  for i in range(len(parts) - 1, 0, -1):
    head = ", ".join(parts[:i]) + f", ... {len(parts) - i} more"
    if len(head) <= width: return head
  return parts[0][:width - 3] + "..."


def table(prof: Sequence[Any], nodes: Mapping[int, tuple[list[Origin], Origin | None]] | None, width: int = 100) -> str:
  """One row per kernel run: its op id, kernel, time, share of the total, rates and the ONNX nodes it covers."""
  total = sum(r.time for r in prof) or 1.0
  w = max([len(r.name) for r in prof] + [6])
  lines = [f"{'op':>4}  {'kernel':<{w}}  {'device':<6}  {'time (us)':>10}  {'%':>5}  {'GFLOP/s':>8}  {'GB/s':>7}  onnx nodes"]
  for r in prof:
    covered = names(nodes[r.op_id][0], width) if nodes and r.op_id in nodes else "?"
    lines.append(f"{r.op_id:>4}  {r.name:<{w}}  {r.device:<6}  {r.time * 1e6:>10.2f}  {100 * r.time / total:>5.1f}  {r.gflops:>8.2f}  "
                 f"{r.gbs:>7.2f}  {covered}")
  lines.append(f"{'':>4}  {'total':<{w}}  {total * 1e6:>10.2f}")
  return "\n".join(lines)


def op_totals(prof: Sequence[Any], nodes: Mapping[int, tuple[list[Origin], Origin | None]]) -> list[tuple[str, float, int, int]]:
  """Per ONNX operator type: (op type, seconds charged to it, kernels its nodes take part in, its nodes in those kernels),
  the most time first. A kernel with no known node is charged to '(none)'."""
  time: dict[str, float] = defaultdict(float)
  kernels: dict[str, int] = defaultdict(int)
  seen: dict[str, set[str]] = defaultdict(set)
  for r in prof:
    covered, main = nodes.get(r.op_id, ([], None))
    time[main.op_type if main is not None else "(none)"] += r.time
    for op in {o.op_type for o in covered}: kernels[op] += 1
    for o in covered: seen[o.op_type].add(o.name)
  ops = set(time) | set(kernels)
  return sorted(((op, time.get(op, 0.0), kernels.get(op, 0), len(seen.get(op, ()))) for op in ops), key=lambda t: (-t[1], t[0]))


def totals_table(prof: Sequence[Any], nodes: Mapping[int, tuple[list[Origin], Origin | None]]) -> str:
  rows = op_totals(prof, nodes)
  total = sum(r.time for r in prof) or 1.0
  w = max([len(op) for op, *_ in rows] + [8])
  lines = [f"{'operator':<{w}}  {'time (us)':>10}  {'%':>5}  {'kernels':>7}  {'nodes':>5}"]
  for op, t, k, n in rows: lines.append(f"{op:<{w}}  {t * 1e6:>10.2f}  {100 * t / total:>5.1f}  {k:>7}  {n:>5}")
  return "\n".join(lines)


def chrome_trace(prof: Sequence[Any], nodes: Mapping[int, tuple[list[Origin], Origin | None]] | None) -> dict[str, Any]:
  """kiln.executor's Chrome trace of the profile, each event named by its primary ONNX node and kernel, its args listing
  every ONNX node the kernel covers."""
  from kiln.executor.profile import chrome_trace as plain
  trace = plain(prof)
  for ev, r in zip(trace["traceEvents"], prof):
    if not nodes or r.op_id not in nodes: continue
    covered, main = nodes[r.op_id]
    if main is not None: ev["name"] = f"{main.op_type} {main.name} [{r.name}]"
    ev["args"]["onnx_nodes"] = [f"{o.name} ({o.op_type})" for o in covered]
    if main is not None: ev["args"]["onnx_op"] = main.op_type
  return trace
