"""ONNX models on kiln: `load(path_or_model, device="CPU", dims=None) -> Model`.

The model is untrusted input: its size, node count, depth, names, tensors and attributes are held to the limits
of kiln.graph.onnx_limits before onnx.checker runs, a path is read by kiln (a regular file, at most 2 GiB, never a
FIFO), and anything malformed is an ONNXError, never a crash. Initializers, Constant and every node whose inputs are
all constants (Shape of a static shape, the shape arithmetic feeding Reshape/Expand/Slice, ConstantOfShape, Range) are
folded with numpy at load time, and so is a BatchNormalization into the Conv it reads (onnx_fold.py); every other node
becomes Tensor ops, and the outputs compile into one fused ExecutionPlan. An operator or attribute kiln does not support
is refused at load time with the node, the op and the attribute named. Needs the `onnx` extra (`pip install "kiln-graph[onnx]"`).
"""
from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kiln.graph import dims as sym
from kiln.graph import onnx_limits as lim
from kiln.graph import (  # noqa: F401  (they register their operators in OPS)
  onnx_ops_act,
  onnx_ops_convt,
  onnx_ops_detect,
  onnx_ops_encode,
  onnx_ops_flow,
  onnx_ops_index,
  onnx_ops_misc,
  onnx_ops_ml,
  onnx_ops_quant,
  onnx_ops_resize,
  onnx_ops_rnn,
  onnx_ops_sample,
  onnx_ops_select,
  onnx_ops_shape,
  onnx_ops_svm,
  onnx_ops_trees,
)
from kiln.graph import shape_values as sv
from kiln.graph.build_target import building_for
from kiln.graph.feeds import (
  FeedError,
  TensorInfo,
  check_dims,
  check_feeds,
  check_out,
  check_out_shapes,
  check_shapes,
  chosen_outputs,
  output_info,
  write_out,
)
from kiln.graph.lazy import GraphError, IndexOutOfRangeError, ONNXError
from kiln.graph.onnx_const import fold_known
from kiln.graph.onnx_empty import SymbolicEmpty, empty_input, empty_outputs
from kiln.graph.onnx_external import Tensors, model_tensors
from kiln.graph.onnx_fold import BatchNormFolds
from kiln.graph.onnx_ops import OPS, WITH_ONNX, OnnxNode, Value, check_shape_value
from kiln.graph.onnx_ops_flow import FLOW
from kiln.graph.onnx_ops_ml import ML_DOMAIN, ML_OPS, ZipMapped
from kiln.graph.onnx_plan_cache import cached_model, keep_model, plan_key
from kiln.graph.onnx_scope import Ctx, check_subgraphs, outer_names, stored_values, subgraphs
from kiln.graph.program import Body, Program, build_program, host_array
from kiln.graph.progress import Progress, report, reporting
from kiln.graph.provenance import made_by, of_node
from kiln.graph.schedule import Compiled
from kiln.graph.specialise import Cut, RuntimeValue, unspecialisable
from kiln.graph.tensor import Tensor, compile
from kiln.ir.errors import IRError


def _onnx() -> Any:
  try:
    import onnx
  except ImportError as e:
    raise ONNXError('loading ONNX models needs the onnx package: pip install onnx (or pip install "kiln-graph[onnx]")') from e
  return onnx


class Model:
  """A loaded ONNX model: `run(feeds) -> {output name: array}`, `inputs` and `outputs` (what it takes and gives, as
  TensorInfo: name, shape, dtype), `plan` (its ExecutionPlan, None when every output is a constant or the model branches
  at run time), `plans` (every plan it runs), `summary()`.

  A model with an If whose condition is computed at run time is a `program` (kiln.graph.program): segments, each a plan,
  and the branches between them, all compiled at load; `compiled` is then None. So is one with a value that sets a shape
  computed at run time (kiln.graph.specialise): the rest of the graph is compiled at run time for each value it takes
  (cached), and `plans` are those compiled so far. An output given as None is computed by the program."""

  def __init__(self, inputs: list[tuple[str, tuple[int | str, ...], np.dtype]], outputs: list[tuple[str, Value | None]], compiled: Compiled | None,
               nodes: int, opset: int, defaults: Mapping[str, np.ndarray] | None = None, program: Program | None = None,
               declared: Mapping[str, TensorInfo] | None = None, maps: Mapping[str, ZipMapped] | None = None):
    self._inputs = [TensorInfo(*i) for i in inputs]
    self._maps = dict(maps or {})  # ZipMap outputs: computed as their scores, returned as a list of {key: score} a row
    self.output_names, self.compiled, self.nodes, self.opset = [n for n, _ in outputs], compiled, nodes, opset
    self.program = program
    self.defaults = dict(defaults or {})  # graph inputs an initializer of the same name gives a value: folded in at load
    # a folded bfloat16 (ml_dtypes') comes back as its uint16 bits, as a computed one does (kiln's numpy form of bfloat16)
    self._consts = {n: host_array(v) for n, v in outputs if isinstance(v, np.ndarray)}
    self._computed = [n for n, v in outputs if not isinstance(v, np.ndarray)]
    self._empty = {n for n, shape, _ in inputs if 0 in shape}  # inputs with no elements, known at load (onnx_empty.py)
    self._outputs = [output_info(n, self._consts.get(n, v), (declared or {}).get(n)) for n, v in outputs]
    self._exact: list[tuple[str, Any, Any]] | None = None  # _run_exact's inputs, made at the first run ([]: never)
    # the inputs the plan (or program) reads, with its dims' variables and bounds: run() checks fed shapes against them
    self._shapes = [(i.name, i.shape) for i in compiled.inputs] if compiled is not None else \
      [(n, s.node.shape) for n, s in program.inputs] if program is not None else []

  @property
  def inputs(self) -> list[TensorInfo]:
    """The inputs run() must be fed, in the model's order: name, shape (an int per fixed dim, a symbolic dim's name: a
    dim_param, or dim_INPUT_AXIS for one with no name; each with the bounds load's dims gave it) and numpy dtype (a
    bfloat16 input takes ml_dtypes' bfloat16 or uint16, its bits). Inputs an initializer gives a value are not among them."""
    return list(self._inputs)

  @property
  def outputs(self) -> list[TensorInfo]:
    """The outputs run() returns, in the model's order: name, shape (symbolic dims named as kiln computes them, 'batch' or
    'batch*128'; for a model compiled at run time, the shape the model declares, None where it declares none) and the
    numpy dtype of the returned array."""
    return list(self._outputs)

  @property
  def plan(self) -> Any:
    """The model's one ExecutionPlan; None when every output is a constant or the model runs several (`plans`)."""
    return None if self.compiled is None else self.compiled.plan

  @classmethod
  def from_cache(cls, inputs: list[tuple[str, tuple[int | str, ...], np.dtype]], outputs: list[tuple[str, Value | None]], compiled: Compiled,
                 nodes: int, opset: int, defaults: Mapping[str, np.ndarray], declared: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> Model:
    """A Model whose plan the plan cache rebuilt (onnx_plan_cache.py): outputs given None are computed, `declared` gives
    their shapes and dtypes as the loaded model had them (what `outputs` reports)."""
    return cls(inputs, outputs, compiled, nodes, opset, defaults, None, {n: TensorInfo(n, s, dt) for n, (s, dt) in declared.items()})

  @property
  def plans(self) -> list[Any]:
    """Every ExecutionPlan the model runs: its one plan, or each segment's of a program (both branches' too, and each
    specialisation's compiled so far)."""
    return self.program.plans if self.program is not None else [] if self.compiled is None else [self.compiled.plan]

  def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None,
          cast: bool = False) -> dict[str, np.ndarray]:
    """Run the model: {output name: array}.

    feeds: {input name: array} for every input in `inputs`, no other name (a misspelt one is an error naming the closest
    input), each of the input's dtype; cast=True casts one of another dtype where every value survives (feeds.py), else a
    differing dtype is a FeedError. Symbolic dims are read off the arrays' shapes (a wrong rank or fixed dim, a dim outside
    the bounds load gave it or two inputs disagreeing on one: a FeedError). outputs: the names to return, in that
    order (default: every output; the plan computes them all). out: {output name: array} to write outputs into instead of
    new arrays (a loop's buffers), each of the output's dtype and this run's shape; those entries of the result are the
    caller's arrays. Every refusal is a FeedError (an ONNXError) raised before the model runs (an out= array whose shape a
    symbolic dim decides: after, with nothing written). A ZipMap output (ai.onnx.ml) is a list of {key: score} dicts, one
    a row, as onnxruntime gives it; out= cannot take one."""
    return self._mapped(self._run(feeds, False, outputs, self._no_maps(out), cast)[0])

  def run_profiled(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None,
                   cast: bool = False) -> tuple[dict[str, np.ndarray], Any]:
    """run, kernel by kernel with each kernel timed: (outputs, the plan's Profile; None when no kernel runs)."""
    got, prof = self._run(feeds, True, outputs, self._no_maps(out), cast)
    return self._mapped(got), prof

  def _no_maps(self, out: Mapping[str, np.ndarray] | None) -> Mapping[str, np.ndarray] | None:
    if out and (named := sorted(set(out) & set(self._maps))):
      raise FeedError(f"out= names {named}: a ZipMap output is a list of maps, made for each run, not an array to write into")
    return out

  def _mapped(self, got: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """got with each ZipMap output's scores made into its maps (the list run() documents)."""
    if not self._maps: return got
    return {n: self._maps[n].rows(a) if n in self._maps else a for n, a in got.items()}  # type: ignore[misc]

  def _run(self, feeds: Mapping[str, np.ndarray], profile: bool, outputs: Sequence[str] | None = None,
           out: Mapping[str, np.ndarray] | None = None, cast: bool = False) -> tuple[dict[str, np.ndarray], Any]:
    if not profile and outputs is None and out is None and (exact := self._run_exact(feeds)) is not None: return exact, None
    arrays = check_feeds(self._inputs, self.defaults, feeds, cast)
    chosen = chosen_outputs(self.output_names, outputs)
    dst = check_out(out, {i.name: i for i in self._outputs}, chosen)
    for i in self._inputs:
      if i.name in self._empty and arrays[i.name].shape != i.shape:  # the compiled model never reads it: check it here
        raise FeedError(f"model input {i.name!r} has shape {arrays[i.name].shape}, the model takes {i.shape} (empty)")
    check_shapes(self._shapes, arrays)
    prof = None
    try:
      got: list[np.ndarray] = []
      if self.program is not None: got, prof = self.program.run(arrays, profile)
      elif self.compiled is None: pass
      elif profile: got, prof = self.compiled.run_profiled(arrays)
      else:
        if dst: check_out_shapes(dst, dict(zip(self._computed, self.compiled.output_shapes(arrays))))  # before the run: nothing written
        got = self.compiled.run(arrays, out=[dst.get(n) for n in self._computed] if dst else None)
    except IndexOutOfRangeError: raise  # typed: it names the node and the index already
    except FeedError: raise
    except GraphError as e: raise ONNXError(str(e)) from e
    res = dict(zip(self._computed, got))
    res = {n: res[n] if n in res else self._consts[n].copy() for n in chosen}
    check_out_shapes(dst, {n: a.shape for n, a in res.items()})  # a program's: known only now, still before anything is written
    return {n: a if n not in dst or a is dst[n] else write_out(a, dst[n]) for n, a in res.items()}, prof

  def _run_exact(self, feeds: Any) -> dict[str, np.ndarray] | None:
    """run's outputs where the model is one plan with no symbolic dim and every output computed, and `feeds` is a dict of
    exactly its inputs, each an array of the input's dtype and shape: what check_feeds and check_shapes would pass
    without a word, tested in one pass (a small model's run was mostly those checks). None otherwise: run() checks as
    always and says what is wrong."""
    if self._exact is None:
      plain = self.compiled is not None and not self.defaults and not self._empty and not self._consts
      shapes = [i.shape for i in self._inputs]
      self._exact = [(i.name, i.shape, i.dtype) for i in self._inputs] if plain and all(
        s is not None and all(isinstance(d, int) for d in s) for s in shapes) else []
    if not self._exact or type(feeds) is not dict or len(feeds) != len(self._exact): return None
    for name, shape, dtype in self._exact:
      a = feeds.get(name)
      if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype: return None
    assert self.compiled is not None
    if (got := self.compiled.run_exact(feeds)) is None: return None
    return dict(zip(self._computed, got))

  def export(self) -> tuple[Any, dict[str, np.ndarray]]:
    """The model's plan as a kiln.executor PlanSpec with the model's input and output names, and the arrays its weights
    name (rebuild it with kiln.executor.PortablePlan). Outputs that are constants of the model are not in it."""
    if self.program is not None and (cut := self.program.tail.then) is not None:
      raise ONNXError(f"the model is compiled at run time from {cut.cut.label} on, for each value of its run-time input(s) "
                      f"{', '.join(name for name, _ in cut.cut.needed)}: a PlanSpec holds one plan (not supported)")
    if self.program is not None:
      raise ONNXError("the model branches at run time (an If on a value computed at run time): a PlanSpec holds one plan, this model runs "
                      f"{len(self.plans)} (not supported)")
    if self.compiled is None: raise ONNXError("every output of the model is a constant: there is no plan to export")
    return self.compiled.export(self._computed)  # type: ignore[no-any-return]

  def to_spec(self) -> Any:
    """The model's plan as a kiln.executor PlanSpec (export() without the weights' arrays)."""
    return self.export()[0]

  def summary(self) -> str:
    """The model in lines: opset, node count, inputs and outputs, then its plans' kernels, buffers and peak memory."""
    lines = [f"ONNX model: opset {self.opset}, {self.nodes} nodes; inputs " +
             ", ".join(f"{n} {s} {dt}" for n, s, dt in self._inputs) + "; outputs " + ", ".join(self.output_names)]
    p = self.plan
    if self.program is not None:
      specs = self.program.specialisations()
      lines.append(f"  {len(self.plans)} plans (segments of both sides of its run-time branches{', and those compiled so far' if specs else ''}), "
                   f"{sum(len(q.kernels) for q in self.plans)} kernels in all")
      for sp in specs:
        lines.append(f"  from {sp.cut.label} on: compiled at run time for each value of {', '.join(n for n, _ in sp.cut.needed)} "
                     f"({sp.compiles} so far, {len(sp.compiled())} kept)")
      for i, q in enumerate(self.plans): lines += [f"    plan {i}: {len(q.kernels)} kernels"] + [f"      {k.name}" for k in q.kernels]
    elif p is None: lines.append("  every output is a constant: no kernels")
    else:
      lines.append(f"  {len(p.kernels)} kernels, {len(p.buffers)} buffers, peak buffer memory {p.memory_bytes / 1e6:.3f} MB "
                   f"({p.memory_bytes_without_reuse / 1e6:.3f} MB without reuse)")
      for k in p.kernels: lines.append(f"    {k.name}")
    return "\n".join(lines)

  __str__ = summary


def _convert(g: Any, env: dict[str, Value], ctx: Ctx) -> None:
  """Every node of graph g (the model's, or a subgraph's: If's branches, Loop's and Scan's bodies) in order, each output into
  env by name. Each node is refused or converted as the model's own are; its name carries the path of the subgraph it sits
  in (ctx.path: 'If_3 > then_branch > node '), in every error and in the run-time checks it makes."""
  folds = BatchNormFolds(g, ctx.onnx)
  for p in g.node:  # a value a nested subgraph reads is read once more: a batch norm fold must see that reader
    for _, sub in subgraphs(p): folds.uses.update(outer_names(sub))
  _convert_nodes(list(g.node), g, env, ctx, folds)


def _convert_nodes(nodes: list[Any], g: Any, env: dict[str, Value], ctx: Ctx, folds: BatchNormFolds) -> None:
  """nodes (of graph g) in order, outputs into env. In the main graph, a node that needs a value computed at run time
  (RuntimeValue) ends the conversion: ctx.body.cut records how to convert the rest once the value is known (specialise.py)."""
  top = not ctx.depth and ctx.body.cut is None
  for k, proto in enumerate(nodes):
    if top: report(k, len(nodes), "converting nodes")
    label = f"node {ctx.path}{proto.name or '<' + proto.op_type + '>'} ({proto.op_type})"
    if why := _unknown(proto): raise ONNXError(f"{label}: {why}")
    fn, allowed = OPS[proto.op_type]
    flow = FLOW.get(proto.op_type)  # If, Loop, Scan: they convert subgraphs in ctx
    if missing := next((i for i in proto.input if i and i not in env), None):
      raise ONNXError(f"{label}: input {missing!r} is not produced by any earlier node, input or initializer")
    if mapped := next((i for i in proto.input if i and isinstance(env[i], ZipMapped)), None):
      raise ONNXError(f"{label}: input {mapped!r} is a ZipMap's sequence of maps, which kiln gives only as a graph output")
    n = OnnxNode(proto, env, ctx.ml_opset if proto.domain == ML_DOMAIN else ctx.opset, ctx.onnx, ctx.stored, ctx.budget)
    n.name = ctx.path + n.name
    for a in n.attrs:
      if a not in allowed: raise n.error(f"attribute {a} is not supported")
    check_shape_value(n)
    lim.check_fold(proto.op_type, n.ins, label, n.attrs, ctx.budget)
    if proto.op_type == "Conv": folds.conv(n, env)  # the batch norm reading it scales its weights instead
    out: Any
    try:
      with made_by(of_node(ctx.path, proto)):  # the graph nodes it makes remember it (provenance.py: a profile names it)
        if flow is not None: out = flow[0](n, ctx, env)
        elif folds.passes_through(proto): out = n.t(0)
        elif (empty := empty_outputs(n, ctx.onnx)) is not None: out = empty  # an input with a dim of 0 (onnx_empty.py)
        else: out = fn(n, ctx.onnx) if proto.op_type in WITH_ONNX else fn(n)
        if flow is None: out = fold_known(out if isinstance(out, list) else [out], n.ins)  # every input known: computed now (onnx_const.py)
    except RuntimeValue as e:
      e.frames.append((nodes[k:] if e.node is n else nodes[k + 1:], env))  # what of this scope is left to convert, and its values
      if ctx.depth: raise
      rest = _resumed(e, ctx.onnx)
      if rest is None: raise ONNXError(str(e)) from None  # in a Loop's or Scan's body, or a run-time If's branch: the refusal
      ctx.body.cut = _cut(rest, g, e.frames[0][1], ctx, folds, e.node, e)
      return
    except ONNXError: raise
    except (IRError, ValueError, TypeError, LookupError, ArithmeticError) as e:  # IRError: GraphError, or a symbolic dim in shape arithmetic
      raise n.error(f"{type(e).__name__}: {e}") from e
    except MemoryError: raise n.error("folding it at load time needs more memory than there is") from None
    outs = [np.asarray(o) if isinstance(o, np.generic) else o for o in (out if isinstance(out, list) else [out])]  # numpy scalars fold too
    for o in outs: lim.check_value(label, o)
    if flow is None: ctx.budget.fold(label, outs, n.ins)  # a subgraph's nodes count their own folds
    names = [o for o in proto.output if o]
    if len(outs) < len(names): raise n.error(f"produces {len(outs)} outputs, the model uses {len(names)}")
    for name, v in zip(proto.output, outs):
      if name: env[name] = v


def _resumed(e: RuntimeValue, onnx: Any) -> list[Any] | None:
  """The nodes left to convert after a cut, from the node that raised e on: its branch's rest, an Identity from each of the
  branch's outputs to its If's, that scope's rest, ... the main graph's rest (e.frames: a scope's rest, then the If that
  took the branch, ..., the main graph's). None where e passed through anything but an If known at load (a Loop's body)."""
  frames = e.frames
  if len(frames) % 2 != 1 or any(not isinstance(f[0], list) for f in frames[::2]) or any(isinstance(f[0], list) for f in frames[1::2]): return None
  rest: list[Any] = []
  for i in range(0, len(frames) - 1, 2):
    proto, branch = frames[i + 1]
    rest += frames[i][0] + [onnx.helper.make_node("Identity", [vo.name], [o], name=f"{proto.name}:{o}")
                            for vo, o in zip(branch.output, proto.output) if o]
  return rest + frames[-1][0]


def _cut(rest: list[Any], g: Any, env: dict[str, Value], ctx: Ctx, folds: BatchNormFolds, n: OnnxNode, e: RuntimeValue) -> Cut:
  """The main graph cut before node n (rest[0]), whose input e.index (or the values e.reads, OnnxNode.read_back) is computed at
  run time: the rest converts, once the value is read back, in a copy of the values it reads (the load budget as it
  stood here). env: n's scope (a branch's of an If known at load falls through to the main graph's)."""
  if e.reads is not None:  # a value the node's output shape depends on: what its reads compute, or a host step's
    needed = [(e.key if e.host is None else f"{e.key}[{i}]", t.node) for i, t in enumerate(e.reads)]
    if e.host is None and len(needed) == 1 and (why := unspecialisable(needed[0][1])): raise n.error(f"{e.text}; {why}") from None
  else:
    name = n.proto.input[e.index]
    v = env[name]
    if not isinstance(v, Tensor) or n.ins[e.index] is not v: raise e  # the handler was given another value than env's: nothing to read back
    if why := unspecialisable(v.node): raise n.error(f"{e.text}; {why}") from None
    needed = [(name, v.node)]
  reads = {i for p in rest for i in p.input if i} | {o.name for o in g.output}
  for p in rest:
    for _, sub in subgraphs(p): reads |= outer_names(sub)
  budget = copy.copy(ctx.budget)

  def resume(env2: dict[str, Value]) -> tuple[list[Value] | None, Body]:
    body = Body()
    _convert_nodes(rest, g, env2, replace(ctx, body=body, budget=copy.copy(budget)), folds)
    return (None if body.cut is not None else [v for _, v in _outputs(g, env2)]), body
  return Cut(f"node {n.name} ({n.op})", needed, {k: env[k] for k in reads if k in env}, resume, e.host, e.key, e.length)


def _outputs(g: Any, env: dict[str, Value]) -> list[tuple[str, Value]]:
  """The graph's outputs (name, value), each produced; a Shape of symbolic dims as the dims' run-time values."""
  outputs = []
  for vo in g.output:
    if vo.name not in env: raise ONNXError(f"graph output {vo.name!r} is produced by no node")
    if isinstance(v := env[vo.name], np.ndarray) and sv.is_shape_value(v): env[vo.name] = sv.as_data(v) if sv.symbolic(v) else v.astype(np.int64)
    if isinstance(env[vo.name], SymbolicEmpty):
      raise ONNXError(f"graph output {vo.name!r} is empty (a dim of 0) beside symbolic dims {sym.fmt_shape(env[vo.name].shape)} (not supported)")
    outputs.append((vo.name, env[vo.name]))
  return outputs


def _check(onnx: Any, m: Any) -> None:
  """onnx.checker on the model, the file entries of its external tensors (initializers and attributes) hidden meanwhile:
  the checker would resolve them against the working directory; onnx_external resolves them against the model's own."""
  # before IR 4 an initializer had to be a graph input too, and the checker refuses one that is not ("W in initializer but
  # not in graph input"); onnxruntime runs such a model with it as a constant, and so does kiln: declared for the check alone
  declared = {i.name for i in m.graph.input}
  undeclared = [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                for t in m.graph.initializer if t.name not in declared] if m.ir_version < 4 else []
  m.graph.input.extend(undeclared)
  hidden = []
  for t, _ in model_tensors(m.graph):
    if t.data_location == onnx.TensorProto.EXTERNAL:
      hidden.append((t, [(e.key, e.value) for e in t.external_data], list(t.dims)))
      del t.external_data[:], t.dims[:]
      t.data_location = onnx.TensorProto.DEFAULT
      t.raw_data = b"\0" * 16  # a scalar stands in (the checker wants a value field of the declared size; no copy of the file)
  try: onnx.checker.check_model(m)
  finally:
    del m.graph.input[len(m.graph.input) - len(undeclared):]
    for t, entries, dims in hidden:
      t.data_location = onnx.TensorProto.EXTERNAL
      t.ClearField("raw_data")
      t.dims.extend(dims)
      for k, v in entries: t.external_data.add(key=k, value=v)


def read(model: Any, directory: str | os.PathLike[str] | None = None) -> tuple[Any, str | None]:
  """The checked ModelProto of a path, bytes or a ModelProto, and the directory its external data lies in (a path's own
  directory, else `directory`, else None: no external data). Every limit of onnx_limits, then onnx.checker."""
  onnx = _onnx()
  base = None if directory is None else os.path.abspath(os.fspath(directory))
  try:
    if isinstance(model, (str, os.PathLike)):  # external data is mapped by onnx_external, never read in here
      m = lim.read_model(onnx, os.fspath(model))
      base = os.path.dirname(os.path.abspath(os.fspath(model)))
    elif isinstance(model, (bytes, bytearray)):
      lim.limit("the model's size in bytes", len(model), "MAX_MODEL_BYTES", lim.MAX_MODEL_BYTES)
      m = onnx.load_from_string(bytes(model))
    elif isinstance(model, onnx.ModelProto): m = model
    else: raise ONNXError(f"load takes a path, bytes or an onnx.ModelProto, got {type(model).__name__}")
    lim.check_model(onnx, m)
    check_subgraphs(onnx, m)
    lim.check_opset(onnx, m)
    _check(onnx, m)
  except ONNXError: raise
  except Exception as e:  # a model is untrusted input: protobuf decode errors, checker failures
    raise ONNXError(f"not a valid ONNX model: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
  return m, base


def _unsupported(g: Any, opset: int, ml_opset: int = 1) -> list[str]:
  """Every node of the model's graph kiln cannot convert (domain, operator, attribute), each named. A subgraph's nodes are
  refused when converted: an If's branch not taken may hold what kiln lacks."""
  found = []
  for p in g.node:
    label = f"node {p.name or '<' + p.op_type + '>'} ({p.op_type})"
    if why := _unknown(p): found.append(f"{label}: {why}")
    else:
      v = ml_opset if p.domain == ML_DOMAIN else opset
      found += [f"{label[:-1]}, opset {v}): attribute {a.name} is not supported" for a in p.attribute if a.name not in OPS[p.op_type][1]]
  return found


def _unknown(p: Any) -> str | None:
  """Why node p's operator is not one kiln converts (its domain, or its name in that domain); None when it is."""
  if p.domain == ML_DOMAIN: return None if p.op_type in ML_OPS else f"operator {p.op_type} of domain {ML_DOMAIN!r} is not supported"
  if p.domain not in ("", "ai.onnx"): return f"domain {p.domain!r} is not supported"
  return None if p.op_type in OPS and p.op_type not in ML_OPS else f"operator {p.op_type} is not supported"


def load(model: Any, device: str = "CPU", dims: Mapping[str, int | tuple[int, int]] | None = None,
         directory: str | os.PathLike[str] | None = None, progress: None | bool | Progress = None) -> Model:
  """Load an ONNX model (a path, bytes or a ModelProto), check it, convert it to a Tensor graph and compile it.

  dims gives every named (dim_param) input dim either a fixed size, e.g. {"seq": 128}, or bounds, e.g. {"batch": (1, 64)}:
  a symbolic dim, a runtime variable, so the one compiled model runs every size within them (read off the fed arrays).
  A dim with no name is keyed by its input's name and axis, e.g. {"input:0": 1}.
  A model that folds its own Shape over a symbolic dim at load time is refused (ONNXError naming the node). directory:
  where the external data of a model given as bytes or a ModelProto lies (a path's own directory is used for a path).
  progress: None (silent), True (a line on stderr once the load has taken over a second) or a callable(done, total,
  what) told each stage's steps as they finish ("converting nodes", "compiling kernels"; kiln.graph.progress)."""
  with reporting(progress), building_for(device): return _load(model, device, dims, directory)  # layouts for the device


def _load(model: Any, device: str, dims: Mapping[str, int | tuple[int, int]] | None, directory: str | os.PathLike[str] | None) -> Model:
  cache_key = plan_key(model, device, dims)  # the whole built plan, kept by the model's content (onnx_plan_cache.py)
  if cache_key is not None and (hit := cached_model(cache_key, Model)) is not None: return hit  # onnx is not even imported
  onnx = _onnx()
  m, base = read(model, directory)
  opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
  ml_opset = next((o.version for o in m.opset_import if o.domain == ML_DOMAIN), 1)
  if bad := _unsupported(m.graph, opset, ml_opset):  # all of them at once: a user learns the whole gap from one try
    more = f"\n  ... and {len(bad) - 40} more" if len(bad) > 40 else ""
    raise ONNXError(bad[0] if len(bad) == 1 else f"{len(bad)} nodes use what kiln does not support:\n  " + "\n  ".join(bad[:40]) + more)
  g = m.graph
  env: dict[str, Value] = {}
  stored = Tensors(onnx, base)  # every stored tensor, external data kept inside the model's directory
  budget = lim.LoadBudget(lim.stored_bytes(onnx, stored_values(g)))  # what the model stores as values (not a ConstantOfShape's fill)
  for init in g.initializer: env[init.name] = stored.array(init, f"initializer {init.name!r}")
  inputs: list[tuple[str, tuple[int | str, ...], np.dtype]] = []
  defaults: dict[str, np.ndarray] = {}
  used: list[str] = []  # the dims keys the inputs name: any other key of dims is an error (a typo would be ignored)
  for vi in g.input:
    if vi.name in env:  # an initializer gives it a default (ONNX IR >= 4): kiln folds that in, and refuses another value at run time
      if isinstance(value := env[vi.name], np.ndarray): defaults[vi.name] = value
      continue
    tt = vi.type.tensor_type
    try: dt = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
    except Exception as e: raise ONNXError(f"input {vi.name!r} has an unsupported element type {tt.elem_type}") from e
    shape: list[int | str] = []
    bounds: dict[str, tuple[int, int]] = {}
    for i, d in enumerate(tt.shape.dim):
      if d.HasField("dim_value") and d.dim_value >= 0:
        shape.append(int(d.dim_value))
        continue
      key = d.dim_param or f"{vi.name}:{i}"  # a dim with no name (silero_vad.onnx's) or declared -1: the input's name and the axis
      used.append(key)
      if not dims or key not in dims:
        raise ONNXError(f"input {vi.name!r} dim {i} is symbolic ({d.dim_param or 'unnamed'}): give its size with dims={{{key!r}: n}} "
                        f"or its bounds with dims={{{key!r}: (lo, hi)}}")
      given = dims[key]
      if isinstance(given, tuple | list):  # bounds: a symbolic dim, a variable named as an identifier
        if len(given) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in given):
          raise ONNXError(f"dims[{key!r}] is a size or (lo, hi) bounds, got {given!r}")
        var = d.dim_param or "_".join(["dim", re.sub(r"\W", "_", vi.name), str(i)])
        bounds[var] = (given[0], given[1])
        shape.append(var)
      else: shape.append(int(given))
    lim.check_shape(f"input {vi.name!r}", [bounds[s][1] if isinstance(s, str) else s for s in shape], np.dtype(dt).itemsize)
    inputs.append((vi.name, tuple(shape), np.dtype(dt)))
    if (empty := empty_input(shape, np.dtype(dt))) is not None:  # a dim of 0: no elements, known at load (run() checks the fed shape)
      env[vi.name] = empty
      continue
    try: env[vi.name] = Tensor.input(vi.name, tuple(shape), dt, dims=bounds)
    except GraphError as e: raise ONNXError(f"input {vi.name!r}: {e}") from e
  check_dims(dims, used)
  main = Body()
  _convert(g, env, Ctx(onnx, opset, stored, budget, _convert, main, ml_opset=ml_opset))
  report(len(g.node), len(g.node), "converting nodes")
  # cut for a value known only at run time: every output comes from the program (specialise.py)
  if main.cut is not None and any(p.op_type == "ZipMap" for p in g.node):
    raise ONNXError("a ZipMap in a model compiled at run time (a shape computed from data) is not supported")
  outputs: list[tuple[str, Value | None]] = [(vo.name, None) for vo in g.output] if main.cut is not None else list(_outputs(g, env))
  found: list[tuple[str, Any]] = list(outputs)  # a ZipMap's output is no Value: its scores compute, run() makes the maps
  maps = {name: v for name, v in found if isinstance(v, ZipMapped)}
  outputs = [(name, v.scores if isinstance(v, ZipMapped) else v) for name, v in found]
  tensors = [v for _, v in outputs if isinstance(v, Tensor)]
  compiled, program = None, None
  try:
    if main.cut is not None or (tensors and main.branches):  # a branch chosen at run time or a specialisation: a Program of plans (program.py)
      program = build_program([(name, env[name].node) for name, _, _ in inputs if isinstance(env[name], Tensor)],  # type: ignore[union-attr]
                              [t.node for t in tensors], main, device)
    elif tensors: compiled = compile(tensors, device)
  except GraphError as e: raise ONNXError(f"compiling the model failed: {e}") from e
  except RecursionError:  # kiln.graph's renderer recurses along a fused chain of elementwise ops (~300 deep at the default limit)
    raise ONNXError("compiling the model failed: a chain of fused operations is too deep for kiln.graph's renderer") from None
  loaded = Model(inputs, outputs, compiled, len(g.node), opset, defaults, program, _declared(onnx, g), maps)
  if cache_key is not None and not maps: keep_model(cache_key, model, loaded, m)  # the plan cache keeps arrays only
  return loaded


def _declared(onnx: Any, g: Any) -> dict[str, TensorInfo]:
  """The outputs as the graph declares them (for an output computed at run time, whose shape kiln learns only then)."""
  out = {}
  for vo in g.output:
    tt = vo.type.tensor_type
    try: dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    except Exception: continue  # noqa: S112  (no element type declared: the output's TensorInfo says it is unknown)
    dt = np.dtype(np.uint16) if dt.name == "bfloat16" else dt  # run() returns a bfloat16 as its bits
    shape = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim) if tt.HasField("shape") else None
    out[vo.name] = TensorInfo(vo.name, shape, dt)
  return out
