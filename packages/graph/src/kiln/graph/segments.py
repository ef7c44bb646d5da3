"""One segment of a Program (program.py): a Tensor graph compiled to an ExecutionPlan whose inputs and outputs are
buffers the caller owns, so that segments hand values to each other in device memory, with no copy between them.

It is schedule.compile_nodes, through the same GraphPlan, with these differences: a BUFFER node found in `bound` reads
that buffer (a value an earlier segment wrote, or a model input), and output i is written straight into `out_bufs[i]`
(an output that is a BUFFER, or a node given twice, is first copied by a kernel). Constant BUFFERs (weights) are shared
through `Weights`: an array two segments read is one buffer on the device.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.executor.checks import CheckReader
from kiln.graph.dims import capped_names, check_sizes, with_capped
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, Node
from kiln.graph.schedule import GraphPlan


class Weights:
  """The device buffers of constant arrays, one per array however many segments read it (the array is kept alive with it).

  A specialisation's continuation (specialise.py) has Weights of its own, dropped with it when its cache lets it go, over
  its parent's: an array the parent already holds, or one of `shared` (the ids of the arrays the graph held where it was
  cut: initializers, the same in every continuation), is the parent's, so no continuation copies the model's weights."""

  def __init__(self, device: str, parent: Weights | None = None, shared: frozenset[int] = frozenset()):
    self.device, self.parent, self.shared = device, parent, shared
    self._bufs: dict[int, tuple[np.ndarray, Any]] = {}

  def _find(self, key: int) -> tuple[np.ndarray, Any] | None:
    hit = self._bufs.get(key)
    return hit if hit is not None or self.parent is None else self.parent._find(key)

  def buffer(self, n: Node) -> Any:
    from kiln.executor import Buffer
    data = n.data
    assert data is not None
    if (hit := self._find(id(data))) is not None: return hit[1]  # its array is alive in hit: the id is this array's
    if self.parent is not None and id(data) in self.shared: return self.parent.buffer(n)
    hit = self._bufs[id(data)] = (data, Buffer.from_numpy(np.ascontiguousarray(data), self.device, n.dtype))  # bf16: uint16 in numpy
    return hit[1]


class Segment:
  """A compiled segment: `run(vals)` executes its plan with the model's dims and raises a failed run-time check."""

  def __init__(self, plan: Any, checks: Sequence[tuple[int, str]], kernels: list[Any], sizes: Sequence[Any] = ()):
    self.plan, self.kernels, self.sizes = plan, kernels, list(sizes)  # sizes: dims the bounds do not prove >= 0 (GraphPlan.sizes)
    self._checks = CheckReader(plan.buffers, checks)
    self._vars = bool(plan.var_bounds)
    self._capped = capped_names(plan.var_bounds)  # bound from their sources' values each run (dims.capped)

  def run(self, vals: Mapping[str, int], prof: list[Any] | None = None) -> None:
    if self._capped: vals = with_capped(vals, self._capped)
    check_sizes(self.sizes, vals)
    if prof is None:
      if self._vars: self.plan.execute_with_vars(vals)
      else: self.plan.execute()
    else:
      if self._vars: self.plan.set_vars(vals)
      prof.extend(self.plan.execute_profiled())
    self._checks.raise_failed(IndexOutOfRangeError)


def compile_segment(outputs: Sequence[Node], out_bufs: Sequence[Any], bound: Mapping[Node, Any], weights: Weights) -> Segment:
  """The plan computing outputs[i] into out_bufs[i], reading bound[b] for every BUFFER node b of the graph in bound."""
  def buffer_for(n: Node) -> Any:
    if n in bound: return bound[n]
    if n.data is not None: return weights.buffer(n)
    if n.op == "BUFFER": raise GraphError(f"segment: input {n} has no buffer")  # every input is bound: a bug, not the model's
    return None
  g = GraphPlan(outputs, weights.device, out_bufs=out_bufs, buffer_for=buffer_for)
  return Segment(g.builder.build(), g.checks, g.kernels, g.sizes)
