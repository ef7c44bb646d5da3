"""The contracts every runtime implements. The executor talks to devices only through these."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
  from kiln.codegen.choose import Opt
  from kiln.codegen.spec import CompiledSpec, ProgramSpec
  from kiln.ir.uop import UOp


@runtime_checkable
class Renderer(Protocol):
  """Turns a verified kernel AST into source plus the metadata a runtime needs."""
  device: str

  def render(self, ast: UOp, opts: Sequence[Opt] | None = None) -> ProgramSpec: ...


@runtime_checkable
class Compiler(Protocol):
  """Source to loadable bytes. `cache_key` names the compiler, its version and target (part of disk-cache keys)."""
  cache_key: str

  def compile(self, spec: ProgramSpec) -> CompiledSpec: ...


@runtime_checkable
class BoundCall(Protocol):
  """A program bound to fixed buffer addresses: the executor's fast path. Calling it runs the kernel."""

  def __call__(self) -> None: ...
  def set_vals(self, vals: Sequence[int], global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None) -> None: ...


@runtime_checkable
class SessionCall(Protocol):
  """Optional on a BoundCall, for a runtime whose every call needs setup that a run of many calls can share (CUDA: making the
  device's context current on this thread). `session()` returns a context manager; inside `with call.session():`,
  `call.in_session()` runs the kernel without that setup. Calls of one runtime have equal `session`s, so ExecutionPlan enters
  one session around each run of them (on the thread that runs the plan) and calls in_session; a session must leave this
  thread as it found it when it exits, normally or by an exception."""
  session: Callable[[], AbstractContextManager[Any]]

  def in_session(self) -> None: ...


@runtime_checkable
class PlanRunning(Protocol):
  """Optional on a Program, for a runtime whose workers behave differently while a plan runs (the CPU pool's workers spin
  for the next split kernel only then, and briefly after). ExecutionPlan enters `plan_running()` once around each run of
  a plan holding such a program (once per distinct context factory), so the runtime keeps its own state; the context
  must undo what it did on exit, normally or by an exception."""
  plan_running: Callable[[], AbstractContextManager[Any]]


@runtime_checkable
class GraphCall(Protocol):
  """Optional on a SessionCall, for a runtime that can record a run of its launches and replay it as one (CUDA graphs).
  ExecutionPlan hands `graph_calls` each maximal run of this runtime's calls with nothing else between them (in the plan's
  order); it returns one callable that runs them all, called inside the session in their place, or None (the calls run one
  by one through in_session). The callable must follow later set_vals of those calls (runtime variables), and must give
  the same results as the calls run one by one."""
  graph_calls: Callable[[Sequence[Any]], Callable[[], None] | None]


@runtime_checkable
class SequenceCall(Protocol):
  """Optional on a BoundCall that needs no session, for a runtime that can run a stretch of its calls in one call of its
  own (the CPU: native code calls each kernel in turn, not Python). ExecutionPlan hands `sequence_calls` each maximal
  stretch of such calls of one runtime with nothing else between them; it returns one callable that runs them in order,
  called in their place, or None (they are called one by one). The callable must follow later set_vals of those calls."""
  sequence_calls: Callable[[Sequence[Any]], Callable[[], None] | None]


@runtime_checkable
class ValsWriter(Protocol):
  """Optional on a BoundCall, for a runtime that can write one variable's value into many of its calls at once (the
  CPU: one numpy assignment into the calls' argument blocks). `vals_writer(sites)`, for (call, position in the kernel's
  var_names) pairs of that runtime's calls, returns a callable that writes a value at every site, or None. ExecutionPlan
  checks the value against the bounds of every kernel it reaches first, and uses it only for calls whose launch size
  does not depend on variables. A runtime whose calls say so themselves has them carry `fixed_launch`: True for a call
  launched the same way whatever the values (CUDA: a kernel that reads its variables from device memory, its grid
  fixed at their upper bounds; the plan then neither resizes it nor hands it sizes), False for one set by set_vals."""
  vals_writer: Callable[[Sequence[tuple[Any, int]]], Callable[[int], None] | None]


@runtime_checkable
class Program(Protocol):
  """A loaded kernel. bufs are raw device addresses in `globals` order; vals follow `var_names` (core_id excluded:
  the runtime supplies it). Returns the kernel's time in seconds when wait=True."""
  name: str

  def __call__(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
               local_size: Sequence[int] | None = None, wait: bool = False) -> float | None: ...
  def bind(self, bufs: Sequence[int], vals: Sequence[int] = (), global_size: Sequence[int] = (1, 1, 1),
           local_size: Sequence[int] | None = None) -> BoundCall: ...


@runtime_checkable
class Allocator(Protocol):
  """Device memory. Handles are opaque; `ptr` gives the address a kernel takes."""

  def alloc(self, size: int, options: Any = None) -> Any: ...
  def free(self, handle: Any, size: int, options: Any = None) -> None: ...
  def ptr(self, handle: Any) -> int: ...
  def copyin(self, dest: Any, src: memoryview) -> None: ...
  def copyout(self, dest: memoryview, src: Any) -> None: ...
  def as_numpy(self, handle: Any, dtype: Any, count: int, offset: int = 0) -> Any:
    """A zero-copy numpy view of `count` elements at byte `offset`, or None when the memory is not host-visible."""
    ...


@runtime_checkable
class Runtime(Protocol):
  """One device: how to render, compile, load and allocate for it."""
  device: str
  renderer: Renderer
  compiler: Compiler
  allocator: Allocator
  host_parallel_safe: bool  # may independent kernels of this device run at once on host threads?

  def load(self, compiled: CompiledSpec) -> Program: ...
  def synchronize(self) -> None: ...
