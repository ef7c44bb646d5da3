"""The built plan: `ExecutionPlan.execute()` is a loop over prepared calls; runtime variables are set without recompiling,
one run at a time per plan; profiling and describe() read it. kiln.executor.planspec.export(plan) writes it as a PlanSpec."""
from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from kiln.codegen.protocols import PlanRunning, SequenceCall, SessionCall, ValsWriter
from kiln.codegen.threads import CORE_ID
from kiln.executor import debug
from kiln.executor.buffer import Buffer
from kiln.executor.mapped import MappedFiles
from kiln.executor.prepared import PreparedCopy, PreparedCustomFunction, PreparedKernel, PreparedOp
from kiln.executor.profile import Profile, ProfileRecord
from kiln.executor.recipe import PlanRecipe
from kiln.ir.errors import PlanError, PlanPoisoned, VariableBoundsError


def session_runs(steps: list[Callable[[], Any]], outside: frozenset[int] = frozenset()
                 ) -> list[tuple[Callable[[], AbstractContextManager[Any]] | None, list[Callable[[], Any]]]]:
  """The steps in order, cut into runs of (session, callables). A bound call with a session (SessionCall: a CUDA launch) is
  called through its in_session inside its runtime's session, entered once per run; a call of another runtime's session
  starts a new run, so two devices' sessions never nest. The steps whose ids are in `outside` (the user's host functions)
  run in no session: a session never reaches user code. Any other step (a copy, a CPU kernel) stays in the run around it: it
  needs no session, or makes its own device's context current and restores it (every runtime's guard does).

  Inside a run, each stretch of one runtime's bound calls with nothing else between them is offered to the runtime as a
  whole (a session's calls: GraphCall, a CUDA graph; calls without a session: SequenceCall, the CPU's native loop): where
  it takes it, one callable replaces the stretch; a copy in the middle splits it in two."""
  runs: list[tuple[Any, list[Any]]] = []
  adoptable = False  # the last run is sessionless and holds no user function (the plan's first steps): a session may take it
  for s in steps:
    if id(s) in outside:
      if not runs or runs[-1][0] is not None: runs.append((None, []))
      runs[-1][1].append(s)
      adoptable = False
    elif isinstance(s, SessionCall):
      if runs and adoptable: runs[-1] = (s.session, runs[-1][1])
      elif not runs or runs[-1][0] is None or runs[-1][0] != s.session: runs.append((s.session, []))
      runs[-1][1].append(s)
      adoptable = False
    else:
      if not runs: runs, adoptable = [(None, [])], True
      runs[-1][1].append(s)
  return [(sess, _stretches(run, outside)) for sess, run in runs]


def _stretch_kind(s: Any, outside: frozenset[int]) -> tuple[Any, Callable[[Sequence[Any]], Any] | None] | None:
  """What a step's stretch is made of, and what makes one callable of it: a session's calls (GraphCall, where the runtime
  has it), one runtime's sequenceable calls (SequenceCall), or nothing (None: the step stands alone)."""
  if id(s) in outside: return None
  if isinstance(s, SessionCall): return s.session, getattr(s, "graph_calls", None)
  return (s.sequence_calls, s.sequence_calls) if isinstance(s, SequenceCall) else None


def _stretches(run: list[Any], outside: frozenset[int]) -> list[Callable[[], Any]]:
  """A run as callables: each stretch of calls of one kind as the one callable its runtime makes of it, else call by call
  (a session's calls through in_session)."""
  out: list[Callable[[], Any]] = []
  stretch: list[Any] = []
  kind: tuple[Any, Callable[[Sequence[Any]], Any] | None] | None = None

  def flush() -> None:
    whole = kind[1](list(stretch)) if stretch and kind is not None and kind[1] is not None else None
    out.extend([whole] if whole is not None else [c.in_session if isinstance(c, SessionCall) else c for c in stretch])
    stretch.clear()
  for s in run:
    k = _stretch_kind(s, outside)
    if k is None or kind is None or k[0] != kind[0]: flush()
    kind = k
    if k is None: out.append(s)
    else: stretch.append(s)
  flush()
  return out


class ExecutionPlan:
  """A built plan. Safe to share between threads: execute(), set_vars() and execute_with_vars() on one plan are serialised
  (a plan's buffers, bound calls and threaded-reduction scratch are single-use), so each run is whole and consistent."""

  def __init__(self, buffers: list[Buffer], ops: list[PreparedOp], op_levels: list[list[int]], outputs: list[int],
               steps: list[Callable[[], Any]], memory_without_reuse: int):
    self.buffers, self.prepared_ops, self.op_levels, self.outputs = buffers, ops, op_levels, outputs
    self._user_fns = frozenset(id(p.run) for p in ops if isinstance(p, PreparedCustomFunction))  # run outside any session
    self._steps = steps  # (sets _runs)
    by_id = {p.id: p for p in ops}
    self._order: list[PreparedKernel | PreparedCopy | PreparedCustomFunction] = [by_id[i] for g in op_levels for i in g]  # type: ignore[misc]
    self.kernels: list[PreparedKernel] = [p for p in self._order if isinstance(p, PreparedKernel)]
    # what the runtimes keep while a run lasts (the CPU pool's workers spin between split kernels only then): one each
    factories = {p.plan_running: None for pk in self.kernels if pk.kernel.threads > 1 and isinstance(p := pk.kernel.program, PlanRunning)}
    self._running = list(factories)
    self._poisoned: BaseException | None = None
    self._lock = threading.RLock()  # one run (or variable change) at a time; re-entrant so execute_with_vars holds it across both
    # runtime variables: where each lands, and its bounds (intersected over the kernels that take it)
    self._var_sites: dict[str, list[tuple[PreparedKernel, int]]] = {}
    self._var_bounds: dict[str, tuple[int, int]] = {}
    for pk in self.kernels:
      rv = {r.name: r for r in pk.runtime_vars}
      for pos, n in enumerate(pk.kernel.var_names):
        if n in pk.fixedvars or n == CORE_ID: continue
        self._var_sites.setdefault(n, []).append((pk, pos))
        lo, hi = (rv[n].min, rv[n].max) if n in rv else (-(1 << 31), (1 << 31) - 1)
        plo, phi = self._var_bounds.get(n, (lo, hi))
        self._var_bounds[n] = (max(lo, plo), min(hi, phi))
    self._unbound = set(self._var_sites)
    self._writers: dict[str, tuple[Callable[[int], None] | None, list[PreparedKernel]]] = {}  # _writer's, by variable
    self._current: dict[str, int] = {}
    storages = {b.storage_id: b.storage for b in buffers}
    self.memory_bytes = sum(s.nbytes for s in storages.values())  # the plan's peak buffer memory (all of it lives as long as the plan)
    self.memory_bytes_without_reuse = memory_without_reuse
    self.recipe: PlanRecipe | None = None  # what build() made it from (to_spec needs it)
    self._mapped = MappedFiles(s.external if s.external is not None else getattr(s.handle, "memoryview", lambda: None)()
                               for s in storages.values() if s.external is not None or s.device.startswith("DISK"))

  # ---- running ----
  @property
  def _steps(self) -> list[Callable[[], Any]]: return self._step_list

  @_steps.setter
  def _steps(self, steps: list[Callable[[], Any]]) -> None:
    self._step_list = steps
    self._runs = session_runs(steps, self._user_fns)  # grouped under their runtimes' sessions (a CUDA plan: one context push a run)

  def _check(self) -> None:
    if self._poisoned is not None:
      raise PlanPoisoned(f"this plan failed earlier ({type(self._poisoned).__name__}: {self._poisoned}); rebuild it to run again")
    if self._unbound:
      raise VariableBoundsError(f"variables {sorted(self._unbound)} are unbound: pass them to execute_with_vars({{...}})")

  def execute(self) -> None:
    """Run every op once, level by level (concurrent calls on one plan run one after another)."""
    with self._lock: self._execute()

  def _execute(self) -> None:
    if self._poisoned is not None or self._unbound: self._check()
    if self._mapped: self._mapped.check()  # a truncated weights file: a typed error here, not SIGBUS in a kernel
    if debug.DEBUG:
      self._run_profiled(print_lines=True)
      return
    running = self._enter_running() if self._running else None  # most plans: no context to enter, no call
    try:
      for session, run in self._runs:
        if session is None:
          for s in run: s()
        else:
          with session():
            for s in run: s()
    except BaseException as e:
      self._poisoned = e
      raise
    finally:
      if running is not None: running.close()

  def _enter_running(self) -> contextlib.ExitStack:
    """Each runtime's plan_running() context (PlanRunning), entered: the caller closes the stack when the run ends."""
    stack = contextlib.ExitStack()
    try:
      for f in self._running: stack.enter_context(f())
    except BaseException:
      stack.close()
      raise
    return stack

  def set_vars(self, var_vals: Mapping[str, int]) -> None:
    """Validate every value against its DEFINE_VAR bounds, then (only if all pass) set them. Names no kernel takes, fixed
    variables and core_id are ignored."""
    with self._lock: self._set_vars(var_vals)

  def _set_vars(self, var_vals: Mapping[str, int]) -> None:
    if self._poisoned is not None: self._check()
    new: dict[str, int] = {}
    for n, v in var_vals.items():
      if (b := self._var_bounds.get(n)) is None: continue
      if isinstance(v, bool) or not hasattr(v, "__index__"): raise VariableBoundsError(f"variable {n} must be an int, got {v!r}")
      v = operator.index(v)
      if not b[0] <= v <= b[1]: raise VariableBoundsError(f"variable {n}={v} is outside bounds [{b[0]}, {b[1]}]")
      if self._current.get(n) != v: new[n] = v
    if not new: return
    try:
      touched: dict[int, PreparedKernel] = {}
      for n, v in new.items():
        write, rest = self._writers[n] if n in self._writers else self._writer(n)
        for pk, pos in self._var_sites[n]: pk.vals[pos] = v
        if write is not None: write(v)
        for pk in rest: touched[pk.id] = pk
      for pk in touched.values():
        if pk.symbolic_sizes: pk.resize()
        assert pk.bound is not None
        pk.bound.set_vals(pk.vals, pk.global_size, pk.local_size)
      self._current.update(new)
      self._unbound.difference_update(new)
    except BaseException as e:
      self._poisoned = e
      raise

  def _writer(self, name: str) -> tuple[Callable[[int], None] | None, list[PreparedKernel]]:
    """How a value of variable `name` reaches its kernels: the runtime's writer for every site it takes at once
    (ValsWriter), and the kernels left to set_vals one by one. Made at the first set_vars that changes it."""
    sites = self._var_sites[name]
    batch: list[tuple[ValsWriter, PreparedKernel, int]] = []
    for pk, pos in sites:
      b = pk.bound
      if isinstance(b, ValsWriter) and getattr(b, "fixed_launch", not pk.symbolic_sizes): batch.append((b, pk, pos))
    kinds = {type(b): b.vals_writer for b, _, _ in batch}  # one runtime's calls only
    write = kinds.popitem()[1]([(b, pos) for b, _, pos in batch]) if len(kinds) == 1 else None
    taken = {pk.id for _, pk, _ in batch} if write is not None else set()
    self._writers[name] = (write, list({pk.id: pk for pk, _ in sites if pk.id not in taken}.values()))
    return self._writers[name]

  def execute_with_vars(self, var_vals: Mapping[str, int]) -> None:
    with self._lock:  # another thread's variables cannot slip in between
      self._set_vars(var_vals)
      self._execute()

  def execute_profiled(self, trace_path: str | os.PathLike | None = None) -> Profile:
    """Run once, op by op, timing each kernel (waiting for it). One record per kernel, in execution order."""
    with self._lock:
      self._check()
      prof = self._run_profiled(print_lines=debug.DEBUG >= 1)
    if trace_path is not None: prof.write_chrome_trace(trace_path)
    return prof

  def _run_profiled(self, print_lines: bool) -> Profile:
    if self._mapped: self._mapped.check()
    prof = Profile()
    t_start = time.perf_counter()
    # a running plan, as in _execute: otherwise the pool's workers sleep between kernels, and every split kernel's time
    # would include waking them (a one-kernel softmax profiled at twice its time in the plan)
    with self._enter_running():
      self._profile_steps(prof, t_start, print_lines)
    return prof

  def _profile_steps(self, prof: Profile, t_start: float, print_lines: bool) -> None:
    try:
      for p in self._order:
        if not isinstance(p, PreparedKernel):
          p.run()
          continue
        if p.symbolic_sizes: p.resize()  # a call set through a writer (ValsWriter.fixed_launch) was not resized
        t0 = time.perf_counter()
        t = p.kernel.program(p.buffer_ptrs, p.vals, p.global_size, p.local_size, wait=True)
        t1 = time.perf_counter()
        k = p.kernel
        rec = ProfileRecord(p.id, k.entry_point, k.device, t if t is not None else t1 - t0, k.mem_bytes, k.flops, t0 - t_start, p.level)
        prof.append(rec)
        if print_lines: debug.emit(debug.kernel_line(rec.name, rec.device, rec.time, rec.bytes, rec.flops, f"op {p.id} level {p.level}"))
    except BaseException as e:
      self._poisoned = e
      raise

  # ---- reading ----
  @property
  def poisoned(self) -> bool: return self._poisoned is not None

  def output_buffer(self, i: int) -> Buffer:
    if not 0 <= i < len(self.outputs): raise PlanError(f"output {i} is out of range (the plan has {len(self.outputs)} outputs)")
    return self.buffers[self.outputs[i]]

  @property
  def var_bounds(self) -> dict[str, tuple[int, int]]: return dict(self._var_bounds)

  def describe(self) -> str:
    """The plan as text: buffers, then ops by level."""
    lines = [f"ExecutionPlan: {len(self.buffers)} buffers ({self.memory_bytes / 1e6:.3f} MB; {self.memory_bytes_without_reuse / 1e6:.3f} MB "
             f"without reuse), {len(self.kernels)} kernels, {len(self.op_levels)} levels"]
    outs = set(self.outputs)
    for i, b in enumerate(self.buffers):
      lines.append(f"  buf {i:3d} {b.device:<6} {b.dtype.name:>8}[{b.size}] storage {b.storage_id}+{b.offset}{'  output' if i in outs else ''}")
    by_id = {p.id: p for p in self.prepared_ops}
    for li, g in enumerate(self.op_levels):
      for i in g:
        p = by_id[i]
        if isinstance(p, PreparedKernel):
          lines.append(f"  L{li} op {i:3d} {p.name:<28} bufs {p.buffer_indices} outs {[p.buffer_indices[j] for j in p.output_indices]} "
                       f"gs {p.global_size} {'(' + p.origin + ')'}{' vars ' + str(p.kernel.var_names) if p.kernel.var_names else ''}")
        else: lines.append(f"  L{li} op {i:3d} {p.name}")
    return "\n".join(lines)
