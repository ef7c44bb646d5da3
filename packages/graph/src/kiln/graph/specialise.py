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

Only the main graph is cut, on values of at most MAX_SPECIALISED_ELEMENTS: inside an If's branch or a loop's body, or for
a larger value, RuntimeValue (an ONNXError) is the refusal at load. A size with a natural bound (NonZero's count, TopK's k,
the length of a Slice with run-time bounds) would better bind a runtime variable of a continuation compiled once for every
value (symbolic dims with a lower bound of 0): that would replace `Specialise._continue` for such values, with the same
read-back step before it (docs/architecture.md).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.graph.lazy import GraphError, Node, ONNXError, toposort
from kiln.graph.program import Body, Builder, Refusal, Slot, Tail, placeholder, read
from kiln.graph.segments import Weights
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes
from kiln.ir.errors import KilnError

MAX_SPECIALISED_ELEMENTS = 64  # a value read back to specialise on: a shape, axes, sizes, pads (a few numbers, never data)
MAX_SPECIALISATIONS = 16  # continuations kept per cut, least recently used dropped (each is compiled plans and their buffers)

Env = dict[str, Any]  # ONNX value name -> Tensor or numpy array (onnx_ops.Value)


Host = Callable[[list[np.ndarray]], np.ndarray]  # a host step: the value from the arrays read back (NonMaxSuppression's selection)


class RuntimeValue(ONNXError):
  """Node.const met a value computed at run time (input `index` of node), or Node.read_back one its output's shape depends
  on (`reads`: NonZero's count, or what a host step computes from). In the model's main graph, or a branch of an If known
  at load, the converter cuts there and specialises the rest of the graph on the value; anywhere else this is the
  refusal, and its message says why."""

  def __init__(self, msg: str, node: Any, index: int, text: str, reads: list[Tensor] | None = None, key: str = "", host: Host | None = None):
    super().__init__(msg)
    self.node, self.index, self.text = node, index, text  # text: what was computed at run time, for the refusal that says why not
    self.reads, self.key, self.host = reads, key, host  # key: the name the rest of the graph finds the value under (Node.read_back)
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

  @property
  def keep(self) -> list[Node]: return [v.node for v in self.env.values() if isinstance(v, Tensor)]

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


def describe(values: Mapping[str, np.ndarray]) -> str:
  return ", ".join(f"{k} = {v.tolist()}" for k, v in values.items())


class Specialise:
  """The step at a cut: reads the needed values back and runs the continuation compiled for them (compiling it on a miss).
  With a host step, the continuation is keyed by the shape of what the host computes, and each run copies its data into
  the slot the continuation reads it from (one compile per row count, not per selection)."""

  def __init__(self, cut: Cut, needed: list[Slot], builder: Builder, done: dict[Node, Slot]):
    self.cut, self.needed, self._builder, self._done = cut, needed, builder, done
    self._shared = cut.shared
    self._cache: OrderedDict[tuple[Any, ...], tuple[Tail, Slot | None]] = OrderedDict()
    self.compiles = 0  # continuations made (a cached refusal too): a run whose values are cached adds none
    self.before: dict[str, np.ndarray] = {}  # the values of the cuts this one follows (a chain), for messages

  def compiled(self) -> list[Tail]:
    """The continuations cached now, least recently used first."""
    return [t for t, _ in self._cache.values()]

  def run(self, vals: Mapping[str, int], prof: list[Any] | None) -> list[Slot | np.ndarray]:
    values = {name: read(s, vals) for (name, _), s in zip(self.cut.needed, self.needed)}
    fed = None if self.cut.host is None else self.cut.host(list(values.values()))  # a typed ONNXError for a bad value, each run
    key = (("host", fed.dtype.str, fed.shape),) if fed is not None else tuple((a.dtype.str, a.shape, a.tobytes()) for a in values.values())
    if (hit := self._cache.get(key)) is not None: self._cache.move_to_end(key)
    else:
      hit = self._cache[key] = self._continue(values, fed)
      self.compiles += 1
      if len(self._cache) > MAX_SPECIALISATIONS: self._cache.popitem(last=False)
    tail, slot = hit
    if slot is not None and fed is not None: slot.buf.copyin(np.ascontiguousarray(fed))
    return tail.run(vals, prof)

  def _continue(self, values: dict[str, np.ndarray], fed: np.ndarray | None) -> tuple[Tail, Slot | None]:
    """The rest of the graph for these values: converted, cut into steps, compiled; or a refusal any run with them raises.
    A failure of the machine (out of memory) is raised, not kept: another run may succeed. A host step's value is a
    placeholder the continuation reads (its slot, filled by each run), or, holding nothing, an empty array known now."""
    known = {**self.before, **(values if fed is None else {f"the rows of {self.cut.key}": np.asarray(fed.shape[0])})}
    where = f"the model from {self.cut.label} on, converted at run time for {describe(known)}"
    ph = None if fed is None or fed.size == 0 else placeholder(fed.shape, dtypes.from_numpy(fed.dtype))
    env = {**self.cut.env, **(values if fed is None else {self.cut.key: fed if ph is None else Tensor(ph)})}
    try:
      outs, body = self.cut.resume(env)
      child = Builder(Weights(self._builder.weights.device, self._builder.weights, self._shared))
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
