"""A plan rebuilt from a PlanSpec, run by name: `PortablePlan(spec, weights).run({input: array}) -> {output: array}`.

Inputs are copied into their buffers (a symbolic dim below its bound fills the buffer's front), each runtime variable
is read off the inputs' shapes (or given), and outputs come back at their actual shape as fresh arrays. The spec's checks
are read after each run: a nonzero one is a PlanCheckError (kiln.executor.checks), and no outputs come back."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.executor.buffer import buffer_dtype
from kiln.executor.checks import CheckReader
from kiln.executor.planspec import CodePolicy, IOEntry, PlanSpec, builder_from_spec, dim_value
from kiln.executor.profile import Profile
from kiln.ir.errors import PlanSpecError, VariableBoundsError


def _fmt(shape: list[Any]) -> str: return "(" + ", ".join(str(d) for d in shape) + ")"


def infer_vars(spec: PlanSpec, feeds: Mapping[str, np.ndarray], given: Mapping[str, int] | None = None) -> dict[str, int]:
  """Each runtime variable's value, read off the fed arrays' shapes (every input naming it must agree, within its bounds)
  or `given`; a product dim ("2*seq") is checked once its variables are known."""
  vals: dict[str, int] = {}
  where: dict[str, str] = {}
  for io in spec.inputs:
    a = feeds[io.name]
    if a.ndim != len(io.shape):
      raise PlanSpecError(f"input {io.name!r} has shape {a.shape}, the plan takes rank {len(io.shape)} {_fmt(io.shape)}")
    for k, (got, d) in enumerate(zip(a.shape, io.shape)):
      if isinstance(d, int) or d not in spec.variables:  # a size, or a product checked once the variables are known
        if isinstance(d, int) and got != d: raise PlanSpecError(f"input {io.name!r} has shape {a.shape}, the plan takes {_fmt(io.shape)} (dim {k})")
        continue
      lo, hi = spec.variables[d]
      if not lo <= got <= hi: raise VariableBoundsError(f"input {io.name!r} dim {k} ({d}) is {got}, outside the bounds [{lo}, {hi}]")
      if d in vals and vals[d] != got: raise PlanSpecError(f"input {io.name!r} dim {k} ({d}) is {got}, but {where[d]} gave {d} = {vals[d]}")
      vals[d], where[d] = int(got), f"input {io.name!r} dim {k}"
  for n, v in (given or {}).items():
    if n in vals and vals[n] != v: raise PlanSpecError(f"variable {n} = {v} was given, but {where[n]} gives {vals[n]}")
    vals[n] = int(v)
  for io in spec.inputs:
    for k, (got, d) in enumerate(zip(feeds[io.name].shape, io.shape)):
      if isinstance(d, str) and d not in spec.variables and all(n in vals for n in d.split("*") if not n.isdigit()):
        if got != dim_value(d, vals): raise PlanSpecError(f"input {io.name!r} dim {k} is {got}, but {d} = {dim_value(d, vals)}")
  return vals


def in_plan_dtype(a: np.ndarray, want: np.dtype, bfloat16: bool = False) -> np.ndarray | None:
  """A fed array in the plan's dtype `want`: as it is, or cast when it is of the same kind (float for float) or an integer
  for an integer; None when the plan cannot take it (the caller raises its own typed error). The one rule every feed of a
  plan follows: a PortablePlan's, a served request's on the driver, kiln.graph's. `bfloat16`: the plan's input is
  bfloat16, held as its uint16 bits (`want`): an array of numpy's bfloat16 extension type (ml_dtypes) is taken as its bits."""
  if bfloat16 and a.dtype.name == "bfloat16" and a.dtype.itemsize == 2: return a.view(np.uint16)
  if a.dtype == want: return a
  if a.dtype.kind != want.kind and not (a.dtype.kind in "iu" and want.kind in "iu"): return None
  return a.astype(want)


def check_feeds(spec: PlanSpec, feeds: Mapping[str, Any], given: Mapping[str, int] | None = None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
  """A request's arrays and variable values, checked against the spec's inputs (every input fed, no other name, ranks,
  sizes, bounds): a PlanSpecError (or VariableBoundsError) before anything runs."""
  arrays: dict[str, np.ndarray] = {}
  for io in spec.inputs:
    if io.name not in feeds: raise PlanSpecError(f"input {io.name!r} (shape {_fmt(io.shape)}, {io.dtype}) was not fed")
    arrays[io.name] = np.asarray(feeds[io.name])
  if unknown := sorted(set(feeds) - set(arrays)):
    raise PlanSpecError(f"feeds {unknown} are not inputs of the plan (it takes {[io.name for io in spec.inputs]})")
  return arrays, infer_vars(spec, arrays, given)


class PortablePlan:
  """A PlanSpec rebuilt in this process. `run` is serialised per plan, as ExecutionPlan.execute is."""

  def __init__(self, spec: PlanSpec, weights: Mapping[str, Any] | None = None, code: CodePolicy = "sealed", verify: bool = True):
    self.spec = spec
    self.plan = builder_from_spec(spec, weights, code, verify).build()
    self.input_names = [i.name for i in spec.inputs]
    self.output_names = [o.name for o in spec.outputs]
    self._checks = CheckReader(self.plan.buffers, [(c.buffer, c.message) for c in spec.checks])

  def _feed(self, feeds: Mapping[str, Any], given: Mapping[str, int] | None) -> dict[str, int]:
    arrays, vals = check_feeds(self.spec, feeds, given)
    for io in self.spec.inputs:
      a = in_plan_dtype(arrays[io.name], buffer_dtype(io.dtype).np)
      if a is None: raise PlanSpecError(f"input {io.name!r} has dtype {arrays[io.name].dtype}, the plan takes {io.dtype}")
      buf = self.plan.buffers[io.buffer]
      if a.size != buf.size: buf = buf.view(0, a.size)
      buf.copyin(np.ascontiguousarray(a))
    if missing := sorted(set(self.plan.var_bounds) - set(vals)):
      raise VariableBoundsError(f"variables {missing} are not dims of any input: pass them as vars=")
    return vals

  def _read(self, io: IOEntry, vals: Mapping[str, int]) -> np.ndarray:
    shape = tuple(dim_value(d, vals) for d in io.shape)
    n = int(np.prod(shape, dtype=np.int64))
    buf = self.plan.buffers[io.buffer]
    return (buf if n == buf.size else buf.view(0, n)).numpy().reshape(shape).copy()

  def run(self, feeds: Mapping[str, Any] | None = None, vars: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    with self.plan._lock:  # feeding, running and reading back are one run
      vals = self._feed(feeds or {}, vars)
      if vals: self.plan.execute_with_vars(vals)
      else: self.plan.execute()
      self._checks.raise_failed()
      return {o.name: self._read(o, vals) for o in self.spec.outputs}

  def run_profiled(self, feeds: Mapping[str, Any] | None = None, vars: Mapping[str, int] | None = None) -> tuple[dict[str, np.ndarray], Profile]:
    with self.plan._lock:
      vals = self._feed(feeds or {}, vars)
      if vals: self.plan.set_vars(vals)
      prof = self.plan.execute_profiled()
      self._checks.raise_failed()
      return {o.name: self._read(o, vals) for o in self.spec.outputs}, prof
