"""compile(..., cache=KEY): a compiled graph kept whole in the plan cache (kiln.executor.plan_cache), so compiling the same
graph again (a language model's plans in a new process) rebuilds its plan from the stored PlanSpec instead of
scheduling, rendering and looking up each kernel again.

The key has two parts. The caller's KEY vouches for what kiln cannot check cheaply: the contents of the graph's
constant arrays (kiln.llm: the checkpoint file's sha256 and the code that makes arrays of it). kiln adds the rest:

| part of the key                                     | why                                                        |
|-----------------------------------------------------|------------------------------------------------------------|
| the graph's structure: each node's op, sources, argument, shape, dtype; a constant's shape and dtype | a key blind to a graph change misses |
| the device, its target key (kiln.executor.cache.target_key), `fuse` | the CPU target, the kiln versions and code stamps below graph |
| each bound input's name, dtype, size and byte offset | the caller's buffers the plan reads and writes in place    |
| kiln.graph's and kiln.executor's code stamps, numpy's version, the plan-shaping KILN_* settings (plan_keys.py) | they schedule the graph |

Constants are not stored twice: a weight of the stored spec whose sha256 is that of one of the graph's constant arrays
is recorded as that constant's place in the graph (the n-th constant in topological order) and taken from the graph on
a hit; only arrays the scheduler made (none today in an LLM's plans) go into the entry's weights file. Bound inputs
(compile(bind=)) are spec inputs, never weights: a hit binds the caller's buffers of this call in their place.

Kept when: the plan cache is on, every node's argument has a stable text (else the key would differ in every process),
and the plan exports (one device, no host functions). Symbolic dims are kept as polynomials in their variables with the
variables' bounds (dims.to_json), so one entry serves every size within them, as the compiled graph did. A hit's
Compiled has no scheduled kernels (`kernels` is empty, as a cached ONNX model's).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.codegen.spec import DeviceSpec
from kiln.executor import debug, plan_cache
from kiln.graph.dims import from_json, to_json
from kiln.graph.lazy import Node, toposort
from kiln.graph.plan_keys import shaping_settings, stamp
from kiln.graph.schedule import Compiled, _Input, compile_nodes
from kiln.ir.dtype import DType, dtypes
from kiln.ir.uop import UOp

FORMAT = "kiln-compile 1"


class _Unkeyable(Exception):
  """A node argument with no text that is the same in every process."""


_ATOMS = (int, str, bool, float, type(None))  # repr is exact for these (an int's and a bool's differ: 1, True)


def _text(x: Any) -> str:
  """x as text that is equal exactly when x is, in any process."""
  t = type(x)
  if t in _ATOMS: return repr(x)
  if t is tuple or t is list: return f"{t.__name__}({','.join([repr(v) if type(v) in _ATOMS else _text(v) for v in x])})"
  if isinstance(x, UOp): return f"U{x.key}"
  if isinstance(x, np.integer | np.floating | np.bool_): return f"{t.__name__}({x!r})"
  if isinstance(x, DType): return f"D{x.name}"
  if isinstance(x, enum.Enum): return f"{t.__name__}.{x.name}"
  if isinstance(x, (tuple, list)): return f"{t.__name__}({','.join(_text(v) for v in x)})"  # a NamedTuple
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return f"{type(x).__name__}({','.join(_text(getattr(x, f.name)) for f in dataclasses.fields(x))})"
  raise _Unkeyable(type(x).__name__)


def structure(roots: Sequence[Node]) -> tuple[str, list[np.ndarray]]:
  """The graph's structure as one sha256 (constants by shape and dtype, not bytes), and its constant arrays in
  topological order."""
  h = hashlib.sha256()
  index: dict[Node, int] = {}
  consts: list[np.ndarray] = []
  for i, n in enumerate(toposort(list(roots))):
    index[n] = i
    if n.op == "BUFFER":
      data = n.arg.data
      if data is not None:
        arg = f"const{len(consts)}:{data.dtype.str}{data.shape}"
        consts.append(data)
      else: arg = f"input:{n.arg.name!r}"
    else: arg = _text(n.arg)
    h.update(f"{n.op}|{','.join(str(index[s]) for s in n.src)}|{arg}|{_text(n.shape)}|{n.dtype.name}|{n.realize}\n".encode())
  return h.hexdigest(), consts


def compile_kept(caller: str, outputs: Sequence[Node], device: str, fuse: bool, bind: Mapping[str, Any], writes: Sequence[Node]) -> Compiled:
  """schedule.compile_nodes(outputs, device, fuse, bind, writes), taken from the plan cache where the same graph was kept
  under the caller's key, else compiled and kept there."""
  dev = str(DeviceSpec.parse(device))
  kept = key_of(caller, [*outputs, *writes], dev, fuse, bind)
  if kept is not None and (hit := cached(kept[0], kept[1], bind)) is not None: return hit
  compiled = compile_nodes(outputs, dev, fuse, bind, writes)
  if kept is not None: keep(kept[0], compiled, kept[1])
  return compiled


def key_of(caller: str, roots: Sequence[Node], device: str, fuse: bool, bind: Mapping[str, Any]) -> tuple[str, list[np.ndarray]] | None:
  """The plan cache key of compiling these roots (outputs and writes) with the caller's key, and the graph's constants; None
  when it is not kept (the cache is off, an argument without a stable text)."""
  if not plan_cache.enabled(): return None
  from kiln.codegen.registry import get_runtime
  from kiln.executor.cache import target_key
  try: shape, consts = structure(roots)
  except _Unkeyable as e:
    if debug.DEBUG >= 1: debug.emit(f"kiln: compile(cache=) not kept: a node's argument is a {e} (no stable text)")
    return None
  bound = sorted((name, b.dtype.name, b.size, b.offset) for name, b in bind.items())
  parts = [FORMAT, caller, shape, device, target_key(device, get_runtime(device)), f"fuse={fuse}", repr(bound),
           f"graph+{stamp('kiln.graph')}", f"executor+{stamp('kiln.executor')}", f"numpy={np.__version__}", shaping_settings()]
  return "\n".join(parts), consts


def _digests(consts: list[np.ndarray], sizes: set[int]) -> dict[str, int]:
  """sha256 -> the index of a constant with those bytes, for the constants of a size some weight has."""
  out: dict[str, int] = {}
  for i, a in enumerate(consts):
    if a.nbytes in sizes: out.setdefault(hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data).hexdigest(), i)
  return out


def describe(c: Compiled) -> dict[str, Any] | None:
  """What a Compiled holds beside its plan, as JSON (shapes with their symbolic dims: dims.to_json), or None where it cannot
  be written (a variable not int32). compile_cache and onnx_plan_cache keep it with the plan; rebuild() undoes it."""
  if any(v.dtype != dtypes.int32 for v in c.variables.values()): return None  # dims.variable's: rebuilt as one
  return {"inputs": [[i.name, i.buf, [to_json(d) for d in i.shape], np.dtype(i.dtype).str, bool(i.bfloat16)] for i in c.inputs],
          "outputs": [[b, [to_json(d) for d in s]] for b, s in c.outputs], "checks": [[b, msg] for b, msg in c.checks],
          "variables": [to_json(v) for v in c.variables.values()], "sizes": [to_json(d) for d in c.sizes], "bound": c.bound}


def rebuild(plan: Any, meta: Mapping[str, Any]) -> Compiled:
  """The Compiled that describe() wrote, over the rebuilt plan (no scheduled kernels: `kernels` is empty)."""
  inputs = [_Input(n, b, tuple(from_json(d) for d in s), np.dtype(dt), bf) for n, b, s, dt, bf in meta["inputs"]]
  variables = {v.arg[0]: v for v in (from_json(x) for x in meta["variables"]) if isinstance(v, UOp)}
  return Compiled(plan, inputs, [(b, tuple(from_json(d) for d in s)) for b, s in meta["outputs"]], [], variables,
                  [(b, m) for b, m in meta["checks"]], [from_json(d) for d in meta["sizes"]], meta["bound"])


def keep(key: str, compiled: Compiled, consts: list[np.ndarray]) -> bool:
  """Store the compiled graph under key; False when it is not kept (see the module docstring)."""
  from kiln.executor.planspec import export
  c = compiled
  if (described := describe(c)) is None: return False
  try: spec, arrays = export(c.plan, {**{i.name: i.buf for i in c.inputs}, **c.bound}, {f"output{i}": b for i, (b, _) in enumerate(c.outputs)},
                             checks=c.checks)
  except Exception as e:  # a plan a spec cannot carry: compiled as before, not kept
    if debug.DEBUG >= 1: debug.emit(f"kiln: compile(cache=) not kept: {type(e).__name__}: {str(e)[:160]}")
    return False
  refs = {st.weight.key: st.weight for st in spec.storages if st.weight is not None and st.weight.kind == "object"}
  found = _digests(consts, {r.nbytes for r in refs.values()})
  from_graph = {k: found[r.sha256] for k, r in refs.items() if r.sha256 in found}
  meta = {**described, "consts": from_graph, "n_consts": len(consts)}
  return plan_cache.store(key, spec, {k: a for k, a in arrays.items() if k not in from_graph}, meta)


def cached(key: str, consts: list[np.ndarray], bind: Mapping[str, Any]) -> Compiled | None:
  """The compiled graph kept under key, rebuilt over this graph's constants and the caller's bound buffers, or None."""
  from kiln.executor.planspec import builder_from_spec
  hit = plan_cache.load(key)
  if hit is None: return None
  meta = hit.meta
  try:
    if meta["n_consts"] != len(consts): raise ValueError(f"the entry's graph has {meta['n_consts']} constants, this one {len(consts)}")
    weights = {**hit.weights, **{k: consts[i] for k, i in meta["consts"].items()}}
    plan = builder_from_spec(hit.spec, weights, code="sealed", verify=False, bound={n: bind[n] for n in meta["bound"]}).build()
    compiled = rebuild(plan, meta)
  except Exception as e:  # an entry that no longer builds here: forget it, compile afresh
    if debug.DEBUG >= 1: debug.emit(f"kiln: compile(cache=) entry not used ({type(e).__name__}: {str(e)[:160]}); compiling the graph")
    plan_cache.remove(key)
    return None
  return compiled
