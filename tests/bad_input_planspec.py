"""Bad-input catalogue entries for portable plans (kiln issue 18): a PlanSpec is a document a user may hand kiln from a
file, so every malformed one is a PlanSpecError naming what is wrong, before any of it is used."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from kiln.executor import Buffer, ExecutionPlanBuilder, PlanSpec, PortablePlan
from kiln.executor.plan_split import split
from kiln.executor.planspec import export
from kiln.ir import dtypes, kernels
from kiln.ir.errors import PlanSpecError

F32 = dtypes.float32


def _plan() -> tuple[Any, int, int]:
  """y = x @ w (w a zero-copy weight) then y2 = y * 2: two kernels."""
  b = ExecutionPlanBuilder("CPU")
  x, w = b.add_buffer(Buffer("CPU", 4 * 8, F32)), b.add_buffer(Buffer.from_numpy(np.arange(8 * 4, dtype=np.float32).reshape(8, 4)))
  y, y2 = b.add_buffer(Buffer("CPU", 16, F32)), b.add_buffer(Buffer("CPU", 16, F32))
  b.add_kernel(kernels.matmul(4, 4, 8), [y, x, w])
  b.add_kernel(kernels.elementwise(lambda v: v * 2.0, F32, ((16,), F32), name="twice"), [y2, y])
  b.set_outputs([y2])
  return b.build(), x, y2


def _spec() -> tuple[PlanSpec, dict[str, np.ndarray]]:
  plan, x, y = _plan()
  return export(plan, {"x": x}, {"y": y})


def _doc(edit: Any) -> Any:
  spec, _ = _spec()
  doc = json.loads(spec.to_json())
  edit(doc)
  return PlanSpec.from_json(json.dumps(doc))


def _tampered_weight() -> Any:
  spec, arrays = _spec()
  return PortablePlan(spec, {k: v + 1 for k, v in arrays.items()})


def _missing_file(tmp_path) -> Any:
  def edit(d: dict) -> None:
    w = next(s for s in d["storages"] if s["weight"])
    w["weight"] = {"kind": "file", "nbytes": w["nbytes"], "path": str(tmp_path / "gone.bin"), "offset": 0, "sha256": "0" * 64}
  spec, _ = _spec()
  return PortablePlan(_doc(edit))


def _undigested_file(tmp_path) -> Any:
  path = tmp_path / "secret.bin"
  path.write_bytes(bytes(128))
  def edit(d: dict) -> None:
    w = next(s for s in d["storages"] if s["weight"])
    w["weight"] = {"kind": "file", "nbytes": w["nbytes"], "path": str(path), "offset": 0}
  return PortablePlan(_doc(edit))


def _custom() -> Any:
  b = ExecutionPlanBuilder("CPU")
  a = b.add_buffer(Buffer("CPU", 4, F32))
  b.add_custom(lambda buf: None, [a])
  b.set_outputs([a])
  return export(b.build())[0]


def _set(path: list[Any], value: Any) -> Any:
  def edit(d: Any) -> None:
    for p in path[:-1]: d = d[p]
    d[path[-1]] = value
  return edit


CASES = [
  ("planspec-not-json", PlanSpecError, r"PlanSpec JSON: invalid JSON", lambda: PlanSpec.from_json(b"{\"format\": 1,")),
  ("planspec-other-format", PlanSpecError, r"invalid PlanSpec[\s\S]*format", lambda: _doc(_set(["format"], 2))),
  ("planspec-op-buffer-out-of-range", PlanSpecError, r"op 0 names buffers \[99\]; the spec has 4", lambda: _doc(_set(["ops", 0, "buffers", 0], 99))),
  ("planspec-buffer-past-storage", PlanSpecError, r"buffer 2 .* runs past the end of storage", lambda: _doc(_set(["buffers", 2, "size"], 1 << 30))),
  ("planspec-ops-out-of-order", PlanSpecError, r"op 1 has id 0: ops must be numbered in order", lambda: _doc(_set(["ops", 1, "id"], 0))),
  ("planspec-unknown-dim", PlanSpecError, r"'x' has dims \['seq'\] that are not variables", lambda: _doc(_set(["inputs", 0, "shape"], ["seq", 8]))),
  ("planspec-bad-digest", PlanSpecError, r"invalid PlanSpec[\s\S]*storages.1.weight.sha256",
   lambda: _doc(_set(["storages", 1, "weight", "sha256"], "00"))),
  ("planspec-kernel-not-a-spec", PlanSpecError, r"kernel op 0: its compiled kernel does not validate",
   lambda: PortablePlan(_doc(_set(["ops", 0, "compiled"], "{\"name\": \"\"}")), _spec()[1])),
  ("planspec-weight-not-handed-in", PlanSpecError, r"weight 's1-[0-9a-f]+' \(128 bytes\) was not handed in", lambda: PortablePlan(_spec()[0])),
  ("planspec-weight-changed", PlanSpecError, r"weight 's1-[0-9a-f]+' does not match the spec's sha256", _tampered_weight),
  ("planspec-weight-file-missing", PlanSpecError, r"gone\.bin .* cannot be mapped", _missing_file),
  ("planspec-file-without-digest", PlanSpecError, r"secret\.bin has no sha256 in the spec; pass verify=False", _undigested_file),
  ("planspec-host-function", PlanSpecError, r"op 0 is a host function \(<lambda>\)", _custom),
  ("planspec-bad-cut", PlanSpecError, r"cuts \[5\] must be increasing op positions inside 1\.\.1", lambda: split(_spec()[0], [5])),
  ("planspec-feed-not-an-input", PlanSpecError, r"feeds \['z'\] are not inputs of the plan",
   lambda: PortablePlan(*_spec()).run({"x": np.zeros(32, np.float32), "z": np.zeros(1)})),
]
