"""Portable plans: `PlanSpec`, a pydantic model of a built ExecutionPlan that another process or host rebuilds.

A spec holds the plan's storages and buffers (size, dtype, device), its ops in order with their dependencies, each kernel
as its CompiledSpec JSON (object code and AST) for the target it was built on, and the named inputs and outputs. Weights
(storages whose contents exist when the plan is built and that are not inputs) travel by reference, never inside it: a
file region (`kind="file"`: a DISK map or a mapped weight file) or a key the rebuilding side resolves (`kind="object"`:
`export()` hands back the arrays, a Ray object store carries them), each with its sha256.

`export(plan, ...)` writes a built plan as a spec; `builder_from_spec(spec, ...)` rebuilds it through the builder's public
API (add_buffer, add_kernel, ...), whose build() gives the plan (PortablePlan wraps the two for a caller that feeds arrays).

Rebuilding compiles nothing where the target key (kiln.executor.cache.target_key: device, CPU target, kiln versions and
source stamps, machine fingerprint) equals the spec's and the code is accepted; elsewhere every kernel is compiled again
from its AST for the local target (the heuristic's kernels get the local heuristic; explicit and tuned options are kept).
Object code is accepted under `code=`:
- "sealed" (default): only when its seal, an HMAC under this host's disk-cache key (the key shared with the writing host,
  or KILN_CACHE_KEY set alike on both), verifies: a spec from a file is untrusted, and an unsealed kernel is recompiled;
- "trusted": whenever the target matches (the caller vouches for where the spec came from, e.g. its own driver through Ray);
- "compile": never.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.codegen import diskcache
from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import CompiledSpec, DeviceSpec
from kiln.executor import debug
from kiln.executor.buffer import Buffer, Storage, base_chain, buffer_dtype
from kiln.executor.builder import ExecutionPlanBuilder
from kiln.executor.cache import CachedKernel, _stats, get_or_compile_kernel, kernel_key, target_key
from kiln.executor.checks import MAX_MESSAGE
from kiln.executor.execution import ExecutionPlan
from kiln.executor.prepared import PreparedKernel
from kiln.executor.spec_access import accesses, first_reads, places
from kiln.ir.errors import KilnError, PlanSpecError
from kiln.ir.serialize import load_json_document

FORMAT: Literal[1] = 1
MAX_PLAN_SPEC_BYTES = 1 << 30  # a spec holds object code and ASTs, never weights
CodePolicy = Literal["sealed", "trusted", "compile"]


class _Entry(BaseModel):
  model_config = ConfigDict(extra="forbid", frozen=True)


class WeightRef(_Entry):
  """Where a storage's contents come from: `nbytes` bytes at `offset` of file `path`, or the array the rebuilding side
  hands in under `key`; `sha256` of those bytes (checked before use unless the caller turns verification off)."""
  kind: Literal["file", "object"]
  nbytes: int = Field(gt=0)
  path: str | None = None
  offset: int = Field(default=0, ge=0)
  key: str | None = None
  sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

  @model_validator(mode="after")
  def _where(self) -> WeightRef:
    if self.kind == "file" and not self.path: raise ValueError("a file weight needs a path")
    if self.kind == "object" and not self.key: raise ValueError("an object weight needs a key")
    return self


class StorageEntry(_Entry):
  device: str
  nbytes: int = Field(gt=0)
  readonly: bool = False
  weight: WeightRef | None = None  # None: fresh memory (an intermediate, an output, an input fed at run time)


class BufferEntry(_Entry):
  storage: int = Field(ge=0)
  offset: int = Field(ge=0)
  size: int = Field(gt=0)
  dtype: str


class OptEntry(_Entry):
  op: str
  axis: int
  amount: int = Field(ge=1)

  def opt(self) -> Opt:
    try: return Opt(OptOps[self.op], self.axis, self.amount)
    except KeyError: raise PlanSpecError(f"unknown optimisation op {self.op!r}") from None


class KernelEntry(_Entry):
  kind: Literal["kernel"] = "kernel"
  id: int = Field(ge=0)
  buffers: list[int]
  fixedvars: dict[str, int] = Field(default_factory=dict)
  deps: list[int] = Field(default_factory=list)
  opts: list[OptEntry] | None = None  # None: the heuristic's (a rebuild on another target runs that target's heuristic)
  compiled: str  # the CompiledSpec as JSON text (its seal covers exactly these characters)
  seal: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

  def compiled_spec(self) -> CompiledSpec:
    try: return CompiledSpec.model_validate_json(self.compiled)
    except (ValidationError, KilnError) as e: raise PlanSpecError(f"kernel op {self.id}: its compiled kernel does not validate: {e}") from None


class CopyEntry(_Entry):
  kind: Literal["copy"] = "copy"
  id: int = Field(ge=0)
  dst: int
  src: int
  deps: list[int] = Field(default_factory=list)


class ViewEntry(_Entry):
  kind: Literal["view"] = "view"
  id: int = Field(ge=0)
  out: int
  base: int
  byte_offset: int = Field(ge=0)
  byte_size: int = Field(gt=0)


OpEntry = Annotated[KernelEntry | CopyEntry | ViewEntry, Field(discriminator="kind")]
Dim = int | str  # a size, or a product of runtime variables and a whole number ("batch", "2*seq", "batch*seq")


def dim_value(d: Dim, vals: Mapping[str, int]) -> int:
  if isinstance(d, int): return d
  out = 1
  for f in d.split("*"): out *= int(f) if f.isdigit() else vals[f]
  return out


def _dim_names(d: Dim) -> list[str]: return [] if isinstance(d, int) else [f for f in d.split("*") if not f.isdigit()]


class IOEntry(_Entry):
  """A named input (copied in before each run) or output (read back after it): plan buffer `buffer`, in `shape`."""
  name: str = Field(min_length=1)
  buffer: int = Field(ge=0)
  shape: list[Dim]
  dtype: str


class CheckEntry(_Entry):
  """A check (kiln.executor.checks): plan buffer `buffer` must hold only zeros after each run, else `message` is raised
  with the offending value in place of its last `{value}`. Not an output: a run returns only the named outputs."""
  buffer: int = Field(ge=0)
  message: str = Field(min_length=1, max_length=MAX_MESSAGE)


class PlanSpec(_Entry):
  format: Literal[1] = FORMAT
  device: str
  target: str  # kiln.executor.cache.target_key of the host that built it
  parallel: bool | None = None
  reuse_memory: bool = True
  storages: list[StorageEntry]
  buffers: list[BufferEntry]
  ops: list[OpEntry]
  inputs: list[IOEntry] = Field(default_factory=list)
  outputs: list[IOEntry]
  variables: dict[str, tuple[int, int]] = Field(default_factory=dict)
  checks: list[CheckEntry] = Field(default_factory=list)  # left out of the JSON when empty: the format of a spec without any

  @model_validator(mode="after")
  def _consistent(self) -> PlanSpec:
    ns, nb = len(self.storages), len(self.buffers)
    for i, b in enumerate(self.buffers):
      if b.storage >= ns: raise ValueError(f"buffer {i} names storage {b.storage}; the spec has {ns}")
      if b.offset + b.size * (size := buffer_dtype(b.dtype).itemsize) > self.storages[b.storage].nbytes:
        raise ValueError(f"buffer {i} ({b.size} x {b.dtype} at byte {b.offset}) runs past the end of storage {b.storage}")
      if b.offset % size: raise ValueError(f"buffer {i} ({b.dtype}) starts at byte {b.offset}, not on a {size}-byte element boundary")
    for pos, op in enumerate(self.ops):
      if op.id != pos: raise ValueError(f"op {pos} has id {op.id}: ops must be numbered in order from 0")
      refs = op.buffers if isinstance(op, KernelEntry) else [op.dst, op.src] if isinstance(op, CopyEntry) else [op.out, op.base]
      if bad := [r for r in refs if not 0 <= r < nb]: raise ValueError(f"op {pos} names buffers {bad}; the spec has {nb}")
      if isinstance(op, KernelEntry | CopyEntry) and (bad := [d for d in op.deps if not 0 <= d < len(self.ops)]):
        raise ValueError(f"op {pos} depends on unknown ops {bad}")
    names: set[str] = set()
    for io in [*self.inputs, *self.outputs]:
      if io.buffer >= nb: raise ValueError(f"{io.name!r} names buffer {io.buffer}; the spec has {nb}")
      if unknown := [n for d in io.shape for n in _dim_names(d) if n not in self.variables]:
        raise ValueError(f"{io.name!r} has dims {unknown} that are not variables of the plan")
      if bad := [d for d in io.shape if isinstance(d, int) and d < 0]: raise ValueError(f"{io.name!r} has negative dims {bad}")
    for io in self.inputs:
      if io.name in names: raise ValueError(f"two inputs are named {io.name!r}")
      names.add(io.name)
    outs: set[str] = set()
    for io in self.outputs:
      if io.name in outs: raise ValueError(f"two outputs are named {io.name!r}")
      outs.add(io.name)
    if not self.outputs: raise ValueError("a plan spec needs at least one output")
    if bad := [c.buffer for c in self.checks if c.buffer >= nb]: raise ValueError(f"checks name buffers {bad}; the spec has {nb}")
    return self

  def to_json(self) -> str: return self.model_dump_json(exclude=None if self.checks else {"checks"})

  @classmethod
  def from_json(cls, text: str | bytes) -> PlanSpec:
    """An untrusted document: strict JSON of at most MAX_PLAN_SPEC_BYTES, then validated; any failure is a PlanSpecError."""
    try: return cls.model_validate(load_json_document(text, MAX_PLAN_SPEC_BYTES, "MAX_PLAN_SPEC_BYTES", "PlanSpec JSON"))
    except ValidationError as e: raise PlanSpecError(f"invalid PlanSpec: {e}") from None
    except KilnError as e: raise PlanSpecError(str(e)) from None

  def kernel_count(self) -> int: return sum(isinstance(o, KernelEntry) for o in self.ops)


# ---- sealing object code ----
def _seal(key: bytes, target: str, compiled_json: str) -> str:
  h = hmac.new(key, b"kiln-planspec %d\0%s\0" % (FORMAT, target.encode()), hashlib.sha256)
  h.update(compiled_json.encode())
  return h.hexdigest()


def _seal_key() -> bytes | None: return diskcache.cache_key() if diskcache.enabled() else None


# ---- writing a spec ----
def _digest(raw: np.ndarray) -> str: return hashlib.sha256(raw.data).hexdigest()


def _file_of(st: Storage) -> tuple[str, int] | None:
  """(path, byte offset) when the storage's bytes are a region of a file: a DISK map, or a host array viewing one (a
  weight mapped by kiln.graph). None for anything else."""
  if st.device.startswith("DISK:"): return st.device[5:], int((st.options or {}).get("offset", 0))
  if st.external is None: return None
  start = int(st.external.ctypes.data)
  for a in base_chain(st.external):  # a view of a map leads to the owning DISK storage (through its KeepAlive)
    owner = getattr(a, "_owner", None)
    if isinstance(owner, Storage) and owner.device.startswith("DISK:"):
      mapped = owner.host_array()
      if mapped is None: return None
      return owner.device[5:], int((owner.options or {}).get("offset", 0)) + start - int(mapped.ctypes.data)
  return None


def _contents(st: Storage) -> np.ndarray:
  raw = st.host_array()
  if raw is not None: return raw
  out = np.empty(st.nbytes, np.uint8)
  st.allocator.copyout(memoryview(out), st.handle)  # type: ignore[arg-type]
  return out


def export(plan: ExecutionPlan, inputs: Mapping[str, int] | None = None, outputs: Mapping[str, int] | None = None,
           shapes: Mapping[str, Sequence[Dim]] | None = None, digest_files: bool = True,
           checks: Sequence[tuple[int, str]] = ()) -> tuple[PlanSpec, dict[str, np.ndarray]]:
  """The plan's PlanSpec and the arrays its object weights name (read-only uint8 views, zero-copy on the host).
  `inputs`/`outputs` name plan buffers (default: no inputs, the plan's outputs as output0, output1, ...); `shapes` gives an
  input's or output's shape (ints, or names of the plan's variables; default: the flat buffer); `checks` are (buffer,
  message) pairs (kiln.executor.checks), plan outputs that are not named outputs."""
  recipe = plan.recipe
  if recipe is None: raise PlanSpecError("this plan has no build record: only a plan built by ExecutionPlanBuilder.build() can be written as a spec")
  inputs = dict(inputs or {})
  outputs = dict(outputs) if outputs is not None else {f"output{i}": b for i, b in enumerate(recipe.outputs)}
  nb = len(recipe.buffers)
  for what, m in (("input", inputs), ("output", outputs), ("check", {msg: b for b, msg in checks})):
    if bad := {n: b for n, b in m.items() if not isinstance(b, int) or not 0 <= b < nb}:
      raise PlanSpecError(f"{what}s {bad} name buffers outside the plan's 0..{nb - 1}")
  if loose := sorted({b for b, _ in checks} - set(recipe.outputs)):  # else the memory planner may have given it to another buffer
    raise PlanSpecError(f"checks name buffers {loose} that are not outputs of the plan (set_outputs)")
  if missing := sorted(set(recipe.outputs) - set(outputs.values()) - {b for b, _ in checks}):
    raise PlanSpecError(f"plan outputs {missing} have no name in outputs=")
  sids: dict[int, int] = {}
  stores: list[Storage] = []
  for br in recipe.buffers:
    if br.storage.id not in sids: sids[br.storage.id] = len(stores); stores.append(br.storage)
  fed = {sids[recipe.buffers[b].storage.id] for b in inputs.values()}
  dev = _kernel_device(plan, recipe.device)
  target = target_key(dev, get_runtime(dev))
  buffers = [BufferEntry(storage=sids[br.storage.id], offset=br.offset, size=br.size, dtype=br.dtype.name) for br in recipe.buffers]
  ops = _op_entries(plan, recipe, target)
  read, written = _contents_read(plan, stores, buffers, ops)
  arrays: dict[str, np.ndarray] = {}
  storages = []
  for si, st in enumerate(stores):
    weight = None
    if si not in fed and si in read:  # the plan reads what is in it before writing it: its contents must travel
      if (where := _file_of(st)) is not None:
        sha = _digest(_contents(st)) if digest_files else None
        weight = WeightRef(kind="file", nbytes=st.nbytes, path=os.path.abspath(where[0]), offset=where[1], sha256=sha)
      else:
        raw = _contents(st)
        sha = _digest(raw)
        key = f"s{si}-{sha[:16]}"
        view = raw.view()
        view.flags.writeable = False
        arrays[key] = view
        weight = WeightRef(kind="object", nbytes=st.nbytes, key=key, sha256=sha)
    # a weight no op writes is read-only in the spec, so a rebuild may share it (zero-copy) instead of copying it
    ro = st.readonly or (weight is not None and si not in written)
    storages.append(StorageEntry(device=st.device, nbytes=st.nbytes, readonly=ro, weight=weight))
  shapes = dict(shapes or {})

  def io(name: str, b: int) -> IOEntry:
    shape = list(shapes.get(name, [recipe.buffers[b].size]))
    return IOEntry(name=name, buffer=b, shape=shape, dtype=recipe.buffers[b].dtype.name)
  try:
    spec = PlanSpec(device=dev, target=target, parallel=recipe.parallel, reuse_memory=recipe.reuse_memory,
                    storages=storages, buffers=buffers, ops=ops, inputs=[io(n, b) for n, b in inputs.items()],
                    outputs=[io(n, b) for n, b in outputs.items()], variables=dict(plan.var_bounds),
                    checks=[CheckEntry(buffer=b, message=msg) for b, msg in checks])
  except ValidationError as e: raise PlanSpecError(f"the plan does not make a valid spec: {e}") from None
  return spec, arrays


def _kernel_device(plan: ExecutionPlan, default: str) -> str:
  """The one device the plan's kernels run on (the spec's device and target key). A plan whose kernels run on two or more
  devices is refused: a spec carries one target key and one device's object code."""
  first: dict[str, Any] = {}
  for pk in plan.kernels: first.setdefault(str(pk.device), pk)
  if len(first) > 1:
    where = "; ".join(f"{d} (first: kernel op {pk.id} '{pk.name}')" for d, pk in first.items())
    raise PlanSpecError(f"this plan's kernels run on {len(first)} devices: {where}. A PlanSpec carries one device's kernels (one "
                        "target key): export each device's part as its own plan, with the copies between them at the cuts")
  return next(iter(first), default)


def _contents_read(plan: ExecutionPlan, stores: list[Storage], buffers: list[BufferEntry], ops: list[KernelEntry | CopyEntry | ViewEntry]
                   ) -> tuple[set[int], set[int]]:
  """(storages whose contents at export time the plan reads: some op reads them before the plan has written all of them,
  in op order, which the plan's dependencies follow; storages any op writes), as spec storage indices."""
  kernels = {p.id: p.kernel for p in plan.prepared_ops if isinstance(p, PreparedKernel)}
  def slots(k: KernelEntry) -> tuple[list[int], list[int], list[int]]:  # the compiled kernel's, not its JSON read back
    ck = kernels[k.id]
    return list(ck.globals), list(ck.ins), list(ck.outs)
  accs = accesses([StorageEntry(device=st.device, nbytes=st.nbytes) for st in stores], buffers, ops, slots)
  touched = {a.storage for op in accs for a in op}
  where = places(buffers, ops)
  read = first_reads(accs) | ({where[b][0] for b in plan.outputs} - touched)  # an output no op writes reads back what it held
  return read, {a.storage for op in accs for a in op if a.write}


def _op_entries(plan: ExecutionPlan, recipe: Any, target: str) -> list[KernelEntry | CopyEntry | ViewEntry]:
  prepared = {p.id: p for p in plan.prepared_ops}
  key = _seal_key()
  out: list[KernelEntry | CopyEntry | ViewEntry] = []
  # one text and seal per distinct kernel, the same str object in every entry that runs it: a pickled spec (what Ray
  # ships to a worker) then holds each object code once (a BERT encoder: 56 entries, 10 distinct kernels, 2.9 -> 0.5 MB)
  texts: dict[int, tuple[str, str | None]] = {}
  for op in recipe.ops:
    kind = type(op).__name__
    if kind == "_CustomOp":
      raise PlanSpecError(f"op {op.id} is a host function ({getattr(op.fn, '__name__', 'fn')}): a spec cannot carry Python code; "
                          "build the plan without add_custom to make it portable")
    if kind == "_CopyOp": out.append(CopyEntry(id=op.id, dst=op.dst, src=op.src, deps=list(op.deps)))
    elif kind == "_ViewOp": out.append(ViewEntry(id=op.id, out=op.out, base=op.base, byte_offset=op.byte_offset, byte_size=op.byte_size))
    else:
      pk = prepared[op.id]
      assert isinstance(pk, PreparedKernel)
      if pk.kernel.compiled is None: raise PlanSpecError(f"kernel op {op.id} '{pk.name}' has no compiled spec to carry")
      if (hit := texts.get(id(pk.kernel.compiled))) is None:
        text = pk.kernel.compiled.model_dump_json()
        hit = texts[id(pk.kernel.compiled)] = (text, None if key is None else _seal(key, target, text))
      opts = None if pk.opts is None else [OptEntry(op=o.op.name, axis=o.axis, amount=o.amount) for o in pk.opts]
      out.append(KernelEntry(id=op.id, buffers=list(op.buffers), fixedvars=dict(op.fixedvars), deps=list(op.deps), opts=opts,
                             compiled=hit[0], seal=hit[1]))
  return out


# ---- rebuilding ----
def _weight_bytes(ref: WeightRef, weights: Mapping[str, Any], si: int, verify: bool) -> np.ndarray:
  if ref.kind == "file":
    assert ref.path is not None
    if verify and ref.sha256 is None:  # else a spec from anywhere could map any file this user can read into a plan's outputs
      raise PlanSpecError(f"storage {si}: its weight file {ref.path} has no sha256 in the spec; pass verify=False to map it unchecked")
    try: raw = Buffer(f"DISK:{ref.path}", ref.nbytes, "uint8", options={"offset": ref.offset}).numpy()
    except (KilnError, OSError, ValueError) as e:
      raise PlanSpecError(f"storage {si}: its weight file {ref.path} (bytes {ref.offset}..{ref.offset + ref.nbytes}) cannot be mapped: {e}") from None
    what = f"file {ref.path} at byte {ref.offset}"
  else:
    if ref.key is None or ref.key not in weights:
      raise PlanSpecError(f"storage {si}: weight {ref.key!r} ({ref.nbytes} bytes) was not handed in (weights=)")
    a = weights[ref.key]
    if isinstance(a, Buffer): a = a.numpy()
    if not isinstance(a, np.ndarray): raise PlanSpecError(f"storage {si}: weight {ref.key!r} is a {type(a).__name__}, not a numpy array")
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if raw.nbytes != ref.nbytes: raise PlanSpecError(f"storage {si}: weight {ref.key!r} has {raw.nbytes} bytes, the spec says {ref.nbytes}")
    what = f"weight {ref.key!r}"
  if verify and ref.sha256 is not None and _digest(raw) != ref.sha256:
    raise PlanSpecError(f"storage {si}: {what} does not match the spec's sha256 (it changed since the spec was written, or is another file)")
  return raw


def _storage(si: int, e: StorageEntry, weights: Mapping[str, Any], verify: bool, align: int) -> Storage:
  """The storage of spec entry si; a read-only weight on the CPU wraps the array handed in where it starts on an `align`
  boundary (the widest element of a buffer in it: what a kernel's loads assume, as Buffer.from_numpy's wrap), else a copy."""
  try: dev = str(DeviceSpec.parse(e.device))
  except (ValidationError, KilnError, ValueError) as err: raise PlanSpecError(f"storage {si}: bad device {e.device!r}: {err}") from None
  if e.weight is None: return Storage(dev, e.nbytes)
  if e.weight.nbytes != e.nbytes: raise PlanSpecError(f"storage {si} has {e.nbytes} bytes, its weight {e.weight.nbytes}")
  if dev.startswith("DISK:"):
    if e.weight.kind != "file" or dev[5:] != e.weight.path: raise PlanSpecError(f"storage {si}: a DISK storage's weight must be its own file")
    _weight_bytes(e.weight, weights, si, verify)
    return Storage(f"DISK:{e.weight.path}", e.nbytes, {"offset": e.weight.offset})
  raw = _weight_bytes(e.weight, weights, si, verify)
  if dev == "CPU" and e.readonly and raw.ctypes.data % align == 0:  # zero-copy where nothing writes it
    return Storage(dev, e.nbytes, external=raw, readonly=True)
  st = Storage(dev, e.nbytes)
  Buffer(dev, e.nbytes, "uint8", _storage=st).copyin(raw)
  if e.readonly: st.readonly = True
  return st


def _seed(k: KernelEntry, compiled: CompiledSpec, opts: list[Opt] | None, rt: Any, device: str, spec: PlanSpec, code: CodePolicy,
          key: bytes | None) -> None:
  """Put the kernel's shipped object code in the kernel cache when `code` accepts it (the caller has checked the target
  key), so build() compiles nothing."""
  if code == "sealed" and (key is None or k.seal is None or not hmac.compare_digest(k.seal, _seal(key, spec.target, k.compiled))): return
  ck_key = kernel_key(compiled.ast, device, opts)  # as compile_kernel keys it (the target key matched)
  try:
    def load() -> CachedKernel:
      ck = CachedKernel.from_compiled(compiled, rt.load(compiled), rt, ck_key, "spec")
      _stats["spec_loads"] += 1
      return ck
    get_or_compile_kernel(ck_key, device, load)
  except Exception as e:  # object code that does not load here after all: compile it from the AST instead
    if debug.DEBUG >= 1: debug.emit(f"kiln: kernel op {k.id} from the spec failed to load ({e}); compiling it")


def _bound_storages(spec: PlanSpec, bound: Mapping[str, Buffer]) -> dict[int, Storage]:
  """Spec storage index -> the caller's Storage that stands for it: each bound input's buffer must be the spec's (dtype,
  elements, byte offset) in a storage of the spec's size on its device; inputs sharing a storage in the spec share one."""
  named = {io.name: io for io in spec.inputs}
  out: dict[int, Storage] = {}
  for name, buf in bound.items():
    if (io := named.get(name)) is None: raise PlanSpecError(f"bound: the spec has no input named {name!r}")
    if not isinstance(buf, Buffer): raise PlanSpecError(f"bound: input {name!r} takes a kiln.executor Buffer, got {type(buf).__name__}")
    be = spec.buffers[io.buffer]
    se = spec.storages[be.storage]
    st = buf.storage
    if (buf.dtype.name, buf.size, buf.offset, st.nbytes, str(st.device)) != (be.dtype, be.size, be.offset, se.nbytes, se.device):
      raise PlanSpecError(f"bound: input {name!r} is {be.size} x {be.dtype} at byte {be.offset} of a {se.nbytes}-byte {se.device} storage "
                          f"in the spec; the buffer given is {buf.size} x {buf.dtype.name} at byte {buf.offset} of {st.nbytes} bytes on {st.device}")
    if out.setdefault(be.storage, st) is not st:
      raise PlanSpecError(f"bound: input {name!r} shares a storage with another bound input in the spec, not here")
  return out


def builder_from_spec(spec: PlanSpec, weights: Mapping[str, Any] | None = None, code: CodePolicy = "sealed",
                      verify: bool = True, bound: Mapping[str, Buffer] | None = None) -> ExecutionPlanBuilder:
  """An ExecutionPlanBuilder holding the spec's buffers and ops; build() gives the plan. See the module docstring for
  `code`; `verify=False` skips the weights' sha256 checks (a large mapped file is then not read up front). `bound` maps
  input names to Buffers the caller owns (a KV cache): the plan reads and writes them in place, in their storage."""
  if not isinstance(spec, PlanSpec): raise PlanSpecError(f"from_spec takes a PlanSpec, got {type(spec).__name__}")
  if code not in ("sealed", "trusted", "compile"): raise PlanSpecError(f"code must be 'sealed', 'trusted' or 'compile', got {code!r}")
  weights = dict(weights or {})
  given = _bound_storages(spec, bound or {})
  align = [1] * len(spec.storages)
  for be in spec.buffers:
    if be.storage < len(align): align[be.storage] = max(align[be.storage], buffer_dtype(be.dtype).itemsize)
  stores = [given.get(si) or _storage(si, e, weights, verify, align[si]) for si, e in enumerate(spec.storages)]
  b = ExecutionPlanBuilder(spec.device, parallel=spec.parallel, reuse_memory=spec.reuse_memory)
  for be in spec.buffers:
    st = stores[be.storage]
    b.add_buffer(Buffer(st.device, be.size, buffer_dtype(be.dtype), _storage=st, _offset=be.offset))
  key = _seal_key() if code == "sealed" else None
  rt = get_runtime(b.device)
  shipped = code != "compile" and target_key(b.device, rt) == spec.target  # else every kernel compiles for this host
  parsed: dict[str, CompiledSpec] = {}  # a kernel the plan runs at several places is read (AST and all) and seeded once
  seeded: set[tuple[str, str]] = set()
  for op in spec.ops:
    if isinstance(op, KernelEntry):
      opts = None if op.opts is None else [o.opt() for o in op.opts]
      if (compiled := parsed.get(op.compiled)) is None: compiled = parsed[op.compiled] = op.compiled_spec()
      if shipped and (op.compiled, repr(opts)) not in seeded:
        seeded.add((op.compiled, repr(opts)))
        _seed(op, compiled, opts, rt, b.device, spec, code, key)
      b.add_kernel(compiled.ast, op.buffers, op.fixedvars, op.deps, opts=opts, tune=False)
    elif isinstance(op, CopyEntry): b.add_copy(op.dst, op.src, op.deps)
    else: b.add_view(op.out, op.base, op.byte_offset, op.byte_size)
  b.set_outputs(list(dict.fromkeys([*(o.buffer for o in spec.outputs), *(c.buffer for c in spec.checks)])))  # kept, never reused
  return b
