"""compile(..., cache=KEY) (kiln.graph.compile_cache): the same graph compiled again is rebuilt from the plan cache, over
this call's constants and bound buffers, and gives the same outputs bit for bit; a graph of another structure, another
caller's key or another bound buffer layout misses; the graph's constants are not stored twice; a graph that cannot be
keyed or kept compiles as before."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kiln.executor import Buffer, cache_stats
from kiln.graph import Tensor, compile
from kiln.graph import compile_cache as cc

CTX, SEQ = 12, 2


@pytest.fixture
def cache(plan_cache_dir: Path) -> Path: return plan_cache_dir  # the repository's conftest.py


def _appending(w: np.ndarray, key: str | None, width: int = 3):  # type: ignore[no-untyped-def]
  """A plan over a cache it appends to (a KV cache's shape): reads the first `past` rows, writes x @ w + 1 at row past.
  Returns (the bound buffer's array, the compiled graph, whether the plan cache gave it)."""
  store = np.zeros((CTX + SEQ, width), np.float32)
  buf = Buffer.from_numpy(store)
  k = Tensor.input("k", ("past", width), dims={"past": (0, CTX)})
  rows = Tensor.input("k_rows", (CTX + SEQ, width))
  x = Tensor.input("x", (SEQ, 4))
  new = x @ Tensor(w) + 1.0
  out = k.sum(0, keepdims=True) * 0.5 + new.sum(0, keepdims=True)
  hits = cache_stats()["plan_hits"]
  c = compile([out, new], bind={"k": buf.view(0, CTX * width), "k_rows": buf}, writes=[rows.write_rows(new, k.shape[0])], cache=key)
  return store, c, cache_stats()["plan_hits"] > hits


def _steps(store: np.ndarray, c, n: int = 4) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
  rng = np.random.default_rng(3)
  outs = []
  for past in range(0, n * SEQ, SEQ):
    outs += c.run({"x": rng.standard_normal((SEQ, 4)).astype(np.float32)}, vars={"past": past})
  outs.append(store.copy())
  return outs


W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


def test_a_graph_compiled_again_is_rebuilt_from_the_cache_over_this_calls_buffers(cache: Path):
  store1, c1, hit1 = _appending(W, "model-a")
  assert not hit1 and len(list(cache.glob("*.json"))) == 1
  want = _steps(store1, c1)
  compiles = cache_stats()["compiles"]
  store2, c2, hit2 = _appending(W.copy(), "model-a")  # a new process's graph: equal constants in new arrays, new buffers
  assert hit2 and cache_stats()["compiles"] == compiles  # nothing scheduled or compiled
  assert c2.kernels == [] and c2.kernel_count == c1.kernel_count and c2.bound == c1.bound
  got = _steps(store2, c2)
  for a, b in zip(got, want): np.testing.assert_array_equal(a, b)
  assert store2.any() and not np.shares_memory(store1, store2)  # it wrote this call's buffer, in place
  store1.fill(0)
  _steps(store2, c2)
  assert not store1.any()  # and never the first call's


def test_constants_come_from_the_graph_not_the_entry(cache: Path):
  big = np.random.default_rng(1).standard_normal((4, 3000)).astype(np.float32)
  _appending(big, "model-b", width=3000)
  (entry,) = cache.glob("*.bin")
  assert entry.stat().st_size < big.nbytes // 10  # the weight is the graph's, referred to by its place


def test_what_misses(cache: Path, monkeypatch: pytest.MonkeyPatch):
  _appending(W, "model-a")
  assert _appending(W, "model-a")[2]
  assert not _appending(W, "model-b")[2]  # another caller key
  assert not _appending(np.zeros((4, 5), np.float32), "model-a", width=5)[2]  # another structure under the same key
  assert not _appending(W, None)[2] and len(list(cache.glob("*.json"))) == 3  # no key: neither used nor kept
  monkeypatch.setenv("KILN_PLAN_CACHE", "0")
  assert not _appending(W, "model-a")[2]


def test_structure_sees_shapes_ops_and_arguments_but_not_constant_bytes():
  def graph(w: np.ndarray, scale: float = 0.5, n: int = 4) -> list:  # type: ignore[type-arg]
    x = Tensor.input("x", (2, n))
    return [((x @ Tensor(w)) * scale).node]
  base, consts = cc.structure(graph(W))
  assert len(consts) == 1 and consts[0] is not None
  assert cc.structure(graph(W + 1))[0] == base  # bytes are the caller key's business
  assert cc.structure(graph(W, scale=0.25))[0] != base
  assert cc.structure(graph(W.astype(np.float64)))[0] != base
  assert cc.structure(graph(np.zeros((5, 3), np.float32), n=5))[0] != base
  assert cc._text((1, True, 1.0)) != cc._text((True, 1, 1.0))  # 1 == True in Python; not here


def test_an_argument_without_a_stable_text_is_compiled_and_not_kept(cache: Path, monkeypatch: pytest.MonkeyPatch):
  @dataclasses.dataclass
  class Odd:
    f: object

  with pytest.raises(cc._Unkeyable): cc._text(Odd(object()))
  monkeypatch.setattr(cc, "structure", lambda roots: (_ for _ in ()).throw(cc._Unkeyable("object")))
  store, c, hit = _appending(W, "model-a")
  assert not hit and not list(cache.glob("*.json"))
  assert _steps(store, c)[0].shape == (1, 3)


def test_a_damaged_entry_is_a_miss_that_compiles_again(cache: Path):
  want = _steps(*_appending(W, "model-a")[:2])
  (entry,) = cache.glob("*.json")
  entry.write_bytes(entry.read_bytes()[:-50])
  store, c, hit = _appending(W, "model-a")
  assert not hit
  for a, b in zip(_steps(store, c), want): np.testing.assert_array_equal(a, b)
