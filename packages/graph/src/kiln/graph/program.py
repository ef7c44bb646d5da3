"""Run-time control flow: a model as a Program, a list of steps over device buffers, where one ExecutionPlan cannot say
what happens (an ONNX If whose condition is computed at run time).

While the model converts, a run-time branch is recorded, not decided: `Branch` holds its condition, the outer values its
branches read (`captures`), each branch's own graph (`Body`: placeholders for the captures, its outputs, and the branches
inside it), and placeholders for its outputs, which later nodes read like any other Tensor. `build_program` then cuts
each scope (the main graph, each branch) into steps:

| step      | what it runs                                                                                      |
|-----------|---------------------------------------------------------------------------------------------------|
| `Segment` | one compiled plan (segments.py): what the next branch needs (its condition and captures), or the scope's outputs |
| `Switch`  | reads its condition (one element, a host read of a few bytes), then runs one branch's steps       |

Every value that crosses from one step to another is a `Slot`: one device buffer, sized for its dims' upper bounds,
that the producing plan writes and the consuming plans read as they are (bound when they are built: no copy). A
branch's outputs are slots both branches write, so what follows reads them whichever ran. A segment also hands on
every value it computes that a later segment reads (the frontier), so nothing is computed twice; values that depend on
no input (a view of a weight) are recomputed instead. Both branches are compiled once, at load: choosing is a host read
and a Python branch, never a compile. Symbolic dims are the model's: every plan takes the values run() reads off the
fed arrays.

The same steps are where data-dependent shapes would go (NonZero, TopK with a run-time k): a host step between segments
that reads a count back and binds the next segment's runtime variables, as Switch reads its condition.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.executor.portable import in_plan_dtype
from kiln.graph.dims import evaluate, fmt_shape
from kiln.graph.lazy import GraphError, Node, ONNXError, Source, toposort
from kiln.graph.segments import Segment, Weights, compile_segment
from kiln.ir.kernels import Dim


# ---- what the conversion records ----
@dataclass(eq=False)
class Body:
  """A scope's graph: placeholders for the outer values it reads (parallel to its Branch's captures), its outputs, and
  the run-time branches recorded while it converted, in order."""
  inputs: list[Node] = field(default_factory=list)
  outputs: list[Node] = field(default_factory=list)
  branches: list[Branch] = field(default_factory=list)
  refused: str | None = None  # why it could not be converted: a run that takes it raises this (ONNXError), as onnxruntime fails then


@dataclass(eq=False)
class Branch:
  """An If whose condition is known only at run time."""
  label: str
  cond: Node
  captures: list[Node]
  then: Body
  else_: Body
  outs: list[Node]  # placeholders of its outputs in the enclosing scope


def placeholder(shape: tuple[Dim, ...], dtype: Any) -> Node:
  """A value another step computes: a BUFFER with neither data nor a name (bound to its slot when a segment is built)."""
  return Node("BUFFER", (), Source(), shape, dtype)


# ---- what runs ----
@dataclass(eq=False)
class Slot:
  """A value crossing steps: the BUFFER node segments read it through, and its device buffer."""
  node: Node
  buf: Any


@dataclass(eq=False)
class Switch:
  label: str
  cond: Slot
  then: list[Step]
  else_: list[Step]

  def run(self, vals: Mapping[str, int], prof: list[Any] | None) -> None:
    take = bool(self.cond.buf.numpy()[0])  # the one element of a bool: the only host read between the segments
    for s in self.then if take else self.else_: s.run(vals, prof)


@dataclass(eq=False)
class Refusal:
  """A branch kiln could not convert at load (it fits other inputs than the ones the model was loaded for): a run that takes
  it is refused with the reason."""
  why: str

  def run(self, vals: Mapping[str, int], prof: list[Any] | None) -> None: raise ONNXError(self.why)


Step = Segment | Switch | Refusal


def _steps_plans(steps: Sequence[Step]) -> list[Any]:
  out = []
  for s in steps:
    if isinstance(s, Segment): out.append(s.plan)
    elif isinstance(s, Switch): out += _steps_plans(s.then) + _steps_plans(s.else_)
  return out


class Program:
  """A model with run-time branches: `run(feeds)` copies the inputs into their slots, runs the steps, and reads the outputs."""

  def __init__(self, inputs: list[tuple[str, Slot]], steps: list[Step], outputs: list[Slot]):
    self.inputs, self.steps, self.outputs = inputs, steps, outputs
    self._lock = threading.Lock()  # the slots are shared by every run: one run at a time

  @property
  def plans(self) -> list[Any]: return _steps_plans(self.steps)

  def run(self, feeds: Mapping[str, np.ndarray], profile: bool = False) -> tuple[list[np.ndarray], Any]:
    from kiln.executor.profile import Profile
    with self._lock:
      vals = self._feed(feeds)
      prof = Profile() if profile else None
      for s in self.steps: s.run(vals, prof)
      return [self._read(s, vals) for s in self.outputs], prof

  def _feed(self, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    arrays = {name: np.asarray(feeds[name]) for name, _ in self.inputs}
    vals: dict[str, int] = {}
    where: dict[str, str] = {}
    for name, s in self.inputs:  # each dim's value off the fed arrays (as Compiled.infer_vars: every input naming it agrees)
      a, shape = arrays[name], s.node.shape
      if a.ndim != len(shape): raise GraphError(f"input {name!r} has shape {a.shape}, the model takes rank {len(shape)} {fmt_shape(shape)}")
      for k, (got, d) in enumerate(zip(a.shape, shape)):
        if isinstance(d, int):
          if got != d: raise GraphError(f"input {name!r} has shape {a.shape}, the model was compiled for {fmt_shape(shape)} (dim {k})")
          continue
        var, lo, hi = d.arg
        if not lo <= got <= hi: raise GraphError(f"input {name!r} dim {k} ({var}) is {got}, outside the bounds [{lo}, {hi}] it was compiled for")
        if var in vals and vals[var] != got: raise GraphError(f"input {name!r} dim {k} ({var}) is {got}, but {where[var]} gave {var} = {vals[var]}")
        vals[var], where[var] = int(got), f"input {name!r} dim {k}"
    for name, s in self.inputs:
      cast = in_plan_dtype(arrays[name], s.node.dtype.np)
      if cast is None: raise GraphError(f"input {name!r} has dtype {arrays[name].dtype}, the model takes {s.node.dtype.np}")
      if cast.size == 0: continue  # a dim of 0 (an empty KV cache): nothing to copy, the kernels read none of it
      buf = s.buf if cast.size == s.buf.size else s.buf.view(0, cast.size)  # below its dims' bounds: the buffer's front
      buf.copyin(np.ascontiguousarray(cast))
    return vals

  @staticmethod
  def _read(s: Slot, vals: Mapping[str, int]) -> np.ndarray:
    shape = tuple(evaluate(d, vals) for d in s.node.shape)
    n = int(np.prod(shape, dtype=np.int64))
    return (s.buf if n == s.buf.size else s.buf.view(0, max(n, 1))).numpy()[:n].reshape(shape).copy()  # n = 0: a dim of 0


# ---- cutting the recorded graph into steps ----
def _substitute(roots: Sequence[Node], done: Mapping[Node, Slot]) -> list[Node]:
  """roots rebuilt with every node of done replaced by its slot's BUFFER (the graph the caller holds is not changed)."""
  memo: dict[Node, Node] = {}
  for n in toposort(list(roots), set(done)):
    if n in done: memo[n] = done[n].node
    else:
      src = tuple(memo[s] for s in n.src)
      memo[n] = n if all(a is b for a, b in zip(src, n.src)) else Node(n.op, src, n.arg, n.shape, n.dtype, n.realize)
  return [memo[r] for r in roots]


class _Builder:
  def __init__(self, device: str):
    self.weights = Weights(device)

  def slot(self, n: Node) -> Slot:
    from kiln.executor import Buffer
    node = n if n.op == "BUFFER" and n.data is None else placeholder(n.shape, n.dtype)
    return Slot(node, Buffer(self.weights.device, n.max_numel, n.dtype).ensure_allocated())  # allocated: no plan reuses its memory

  def steps(self, roots: list[Node], outs: list[Slot] | None, branches: list[Branch], done: dict[Node, Slot]) -> list[Step]:
    """The steps of one scope: before each branch a segment computing its condition and captures, then a Switch; last a
    segment computing roots (into outs where given: a branch's outputs, which it writes even when they are its inputs)."""
    stages = [[b.cond, *b.captures] for b in branches] + [roots]
    steps: list[Step] = []
    for i, stage in enumerate(stages):
      last = i == len(branches)
      want = list(stage) if last and outs is not None else [n for n in dict.fromkeys(stage) if n not in done]
      if want:
        order = toposort(want, set(done))
        runtime: dict[Node, bool] = {}  # depends on an input or another step's value; else recomputed where it is read (a view of a weight)
        for n in order: runtime[n] = n in done or (n.op == "BUFFER" and n.data is None) or any(runtime[s] for s in n.src)
        made = {n for n in order if n not in done}
        later = [n for s in stages[i + 1:] for n in s]
        frontier = [n for n in toposort(later, set(done) | made) if n in made and n not in want and runtime[n]]
        slots = (list(outs) if last and outs is not None else [self.slot(n) for n in want]) + [self.slot(n) for n in frontier]
        nodes = want + frontier
        steps.append(compile_segment(_substitute(nodes, done), [s.buf for s in slots], {s.node: s.buf for s in done.values()}, self.weights))
        for n, s in zip(nodes, slots): done.setdefault(n, s)
      if last: break
      b = branches[i]
      caps = [done[c] for c in b.captures]
      outs_b = [self.slot(o) for o in b.outs]
      done.update(zip(b.outs, outs_b))
      arms: list[list[Step]] = [[Refusal(body.refused)] if body.refused is not None else
                                self.steps(body.outputs, outs_b, body.branches, dict(zip(body.inputs, caps))) for body in (b.then, b.else_)]
      steps.append(Switch(b.label, done[b.cond], *arms))
    return steps


def build_program(inputs: list[tuple[str, Node]], outputs: list[Node], main: Body, device: str) -> Program:
  """The Program of a converted model: inputs (name, BUFFER node), its computed outputs, and the main graph's branches."""
  from kiln.codegen.spec import DeviceSpec
  b = _Builder(str(DeviceSpec.parse(device)))
  done = {node: b.slot(node) for _, node in inputs}
  ins = [(name, done[node]) for name, node in inputs]
  steps = b.steps(outputs, None, main.branches, done)
  return Program(ins, steps, [done[o] for o in outputs])
