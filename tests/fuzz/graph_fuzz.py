"""Differential fuzzing of the graph layer: random tensor programs (kiln.graph.Tensor) against numpy in float64, and random
ONNX graphs (kiln.graph.onnx) against onnxruntime. A program is one input of random rank (1-4) and sizes (1-6) and a chain
of 1-7 steps drawn from STEPS, each with its numpy twin: elementwise maths and broadcasting, reductions, softmax and
norms, movement (permute, reshape, slice with steps, pad, cat, expand), a matmul with a constant, gather, conv and pool.
Each is compiled fused and unfused; both must match the reference within TOL of the output's scale.

Used by kfuzz.py (`scripts/fuzz N --graph G --onnx O`) and, a few cases each, by test_fuzz.py in CI."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

TOL = 2e-4  # relative to max(1, |reference|'s largest value): float32 kernels against a float64 reference
_ERF = np.vectorize(math.erf)


@dataclass
class Program:
  shape: tuple[int, ...]
  seed: int
  steps: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

  def describe(self) -> str: return f"x{list(self.shape)} seed {self.seed}: " + " -> ".join(f"{n}{a or ''}" for n, a in self.steps)


# each step: (applies to this shape?, draw its parameters, apply to (kiln tensor or numpy array, is_numpy))
def _axis(draw: Callable, shape: tuple[int, ...]) -> int: return draw(st.integers(-len(shape), len(shape) - 1))


def _params(draw: Callable, name: str, shape: tuple[int, ...]) -> dict[str, Any]:
  nd = len(shape)
  if name in ("sum", "max", "mean", "softmax", "log_softmax"): return {"axis": _axis(draw, shape), "keep": draw(st.booleans()) or nd == 1}
  if name == "permute": return {"order": draw(st.permutations(range(nd)))}
  if name == "slice":
    a = draw(st.integers(0, nd - 1))
    n = shape[a]
    start, step = draw(st.integers(0, n - 1)), draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
    return {"axis": a, "start": start, "stop": draw(st.integers(start + 1, n)) if step > 0 else None, "step": step}
  if name == "pad": return {"axis": draw(st.integers(0, nd - 1)), "before": draw(st.integers(0, 2)), "after": draw(st.integers(0, 2))}
  if name == "cat": return {"axis": draw(st.integers(0, nd - 1))}
  if name == "matmul": return {"n": draw(st.integers(1, 6))}
  if name == "gather": return {"idx": draw(st.lists(st.integers(-shape[0], shape[0] - 1), min_size=1, max_size=5))}
  if name == "conv":
    return {"o": draw(st.integers(1, 4)), "k": draw(st.integers(1, 3)), "stride": draw(st.integers(1, 2)), "pad": draw(st.integers(0, 1))}
  if name == "bcast": return {"axis": draw(st.integers(0, nd - 1))}
  return {}


def _fits(name: str, shape: tuple[int, ...]) -> bool:
  nd, size = len(shape), math.prod(shape)
  if name == "reshape": return nd >= 2
  if name == "expand": return 1 in shape
  if name in ("sum", "max", "mean") and nd == 1: return True
  if name == "matmul": return shape[-1] >= 1
  if name == "conv": return nd == 4 and shape[2] >= 3 and shape[3] >= 3
  if name == "pool": return nd == 4 and shape[2] >= 2 and shape[3] >= 2
  if name == "cat": return size <= 400
  return True


def _const(shape: tuple[int, ...], salt: int) -> np.ndarray:
  return np.random.default_rng(salt).uniform(-1, 1, shape).astype(np.float32)


def _apply(name: str, p: dict[str, Any], x: Any, np_mode: bool, salt: int) -> Any:  # noqa: C901 (one table of twins)
  from kiln.graph.tensor import Tensor
  C = (lambda a: a.astype(np.float64)) if np_mode else Tensor
  shape = tuple(x.shape)
  if name == "relu": return np.maximum(x, 0) if np_mode else x.relu()
  if name == "tanh": return np.tanh(x) if np_mode else x.tanh()
  if name == "sigmoid": return 1 / (1 + np.exp(-x)) if np_mode else x.sigmoid()
  if name == "gelu": return 0.5 * x * (1 + _ERF(x / math.sqrt(2))) if np_mode else x.gelu()
  if name == "exp": return np.exp(np.clip(x, -4, 4)) if np_mode else x.maximum(-4.0).minimum(4.0).exp()
  if name == "sqrt": return np.sqrt(np.abs(x) + 0.1) if np_mode else (x.abs() + 0.1).sqrt()
  if name == "square": return x * x
  if name == "bcast":  # + a constant broadcast along every axis but one
    c = _const(tuple(n if i == p["axis"] else 1 for i, n in enumerate(shape)), salt)
    return x + C(c)
  if name == "where": return np.where(x > 0, x, x * 0.1) if np_mode else (x > 0).where(x, x * 0.1)
  if name in ("sum", "max", "mean"):
    if len(shape) == 1 and not p.get("keep"): p = {**p, "keep": True}
    return getattr(x, name)(axis=p["axis"], keepdims=p["keep"]) if np_mode else getattr(x, name)(p["axis"], keepdims=p["keep"])
  if name in ("softmax", "log_softmax"):
    if not np_mode: return getattr(x, name)(p["axis"])
    s = x - x.max(p["axis"], keepdims=True)
    lse = np.log(np.exp(s).sum(p["axis"], keepdims=True))
    return np.exp(s - lse) if name == "softmax" else s - lse
  if name == "layernorm":
    if not np_mode: return x.layernorm()
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)
  if name == "permute": return x.transpose(p["order"]) if np_mode else x.permute(*p["order"])
  if name == "reshape": return x.reshape(*shape[:-2], shape[-2] * shape[-1])
  if name == "expand":
    to = tuple(3 if n == 1 else n for n in shape)
    return np.broadcast_to(x, to) if np_mode else x.expand(*to)
  if name == "slice":
    a, st_, sp, step = p["axis"], p["start"], p["stop"], p["step"]
    key = tuple(slice(st_, sp, step) if i == a else slice(None) for i in range(len(shape)))
    return x[key]
  if name == "pad":
    pads = tuple((p["before"], p["after"]) if i == p["axis"] else (0, 0) for i in range(len(shape)))
    return np.pad(x, pads) if np_mode else x.pad(pads)
  if name == "cat": return np.concatenate([x, x * 2], p["axis"]) if np_mode else Tensor.cat([x, x * 2], p["axis"])
  if name == "matmul": return x @ C(_const((shape[-1], p["n"]), salt))
  if name == "gather":
    idx = np.asarray(p["idx"], np.int64)
    return np.take(x, idx, 0) if np_mode else x.gather(Tensor(idx), 0)
  if name == "conv":
    o, k, s_, pd = p["o"], min(p["k"], shape[2], shape[3]), p["stride"], p["pad"]
    w = _const((o, shape[1], k, k), salt)
    if not np_mode: return x.conv2d(Tensor(w), stride=s_, padding=pd)
    xp = np.pad(x, ((0, 0), (0, 0), (pd, pd), (pd, pd)))
    oh, ow = (xp.shape[2] - k) // s_ + 1, (xp.shape[3] - k) // s_ + 1
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::s_, ::s_][:, :, :oh, :ow]
    return np.einsum("nchwij,ocij->nohw", win, w.astype(np.float64))
  if name == "pool":
    if not np_mode: return x.max_pool((2, 2))
    n, c, h, w_ = shape
    return x[:, :, :h // 2 * 2, :w_ // 2 * 2].reshape(n, c, h // 2, 2, w_ // 2, 2).max((3, 5))
  raise AssertionError(name)


STEPS = ["relu", "tanh", "sigmoid", "gelu", "exp", "sqrt", "square", "bcast", "where", "sum", "max", "mean", "softmax",
         "log_softmax", "layernorm", "permute", "reshape", "expand", "slice", "pad", "cat", "matmul", "gather", "conv", "pool"]


@st.composite
def programs(draw: Callable) -> Program:
  nd = draw(st.integers(1, 4))
  shape = tuple(draw(st.integers(1, 6)) for _ in range(nd))
  prog = Program(shape, draw(st.integers(0, 2**31 - 1)))
  cur = np.zeros(shape)
  for _ in range(draw(st.integers(1, 7))):
    name = draw(st.sampled_from([s for s in STEPS if _fits(s, cur.shape)]))
    p = _params(draw, name, cur.shape)
    nxt = _apply(name, p, cur, True, 0)
    if nxt.size == 0 or nxt.size > 4096 or nxt.ndim == 0: continue  # keep programs small and non-empty
    prog.steps.append((name, p))
    cur = nxt
  return prog


def check_program(prog: Program) -> str | None:
  """None when fused and unfused kiln plans match numpy; else what differed."""
  from kiln.graph.tensor import Tensor, compile
  x = np.random.default_rng(prog.seed).uniform(-2, 2, prog.shape).astype(np.float32)
  ref: Any = x.astype(np.float64)
  t = Tensor(x)
  for i, (name, p) in enumerate(prog.steps):
    ref, t = _apply(name, p, ref, True, i), _apply(name, p, t, False, i)
  scale = max(1.0, float(np.abs(ref).max()))
  for fuse in (True, False):
    got = compile([t], fuse=fuse).run()[0]
    if got.shape != ref.shape: return f"fuse={fuse}: shape {got.shape}, numpy {ref.shape}"
    if not np.allclose(got, ref, rtol=TOL, atol=TOL * scale, equal_nan=True):
      err = float(np.nanmax(np.abs(got - ref)))
      return f"fuse={fuse}: max |kiln - numpy| = {err:.3g} (scale {scale:.3g})"
  return None


# ---- random ONNX graphs against onnxruntime ----
ONNX_OPS = ["Relu", "Tanh", "Sigmoid", "Erf", "Abs", "Neg", "Add", "Mul", "Sub", "Softmax", "ReduceMean", "ReduceMax", "Transpose",
            "MatMul", "LayerNormalization", "Concat", "Slice", "Where", "Unsqueeze",
            # continuous ones only (a Floor or Sign after a last-bit difference upstream would differ by a whole step)
            "LeakyRelu", "Elu", "Softplus", "HardSwish", "Mish", "Cos", "Softsign", "HardSigmoid", "ReduceLogSumExp", "ReduceL2", "CumSum",
            "Trilu"]
REDUCES = ("ReduceMean", "ReduceMax", "ReduceLogSumExp", "ReduceL2")  # axes as an input (opset 18), keepdims drawn


@st.composite
def onnx_chains(draw: Callable) -> tuple[tuple[int, ...], int, list[tuple[str, dict[str, Any]]]]:
  nd = draw(st.integers(2, 3))
  shape = tuple(draw(st.integers(1, 5)) for _ in range(nd))
  steps = []
  cur = list(shape)
  for _ in range(draw(st.integers(1, 6))):
    op = draw(st.sampled_from(ONNX_OPS))
    p: dict[str, Any] = {}
    if op in ("Softmax", "Concat", "CumSum", *REDUCES): p["axis"] = draw(st.integers(-len(cur), len(cur) - 1))
    if op in REDUCES: p["keep"] = draw(st.booleans()) or len(cur) <= 1
    if op == "Trilu":
      if len(cur) < 2: continue
      p["upper"], p["k"] = draw(st.integers(0, 1)), draw(st.integers(-3, 3))
    if op == "Transpose": p["perm"] = draw(st.permutations(range(len(cur))))
    if op == "MatMul": p["n"] = draw(st.integers(1, 5))
    if op == "Slice":
      p["axis"] = draw(st.integers(0, len(cur) - 1))
      p["start"] = draw(st.integers(0, cur[p["axis"]] - 1))
    if op == "Unsqueeze":
      if len(cur) >= 4: continue
      p["axis"] = draw(st.integers(0, len(cur)))
    cur = _onnx_shape(op, p, cur)
    if not cur or math.prod(cur) > 2048: break
    steps.append((op, p))
  return shape, draw(st.integers(0, 2**31 - 1)), steps


def _onnx_shape(op: str, p: dict[str, Any], s: list[int]) -> list[int]:
  if op in REDUCES:
    a = p["axis"] % len(s)
    return [1 if i == a else n for i, n in enumerate(s)] if p["keep"] else [n for i, n in enumerate(s) if i != a]
  if op == "Transpose": return [s[i] for i in p["perm"]]
  if op == "MatMul": return [*s[:-1], p["n"]]
  if op == "Concat":
    a = p["axis"] % len(s)
    return [n * 2 if i == a else n for i, n in enumerate(s)]
  if op == "Slice": return [n - p["start"] if i == p["axis"] else n for i, n in enumerate(s)]
  if op == "Unsqueeze": return [*s[:p["axis"]], 1, *s[p["axis"]:]]
  return s


def onnx_model(shape: tuple[int, ...], steps: list[tuple[str, dict[str, Any]]]) -> Any:
  """The chain as an ONNX model (opset 18: ReduceMean/ReduceMax take their axes as an input)."""
  from onnx import TensorProto, helper, numpy_helper
  nodes, inits, cur, shp = [], [], "x", list(shape)

  def const(name: str, value: np.ndarray) -> str:
    inits.append(numpy_helper.from_array(value, name))
    return name
  for i, (op, p) in enumerate(steps):
    out, ins, attrs = f"t{i}", [cur], {}
    if op in ("Add", "Mul", "Sub"):
      c = _const(tuple(shp[-1:]), i)
      inits.append(numpy_helper.from_array(c, f"c{i}")); ins.append(f"c{i}")
    elif op == "Softmax": attrs["axis"] = p["axis"]
    elif op in REDUCES:
      inits.append(numpy_helper.from_array(np.asarray([p["axis"]], np.int64), f"a{i}")); ins.append(f"a{i}"); attrs["keepdims"] = int(p["keep"])
    elif op == "Transpose": attrs["perm"] = list(p["perm"])
    elif op == "MatMul":
      inits.append(numpy_helper.from_array(_const((shp[-1], p["n"]), i), f"w{i}")); ins.append(f"w{i}")
    elif op == "LayerNormalization":
      ins += [const(f"{nm}{i}", np.full(shp[-1:], v, np.float32)) for nm, v in (("g", 1.0), ("b", 0.0))]
    elif op == "Concat": ins = [cur, cur]; attrs["axis"] = p["axis"]
    elif op == "Slice":
      ins += [const(f"{nm}{i}", np.asarray([v], np.int64)) for nm, v in (("s", p["start"]), ("e", 2**62), ("ax", p["axis"]))]
    elif op == "Where":
      nodes.append(helper.make_node("Greater", [cur, f"z{i}"], [f"m{i}"]))
      inits.append(numpy_helper.from_array(np.zeros((), np.float32), f"z{i}"))
      nodes.append(helper.make_node("Mul", [cur, f"z{i}h"], [f"h{i}"]))
      inits.append(numpy_helper.from_array(np.asarray(0.25, np.float32), f"z{i}h"))
      ins = [f"m{i}", cur, f"h{i}"]
    elif op == "Unsqueeze":
      inits.append(numpy_helper.from_array(np.asarray([p["axis"]], np.int64), f"u{i}")); ins.append(f"u{i}")
    elif op == "CumSum": ins.append(const(f"cs{i}", np.asarray(p["axis"], np.int64)))
    elif op == "Trilu": ins.append(const(f"k{i}", np.asarray(p["k"], np.int64))); attrs["upper"] = p["upper"]
    nodes.append(helper.make_node(op, ins, [out], **attrs))
    cur, shp = out, _onnx_shape(op, p, shp)
  g = helper.make_graph(nodes, "fuzz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, shp)], inits)
  return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def check_onnx(shape: tuple[int, ...], seed: int, steps: list[tuple[str, dict[str, Any]]]) -> str | None:
  """None when kiln.graph.onnx matches onnxruntime on the chain; else what differed."""
  import onnxruntime as ort

  from kiln.graph import onnx as konnx
  if not steps: return None
  model = onnx_model(shape, steps)
  x = np.random.default_rng(seed).uniform(-2, 2, shape).astype(np.float32)
  so = ort.SessionOptions()
  so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  want = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  got = list(konnx.load(model).run({"x": x}).values())[0]
  scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
  if got.shape != want.shape: return f"shape {got.shape}, onnxruntime {want.shape}"
  if not np.allclose(got, want, rtol=TOL, atol=TOL * scale, equal_nan=True): return f"max |kiln - ort| = {float(np.nanmax(np.abs(got - want))):.3g}"
  return None
