"""Run-time specialisation: the rest of a model converted and compiled for values it computes at run time.

An input that sets a shape or axes (a Reshape's shape, a Reduce's axes, Resize's sizes or scales, a Slice's starts, Pad's
pads, Range's limit) is usually an initializer or shape arithmetic, folded at load. When it is computed at run time (fed,
or computed from data), `Node.const` raises `RuntimeValue` and the converter (onnx.py) *cuts* the model's main graph before
that node: a `Cut` records the values to read back, the values the rest of the graph reads, and how to convert the rest.
The model becomes a Program (program.py) whose steps end in a `Specialise`:

| step          | what it runs                                                                                          |
|---------------|-------------------------------------------------------------------------------------------------------|
| the prefix    | segments (and run-time branches) computing everything the rest of the graph reads, the needed values too |
| `Specialise`  | reads the needed values back (a few numbers, as a Switch reads a condition), then runs the continuation |
| continuation  | the rest of the graph, from the node that needed the values on, converted with them as constants and compiled |

Continuations are cached by the values read (their dtypes, shapes and bytes), the MAX_SPECIALISATIONS most recently used
kept: a run with values seen before compiles nothing, and values that never change (the usual case: a shape computed from
data of one shape) compile once, at the first run. A continuation reads the prefix's slots in place and the model inputs
(no copies), and may end in a cut of its own (a chain: a Slice whose starts and ends are both fed is two links). A value
the rest of the graph cannot take (a negative size, an axis out of range, a size over onnx_limits' limits) fails that
conversion with an ONNXError naming the node: the run raises it, and so does every run with the same value (the refusal is
cached as a continuation is).

A *length* is the other kind of value read back: NonZero's and Unique's counts, the number of boxes NonMaxSuppression keeps
(its host step's rows), each with a bound known at load (the input's size; batches * classes * boxes). The rest of the graph
does not need its value, only a dim for it: the continuation is converted once, at load, with the length as a runtime
variable in [0, bound] (`Length`; the output's dim is that variable, its buffers sized for the bound), and each run reads the
length back and binds the variable, as a model input's dims are bound (one compile for every length; the host step's rows
are copied into the front of their slot). Only where that continuation cannot be converted with the length symbolic (an op
after it that needs the length as a number: a Reshape to a shape computed from it) does the cut fall back to a continuation
per value, as for the shape values above, and `Specialise.unbounded` says why. A host step may bind several lengths at
once (`Length.vars`): a Slice window computed from data, a start and a length per axis.

A *condition* is the third: a run-time If in the main graph whose branch reads a value back (torchvision's batched_nms:
"no boxes?" with NonMaxSuppression in the else branch) or gives an output of another shape cannot be a Switch, so the
graph is cut before it on its condition (onnx_ops_flow._cut_on). Its two continuations, the If folded to each branch, are
both compiled when the step is made, at load: a run picks one, as a Switch would, and none compiles. A length the
condition is computed from stays a variable in both.

Only the main graph (and a branch of an If known at load) is cut, on values of at most MAX_SPECIALISED_ELEMENTS: inside a
run-time If's branch or a loop's body, or for a larger value, RuntimeValue (an ONNXError) is the refusal at load.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.graph import dims as sym
from kiln.graph.build_target import building_for
from kiln.graph.lazy import GraphError, Node, ONNXError, toposort
from kiln.graph.program import Body, Builder, LoopStep, Refusal, Slot, Switch, Tail, placeholder, read
from kiln.graph.segments import Weights
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes
from kiln.ir.errors import KilnError
from kiln.ir.uop import UOp

MAX_SPECIALISED_ELEMENTS = 64  # a value read back to specialise on: a shape, axes, sizes, pads (a few numbers, never data)
MAX_SPECIALISATIONS = 16  # continuations kept per cut, least recently used dropped (each is compiled plans and their buffers)

Env = dict[str, Any]  # ONNX value name -> Tensor or numpy array (onnx_ops.Value)


Host = Callable[[list[np.ndarray]], np.ndarray]  # a host step: the value from the arrays read back (NonMaxSuppression's selection)


@dataclass(frozen=True)
class Length:
  """A value read back whose length is all the rest of the graph depends on: one count in [0, bound] (row None), or a host
  step's array of at most `bound` rows, each of shape `row` and dtype `dtype` (NonMaxSuppression's selection)."""
  bound: int
  row: tuple[int, ...] | None = None
  dtype: Any = None
  at_most: Any = None  # a dim the value may not pass in a run (TopK's k, its axis when that is symbolic), checked by the run
  vars: int = 1  # more than one: a host step's ints, each a variable in [0, bound] (a Slice's start and length per axis)


class RuntimeValue(ONNXError):
  """Node.const met a value computed at run time (input `index` of node), or Node.read_back one its output's shape depends
  on (`reads`: NonZero's count, or what a host step computes from). In the model's main graph, or a branch of an If known
  at load, the converter cuts there and specialises the rest of the graph on the value; anywhere else this is the
  refusal, and its message says why."""

  def __init__(self, msg: str, node: Any, index: int, text: str, reads: list[Tensor] | None = None, key: str = "", host: Host | None = None,
               length: Length | None = None):
    super().__init__(msg)
    self.node, self.index, self.text = node, index, text  # text: what was computed at run time, for the refusal that says why not
    self.reads, self.key, self.host = reads, key, host  # key: the name the rest of the graph finds the value under (Node.read_back)
    self.length = length
    self.frames: list[Any] = []  # the scopes it left on its way to the main graph: each branch's rest, then its If (onnx.py)


def unspecialisable(n: Node) -> str | None:
  """Why kiln cannot specialise on the run-time value n (None: it can)."""
  if n.max_numel > MAX_SPECIALISED_ELEMENTS:
    return f"it holds up to {n.max_numel} elements, and kiln specialises on values of at most MAX_SPECIALISED_ELEMENTS = {MAX_SPECIALISED_ELEMENTS}"
  if n.dtype.name == "bfloat16": return "kiln does not specialise on a bfloat16 value"
  return None


@dataclass(eq=False)
class Cut:
  """Where the conversion of the main graph stopped: `needed` (name, node) are read back, `env` holds the values the rest
  of the graph reads (`keep`: those computed at run time, handed on in slots), and `resume(env)` converts the rest in env,
  giving the model's outputs (None where it was cut again) and its Body (branches, a further cut)."""
  label: str
  needed: list[tuple[str, Node]]
  env: Env
  resume: Callable[[Env], tuple[list[Any] | None, Body]]
  host: Host | None = None  # a host step computes the value from the needed arrays; the rest is keyed by its shape, fed its data
  key: str = ""  # the host step's value's name in env
  length: Length | None = None  # the value is a length: the rest is compiled once, for a runtime variable

  @property
  def var(self) -> str:
    """The runtime variable a length binds: named after its node, so errors and profiles say whose length it is."""
    return "len_" + ("".join(c if c.isalnum() else "_" for c in self.label.removeprefix("node ")).strip("_") or "value")

  @property
  def keep(self) -> list[Node]: return [v.node for v in self.env.values() if isinstance(v, Tensor)]

  @property
  def condition(self) -> Node | None:
    """The one bool the cut reads back, where it is an If's condition (two values: both continuations compiled at load)."""
    if self.host is not None or self.length is not None or len(self.needed) != 1: return None
    node = self.needed[0][1]
    return node if node.dtype.is_bool and node.max_numel == 1 and sym.is_static(node.shape) else None

  def step(self, needed: list[Slot], builder: Builder, done: dict[Node, Slot]) -> Specialise:
    """The Specialise that runs the rest of the graph at this cut (program.Builder.tail asks the cut for it, so program.py
    never imports this module: this one builds on it)."""
    return Specialise(self, needed, builder, done)

  @property
  def shared(self) -> frozenset[int]:
    """The ids of the arrays every continuation reads alike (initializers, the constants in env's graphs): env keeps them
    alive, so their device buffers are made once, not once per continuation."""
    arrays = [v for v in self.env.values() if isinstance(v, np.ndarray)]
    arrays += [d for n in toposort(self.keep) if (d := n.data) is not None]
    return frozenset(id(a) for a in arrays)


def _refused_branch(tail: Tail) -> str | None:
  """Why a branch of a run-time If in tail (or in the continuations compiled at load after it) is refused, None if none is."""
  todo: list[Any] = list(tail.steps)
  if tail.then is not None and tail.then.at_load: todo += [s for t in tail.then.compiled() for s in t.steps]
  while todo:
    s = todo.pop()
    if isinstance(s, Refusal): return s.why
    if isinstance(s, Switch): todo += s.then + s.else_
    if isinstance(s, LoopStep): todo += s.body
  return None


def _needs_value(tail: Tail, var: UOp) -> str | None:
  """Why the continuations after tail need the length var's value (None: they take it as a variable). A later cut converted
  per value at run time must neither need a value computed from it as a number nor read tensors of its length; a bound
  length's continuation, or a condition's two (compiled at load, the length a variable in each), are checked in turn."""
  todo = [tail]
  while todo:
    later = todo.pop().then
    if later is None: continue
    if later.at_load:
      todo += later.compiled()
      continue
    if _mentions([n for _, n in later.cut.needed], var):  # a value computed from the length, needed as a number
      return f"{later.cut.label} needs a value computed from it ({', '.join(k for k, _ in later.cut.needed)}) as a number"
    if _mentions(later.cut.keep, var):
      return f"{later.cut.label} is converted per value at run time ({later.unbounded or 'not a length'}), and reads it"
  return None


def _mentions(nodes: list[Node], var: UOp) -> bool:
  """Whether the graph of nodes depends on the runtime variable var: a shape holding it, or a dim's value (Tensor.dim_value)."""
  for n in toposort(nodes):
    if any(v is var for v in sym.variables(n.shape)): return True
    if n.op == "CONST" and isinstance(n.arg, UOp) and any(v is var for v in sym.variables([n.arg])): return True
  return False


def describe(values: Mapping[str, Any]) -> str:
  """Values read back, for messages: a number's value, a length's variable and bounds."""
  def one(v: Any) -> str:
    if isinstance(v, np.ndarray): return str(v.tolist())
    if isinstance(v, tuple): return "(" + ", ".join(one(x) for x in v) + ")"
    d = v.node.shape[0] if isinstance(v, Tensor) else v
    lo, hi = sym.bounds(d)
    return f"{sym.fmt(d)} in [{lo}, {hi}]"
  return ", ".join(f"{k} = {one(v)}" for k, v in values.items())


class Specialise:
  """The step at a cut: reads the needed values back and runs the continuation compiled for them (compiling it on a miss).
  With a host step, the continuation is keyed by the shape of what the host computes, and each run copies its data into
  the slot the continuation reads it from (one compile per row count, not per selection). A length is bound instead: its
  continuation is compiled once, when the step is made (at load), and every run binds its variable."""

  def __init__(self, cut: Cut, needed: list[Slot], builder: Builder, done: dict[Node, Slot]):
    self.cut, self.needed, self._builder, self._done = cut, needed, builder, done
    self._shared = cut.shared
    self._cache: OrderedDict[tuple[Any, ...], tuple[Tail, Slot | None]] = OrderedDict()
    self.compiles = 0  # continuations made (a cached refusal too): a run whose values are cached adds none
    self.before: dict[str, Any] = {}  # the values of the cuts this one follows (a chain), for messages
    self.unbounded: str | None = None  # why a length could not be bound (the continuation is then per value), None if it was
    self._bounded = self._bind() if cut.length is not None else None
    if (c := cut.condition) is not None:
      for value in (False, True): self._compiled_for({cut.needed[0][0]: np.full(sym.static_shape("an If's condition", c.shape), value)})

  @property
  def at_load(self) -> bool:
    """Whether every continuation it runs was compiled when it was made: a length's bound one, or a condition's two."""
    return self._bounded is not None or self.cut.condition is not None

  def compiled(self) -> list[Tail]:
    """The continuations compiled now: the bound one, or those cached, least recently used first."""
    return [self._bounded[0]] if self._bounded is not None else [t for t, _ in self._cache.values()]

  def _bind(self) -> tuple[Tail, Slot | None] | None:
    """The continuation for every length at once: the length is a runtime variable in [0, bound] (a count's dim, or the rows
    of a host step's array); None, with the reason in `unbounded`, where the rest of the graph needs its value."""
    ln = self.cut.length
    assert ln is not None
    if ln.bound < 1:
      self.unbounded = f"its bound is {ln.bound}: the value is known"
      return None
    vs = [sym.variable(name, 0, ln.bound) for name in self.var_names]
    var = vs[0]
    if ln.vars > 1: env_val: Any = tuple(vs)
    elif ln.row is None: env_val = var
    else: env_val = Tensor(placeholder((var, *ln.row), dtypes.from_numpy(np.dtype(ln.dtype))))
    tail, slot = self._continue({self.cut.key: env_val}, {self.cut.key: env_val}, None if ln.row is None else env_val.node)
    self.compiles += 1
    if len(tail.steps) == 1 and isinstance(tail.steps[0], Refusal):
      self.unbounded = tail.steps[0].why
      return None
    if (why := _refused_branch(tail)) is not None:  # a run-time If's branch it could not convert, the length still a variable
      self.unbounded = f"a branch chosen at run time could not be converted with it a variable: {why}"  # per value, it may fold
      return None
    for v in vs:
      if (why := _needs_value(tail, v)) is not None:
        self.unbounded = why
        return None
    return tail, slot

  @property
  def var_names(self) -> list[str]:
    """The runtime variables a length binds: the cut's, or one per value of a host step's ints (cut.var_0, cut.var_1, ...)."""
    n = self.cut.length.vars if self.cut.length is not None else 1
    return [self.cut.var] if n == 1 else [f"{self.cut.var}_{i}" for i in range(n)]

  def run(self, vals: dict[str, int], prof: list[Any] | None) -> list[Slot | np.ndarray]:
    """Reads the needed values back, binds a length's variable in vals (the run's: its outputs are read with it), and runs
    the rest of the graph."""
    values = {name: read(s, vals) for (name, _), s in zip(self.cut.needed, self.needed)}
    fed = None if self.cut.host is None else self.cut.host(list(values.values()))  # a typed ONNXError for a bad value, each run
    if self._bounded is not None: return self._run_bound(vals, prof, values, fed)
    tail, slot = self._compiled_for(values, fed)
    if slot is not None and fed is not None: slot.buf.copyin(np.ascontiguousarray(fed))
    return tail.run(vals, prof)

  def _compiled_for(self, values: dict[str, np.ndarray], fed: np.ndarray | None = None) -> tuple[Tail, Slot | None]:
    """The continuation for these values read back (for a host step's value fed: its shape), compiled on a miss."""
    key = (("host", fed.dtype.str, fed.shape),) if fed is not None else tuple((a.dtype.str, a.shape, a.tobytes()) for a in values.values())
    if (hit := self._cache.get(key)) is not None:
      self._cache.move_to_end(key)
      return hit
    ph = None if fed is None or fed.size == 0 else placeholder(fed.shape, dtypes.from_numpy(fed.dtype))
    known = values if fed is None else {f"the rows of {self.cut.key}": np.asarray(fed.shape[0])}
    env = values if fed is None else {self.cut.key: fed if ph is None else Tensor(ph)}
    hit = self._cache[key] = self._continue(env, known, ph)
    self.compiles += 1
    if len(self._cache) > MAX_SPECIALISATIONS: self._cache.popitem(last=False)
    return hit

  def _run_bound(self, vals: dict[str, int], prof: list[Any] | None, values: dict[str, np.ndarray],
                 fed: np.ndarray | None) -> list[Slot | np.ndarray]:
    assert self._bounded is not None and self.cut.length is not None
    tail, slot = self._bounded
    ln = self.cut.length
    if ln.vars > 1:
      got = np.asarray(fed).reshape(-1)
      if got.size != ln.vars or not all(0 <= int(x) <= ln.bound for x in got):
        raise ONNXError(f"{self.cut.label}: its host step gave {got.tolist()}, not {ln.vars} values in [0, {ln.bound}]")
      vals.update(zip(self.var_names, (int(x) for x in got)))
      return tail.run(vals, prof)
    if fed is None: n = int(np.asarray(next(iter(values.values()))).reshape(-1)[0])
    else:
      n = int(fed.shape[0])
      if fed.shape[1:] != ln.row or fed.dtype != np.dtype(ln.dtype):
        raise ONNXError(f"{self.cut.label}: its host step gave {fed.dtype} {fed.shape}, not rows of {ln.row} {np.dtype(ln.dtype)}")
    if not 0 <= n <= ln.bound: raise ONNXError(f"{self.cut.label}: {self.cut.key} is {n}, outside [0, {ln.bound}] (its bound at load)")
    if ln.at_most is not None and n > (most := sym.evaluate(ln.at_most, vals)):
      raise ONNXError(f"{self.cut.label}: {self.cut.key} is {n}, outside [0, {most}] ({sym.fmt(ln.at_most)} in this run)")
    vals[self.cut.var] = n
    if slot is not None and fed is not None and fed.size:
      slot.buf.view(0, fed.size).copyin(np.ascontiguousarray(fed))  # the front of a slot sized for the bound
    return tail.run(vals, prof)

  def _continue(self, values: Env, known: Mapping[str, Any], ph: Node | None) -> tuple[Tail, Slot | None]:
    """The rest of the graph for these values (numbers, a length's variable, or a host step's value: a placeholder ph the
    continuation reads from its slot, filled by each run, or an empty array known now): converted, cut into steps,
    compiled; or a refusal any run with them raises. A failure of the machine (out of memory) is raised, not kept: another
    run may succeed."""
    known = {**self.before, **known}
    where = f"the model from {self.cut.label} on, converted for {describe(known)}"
    env = {**self.cut.env, **values}
    device = self._builder.weights.device
    try:
      with building_for(device): outs, body = self.cut.resume(env)  # the layouts of the device it runs on, as at load
      child = Builder(Weights(device, self._builder.weights, self._shared))
      done = dict(self._done)
      slot = None if ph is None else done.setdefault(ph, child.slot(ph))
      tail = child.tail([o.node if isinstance(o, Tensor) else o for o in outs or []], body, done)
      if tail.then is not None: tail.then.before = known
      return tail, slot
    except ONNXError as e: why = f"{e} ({where})"
    except GraphError as e: why = f"compiling {where} failed: {e}"
    except RecursionError: why = f"compiling {where} failed: a chain of fused operations is too deep for kiln.graph's renderer"
    except KilnError as e: raise ONNXError(f"compiling {where} failed: {type(e).__name__}: {e}") from e
    return Tail([Refusal(why)], []), None
