"""Cutting a PlanSpec into pipeline stages (kiln issue 18): every cut gives the whole plan's outputs bit for bit."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.executor import Buffer, ExecutionPlanBuilder, PortablePlan
from kiln.executor.plan_split import ACTIVATION, balanced_cuts, run_in_order, split
from kiln.executor.planspec import export
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import PlanSpecError

RNG = np.random.default_rng(181)
F32 = dtypes.float32


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))


def _ew(fn, n: int, ins: int, name: str):
  return kernels.elementwise(fn, F32, *[((n,), F32)] * ins, name=name)


def _residual_plan():
  """h = x @ w1; r = relu(h); y = r @ w2; z = y + t where t is a view of x's first 64*16 floats; s = z * 2 (a copy of s
  goes to the output too). x is used by the first op and again by the fourth: an activation that skips a stage."""
  w1, w2 = RNG.standard_normal((32, 48)).astype(np.float32), RNG.standard_normal((48, 16)).astype(np.float32)
  b = ExecutionPlanBuilder("CPU")
  x = b.add_buffer(Buffer("CPU", 64 * 32, F32))
  bw1, bw2 = b.add_buffer(Buffer.from_numpy(w1)), b.add_buffer(Buffer.from_numpy(w2))
  h, r, y, z, s, out2 = (b.add_buffer(Buffer("CPU", n, F32)) for n in (64 * 48, 64 * 48, 64 * 16, 64 * 16, 64 * 16, 64 * 16))
  t = b.add_buffer(Buffer("CPU", 64 * 16, F32))
  b.add_view(t, x, 0, 64 * 16 * 4)
  b.add_kernel(kernels.matmul(64, 48, 32), [h, x, bw1])
  b.add_kernel(_ew(lambda v: v.maximum(0.0), 64 * 48, 1, "relu"), [r, h])
  b.add_kernel(kernels.matmul(64, 16, 48), [y, r, bw2])
  b.add_kernel(_ew(lambda p, q: p + q, 64 * 16, 2, "add"), [z, y, t])
  b.add_kernel(_ew(lambda v: v * 2.0, 64 * 16, 1, "twice"), [s, z])
  b.add_copy(out2, s)
  b.set_outputs([z, out2])
  plan = b.build()
  return export(plan, {"x": x}, {"z": z, "s2": out2}, {"x": [64, 32], "z": [64, 16], "s2": [64, 16]})


def test_every_cut_is_bit_identical() -> None:
  spec, arrays = _residual_plan()
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  want = PortablePlan(spec, arrays).run({"x": x})
  n = len(spec.ops)
  tried = 0
  for k in (1, 2, 3):
    for cuts in itertools.combinations(range(1, n), k):
      if 1 in cuts:  # op 0 is the view: a stage of views alone does no work
        with pytest.raises(PlanSpecError, match="no work"): split(spec, list(cuts))
        continue
      stages = split(spec, list(cuts))
      assert len(stages) == k + 1
      got = run_in_order(spec, [PortablePlan(s, arrays) for s in stages], {"x": x})
      assert sorted(got) == ["s2", "z"]
      for name in want: np.testing.assert_array_equal(got[name], want[name], err_msg=f"cuts {cuts}")
      tried += 1
  assert tried >= 15


def test_stages_take_only_what_they_use() -> None:
  spec, arrays = _residual_plan()
  first, second = split(spec, [2])  # [view, matmul] | [relu, matmul, add, twice, copy]
  w_first = {e.weight.key for e in first.storages if e.weight is not None}
  w_second = {e.weight.key for e in second.storages if e.weight is not None}
  assert len(w_first) == 1 and len(w_second) == 1 and w_first != w_second  # each stage maps only its own weight
  assert [i.name for i in first.inputs] == ["x"] and not first.outputs[0].name.startswith("z")
  assert {i.name for i in second.inputs} >= {"x"}  # the add reads x (through the view) again
  assert all(o.name.startswith(ACTIVATION) for o in first.outputs)
  assert sorted(o.name for o in second.outputs) == ["s2", "z"]


def test_balanced_cuts_and_bad_cuts() -> None:
  spec, _ = _residual_plan()
  cuts = balanced_cuts(spec, 2)
  assert len(cuts) == 1 and 0 < cuts[0] < len(spec.ops)
  assert len(balanced_cuts(spec, 6)) == 5 and 1 not in balanced_cuts(spec, 6)
  with pytest.raises(PlanSpecError, match="cannot cut"): balanced_cuts(spec, 7)
  with pytest.raises(PlanSpecError, match="increasing"): split(spec, [3, 2])
  with pytest.raises(PlanSpecError, match="increasing"): split(spec, [0])
  with pytest.raises(PlanSpecError, match="positive"): balanced_cuts(spec, 0)
