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

A value that sets a shape or axes but is computed at run time (a Reshape's shape fed as an input) ends a scope's steps
in a `Specialise` (specialise.py): it reads the value back, as a Switch reads its condition, then runs the rest of the
graph converted and compiled for that value (cached by it). A scope's steps and what they end in are a `Tail`.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.executor.portable import in_plan_dtype
from kiln.graph.dims import bind_dims, evaluate
from kiln.graph.lazy import GraphError, Node, ONNXError, Source, toposort
from kiln.graph.segments import Segment, Weights, compile_segment
from kiln.ir.dtype import dtypes
from kiln.ir.kernels import Dim

if TYPE_CHECKING:
  from kiln.graph.specialise import Cut, Specialise


# ---- what the conversion records ----
@dataclass(eq=False)
class Body:
  """A scope's graph: placeholders for the outer values it reads (parallel to its Branch's captures), its outputs, and
  the run-time branches recorded while it converted, in order."""
  inputs: list[Node] = field(default_factory=list)
  outputs: list[Node] = field(default_factory=list)
  branches: list[Branch | RunLoop] = field(default_factory=list)  # in the order they were met
  cut: Cut | None = None  # where its conversion stopped for a value known only at run time (specialise.py); outputs are then empty
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


@dataclass(eq=False)
class RunLoop:
  """A Loop whose trip count or condition is known only at run time (and that has no scan outputs): its body is converted
  once (inputs: placeholders of the iteration number, the condition, the carried values, then its captures; outputs: the
  next condition, then the carried values) and compiled once; a run steps it."""
  label: str
  trips: Node | None  # M computed at run time (one integer), else None
  max_trips: int | None  # M known at load (None: no M)
  cond: Node | None  # the first condition computed at run time, else None
  first: bool  # the first condition known at load (True when the Loop has none)
  inits: list[Node]  # the carried values' first values
  captures: list[Node]
  body: Body
  outs: list[Node]  # placeholders of the carried values' last values in the enclosing scope
  scans: list[Node] = field(default_factory=list)  # placeholders (bound, *row) of the scan outputs, row i written by iteration i
  count: Node | None = None  # placeholder of the iterations run (int64, one), with scan outputs: their length, read back
  bound: int = 0  # the iterations the scan outputs have room for


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


def _copy(dst: Slot, src: Slot, vals: Mapping[str, int]) -> None:
  """src's value into dst's buffer (both sized for the same dims' bounds), through the host: a carried value per iteration."""
  a = read(src, vals)
  if a.size: (dst.buf if a.size == dst.buf.size else dst.buf.view(0, a.size)).copyin(np.ascontiguousarray(a))


@dataclass(eq=False)
class LoopStep:
  """A RunLoop's step: reads its trip count and first condition, puts the carried values' first values in their slots,
  then per iteration writes the iteration number and condition, runs the body's steps (which read the carried slots and
  write the next values beside them), copies those back and reads the next condition. At most MAX_LOOP_ITERATIONS
  iterations (a loop whose condition never turns false is an error, never a hang)."""
  label: str
  trips: Slot | int | None
  cond: Slot | bool
  inits: list[Slot]
  carried: list[Slot]  # the loop's values: the body reads them, the enclosing scope reads the last ones
  it: Slot
  go: Slot
  nxt: list[Slot]  # the body's outputs: the next condition, the next carried values, then this iteration's scan values
  body: list[Step]
  scans: list[Slot] = field(default_factory=list)  # the scan outputs, row i of each written after iteration i
  count: Slot | None = None  # the iterations run, written after the last
  bound: int = 0  # the rows of each scan output's slot

  def run(self, vals: Mapping[str, int], prof: list[Any] | None) -> None:
    m = self.trips if not isinstance(self.trips, Slot) else int(read(self.trips, vals).reshape(-1)[0])
    go = self.cond if isinstance(self.cond, bool) else bool(read(self.cond, vals).reshape(-1)[0])
    for dst, src in zip(self.carried, self.inits): _copy(dst, src, vals)
    i = 0
    while go and (m is None or i < m):
      if i >= MAX_LOOP_ITERATIONS:
        raise ONNXError(f"{self.label} runs over MAX_LOOP_ITERATIONS = {MAX_LOOP_ITERATIONS} iterations (its condition never turned false)")
      self.it.buf.copyin(np.array([i], np.int64))
      self.go.buf.copyin(np.array([go], np.bool_))
      if self.scans and i >= self.bound:
        raise ONNXError(f"{self.label} runs more than the {self.bound} iterations its scan outputs have room for (each scan output is "
                        "at most onnx_limits.MAX_SCAN_BYTES, and at most the trip count where that is known at load)")
      for s in self.body: s.run(vals, prof)
      for dst, src in zip(self.carried, self.nxt[1:]): _copy(dst, src, vals)
      for dst, src in zip(self.scans, self.nxt[1 + len(self.carried):]):
        a = np.ascontiguousarray(read(src, vals))
        if a.size: dst.buf.view(i * a.nbytes, a.size).copyin(a)
      go = bool(read(self.nxt[0], vals).reshape(-1)[0])
      i += 1
    if self.count is not None: self.count.buf.copyin(np.array([i], np.int64))


MAX_LOOP_ITERATIONS = 1 << 20  # a run-time loop's iterations: a condition that never turns false is refused, not a hang

Step = Segment | Switch | Refusal | LoopStep


@dataclass(eq=False)
class Tail:
  """What a scope runs from some point on: its steps, then its outputs (a slot, or a constant a specialisation folded), or a
  Specialise that runs the rest of the graph for values it reads back and gives the outputs."""
  steps: list[Step]
  outputs: list[Slot | np.ndarray]
  then: Specialise | None = None

  def run(self, vals: dict[str, int], prof: list[Any] | None) -> list[Slot | np.ndarray]:
    """Runs the steps, then the Specialise if any, which binds the variables of the lengths it reads back in vals."""
    for s in self.steps: s.run(vals, prof)
    return self.outputs if self.then is None else self.then.run(vals, prof)

  @property
  def plans(self) -> list[Any]:
    """Its segments' plans, both sides of each branch, and those of every specialisation compiled so far."""
    return _steps_plans(self.steps) + ([] if self.then is None else [p for t in self.then.compiled() for p in t.plans])


def _steps_plans(steps: Sequence[Step]) -> list[Any]:
  out = []
  for s in steps:
    if isinstance(s, Segment): out.append(s.plan)
    elif isinstance(s, Switch): out += _steps_plans(s.then) + _steps_plans(s.else_)
    elif isinstance(s, LoopStep): out += _steps_plans(s.body)
  return out


def read(s: Slot, vals: Mapping[str, int]) -> np.ndarray:
  """A slot's value as the run's dims make it (the front of a buffer sized for their bounds), copied to the host."""
  shape = tuple(evaluate(d, vals) for d in s.node.shape)
  n = int(np.prod(shape, dtype=np.int64))
  return (s.buf if n == s.buf.size else s.buf.view(0, max(n, 1))).numpy()[:n].reshape(shape).copy()  # n = 0: a dim of 0


def host_array(v: np.ndarray) -> np.ndarray:
  """A constant output as run() hands it out: a bfloat16 (ml_dtypes') as its uint16 bits, as a computed one is."""
  return v.view(np.uint16) if v.dtype.name == "bfloat16" else v


class Program:
  """A model with run-time branches or specialisations: `run(feeds)` copies the inputs into their slots, runs the steps,
  and reads the outputs: its computed outputs, or, where it specialises, every output of the model."""

  def __init__(self, inputs: list[tuple[str, Slot]], tail: Tail):
    self.inputs, self.tail = inputs, tail
    self._lock = threading.Lock()  # the slots (and a specialisation's cache) are shared by every run: one run at a time

  @property
  def steps(self) -> list[Step]: return self.tail.steps

  @property
  def plans(self) -> list[Any]: return self.tail.plans

  def specialisations(self) -> list[Specialise]:
    """Every Specialise step: the main graph's, then those of the continuations compiled so far."""
    out, todo = [], [self.tail]
    while todo:
      t = todo.pop(0)
      if t.then is not None:
        out.append(t.then)
        todo += t.then.compiled()
    return out

  def run(self, feeds: Mapping[str, np.ndarray], profile: bool = False) -> tuple[list[np.ndarray], Any]:
    from kiln.executor.profile import Profile
    with self._lock:
      vals = self._feed(feeds)
      prof = Profile() if profile else None
      outs = self.tail.run(vals, prof)
      return [read(s, vals) if isinstance(s, Slot) else host_array(s).copy() for s in outs], prof

  def _feed(self, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    arrays = {name: np.asarray(feeds[name]) for name, _ in self.inputs}
    vals = bind_dims([(name, s.node.shape) for name, s in self.inputs], {name: a.shape for name, a in arrays.items()}, "the model")
    for name, s in self.inputs:
      bf16 = s.node.dtype == dtypes.bfloat16
      cast = in_plan_dtype(arrays[name], s.node.dtype.np, bf16)
      if cast is None:
        raise GraphError(f"input {name!r} has dtype {arrays[name].dtype}, the model takes {'bfloat16' if bf16 else s.node.dtype.np}")
      if cast.size == 0: continue  # a dim of 0 (an empty KV cache): nothing to copy, the kernels read none of it
      buf = s.buf if cast.size == s.buf.size else s.buf.view(0, cast.size)  # below its dims' bounds: the buffer's front
      buf.copyin(np.ascontiguousarray(cast))
    return vals


# ---- cutting the recorded graph into steps ----
def _substitute(roots: Sequence[Node], done: Mapping[Node, Slot]) -> list[Node]:
  """roots rebuilt with every node of done replaced by its slot's BUFFER (the graph the caller holds is not changed)."""
  memo: dict[Node, Node] = {}
  for n in toposort(list(roots), set(done)):
    if n in done: memo[n] = done[n].node
    else:
      src = tuple(memo[s] for s in n.src)
      memo[n] = n if all(a is b for a, b in zip(src, n.src)) else Node(n.op, src, n.arg, n.shape, n.dtype, n.realize, origin=n.origin)
  return [memo[r] for r in roots]


def runtime(order: Sequence[Node], done: Mapping[Node, Slot]) -> dict[Node, bool]:
  """Which nodes (in topological order) depend on an input or another step's value; the rest (a view of a weight) are
  recomputed where they are read instead of handed on in a slot."""
  out: dict[Node, bool] = {}
  for n in order: out[n] = n in done or (n.op == "BUFFER" and n.data is None) or any(out[s] for s in n.src)
  return out


class Builder:
  """Cuts a converted scope into steps; its Weights hold the device buffers of the constants its segments read."""

  def __init__(self, weights: Weights):
    self.weights = weights

  def slot(self, n: Node) -> Slot:
    from kiln.executor import Buffer
    node = n if n.op == "BUFFER" and n.data is None else placeholder(n.shape, n.dtype)
    return Slot(node, Buffer(self.weights.device, n.max_numel, n.dtype).ensure_allocated())  # allocated: no plan reuses its memory

  def steps(self, roots: list[Node], outs: list[Slot] | None, branches: list[Branch | RunLoop], done: dict[Node, Slot]) -> list[Step]:
    """The steps of one scope: before each branch a segment computing its condition and captures, then a Switch (before a
    run-time loop, what it reads, then its LoopStep); last a segment computing roots (into outs where given: a branch's
    outputs, which it writes even when they are its inputs)."""
    stages = [[b.cond, *b.captures] if isinstance(b, Branch) else [*(t for t in (b.trips, b.cond) if t is not None), *b.inits, *b.captures]
              for b in branches] + [roots]
    steps: list[Step] = []
    for i, stage in enumerate(stages):
      last = i == len(branches)
      want = list(stage) if last and outs is not None else [n for n in dict.fromkeys(stage) if n not in done]
      if want:
        order = toposort(want, set(done))
        live = runtime(order, done)
        made = {n for n in order if n not in done}
        later = [n for s in stages[i + 1:] for n in s]
        frontier = [n for n in toposort(later, set(done) | made) if n in made and n not in want and live[n]]
        slots = (list(outs) if last and outs is not None else [self.slot(n) for n in want]) + [self.slot(n) for n in frontier]
        nodes = want + frontier
        steps.append(compile_segment(_substitute(nodes, done), [s.buf for s in slots], {s.node: s.buf for s in done.values()}, self.weights))
        for n, s in zip(nodes, slots): done.setdefault(n, s)
      if last: break
      b = branches[i]
      if isinstance(b, RunLoop):
        steps.append(self._loop(b, done))
        continue
      caps = [done[c] for c in b.captures]
      outs_b = [self.slot(o) for o in b.outs]
      done.update(zip(b.outs, outs_b))
      arms: list[list[Step]] = [[Refusal(body.refused)] if body.refused is not None else
                                self.steps(body.outputs, outs_b, body.branches, dict(zip(body.inputs, caps))) for body in (b.then, b.else_)]
      steps.append(Switch(b.label, done[b.cond], *arms))
    return steps

  def _loop(self, b: RunLoop, done: dict[Node, Slot]) -> LoopStep:
    """A run-time loop's step: slots for its carried values (the enclosing scope reads the last ones from them), the
    iteration number and condition, and the body's outputs; the body's steps compiled once over them."""
    carried = [self.slot(o) for o in b.outs]
    done.update(zip(b.outs, carried))
    it, go = self.slot(b.body.inputs[0]), self.slot(b.body.inputs[1])
    nxt = [self.slot(o) for o in b.body.outputs]
    inner = dict(zip(b.body.inputs, [it, go, *carried, *[done[c] for c in b.captures]]))
    body = self.steps(b.body.outputs, nxt, b.body.branches, inner)
    trips = done[b.trips] if b.trips is not None else b.max_trips
    scans = [self.slot(o) for o in b.scans]
    count = None if b.count is None else self.slot(b.count)
    done.update(zip(b.scans, scans))
    if b.count is not None and count is not None: done[b.count] = count
    return LoopStep(b.label, trips, done[b.cond] if b.cond is not None else b.first, [done[x] for x in b.inits], carried, it, go, nxt, body,
                    scans, count, b.bound)

  def tail(self, outputs: Sequence[Node | np.ndarray], body: Body, done: dict[Node, Slot]) -> Tail:
    """A scope's steps and outputs (constants stay constants); where its conversion was cut, the steps computing what the
    rest of the graph reads, then the Specialise that converts and runs the rest."""
    if body.cut is None:
      nodes = [o for o in outputs if isinstance(o, Node)]
      return Tail(self.steps(nodes, None, body.branches, done), [done[o] if isinstance(o, Node) else o for o in outputs])
    cut = body.cut
    wanted = set(cut.keep)
    keep = [n for n, live in runtime(toposort(cut.keep, set(done)), done).items() if live and n in wanted]
    steps = self.steps([n for _, n in cut.needed] + keep, None, body.branches, done)
    return Tail(steps, [], cut.step([done[n] for _, n in cut.needed], self, dict(done)))


def build_program(inputs: list[tuple[str, Node]], outputs: list[Node], main: Body, device: str) -> Program:
  """The Program of a converted model: inputs (name, BUFFER node), its computed outputs (none where the main graph was cut:
  every output then comes from the specialisation), and the main graph's branches and cut."""
  from kiln.codegen.spec import DeviceSpec
  b = Builder(Weights(str(DeviceSpec.parse(device))))
  done = {node: b.slot(node) for _, node in inputs}
  ins = [(name, done[node]) for name, node in inputs]
  return Program(ins, b.tail(outputs, main, done))
