"""Inputs made from a model's declared shapes and dtypes, for `kiln run --random` and `kiln bench`: what onnxruntime's
perf tool and OpenVINO's benchmark_app do, with values every model accepts.

- a symbolic dim takes its --dims value, else DEFAULT_DIM (1; printed as used, so a result is never read as another size);
- floating point: standard normal values;
- bool: random;
- an integer input used as a Gather's indices into a table the model holds (token ids into an embedding): ids in
  [0, the smallest such table's size), so no index is out of range;
- an integer input whose name holds "mask" (an attention mask): all ones;
- any other integer input: values in [0, 2) (uint8, image data: [0, 256)), as small as a shape, a position or a segment id
  (token_type_ids) can safely be: a model that indexes with a computed value may still refuse it, naming the node.

The values come from a seeded generator: the same model and dims give the same feeds in kiln and in each peer.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kiln.graph.errors import GraphError
from kiln.graph.model_info import Declared

DEFAULT_DIM = 1
SEED = 0


class FeedError(GraphError):
  """A declared input random feeds cannot be made for (no declared shape, an element type numpy lacks)."""


def sizes(declared: Sequence[Declared], dims: Mapping[str, int]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
  """Each input's shape with its symbolic dims resolved, and the symbolic dims DEFAULT_DIM filled (named, for the caller to say)."""
  shapes: dict[str, tuple[int, ...]] = {}
  defaulted: dict[str, int] = {}
  for d in declared:
    if d.dims is None: raise FeedError(f"input {d.name!r} declares no shape: give it with --input {d.name}=FILE.npy")
    shape = []
    for x in d.dims:
      if isinstance(x, int): shape.append(x)
      elif x in dims: shape.append(dims[x])
      else:
        defaulted[x] = DEFAULT_DIM
        shape.append(DEFAULT_DIM)
    shapes[d.name] = tuple(shape)
  return shapes, defaulted


def make(declared: Sequence[Declared], shapes: Mapping[str, tuple[int, ...]], tables: Mapping[str, int],
         skip: Sequence[str] = ()) -> dict[str, np.ndarray]:
  """A feed for every declared input not in skip (those the user gave), by the rules of the module's docstring."""
  rng = np.random.default_rng(SEED)
  out: dict[str, np.ndarray] = {}
  for d in declared:
    if d.name in skip: continue
    if d.dtype is None: raise FeedError(f"input {d.name!r} has element type {d.elem_type}, which kiln cannot make values for")
    out[d.name] = _values(rng, d, shapes[d.name], tables.get(d.name))
  return out


def _values(rng: np.random.Generator, d: Declared, shape: tuple[int, ...], table: int | None) -> np.ndarray:
  dt = d.dtype
  assert dt is not None
  if dt.kind == "f" or dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
    return rng.standard_normal(shape, dtype=np.float32).astype(dt)
  if dt.kind == "b": return rng.integers(0, 2, shape).astype(bool)
  if dt.kind in "iu":
    if table is not None: return rng.integers(0, max(table, 1), shape).astype(dt)
    if "mask" in d.name.lower(): return np.ones(shape, dt)
    return rng.integers(0, 256 if dt == np.uint8 else 2, shape).astype(dt)
  if dt.kind == "c": return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
  raise FeedError(f"input {d.name!r} has element type {d.elem_type}, which kiln cannot make values for")


def describe(declared: Sequence[Declared], feeds: Mapping[str, np.ndarray], tables: Mapping[str, int]) -> list[str]:
  """One line per made feed: its shape, dtype and what its values are."""
  lines = []
  for d in declared:
    if d.name not in feeds: continue
    a = feeds[d.name]
    if d.name in tables: what = f"ids in [0, {tables[d.name]})"
    elif a.dtype.kind in "iu" and "mask" in d.name.lower(): what = "all ones"
    elif a.dtype.kind in "iu": what = f"ints in [0, {256 if a.dtype == np.uint8 else 2})"
    elif a.dtype.kind == "b": what = "random bools"
    else: what = "standard normal"
    lines.append(f"{d.name} {a.shape} {a.dtype}: {what}")
  return lines

