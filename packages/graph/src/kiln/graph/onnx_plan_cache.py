"""A loaded ONNX model kept whole in the plan cache (kiln.executor.plan_cache): loading the same model again rebuilds
its plan from the stored PlanSpec, without parsing, converting, scheduling or looking up kernels (issue 37).

The key is the model's content and everything else the built plan depends on:

| part of the key                      | why                                                                       |
|--------------------------------------|---------------------------------------------------------------------------|
| sha256 of the model's bytes (and a path's extension: the format follows it) | the model itself                   |
| `dims`, the device                   | load's other arguments                                                    |
| the target key (kiln.executor.cache.target_key) | the CPU target, the kiln versions with the code stamps of IR, codegen, runtime |
| kiln.graph's and kiln.executor's code stamps, onnx's and numpy's versions | they convert, fold and schedule the model |
| every KILN_* setting but those that never change a plan (NEUTRAL) | KILN_WINOGRAD, KILN_TUNE, a new setting too |

A model file's hash is remembered beside its stat (plan_keys.file_digest), as git's index does.

| a model is kept when                                 | else                                                        |
|------------------------------------------------------|-------------------------------------------------------------|
| it compiles to one plan (no run-time branch or specialisation) | a Program is not a PlanSpec                       |
| it has no external data, and no weight is a mapped file | its content is more than the bytes hashed                |
| its inputs, outputs and constants have numpy dtypes that round-trip by name | (bfloat16 is ml_dtypes')             |

A model loaded with bounds (symbolic dims) is kept with its shapes' expressions in the variables (compile_cache.describe):
the rebuilt plan runs every size within the bounds, as the loaded one did.

A hit gives a Model that runs as the loaded one does, without importing onnx; what it does not have is the graph:
`compiled.kernels` is empty (the scheduler's kernels), and the ONNX nodes each kernel covers come from the entry
(`compiled.origins`).
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.codegen import diskcache
from kiln.executor import plan_cache
from kiln.executor.cache import target_key
from kiln.executor.plan_cache import stat_id
from kiln.executor.planspec import export
from kiln.graph.compile_cache import describe, rebuild
from kiln.graph.onnx_limits import MAX_MODEL_BYTES
from kiln.graph.plan_keys import digest, file_digest, shaping_settings, stamp

FORMAT = "kiln-onnx-plan 2"  # 2: symbolic dims kept (compile_cache.describe)


def plan_key(model: Any, device: str, dims: Mapping[str, Any] | None) -> tuple[str, list[int] | None] | None:
  """The plan cache key of loading `model` with these arguments (and the model file's stat, checked again before storing),
  or None when it is not cached (the cache is off, a model of another kind)."""
  if not plan_cache.enabled() or diskcache.cache_key() is None: return None
  if (version := _onnx_version()) is None: return None  # no onnx: load says what to install
  sid, fmt = None, "protobuf"
  if isinstance(model, (str, os.PathLike)):
    path = os.fspath(model)
    if not isinstance(path, str) or (got := file_digest(path, MAX_MODEL_BYTES)) is None: return None  # a bytes path: loaded, never kept
    content, sid = got
    ext = os.path.splitext(path)[1].lower()
    fmt = "protobuf" if ext in (".onnx", ".pb", "") else f"ext:{ext}"  # onnx reads a .json or .txt model as text
  elif isinstance(model, (bytes, bytearray)): content = digest(bytes(model))
  elif (onnx := sys.modules.get("onnx")) is not None and isinstance(model, onnx.ModelProto): content = digest(model.SerializeToString())
  else: return None  # load refuses it
  from kiln.codegen.registry import get_runtime
  from kiln.codegen.spec import DeviceSpec
  try:
    dev = str(DeviceSpec.parse(device))
    target = target_key(dev, get_runtime(dev))
  except Exception: return None  # noqa: S112 (a bad device: load reports it)
  try: given = json.dumps(sorted((str(k), list(v) if isinstance(v, tuple | list) else v) for k, v in (dims or {}).items()))
  except (TypeError, ValueError): return None  # not a size or bounds: load reports it
  parts = [FORMAT, content, fmt, given, dev, target,
           f"graph+{stamp('kiln.graph')}", f"executor+{stamp('kiln.executor')}", f"onnx={version}", f"numpy={np.__version__}",
           shaping_settings()]
  return "\n".join(parts), sid


def _onnx_version() -> str | None:
  """The installed onnx's version without importing it (a hit never needs onnx: about 0.25 s of a new process's first load)."""
  if (onnx := sys.modules.get("onnx")) is not None: return str(onnx.__version__)
  import importlib.metadata
  try: return importlib.metadata.version("onnx")
  except importlib.metadata.PackageNotFoundError: return None


def _round_trips(dt: np.dtype) -> bool:
  try: return np.dtype(dt.str) == dt and dt.kind in "biuf"
  except TypeError: return False


def _inputs_of(m: Any) -> list[tuple[str, tuple[int | str, ...], np.dtype]]:
  return [(n, tuple(s), np.dtype(dt)) for n, s, dt in getattr(m, "_inputs", None) or m.inputs]


def _origins(compiled: Any) -> dict[str, Any]:
  """Plan op id -> [the ONNX nodes the kernel covers, its primary node] (provenance.py), as JSON."""
  from kiln.graph.provenance import kernel_origins, primary
  out: dict[str, Any] = {}
  for k in compiled.kernels:
    if getattr(k, "op_id", None) is None: continue
    p = primary(k)
    out[str(k.op_id)] = [[list(o) for o in kernel_origins(k)], list(p) if p is not None else None]
  return out


def keep_model(key: tuple[str, list[int] | None], model: Any, m: Any, proto: Any) -> bool:
  """Store the loaded Model m (of `model`, whose checked ModelProto is `proto`) under key; False when it is not kept
  (see the module docstring)."""
  from kiln.graph.onnx_external import model_tensors
  if m.program is not None or m.compiled is None: return False
  if any(t.data_location == 1 for t, _ in model_tensors(proto.graph)): return False  # onnx.TensorProto.EXTERNAL
  if key[1] is not None:  # the file must still be what was hashed: unchanged since (its ctime moves on any write)
    try:
      if stat_id(os.stat(os.path.realpath(os.fspath(model)))) != key[1]: return False
    except OSError: return False
  c, inputs, consts = m.compiled, _inputs_of(m), dict(m._consts)
  if not all(_round_trips(dt) for _, _, dt in inputs) or not all(_round_trips(a.dtype) for a in [*consts.values(), *m.defaults.values()]):
    return False
  if (described := describe(c)) is None: return False
  try: spec, arrays = export(c.plan, {i.name: i.buf for i in c.inputs}, dict(zip(m._computed, (b for b, _ in c.outputs))), checks=c.checks)
  except Exception: return False  # noqa: S112 (a plan a spec cannot carry: the model loads as before)
  if any(st.weight is not None and st.weight.kind == "file" for st in spec.storages): return False  # a mapped file: not what was hashed
  extra = {f"const:{n}": np.ascontiguousarray(a) for n, a in consts.items()}
  extra.update({f"default:{n}": np.ascontiguousarray(a) for n, a in m.defaults.items()})
  declared = {i.name: [list(i.shape), np.dtype(i.dtype).str] for i in getattr(m, "_outputs", [])
              if i.name not in consts and i.shape is not None and i.dtype is not None and _round_trips(np.dtype(i.dtype))}
  meta = {
    "inputs": [[n, list(s), dt.str] for n, s, dt in inputs],
    "outputs": [[n, "const" if n in consts else "computed"] for n in m.output_names],
    "declared": declared,
    "compiled": described,
    "defaults": list(m.defaults), "nodes": m.nodes, "opset": m.opset, "origins": _origins(c),
  }
  try: json.dumps(meta)
  except (TypeError, ValueError): return False
  return plan_cache.store(key[0], spec, {**arrays, **extra}, meta)


def cached_model(key: tuple[str, list[int] | None], model_cls: Any) -> Any | None:
  """The Model kept under key, rebuilt, or None (a miss)."""
  from kiln.executor.planspec import builder_from_spec
  from kiln.graph.provenance import Origin
  hit = plan_cache.load(key[0])
  if hit is None: return None
  meta, w = hit.meta, hit.weights
  try:
    plan = builder_from_spec(hit.spec, w, code="sealed", verify=False).build()  # the weights' chunks were verified on load
    compiled = rebuild(plan, meta["compiled"])
    compiled.origins = {int(k): ([Origin(*o) for o in os_], Origin(*p) if p else None) for k, (os_, p) in meta["origins"].items()}
    outputs = [(n, w[f"const:{n}"] if kind == "const" else None) for n, kind in meta["outputs"]]
    declared = {n: (tuple(s), np.dtype(dt)) for n, (s, dt) in meta.get("declared", {}).items()}
    m = model_cls.from_cache([(n, tuple(s), np.dtype(dt)) for n, s, dt in meta["inputs"]], outputs, compiled, meta["nodes"], meta["opset"],
                             {n: w[f"default:{n}"] for n in meta["defaults"]}, declared)
  except Exception as e:  # a sealed entry that no longer builds (another kiln's plan): forget it, load afresh
    from kiln.executor import debug
    if debug.DEBUG >= 1: debug.emit(f"kiln: plan cache entry not used ({type(e).__name__}: {str(e)[:160]}); loading the model")
    plan_cache.remove(key[0])
    return None
  return m
