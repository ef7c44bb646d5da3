"""A served model refuses an out-of-vocab token id (issue 41 item 3): the Gather's check travels in the spec, the worker's
PortablePlan raises PlanCheckError, and the worker hands it back in that request's place as the PlanCheckError itself
(kiln.distributed never lets a RayTaskError out)."""
from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from kiln.distributed import pipeline, serve  # noqa: E402
from kiln.executor.checks import PlanCheckError  # noqa: E402
from kiln.graph.tensor import Tensor, compile  # noqa: E402

VOCAB, HID = 50, 16


@pytest.fixture(scope="module")
def lm():
  """ids (batch, 4) -> embedding -> linear -> relu -> linear; its spec, weights and a good request's outputs."""
  rng = np.random.default_rng(41)
  def w(*s: int) -> Tensor: return Tensor((rng.standard_normal(s) * 0.3).astype(np.float32))
  ids = Tensor.input("ids", ("batch", 4), np.int64, dims={"batch": (1, 4)})
  h = w(VOCAB, HID).gather(ids, 0, name="tok_emb")
  c = compile([h.linear(w(HID, HID)).relu().linear(w(HID, HID))])
  spec, weights = c.export(["y"])
  good = {"ids": rng.integers(-VOCAB, VOCAB, (2, 4))}
  return spec, weights, good, c.run(good)[0]


def _bad() -> dict[str, np.ndarray]:
  ids = np.zeros((2, 4), np.int64)
  ids[1, 3] = VOCAB  # one past the vocabulary
  return {"ids": ids}


def test_replica_refuses_an_out_of_vocab_id(cluster, lm) -> None:
  spec, weights, good, want = lm
  with serve(spec, replicas=1, weights=weights, placement={"resources": {"host0": 1}}) as r:
    with pytest.raises(PlanCheckError, match=rf"tok_emb .*index {VOCAB} is out of range \[-{VOCAB}, {VOCAB}\)"): r.run(_bad())
    np.testing.assert_array_equal(r.run(good)["y"], want)  # the replica still serves


def test_pipeline_refuses_an_out_of_vocab_id(cluster, lm) -> None:
  spec, weights, good, want = lm
  hosts = [{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]
  with pipeline(spec, stages=2, weights=weights, placement=hosts) as p:
    assert sum(len(s.checks) for s in p.stages) == 1
    with pytest.raises(PlanCheckError, match=rf"index {VOCAB} is out of range"): p.run(_bad())
    np.testing.assert_array_equal(p.run(good)["y"], want)
