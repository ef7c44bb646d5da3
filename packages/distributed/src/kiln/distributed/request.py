"""A request checked on the driver, before it is sent: every input fed and no other name, ranks, sizes and variable
bounds (kiln.executor's check_feeds), and dtypes by the rule the worker's PortablePlan applies (the plan's dtype, or one
of the same kind, or integer for integer), cast here so the worker receives the plan's own dtype (and a float64 request
travels at float32's size). A request the worker would refuse is refused here, typed, and never sent."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.executor import PlanSpec
from kiln.executor.buffer import buffer_dtype
from kiln.executor.portable import check_feeds, in_plan_dtype
from kiln.ir.errors import PlanSpecError


def prepare(spec: PlanSpec, feeds: Mapping[str, Any], vars: Mapping[str, int] | None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
  """The request's arrays in the plan's dtypes and its variables' values; a PlanSpecError (or VariableBoundsError) else."""
  if not isinstance(feeds, Mapping): raise PlanSpecError(f"a request is a mapping of input name -> array, got {type(feeds).__name__}")
  arrays: dict[str, Any] = {}
  for name, v in feeds.items():
    try: arrays[name] = np.asarray(v)
    except Exception as e: raise PlanSpecError(f"input {name!r} is not an array: {type(e).__name__}: {e}") from None
  arrays, vals = check_feeds(spec, arrays, vars)
  for io in spec.inputs:
    cast = in_plan_dtype(arrays[io.name], buffer_dtype(io.dtype).np)
    if cast is None: raise PlanSpecError(f"input {io.name!r} has dtype {arrays[io.name].dtype}, the plan takes {io.dtype}")
    arrays[io.name] = cast
  return arrays, vals
