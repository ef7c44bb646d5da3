"""ONNX Gather (and embedding lookups) with indices at and past the ends of the gathered axis, against onnxruntime.

A case is a table (rank 1-3, fed or an initializer), an axis, and int32 or int64 indices (rank 0-2) drawn from the edges
of [-n, n) (-n-1, -n, -1, 0, n-1, n), far outside it (the dtype's ends, 2**31, 2**32 + 1, n + 2**32: a 32-bit index
cast would wrap them into range) and inside it. The indices are a constant (an initializer or a Constant node), fed, or
computed from a fed input (Add/Sub/Mul by a constant, Neg, a Cast from the other index dtype, a Concat with constants,
a Gather from a constant remap table: two checked gathers in one plan, either of which may be the one out of range).
An exact op may follow the Gather (Neg, Add, ReduceMax), so the gather is fused into a consumer; fed indices may have a
symbolic batch dim (one plan for every batch size within its bounds).

The oracle is onnxruntime. Where it refuses an index, kiln must refuse too, typed and naming the node and a bad index:
an ONNXError at load for constant indices, an IndexOutOfRangeError at run time otherwise (and the same plan must then
run good indices: the `good` feed). Where it returns, kiln must return the same values exactly."""
from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

oracle = importlib.import_module(f"{__package__}.onnx_oracle" if __package__ else "onnx_oracle")  # in tests.fuzz, or beside the script

IDX: dict[str, Any] = {"int32": np.int32, "int64": np.int64}
COMPUTE = ["Add", "Sub", "Mul", "Neg", "Cast", "Concat", "Gather"]
SYM = (1, 8)  # the bounds of a symbolic batch dim of the fed indices


def _edges(n: int, dt: str) -> list[int]:
  info = np.iinfo(IDX[dt])
  far = [info.min, info.max, info.min + 1, 2**31 - 1, -2**31, 2**31, 2**32 + 1, n + 2**32, -2**32 - 1, 2 * n]
  return [v for v in (-n - 1, -n, -1, 0, n - 1, n, n + 1, *far) if info.min <= v <= info.max]


@st.composite
def cases(draw: Callable) -> dict[str, Any]:
  rank = draw(st.integers(1, 3))
  table = [draw(st.integers(1, 6)) for _ in range(rank)]
  axis = draw(st.integers(-rank, rank - 1))
  n = table[axis]
  dt = draw(st.sampled_from(sorted(IDX)))
  ishape = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2)))]
  bad = draw(st.integers(0, 2)) == 0  # a third of the cases aim past the ends; the rest mostly hit the edges in range
  one = st.sampled_from(_edges(n, dt)) if bad else st.one_of(st.integers(-n, n - 1), st.sampled_from([-n, -1, 0, n - 1]))
  values = [draw(one) for _ in range(math.prod(ishape))]
  src = draw(st.sampled_from(["init", "constant", "input", "computed"]))
  comp: list[Any] = []
  if src == "computed":
    op = draw(st.sampled_from(COMPUTE))
    info = np.iinfo(IDX[dt])
    k = min(max(draw(st.sampled_from([0, 1, -1, n, -n, 2, 3, 2**31, 2**32])), int(info.min)), int(info.max))
    comp = [op, k if op not in ("Concat", "Gather") else [draw(st.sampled_from(_edges(n, dt))) for _ in range(draw(st.integers(1, 4)))]]
    if op == "Concat" and not ishape: ishape, values = [1], values or [0]
  post = draw(st.sampled_from(["none", "Neg", "Add", "ReduceMax"]))
  sym = src in ("input", "computed") and bool(ishape) and comp[:1] != ["Concat"] and draw(st.booleans())  # a batch dim bound at run time
  return {"table": table, "axis": axis, "table_src": draw(st.sampled_from(["input", "init"])), "dtype": dt, "ishape": ishape,
          "values": values, "src": src, "compute": comp, "post": post, "sym": sym, "seed": draw(st.integers(0, 2**31 - 1))}


def _fits(v: np.ndarray, dt: Any) -> bool:
  info = np.iinfo(dt)
  return bool(((v >= info.min) & (v <= info.max)).all())


def computed(c: dict[str, Any], fed: np.ndarray) -> np.ndarray | None:
  """The indices the Gather sees for fed values `fed` (numpy, exact; None when the arithmetic would leave the dtype: ONNX
  leaves overflow undefined, so such a case is not drawn)."""
  dt = IDX[c["dtype"]]
  if c["src"] != "computed": return fed.astype(dt)
  op, k = c["compute"]
  if op == "Cast": return fed.astype(dt)  # narrowing int64 -> int32 wraps, as ONNX's Cast does
  f = [int(v) for v in fed.reshape(-1)]  # Python ints: no wrap before the range check
  if op == "Gather" and any(not -len(k) <= v < len(k) for v in f): return None  # the remap's own index is out of range
  if op in ("Concat", "Gather"): r = f + list(k) if op == "Concat" else [k[v] for v in f]
  else: r = [{"Add": v + k, "Sub": v - k, "Mul": v * k, "Neg": -v}[op] for v in f]
  info = np.iinfo(dt)
  if not all(info.min <= v <= info.max for v in r): return None
  return np.asarray(r, dt).reshape(fed.shape if op != "Concat" else (-1,))


def _other(dt: str) -> Any: return np.int64 if dt == "int32" else np.int32


def fed_values(c: dict[str, Any]) -> np.ndarray:
  """The fed input of a computed case holds `values` in the dtype its op reads (a Cast reads the other index dtype)."""
  dt = _other(c["dtype"]) if c["compute"] and c["compute"][0] == "Cast" else IDX[c["dtype"]]
  info = np.iinfo(dt)
  return np.asarray([min(max(v, info.min), info.max) for v in c["values"]], dt).reshape(c["ishape"])


def build(c: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray], np.ndarray | None, str]:
  """(model, feeds, the indices the Gather sees or None when they cannot be computed exactly, the Gather's node name). With
  c["sym"] the fed indices' first dim is the symbolic "b" (kiln: dims={"b": SYM})."""
  from onnx import TensorProto, helper, numpy_helper
  table = np.random.default_rng(c["seed"]).permutation(math.prod(c["table"])).astype(np.float32).reshape(c["table"]) + 0.25
  dt, tp = IDX[c["dtype"]], TensorProto.INT32 if c["dtype"] == "int32" else TensorProto.INT64
  name = f"gather_{c['seed'] % 1000}"
  ins, inits, nodes, feeds = [], [], [], {}
  if c["table_src"] == "input":
    ins.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, c["table"])); feeds["table"] = table
  else: inits.append(numpy_helper.from_array(table, "table"))
  fed = fed_values(c)
  idx = computed(c, fed)
  if c["src"] == "init": inits.append(numpy_helper.from_array(fed.astype(dt), "idx"))
  elif c["src"] == "constant": nodes.append(helper.make_node("Constant", [], ["idx"], value=numpy_helper.from_array(fed.astype(dt), "k")))
  else:
    ftp = (TensorProto.INT64 if c["dtype"] == "int32" else TensorProto.INT32) if c["compute"][:1] == ["Cast"] else tp
    ins.append(helper.make_tensor_value_info("ids", ftp, ["b", *c["ishape"][1:]] if c.get("sym") else c["ishape"])); feeds["ids"] = fed
    if c["src"] == "input": nodes.append(helper.make_node("Identity", ["ids"], ["idx"]))
    else: nodes += _compute_nodes(c, tp, inits)
  nodes.append(helper.make_node("Gather", ["table", "idx"], ["g"], name=name, axis=c["axis"]))
  ax = c["axis"] % len(c["table"])
  ishape: list[Any] = list(idx.shape) if idx is not None else c["ishape"]
  if c.get("sym"): ishape = ["b", *ishape[1:]]
  shape = c["table"][:ax] + ishape + c["table"][ax + 1:]
  post = c["post"] if shape else "none"
  if post == "Neg": nodes.append(helper.make_node("Neg", ["g"], ["y"]))
  elif post == "Add":
    inits.append(numpy_helper.from_array(np.float32(0.5) * np.arange(shape[-1] if isinstance(shape[-1], int) else 1, dtype=np.float32), "bias"))
    nodes.append(helper.make_node("Add", ["g", "bias"], ["y"]))
  elif post == "ReduceMax":
    inits.append(numpy_helper.from_array(np.asarray([-1], np.int64), "axes"))
    nodes.append(helper.make_node("ReduceMax", ["g", "axes"], ["y"], keepdims=1))
    shape = shape[:-1] + [1]
  else: nodes.append(helper.make_node("Identity", ["g"], ["y"]))
  out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
  return oracle.make_model(nodes, ins, out, inits), feeds, idx, name


def _compute_nodes(c: dict[str, Any], tp: int, inits: list[Any]) -> list[Any]:
  from onnx import helper, numpy_helper
  op, k = c["compute"]
  dt = IDX[c["dtype"]]
  if op == "Neg": return [helper.make_node("Neg", ["ids"], ["idx"])]
  if op == "Cast": return [helper.make_node("Cast", ["ids"], ["idx"], to=tp)]
  if op == "Gather":
    inits.append(numpy_helper.from_array(np.asarray(k, dt), "remap"))
    return [helper.make_node("Gather", ["remap", "ids"], ["idx"], name="remap", axis=0)]
  if op == "Concat":
    inits += [numpy_helper.from_array(np.asarray(k, dt), "tail"), numpy_helper.from_array(np.asarray([-1], np.int64), "flat")]
    return [helper.make_node("Reshape", ["ids", "flat"], ["idsf"]), helper.make_node("Concat", ["idsf", "tail"], ["idx"], axis=0)]
  inits.append(numpy_helper.from_array(np.asarray(k, dt), "k"))
  return [helper.make_node(op, ["ids", "k"], ["idx"])]


def _bad(idx: np.ndarray, n: int) -> set[int]: return {int(v) for v in idx.reshape(-1) if not -n <= int(v) < n}


def refusals(c: dict[str, Any], fed: np.ndarray, idx: np.ndarray | None, name: str) -> dict[str, set[int]] | None:
  """The gathers that must refuse, each with the indices its error may name ({} when none must; None when the case is
  undefined: its index arithmetic leaves the dtype). A remap read out of range refuses by name; its clamped result may
  also send the outer gather any remap value, so the outer may be the one named, with one of those."""
  n = c["table"][c["axis"]]
  if c["compute"][:1] == ["Gather"]:
    k = c["compute"][1]
    if inner := {int(v) for v in fed.reshape(-1) if not -len(k) <= int(v) < len(k)}: return {"remap": inner, name: _bad(np.asarray(k), n)}
  if idx is None: return None
  return {name: bad} if (bad := _bad(idx, n)) else {}


def _named(e: Exception, must: dict[str, set[int]]) -> str:
  """'' when the error names one of the gathers that must refuse and one of its bad indices, else what is missing."""
  v = getattr(e, "value", None)
  if v is None and (m := re.search(r"index (-?\d+) is out of range", str(e))): v = int(m.group(1))
  for node, bad in must.items():
    if f"node {node} " in str(e): return "" if v is not None and int(v) in bad else f"the error names index {v}, not one of {sorted(bad)[:6]}: {e}"
  return f"the error names none of the gathers {sorted(must)}: {e}"


def check(c: dict[str, Any], guard: bool = True) -> str | None:
  """None when kiln answers as onnxruntime does (the same values, or a typed refusal where it refuses); else what differed."""
  from kiln.graph import onnx as konnx
  from kiln.graph.lazy import IndexOutOfRangeError, ONNXError
  model, feeds, idx, name = build(c)
  if (must := refusals(c, fed_values(c), idx, name)) is None: return None  # undefined in ONNX: not a case
  want, why = oracle.ort_run(model, feeds)
  if (want is None) != bool(must): return f"onnxruntime {'refused' if want is None else 'ran'} ({why}) where the case expects otherwise: malformed"
  with oracle.guarded(guard):
    try: m = konnx.load(model, dims={"b": SYM} if c.get("sym") else None)
    except ONNXError as e:
      if want is not None: return f"kiln refused at load what onnxruntime ran: {e}"
      if c["src"] in ("input", "computed"): return f"kiln refused indices that are fed at load time: {e}"
      return _named(e, must) or None
    try: got = m.run(feeds)["y"]
    except IndexOutOfRangeError as e:
      if want is not None: return f"kiln raised where onnxruntime returned: {e}"
      if c["src"] in ("init", "constant"): return f"constant indices were not refused at load (ONNXError) but at run time: {e}"
      return _named(e, must) or _good_after(c, m, model, feeds)
    except Exception as e:
      return f"kiln raised {type(e).__name__}{' where onnxruntime returned' if want is not None else ', not IndexOutOfRangeError'}: {e}"
    if want is None: return f"kiln returned values where onnxruntime refused ({why}): bad indices {must}, got {got.reshape(-1)[:6]}"
    return oracle.same(got, want[0]) or None


def _good_after(c: dict[str, Any], m: Any, model: Any, feeds: dict[str, np.ndarray]) -> str | None:
  """After a refused run, the same plan runs indices in range (0, or what the op's constant needs to give 0)."""
  if "ids" not in feeds: return None
  k = c["compute"][1] if c["compute"] and c["compute"][0] in ("Add", "Sub") else 0
  shape = feeds["ids"].shape
  if c.get("sym"): shape = (shape[0] % SYM[1] + 1, *shape[1:])  # another batch size, from the same plan
  for v in (0, -k, k):
    g = np.full(shape, v).astype(feeds["ids"].dtype) if _fits(np.asarray([v]), feeds["ids"].dtype) else None
    if g is None or (ix := computed(c, g)) is None or _bad(ix, c["table"][c["axis"]]): continue
    good = {**feeds, "ids": g}
    want, why = oracle.ort_run(model, good)
    if want is None: return f"onnxruntime refused the good feed ({why})"
    try: got = m.run(good)["y"]
    except Exception as e: return f"after a refused run the plan failed good indices: {type(e).__name__}: {e}"
    return (msg := oracle.same(got, want[0])) and f"after a refused run: {msg}" or None
  return None
