"""Building an execution plan: `ExecutionPlanBuilder` collects buffers and ops; `build()` compiles every kernel through the
kernel cache, derives dependencies from buffer hazards, groups ops into levels, plans intermediate memory, allocates,
and binds each kernel to its buffer addresses, giving an ExecutionPlan."""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kiln.codegen.choose import Opt
from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import DeviceSpec
from kiln.codegen.threads import thread_count
from kiln.executor import tune as tuning
from kiln.executor.buffer import Buffer, Storage
from kiln.executor.cache import compile_kernel_with_origin
from kiln.executor.execution import ExecutionPlan
from kiln.executor.hazards import HOST, ByteAccess, Engine, Lifetime, conflict, hazard_deps, levels, plan_reuse, queue_waits
from kiln.executor.overlap import PARALLEL_MIN_COST, parallel
from kiln.executor.prepared import PreparedBufferView, PreparedCopy, PreparedCustomFunction, PreparedKernel, PreparedOp, RuntimeVar
from kiln.executor.recipe import BufferRecipe, PlanRecipe
from kiln.ir.errors import CodegenError, KilnBufferError, PlanError, VariableBoundsError
from kiln.ir.ops import Ops
from kiln.ir.uop import UOp


# ---- op records (what add_* collected; build() prepares them) ----
@dataclass
class _KernelOp:
  id: int; ast: UOp; buffers: list[int]; fixedvars: dict[str, int]; deps: list[int]; name: str; opts: list[Opt] | None = None
  tune: bool | None = None
  device: str | None = None  # where it runs; None: where its buffers are

@dataclass
class _CopyOp:
  id: int; dst: int; src: int; deps: list[int]

@dataclass
class _ViewOp:
  id: int; out: int; base: int; byte_offset: int; byte_size: int

@dataclass
class _CustomOp:
  id: int; fn: Callable[..., Any]; buffers: list[int]; outputs: list[int] | None; deps: list[int]


class DeviceMismatchError(PlanError):
  """A kernel's buffers are not all on the device it runs on (add_copy them there first). Names the kernel, slot and buffer."""


def _op_label(op: Any) -> str:
  if isinstance(op, _KernelOp): return f"kernel {op.id} '{op.name}'"
  if isinstance(op, _CopyOp): return f"copy {op.id}"
  if isinstance(op, _CustomOp): return f"custom {op.id} '{getattr(op.fn, '__name__', 'fn')}'"
  return f"view {op.id}"


class ExecutionPlanBuilder:
  """Collects buffers and ops for an ExecutionPlan. Indices and op ids are plain ints, in the order things were added."""

  def __init__(self, device: str | DeviceSpec = "CPU", *, parallel: bool | None = None, reuse_memory: bool = True):
    self.device = str(DeviceSpec.parse(device))
    self.parallel, self.reuse_memory = parallel, reuse_memory  # parallel None: overlap only kernels big enough to gain
    self.buffers: list[Buffer] = []
    self._index: dict[int, int] = {}  # id(buffer) -> its index: a buffer added again is the same index (held in buffers: ids stay unique)
    self.ops: list[_KernelOp | _CopyOp | _ViewOp | _CustomOp] = []
    self.outputs: list[int] = []

  def add_buffer(self, buf: Buffer) -> int:
    if not isinstance(buf, Buffer): raise PlanError(f"add_buffer takes a kiln Buffer, got {type(buf).__name__}")
    if (i := self._index.get(id(buf))) is not None: return i
    self._index[id(buf)] = len(self.buffers)
    self.buffers.append(buf)
    return len(self.buffers) - 1

  def add_kernel(self, ast: UOp, buffers: Sequence[int], fixedvars: Mapping[str, int] | None = None, deps: Sequence[int] | None = None,
                 opts: Sequence[Opt] | None = None, tune: bool | None = None, device: str | DeviceSpec | None = None) -> int:
    """Slot i of the AST binds plan buffer buffers[i]. `opts` replaces the heuristic's optimisation options for this kernel
    ([] means none; the kernel cache keys on them). `tune=True` chooses them by timing candidates at build() on the
    plan's buffers (kiln.executor.tune: it writes the kernel's outputs, within KILN_TUNE_BUDGET seconds, remembered in
    the cache directory); None follows KILN_TUNE, False never tunes. `device` is where it runs (None: where its buffers
    are); every buffer it binds must be there, else build() raises DeviceMismatchError. Returns the op id."""
    if not isinstance(ast, UOp): raise PlanError(f"add_kernel takes a kernel AST (UOp), got {type(ast).__name__}")
    name = ast.arg if ast.op is Ops.SINK and isinstance(ast.arg, str) else f"kernel{len(self.ops)}"
    dev = None if device is None else str(DeviceSpec.parse(device))
    if opts is not None:
      if isinstance(opts, (str, bytes)) or not isinstance(opts, Sequence) or not all(isinstance(o, Opt) for o in opts):
        raise PlanError(f"kernel {len(self.ops)} '{name}': opts must be a list of kiln.codegen.choose.Opt, got {opts!r}")
      opts = list(opts)
      if tune: raise PlanError(f"kernel {len(self.ops)} '{name}': tune=True chooses the opts itself; pass opts or tune, not both")
    self.ops.append(_KernelOp(len(self.ops), ast, [int(b) for b in buffers], dict(fixedvars or {}), list(deps or []), name, opts, tune, dev))
    return len(self.ops) - 1

  def add_copy(self, dst: int, src: int, deps: Sequence[int] | None = None) -> int:
    """dst <- src, byte for byte (equal byte sizes), between any two devices: host->device, device->host, device->device
    (on one GPU the device copies it; between two it goes through the host). Returns the op id."""
    if self._in_range(dst) and self._in_range(src) and not self._is_view_target(dst) and not self._is_view_target(src):
      _check_copy(self.buffers[dst], self.buffers[src], dst, src)
    self.ops.append(_CopyOp(len(self.ops), dst, src, list(deps or [])))
    return len(self.ops) - 1

  def add_view(self, out: int, base: int, byte_offset: int, byte_size: int) -> int:
    """Plan buffer `out` becomes a view of plan buffer `base`: byte_size bytes from byte_offset, in out's dtype."""
    self.ops.append(_ViewOp(len(self.ops), out, base, byte_offset, byte_size))
    return len(self.ops) - 1

  def add_custom(self, fn: Callable[..., Any], buffers: Sequence[int], outputs: Sequence[int] | None = None,
                 deps: Sequence[int] | None = None) -> int:
    """fn(*plan_buffers) runs on the host in its turn. `outputs` (positions in buffers) are the ones it writes; default all."""
    self.ops.append(_CustomOp(len(self.ops), fn, [int(b) for b in buffers], None if outputs is None else list(outputs), list(deps or [])))
    return len(self.ops) - 1

  def set_outputs(self, outputs: Sequence[int]) -> None: self.outputs = [int(o) for o in outputs]

  def _in_range(self, i: int) -> bool: return isinstance(i, int) and 0 <= i < len(self.buffers)
  def _is_view_target(self, i: int) -> bool: return any(isinstance(o, _ViewOp) and o.out == i for o in self.ops)

  def build(self) -> ExecutionPlan: return _Builder(self).build()


def _check_copy(d: Buffer, s: Buffer, di: int, si: int) -> None:
  if d.nbytes != s.nbytes:
    raise KilnBufferError(f"copy between buffers of different sizes: dst buffer {di} has {d.nbytes} bytes ({d.size} x {d.dtype.name}), "
                          f"src buffer {si} has {s.nbytes} bytes ({s.size} x {s.dtype.name})")
  if d.readonly: raise KilnBufferError(f"copy into read-only buffer {di}")


def _check_no_alias(label: str, bufs: list[int], slots: list[int], outs: list[int], buffers: list[Buffer]) -> None:
  """A kernel's code assumes its buffers do not overlap (noalias pointers; a peeled vector tile recomputes a few outputs
  from its inputs), so a slot it writes may share no byte with another slot."""
  span = {s: ByteAccess(buffers[bufs[s]].storage_id, *buffers[bufs[s]].byte_range, s in outs) for s in slots}
  for o in outs:
    for s in slots:
      if s != o and conflict([span[o]], [span[s]]):
        raise PlanError(f"{label}: slot {o} (buffer {bufs[o]}) is written and overlaps slot {s} (buffer {bufs[s]}) in memory; "
                        "a kernel's buffers must not alias: write to another buffer and copy back")


class _Builder:
  """One build(): validation, compiling, scheduling, memory planning, binding."""

  def __init__(self, b: ExecutionPlanBuilder):
    self.b, self.buffers = b, list(b.buffers)
    self.tune_all = tuning.tune_enabled()
    self.to_tune: list[_KernelOp] = []  # kernels to tune that have no stored choice yet

  def _idx(self, i: Any, what: str) -> int:
    if not isinstance(i, int) or not 0 <= i < len(self.buffers):
      raise PlanError(f"{what}: buffer index {i!r} is out of range (the plan has {len(self.buffers)} buffers)")
    return i

  def build(self) -> ExecutionPlan:
    b, ops = self.b, self.b.ops
    # what the plan was built from, before views and memory reuse rebind its buffers (ExecutionPlan.to_spec reads it)
    self.recipe = PlanRecipe(b.device, b.parallel, b.reuse_memory, [BufferRecipe(x.storage, x.offset, x.size, x.dtype) for x in b.buffers],
                             list(ops), list(b.outputs))
    if not b.outputs: raise PlanError("the plan has no outputs: call set_outputs([...]) with the buffers to read back")
    for o in b.outputs: self._idx(o, "set_outputs")
    ids = {op.id for op in ops}
    for op in ops:
      for d in getattr(op, "deps", []):
        if d not in ids: raise PlanError(f"{_op_label(op)} depends on unknown op {d!r} (ops are 0..{len(ops) - 1})")
    # views first: they change what later ops touch
    views: list[PreparedBufferView] = []
    for op in ops:
      if not isinstance(op, _ViewOp): continue
      out, base = self._idx(op.out, f"view {op.id} out"), self._idx(op.base, f"view {op.id} base")
      ob = self.buffers[out]
      if op.byte_size % ob.dtype.itemsize: raise PlanError(f"view {op.id}: byte_size {op.byte_size} is not a multiple of {ob.dtype.name}'s size")
      if ob.is_allocated: raise PlanError(f"view {op.id}: buffer {out} is already allocated; a view target must be a fresh buffer")
      self.buffers[out] = self.buffers[base].view(op.byte_offset, op.byte_size // ob.dtype.itemsize, ob.dtype)
      views.append(PreparedBufferView(op.id, out, base, op.byte_offset, op.byte_size))
    exec_ops = [op for op in ops if not isinstance(op, _ViewOp)]
    # compile and validate kernels
    prepared: dict[int, PreparedKernel | PreparedCopy | PreparedCustomFunction] = {}
    accesses: list[list[ByteAccess]] = []
    for op in exec_ops:
      pk: PreparedKernel | PreparedCopy | PreparedCustomFunction
      if isinstance(op, _KernelOp): pk, acc = self._kernel(op)
      elif isinstance(op, _CopyOp): pk, acc = self._copy(op)
      else: pk, acc = self._custom(op)
      prepared[op.id] = pk
      accesses.append(acc)
    # dependencies: hazards on storage byte ranges, plus explicit ones (onto views: nothing to wait for)
    pos = {op.id: i for i, op in enumerate(exec_ops)}
    deps = hazard_deps(accesses)
    explicit = [{pos[d] for d in op.deps if d in pos} for op in exec_ops]
    for i in range(len(exec_ops)): deps[i] |= explicit[i]
    lv = levels(deps, [_op_label(op) for op in exec_ops])
    for li, group in enumerate(lv):
      for i in group:
        p = prepared[exec_ops[i].id]
        p.level, p.dependencies = li, sorted(exec_ops[j].id for j in deps[i])
    lv = self._across_devices(exec_ops, prepared, lv, deps, explicit, accesses)
    op_levels = [[exec_ops[i].id for i in g] for g in lv]
    naive = self._plan_memory(exec_ops, accesses, lv)
    for buf in self.buffers: buf.ensure_allocated()
    self._tune(prepared, accesses)
    overlapped = self._overlapped(prepared, op_levels)
    self._bind(prepared, overlapped)
    all_ops: list[PreparedOp] = sorted([*prepared.values(), *views], key=lambda p: p.id)
    plan = ExecutionPlan(self.buffers, all_ops, op_levels, list(b.outputs), self._steps(prepared, op_levels, overlapped), naive)
    plan.recipe = self.recipe
    return plan

  def _kernel(self, op: _KernelOp) -> tuple[PreparedKernel, list[ByteAccess]]:
    label = _op_label(op)
    for i, bi in enumerate(op.buffers): self._idx(bi, f"{label} slot {i}")
    nodes = op.ast.toposort()
    slots = {u.arg: u for u in nodes if u.op is Ops.DEFINE_GLOBAL}
    nslots = max(slots, default=-1) + 1
    if len(op.buffers) != nslots:
      raise PlanError(f"{label} takes {nslots} buffers (DEFINE_GLOBAL slots 0..{nslots - 1}), got {len(op.buffers)}")
    if not any(u.op is Ops.STORE for u in nodes): raise PlanError(f"{label} has no outputs (it stores to no buffer)")
    binds = {u.src[0].arg[0]: int(u.src[1].arg) for u in nodes if u.op is Ops.BIND}
    device = self._kernel_device(op, label)
    tuned = op.opts is None and (op.tune or (op.tune is None and self.tune_all))
    try:
      if tuned:  # the stored choice, else the heuristic's kernel now and a search once the buffers exist
        kernel, origin, known = tuning.compile_choice(op.ast, device)
        if not known: self.to_tune.append(op)
      else: kernel, origin = compile_kernel_with_origin(op.ast, device, op.opts)
    except CodegenError as e:
      if op.opts is None: raise
      raise CodegenError(f"{label}: its opts {[str(o) for o in op.opts]} do not fit the kernel: {e}") from e
    if not kernel.outs: raise PlanError(f"{label} has no outputs (the compiled kernel writes no buffer)")
    # buffers must fit the kernel's arguments
    args = {a.slot: (a.dtype, a.size) for a in kernel.args}
    for slot in kernel.globals:
      want = args.get(slot) or ((str(slots[slot].dtype.base), slots[slot].dtype.size) if slot in slots else None)  # type: ignore[attr-defined]
      if want is None: continue
      buf = self.buffers[op.buffers[slot]]
      if buf.dtype.name != want[0]: raise PlanError(f"{label} slot {slot} wants {want[0]}, buffer {op.buffers[slot]} is {buf.dtype.name}")
      if want[1] > 0 and buf.size < want[1]:
        raise PlanError(f"{label} slot {slot} reads/writes {want[1]} x {want[0]}, buffer {op.buffers[slot]} has only {buf.size}")
      if slot in kernel.outs and buf.readonly: raise PlanError(f"{label} slot {slot} writes buffer {op.buffers[slot]}, which is read-only")
    _check_no_alias(label, op.buffers, kernel.globals, kernel.outs, self.buffers)
    # variables: bounds from the compiled kernel, else the AST's DEFINE_VARs
    bounds = {v.arg[0]: RuntimeVar(v.arg[0], v.arg[1], v.arg[2]) for v in nodes if v.op is Ops.DEFINE_VAR}
    bounds.update({v.name: RuntimeVar(v.name, v.min, v.max) for v in kernel.vars})
    fixed = {**binds, **op.fixedvars}
    for n, v in fixed.items():
      if (rv := bounds.get(n)) is not None and not rv.min <= v <= rv.max:
        raise VariableBoundsError(f"{label}: fixed variable {n}={v} is outside bounds [{rv.min}, {rv.max}]")
    fixed = {n: v for n, v in fixed.items() if n in kernel.var_names}
    vals = [fixed[n] if n in fixed else (bounds[n].min if n in bounds else 0) for n in kernel.var_names]
    pk = PreparedKernel(id=op.id, ast=op.ast, kernel=kernel, device=DeviceSpec.parse(device),
                        buffer_indices=[op.buffers[s] for s in kernel.globals],
                        output_indices=[i for i, s in enumerate(kernel.globals) if s in kernel.outs], vals=vals, fixedvars=fixed,
                        dependencies=[], buffer_ptrs=[], buffer_ids=[], runtime_vars=[bounds[n] for n in kernel.var_names if n in bounds],
                        origin=origin, opts=None if op.opts is None else list(op.opts))
    pk.symbolic_sizes = any(isinstance(x, UOp) for x in (*(kernel.global_size or ()), *(kernel.local_size or ())))
    acc = []
    for s in kernel.globals:
      buf = self.buffers[op.buffers[s]]
      w, r = s in kernel.outs, s in kernel.ins or s not in kernel.outs
      if w: acc.append(ByteAccess(buf.storage_id, *buf.byte_range, True))
      if r: acc.append(ByteAccess(buf.storage_id, *buf.byte_range, False))
    return pk, acc

  def _kernel_device(self, op: _KernelOp, label: str) -> str:
    """Where the kernel runs: op.device, else the device all its buffers are on. A buffer elsewhere (or a kernel on a
    device that only holds data) is a DeviceMismatchError naming the kernel, the slot, the buffer and both devices."""
    devs = [self.buffers[bi].device for bi in op.buffers]
    if op.device is not None: dev = op.device
    elif all(d == self.b.device for d in devs): dev = self.b.device
    else:  # the buffers decide: the plan's device if one of them is there, else the first output's (slot 0's) device
      dev = self.b.device if self.b.device in devs else devs[0]
    for i, (bi, d) in enumerate(zip(op.buffers, devs)):
      if d != dev:
        others = sorted(set(devs) - {dev})
        raise DeviceMismatchError(f"{label} runs on {dev}{'' if op.device is not None else ' (where its other buffers are)'}, but slot {i}: "
                                  f"buffer {bi} is on {d}; a kernel's buffers must all be on its device (this one's are on "
                                  f"{', '.join([dev, *others])}): add_copy it first, to a buffer on {dev}")
    if dev.startswith("DISK"):
      raise DeviceMismatchError(f"{label}: its buffers are on {dev}, which holds data and runs no kernels: add_copy them to CPU first")
    return dev

  def _tune(self, prepared: dict[int, Any], accesses: list[list[ByteAccess]]) -> None:
    """Search the kernels without a stored choice on their allocated buffers; a winner other than the heuristic is
    prepared again with its options (it is in the kernel cache: no compile)."""
    reads = [a for acc in accesses for a in acc if not a.write]
    for op in self.to_tune:
      pk: PreparedKernel = prepared[op.id]
      keep: set[int] = set()  # buffers some op reads: their contents must survive the search
      for i in pk.buffer_indices:
        start, end = self.buffers[i].byte_range
        if conflict([ByteAccess(self.buffers[i].storage_id, start, end, True)], reads): keep.add(i)
      res = tuning.search(pk, self.buffers, keep)
      if res.opts is None: continue
      new, _ = self._kernel(replace(op, opts=res.opts))
      new.level, new.dependencies = pk.level, pk.dependencies
      prepared[op.id] = new

  def _copy(self, op: _CopyOp) -> tuple[PreparedCopy, list[ByteAccess]]:
    d, s = self._idx(op.dst, f"copy {op.id} dst"), self._idx(op.src, f"copy {op.id} src")
    db, sb = self.buffers[d], self.buffers[s]
    _check_copy(db, sb, d, s)
    return (PreparedCopy(op.id, d, s, db.nbytes, [], src_device=sb.device, dst_device=db.device),
            [ByteAccess(db.storage_id, *db.byte_range, True), ByteAccess(sb.storage_id, *sb.byte_range, False)])

  # ---- plans across devices ----
  def _is_async(self, device: str) -> bool:
    """Does the device run its work after the host has moved on (a CUDA GPU's stream), so another device or the host must
    wait for it? A runtime may say so with `asynchronous`; by default CUDA is, CPU and DISK are not."""
    if (known := self._async.get(device)) is None:
      default = DeviceSpec.parse(device).kind == "CUDA"
      known = self._async[device] = bool(getattr(get_runtime(device), "asynchronous", default)) if default else False
    return known

  def _engine(self, op: Any, p: Any) -> Engine:
    if isinstance(p, PreparedKernel):
      dev = str(p.device)
      return Engine(issues=frozenset({dev}), ordered=frozenset({dev})) if self._is_async(dev) else HOST
    if isinstance(p, PreparedCopy):
      s, d = p.src_device, p.dst_device
      sa, da = self._is_async(s), self._is_async(d)
      if s == d and sa and _device_copy(self.buffers[p.dst], self.buffers[p.src]) is not None:
        return Engine(issues=frozenset({d}), ordered=frozenset({d}))  # the device copies it, in its own order
      # through the host: out of the source (returns with the data, after the device's earlier work), into the destination
      return Engine(issues=frozenset({d} if da else ()), ordered=frozenset({q for q, a in ((s, sa), (d, da)) if a}),
                    drains=frozenset({s} if sa else ()))
    return Engine(raw=frozenset(self.buffers[i].device for i in p.buffer_indices if self._is_async(self.buffers[i].device)))

  def _across_devices(self, exec_ops: list, prepared: Mapping[int, Any], lv: list[list[int]], deps: list[set[int]],
                      explicit: list[set[int]], accesses: list[list[ByteAccess]]) -> list[list[int]]:
    """Plans across devices: each op's engine, the order within a level (in a mixed plan: the device's launches first, then
    the host's own work, then what waits for a device: copies through the host and host functions on device memory; so the
    device computes while the host does), and where the host must wait for a device (each op's `waits`). A plan on one
    device keeps its order and gets no waits unless a host function touches device memory."""
    self._async: dict[str, bool] = {}
    engines = [self._engine(op, prepared[op.id]) for op in exec_ops]
    self._waits: dict[int, list[str]] = {}
    if not any(e.issues or e.raw for e in engines): return lv
    homes = {str(p.device) if isinstance(p, PreparedKernel) else "CPU" for p in prepared.values() if not isinstance(p, PreparedCopy)}
    if len(homes) > 1:  # a mixed plan
      def rank(i: int) -> int:
        e = engines[i]
        op = exec_ops[i]
        if e.issues and not e.drains and (isinstance(op, _KernelOp) or self.buffers[op.dst].device == self.buffers[op.src].device):
          return 0  # a launch (or a copy on one device): queued, the host goes on
        return 2 if (e.ordered or e.raw) else 1  # a copy through the host or a host function on device memory waits: last
      lv = [sorted(g, key=lambda i: (rank(i), i)) for g in lv]
    dev_of = {b.storage_id: b.device for b in self.buffers}
    queue_of = {sid: d for sid, d in dev_of.items() if self._is_async(d)}
    order = [i for g in lv for i in g]
    for i, qs in queue_waits(order, deps, explicit, accesses, queue_of, engines).items():
      prepared[exec_ops[i].id].waits = qs
      self._waits[exec_ops[i].id] = qs
    return lv

  def _custom(self, op: _CustomOp) -> tuple[PreparedCustomFunction, list[ByteAccess]]:
    for i, bi in enumerate(op.buffers): self._idx(bi, f"{_op_label(op)} buffer {i}")
    outs = list(range(len(op.buffers))) if op.outputs is None else op.outputs
    if bad := [o for o in outs if not 0 <= o < len(op.buffers)]: raise PlanError(f"{_op_label(op)}: output positions {bad} are out of range")
    acc = []
    for i, bi in enumerate(op.buffers):
      buf = self.buffers[bi]
      acc.append(ByteAccess(buf.storage_id, *buf.byte_range, i in outs))
    return PreparedCustomFunction(op.id, op.fn, list(op.buffers), outs, []), acc

  def _plan_memory(self, exec_ops: list, accesses: list[list[ByteAccess]], lv: list[list[int]]) -> int:
    """Let intermediates (not outputs, not yet allocated, written before read) share memory when their level ranges do not
    overlap. A storage's lifetime spans every access through any buffer on it (a view too), and all of them move to the
    shared memory together, each at its offset (kiln.graph's read windows are views: excluding viewed storages cost its
    BERT encoder 24 MB of peak memory). Returns the bytes the plan would take without reuse."""
    storages: dict[int, Storage] = {}
    for buf in self.buffers: storages.setdefault(buf.storage_id, buf.storage)
    naive = sum(s.nbytes for s in storages.values())
    if not self.b.reuse_memory: return naive
    level_of = {i: li for li, g in enumerate(lv) for i in g}
    outs = {self.buffers[o].storage_id for o in self.b.outputs}
    span: dict[int, list[int]] = {}
    first_write: dict[int, bool] = {}
    for i in sorted(range(len(exec_ops)), key=lambda i: (level_of[i], i)):
      for a in accesses[i]:
        if a.storage not in span:
          span[a.storage] = [level_of[i], level_of[i]]
          first_write[a.storage] = a.write and not any(x.storage == a.storage and not x.write for x in accesses[i])
        span[a.storage][1] = max(span[a.storage][1], level_of[i])
    cands = [sid for sid, st in storages.items() if sid in span and sid not in outs and not st.allocated
             and st.external is None and first_write[sid]]
    if len(cands) < 2: return naive
    by_dev: dict[str, list[Lifetime]] = {}
    for sid in cands: by_dev.setdefault(storages[sid].device, []).append(Lifetime(sid, storages[sid].nbytes, *span[sid]))
    for dev, lts in by_dev.items():
      assign, sizes = plan_reuse(lts)
      slots = [Storage(dev, n) for n in sizes]
      for buf in self.buffers:
        if buf.storage_id in assign: buf._rebind(slots[assign[buf.storage_id]], buf.offset)
    return naive

  def _bind(self, prepared: Mapping[int, Any], overlapped: list[list[PreparedKernel]]) -> None:
    sharing: dict[Any, list[Any]] = {}  # bound calls whose runtime lets a plan's calls share their scratch
    for p in prepared.values():
      if isinstance(p, PreparedKernel):
        bufs = [self.buffers[i] for i in p.buffer_indices]
        p.buffer_ptrs, p.buffer_ids = [b.ptr for b in bufs], [b.id for b in bufs]
        p.resize()
        p.bound = p.kernel.program.bind(p.buffer_ptrs, p.vals, p.global_size, p.local_size)
        if hasattr(p.bound, "share_scratch"): sharing.setdefault(type(p.bound), []).append(p.bound)
        continue
      run: Callable[[], Any]
      if isinstance(p, PreparedCopy): run = self._copy_fn(self.buffers[p.dst], self.buffers[p.src])
      else: run = functools.partial(p.fn, *[self.buffers[i] for i in p.buffer_indices])
      p.run = _after(_syncs(p.waits), run)  # a copy's or host function's waits run inside it (execute_profiled too)
    # a plan runs its steps one after another, but the kernels of an overlapped group run at once: each needs its own
    together = [[p.bound for p in g] for g in overlapped]
    for kind, calls in sharing.items(): kind.share_scratch(calls, together)

  @staticmethod
  def _copy_fn(dst: Buffer, src: Buffer) -> Callable[[], Any]:
    d, s = dst._host_bytes(), src._host_bytes()
    if d is not None and s is not None: return lambda: np.copyto(d, s)
    if (dev := _device_copy(dst, src)) is not None: return dev
    # host <-> device through the allocator, on exactly the buffers' bytes (not a view's whole storage)
    dr, sr = _region(dst), _region(src)
    if s is not None:
      if dr is not None:
        a, m = dst.storage.allocator, memoryview(s)  # type: ignore[arg-type]
        return lambda: a.copyin(dr, m)
      return lambda: dst.copyin(s)
    if d is not None:
      if sr is not None:
        a, m = src.storage.allocator, memoryview(d)  # type: ignore[arg-type]
        return lambda: a.copyout(m, sr)
      return lambda: src.copyout(d)
    tmp = np.empty(src.nbytes, np.uint8)  # between two devices through the host: staging allocated once, here, not on the fast path
    return lambda: (src.copyout(tmp), dst.copyin(tmp))

  def _overlapped(self, prepared: Mapping[int, Any], op_levels: list[list[int]]) -> list[list[PreparedKernel]]:
    """Per level, the kernels that run at once on threads (overlap.parallel), where two or more may."""
    auto = self.b.parallel is None and thread_count() > 1  # one thread asked for (KILN_THREADS=1): no kernel beside another
    groups = []
    for group in op_levels:
      # on its own (parallel=None) never a kernel sized by a run-time variable: its estimate is at the variables' upper
      # bounds, which a run may be far below (a text model exported with a dynamic batch and sequence ran 2 of 8 and 16
      # of 64, and the groups' hand-offs to Python threads took half its time); at sizes near the bounds such a kernel is
      # large enough to be split over the threads itself
      safe = [p for i in group if isinstance(p := prepared[i], PreparedKernel) and p.kernel.host_parallel_safe and
              (self.b.parallel or (auto and not p.runtime_vars and p.kernel.mem_bytes + p.kernel.flops >= PARALLEL_MIN_COST))]
      groups.append(safe if self.b.parallel is not False and len(safe) >= 2 else [])
    return groups

  def _steps(self, prepared: Mapping[int, Any], op_levels: list[list[int]], overlapped: list[list[PreparedKernel]]) -> list[Callable[[], Any]]:
    """The fast path: one callable per op (or per group of kernels overlapped on threads, `overlapped`), in level order."""
    steps: list[Callable[[], Any]] = []
    for group, safe in zip(op_levels, overlapped):
      ps = [prepared[i] for i in group]
      if safe:
        steps.extend(_syncs(sorted({q for p in safe for q in p.waits})))  # a kernel's waits run before it (the group's before the group)
        steps.append(parallel([p.bound for p in safe if p.bound is not None]))
      for p in ps:
        if p in safe: continue
        if isinstance(p, PreparedKernel) and p.bound is not None:
          steps.extend(_syncs(p.waits))
          steps.append(p.bound)
        else: steps.append(p.run)
    return steps


def _syncs(queues: Sequence[str]) -> list[Callable[[], Any]]:
  """The calls that wait for each queue's (device's) work so far."""
  return [get_runtime(q).synchronize for q in queues]


def _after(syncs: list[Callable[[], Any]], run: Callable[[], Any]) -> Callable[[], Any]:
  if not syncs: return run
  def waited() -> Any:
    for s in syncs: s()
    return run()
  return waited


def _region(buf: Buffer) -> Any:
  """The allocator handle of exactly buf's bytes (its storage's handle, or a view of it where the allocator makes views), or
  None (then Buffer.copyin/copyout go through the whole storage)."""
  st = buf.storage
  if st.handle is None or st.allocator is None: return None
  if buf.offset == 0 and buf.nbytes == st.nbytes: return st.handle
  view = getattr(st.allocator, "view", None)
  return view(st.handle, buf.offset, buf.nbytes) if view is not None else None


def _device_copy(dst: Buffer, src: Buffer) -> Callable[[], Any] | None:
  """A copy the device does itself (both buffers in one device's memory, an allocator with `copy`), or None."""
  if dst.device != src.device or dst._host_bytes() is not None: return None
  alloc = dst.storage.allocator
  if alloc is None or alloc is not src.storage.allocator or getattr(alloc, "copy", None) is None: return None
  dr, sr = _region(dst), _region(src)
  if dr is None or sr is None: return None
  return lambda: alloc.copy(dr, sr, dst.nbytes)
