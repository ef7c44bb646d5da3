"""Boundary models (pydantic): what a renderer hands a compiler, a compiler a runtime, and a runtime the executor.

Field names follow the seed runtime's ProgramSpec/CompiledSpec. Every model validates on construction and on
assignment, and round-trips through JSON (a UOp as its JSON graph form).

A spec's JSON is untrusted (a disk-cache entry in a new process, a file): `model_validate_json` reads strict JSON (no
duplicate keys, no NaN/Infinity) of at most MAX_SPEC_BYTES, and every model holds its fields to these limits, each refused
naming the limit and the value (a DocumentLimitError inside pydantic's ValidationError, or raised itself for the size):
  MAX_SPEC_BYTES     64 MiB    the JSON text (the disk cache's MAX_ENTRY_BYTES: no cache entry holds a larger spec)
  MAX_NAME_CHARS     1,024     name, entry_point, compiler, a variable's name, each applied option
  MAX_SOURCE_CHARS   32 MiB    src (the 100,000-op chain kernel's LLVM IR is well under it)
  MAX_OBJECT_BYTES   32 MiB    bytes (object code, cubin)
  MAX_BUFFERS        4,096     buf_count, entries of globals/outs/ins/args and slot numbers (kiln.ir.serialize.MAX_SLOTS)
  MAX_VARS           256       vars and var_names;  MAX_OPTS 256 applied_opts
  MAX_WORK_SIZE      2**31-1   a concrete global/local size (CUDA's grid limit; the CPU's thread split)
  MAX_THREADS        4,096     the CPU thread split (one argument tuple is built per thread)
  MAX_BUFFER_BYTES   2**47     scratch_bytes, a buffer's or argument's element count and bytes (kiln.ir.serialize's)
  MAX_PATH_CHARS     4,096     a DISK device's path (PATH_MAX)
  int64              flops, mem_bytes and a variable's bounds fit int64
The ast is a JSON graph: kiln.ir.serialize's node, depth, string and buffer limits apply to it.
"""
from __future__ import annotations

import base64
import builtins
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import (
  BaseModel,
  ConfigDict,
  Field,
  PlainSerializer,
  PlainValidator,
  ValidationError,
  WithJsonSchema,
  field_validator,
  model_serializer,
  model_validator,
)
from pydantic.config import ExtraValues

from kiln.ir.analysis import sym_int_eval
from kiln.ir.dtype import parse_dtype
from kiln.ir.errors import DeviceError, IRTypeError
from kiln.ir.ops import Ops
from kiln.ir.serialize import MAX_BUFFER_BYTES, MAX_SLOTS, UOpGraph, check_limit, from_graph, load_json_document, to_graph
from kiln.ir.uop import UOp

# ---- document limits (see the module docstring) ----
MAX_SPEC_BYTES = 64 << 20
MAX_NAME_CHARS = 1024
MAX_SOURCE_CHARS = 32 << 20
MAX_OBJECT_BYTES = 32 << 20
MAX_BUFFERS = MAX_SLOTS
MAX_VARS = 256
MAX_OPTS = 256
MAX_WORK_SIZE = 2**31 - 1
MAX_THREADS = 4096
MAX_PATH_CHARS = 4096
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_int64(what: str, v: int) -> None:
  if not INT64_MIN <= v <= INT64_MAX: raise ValueError(f"{what} {v} does not fit int64")

# ---- devices ----
_DEVICE_RE = re.compile(r"^(?P<kind>[A-Za-z]+)(?::(?P<rest>.*))?$")


class DeviceSpec(BaseModel):
  """A parsed device: CPU, CUDA:<n> (GPU is an alias of CUDA), DISK:<path> (the path keeps its case)."""
  model_config = ConfigDict(frozen=True, extra="forbid")
  kind: Literal["CPU", "CUDA", "DISK"]
  index: int = 0
  path: str | None = None

  @model_validator(mode="before")
  @classmethod
  def _from_str(cls, v: Any) -> Any:
    if isinstance(v, DeviceSpec): return {"kind": v.kind, "index": v.index, "path": v.path}
    if not isinstance(v, str): return v
    return _parse(v)

  @model_validator(mode="after")
  def _check(self) -> DeviceSpec:
    if self.kind == "DISK" and not self.path: raise ValueError("DISK device needs a path: DISK:/some/file")
    if self.path is not None: check_limit("the DISK path's length", len(self.path), "MAX_PATH_CHARS", MAX_PATH_CHARS)
    if self.kind != "DISK" and self.path is not None: raise ValueError(f"{self.kind} device takes no path")
    if self.index < 0: raise ValueError(f"device index must be >= 0, got {self.index}")
    if self.kind == "CPU" and self.index != 0: raise ValueError("CPU has a single device (index 0)")
    return self

  @model_serializer
  def _ser(self) -> str: return str(self)

  @classmethod
  def parse(cls, s: str | DeviceSpec) -> DeviceSpec:
    if isinstance(s, DeviceSpec): return s
    try: return cls.model_validate(s)
    except ValueError as e: raise DeviceError(f"invalid device {s!r}: {_first_error(e)}") from None

  def __str__(self) -> str:
    if self.kind == "CPU": return "CPU"
    if self.kind == "DISK": return f"DISK:{self.path}"
    return f"CUDA:{self.index}"


def _first_error(e: Exception) -> str:
  errs = getattr(e, "errors", None)
  if callable(errs):
    try: return "; ".join(str(x.get("msg", x)).removeprefix("Value error, ") for x in errs())  # pydantic's prefix means nothing to a user
    except Exception: pass  # noqa: S110
  return str(e)


def _parse(s: str) -> dict[str, Any]:
  m = _DEVICE_RE.match(s.strip())
  if m is None: raise ValueError(f"cannot parse device {s!r}; expected CPU, CUDA, CUDA:<n>, GPU or DISK:<path>")
  kind, rest = m.group("kind").upper(), m.group("rest")
  if kind == "GPU": kind = "CUDA"
  if kind == "DISK": return {"kind": "DISK", "path": rest}
  if kind not in ("CPU", "CUDA"): raise ValueError(f"unknown device kind {m.group('kind')!r}; expected CPU, CUDA, GPU or DISK")
  if rest is None: return {"kind": kind}
  if not rest.isdigit(): raise ValueError(f"device index must be a non-negative integer, got {rest!r}")
  return {"kind": kind, "index": int(rest)}


# ---- symbolic sizes and bytes ----
def _uop_in(v: Any) -> UOp:
  if isinstance(v, UOp): return v
  if isinstance(v, UOpGraph): return from_graph(v)
  if isinstance(v, dict): return from_graph(UOpGraph.model_validate(v))
  raise ValueError(f"expected a UOp or its JSON graph, got {type(v).__name__}")


UOpField = Annotated[UOp, PlainValidator(_uop_in), PlainSerializer(lambda u: to_graph(u).model_dump(mode="json")),
                     WithJsonSchema({"type": "object", "description": "UOp JSON graph"})]


def _sym_in(v: Any) -> int | UOp:
  if isinstance(v, bool): raise ValueError("a size must be an int or a UOp, not a bool")
  if isinstance(v, int):
    if v < 1: raise ValueError(f"sizes must be positive, got {v}")
    check_limit("a work size", v, "MAX_WORK_SIZE", MAX_WORK_SIZE)
    return v
  u = _uop_in(v)
  if u.op is Ops.CONST: return _sym_in(int(u.arg))
  if not u.dtype.is_int: raise ValueError(f"a symbolic size must be an integer UOp, got {u.dtype}")
  return u


SymInt = Annotated[int | UOp, PlainValidator(_sym_in),
                   PlainSerializer(lambda v: v if isinstance(v, int) else to_graph(v).model_dump(mode="json")),
                   WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "object"}]})]
def _bytes_in(v: Any) -> bytes:
  if isinstance(v, bytes): return v
  if not isinstance(v, str): raise ValueError(f"bytes are base64 text, got {type(v).__name__}")  # b64decode raised TypeError on an int
  check_limit("the base64 text of bytes", len(v), "MAX_OBJECT_BYTES (as base64)", (MAX_OBJECT_BYTES + 2) // 3 * 4)
  return base64.b64decode(v, validate=True)


Bytes64 = Annotated[bytes, PlainValidator(_bytes_in),
                    PlainSerializer(lambda b: base64.b64encode(b).decode()), WithJsonSchema({"type": "string", "contentEncoding": "base64"})]


def sym_eval(v: int | UOp, var_vals: Mapping[str, int]) -> int:
  """A symbolic launch or buffer size with concrete variable values (kiln.ir.analysis.sym_int_eval: C integer semantics).
  Values are not checked against the variables' bounds here: the plan and the runtimes check them where they bind them."""
  return sym_int_eval(v, var_vals, check_bounds=False)


def upper_vals(spec: ProgramSpec | CompiledSpec) -> list[int]:
  """Each variable's upper bound, in var_names order (0 for one without bounds: core_id): the values a kernel that reads its
  variables from memory is launched for (vars_in_memory)."""
  top = {v.name: v.max for v in spec.vars}
  return [top.get(n, 0) for n in spec.var_names]


class _Model(BaseModel):
  model_config = ConfigDict(validate_assignment=True, extra="forbid", arbitrary_types_allowed=True)

  def __setattr__(self, name: str, value: Any) -> None:
    # pydantic runs model validators after the field is already set: restore the old state when they reject it
    old = dict(self.__dict__)
    try: super().__setattr__(name, value)
    except ValidationError:
      self.__dict__.clear()
      self.__dict__.update(old)
      raise

  @classmethod
  def model_validate_json(cls, json_data: str | bytes | bytearray, *, strict: bool | None = None, extra: ExtraValues | None = None,
                          context: Any | None = None, by_alias: bool | None = None, by_name: bool | None = None) -> Self:
    """Untrusted JSON: at most MAX_SPEC_BYTES of strict JSON (kiln.ir.serialize.load_json_document), then validated."""
    doc = load_json_document(json_data, MAX_SPEC_BYTES, "MAX_SPEC_BYTES", f"{cls.__name__} JSON")
    return cls.model_validate(doc, strict=strict, extra=extra, context=context, by_alias=by_alias, by_name=by_name)

  @classmethod
  def model_validate_json_with(cls, json_data: str | bytes | bytearray, **known: Any) -> Self:
    """Untrusted JSON, as model_validate_json, whose missing fields the caller supplies from what it holds (the disk cache
    stores a kernel's spec without its AST: the entry's key names the AST, and the caller has it in hand, so it is neither
    stored twice nor rebuilt from JSON). JSON that holds one of those fields is refused."""
    doc = load_json_document(json_data, MAX_SPEC_BYTES, "MAX_SPEC_BYTES", f"{cls.__name__} JSON")
    if isinstance(doc, dict) and (both := sorted(set(doc) & set(known))):
      raise ValueError(f"{cls.__name__} JSON holds {both}, which the caller supplies")
    return cls.model_validate({**doc, **known} if isinstance(doc, dict) else doc)

  def _update(self, **changes: Any) -> None:
    """Change several fields at once, validated as a whole: a rejected change leaves the model as it was."""
    new = type(self).model_validate({**dict(self), **changes})
    self.__dict__.update(new.__dict__)


def _value_dtype(v: str) -> str:
  try: d = parse_dtype(v)
  except IRTypeError as e: raise ValueError(str(e)) from None  # a ValueError, so pydantic reports it against the field
  if d.kind in "vp" or d.count != 1: raise ValueError(f"must be a scalar value dtype, got {v!r}")
  return v


class Variable(_Model):
  """A runtime integer the kernel takes, with its DEFINE_VAR bounds."""
  name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
  min: int
  max: int

  @model_validator(mode="after")
  def _bounds(self) -> Variable:
    check_limit("a variable name's length", len(self.name), "MAX_NAME_CHARS", MAX_NAME_CHARS)
    for b in (self.min, self.max): _check_int64(f"variable {self.name[:64]}: bound", b)
    if self.min > self.max: raise ValueError(f"variable {self.name}: min {self.min} > max {self.max}")
    return self


class BufferSpec(_Model):
  """What a buffer is: element dtype, element count, device."""
  dtype: str
  size: int = Field(gt=0)
  device: DeviceSpec = Field(default_factory=lambda: DeviceSpec.parse("CPU"))

  @field_validator("dtype")
  @classmethod
  def _dtype(cls, v: str) -> str: return _value_dtype(v)

  @model_validator(mode="after")
  def _limits(self) -> BufferSpec:
    check_limit("a buffer's size in bytes", self.nbytes, "MAX_BUFFER_BYTES", MAX_BUFFER_BYTES)
    return self

  @property
  def nbytes(self) -> int: return self.size * parse_dtype(self.dtype).nbytes


class KernelArg(_Model):
  """One buffer argument of a kernel: its DEFINE_GLOBAL slot, element dtype and element count (-1 unknown); align: the bytes
  its address must be a multiple of when the kernel needs more than the element's size (16-byte vector loads), else 0."""
  slot: int = Field(ge=0)
  dtype: str
  size: int
  align: int = Field(default=0, ge=0, le=4096)

  @field_validator("dtype")
  @classmethod
  def _dtype(cls, v: str) -> str: return _value_dtype(v)

  @field_validator("size")
  @classmethod
  def _size(cls, v: int) -> int:
    if v < 1 and v != -1: raise ValueError(f"size must be positive or -1 (unknown), got {v}")
    check_limit("an argument's size in elements", v, "MAX_BUFFER_BYTES", MAX_BUFFER_BYTES)
    return v

  @field_validator("slot")
  @classmethod
  def _slot(cls, v: int) -> int:
    check_limit("an argument's slot", v + 1, "MAX_BUFFERS", MAX_BUFFERS)
    return v


def _check_buffers(globals_: list[int], outs: list[int], ins: list[int], buf_count: int) -> None:
  gset = set(globals_)
  if len(gset) != len(globals_): raise ValueError(f"globals has duplicates: {globals_}")
  for name, lst in (("outs", outs), ("ins", ins)):
    if bad := [x for x in lst if x not in gset]: raise ValueError(f"{name} {bad} are not in globals {globals_}")
  if buf_count != len(globals_): raise ValueError(f"buf_count {buf_count} != number of globals {len(globals_)}")


def _check_limits(spec: ProgramSpec | CompiledSpec) -> None:
  """The document limits of the fields ProgramSpec and CompiledSpec share (the module docstring lists them)."""
  for what, text in (("name", spec.name), ("entry_point", spec.entry_point), *(("an applied option", o) for o in spec.applied_opts),
                     *(("a variable name", v) for v in spec.var_names), *((("compiler", spec.compiler),) if isinstance(spec, CompiledSpec) else ())):
    check_limit(f"{what}'s length", len(text), "MAX_NAME_CHARS", MAX_NAME_CHARS)
  if spec.src is not None: check_limit("the source text's length", len(spec.src), "MAX_SOURCE_CHARS", MAX_SOURCE_CHARS)
  if isinstance(spec, CompiledSpec): check_limit("the object code's size in bytes", len(spec.bytes), "MAX_OBJECT_BYTES", MAX_OBJECT_BYTES)
  check_limit("buf_count", spec.buf_count, "MAX_BUFFERS", MAX_BUFFERS)
  for what, lst in (("globals", spec.globals), ("outs", spec.outs), ("ins", spec.ins), ("args", spec.args)):
    check_limit(f"the number of {what}", len(lst), "MAX_BUFFERS", MAX_BUFFERS)
  for slot in spec.globals:
    if slot < 0: raise ValueError(f"a global slot must be >= 0, got {slot}")
    check_limit("a global slot", slot + 1, "MAX_BUFFERS", MAX_BUFFERS)
  check_limit("the number of vars", len(spec.vars), "MAX_VARS", MAX_VARS)
  check_limit("the number of var_names", len(spec.var_names), "MAX_VARS", MAX_VARS)
  check_limit("the number of applied_opts", len(spec.applied_opts), "MAX_OPTS", MAX_OPTS)
  check_limit("threads", spec.threads, "MAX_THREADS", MAX_THREADS)
  check_limit("slots", spec.slots, "MAX_THREADS", MAX_THREADS)
  check_limit("scratch_bytes", spec.scratch_bytes, "MAX_BUFFER_BYTES", MAX_BUFFER_BYTES)
  for what, v in (("flops", spec.flops), ("mem_bytes", spec.mem_bytes)): _check_int64(what, v)


def _check_var_names(var_names: list[str]) -> None:
  if len(set(var_names)) != len(var_names):
    dup = sorted({v for v in var_names if var_names.count(v) > 1})
    raise ValueError(f"var_names must be unique, duplicated: {dup}")


class ProgramSpec(_Model):
  """Source and metadata from a renderer, consumed by a compiler."""
  name: str = Field(min_length=1)
  src: str
  device: DeviceSpec
  ast: UOpField
  global_size: tuple[SymInt, SymInt, SymInt] | None = None
  local_size: tuple[SymInt, SymInt, SymInt] | None = None
  vars: list[Variable] = Field(default_factory=list)
  var_names: list[str] = Field(default_factory=list)  # positional order of vals; "core_id" last when threaded
  globals: list[int] = Field(default_factory=list)
  outs: list[int] = Field(default_factory=list)
  ins: list[int] = Field(default_factory=list)
  buf_count: int = Field(default=0, ge=0)
  args: list[KernelArg] = Field(default_factory=list)  # per global, in globals order
  applied_opts: list[str] = Field(default_factory=list)
  threads: int = Field(default=1, ge=1)  # CPU split: the chunks the threads claim (global_size[0]); 1 when not split
  slots: int = Field(default=0, ge=0)  # CPU split: most threads with a scratch of their own (PACK, KEEP); 0: any number
  scratch_bytes: int = Field(default=0, ge=0)  # CPU: per-call scratch (threaded reduction partials, packed panels)
  finish: bool = False  # CPU: after the chunks, one more call with core_id == threads folds their partials
  work: SymInt | None = None  # CPU, split over a symbolic axis: element-ops as an expression of the variables (choose.heuristic.split_rule)
  split_min: int = Field(default=0, ge=0)  # ... under which the runtime runs it on the calling thread alone (0: always split)
  entry_point: str = ""  # the symbol to call when it differs from name (CPU: name plus a hash of the code)
  flops: int = Field(default=0, ge=0)  # estimated, for profiles
  mem_bytes: int = Field(default=0, ge=0)
  shared_bytes: int = Field(default=0, ge=0, le=1 << 20)  # GPU: dynamic shared memory per block the launch must give
  # GPU: the variables are read from a device array of int32 (var_names order) passed after the buffers, and the grid is
  # launched at their upper bounds (kiln.codegen.render.cuda_vars)
  vars_in_memory: bool = False

  @model_validator(mode="after")
  def _consistent(self) -> ProgramSpec:
    _check_limits(self)
    _check_buffers(self.globals, self.outs, self.ins, self.buf_count)
    _check_var_names(self.var_names)
    if bad := [v.name for v in self.vars if v.name not in self.var_names]: raise ValueError(f"vars {bad} are not in var_names")
    if self.args and [a.slot for a in self.args] != self.globals: raise ValueError("args must list the globals in order")
    return self

  @classmethod
  def new(cls, name: str, src: str, device: DeviceSpec | str, ast: UOp) -> ProgramSpec:
    return cls(name=name, src=src, device=DeviceSpec.parse(device), ast=ast)

  def add_var(self, var: Variable) -> None:
    """Add a variable (and its name to var_names when new); a name already in vars is an error."""
    if any(v.name == var.name for v in self.vars): raise ValueError(f"variable {var.name} is already in vars")
    self._update(vars=[*self.vars, var], var_names=self.var_names if var.name in self.var_names else [*self.var_names, var.name])

  def set_work_sizes(self, global_size: tuple, local_size: tuple | None) -> None:
    self._update(global_size=global_size, local_size=local_size)

  def set_var_names(self, var_names: list[str]) -> None: self._update(var_names=list(var_names))

  def set_buffer_metadata(self, globals_: list[int], outs: list[int], ins: list[int]) -> None:
    """Set globals, outs and ins together; validated as a whole, so a bad set leaves the spec unchanged."""
    args = [a for a in self.args if a.slot in globals_]
    self._update(globals=list(globals_), outs=list(outs), ins=list(ins), buf_count=len(globals_),
                 args=args if [a.slot for a in args] == list(globals_) else [])  # args no longer describing every global are dropped


class CompiledSpec(_Model):
  """A compiler's result: source (JIT backends) or bytes (object code, cubin). Carries what is needed to load and call it
  without rendering again, so a disk-cache hit in a new process needs no codegen."""
  name: str = Field(min_length=1)
  src: str | None = None
  bytes: Bytes64 = b""
  ast: UOpField
  var_names: list[str] = Field(default_factory=list)
  global_size: tuple[SymInt, SymInt, SymInt] | None = None
  local_size: tuple[SymInt, SymInt, SymInt] | None = None
  buf_count: int = Field(default=0, ge=0)
  # carried over from the ProgramSpec (not in the seed, which re-renders)
  device: DeviceSpec = Field(default_factory=lambda: DeviceSpec.parse("CPU"))
  vars: list[Variable] = Field(default_factory=list)
  globals: list[int] = Field(default_factory=list)
  outs: list[int] = Field(default_factory=list)
  ins: list[int] = Field(default_factory=list)
  args: list[KernelArg] = Field(default_factory=list)
  applied_opts: list[str] = Field(default_factory=list)
  threads: int = Field(default=1, ge=1)  # CPU split: chunks (as ProgramSpec)
  slots: int = Field(default=0, ge=0)
  scratch_bytes: int = Field(default=0, ge=0)
  finish: bool = False  # CPU: after the chunks, one more call with core_id == threads folds their partials
  work: SymInt | None = None  # CPU: as ProgramSpec
  split_min: int = Field(default=0, ge=0)
  entry_point: str = ""  # the symbol to call when it differs from name (CPU: name plus a hash of the code)
  flops: int = Field(default=0, ge=0)
  mem_bytes: int = Field(default=0, ge=0)
  shared_bytes: int = Field(default=0, ge=0, le=1 << 20)  # GPU: dynamic shared memory per block (as ProgramSpec)
  vars_in_memory: bool = False  # GPU: variables from a device array, the grid at their upper bounds (as ProgramSpec)
  compiler: str = ""

  @model_validator(mode="after")
  def _consistent(self) -> CompiledSpec:
    _check_limits(self)
    if self.src is None and not self.bytes: raise ValueError("a CompiledSpec needs src or bytes")
    _check_var_names(self.var_names)
    if self.globals: _check_buffers(self.globals, self.outs, self.ins, self.buf_count)
    return self

  @classmethod
  def from_source(cls, name: str, src: str, ast: UOp, buf_count: int) -> CompiledSpec:
    return cls(name=name, src=src, ast=ast, buf_count=buf_count, globals=list(range(buf_count)) if buf_count else [])

  @classmethod
  def from_bytes(cls, name: str, data: builtins.bytes, ast: UOp) -> CompiledSpec: return cls(name=name, bytes=data, ast=ast)

  @classmethod
  def from_source_with_sizes(cls, name: str, src: str, ast: UOp, global_size: tuple | None, local_size: tuple | None,
                             buf_count: int) -> CompiledSpec:
    return cls(name=name, src=src, ast=ast, global_size=global_size, local_size=local_size, buf_count=buf_count,
               globals=list(range(buf_count)) if buf_count else [])

  @classmethod
  def from_program(cls, spec: ProgramSpec, *, src: str | None = None, data: builtins.bytes = b"", compiler: str = "") -> CompiledSpec:
    """Carry a ProgramSpec's metadata over to its compiled form."""
    return cls(name=spec.name, src=src, bytes=data, ast=spec.ast, var_names=spec.var_names, global_size=spec.global_size,
               local_size=spec.local_size, buf_count=spec.buf_count, device=spec.device, vars=spec.vars, globals=spec.globals,
               outs=spec.outs, ins=spec.ins, args=spec.args, applied_opts=spec.applied_opts, threads=spec.threads,
               slots=spec.slots, scratch_bytes=spec.scratch_bytes, finish=spec.finish, work=spec.work, split_min=spec.split_min,
               entry_point=spec.entry_point,
               flops=spec.flops, mem_bytes=spec.mem_bytes, shared_bytes=spec.shared_bytes,
               vars_in_memory=spec.vars_in_memory, compiler=compiler)
