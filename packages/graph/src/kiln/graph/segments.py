"""One segment of a Program (program.py): a Tensor graph compiled to an ExecutionPlan whose inputs and outputs are
buffers the caller owns, so that segments hand values to each other in device memory, with no copy between them.

It is schedule.compile_nodes (keep the two alike) with two differences: a BUFFER node found in `bound` reads that buffer (a value an earlier
segment wrote, or a model input), and output i is written straight into `out_bufs[i]` (an output that is a BUFFER, or a
node given twice, is first copied by a kernel, as compile_nodes copies a BUFFER output). Constant BUFFERs (weights) are
shared through `Weights`: an array two segments read is one buffer on the device.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.executor.checks import CheckReader
from kiln.graph.dims import fmt_shape, is_static
from kiln.graph.epilogue import fuse_epilogues
from kiln.graph.index_check import gather_checks
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, Node, toposort
from kiln.graph.schedule import _reassociated_opts, aligned_windows, precompile, schedule
from kiln.graph.windows import Window, read_windows
from kiln.ir.dtype import DType, dtypes


class Weights:
  """The device buffers of constant arrays, one per array however many segments read it (the array is kept alive with it)."""

  def __init__(self, device: str):
    self.device = device
    self._bufs: dict[int, tuple[np.ndarray, Any]] = {}

  def buffer(self, n: Node) -> Any:
    from kiln.executor import Buffer
    data = n.data
    assert data is not None
    if (hit := self._bufs.get(id(data))) is None:
      hit = self._bufs[id(data)] = (data, Buffer.from_numpy(np.ascontiguousarray(data), self.device, n.dtype))  # bf16: uint16 in numpy
    return hit[1]


class Segment:
  """A compiled segment: `run(vals)` executes its plan with the model's dims and raises a failed run-time check."""

  def __init__(self, plan: Any, checks: Sequence[tuple[int, str]], kernels: list[Any]):
    self.plan, self.kernels = plan, kernels
    self._checks = CheckReader(plan.buffers, checks)
    self._vars = bool(plan.var_bounds)

  def run(self, vals: Mapping[str, int], prof: list[Any] | None = None) -> None:
    if prof is None:
      if self._vars: self.plan.execute_with_vars(vals)
      else: self.plan.execute()
    else:
      if self._vars: self.plan.set_vars(vals)
      prof.extend(self.plan.execute_profiled())
    self._checks.raise_failed(IndexOutOfRangeError)


def _copy(n: Node) -> Node: return Node("VIEW", (n,), ("reshape", n.shape), n.shape, n.dtype)


def compile_segment(outputs: Sequence[Node], out_bufs: Sequence[Any], bound: Mapping[Node, Any], weights: Weights) -> Segment:
  """The plan computing outputs[i] into out_bufs[i], reading bound[b] for every BUFFER node b of the graph in bound."""
  from kiln.codegen.registry import get_runtime
  from kiln.executor import Buffer, ExecutionPlanBuilder
  device = weights.device
  outs: list[Node] = []
  for o in outputs: outs.append(_copy(o) if o.op == "BUFFER" or o in outs else o)
  new = fuse_epilogues(outs)
  outs = [new[o] for o in outs]
  checks = gather_checks(toposort(outs))
  uniq = list(dict.fromkeys([*(c for c, _ in checks), *outs]))
  try: kernels = schedule(uniq)
  except RecursionError:
    raise GraphError(f"the graph is too deep to render ({len(toposort(uniq))} nodes): a chain of a few hundred elementwise ops fused into "
                     "one kernel reaches Python's recursion limit") from None
  pb = ExecutionPlanBuilder(device)
  bufs: dict[Node, int] = {o: pb.add_buffer(b) for o, b in zip(outs, out_bufs)}

  def buf_of(n: Node) -> int:
    if n in bufs: return bufs[n]
    if n in bound: b = bound[n]
    elif n.data is not None: b = weights.buffer(n)
    else:
      if n.max_numel > dtypes.index.max and not is_static(n.shape):  # as compile_nodes: kernels index in int32
        raise GraphError(f"a {n.op} node of shape {fmt_shape(n.shape)} has {n.max_numel} elements at the dims' upper bounds, more than a "
                         f"{dtypes.index.name} index reaches ({dtypes.index.max}): lower the bounds")
      if n.op == "BUFFER": raise GraphError(f"segment: input {n} has no buffer")  # every input is bound: a bug, not the model's
      b = Buffer(device, n.max_numel, n.dtype)
    bufs[n] = pb.add_buffer(b)
    return bufs[n]
  views: dict[tuple[int, Window], int] = {}

  def view_of(base: int, w: Window, dtype: DType) -> int:
    if (base, w) not in views:
      views[base, w] = pb.add_buffer(Buffer(device, w[1], dtype))
      pb.add_view(views[base, w], base, w[0] * dtype.itemsize, w[1] * dtype.itemsize)
    return views[base, w]
  rt = get_runtime(device)
  align = int(getattr(rt, "view_align", 1))  # as compile_nodes: CUDA's tiled matmul wants its views' starts aligned
  placed = []
  for k in kernels:
    ast, wins = read_windows(k.ast)
    if align > 1: ast, wins = aligned_windows(ast, wins, [s.dtype.itemsize for s in k.slots], align)
    placed.append((k, ast, wins, _reassociated_opts(ast, device)))
  precompile([(ast, opts) for _, ast, _, opts in placed], device, int(getattr(rt, "compile_threads", 1)))
  for k, ast, wins, opts in placed:
    slots = [view_of(buf_of(s), wins[i], s.dtype) if i in wins else buf_of(s) for i, s in enumerate(k.slots)]
    pb.add_kernel(ast, slots, opts=opts)
  pb.set_outputs(list(dict.fromkeys(bufs[o] for o in uniq)))
  return Segment(pb.build(), [(bufs[c], m) for c, m in checks], kernels)
