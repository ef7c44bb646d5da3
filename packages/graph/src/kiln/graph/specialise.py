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
from kiln.graph.program import Body, Builder, Refusal, Slot, Tail, read
from kiln.graph.segments import Weights
from kiln.graph.tensor import Tensor
from kiln.ir.errors import KilnError

MAX_SPECIALISED_ELEMENTS = 64  # a value read back to specialise on: a shape, axes, sizes, pads (a few numbers, never data)
MAX_SPECIALISATIONS = 16  # continuations kept per cut, least recently used dropped (each is compiled plans and their buffers)

Env = dict[str, Any]  # ONNX value name -> Tensor or numpy array (onnx_ops.Value)


class RuntimeValue(ONNXError):
  """Node.const met a value computed at run time. In the model's main graph the converter cuts there and specialises the
  rest of the graph on the value; anywhere else this is the refusal, and its message says why."""

  def __init__(self, msg: str, node: Any, index: int, text: str):
    super().__init__(msg)
    self.node, self.index, self.text = node, index, text  # text: what was computed at run time, for the refusal that says why not


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

  @property
  def keep(self) -> list[Node]: return [v.node for v in self.env.values() if isinstance(v, Tensor)]

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
  """The step at a cut: reads the needed values back and runs the continuation compiled for them (compiling it on a miss)."""

  def __init__(self, cut: Cut, needed: list[Slot], builder: Builder, done: dict[Node, Slot]):
    self.cut, self.needed, self._builder, self._done = cut, needed, builder, done
    self._shared = cut.shared
    self._cache: OrderedDict[tuple[Any, ...], Tail] = OrderedDict()
    self.compiles = 0  # continuations made (a cached refusal too): a run whose values are cached adds none
    self.before: dict[str, np.ndarray] = {}  # the values of the cuts this one follows (a chain), for messages

  def compiled(self) -> list[Tail]:
    """The continuations cached now, least recently used first."""
    return list(self._cache.values())

  def run(self, vals: Mapping[str, int], prof: list[Any] | None) -> list[Slot | np.ndarray]:
    values = {name: read(s, vals) for (name, _), s in zip(self.cut.needed, self.needed)}
    key = tuple((a.dtype.str, a.shape, a.tobytes()) for a in values.values())
    if (tail := self._cache.get(key)) is not None: self._cache.move_to_end(key)
    else:
      tail = self._cache[key] = self._continue(values)
      self.compiles += 1
      if len(self._cache) > MAX_SPECIALISATIONS: self._cache.popitem(last=False)
    return tail.run(vals, prof)

  def _continue(self, values: dict[str, np.ndarray]) -> Tail:
    """The rest of the graph for these values: converted, cut into steps, compiled; or a refusal any run with them raises.
    A failure of the machine (out of memory) is raised, not kept: another run may succeed."""
    known = {**self.before, **values}
    where = f"the model from {self.cut.label} on, converted at run time for {describe(known)}"
    try:
      outs, body = self.cut.resume({**self.cut.env, **values})
      child = Builder(Weights(self._builder.weights.device, self._builder.weights, self._shared))
      tail = child.tail([o.node if isinstance(o, Tensor) else o for o in outs or []], body, dict(self._done))
      if tail.then is not None: tail.then.before = known
      return tail
    except ONNXError as e: why = f"{e} ({where})"
    except GraphError as e: why = f"compiling {where} failed: {e}"
    except RecursionError: why = f"compiling {where} failed: a chain of fused operations is too deep for kiln.graph's renderer"
    except KilnError as e: raise ONNXError(f"compiling {where} failed: {type(e).__name__}: {e}") from e
    return Tail([Refusal(why)], [])
