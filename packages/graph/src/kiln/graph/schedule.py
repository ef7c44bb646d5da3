"""The scheduler: which nodes get a buffer of their own (are *realized*) and become kernels, and the ExecutionPlan built
from them.

Every node that is not realized is inlined into each kernel that reads it (render.py). Starting from the outputs
alone, kernels are rendered and checked; a node that breaks a rule below is realized and the kernels are rendered
again, until no rule is broken. A node's *placement* in a kernel is the set of loops its value is computed under: the
ranges it varies over, plus, where one of them is a reduce range, the placement of the REDUCE that closes it (a value
inside a reduction's body runs once per step of every loop around it); for a REDUCE also every output loop outside
its innermost one. Its *recompute factor* is the trip count of its placement over the trip count of its own ranges.

| rule                                                                                  | why                                             |
|---------------------------------------------------------------------------------------|-------------------------------------------------|
| a REDUCE that varies over another reduction's range (a matmul feeding a reduction)    | nested reductions would recompute it per step   |
| a REDUCE with recompute factor > 1 (a column sum read in a row loop)                   | its whole reduction would run again per element |
| a REDUCE rendered at two different indices in one kernel, or inlined into two kernels  | computed twice                                  |
| an elementwise, gather or concat node with recompute factor > 1 (a GELU feeding a matmul) | recomputed per step of the reduction reading it |

Only the topmost offending node on each path is realized per round (its inputs then fuse into its own kernel), and a
realized REDUCE pulls up with it the chain of same-shape elementwise ops that are its sole consumers (a matmul's bias,
activation and residual become its epilogue, not the next kernel's prologue).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.codegen.spec import DeviceSpec
from kiln.graph.lazy import GraphError, Node, toposort
from kiln.graph.render import Kernel, Renderer
from kiln.ir.analysis import free_ranges_of
from kiln.ir.ops import AxisType, Ops
from kiln.ir.uop import UOp


def consumers(nodes: Sequence[Node]) -> dict[Node, set[Node]]:
  out: dict[Node, set[Node]] = {n: set() for n in nodes}
  for n in nodes:
    for s in n.src: out.setdefault(s, set()).add(n)
  return out


def _trips(rs: set[UOp]) -> int:
  out = 1
  for r in rs: out *= int(r.src[0].arg) if r.src[0].op is Ops.CONST else 1 << 20
  return out


class _Analysis:
  """Placement and recompute factors of the UOps of one kernel."""
  def __init__(self, k: Kernel):
    topo = k.ast.toposort()
    self.free = free_ranges_of(topo)
    self.owner = {r: u for u in topo if u.op is Ops.REDUCE for r in u.src[1:]}
    self.cache: dict[UOp, frozenset[UOp]] = {}

  def placement(self, u: UOp) -> frozenset[UOp]:
    if (hit := self.cache.get(u)) is not None: return hit
    out = set(self.free.get(u, frozenset()))
    for r in list(out):
      if r.arg[1] is AxisType.REDUCE and r in self.owner: out |= self.placement(self.owner[r]) | set(self.owner[r].src[1:])
    if u.op is Ops.REDUCE:
      loops = [r.arg[0] for r in out if r.arg[1] is AxisType.LOOP]
      if loops:
        top = max(loops)
        out |= {r for r in self.free_all_loops() if r.arg[0] < top}
    self.cache[u] = res = frozenset(out)
    return res

  def free_all_loops(self) -> set[UOp]:
    return {r for rs in self.free.values() for r in rs if r.arg[1] is AxisType.LOOP}

  def factor(self, u: UOp) -> float: return _trips(set(self.placement(u))) / _trips(set(self.free.get(u, frozenset())))

  def in_reduce_body(self, u: UOp) -> bool: return any(r.arg[1] is AxisType.REDUCE for r in self.free.get(u, frozenset()))


def _offends(n: Node, uops: set[UOp], an: _Analysis, kernels_of: Mapping[Node, int]) -> bool:
  if n.op == "REDUCE":
    reds = [u for u in uops if u.op is Ops.REDUCE]
    if not reds: return False  # a reduction over size-1 axes only is its source
    return len(reds) > 1 or kernels_of.get(n, 0) > 1 or any(an.in_reduce_body(u) or an.factor(u) > 1 for u in reds)
  if n.op in ("ALU", "GATHER", "CAT") and n.arg is not Ops.CAST:
    return any(an.factor(u) > 1 for u in uops if u.op is not Ops.CONST)
  return False


def _lift(n: Node, cons: Mapping[Node, set[Node]], realized: set[Node]) -> Node:
  """A REDUCE to realize takes along its epilogue: sole consumers that are elementwise of the same shape."""
  if n.op != "REDUCE": return n
  while len(c := cons.get(n, set())) == 1:
    p = next(iter(c))
    if p in realized or not (p.op == "ALU" and p.shape == n.shape or p.op == "VIEW" and p.arg[0] == "reshape"): break
    n = p
  while n.op == "VIEW" and n.src: n = n.src[0]  # a trailing reshape stays a view of the buffer
  return n


def _name(n: Node, i: int) -> str:
  kinds = {m.op for m in n.toposort()}
  tag = "reduce" if "REDUCE" in kinds else "gather" if "GATHER" in kinds else "elementwise"
  return f"g{i}_{tag}"


def _offenders(kernels: Mapping[Node, Kernel], cons: Mapping[Node, set[Node]], realized: set[Node],
               kernels_of: Mapping[Node, int] | None) -> set[Node]:
  new: set[Node] = set()
  for k in kernels.values():
    if k.analysis is None: k.analysis = _Analysis(k)
    an = k.analysis
    stack, seen = [k.node], {k.node}
    while stack:  # top-down: the first offender on each path
      n = stack.pop()
      if n is not k.node and (n in k.offenders or n in k.rendered and _offends(n, k.rendered[n], an, kernels_of or {})):
        new.add(_lift(n, cons, realized))
        continue
      for s in n.src:
        if s not in seen and s not in realized and s.op != "BUFFER" and (s in k.rendered or s in k.offenders):
          seen.add(s); stack.append(s)
  return new - realized


def schedule(outputs: Sequence[Node], fuse: bool = True, max_rounds: int = 1000) -> list[Kernel]:
  """Kernels computing every output (and every node the rules realize), in an order that respects their reads."""
  nodes = toposort(list(outputs))
  order = {n: i for i, n in enumerate(nodes)}
  cons = consumers(nodes)
  realized: set[Node] = {o for o in outputs} | {n for n in nodes if n.realize and n.op != "BUFFER"}
  for o in outputs:
    if o.op == "BUFFER": raise GraphError("schedule: an output that is a BUFFER needs a copy node (compile() adds one)")
  if not fuse: realized |= {n for n in nodes if n.op in ("ALU", "REDUCE", "GATHER", "CAT")}
  kernels: dict[Node, Kernel] = {}
  for _ in range(max_rounds):
    for n in sorted(realized, key=order.__getitem__):  # a kernel is rendered again only when a node it inlined got realized
      if n.op != "BUFFER" and (n not in kernels or any(m in realized for m in kernels[n].rendered if m is not n)):
        kernels[n] = Renderer(n, realized).kernel(_name(n, order[n]))
    kernels_of: dict[Node, int] = {}
    for k in kernels.values():
      for n in k.rendered:
        if n is not k.node: kernels_of[n] = kernels_of.get(n, 0) + 1
    new = _offenders(kernels, cons, realized, None)
    if not new:  # a REDUCE inlined into several kernels is judged only once everything else is settled
      new = _offenders(kernels, cons, realized, kernels_of)
    if not new: return [kernels[n] for n in sorted(kernels, key=order.__getitem__)]
    realized |= new
  raise GraphError(f"schedule: no fixed point after {max_rounds} rounds")


@dataclass
class _Input:
  name: str; buf: int; shape: tuple[int, ...]; dtype: np.dtype


class Compiled:
  """A graph compiled to an ExecutionPlan: `run(feeds)` copies the inputs in, executes, and returns the outputs."""

  def __init__(self, plan, inputs: list[_Input], outputs: list[tuple[int, tuple[int, ...]]], kernels: list[Kernel]):  # type: ignore[no-untyped-def]
    self.plan, self.inputs, self.outputs, self.kernels = plan, inputs, outputs, kernels

  @property
  def kernel_count(self) -> int: return len(self.plan.kernels)

  def run(self, feeds: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
    self._feed(feeds)
    self.plan.execute()
    return self._outputs()

  def run_profiled(self, feeds: Mapping[str, np.ndarray] | None = None) -> tuple[list[np.ndarray], Any]:
    """run, kernel by kernel with each one timed: (outputs, the plan's Profile)."""
    self._feed(feeds)
    prof = self.plan.execute_profiled()
    return self._outputs(), prof

  def _feed(self, feeds: Mapping[str, np.ndarray] | None) -> None:
    feeds = dict(feeds or {})
    for i in self.inputs:
      if i.name not in feeds: raise GraphError(f"input {i.name!r} (shape {i.shape}, {i.dtype}) was not fed")
      a = np.asarray(feeds[i.name])
      if tuple(a.shape) != i.shape: raise GraphError(f"input {i.name!r} has shape {tuple(a.shape)}, the graph was compiled for {i.shape}")
      if a.dtype != i.dtype:
        if a.dtype.kind != i.dtype.kind and not (a.dtype.kind in "iu" and i.dtype.kind in "iu"):
          raise GraphError(f"input {i.name!r} has dtype {a.dtype}, the graph takes {i.dtype}")
        a = a.astype(i.dtype)
      self.plan.buffers[i.buf].copyin(np.ascontiguousarray(a))

  def _outputs(self) -> list[np.ndarray]:
    return [self.plan.buffers[b].numpy()[:int(np.prod(s, dtype=np.int64))].reshape(s).copy() for b, s in self.outputs]


def compile_nodes(outputs: Sequence[Node], device: str = "CPU", fuse: bool = True) -> Compiled:
  from kiln.executor import Buffer, ExecutionPlanBuilder
  device = str(DeviceSpec.parse(device))
  outs = [Node("VIEW", (o,), ("reshape", o.shape), o.shape, o.dtype) if o.op == "BUFFER" else o for o in outputs]
  uniq = list(dict.fromkeys(outs))
  kernels = schedule(uniq, fuse)
  pb = ExecutionPlanBuilder(device)
  bufs: dict[Node, int] = {}
  inputs: dict[str, _Input] = {}
  def buf_of(n: Node) -> int:
    if n in bufs: return bufs[n]
    if n.op == "BUFFER" and n.arg.data is not None: b = Buffer.from_numpy(np.ascontiguousarray(n.arg.data), device, n.dtype)  # bf16: uint16 in numpy
    else: b = Buffer(device, n.numel, n.dtype)
    bufs[n] = pb.add_buffer(b)
    if n.op == "BUFFER" and n.arg.name is not None:
      if (prev := inputs.get(n.arg.name)) is not None: raise GraphError(f"two inputs are named {n.arg.name!r} ({prev.shape} and {n.shape})")
      inputs[n.arg.name] = _Input(n.arg.name, bufs[n], n.shape, n.dtype.np)
    return bufs[n]
  for k in kernels: pb.add_kernel(k.ast, [buf_of(s) for s in k.slots])
  pb.set_outputs(list(dict.fromkeys(bufs[o] for o in uniq)))
  plan = pb.build()
  return Compiled(plan, list(inputs.values()), [(bufs[o], o.shape) for o in outs], kernels)
