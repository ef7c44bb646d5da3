"""The ONNX operators for control flow: If, Loop and Scan, in FLOW: the loader (onnx.py) calls them with the conversion's
context and scope, which they need to convert their subgraphs. They are listed in onnx_ops.OPS too, with their attributes,
so that OPS names every operator kiln converts.

| op   | known at load                          | what kiln does                                                                |
|------|----------------------------------------|-------------------------------------------------------------------------------|
| If   | the condition (a constant, or folded from static shapes: the usual torch export) | converts the branch taken, in place |
| If   | nothing (computed at run time)         | converts both: constant outputs of one shape are a Where, else a run-time branch (program.py) |
| If   | nothing; a branch reads a value back, or outputs differ in shape | cut on the condition, the rest converted for each (specialise.py) |
| Loop | trip count M and each iteration's condition | unrolled: the body once per iteration, carried values passed on, scan outputs stacked |
| Loop | M or a condition computed at run time | a run-time loop (program.RunLoop): the body compiled once, each run steps it |
| Scan | the sequence length (opset 9 on)       | unrolled the same way, each input sliced along its axis, in its direction      |

A run-time loop's body reads its iteration number, condition and carried values from slots, and the outer Tensors it
reads through placeholders (captures, as a run-time If's branches do); each carried value keeps its shape and dtype; a
LoopStep copies the next values back after each iteration and reads the body's condition (a host read, as a Switch's).
Scan outputs of a run-time loop (in the main graph, or a branch of an If known at load) are written row by row into slots
with room for its bound (M where known at load, else what onnx_limits.MAX_SCAN_BYTES allows), and the iterations run are a
length read back after it (specialise.py): the rest of the model is compiled once, at load, with the scan outputs that many
rows long. A body that cannot be converted once for every iteration (a Slice at its iteration number, a carried value that
changes shape) is unrolled instead, for each trip count read back (compiled per value, cached); with a condition the body
computes at run time that is refused, naming why.
Unrolled iterations count against onnx_limits' MAX_UNROLLED_STEPS with the recurrent operators' steps. Each iteration's
carried Tensors are realized (a buffer each), so an unrolled chain never fuses into one deep expression.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import onnx_limits as lim
from kiln.graph.lazy import Node, ONNXError
from kiln.graph.onnx_empty import is_empty
from kiln.graph.onnx_ops import OPS, OnnxNode, Value
from kiln.graph.onnx_scope import Ctx, Scope, outer_names
from kiln.graph.program import MAX_LOOP_ITERATIONS, Body, Branch, RunLoop, placeholder
from kiln.graph.specialise import Length, RuntimeValue
from kiln.graph.tensor import Tensor
from kiln.ir.dtype import dtypes

Handler = Callable[[OnnxNode, Ctx, dict[str, Value]], list[Value]]


def initializers(n: OnnxNode, ctx: Ctx, graph: Any, where: str) -> dict[str, Value]:
  """A subgraph's initializers, read once (an unrolled loop binds the same arrays in every iteration)."""
  return {t.name: ctx.stored.array(t, f"node {n.name} > {where}: initializer {t.name[:64]!r}") for t in graph.initializer}


def run_graph(n: OnnxNode, ctx: Ctx, graph: Any, where: str, binds: list[Value], env: dict[str, Value], body: Body | None = None,
              inits: dict[str, Value] | None = None, folded: bool = False) -> list[Value]:
  """Convert a subgraph of node n (`where`: its attribute, e.g. 'then_branch' or 'body (iteration 3)') in a scope of its own
  over env, its inputs bound to binds; its outputs' values. body: where its run-time branches are recorded (default: the
  enclosing scope's, as for an unrolled loop's body). inits: its initializers, if already read; folded: the branch an If known at load takes."""
  sub = ctx.sub(f"{n.name} > {where}", body, folded)
  if len(binds) != len(graph.input): raise n.error(f"{where} takes {len(graph.input)} inputs, {n.op} gives it {len(binds)}")
  scope = Scope(env)
  scope.update(initializers(n, ctx, graph, where) if inits is None else inits)
  for vi, v in zip(graph.input, binds): scope[vi.name] = v
  ctx.convert(graph, scope, sub)
  outs = []
  for vo in graph.output:
    if vo.name not in scope: raise n.error(f"{where}: output {vo.name!r} is produced by no node")
    outs.append(scope[vo.name])
  return outs


def _one(n: OnnxNode, v: Value, what: str) -> Value:
  """A single-element value (a condition or a count); numpy for a constant."""
  if isinstance(v, np.ndarray):
    if v.dtype == object: raise n.error(f"{what} holds symbolic dims of a Shape, known only at run time")
    if v.size != 1: raise n.error(f"{what} must hold one element, got shape {v.shape}")
    return v
  if v.numel != 1: raise n.error(f"{what} must hold one element, got shape {v.shape}")
  return v


def _captures(env: dict[str, Value], *graphs: Any) -> list[tuple[str, Tensor]]:
  """The outer Tensors the subgraphs read (name, value), by name: what a run-time If's branches or loop body capture."""
  names = sorted(set().union(*(outer_names(g) for g in graphs)))
  return [(name, v) for name in names if name in env and isinstance(v := env[name], Tensor)]


def _captured(env: dict[str, Value], caps: list[tuple[str, Tensor]]) -> tuple[Scope, list[Node]]:
  """A scope over env that reads each capture through a placeholder of its own (another step computed it: the subgraph
  is compiled as steps of its own), and those placeholders, in caps' order."""
  scope = Scope(env)
  held = [placeholder(v.shape, v.dtype) for _, v in caps]
  for (name, _), p in zip(caps, held): scope[name] = Tensor(p)
  return scope, held


def _as_tensor(n: OnnxNode, k: int, attr: str, v: Value) -> Tensor:
  if isinstance(v, Tensor): return v
  if v.dtype == object: raise n.error(f"output {k} of {attr} is a Shape with symbolic dims, in a branch chosen at run time (not supported)")
  return Tensor(v)


def _if(n: OnnxNode, ctx: Ctx, env: dict[str, Value]) -> list[Value]:
  c = n.ins[0] if n.ins else None
  if c is None: raise n.error("input 0 (cond) is missing")
  c = _one(n, c, "input 0 (cond)")
  graphs = {"then_branch": n.attr("then_branch"), "else_branch": n.attr("else_branch")}
  if any(g is None for g in graphs.values()): raise n.error("attributes then_branch and else_branch are required")
  if isinstance(c, np.ndarray):  # known at load: only the branch taken is converted (the other may not even convert)
    attr = "then_branch" if bool(c.reshape(-1)[0]) else "else_branch"
    try: return run_graph(n, ctx, graphs[attr], attr, [], env, folded=True)
    except RuntimeValue as e:  # a value the branch reads back: the rest of the branch, then of the graph, resume for it (onnx.py)
      e.frames.append((n.proto, graphs[attr]))
      raise
  if not c.dtype.is_bool: raise n.error(f"input 0 (cond) must be bool, got {c.dtype.name}")
  caps = _captures(env, *graphs.values())
  bodies: list[Body] = []
  outs: list[list[Value] | None] = []
  failed: list[ONNXError] = []
  for attr, g in graphs.items():
    scope, held = _captured(env, caps)
    body = Body(inputs=held)
    bodies.append(body)
    try: outs.append(run_graph(n, ctx, g, attr, [], scope, body))
    except ONNXError as e:  # a branch for other inputs (Silero's 8 kHz branch fed 16 kHz frames): refused if a run takes it
      body.refused, body.branches = f"node {n.name} (If) took its {attr}, which kiln could not convert at load: {e}", []
      outs.append(None)
      failed.append(e)
  if ctx.cuts and any(isinstance(e, RuntimeValue) for e in failed): _cut_on(n, c, "a branch reads a value back")
  if len(failed) == 2: raise failed[0]
  want = len(n.proto.output)
  for attr, vals in zip(graphs, outs):
    if vals is not None and len(vals) != want: raise n.error(f"{attr} gives {len(vals)} outputs; the node has {want}")
  if ctx.cuts:
    if outs[0] is not None and outs[1] is not None:
      for k, (a, b) in enumerate(zip(*outs)):
        if tuple(a.shape) != tuple(b.shape):
          _cut_on(n, c, f"output {k} is {sym.fmt_shape(a.shape)} in then_branch, {sym.fmt_shape(b.shape)} in else_branch")
    if any(is_empty(v) for vals in outs for v in vals or []): _cut_on(n, c, "a branch gives an empty output")  # no Tensor holds one
  ts = [None if vals is None else [_as_tensor(n, k, attr, v) for k, v in enumerate(vals)] for attr, vals in zip(graphs, outs)]
  then, other = (t or ts[1 - i] for i, t in enumerate(ts))
  assert then is not None and other is not None
  for k, (a, b) in enumerate(zip(then, other)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise n.error(f"output {k} is {a.dtype.name} {tuple(a.shape)} in then_branch and {b.dtype.name} {tuple(b.shape)} in else_branch: a "
                    "branch chosen at run time must give each output one shape and dtype (kiln has no data-dependent shapes)")
  cond = c.reshape(())
  if not failed and all(isinstance(v, np.ndarray) for vals in outs for v in vals or []):  # constants: a select (nothing computes or checks)
    return [cond.where(a, b) for a, b in zip(then, other)]
  phs = [placeholder(t.shape, t.dtype) for t in then]
  for body, t in zip(bodies, ts): body.outputs = [] if t is None else [v.node for v in t]
  ctx.body.branches.append(Branch(f"node {n.name} (If)", c.node, [v.node for _, v in caps], bodies[0], bodies[1], phs))
  return [Tensor(p) for p in phs]


def _cut_on(n: OnnxNode, c: Tensor, why: str) -> None:
  """Raise the RuntimeValue that cuts the main graph before If n, on its condition c: the rest of the graph is converted for
  each value of c (two continuations, both compiled at load: specialise.py), where the If folds to its branch. Chosen where
  a run-time branch cannot be a Switch (why): a branch reads a value back (torchvision's batched_nms on 'no boxes?'), or an
  output's shape differs by branch."""
  text = f"input 0 (cond) is computed at run time, and {why}"
  raise RuntimeValue(str(n.error(f"{text}: kiln converts the rest of a model for each condition only in its main graph (or a branch of "
                                 "an If known at load), not inside a Loop or Scan body or a run-time If's branch")), n, 0, text)


def _carry(v: Value) -> Value:
  """A value passed to the next iteration: a Tensor gets a buffer of its own (an unrolled chain stays shallow and each
  iteration's work is done once, not inlined into every reader)."""
  return v.contiguous() if isinstance(v, Tensor) else v


def _stack(n: OnnxNode, what: str, vals: list[Value], axis: int) -> Value:
  """The per-iteration values of a scan output side by side along a new axis (numpy when all are constants)."""
  shapes = [tuple(v.shape) for v in vals]
  if other := next((s for s in shapes if s != shapes[0]), None): raise n.error(f"{what} changes shape between iterations: {shapes[0]}, then {other}")
  rank = len(shapes[0]) + 1
  if not -rank <= axis < rank: raise n.error(f"{what}: axis {axis} is out of range for rank {rank}")
  if all(isinstance(v, np.ndarray) for v in vals):
    if any(v.dtype == object for v in vals): raise n.error(f"{what} holds symbolic dims of a Shape (not supported)")
    out = np.stack([np.asarray(v) for v in vals], axis % rank)
    n.budget.fold(f"node {n.name} ({n.op})", [out], [])
    return out
  return Tensor.stack([v if isinstance(v, Tensor) else Tensor(v) for v in vals], axis % rank)


def _at_run_time(n: OnnxNode, what: str, why: str) -> Exception:
  return n.error(f"{what} is computed at run time: kiln unrolls a {n.op} at load time, so {why} must be known then (a loop run a "
                 "number of times known only at run time is not supported)")


def _flag(n: OnnxNode, v: Value, what: str, why: str) -> bool:
  v = _one(n, v, what)
  if isinstance(v, Tensor): raise _at_run_time(n, what, why)
  return bool(v.reshape(-1)[0])


def _loop(n: OnnxNode, ctx: Ctx, env: dict[str, Value]) -> list[Value]:
  """for (i = 0; i < M && cond; ++i) cond, v... = body(i, cond, v...), unrolled (M and cond optional, not both absent)."""
  body = n.attr("body")
  if body is None: raise n.error("attribute body is required")
  m = n.ins[0] if n.ins else None
  c = n.ins[1] if len(n.ins) > 1 else None
  carried = [v for v in n.ins[2:] if v is not None]
  if len(carried) < len(n.ins) - 2: raise n.error("a loop-carried input is missing")
  if len(body.output) >= 1 + len(carried) == len(body.input) - 1 and (isinstance(m, Tensor) or isinstance(c, Tensor)) and 0 not in n.from_shape \
      and (len(body.output) == 1 + len(carried) or ctx.cuts):
    try: return _run_time_loop(n, ctx, env, body, m, c, carried)  # one body, compiled once, stepped by each run
    except ONNXError as e:  # a body that needs its iteration number as a constant (a Slice at i): unrolled per value below
      if isinstance(e, RuntimeValue) and e.node is n: raise  # the iterations read back after the loop: the cut, not a failure
  trips = None
  if m is not None:
    _one(n, m, "input 0 (M, the trip count)")
    mv = n.const(0, "M, the trip count")  # computed at run time: read back by a run, which unrolls the rest for it (specialise.py)
    if mv.dtype.kind not in "iu": raise n.error(f"input 0 (M, the trip count) must be an integer, got {mv.dtype}")
    trips = max(int(mv.reshape(-1)[0]), 0)
  go = True if c is None else _flag(n, n.const(1, "cond") if isinstance(c, Tensor) else c, "input 1 (cond)", "the condition")  # as M
  if m is None and c is None: raise n.error("neither a trip count nor a condition: the loop would never end")
  n_carried, n_out = len(carried), len(body.output)
  if len(body.input) != 2 + n_carried or n_out < 1 + n_carried:
    raise n.error(f"body takes {len(body.input)} inputs and gives {n_out} outputs; with {n_carried} loop-carried values it must take "
                  f"{2 + n_carried} (iteration number, condition, the values) and give at least {1 + n_carried}")
  scans: list[list[Value]] = [[] for _ in range(n_out - 1 - n_carried)]
  inits = initializers(n, ctx, body, "body")
  first, recorded = list(carried), len(ctx.body.branches)
  i = 0
  while go and (trips is None or i < trips):
    ctx.budget.unroll(f"node {n.name} (Loop)", 1)
    outs = run_graph(n, ctx, body, f"body (iteration {i})", [np.array(i, np.int64), np.array(go), *carried], env, inits=inits)
    carried = [_carry(v) for v in outs[1:1 + n_carried]]
    for k, v in enumerate(outs[1 + n_carried:]): scans[k].append(v)
    i += 1
    if trips is None or i < trips:  # the body's condition decides whether another runs (with no cond input too, as onnxruntime)
      if isinstance(outs[0], Tensor) and (not scans or ctx.cuts):  # computed at run time: a run-time loop, the unrolled start dropped
        del ctx.body.branches[recorded:]
        return _run_time_loop(n, ctx, env, body, m, c, first)
      go = _flag(n, outs[0], f"the condition the body gives at iteration {i - 1}", "each iteration's condition")
  if scans and i == 0: raise n.error("the loop runs no iteration, so its scan outputs would be empty (kiln has no empty tensors)")
  return carried + [_stack(n, f"scan output {k}", vals, 0) for k, vals in enumerate(scans)]


def _run_time_loop(n: OnnxNode, ctx: Ctx, env: dict[str, Value], body: Any, m: Value | None, c: Value | None, carried: list[Value]) -> list[Value]:
  """A Loop whose trip count or condition is computed at run time: its body converted once over placeholders (the iteration
  number, the condition, the carried values, the outer Tensors it reads) and recorded as a RunLoop, which program.py
  compiles once and each run steps (the body's own condition read back per iteration). Each carried value keeps its shape
  and dtype from one iteration to the next. Scan outputs (main graph only) are written row by row into slots with room
  for `bound` iterations; the iterations run are a length read back after the loop (specialise.py), so the rest of the
  graph is compiled once, with the scan outputs that many rows long. A continuation converting the Loop again finds the
  loop the prefix ran (ctx.loops) and reads its slots."""
  if (made := ctx.loops.get(id(n.proto))) is not None: return _scanned(n, *made)
  label = f"node {n.name} (Loop)"
  if m is not None and not (m.dtype.is_int if isinstance(m, Tensor) else m.dtype.kind in "iu"):
    raise n.error(f"input 0 (M, the trip count) must be an integer, got {m.dtype}")
  if isinstance(c, Tensor) and not c.dtype.is_bool: raise n.error(f"input 1 (cond) must be bool, got {c.dtype.name}")
  ts = [_as_tensor(n, k, "the loop-carried inputs", v) for k, v in enumerate(carried)]
  caps = _captures(env, body)
  it, go = placeholder((), dtypes.int64), placeholder((), dtypes.bool)
  phs = [placeholder(t.shape, t.dtype) for t in ts]
  scope, held = _captured(env, caps)
  inner = Body(inputs=[it, go, *phs, *held])
  outs = run_graph(n, ctx, body, "body", [Tensor(it), Tensor(go), *[Tensor(p) for p in phs]], scope, inner, initializers(n, ctx, body, "body"))
  cond = _one(n, outs[0], "the condition the body gives")
  nxt = [_as_tensor(n, k + 1, "body", v) for k, v in enumerate(outs[1:])]
  for k, (a, b) in enumerate(zip(ts, nxt)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise n.error(f"loop-carried value {k} is {a.dtype.name} {tuple(a.shape)} before an iteration and {b.dtype.name} {tuple(b.shape)} after: "
                    "a loop run at run time keeps each carried value's shape and dtype")
  inner.outputs = [_as_tensor(n, 0, "body", cond).cast(dtypes.bool).reshape(()).node, *[t.node for t in nxt]]
  mt = m.reshape(1) if isinstance(m, Tensor) else None
  ct = c.reshape(1) if isinstance(c, Tensor) else None
  ends = [placeholder(t.shape, t.dtype) for t in ts]
  rows = nxt[len(ts):]
  max_trips = max(int(m.reshape(-1)[0]), 0) if isinstance(m, np.ndarray) else None
  bound = _scan_bound(n, rows, max_trips) if rows else 0
  scans = [placeholder((bound, *r.shape), r.dtype) for r in rows]
  count = placeholder((1,), dtypes.int64) if rows else None
  ctx.body.branches.append(RunLoop(label, None if mt is None else mt.node, max_trips, None if ct is None else ct.node,
                                   True if c is None or ct is not None else bool(np.asarray(c).reshape(-1)[0]),
                                   [t.node for t in ts], [v.node for _, v in caps], inner, ends, scans, count, bound))
  if not rows: return [Tensor(p) for p in ends]
  assert count is not None
  ctx.loops[id(n.proto)] = (ends, scans, count, bound)
  return _scanned(n, ends, scans, count, bound)


def _scan_bound(n: OnnxNode, rows: list[Tensor], max_trips: int | None) -> int:
  """The iterations a run-time loop's scan outputs have room for: its trip count where known at load, else as many rows
  as the largest scan output's MAX_SCAN_BYTES allow (at most MAX_LOOP_ITERATIONS); a run past it is refused by its step."""
  for k, r in enumerate(rows):
    if not sym.is_static(r.shape):
      raise n.error(f"scan output {k} is {sym.fmt_shape(r.shape)} per iteration: a loop run at run time needs its scan rows of a fixed shape")
  row_bytes = max(max(int(np.prod(sym.static_shape("a scan row", r.shape), dtype=np.int64)) * r.dtype.itemsize for r in rows), 1)
  room = min(MAX_LOOP_ITERATIONS, max(lim.MAX_SCAN_BYTES // row_bytes, 1))
  return max(min(room, max_trips) if max_trips is not None else room, 1)


def _scanned(n: OnnxNode, ends: list[Node], scans: list[Node], count: Node, bound: int) -> list[Value]:
  """A run-time loop's outputs: the carried values' last values, then each scan output's first `iterations` rows, that
  length read back after the loop (the first conversion raises RuntimeValue there: the cut; the continuation's gets a
  variable in [0, bound])."""
  its = n.read_back("the iterations of the loop", [Tensor(count)], length=Length(bound))
  return [*(Tensor(p) for p in ends), *(Tensor(p)[:its] for p in scans)]


def _slice(v: Value, axis: int, t: int) -> Value:
  if isinstance(v, np.ndarray): return np.take(v, t, axis)
  return v.slice([t], [t + 1], [axis]).squeeze(axis)


def _scan(n: OnnxNode, ctx: Ctx, env: dict[str, Value]) -> list[Value]:
  """Scan (opset 9 on): the body over slices of the scan inputs along their axes, in their directions, states carried,
  the scan outputs stacked along theirs; unrolled over the (static) sequence length."""
  if n.opset < 9: raise n.error("Scan before opset 9 (a batch axis and sequence_lens) is not supported")
  body, m = n.attr("body"), n.attr("num_scan_inputs")
  if body is None or m is None: raise n.error("attributes body and num_scan_inputs are required")
  ins = [v for v in n.ins if v is not None]
  if len(ins) < len(n.ins): raise n.error("an input is missing")
  n_state = len(ins) - m
  if not 1 <= m <= len(ins): raise n.error(f"num_scan_inputs={m} does not fit its {len(ins)} inputs")
  n_scan_out = len(body.output) - n_state
  if len(body.input) != len(ins) or n_scan_out < 0:
    raise n.error(f"body takes {len(body.input)} inputs and gives {len(body.output)} outputs; the node has {len(ins)} inputs, {n_state} states")
  def ints(name: str, count: int, allowed: tuple[int, ...] | None = None) -> list[int]:
    v = [int(x) for x in (n.attr(name) or [0] * count)]
    if len(v) != count: raise n.error(f"attribute {name} has {len(v)} values for {count}")
    if allowed is not None and any(x not in allowed for x in v): raise n.error(f"attribute {name} takes {' or '.join(map(str, allowed))}, got {v}")
    return v
  in_axes, in_dirs = ints("scan_input_axes", m), ints("scan_input_directions", m, (0, 1))
  out_axes, out_dirs = ints("scan_output_axes", n_scan_out), ints("scan_output_directions", n_scan_out, (0, 1))
  states, xs = ins[:n_state], ins[n_state:]
  lengths = set()
  for k, (x, a) in enumerate(zip(xs, in_axes)):
    if not -x.ndim <= a < x.ndim: raise n.error(f"scan_input_axes[{k}]={a} is out of range for rank {x.ndim}")
    in_axes[k] = a % x.ndim
    if not isinstance(d := x.shape[in_axes[k]], int): raise n.error(f"scan input {k}'s sequence axis {a} is symbolic (kiln unrolls a Scan at load)")
    lengths.add(d)
  if len(lengths) != 1: raise n.error(f"the scan inputs' sequence lengths differ: {sorted(lengths)}")
  steps = lengths.pop()
  scans: list[list[Value]] = [[] for _ in range(n_scan_out)]
  inits = initializers(n, ctx, body, "body")
  for t in range(steps):
    ctx.budget.unroll(f"node {n.name} (Scan)", 1)
    slices = [_slice(x, a, steps - 1 - t if d else t) for x, a, d in zip(xs, in_axes, in_dirs)]
    outs = run_graph(n, ctx, body, f"body (iteration {t})", [*states, *slices], env, inits=inits)
    states = [_carry(v) for v in outs[:n_state]]
    for k, v in enumerate(outs[n_state:]): scans[k].append(v)
  if scans and steps == 0: raise n.error("the sequence is empty, so the scan outputs would be empty (kiln has no empty tensors)")
  return states + [_stack(n, f"scan output {k}", vals[::-1] if d else vals, a) for k, (vals, a, d) in enumerate(zip(scans, out_axes, out_dirs))]


FLOW: dict[str, tuple[Handler, frozenset[str]]] = {
  "If": (_if, frozenset({"then_branch", "else_branch"})),
  "Loop": (_loop, frozenset({"body"})),
  "Scan": (_scan, frozenset({"body", "num_scan_inputs", "scan_input_axes", "scan_input_directions", "scan_output_axes", "scan_output_directions"})),
}


def _by_the_loader(n: OnnxNode) -> Value:
  raise n.error("is converted by the loader, which hands it its scope (onnx_ops_flow.FLOW)")


for _op, (_, _attrs) in FLOW.items(): OPS[_op] = (_by_the_loader, _attrs)
