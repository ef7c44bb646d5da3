"""Cutting a PlanSpec into pipeline stages at op boundaries.

Stage k runs ops [cuts[k-1], cuts[k]) of the plan, in order. What crosses a cut is memory, not tensors: every storage a
stage touches that an earlier stage wrote (unless the stage first overwrites all of it) comes in as an *activation*,
the storage's raw bytes under the name `ACTIVATION + <storage index>`, and the stage that writes it hands it on. The
plan's named inputs go to each stage that touches them, its weights only to the stages that read them, and each named
output (and each check, kiln.executor.checks) comes from the last stage that writes it. Running the stages in order on
the same inputs therefore does exactly what the whole plan does, kernel for kernel: the outputs are bit-identical.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.executor.buffer import buffer_dtype
from kiln.executor.planspec import BufferEntry, CheckEntry, CopyEntry, IOEntry, KernelEntry, PlanSpec, StorageEntry, ViewEntry
from kiln.executor.spec_access import accesses, compiled_doc, first_reads, places
from kiln.ir.errors import PlanSpecError

ACTIVATION = "kiln.activation."


def op_costs(spec: PlanSpec) -> list[float]:
  """Estimated work per op (a kernel's flops plus bytes; a copy's bytes; a view nothing), to balance stages."""
  costs = []
  for op in spec.ops:
    if isinstance(op, KernelEntry):
      doc = compiled_doc(op)
      costs.append(float(doc.get("flops", 0)) + float(doc.get("mem_bytes", 0)))
    elif isinstance(op, CopyEntry): costs.append(float(spec.buffers[op.dst].size * buffer_dtype(spec.buffers[op.dst].dtype).itemsize))
    else: costs.append(0.0)
  return costs


def balanced_cuts(spec: PlanSpec, stages: int) -> list[int]:
  """Op positions where stages 2.. start, so that each stage holds about an equal share of the work."""
  work = [i for i, op in enumerate(spec.ops) if not isinstance(op, ViewEntry)]
  if not isinstance(stages, int) or stages < 1: raise PlanSpecError(f"stages must be a positive int, got {stages!r}")
  if stages > len(work): raise PlanSpecError(f"cannot cut {len(work)} ops into {stages} stages")
  costs = op_costs(spec)
  total = sum(costs[i] for i in work) or 1.0
  cuts: list[int] = []
  acc = 0.0
  for pos, i in enumerate(work[:-1]):
    acc += costs[i]
    k = len(cuts) + 1
    left = len(work) - pos - 1  # ops after this one
    if k < stages and (acc >= total * k / stages or left == stages - k): cuts.append(work[pos + 1])
  return cuts


def split(spec: PlanSpec, cuts: int | Sequence[int]) -> list[PlanSpec]:
  """The stages of `spec`: `cuts` is a stage count (balanced by balanced_cuts) or the op positions where stages 2.. start."""
  cuts = balanced_cuts(spec, cuts) if isinstance(cuts, int) else [int(c) for c in cuts]
  n = len(spec.ops)
  if any(not 0 < c < n for c in cuts) or cuts != sorted(set(cuts)):
    raise PlanSpecError(f"cuts {cuts} must be increasing op positions inside 1..{n - 1}")
  bounds = [0, *cuts, n]
  for k in range(len(bounds) - 1):
    if all(isinstance(spec.ops[i], ViewEntry) for i in range(bounds[k], bounds[k + 1])):
      raise PlanSpecError(f"stage {k} (ops {bounds[k]}..{bounds[k + 1] - 1}) holds no work, only views: cut elsewhere")
  stage_of = [next(k for k in range(len(bounds) - 1) if bounds[k] <= i < bounds[k + 1]) for i in range(n)]
  for op in spec.ops:
    if isinstance(op, KernelEntry | CopyEntry) and (bad := [d for d in op.deps if stage_of[d] > stage_of[op.id]]):
      raise PlanSpecError(f"op {op.id} depends on ops {bad} of a later stage: cut elsewhere")
  acc = accesses(spec.storages, spec.buffers, spec.ops)
  where = places(spec.buffers, spec.ops)
  nst = len(bounds) - 1
  stage_accs = [acc[bounds[k]:bounds[k + 1]] for k in range(nst)]
  touched = [{a.storage for op in accs for a in op} for accs in stage_accs]
  written = [{a.storage for op in accs for a in op if a.write} for accs in stage_accs]
  needs_old = [first_reads(accs) for accs in stage_accs]  # touched, and not first overwritten whole
  inputs_at = {where[io.buffer][0]: io for io in spec.inputs}
  def owner(buffer: int) -> int:
    st = where[buffer][0]
    writers = [k for k in range(nst) if st in written[k]]
    return writers[-1] if writers else max([k for k in range(nst) if st in touched[k]], default=nst - 1)
  out_at = [owner(io.buffer) for io in spec.outputs]
  check_at = [owner(c.buffer) for c in spec.checks]
  stages = []
  for k in range(nst):
    earlier = set().union(*written[:k]) if k else set()
    later = set().union(*touched[k + 1:]) if k + 1 < nst else set()
    act_in = sorted(earlier & needs_old[k])
    act_out = sorted(written[k] & later)
    outs = [io for io, at in zip(spec.outputs, out_at) if at == k]
    checks = [c for c, at in zip(spec.checks, check_at) if at == k]
    ins = [io for st, io in inputs_at.items() if st in touched[k] and st not in earlier]
    if not outs and not act_out: raise PlanSpecError(f"stage {k} (ops {bounds[k]}..{bounds[k + 1] - 1}) writes nothing that is used later")
    stages.append(_stage(spec, range(bounds[k], bounds[k + 1]), act_in, act_out, ins, outs, checks, earlier, where))
  return stages


def _stage(spec: PlanSpec, ops: range, act_in: list[int], act_out: list[int], ins: list[IOEntry], outs: list[IOEntry],
           checks: list[CheckEntry], earlier: set[int], where: Mapping[int, tuple[int, int, int]]) -> PlanSpec:
  used: list[int] = []  # original buffer indices, in first-use order
  def use(b: int) -> None:
    if b not in used: used.append(b)
  own = [spec.ops[i] for i in ops if not isinstance(spec.ops[i], ViewEntry)]
  for op in own:
    for b in (op.buffers if isinstance(op, KernelEntry) else [op.dst, op.src]): use(b)  # type: ignore[union-attr]
  for b in [*(io.buffer for io in [*ins, *outs]), *(c.buffer for c in checks)]: use(b)
  views: list[ViewEntry] = []
  pending = [op for op in spec.ops if isinstance(op, ViewEntry)]
  grew = True
  while grew:  # the view ops that make any used buffer, and their bases' views in turn
    grew = False
    for v in pending:
      if v.out in used and v not in views:
        views.append(v)
        use(v.base)
        grew = True
  views.sort(key=lambda v: v.id)
  # a view op's target keeps its own (unused) storage entry; what it reaches is its base's storage
  storages = sorted({spec.buffers[b].storage for b in used} | {where[b][0] for b in used} | set(act_in) | set(act_out))
  snew = {s: i for i, s in enumerate(storages)}
  bnew = {b: i for i, b in enumerate(used)}
  st_entries = []
  for s in storages:
    e = spec.storages[s]
    keep = e.weight is not None and s not in earlier  # data written by an earlier stage comes as an activation instead
    st_entries.append(StorageEntry(device=e.device, nbytes=e.nbytes, readonly=e.readonly and keep, weight=e.weight if keep else None))
  buffers = [BufferEntry(storage=snew[spec.buffers[b].storage], offset=spec.buffers[b].offset, size=spec.buffers[b].size,
                         dtype=spec.buffers[b].dtype) for b in used]
  act_bufs: dict[int, int] = {}
  for s in sorted(set(act_in) | set(act_out)):
    act_bufs[s] = len(buffers)
    buffers.append(BufferEntry(storage=snew[s], offset=0, size=spec.storages[s].nbytes, dtype="uint8"))
  ids: dict[int, int] = {}
  new_ops: list[Any] = []
  for op in [*views, *own]:
    ids[op.id] = len(new_ops)
    nid = len(new_ops)
    if isinstance(op, ViewEntry): new_ops.append(op.model_copy(update={"id": nid, "out": bnew[op.out], "base": bnew[op.base]}))
    elif isinstance(op, KernelEntry):
      new_ops.append(op.model_copy(update={"id": nid, "buffers": [bnew[b] for b in op.buffers], "deps": [ids[d] for d in op.deps if d in ids]}))
    else:
      new_ops.append(op.model_copy(update={"id": nid, "dst": bnew[op.dst], "src": bnew[op.src], "deps": [ids[d] for d in op.deps if d in ids]}))
  def moved(e: IOEntry) -> IOEntry: return e.model_copy(update={"buffer": bnew[e.buffer]})
  def act(s: int) -> IOEntry: return IOEntry(name=f"{ACTIVATION}{s}", buffer=act_bufs[s], shape=[spec.storages[s].nbytes], dtype="uint8")
  return PlanSpec(device=spec.device, target=spec.target, parallel=spec.parallel, reuse_memory=spec.reuse_memory, storages=st_entries,
                  buffers=buffers, ops=new_ops, inputs=[*(moved(e) for e in ins), *(act(s) for s in act_in)],
                  outputs=[*(moved(e) for e in outs), *(act(s) for s in act_out)], variables=dict(spec.variables),
                  checks=[c.model_copy(update={"buffer": bnew[c.buffer]}) for c in checks])


def run_in_order(spec: PlanSpec, stages: Sequence[Any], feeds: Mapping[str, Any], vars: Mapping[str, int] | None = None) -> dict[str, Any]:
  """Run the stage plans of `spec` (PortablePlan-like: .spec, .run(feeds, vars)) one after another in this process,
  passing the activations along; returns the whole plan's named outputs."""
  from kiln.executor.portable import check_feeds
  env, vals = check_feeds(spec, feeds, vars)  # the variables too: a later stage may see none of the inputs that carry one
  final: dict[str, Any] = {}
  for st in stages:
    got = st.run({io.name: env[io.name] for io in st.spec.inputs}, vals)
    env.update(got)
    final.update({k: v for k, v in got.items() if not k.startswith(ACTIVATION)})
  return final
