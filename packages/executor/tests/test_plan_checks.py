"""Checks (kiln.executor.checks, issue 41 item 3): plan buffers that must read zero after each run travel in a PlanSpec
with their message; a rebuilt plan raises PlanCheckError naming the value, and stays usable."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.executor import Buffer, ExecutionPlanBuilder, PlanSpec, PortablePlan
from kiln.executor.checks import MAX_MESSAGE, PlanCheckError, message
from kiln.executor.plan_split import run_in_order, split
from kiln.executor.planspec import export
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import PlanSpecError

I32 = dtypes.int32
N = 8


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))


def _plan(check_is_output: bool = True):
  """y = x * 2, then z = y + 1; the check holds each x above 3 (0 elsewhere): nonzero when any x is above 3."""
  b = ExecutionPlanBuilder("CPU")
  x, y, z, c = (b.add_buffer(Buffer("CPU", N, I32)) for _ in range(4))
  b.add_kernel(kernels.elementwise(lambda v: (v > 3).where(v, 0), I32, ((N,), I32), name="above3"), [c, x])
  b.add_kernel(kernels.elementwise(lambda v: v * 2, I32, ((N,), I32), name="twice"), [y, x])
  b.add_kernel(kernels.elementwise(lambda v: v + 1, I32, ((N,), I32), name="inc"), [z, y])
  b.set_outputs([z, c] if check_is_output else [z])
  return b.build(), x, z, c


def _spec(msg: str = "x {value} is above 3") -> PlanSpec:
  plan, x, z, c = _plan()
  return export(plan, {"x": x}, {"z": z}, checks=[(c, msg)])[0]


def test_a_rebuilt_plan_raises_the_check_and_stays_usable() -> None:
  spec = _spec()
  assert [o.name for o in spec.outputs] == ["z"] and spec.checks[0].message == "x {value} is above 3"
  p = PortablePlan(PlanSpec.from_json(spec.to_json()))
  assert p.output_names == ["z"]
  with pytest.raises(PlanCheckError, match="^x 7 is above 3$") as e: p.run({"x": np.array([0, 1, 7, 2, 9, 0, 0, 0], np.int32)})
  assert e.value.value == 7
  got = p.run({"x": np.arange(N, dtype=np.int32) % 4})  # the check is computed afresh each run: nothing to reset
  assert list(got) == ["z"]
  np.testing.assert_array_equal(got["z"], (np.arange(N) % 4) * 2 + 1)
  with pytest.raises(PlanCheckError): p.run_profiled({"x": np.full(N, 5, np.int32)})


def test_only_the_last_placeholder_takes_the_value() -> None:
  assert message("node {value} (Gather): index {value} is out", -3) == "node {value} (Gather): index -3 is out"
  assert message("no placeholder", 5) == "no placeholder (value 5)"
  p = PortablePlan(_spec("a {value}-named node: {value}"))
  with pytest.raises(PlanCheckError, match=r"^a \{value\}-named node: 4$"): p.run({"x": np.full(N, 4, np.int32)})


def test_the_json_format_of_a_spec_without_checks_is_unchanged() -> None:
  plan, x, z, _ = _plan(check_is_output=False)
  spec = export(plan, {"x": x}, {"z": z})[0]
  doc = json.loads(spec.to_json())
  assert "checks" not in doc  # what kiln wrote before checks existed: an older reader still loads it
  assert PlanSpec.from_json(json.dumps(doc)) == spec
  with_check = json.loads(_spec().to_json())
  assert with_check["checks"] == [{"buffer": with_check["checks"][0]["buffer"], "message": "x {value} is above 3"}]


def test_bad_checks_are_refused() -> None:
  plan, x, z, c = _plan(check_is_output=False)
  with pytest.raises(PlanSpecError, match="not outputs of the plan"): export(plan, {"x": x}, {"z": z}, checks=[(c, "m {value}")])
  plan, x, z, c = _plan()
  with pytest.raises(PlanSpecError, match="outside the plan"): export(plan, {"x": x}, {"z": z}, checks=[(99, "m {value}")])
  doc = json.loads(_spec().to_json())
  doc["checks"][0]["buffer"] = 99
  with pytest.raises(PlanSpecError, match="checks name buffers"): PlanSpec.from_json(json.dumps(doc))
  doc = json.loads(_spec().to_json())
  doc["checks"][0]["message"] = "m" * (MAX_MESSAGE + 1)
  with pytest.raises(PlanSpecError, match="message"): PlanSpec.from_json(json.dumps(doc))


def test_a_check_goes_with_the_stage_that_writes_it() -> None:
  spec = _spec()
  # a stage of the check alone hands nothing on: a pipeline would never wait for it, so its failure would go unseen
  with pytest.raises(PlanSpecError, match="writes nothing that is used later"): split(spec, [1])
  stages = split(spec, [2])
  assert [len(s.checks) for s in stages] == [1, 0]  # the check's kernel is op 0
  plans = [PortablePlan(s) for s in stages]
  with pytest.raises(PlanCheckError, match="x 6 is above 3"): run_in_order(spec, plans, {"x": np.full(N, 6, np.int32)})
  np.testing.assert_array_equal(run_in_order(spec, plans, {"x": np.ones(N, np.int32)})["z"], np.full(N, 3))
