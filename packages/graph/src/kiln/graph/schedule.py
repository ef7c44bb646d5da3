"""The scheduler: which nodes get a buffer of their own (are *realized*) and become kernels, and the ExecutionPlan built
from them.

Every node that is not realized is inlined into each kernel that reads it (kernelize.py). Starting from the outputs
alone, kernels are rendered and checked; a node that breaks one of realize_rules.py's rules is realized and the kernels
are rendered again, until no rule is broken. Only the topmost offending node on each path is realized per round, and a
realized REDUCE takes its epilogue along (realize_rules.lift). Before all this, the chain after a conv's realized product
moves into the product's kernel when its readers read each element at least once (epilogue.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.codegen.spec import DeviceSpec
from kiln.executor.checks import CheckReader
from kiln.executor.planspec import export
from kiln.executor.portable import in_plan_dtype
from kiln.graph import progress
from kiln.graph.cat_place import place_cats
from kiln.graph.dims import (
  bind_dims,
  capped_names,
  check_sizes,
  evaluate,
  fmt,
  fmt_shape,
  is_mono,
  is_static,
  mono,
  negative,
  source_of,
  variables,
  with_capped,
)
from kiln.graph.epilogue import fuse_epilogues
from kiln.graph.index_check import gather_checks
from kiln.graph.kernelize import Kernel, Kernelizer, stored_dtype
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, Node, consumers, toposort
from kiln.graph.realize_rules import analysis_of, lift, offenders, sibling_reductions
from kiln.graph.windows import Window, read_windows
from kiln.ir.dtype import DType, PtrDType, dtypes
from kiln.ir.kernels import Dim
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp


def schedule(outputs: Sequence[Node], fuse: bool = True, max_rounds: int = 1000, stored: Callable[[Node], DType] | None = None) -> list[Kernel]:
  """Kernels computing every output (and every node the rules realize), in an order that respects their reads; `stored`
  gives a realized node's buffer dtype (kernelize.stored_dtype)."""
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
        kernels[n] = Kernelizer(n, realized, stored).kernel()
    kernels_of: dict[Node, int] = {}
    for k in kernels.values():
      for n in k.rendered:
        if n is not k.node: kernels_of[n] = kernels_of.get(n, 0) + 1
    new = offenders(kernels, cons, realized, None)
    if not new:  # a REDUCE inlined into several kernels is judged only once everything else is settled
      new = offenders(kernels, cons, realized, kernels_of)
    if not new:  # and reductions side by side only in the kernels that settled (the first round inlines whole layers)
      new = {lift(n, cons, realized) for k in kernels.values() for n in sibling_reductions(k)} - realized
    if not new:
      out = [kernels[n] for n in sorted(kernels, key=order.__getitem__)]
      for k in out: k.analysis = None  # the rounds' working state: a compiled plan kept every kernel's (tens of MB)
      analysis_of.cache_clear()
      return out
    realized |= new
  raise GraphError(f"schedule: no fixed point after {max_rounds} rounds")


@dataclass
class _Input:
  name: str; buf: int; shape: tuple[Dim, ...]; dtype: np.dtype; bfloat16: bool = False  # dtype: numpy's (bfloat16: its uint16 bits)


class Compiled:
  """A graph compiled to an ExecutionPlan: `run(feeds)` copies the inputs in, executes, and returns the outputs.

  A graph with symbolic dims is compiled once for every size in their bounds: run() reads each variable's value off the
  fed arrays' shapes, checks it against the other inputs and the bounds, and runs the plan with those values (no
  kernel is compiled again); the outputs come back at the actual size.

  `checks` are (plan buffer, message) pairs read after every run (index_check.py: a Gather's indices); a nonzero one
  is an IndexOutOfRangeError instead of the outputs."""

  def __init__(self, plan, inputs: list[_Input], outputs: list[tuple[int, tuple[Dim, ...]]], kernels: list[Kernel],  # type: ignore[no-untyped-def]
               variables: Mapping[str, UOp] | None = None, checks: Sequence[tuple[int, str]] = (), sizes: Sequence[Dim] = (),
               bound: Mapping[str, int] | None = None):
    self.plan, self.inputs, self.outputs, self.kernels = plan, inputs, outputs, kernels
    self.bound = dict(bound or {})  # compile(bind=)'s input names -> the plan buffers of the caller's Buffers
    self.variables: dict[str, UOp] = dict(variables or {})  # name -> UOp.variable(name, lo, hi)
    self._capped = capped_names(self.variables)  # bound from their sources' values each run (dims.capped)
    self.checks = list(checks)
    self.sizes = list(sizes)  # dims the bounds do not prove >= 0 (GraphPlan.sizes): each run checks them before the plan runs
    self._checks = CheckReader(plan.buffers, self.checks)
    # each run's fixed costs, which a small model's run is mostly made of: the outputs' shapes when no dim is symbolic, and
    # zero-copy arrays over the host-visible input and output buffers (the plan's buffers never move once it is built)
    self._static_shapes = None if self.variables else [tuple(evaluate(d, {}) for d in s) for _, s in self.outputs]
    self._views: dict[int, np.ndarray | None] = {}
    self._exact: list[tuple[str, np.ndarray]] | None = None  # run_exact's input names and buffers, made at its first call ([]: never)
    # plan op id -> (the ONNX nodes its kernel covers, its primary one) for a plan the plan cache rebuilt, which has no
    # scheduled kernels to ask (onnx_plan_cache.py); None otherwise
    self.origins: dict[int, tuple[list[Any], Any]] | None = None

  @property
  def kernel_count(self) -> int: return len(self.plan.kernels)

  def run(self, feeds: Mapping[str, np.ndarray] | None = None, vars: Mapping[str, int] | None = None,  # noqa: A002
          out: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray]:
    """The outputs for these feeds. `vars` gives variables no fed input has as a dim (a bound cache's past length:
    compile(..., bind=)); one a feed also gives must agree with it. `out`: per output, an array to write it into (of its
    dtype; its shape is checked for every output before any is written) or None for a new one."""
    vals = self._feed(feeds, vars)
    if self.variables: self.plan.execute_with_vars(vals)
    else: self.plan.execute()
    self._checks.raise_failed(IndexOutOfRangeError)
    return self._outputs(vals, out)

  def run_exact(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray] | None:
    """run(feeds) for a caller that has checked every fed array's shape and dtype against the inputs' (kiln.graph.onnx's
    Model), where no dim is symbolic and each input buffer is host-visible in the fed dtype: the arrays copied straight
    in. None where the graph is not such a graph (run() then does it)."""
    if self._exact is None:
      views = [self._view(i.buf) for i in self.inputs]
      ok = not self.variables and not self.sizes and all(
        v is not None and v.flags.writeable and v.dtype == i.dtype and not i.bfloat16 and v.size == math.prod(i.shape) > 0  # type: ignore[arg-type]
        for i, v in zip(self.inputs, views))
      self._exact = [(i.name, v) for i, v in zip(self.inputs, views)] if ok else []  # type: ignore[misc]
    if not self._exact or any(feeds[name].dtype != view.dtype for name, view in self._exact): return None  # run() casts it
    for name, view in self._exact: np.copyto(view, feeds[name].reshape(-1), casting="no")
    self.plan.execute()
    self._checks.raise_failed(IndexOutOfRangeError)
    return self._outputs({})

  def run_profiled(self, feeds: Mapping[str, np.ndarray] | None = None, vars: Mapping[str, int] | None = None  # noqa: A002
                   ) -> tuple[list[np.ndarray], Any]:
    """run, kernel by kernel with each one timed: (outputs, the plan's Profile); `vars` as run's (a bound cache's past)."""
    vals = self._feed(feeds, vars)
    if self.variables: self.plan.set_vars(vals)
    prof = self.plan.execute_profiled()
    self._checks.raise_failed(IndexOutOfRangeError)
    return self._outputs(vals), prof

  def export(self, output_names: Sequence[str] | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """The compiled graph as a kiln.executor PlanSpec (inputs by name, outputs as output_names or output0, ...; symbolic
    dims by their variables' names) and the arrays its weights name: rebuild it with kiln.executor.PortablePlan. The
    checks travel with it: the rebuilt plan raises kiln.executor's PlanCheckError with the same message."""
    names = list(output_names) if output_names is not None else [f"output{i}" for i in range(len(self.outputs))]
    if len(names) != len(self.outputs): raise GraphError(f"{len(names)} output names for {len(self.outputs)} outputs")
    outs, shapes = {}, {}
    for n, (b, s) in zip(names, self.outputs): outs[n], shapes[n] = b, [_spec_dim(d) for d in s]
    for i in self.inputs: shapes[i.name] = [_spec_dim(d) for d in i.shape]
    return export(self.plan, {i.name: i.buf for i in self.inputs}, outs, shapes, checks=self.checks)

  def to_spec(self, output_names: Sequence[str] | None = None) -> Any: return self.export(output_names)[0]

  def infer_vars(self, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Each variable's value from the fed arrays' shapes (every input that names it must agree, within its bounds)."""
    return bind_dims([(i.name, i.shape) for i in self.inputs], {i.name: feeds[i.name].shape for i in self.inputs}, "the graph")

  def _feed(self, feeds: Mapping[str, np.ndarray] | None, given: Mapping[str, int] | None = None) -> dict[str, int]:
    feeds = dict(feeds or {})
    for i in self.inputs:
      if i.name not in feeds: raise GraphError(f"input {i.name!r} (shape {fmt_shape(i.shape)}, {i.dtype}) was not fed")
      feeds[i.name] = np.asarray(feeds[i.name])
    static = not self.variables and all(feeds[i.name].shape == i.shape for i in self.inputs)
    vals = {} if static else self.infer_vars(feeds)  # infer_vars names a wrong shape
    for name, v in (given or {}).items():
      if (var := self.variables.get(name)) is None: raise GraphError(f"vars: the graph has no variable {name!r} (it has {sorted(self.variables)})")
      _, lo, hi = var.arg
      if not isinstance(v, int | np.integer) or not lo <= v <= hi:
        raise GraphError(f"vars: {name} = {v!r} is outside the bounds [{lo}, {hi}] it was compiled for")
      if name in vals and vals[name] != v: raise GraphError(f"vars: {name} = {v}, but the feeds give {name} = {vals[name]}")
      vals[name] = int(v)
    if self._capped: vals = dict(with_capped(vals, self._capped))
    if missing := sorted(set(self.variables) - set(vals)):
      raise GraphError(f"variables {missing} are a dim of no fed input (only of bound buffers): give them with run(feeds, vars={{...}})")
    check_sizes(self.sizes, vals)
    for i in self.inputs:
      a = in_plan_dtype(feeds[i.name], i.dtype, i.bfloat16)
      if a is None:
        raise GraphError(f"input {i.name!r} has dtype {feeds[i.name].dtype}, the graph takes {'bfloat16' if i.bfloat16 else i.dtype}")
      if a.size == 0: continue  # a dim of 0 (an empty KV cache): nothing to copy, the kernels read none of it
      if (view := self._view(i.buf)) is not None and view.dtype == a.dtype and view.flags.writeable:
        np.copyto(view[:a.size], a.reshape(-1), casting="no")  # a symbolic input below its maximum fills the buffer's front
        continue
      buf = self.plan.buffers[i.buf]
      if a.size != buf.size: buf = buf.view(0, a.size)
      buf.copyin(np.ascontiguousarray(a))
    return vals

  def _view(self, b: int) -> np.ndarray | None:
    """Plan buffer b as a zero-copy array (None: not host-visible), made once."""
    if b not in self._views: self._views[b] = self.plan.buffers[b].host_view()
    return self._views[b]

  def output_shapes(self, feeds: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
    """The shapes run(feeds) returns its outputs in (symbolic dims read off the feeds), without running anything."""
    vals = self.infer_vars({i.name: np.asarray(feeds[i.name]) for i in self.inputs})
    return [tuple(evaluate(d, vals) for d in s) for _, s in self.outputs]

  def _outputs(self, vals: Mapping[str, int], dst: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray]:
    shapes = self._static_shapes or [tuple(evaluate(d, vals) for d in s) for _, s in self.outputs]
    for i, (a, shape) in enumerate(zip(dst or (), shapes)):
      if a is not None and a.shape != shape: raise GraphError(f"out: output {i} has shape {shape} in this run, the array given for it {a.shape}")
    out = []
    for i, ((b, _), shape) in enumerate(zip(self.outputs, shapes)):
      n = math.prod(shape)
      if (view := self._view(b)) is not None: got = view[:n].reshape(shape)
      else:
        buf = self.plan.buffers[b]
        got = (buf if n == buf.size else buf.view(0, max(n, 1))).numpy()[:n].reshape(shape)  # n = 0: a dim of 0
      if dst is not None and (a := dst[i]) is not None:
        np.copyto(a, got, casting="no")
        out.append(a)
      else: out.append(got.copy())
    return out


def _spec_dim(d: Dim) -> int | str:
  """A dim in a PlanSpec: a size, or a product of variable names and a whole number ("2*seq")."""
  if isinstance(d, int): return d
  if not is_mono(d): raise GraphError(f"the dim {fmt(d)} is a sum: a PlanSpec's dims are products of names (exporting it is not supported)")
  c, vs = mono(d)
  return "*".join([*([str(c)] if c != 1 or not vs else []), *(v.arg[0] for v in vs)])


def _variables(nodes: Sequence[Node], inputs: Mapping[str, _Input], bound: Sequence[Node] = ()) -> dict[str, UOp]:
  """The graph's variables by name; each must be one dim of some input: a fed one (run() reads its value there) or a
  bound one (run() takes it in vars)."""
  found: dict[str, UOp] = {}
  for n in nodes:
    for v in variables(n.shape) + ([*variables((n.arg,))] if n.op == "CONST" and isinstance(n.arg, UOp) else []):
      if (prev := found.setdefault(v.arg[0], v)) is not v:
        raise GraphError(f"dim {v.arg[0]!r} has two sets of bounds: {prev.arg[1:]} and {v.arg[1:]}")
  fed = {d.arg[0] for i in inputs.values() for d in i.shape if isinstance(d, UOp)} | {v.arg[0] for n in bound for v in variables(n.shape)}
  if missing := sorted(k for k in found if source_of(k) not in fed):  # a capped variable is bound from its source (dims.capped)
    raise GraphError(f"symbolic dims {missing} are not a dim of any input, so run() cannot learn their values")
  return found


def _reassociated_opts(ast: UOp, device: str) -> list | None:
  """A graph's sums have no order of their own, so its kernels may take the optimiser's choices for reductions summed in
  another order (heuristic_opts(reassociate=True): a global pool vectorised along its maps, not gathered across its
  channels); None where that changes nothing, and the plan picks them as for any kernel (and KILN_TUNE may tune them)."""
  from kiln.codegen.choose import reassociated_for
  return reassociated_for(ast, device)


def aligned_windows(ast: UOp, wins: dict[int, Window], itemsizes: Sequence[int], align: int) -> tuple[UOp, dict[int, Window]]:
  """read_windows' result with each view starting on an `align`-byte boundary of its buffer: a window from element lo
  starts lo % (align / itemsize) elements earlier and its indices move up by as many. A device whose kernels load 16
  bytes at a time (CUDA's tiled matmul) refuses a view that starts between two such chunks (a slice x[1:] read as a matrix)."""
  moved: dict[int, int] = {}
  for slot, (lo, _) in wins.items():
    size = itemsizes[slot]
    if align % size == 0 and (d := lo % (align // size)): moved[slot] = d
  if not moved: return ast, wins
  out = dict(wins)
  for slot, d in moved.items(): out[slot] = (wins[slot][0] - d, wins[slot][1] + d)
  new: dict[UOp, UOp] = {}
  for u in ast.toposort():
    src = tuple(new[x] for x in u.src)
    if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL and (shift := moved.get(u.src[0].arg)) is not None:
      g = u.src[0]
      assert isinstance(g.dtype, PtrDType)  # a window's slot is a pointer (read_windows made it)
      new[u] = UOp.define_global(g.arg, g.dtype.base.ptr(out[g.arg][1])).index(src[1] + shift, *src[2:])
    else: new[u] = u if all(a is b for a, b in zip(src, u.src)) else u.replace(src=src)
  return new[ast], out


def precompile(kernels: Sequence[tuple[UOp, Any]], device: str, threads: int) -> None:
  """Compile the plan's kernels (each distinct one once), `threads` at a time, before the plan is built, which then finds
  them in the kernel cache: in worker processes where the runtime's compile work holds the interpreter (the CPU's), else
  on threads (CUDA: an nvcc process a kernel); kiln.executor.compile_pool decides. A failure is left for the build, which reports
  it with the kernel's place in the plan (a compile that raised is not cached). While a load reports progress
  (kiln.graph.progress) they compile here even on one thread, each one reported as it finishes."""
  todo = list({(ast.key, repr(opts)): (ast, opts) for ast, opts in kernels}.values())
  if not todo or (threads <= 1 or len(todo) <= 1) and not progress.active(): return  # the build compiles them, in order
  from kiln.executor import precompile_kernels
  what, count = "compiling kernels", [0]
  progress.report(0, len(todo), what)
  def done() -> None:
    count[0] += 1
    progress.report(count[0], len(todo), what)
  precompile_kernels(todo, device, threads, done)  # processes or threads, as the runtime's compile work allows


class GraphPlan:
  """A graph's kernels placed in an ExecutionPlanBuilder: what compile_nodes and a Program's segments (segments.py) share.

  Each node a kernel reads or writes gets one plan buffer (`bufs`): the one `buffer_for(node)` gives where it gives one
  (a buffer the caller owns: a segment's bound input, a weight segments share), else a new one (a weight's array copied
  in, an input's, listed in `inputs`, or a kernel's output). `out_bufs` writes output i straight into out_bufs[i] (a
  segment's slots); an output given twice is then first copied by a kernel, as an output that is a BUFFER always is.
  `builder.build()` gives the plan; `checks` are (plan buffer, message) pairs of its run-time index checks."""

  def __init__(self, outputs: Sequence[Node], device: str, fuse: bool = True, out_bufs: Sequence[Any] | None = None,
               buffer_for: Callable[[Node], Any] | None = None, writes: Sequence[Node] = ()):
    from kiln.codegen.registry import get_runtime
    from kiln.executor import ExecutionPlanBuilder
    self.device, self.buffer_for = device, buffer_for or (lambda n: None)
    outs: list[Node] = []
    for o in outputs: outs.append(_copy(o) if o.op == "BUFFER" or out_bufs is not None and o in outs else o)
    effects = list(dict.fromkeys(writes))  # Tensor.write_rows: scheduled as outputs are, returned by no run
    if fuse:
      new = fuse_epilogues([*outs, *effects])
      outs, effects = [new[o] for o in outs], [new[w] for w in effects]
    checks = gather_checks(toposort([*outs, *effects]))
    uniq = list(dict.fromkeys([*(c for c, _ in checks), *outs, *effects]))  # the checks' kernels first: a pipeline's first stage runs them
    outset = frozenset(uniq)
    wide = device.startswith("CPU")
    self.stored: Callable[[Node], DType] = lambda n: stored_dtype(n, outset, wide)
    try: self.kernels = schedule(uniq, fuse, stored=self.stored)
    except RecursionError:  # the renderer recurses along a fused chain (a few hundred elementwise ops deep): a typed error, not a crash
      raise GraphError(f"the graph is too deep to render ({len(toposort(uniq))} nodes; a chain of a few hundred elementwise ops "
                       "fused into one kernel reaches Python's recursion limit): realize an intermediate with .contiguous()") from None
    self.kernels, self.placed = place_cats(self.kernels, set(uniq), self.stored)
    self.outs, self.nodes = outs, toposort(uniq)
    self.builder = pb = ExecutionPlanBuilder(device)
    self.bufs: dict[Node, int] = {} if out_bufs is None else {o: pb.add_buffer(b) for o, b in zip(outs, out_bufs)}
    self.inputs: dict[str, _Input] = {}
    self._views: dict[tuple[int, Window], int] = {}
    rt = get_runtime(device)
    align = int(getattr(rt, "view_align", 1))  # CUDA: 16, its tiled matmul's vector loads want their operands' starts aligned
    placed = []
    for k in self.kernels:
      ast, wins = read_windows(k.ast)
      if align > 1: ast, wins = aligned_windows(ast, wins, [self.stored(s).itemsize for s in k.slots], align)
      placed.append((k, ast, wins, _reassociated_opts(ast, device)))
    precompile([(ast, opts) for _, ast, _, opts in placed], device, int(getattr(rt, "compile_threads", 1)))
    for k, ast, wins, opts in placed:
      slots = [self.view_of(self.buf_of(s), wins[i], self.stored(s)) if i in wins else self.buf_of(s) for i, s in enumerate(k.slots)]
      k.op_id = pb.add_kernel(ast, slots, opts=opts)  # a profile's records name it (provenance.py)
    pb.set_outputs(list(dict.fromkeys(self.bufs[o] for o in uniq if o not in effects)))
    self.checks = [(self.bufs[c], m) for c, m in checks]
    self.sizes = list(dict.fromkeys(d for n in self.nodes for d in negative(n.shape)))  # seq - 1 of a seq that may be 0: run() checks it

  def buf_of(self, n: Node) -> int:
    from kiln.executor import Buffer
    if n in self.bufs: return self.bufs[n]
    if n in self.placed:  # a concatenation's piece, written by its kernel into the concatenation's buffer (cat_place.py)
      pl = self.placed[n]
      self.bufs[n] = self.view_of(self.buf_of(pl.cat), (pl.at, pl.span), self.stored(n))
      return self.bufs[n]
    if n.op == "WRITE":  # its kernel stores into the target's buffer, which the caller owns
      self.bufs[n] = self.buf_of(n.src[0])
      if n.src[0].arg.name in self.inputs: raise GraphError(f"write_rows into {n.src[0].arg.name!r}: the target must be bound (compile(bind=))")
      return self.bufs[n]
    b = self.buffer_for(n)
    if owned := b is None:
      if n.max_numel > dtypes.index.max and not is_static(n.shape):  # kernels index in int32: the bounds must keep every index in it
        raise GraphError(f"a {n.op} node of shape {fmt_shape(n.shape)} has {n.max_numel} elements at the dims' upper bounds, more than a "
                         f"{dtypes.index.name} index reaches ({dtypes.index.max}): lower the bounds")
      if (data := n.data) is not None: b = Buffer.from_numpy(np.ascontiguousarray(data), self.device, n.dtype)  # bf16: uint16 in numpy
      else: b = Buffer(self.device, n.max_numel, self.stored(n))  # symbolic dims: sized for their upper bounds
    self.bufs[n] = self.builder.add_buffer(b)
    if owned and n.op == "BUFFER" and n.arg.name is not None:  # a model input the plan owns: run() copies it in
      if (prev := self.inputs.get(n.arg.name)) is not None: raise GraphError(f"two inputs are named {n.arg.name!r} ({prev.shape} and {n.shape})")
      self.inputs[n.arg.name] = _Input(n.arg.name, self.bufs[n], n.shape, n.dtype.np, n.dtype == dtypes.bfloat16)
    return self.bufs[n]

  def view_of(self, base: int, w: Window, dtype: DType) -> int:
    """One plan buffer per (buffer, window), however many kernels read it."""
    from kiln.executor import Buffer
    if (base, w) not in self._views:
      self._views[base, w] = v = self.builder.add_buffer(Buffer(self.device, w[1], dtype))
      self.builder.add_view(v, base, w[0] * dtype.itemsize, w[1] * dtype.itemsize)
    return self._views[base, w]


def _copy(n: Node) -> Node: return Node("VIEW", (n,), ("reshape", n.shape), n.shape, n.dtype)


def _binder(bind: Mapping[str, Any]) -> tuple[Callable[[Node], Any], list[Node]]:
  """compile(bind=)'s buffer_for: a named input's node -> the caller's Buffer, checked against the input's dtype and its
  size at the dims' upper bounds. The nodes it bound are listed (their dims are variables too)."""
  from kiln.executor import Buffer
  bound: list[Node] = []
  def buffer_for(n: Node) -> Any:
    if n.op != "BUFFER" or n.arg.name is None or (b := bind.get(n.arg.name)) is None: return None
    if not isinstance(b, Buffer): raise GraphError(f"bind: input {n.arg.name!r} takes a kiln.executor Buffer, got {type(b).__name__}")
    if b.dtype != n.dtype or b.size != n.max_numel:
      raise GraphError(f"bind: input {n.arg.name!r} ({fmt_shape(n.shape)}, {n.dtype.name}) needs a {n.dtype.name} buffer of {n.max_numel} "
                       f"elements (its size at the dims' upper bounds), got {b.size} x {b.dtype.name}")
    bound.append(n)
    return b
  return buffer_for, bound


def compile_nodes(outputs: Sequence[Node], device: str = "CPU", fuse: bool = True, bind: Mapping[str, Any] | None = None,
                  writes: Sequence[Node] = ()) -> Compiled:
  """`bind` maps input names to Buffers the caller owns (a KV cache): the plan reads them in place, run() copies nothing
  into them, and the caller may write them between runs; `writes` (WRITE nodes, Tensor.write_rows) store into them."""
  buffer_for, bound = _binder(bind or {})
  g = GraphPlan(outputs, str(DeviceSpec.parse(device)), fuse, buffer_for=buffer_for, writes=writes)
  for n in g.nodes:  # an input no kernel reads still tells run() its dims (a slice keeping only a pad's values of a batch)
    if n.op == "BUFFER" and n.arg.name is not None and variables(n.shape): g.buf_of(n)
  if unknown := sorted(set(bind or {}) - {n.arg.name for n in bound}):
    raise GraphError(f"bind: the graph has no input named {unknown} (or no kernel reads it)")
  variables_ = _variables(g.nodes, g.inputs, bound)
  return Compiled(g.builder.build(), list(g.inputs.values()), [(g.bufs[o], o.shape) for o in g.outs], g.kernels, variables_, g.checks, g.sizes,
                  {n.arg.name: g.bufs[n] for n in bound})
