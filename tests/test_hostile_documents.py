"""Hostile documents: valid documents (kernels' JSON graphs, ProgramSpec/CompiledSpec JSON, a small ONNX model's bytes)
mutated by hypothesis (truncated, nodes swapped, duplicated or deleted, numbers made huge, negative or NaN, sources made
self or forward references, strings blown up, keys duplicated, bytes flipped). Every outcome is a successful load of a
document that is still valid (it round-trips; an ONNX model runs) or a typed error: a KilnError, or pydantic's
ValidationError for the boundary models. Never another exception, a hang (each example runs under an alarm) or a crash.

KILN_HOSTILE_EXAMPLES=N multiplies the example counts (outside CI: KILN_HOSTILE_EXAMPLES=50 runs ~10,000 documents)."""
import contextlib
import copy
import json
import os
import signal
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import CompiledSpec, ProgramSpec
from kiln.ir import UOp, dtypes, kernels
from kiln.ir.errors import KilnError
from kiln.ir.serialize import from_json, to_json
from kiln.ir.verify import verify

SCALE = int(os.environ.get("KILN_HOSTILE_EXAMPLES", "1"))
SECONDS = 10  # one example's budget: a hang fails it


class Hang(Exception):
  pass


@contextlib.contextmanager
def alarm(seconds: int = SECONDS):
  def fire(*_: Any) -> None: raise Hang(f"one document took more than {seconds} s")
  old = signal.signal(signal.SIGALRM, fire)
  signal.setitimer(signal.ITIMER_REAL, seconds, 1)  # fires again each second: a gc callback swallows an exception raised in it
  try: yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def hostile_settings(n: int):
  return settings(max_examples=n * SCALE, deadline=None, derandomize=SCALE == 1, database=None, suppress_health_check=list(HealthCheck))


# ---- mutations of a JSON value ----
HOSTILE = [2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**62, 10**30, -1, 0, 1, 1e308, -1e308,
           float("nan"), float("inf"), float("-inf"), -0.0, 0.5, True, False, None, "", "x" * 5000, "NaN", "float32*4611686018427387904",
           "float32x100000", "int32", "SINK", [], [0] * 1000, {}, {"float": "nan"}, {"tuple": [{"tuple": []}]}]


def _places(doc: Any) -> list[tuple[Any, Any]]:
  """Every (container, key or index) in doc, found without recursion."""
  out, stack = [], [doc]
  while stack:
    c = stack.pop()
    keys = list(c) if isinstance(c, dict) else range(len(c)) if isinstance(c, list) else []
    for k in keys:
      out.append((c, k))
      if isinstance(c[k], dict | list): stack.append(c[k])
  return out


BLOW_UP = 100_000  # items or characters one blow-up may reach, and one per document: two compounding ones made gigabytes


def mutate_doc(data: st.DataObject, doc: Any) -> Any:
  doc, blown = copy.deepcopy(doc), False
  for _ in range(data.draw(st.integers(1, 4), label="mutations")):
    places = _places(doc)
    if not places: break
    c, k = places[data.draw(st.integers(0, len(places) - 1), label="place")]
    kind = data.draw(st.sampled_from(["value", "value", "blow-up", "delete", "duplicate", "swap", "reference"]), label="kind")
    if kind == "value": c[k] = copy.deepcopy(data.draw(st.sampled_from(HOSTILE), label="value"))
    elif kind == "blow-up" and isinstance(c[k], str | list) and c[k] and not blown:
      c[k], blown = c[k] * min(data.draw(st.sampled_from([2, 100, 3000])), BLOW_UP // len(c[k])), True
    elif kind == "delete": del c[k]
    elif kind == "duplicate" and isinstance(c, list): c.insert(k, copy.deepcopy(c[k]))
    elif kind == "swap" and isinstance(c, list) and len(c) > 1:
      j = data.draw(st.integers(0, len(c) - 1))
      c[k], c[j] = c[j], c[k]
    elif kind == "reference":  # a node's sources: itself, a later node, a negative or absurd index (cycles and dangling edges)
      nodes = doc.get("nodes") if isinstance(doc, dict) else None
      if isinstance(nodes, list) and nodes:
        i = data.draw(st.integers(0, len(nodes) - 1))
        if isinstance(nodes[i], dict): nodes[i]["src"] = [data.draw(st.sampled_from([i, i + 1, len(nodes), -1, 2**40]))]
  return doc


def mutate_text(data: st.DataObject, text: str) -> str | bytes:
  kind = data.draw(st.sampled_from(["none", "none", "truncate", "duplicate-key", "flip", "nan-token"]), label="text")
  if kind == "truncate": return text[:data.draw(st.integers(0, max(len(text) - 1, 0)))]
  if kind == "duplicate-key": return text.replace('"op": ', '"op": "NEG", "op": ', 1).replace('"name": ', '"name": "x", "name": ', 1)
  if kind == "flip" and text:
    b = bytearray(text.encode())
    b[data.draw(st.integers(0, len(b) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    return bytes(b)
  if kind == "nan-token": return text.replace("1", "NaN", 1)
  return text


def json_text(doc: Any) -> str: return json.dumps(doc, allow_nan=True)


# ---- UOp JSON graphs ----
def _seed_kernels() -> list[dict]:
  n = UOp.variable("n", 1, 64)
  return [json.loads(to_json(k)) for k in (kernels.matmul(4, 4, 8), kernels.softmax((n, 8), dtypes.float32),
                                           kernels.elementwise(lambda x: (x * 2.0).exp2(), dtypes.float32, ((16,), dtypes.float32)))]


SEED_GRAPHS = _seed_kernels()


@hostile_settings(400)
@given(st.data())
def test_mutated_uop_graphs(data):
  text = mutate_text(data, json_text(mutate_doc(data, data.draw(st.sampled_from(SEED_GRAPHS), label="seed"))))
  with alarm():
    try: u = from_json(text)
    except KilnError as e: return event(f"refused: {type(e).__name__}")
    event("loaded")
    assert from_json(to_json(u)) is u, "a loaded graph must round-trip"
    try: verify(u)  # the verifier is the next reader of a loaded kernel: it must refuse what it cannot take, typed
    except KilnError: pass


# ---- ProgramSpec / CompiledSpec JSON ----
def _seed_specs() -> list[tuple[type, dict]]:
  rt = get_runtime("CPU")
  prog = rt.renderer.render(kernels.matmul(4, 4, 8))
  comp = rt.compiler.compile(rt.renderer.render(kernels.softmax((UOp.variable("n", 1, 64), 8), dtypes.float32)))
  return [(ProgramSpec, json.loads(prog.model_dump_json())), (CompiledSpec, json.loads(comp.model_dump_json()))]


SEED_SPECS = _seed_specs()


@hostile_settings(300)
@given(st.data())
def test_mutated_specs(data):
  cls, doc = data.draw(st.sampled_from(SEED_SPECS), label="seed")
  text = mutate_text(data, json_text(mutate_doc(data, doc)))
  with alarm():
    try: spec = cls.model_validate_json(text)
    except (KilnError, ValidationError) as e: return event(f"refused: {type(e).__name__}")
    event("loaded")
    assert cls.model_validate_json(spec.model_dump_json()) == spec, "a loaded spec must round-trip"


# ---- ONNX models ----
try:
  import onnx
  from onnx import TensorProto, helper, numpy_helper

  from kiln.graph.onnx import load
except ImportError: onnx = None


def _seed_model() -> bytes:
  rng = np.random.default_rng(0)
  inits = [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W"),
           numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
           numpy_helper.from_array(np.array([4, 2], np.int64), "shape"),
           numpy_helper.from_array(np.array([2], np.int64), "fill")]
  nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"), helper.make_node("Add", ["xw", "b"], ["xwb"], name="add"),
           helper.make_node("Relu", ["xwb"], ["r"], name="relu"), helper.make_node("Reshape", ["r", "shape"], ["rs"], name="reshape"),
           helper.make_node("ConstantOfShape", ["fill"], ["ones"], name="cos", value=numpy_helper.from_array(np.ones(1, np.float32))),
           helper.make_node("Mul", ["rs", "ones"], ["y"], name="mul"),
           helper.make_node("ReduceSum", ["y"], ["s"], name="sum", keepdims=0)]
  g = helper.make_graph(nodes, "seed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2]), helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                        initializer=inits)
  return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


SEED_ONNX = _seed_model() if onnx is not None else b""
DIMS = [2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -1, -(2**40), 0, 1, 10**6]


def _mutate_proto(data: st.DataObject, m: Any) -> None:
  g = m.graph
  kind = data.draw(st.sampled_from(["init-dim", "raw-data", "self-cycle", "forward-cycle", "duplicate-node", "swap-nodes", "op-type",
                                    "attr-ints", "input-dim", "name", "duplicate-init", "opset", "drop-node"]), label="proto")
  pick = lambda seq: seq[data.draw(st.integers(0, len(seq) - 1))]  # noqa: E731
  if kind == "init-dim":
    t = pick(g.initializer)
    if t.dims: t.dims[data.draw(st.integers(0, len(t.dims) - 1))] = data.draw(st.sampled_from(DIMS))
  elif kind == "raw-data":
    t = pick(g.initializer)
    t.raw_data = t.raw_data[:data.draw(st.integers(0, len(t.raw_data)))] if t.raw_data else b"\0" * data.draw(st.integers(0, 64))
  elif kind == "self-cycle":
    n = pick(g.node)
    n.input[0] = n.output[0]
  elif kind == "forward-cycle":
    i = data.draw(st.integers(0, len(g.node) - 2))
    g.node[i].input[0] = g.node[i + 1].output[0]
  elif kind == "duplicate-node": g.node.append(copy.deepcopy(pick(g.node)))
  elif kind == "swap-nodes":
    i, j = data.draw(st.integers(0, len(g.node) - 1)), data.draw(st.integers(0, len(g.node) - 1))
    a, b = copy.deepcopy(g.node[i]), copy.deepcopy(g.node[j])
    g.node[i].CopyFrom(b)
    g.node[j].CopyFrom(a)
  elif kind == "op-type": pick(g.node).op_type = data.draw(st.sampled_from(["Loop", "Frobnicate", "", "Relu", "Range", "Expand", "x" * 5000]))
  elif kind == "attr-ints":
    n = pick(g.node)
    n.attribute.append(helper.make_attribute(data.draw(st.sampled_from(["axes", "keepdims", "perm", "bogus"])),
                                             [data.draw(st.sampled_from(DIMS))] * data.draw(st.sampled_from([1, 3, 100_000]))))
  elif kind == "input-dim":
    d = g.input[0].type.tensor_type.shape.dim
    d[data.draw(st.integers(0, len(d) - 1))].dim_value = data.draw(st.sampled_from(DIMS))
  elif kind == "name": pick(g.node).output[0] = "y" * data.draw(st.sampled_from([10, 5000, 100_000]))
  elif kind == "duplicate-init": g.initializer.append(copy.deepcopy(pick(g.initializer)))
  elif kind == "opset": m.opset_import[0].version = data.draw(st.sampled_from([0, 1, 7, 99, 2**62]))
  elif kind == "drop-node": del g.node[data.draw(st.integers(0, len(g.node) - 1))]


def _mutate_bytes(data: st.DataObject, b: bytes) -> bytes:
  kind = data.draw(st.sampled_from(["truncate", "flip", "duplicate-range", "delete-range"]), label="bytes")
  i = data.draw(st.integers(0, len(b) - 1))
  j = data.draw(st.integers(i, min(len(b), i + 64)))
  if kind == "truncate": return b[:i]
  if kind == "flip": return b[:i] + bytes([b[i] ^ (1 << data.draw(st.integers(0, 7)))]) + b[i + 1:]
  if kind == "duplicate-range": return b[:j] + b[i:j] + b[j:]  # a repeated protobuf field: a node or an initializer twice
  return b[:i] + b[j:]


@pytest.mark.skipif(onnx is None, reason="needs the onnx package (kiln-graph[onnx])")
@hostile_settings(100)
@given(st.data())
def test_mutated_onnx_models(data):
  if data.draw(st.booleans(), label="proto-level"):
    m = onnx.load_from_string(SEED_ONNX)
    for _ in range(data.draw(st.integers(1, 3))): _mutate_proto(data, m)
    try: doc = m.SerializeToString()
    except Exception: return  # protobuf refuses to write it (an over-large int field): no document to load
  else: doc = _mutate_bytes(data, SEED_ONNX)
  with alarm(30):  # a model that survives compiles kernels
    try: model = load(doc)
    except KilnError as e: return event(f"refused: {type(e).__name__}: {str(e).split(':')[0][:40]}")
    if model.plan is not None and model.plan.memory_bytes > 64 << 20: return event("loaded, too large to run here")
    event("loaded and ran")
    feeds = {n: np.zeros(s, dt) for n, s, dt in model.inputs}
    out = model.run(feeds)
    assert set(out) == set(model.output_names) and all(isinstance(v, np.ndarray) for v in out.values())
