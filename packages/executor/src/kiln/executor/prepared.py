"""Prepared ops: what build() turns each op into (a kernel bound to the plan's buffers, a copy, a view, a host function),
and RuntimeVar, a kernel variable's bounds. ExecutionPlan.execute() runs these."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kiln.codegen.choose import Opt
from kiln.codegen.protocols import BoundCall
from kiln.codegen.spec import DeviceSpec, sym_eval
from kiln.executor.cache import CachedKernel, Origin
from kiln.ir.uop import UOp


class RuntimeVar(NamedTuple):
  name: str
  min: int
  max: int


@dataclass(eq=False)
class PreparedKernel:
  """A compiled kernel bound to the plan's buffers. `vals` are positional, in `kernel.var_names` order."""
  id: int
  ast: UOp
  kernel: CachedKernel
  device: DeviceSpec
  buffer_indices: list[int]  # plan buffer per kernel argument (globals order)
  output_indices: list[int]  # positions in buffer_indices that the kernel writes
  vals: list[int]
  fixedvars: dict[str, int]
  dependencies: list[int]
  buffer_ptrs: list[int]
  buffer_ids: list[int]
  runtime_vars: list[RuntimeVar]
  global_size: tuple[int, int, int] = (1, 1, 1)
  local_size: tuple[int, int, int] | None = None
  level: int = 0
  origin: Origin = "compiled"
  bound: BoundCall | None = None
  symbolic_sizes: bool = False
  opts: list[Opt] | None = None  # the options it was compiled with (None: the heuristic's; a tuned kernel holds its winner)
  waits: list[str] = field(default_factory=list)  # devices synchronised before it runs (mixed plans: another device's work it needs)
  _sizes: dict[tuple[int, ...], tuple] = field(default_factory=dict, repr=False)

  @property
  def name(self) -> str: return self.kernel.entry_point

  def var_vals(self) -> dict[str, int]: return {**dict(zip(self.kernel.var_names, self.vals)), **self.fixedvars}

  def resize(self) -> None:
    """Re-evaluate symbolic launch sizes with the current vals (memoised: replaying a few sizes costs a dict lookup)."""
    k = tuple(self.vals)
    if (hit := self._sizes.get(k)) is None:
      vv = self.var_vals()
      gs, ls = self.kernel.global_size, self.kernel.local_size
      hit = (tuple(sym_eval(x, vv) for x in gs) if gs is not None else (1, 1, 1), tuple(sym_eval(x, vv) for x in ls) if ls is not None else None)
      if len(self._sizes) < 4096: self._sizes[k] = hit
    self.global_size, self.local_size = hit


@dataclass(eq=False)
class PreparedCopy:
  """dst <- src. Between the host and a device through the device's allocator (ordered after the device's earlier work;
  returns when the host side is done), on one device by the device itself, between two devices through the host."""
  id: int
  dst: int
  src: int
  nbytes: int
  dependencies: list[int]
  level: int = 0
  run: Callable[[], Any] = lambda: None
  src_device: str = "CPU"
  dst_device: str = "CPU"
  waits: list[str] = field(default_factory=list)  # devices synchronised before it runs

  @property
  def name(self) -> str:
    on_host = all(d == "CPU" or d.startswith("DISK") for d in (self.src_device, self.dst_device))
    where = "" if on_host else f" {self.src_device}->{self.dst_device}"
    return f"copy {self.src}->{self.dst}{where}"


@dataclass(eq=False)
class PreparedBufferView:
  """Resolved at build: plan buffer `out` becomes a view of `base` (no work at execute time)."""
  id: int
  out: int
  base: int
  byte_offset: int
  byte_size: int
  dependencies: list[int] = field(default_factory=list)
  level: int = -1

  @property
  def name(self) -> str: return f"view {self.base}[{self.byte_offset}:{self.byte_offset + self.byte_size}]->{self.out}"


@dataclass(eq=False)
class PreparedCustomFunction:
  """A host function called with the plan's Buffers (conservatively reads and writes all of them unless told)."""
  id: int
  fn: Callable[..., Any]
  buffer_indices: list[int]
  output_indices: list[int]
  dependencies: list[int]
  level: int = 0
  run: Callable[[], Any] = lambda: None
  waits: list[str] = field(default_factory=list)  # devices synchronised before it runs (it sees their earlier work done)

  @property
  def name(self) -> str: return getattr(self.fn, "__name__", "custom")


PreparedOp = PreparedKernel | PreparedCopy | PreparedBufferView | PreparedCustomFunction
