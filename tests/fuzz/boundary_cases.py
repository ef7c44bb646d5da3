"""Reductions over element counts at the 32-bit boundaries: 2**31 - 1, 2**31, 2**31 + k and 2**32 + k elements.

Nothing that large is ever stored. A case grows a small fed input into the big tensor with ops that fuse into the
reduction (Expand, Tile, a broadcast Add of two small inputs, a Concat of a small tail, a Pad with a constant), then
ReduceSum, ReduceMax or ReduceMin over every axis or one (keepdims drawn), so the plan is one kernel reading a few bytes
and looping 2**31 or more times. The kept axis of a one-axis reduction is always small, so the output is too.

The expected value is exact and comes from the small sources in numpy (`expected`): a sum is the sources' sums times how
often each is repeated (int64 exactly, int32 wrapped as ONNX's two's-complement sum wraps, float64 exactly because the
values are small integers), a max or min is the sources' own. float32 sums are not drawn: a float32 sum of 2**31 terms
depends on the order it is summed in, so no exact answer exists to check. The tail and the pad hold a marker beyond the
source's range, so a max or min must reach the very last elements. Each case first runs its small twin (the same graph
with a few hundred elements) against onnxruntime and against `expected`, so the formula is checked where it can be.

A case runs in a child process (`check`): a kernel whose 32-bit index wraps may loop forever or fault on a guard page,
and the child's timeout or signal is then the case's failure, not the fuzzer's end. These cases need 64-bit index
arithmetic in codegen (issue 41 item 2, 3fa34f1): before it, every case with an axis of 2**31 or more, and 2**31 - 1
in one axis, was a CodegenError (and before that refusal, the starting value)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

oracle = importlib.import_module(f"{__package__}.onnx_oracle" if __package__ else "onnx_oracle")  # in tests.fuzz, or beside the script

TARGETS = {"2^31-1": 2**31 - 1, "2^31": 2**31, "2^31+k": 2**31, "2^32+k": 2**32}  # +k: a few more, drawn
GROW = ["expand1", "tile1", "concat1", "pad1", "expand2", "expand2t", "tile2", "bcast2"]
BCAST = {"2^31": [(2**15, 2**16), (2**16, 2**15)], "2^31+k": [(46341, 46341), (2**16, 2**15 + 1)],  # 2**31 + 4633, + 2**16
         "2^32+k": [(2**16 + 1, 2**16), (65537, 65537)]}  # 2**32 + 2**16, + 2**17 + 1: sources of at most 65537 elements
SMALL = 1 << 16  # a kept axis (the output) and every source at most this long


def _divisors(n: int, hi: int) -> list[int]: return [d for d in range(1, hi + 1) if n % d == 0]


@st.composite
def cases(draw: Callable) -> dict[str, Any]:
  target = draw(st.sampled_from(sorted(TARGETS)))
  n = TARGETS[target] + (draw(st.integers(1, 64)) if target.endswith("+k") else 0)
  grow = draw(st.sampled_from([g for g in GROW if g != "bcast2" or target in BCAST]))
  dtype = draw(st.sampled_from(["float32", "float64", "int32", "int64"]))
  op = draw(st.sampled_from(["ReduceMax", "ReduceMin"] + (["ReduceSum"] if dtype != "float32" else [])))
  c: dict[str, Any] = {"target": target, "grow": grow, "dtype": dtype, "op": op, "keep": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1))}
  if grow == "expand1": c["R"] = n
  elif grow == "tile1": c["c"] = draw(st.sampled_from(_divisors(n, 8))); c["R"] = n // c["c"]
  elif grow in ("concat1", "pad1"):
    c["c"] = draw(st.integers(1, 8))
    c["k"] = (n - 1) % c["c"] + 1 + c["c"] * draw(st.integers(0, 1))  # n - k is a multiple of c: exactly n elements
    c["R"] = (n - c["k"]) // c["c"]
  elif grow in ("expand2", "expand2t"):
    small = draw(st.sampled_from(_divisors(n, 64)))
    c["R"], c["C"] = (n // small, small) if grow == "expand2" else (small, n // small)
  elif grow == "tile2":
    c["r"] = draw(st.sampled_from(_divisors(n, 4)))
    c["C"] = draw(st.sampled_from(_divisors(n // c["r"], 8)))
    c["R"] = n // (c["r"] * c["C"])
  else: c["R"], c["C"] = draw(st.sampled_from(BCAST[target]))
  c["axes"] = draw(st.sampled_from(_axes(c)))
  return c


def _rank(c: dict[str, Any]) -> int: return 1 if c["grow"].endswith("1") else 2


def shape(c: dict[str, Any]) -> list[int]:
  """The big tensor's shape."""
  g = c["grow"]
  if g == "expand1": return [c["R"]]
  if g == "tile1": return [c["R"] * c["c"]]
  if g in ("concat1", "pad1"): return [c["R"] * c["c"] + c["k"]]
  if g == "tile2": return [c["R"] * c["r"], c["C"]]
  return [c["R"], c["C"]]


def _axes(c: dict[str, Any]) -> list[str]:
  """'all', or one axis whose kept other axis is small (the output stays small)."""
  if _rank(c) == 1: return ["all"]
  s = shape(c)
  return ["all"] + [str(a) for a in (0, 1) if s[1 - a] <= SMALL]


def sources(c: dict[str, Any]) -> dict[str, np.ndarray]:
  """The fed inputs: small integers (exact in every dtype and every sum), and the tail's marker past their range."""
  rng, dt, g = np.random.default_rng(c["seed"]), np.dtype(c["dtype"]), c["grow"]
  ints = lambda *s: rng.integers(-8, 9, s).astype(dt)  # noqa: E731
  if g == "expand1": return {"x": ints(1)}
  if g in ("tile1", "concat1", "pad1"):
    feeds = {"x": ints(c["c"])}
    if g == "concat1":
      t = ints(c["k"])
      t[-1] = _marker(c)
      feeds["t"] = t
    return feeds
  if g == "expand2": return {"x": ints(1, c["C"])}
  if g == "expand2t": return {"x": ints(c["R"], 1)}
  if g == "tile2": return {"x": ints(c["r"], c["C"])}
  return {"x": ints(c["R"], 1), "y": ints(1, c["C"])}


def _marker(c: dict[str, Any]) -> int: return {"ReduceMax": 9 + c["seed"] % 5, "ReduceMin": -9 - c["seed"] % 5}.get(c["op"], 3)


def build(c: dict[str, Any]) -> Any:
  from onnx import helper, numpy_helper
  tp = helper.np_dtype_to_tensor_dtype(np.dtype(c["dtype"]))
  feeds, g, i64 = sources(c), c["grow"], lambda v, nm: numpy_helper.from_array(np.asarray(v, np.int64), nm)
  inits, nodes = [], []
  if g in ("expand1", "expand2", "expand2t"):
    inits.append(i64(shape(c), "shape")); nodes.append(helper.make_node("Expand", ["x", "shape"], ["big"]))
  elif g == "bcast2": nodes.append(helper.make_node("Add", ["x", "y"], ["big"]))
  else:
    inits.append(i64([c["R"], 1] if g == "tile2" else [c["R"]], "reps"))
    nodes.append(helper.make_node("Tile", ["x", "reps"], ["big" if g in ("tile1", "tile2") else "base"]))
    if g == "concat1": nodes.append(helper.make_node("Concat", ["base", "t"], ["big"], axis=0))
    if g == "pad1":
      inits += [i64([0, c["k"]], "pads"), numpy_helper.from_array(np.asarray(_marker(c), c["dtype"]), "value")]
      nodes.append(helper.make_node("Pad", ["base", "pads", "value"], ["big"]))
  axes = list(range(_rank(c))) if c["axes"] == "all" else [int(c["axes"])]
  inits.append(i64(axes, "axes"))
  nodes.append(helper.make_node(c["op"], ["big", "axes"], ["y_out"], keepdims=int(c["keep"])))
  out = [1 if a in axes else n for a, n in enumerate(shape(c))] if c["keep"] else [n for a, n in enumerate(shape(c)) if a not in axes]
  ins = [helper.make_tensor_value_info(k, tp, list(v.shape)) for k, v in feeds.items()]
  return oracle.make_model(nodes, ins, [helper.make_tensor_value_info("y_out", tp, out)], inits)


def expected(c: dict[str, Any]) -> np.ndarray:
  """The exact answer from the small sources alone (Python ints): the big tensor is a source S tiled (tr, tc) times, or
  x[i] + y[j] for bcast2, so a sum is S's sums times the repeats and a max or min is S's own."""
  f, g, op = {k: v.astype(object) for k, v in sources(c).items()}, c["grow"], c["op"]
  sum_ = op == "ReduceSum"
  red = (lambda a, ax: a.sum(ax)) if sum_ else (lambda a, ax: a.max(ax)) if op == "ReduceMax" else (lambda a, ax: a.min(ax))
  if g == "bcast2":
    x, y, R, C = f["x"][:, 0], f["y"][0], c["R"], c["C"]
    if c["axes"] == "all": v = red(x, 0) * C + red(y, 0) * R if sum_ else red(x, 0) + red(y, 0)
    elif c["axes"] == "0": v = red(x, 0) + (y * R if sum_ else y)
    else: v = (x * C if sum_ else x) + red(y, 0)
  else:
    S = f["x"].reshape(-1, 1) if _rank(c) == 1 else f["x"]
    tr, tc = (c["R"], 1) if g not in ("expand2t",) else (1, c["C"])
    times = tr * tc if sum_ else 1
    if c["axes"] == "all":
      v = red(S.reshape(-1), 0) * times
      tail = f["t"] if g == "concat1" else np.full(c["k"], _marker(c), object) if g == "pad1" else None
      if tail is not None: v = v + tail.sum() if sum_ else red(np.asarray([v, red(tail, 0)], object), 0)
    elif c["axes"] == "0": v = np.tile(red(S, 0) * (tr if sum_ else 1), tc)
    else: v = np.tile(red(S, 1) * (tc if sum_ else 1), tr)
  out = np.asarray(v).astype(np.int64 if c["dtype"].startswith("int") else np.float64).astype(c["dtype"])  # int32 wraps as its sum does
  if c["keep"]: out = out.reshape([1 if c["axes"] in ("all", str(a)) else n for a, n in enumerate(shape(c))])
  return out


def twin(c: dict[str, Any]) -> dict[str, Any]:
  """The same graph with a few hundred elements: onnxruntime can run it."""
  if c["grow"] == "bcast2": return {**c, "R": 13, "C": 11}
  if c["grow"] == "expand2t": return {**c, "C": min(c["C"], 29)}
  return {**c, "R": min(c["R"], 37)}


def check_small(c: dict[str, Any], guard: bool = True) -> str | None:
  """The case's small twin: onnxruntime, `expected` and kiln must agree (the formula checked where ort can run it)."""
  from kiln.graph import onnx as konnx
  small = twin(c)
  want, why = oracle.ort_run(build(small), sources(small))
  if want is None: return f"onnxruntime refused the small twin ({why}): the case is malformed"
  if msg := oracle.same(expected(small), want[0]): return f"the expected-value formula disagrees with onnxruntime on the small twin: {msg}"
  with oracle.guarded(guard): got = konnx.load(build(small)).run(sources(small))["y_out"]
  return (msg := oracle.same(got, want[0])) and f"small twin: {msg}" or None


def check_here(c: dict[str, Any], guard: bool = True) -> str | None:
  """check_small, then the case itself against `expected`, in this process."""
  from kiln.graph import onnx as konnx
  if msg := check_small(c, guard): return msg
  with oracle.guarded(guard): got = konnx.load(build(c)).run(sources(c))["y_out"]
  return (msg := oracle.same(got, expected(c))) and f"{int(np.prod(shape(c)))} elements: {msg}" or None


def timeout_s(c: dict[str, Any]) -> float: return 60 + int(np.prod(shape(c))) / 2**24  # 2**31: ~3 minutes, 2**32: ~5 (some take 80 s)


def check(c: dict[str, Any], guard: bool = True) -> str | None:
  """check_here in a child process: a hang is a timeout and a guard-page fault a signal, each this case's failure."""
  env = {**os.environ, "KILN_GUARD": "1" if guard else "0"}
  cmd = [sys.executable, os.path.abspath(__file__), json.dumps(c), "1" if guard else "0"]
  try: p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s(c), env=env)
  except subprocess.TimeoutExpired: return f"no answer after {timeout_s(c):.0f} s (a wrapped loop counter runs forever?)"
  if p.returncode < 0: return f"the case died of signal {-p.returncode} (a guard page fault?): {p.stderr[-1500:]}"
  if p.returncode != 0 or not p.stdout.strip(): return f"exit {p.returncode}: {p.stderr[-3000:]}"
  got = json.loads(p.stdout.strip().splitlines()[-1])
  return None if got is None else str(got)


if __name__ == "__main__":
  try: msg = check_here(json.loads(sys.argv[1]), sys.argv[2] == "1")
  except Exception as e: msg = f"{type(e).__name__}: {str(e)[:800]}"
  print(json.dumps(msg))
