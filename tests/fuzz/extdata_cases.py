"""ONNX models whose constants keep their bytes in files beside the model (external data), valid and hostile.

A case is a small chain over one fed input, each step reading one stored tensor: an Add of an initializer (W), a Mul by a
Constant node's value (C), an Add of a ConstantOfShape whose value is stored (V), a Gather by a Constant's int64 indices
(I) and a Reshape by an int64 initializer (R). The bytes are written by onnx.save_model (save_as_external_data, attribute
tensors too) or by hand: one file or one per tensor (some in a subfolder), gaps before each tensor (so offsets are often
not aligned to the element), with or without a length entry. The model is loaded from its path, or as a ModelProto with
`directory=`. Valid cases must match onnxruntime exactly (given the model as onnx.load reads it with its data); half of them run kiln on the mapped
file itself, the others with every constant copied between guard pages (onnx_oracle.guarded).

A hostile case changes one tensor's entry or its file after writing: a location with `..`, an absolute one, a symlink to
a file or folder outside, a FIFO, a folder, /dev/zero through a link, a missing file, a NUL byte, an empty location, an
offset past the end, a truncated file, a wrong length, a negative, huge or non-integer offset, an unknown key, dims far
too large, or a ModelProto given with no directory. Each must be an ONNXError at load, within WATCHDOG_S seconds. The
file outside holds the right bytes at the right offset, so a resolver that let the path through would load and run."""
from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

oracle = importlib.import_module(f"{__package__}.onnx_oracle" if __package__ else "onnx_oracle")  # in tests.fuzz, or beside the script

ROLES = ["W", "C", "V", "I", "R"]
HOSTILE = ["dotdot", "dotdot_inner", "absolute", "symlink_file", "symlink_dir", "fifo", "directory", "dev_link", "missing", "nul", "empty",
           "offset_past_end", "truncated", "length_mismatch", "negative", "not_int", "huge_offset", "unknown_key", "huge_dims", "no_directory"]
WATCHDOG_S = 20.0
LABEL = {"W": "initializer 'W'", "R": "initializer 'R'", "C": "node const_C", "V": "node cofs_V", "I": "node const_I"}  # in the errors


@st.composite
def cases(draw: Callable) -> dict[str, Any]:
  roles = [r for r in ROLES if draw(st.booleans())] or [draw(st.sampled_from(ROLES))]
  hostile = draw(st.sampled_from(HOSTILE)) if draw(st.integers(0, 1)) else None
  return {"shape": [draw(st.integers(1, 5)), draw(st.integers(1, 5))], "roles": roles, "seed": draw(st.integers(0, 2**31 - 1)),
          "writer": draw(st.sampled_from(["onnx", "hand"])), "one_file": draw(st.booleans()), "gaps": [draw(st.integers(0, 9)) for _ in roles],
          "length": draw(st.booleans()), "subdir": draw(st.booleans()), "via": draw(st.sampled_from(["path", "proto"])),
          "mapped": draw(st.booleans()), "hostile": hostile, "target": draw(st.integers(0, len(roles) - 1)), "amount": draw(st.integers(0, 5))}


def _arrays(c: dict[str, Any]) -> dict[str, np.ndarray]:
  a, b = c["shape"]
  rng = np.random.default_rng(c["seed"])
  return {"W": rng.uniform(-2, 2, (a, b)).astype(np.float32), "C": rng.uniform(-2, 2, (b,)).astype(np.float32),
          "V": np.asarray([rng.uniform(-2, 2)], np.float32), "I": rng.integers(-a, a, (rng.integers(1, 4),)).astype(np.int64),
          "R": np.asarray([-1], np.int64)}


def model(c: dict[str, Any]) -> Any:
  """The chain as a ModelProto, every stored tensor still in memory."""
  from onnx import TensorProto, helper, numpy_helper
  arr, (a, b) = _arrays(c), c["shape"]
  nodes, inits, cur, shape = [], [], "x", [a, b]
  for role in c["roles"]:
    t = numpy_helper.from_array(arr[role], f"{role}val")
    out = f"after_{role}"
    if role in ("W", "R"):
      t.name = role
      inits.append(t)
    if role == "W": nodes.append(helper.make_node("Add", [cur, "W"], [out]))
    elif role == "C": nodes += [helper.make_node("Constant", [], ["C"], name="const_C", value=t), helper.make_node("Mul", [cur, "C"], [out])]
    elif role == "V":
      inits.append(numpy_helper.from_array(np.asarray(shape, np.int64), "vshape"))
      nodes += [helper.make_node("ConstantOfShape", ["vshape"], ["V"], name="cofs_V", value=t), helper.make_node("Add", [cur, "V"], [out])]
    elif role == "I":
      nodes += [helper.make_node("Constant", [], ["I"], name="const_I", value=t), helper.make_node("Gather", [cur, "I"], [out], axis=0)]
      shape = [len(arr["I"]), *shape[1:]]
    else:
      nodes.append(helper.make_node("Reshape", [cur, "R"], [out]))
      shape = [int(np.prod(shape))]
    cur = out
  nodes.append(helper.make_node("Identity", [cur], ["y"]))
  return oracle.make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [a, b])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)


def _entries(t: Any) -> dict[str, str]: return {e.key: e.value for e in t.external_data}


def _set_entries(t: Any, entries: dict[str, str]) -> None:
  del t.external_data[:]
  for k, v in entries.items(): t.external_data.add(key=k, value=v)


def write(c: dict[str, Any], d: str) -> tuple[str, Any]:
  """The model and its data written into folder d; (the model's path, its ModelProto without the data)."""
  import onnx
  from onnx import TensorProto
  m = model(c)
  path = os.path.join(d, "model.onnx")
  if c["writer"] == "onnx":
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=c["one_file"], location="weights.bin" if c["one_file"] else None,
                    size_threshold=0, convert_attribute=True)
    return path, onnx.load(path, load_external_data=False)
  sizes: dict[str, int] = {}
  for i, role in enumerate(c["roles"]):
    t = _tensor(m, role)  # the graph's own copy (make_graph and make_node copy the tensors they are given)
    raw = t.raw_data
    loc = "weights.bin" if c["one_file"] else os.path.join("sub", f"{role}.bin") if c["subdir"] and i % 2 else f"{role}.bin"
    os.makedirs(os.path.dirname(os.path.join(d, loc)), exist_ok=True)
    off = sizes.get(loc, 0) + c["gaps"][i]
    with open(os.path.join(d, loc), "ab") as f: f.write(b"\xa5" * c["gaps"][i] + raw)
    sizes[loc] = off + len(raw)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    # no length: the data runs to the end of the file (ONNX's rule), so only a file of one tensor may leave it out
    _set_entries(t, {"location": loc, "offset": str(off), **({"length": str(len(raw))} if c["length"] or c["one_file"] else {})})
  with open(path, "wb") as f: f.write(m.SerializeToString())
  return path, m


def _tensor(m: Any, role: str) -> Any:
  for t in m.graph.initializer:
    if t.name == role: return t
  for n in m.graph.node:
    if n.name in (f"const_{role}", f"cofs_{role}"): return n.attribute[0].t
  raise AssertionError(role)


def make_hostile(c: dict[str, Any], d: str, root: str, m: Any) -> None:
  """One tensor's entry or file made hostile (c['hostile']); the model file rewritten."""
  import onnx
  t = _tensor(m, c["roles"][c["target"]])
  e = _entries(t)
  loc, off, k = e["location"], int(e.get("offset", "0")), c["amount"]
  need = int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
  with open(os.path.join(d, loc), "rb") as f: data = f.read()
  outside = os.path.join(root, "outside.bin")
  with open(outside, "wb") as f: f.write(data)  # the right bytes at the right offset: a path let through would load
  h = c["hostile"]
  if h == "dotdot": e["location"] = "../outside.bin"
  elif h == "dotdot_inner": e["location"] = "sub/../../outside.bin"
  elif h == "absolute": e["location"] = outside
  elif h in ("symlink_file", "symlink_dir", "dev_link"):
    os.symlink(outside if h == "symlink_file" else root if h == "symlink_dir" else "/dev/zero", os.path.join(d, "link"))
    e["location"] = "link/outside.bin" if h == "symlink_dir" else "link"
  elif h == "fifo":
    os.mkfifo(os.path.join(d, "pipe"))
    e["location"] = "pipe"
  elif h == "directory":
    os.makedirs(os.path.join(d, "adir"), exist_ok=True)
    e["location"] = "adir"
  elif h == "missing": e["location"] = "missing.bin"
  elif h == "nul": e["location"] = loc + "\0.bin"
  elif h == "empty": e["location"] = ""
  elif h == "offset_past_end": e["offset"] = str(len(data) - need + 1 + k)
  elif h == "truncated":
    with open(os.path.join(d, loc), "r+b") as f: f.truncate(off + need - 1 - min(k, need - 1))
  elif h == "length_mismatch": e["length"] = str(need - 1 - k if k % 2 and need > k else need + 1 + k)
  elif h == "negative": e["offset"] = str(-1 - k)
  elif h == "not_int": e["offset"] = ["0x10", "ten", "1.5", "", "1e3", "0x"][k]
  elif h == "huge_offset": e["offset"] = str(2**63 + k)
  elif h == "unknown_key": e["secret"] = "x"
  elif h == "huge_dims":
    del t.dims[:]
    t.dims.extend([2**31, 2**31 + k])
    e.pop("length", None)
  _set_entries(t, e)
  with open(os.path.join(d, "model.onnx"), "wb") as f: f.write(m.SerializeToString())


def check(c: dict[str, Any], guard: bool = True) -> str | None:
  """None when a valid case matches onnxruntime and a hostile one is an ONNXError at load; else what went wrong."""
  from kiln.graph import onnx as konnx
  from kiln.graph.lazy import ONNXError
  with tempfile.TemporaryDirectory(prefix="kiln-extdata-") as root:
    d = os.path.join(root, "model")
    os.makedirs(d)
    path, m = write(c, d)
    if c["hostile"] not in (None, "no_directory"): make_hostile(c, d, root, m)
    x = np.random.default_rng(c["seed"] + 1).uniform(-2, 2, c["shape"]).astype(np.float32)
    src: Any = path if c["via"] == "path" and c["hostile"] != "no_directory" else m
    where = None if c["hostile"] == "no_directory" or c["via"] == "path" else d
    with oracle.guarded(guard, map_constants=c["mapped"]):
      try:
        with oracle.watchdog(WATCHDOG_S): km = konnx.load(src, directory=where)
      except ONNXError as e:
        if c["hostile"] is None: return f"kiln refused a valid model: {e}"
        # a truncated file shared by several tensors fails at whichever of them is read first (initializers come first)
        label = LABEL[c["roles"][c["target"]]]
        named = label in str(e) or c["hostile"] == "truncated" and "the file has" in str(e)
        return None if c["hostile"] == "no_directory" or named else f"the ONNXError does not name the hostile tensor ({label}): {e}"
      except Exception as e: return f"load raised {type(e).__name__}, not an ONNXError: {e}"
      if c["hostile"] is not None: return f"kiln loaded a model whose external data is hostile ({c['hostile']})"
      got = km.run({"x": x})["y"]
    import onnx  # onnx's own reader of the data files (onnxruntime's shape inference cannot read a Reshape's external shape)
    want, why = oracle.ort_run(onnx.load(path), {"x": x})
    if want is None: return f"onnxruntime refused a valid case ({why}): the case is malformed"
    return oracle.same(got, want[0]) or None
