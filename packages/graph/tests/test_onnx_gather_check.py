"""ONNX Gather's indices against onnxruntime's (issue 41 item 3): onnxruntime refuses an index outside [-n, n) ("indices
element out of data bounds"); kiln raises IndexOutOfRangeError naming the node and the index, at run time for fed or
computed indices and at load time for constant ones, and wraps negative indices as onnxruntime does."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_case import N, check, f32, model, ort

from kiln.graph import onnx as konnx
from kiln.graph.lazy import IndexOutOfRangeError, ONNXError

TABLE = f32(10, 4)


def _lookup(ids: np.ndarray, add: bool = False):  # noqa: ANN202
  nodes = [N("Add", ["ids", "one"], ["i"]), N("Gather", ["t", "i"], ["y"], name="tok_emb")] if add else \
          [N("Gather", ["t", "ids"], ["y"], name="tok_emb")]
  inits = {"t": TABLE, **({"one": np.array(1, np.int64)} if add else {})}
  return model(nodes, {"ids": ids}, {"y": np.float32}, inits)


def _ort_refuses(m, feeds: dict) -> None:  # noqa: ANN001
  with pytest.raises(Exception, match="out of data bounds"):
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("ids,bad", [([1, 5, 1000], 1000), ([1, -11, 2], -11)])
def test_fed_index_out_of_range(ids: list[int], bad: int) -> None:
  feeds = {"ids": np.array(ids, np.int64)}
  m = _lookup(feeds["ids"])
  _ort_refuses(m, feeds)
  km = konnx.load(m)
  with pytest.raises(IndexOutOfRangeError, match=rf"node tok_emb \(Gather\) \(axis 0 of \(10, 4\)\): index {bad} is out of range \[-10, 10\)"):
    km.run(feeds)
  check(m, {"ids": np.array([-10, 9, 0], np.int64)})  # the edges and a negative index, as onnxruntime gives them, on the same model
  assert km.export()[0].checks  # an exported plan carries the check


def test_computed_index_out_of_range() -> None:
  feeds = {"ids": np.array([3, 9], np.int64)}  # 9 + 1 = 10
  m = _lookup(feeds["ids"], add=True)
  _ort_refuses(m, feeds)
  with pytest.raises(IndexOutOfRangeError, match="node tok_emb .*index 10 is out of range"): konnx.load(m).run(feeds)
  check(m, {"ids": np.array([-11, 8], np.int64)})


def test_constant_index_out_of_range_is_refused_at_load() -> None:
  x = f32(2, 3)
  m = model([N("Gather", ["x", "i"], ["y"], axis=1, name="pick")], {"x": x}, {"y": np.float32}, {"i": np.array([0, 3], np.int64)})
  with pytest.raises(ONNXError, match=r"node pick \(Gather.*index 3 is out of range \[-3, 3\)"): konnx.load(m)
  folded = model([N("Gather", ["t", "i"], ["y"], name="fold")], {"x": x}, {"y": np.float32},
                 {"t": np.arange(4, dtype=np.float32), "i": np.array([-5], np.int64)})  # both constant: folded at load
  with pytest.raises(ONNXError, match=r"node fold \(Gather.*index -5 is out of range \[-4, 4\)"): konnx.load(folded)
