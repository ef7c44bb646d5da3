"""The benchmark's model rows (issue 14): softmax, layernorm, exp and GELU as one kernel each, and a post-LN transformer encoder
layer (BERT/MiniLM shape) as one ExecutionPlan, each checked against numpy, then timed with numpy, torch and onnxruntime in
the same interleaved rounds (Bench.time_row)."""
from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.ir import AxisType, Ops, UOp, kernels
from kiln_bench.bench import Bench, Peer
from kiln_bench.harness import F32, GB, WrongResult, aligned_empty, check, kiln_call
from kiln_bench.peers import ort_session
from kiln_bench.table import Row, rate

LOG2E, RSQRT2, EPS = 1 / math.log(2), 1 / math.sqrt(2), 1e-5


# ---- kernels built by hand (kiln.ir.kernels has no layernorm, linear or attention) ----

def _g(slot: int, n: int) -> UOp: return UOp.define_global(slot, F32.ptr(n))
def gelu(y: UOp) -> UOp: return y * 0.5 * ((y * RSQRT2).erf() + 1.0)  # exact GELU (torch's default), through Ops.ERF


def layernorm_kernel(m: int, n: int) -> UOp:
  """out[i, :] = (x[i, :] - mean) / sqrt(var + eps) * gamma + beta, the variance taken around the mean: one kernel, two
  nested REDUCEs. Slots: 0 out, 1 x (m, n), 2 gamma (n), 3 beta (n)."""
  out, x, g, b = _g(0, m * n), _g(1, m * n), _g(2, n), _g(3, n)
  i, j, r1, r2 = UOp.range(m, 0), UOp.range(n, 1), UOp.range(n, 2, AxisType.REDUCE), UOp.range(n, 3, AxisType.REDUCE)
  mean = x.index(i * n + r1).load().reduce(Ops.ADD, r1) * (1 / n)
  d = x.index(i * n + r2).load() - mean
  rstd = ((d * d).reduce(Ops.ADD, r2) * (1 / n) + EPS).sqrt().reciprocal()
  y = (x.index(i * n + j).load() - mean) * rstd * g.index(j).load() + b.index(j).load()
  return UOp.sink(out.index(i * n + j).store(y), name="layernorm")


def linear_kernel(m: int, k: int, n: int, act: bool = False, residual: bool = False, name: str = "linear") -> UOp:
  """out[m, n] = x[m, k] @ w[k, n] + b[n] (then GELU, or + res[m, n]). Slots: 0 out, 1 x, 2 w, 3 b, 4 res."""
  out, x, w, b = _g(0, m * n), _g(1, m * k), _g(2, k * n), _g(3, n)
  i, j, r = UOp.range(m, 0), UOp.range(n, 1), UOp.range(k, 2, AxisType.REDUCE)
  y = (x.index(i * k + r).load() * w.index(r * n + j).load()).reduce(Ops.ADD, r) + b.index(j).load()
  if residual: y = y + _g(4, m * n).index(i * n + j).load()
  return UOp.sink(out.index(i * n + j).store(gelu(y) if act else y), name=name)


def scores_kernel(bs: int, s: int, hid: int, heads: int) -> UOp:
  """s[b, h, i, j] = scale * q[b, i, h, :] . k[b, j, h, :], q and k read in place from the qkv projection (rows of
  [q | k | v], 3 * hid wide). Slots: 0 scores (bs, heads, s, s), 1 qkv (bs * s, 3 * hid)."""
  dh, w = hid // heads, 3 * hid
  out, qkv = _g(0, bs * heads * s * s), _g(1, bs * s * w)
  b, h, i, j, d = UOp.range(bs, 0), UOp.range(heads, 1), UOp.range(s, 2), UOp.range(s, 3), UOp.range(dh, 4, AxisType.REDUCE)
  q = qkv.index((b * s + i) * w + h * dh + d).load()
  k = qkv.index((b * s + j) * w + hid + h * dh + d).load()
  return UOp.sink(out.index(((b * heads + h) * s + i) * s + j).store((q * k).reduce(Ops.ADD, d) * (1 / math.sqrt(dh))), name="attn_scores")


def context_kernel(bs: int, s: int, hid: int, heads: int) -> UOp:
  """ctx[b, i, h, e] = sum_j p[b, h, i, j] * v[b, j, h, e], v read in place from qkv; ctx is (bs * s, hid), heads side by side.
  Slots: 0 ctx, 1 p (bs, heads, s, s), 2 qkv."""
  dh, w = hid // heads, 3 * hid
  out, p, qkv = _g(0, bs * s * hid), _g(1, bs * heads * s * s), _g(2, bs * s * w)
  b, i, h, e, j = UOp.range(bs, 0), UOp.range(s, 1), UOp.range(heads, 2), UOp.range(dh, 3), UOp.range(s, 4, AxisType.REDUCE)
  pv = p.index(((b * heads + h) * s + i) * s + j).load() * qkv.index((b * s + j) * w + 2 * hid + h * dh + e).load()
  return UOp.sink(out.index((b * s + i) * hid + h * dh + e).store(pv.reduce(Ops.ADD, j)), name="attn_context")


# ---- numpy versions: float32 for the numpy column, float64 for the checks ----

def np_softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
  mu = x.mean(-1, keepdims=True)
  d = x - mu
  return d / np.sqrt((d * d).mean(-1, keepdims=True) + EPS) * g + b


def np_gelu(x: np.ndarray) -> np.ndarray:
  from math import erf
  return 0.5 * x * (1 + np.vectorize(erf, otypes=[np.float64])(x.astype(np.float64) * RSQRT2)).astype(x.dtype)


def np_layer(x: np.ndarray, w: dict[str, np.ndarray], bs: int, s: int, heads: int, gelu_fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
  """The encoder layer in numpy, in x's dtype: x (bs * s, hid), weights as kiln takes them (in x out)."""
  hid = x.shape[1]
  dh = hid // heads
  qkv = (x @ w["wqkv"] + w["bqkv"]).reshape(bs, s, 3, heads, dh).transpose(2, 0, 3, 1, 4)  # (3, bs, heads, s, dh)
  p = np_softmax(qkv[0] @ qkv[1].transpose(0, 1, 3, 2) / np.sqrt(dh).astype(x.dtype))
  ctx = (p @ qkv[2]).transpose(0, 2, 1, 3).reshape(bs * s, hid)
  h1 = np_layernorm(ctx @ w["wo"] + w["bo"] + x, w["g1"], w["be1"])
  return np_layernorm(gelu_fn(h1 @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"] + h1, w["g2"], w["be2"])


# ---- rows ----

def _vs_torch(fn: Callable[[], Any], want: np.ndarray, name: str, **tol: float) -> dict[str, Peer]:
  """torch as a peer of the row (Bench.time_row): its call, and the check of its answer."""
  return {"torch": (fn, lambda o: check(f"torch {name}", o.numpy(), want, **tol))}


def _bytes_row(b: Bench, r: Row, nbytes: int, targets: list[tuple[str, float]]) -> None:
  r.ratio = r.paired("numpy") if r.numpy else None
  r.achieved, r.frac = rate(nbytes / r.kiln, "GB/s", b.bw), nbytes / r.kiln / b.bw  # type: ignore[operator]
  r.limit = f"{b.bw / GB:.1f} GB/s read"
  r.checks = targets
  r.target = " and ".join(">= torch" if k == "torch" and v == 1 else f">= {v:g}x {k}" if k != "limit" else f">= {v:.0%} limit" for k, v in targets)
  if b.peers.torch is None:
    why = "only the limit target is judged" if len(targets) > 1 else "target not judged"
    r.note = (r.note + "; " if r.note else "") + f"torch not installed: {why}"


def softmax(b: Bench, r: Row, rows: int, n: int) -> None:
  m = b.size(rows, 8)
  r.work = f"softmax {m}x{n} float32, 1 kernel"
  x = (b.rng.standard_normal((m, n)) * 3).astype(np.float32)
  out = np.empty_like(x)
  k = kiln_call(kernels.softmax((m, n), F32), [out, x])
  want = np_softmax(x.astype(np.float64))
  k()
  check("softmax", out, want, rtol=1e-5, atol=1e-7)
  peers: dict[str, Peer] = {}
  if b.peers.torch is not None:
    torch = b.peers.torch
    tx, to = torch.from_numpy(x), torch.empty(m, n)
    peers = _vs_torch(lambda: torch.ops.aten._softmax.out(tx, -1, False, out=to), want, "softmax", rtol=1e-5, atol=1e-7)
  b.time_row(r, {"kiln": k, "numpy": lambda: np_softmax(x)}, peers)
  _bytes_row(b, r, 8 * m * n, [("torch", 1.0), ("limit", 0.7)])


def layernorm(b: Bench, r: Row, n: int, rows: int = 8192) -> None:
  m = b.size(rows, 8)
  r.work = f"layernorm {m}x{n} float32, 1 kernel"
  x = (b.rng.standard_normal((m, n)) * 2 + 0.5).astype(np.float32)
  g, be = (b.rng.standard_normal(n) * 0.5 + 1).astype(np.float32), (b.rng.standard_normal(n) * 0.1).astype(np.float32)
  out = np.empty_like(x)
  k = kiln_call(layernorm_kernel(m, n), [out, x, g, be])
  want = np_layernorm(x.astype(np.float64), g, be)
  k()
  check("layernorm", out, want, rtol=1e-4, atol=1e-5)
  peers: dict[str, Peer] = {}
  if b.peers.torch is not None:
    torch = b.peers.torch
    tx, tg, tb = torch.from_numpy(x), torch.from_numpy(g), torch.from_numpy(be)
    peers = _vs_torch(lambda: torch.nn.functional.layer_norm(tx, (n,), tg, tb, EPS), want, "layernorm", rtol=1e-4, atol=1e-5)
  b.time_row(r, {"kiln": k, "numpy": lambda: np_layernorm(x, g, be)}, peers)
  _bytes_row(b, r, 8 * m * n, [("torch", 1.0), ("limit", 0.7)])


def unary(b: Bench, r: Row, which: str) -> None:
  n = b.size(1 << 22, 1 << 10)
  r.work = f"{which} {n / (1 << 20):.3g}M float32"
  x = aligned_empty(n)
  x[:] = (b.rng.standard_normal(n) * 3).astype(np.float32)
  out = aligned_empty(n)
  fn = (lambda v: (v * LOG2E).exp2()) if which == "exp" else gelu
  k = kiln_call(kernels.elementwise(fn, F32, ((n,), F32), name=f"bench_{which}"), [out, x])
  x64 = x.astype(np.float64)
  want = np.exp(x64) if which == "exp" else np_gelu(x64)
  tol = {"rtol": 1e-5, "atol": 1e-30} if which == "exp" else {"rtol": 1e-5, "atol": 1e-5}  # torch's GELU is off by 1.2e-6 near 0
  k()
  check(which, out, want, **tol)
  on = aligned_empty(n)
  mine: dict[str, Callable[[], Any]] = {"kiln": k}
  if which == "exp": mine["numpy"] = lambda: np.exp(x, out=on)  # numpy has no erf: no numpy column for GELU
  peers: dict[str, Peer] = {}
  if b.peers.torch is not None:
    torch = b.peers.torch
    tx, to = torch.from_numpy(x), torch.empty(n)
    tf = (lambda: torch.exp(tx, out=to)) if which == "exp" else (lambda: torch.ops.aten.gelu.out(tx, approximate="none", out=to))
    peers = _vs_torch(tf, want, which, **tol)
  b.time_row(r, mine, peers)
  _bytes_row(b, r, 8 * n, [("torch", 1.0)])
  r.note = (r.note + "; " if r.note else "") + ("exp2(x * log2 e)" if which == "exp" else "exact GELU 0.5x(1 + erf(x/sqrt 2)) through UOp.erf")


def _layer_weights(rng: np.random.Generator, hid: int, ffn: int) -> dict[str, np.ndarray]:
  def m(a: int, c: int) -> np.ndarray: return (rng.standard_normal((a, c)) / math.sqrt(a)).astype(np.float32)
  def v(c: int, s: float = 0.02, mu: float = 0.0) -> np.ndarray: return (rng.standard_normal(c) * s + mu).astype(np.float32)
  return {"wqkv": m(hid, 3 * hid), "bqkv": v(3 * hid), "wo": m(hid, hid), "bo": v(hid), "g1": v(hid, 0.1, 1.0), "be1": v(hid),
          "w1": m(hid, ffn), "b1": v(ffn), "w2": m(ffn, hid), "b2": v(hid), "g2": v(hid, 0.1, 1.0), "be2": v(hid)}


def layer_plan(x: np.ndarray, w: dict[str, np.ndarray], bs: int, s: int, heads: int) -> Any:
  """The encoder layer as one ExecutionPlan of 9 kernels: qkv projection, scores, softmax, context, output projection +
  residual, layernorm, FFN up + GELU, FFN down + residual, layernorm."""
  from kiln.executor import Buffer, ExecutionPlanBuilder
  m, hid = x.shape
  ffn = w["w1"].shape[1]
  pb = ExecutionPlanBuilder("CPU")
  ids = {k: pb.add_buffer(Buffer.from_numpy(v)) for k, v in w.items()}
  def buf(n: int) -> int: return pb.add_buffer(Buffer("CPU", n, F32))
  xi, qkv, sc, p, ctx = pb.add_buffer(Buffer.from_numpy(x)), buf(m * 3 * hid), buf(bs * heads * s * s), buf(bs * heads * s * s), buf(m * hid)
  y1, h1, f, y2, out = buf(m * hid), buf(m * hid), buf(m * ffn), buf(m * hid), buf(m * hid)
  pb.add_kernel(linear_kernel(m, hid, 3 * hid, name="qkv"), [qkv, xi, ids["wqkv"], ids["bqkv"]])
  pb.add_kernel(scores_kernel(bs, s, hid, heads), [sc, qkv])
  pb.add_kernel(kernels.softmax((bs * heads * s, s), F32), [p, sc])
  pb.add_kernel(context_kernel(bs, s, hid, heads), [ctx, p, qkv])
  pb.add_kernel(linear_kernel(m, hid, hid, residual=True, name="attn_out"), [y1, ctx, ids["wo"], ids["bo"], xi])
  pb.add_kernel(layernorm_kernel(m, hid), [h1, y1, ids["g1"], ids["be1"]])
  pb.add_kernel(linear_kernel(m, hid, ffn, act=True, name="ffn_up_gelu"), [f, h1, ids["w1"], ids["b1"]])
  pb.add_kernel(linear_kernel(m, ffn, hid, residual=True, name="ffn_down"), [y2, f, ids["w2"], ids["b2"], h1])
  pb.add_kernel(layernorm_kernel(m, hid), [out, y2, ids["g2"], ids["be2"]])
  pb.set_outputs([out])
  return pb.build()


def _torch_layer(torch: Any, w: dict[str, np.ndarray], hid: int, heads: int, ffn: int) -> tuple[Any, Any]:
  """(torch.nn.TransformerEncoderLayer with these weights, for the torch column: its fused inference path; the same layer
  in plain functional torch, for the ONNX export: the stock layer's fused attention does not export with torch's
  TorchScript exporter, and the dynamo exporter needs onnxscript)."""
  nn, F = torch.nn, torch.nn.functional
  t = {k: torch.from_numpy(v) for k, v in w.items()}
  layer = nn.TransformerEncoderLayer(hid, heads, ffn, dropout=0.0, activation="gelu", batch_first=True, norm_first=False).eval()
  with torch.no_grad():
    layer.self_attn.in_proj_weight.copy_(t["wqkv"].T)
    layer.self_attn.in_proj_bias.copy_(t["bqkv"])
    layer.self_attn.out_proj.weight.copy_(t["wo"].T)
    layer.self_attn.out_proj.bias.copy_(t["bo"])
    for mod, wk, bk in ((layer.linear1, "w1", "b1"), (layer.linear2, "w2", "b2"), (layer.norm1, "g1", "be1"), (layer.norm2, "g2", "be2")):
      mod.weight.copy_(t[wk].T if wk[0] == "w" else t[wk])
      mod.bias.copy_(t[bk])
    for mod in (layer.norm1, layer.norm2): mod.eps = EPS

  class Functional(nn.Module):  # type: ignore[name-defined,misc]
    def forward(self, x: Any) -> Any:
      bs, s, _ = x.shape
      dh = hid // heads
      q, k, v = (x @ t["wqkv"] + t["bqkv"]).reshape(bs, s, 3, heads, dh).permute(2, 0, 3, 1, 4).unbind(0)
      ctx = (torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(dh)), -1) @ v).transpose(1, 2).reshape(bs, s, hid)
      h1 = F.layer_norm(ctx @ t["wo"] + t["bo"] + x, (hid,), t["g1"], t["be1"], EPS)
      return F.layer_norm(F.gelu(h1 @ t["w1"] + t["b1"]) @ t["w2"] + t["b2"] + h1, (hid,), t["g2"], t["be2"], EPS)
  return layer, Functional().eval()


def _layer_case(b: Bench, hid: int, ffn: int, heads: int) -> tuple[int, int, np.ndarray, dict[str, np.ndarray], np.ndarray]:
  """(batch, sequence, x, weights, numpy's float64 answer) of the encoder-layer rows (batch 1 x 16 in the test's tiny run)."""
  bs, s = (1, 16) if b.scale < 0.1 else (8, 128)
  x = b.rng.standard_normal((bs * s, hid)).astype(np.float32)
  w = _layer_weights(b.rng, hid, ffn)
  return bs, s, x, w, np_layer(x.astype(np.float64), {k: v.astype(np.float64) for k, v in w.items()}, bs, s, heads, np_gelu)


def encoder_layer(b: Bench, r: Row, hid: int = 384, heads: int = 12, ffn: int = 1536) -> None:
  bs, s, x, w, want = _layer_case(b, hid, ffn, heads)
  r.work = f"encoder layer h{hid} x{heads} ffn{ffn} s{s} b{bs}"
  m = bs * s
  plan = layer_plan(x, w, bs, s, heads)
  plan.execute()
  tol = {"rtol": 1e-4, "atol": 2e-4}
  check("encoder layer", plan.output_buffer(0).numpy().reshape(m, hid), want, **tol)
  np_gelu32 = lambda v: 0.5 * v * (1 + np.tanh(0.7978845608 * (v + 0.044715 * v ** 3)))  # numpy has no erf: tanh GELU, float32
  torch = b.peers.torch
  peers: dict[str, Peer] = {}
  if torch is not None:
    layer, func = _torch_layer(torch, w, hid, heads, ffn)
    tx = torch.from_numpy(x).reshape(bs, s, hid)
    def run_torch() -> Any:
      with torch.no_grad(): return layer(tx)
    peers["torch"] = (run_torch, lambda o: check("torch encoder layer", o.numpy().reshape(m, hid), want, **tol))
    if b.peers.onnxruntime is not None:
      try:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-onnx-") as d:
          path = os.path.join(d, "layer.onnx")
          with torch.no_grad(): torch.onnx.export(func, (tx,), path, dynamo=False, input_names=["x"], output_names=["y"])
          sess = ort_session(b.peers, path)
        feed = {"x": x.reshape(bs, s, hid)}
        peers["onnxruntime"] = (lambda: sess.run(None, feed)[0], lambda o: check("onnxruntime encoder layer", o.reshape(m, hid), want, **tol))
      except Exception as e:
        r.note += f"{'; ' if r.note else ''}onnxruntime: export failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
  elif b.peers.onnxruntime is not None: r.note += f"{'; ' if r.note else ''}onnxruntime: skipped (the ONNX model is exported from torch)"
  b.time_row(r, {"kiln": plan.execute, "numpy": lambda: np_layer(x, w, bs, s, heads, np_gelu32)}, peers)
  dh = hid // heads
  flops = 2 * m * hid * (3 * hid + hid + 2 * ffn) + 4 * bs * heads * s * s * dh
  r.ratio = r.paired("numpy")
  r.achieved, r.limit = rate(flops / r.kiln, "GFLOP/s", b.peak or None), f"{b.peak / GB:.0f} GFLOP/s FMA" if b.peak else "-"
  r.checks, r.target = [("torch", 1.25), ("onnxruntime", 1.0)], ">= 1.25x torch and >= onnxruntime"
  r.note = (r.note + "; " if r.note else "") + (f"one plan of {len(plan.kernels)} kernels, post-LN, exact GELU; torch: nn.TransformerEncoderLayer; "
                                                "onnxruntime: the same layer in functional torch, exported; numpy column: float32, tanh GELU")
  if torch is None: r.note += "; torch not installed: target not judged"


def encoder_tuned(b: Bench, r: Row, hid: int = 384, heads: int = 12, ffn: int = 1536) -> None:
  """The encoder layer's plan built with KILN_TUNE=1 (every kernel searched within KILN_TUNE_BUDGET, choices kept in a new
  cache directory), timed interleaved with the same plan on the heuristic's options; then built again from that directory,
  which must search nothing (a search there is a WRONG row: the tuning cache failed)."""
  from kiln.executor.tune import tune_stats
  bs, s, x, w, want = _layer_case(b, hid, ffn, heads)
  r.work = f"encoder layer tuned (KILN_TUNE) s{s} b{bs}"
  m = bs * s
  saved = {k: os.environ.get(k) for k in ("KILN_TUNE", "KILN_CACHE_DIR", "KILN_TUNE_BUDGET")}
  budget = "0.3" if b.scale < 0.1 else "1.0"
  try:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-tune-") as d:
      os.environ.update(KILN_TUNE="1", KILN_CACHE_DIR=d, KILN_TUNE_BUDGET=budget)
      st0 = tune_stats()
      t0 = time.perf_counter()
      tuned = layer_plan(x, w, bs, s, heads)
      search_s = time.perf_counter() - t0
      st1 = tune_stats()
      again = layer_plan(x, w, bs, s, heads)
      st2 = tune_stats()
      if st2["searches"] != st1["searches"]:
        raise WrongResult(f"the second build searched {st2['searches'] - st1['searches']} kernels again: the tuning cache did not hold")
      os.environ["KILN_TUNE"] = "0"
      plain = layer_plan(x, w, bs, s, heads)
  finally:
    for k, v in saved.items():
      if v is None: os.environ.pop(k, None)
      else: os.environ[k] = v
  tol = {"rtol": 1e-4, "atol": 2e-4}
  for name, plan in (("tuned", tuned), ("rebuilt", again), ("heuristic", plain)):
    plan.execute()
    check(f"encoder layer ({name})", plan.output_buffer(0).numpy().reshape(m, hid), want, **tol)
  b.time_row(r, {"kiln": tuned.execute, "heuristic": plain.execute})
  changed = sum(1 for a, c in zip(tuned.kernels, plain.kernels) if a.kernel.applied_opts != c.kernel.applied_opts)
  r.achieved = f"{r.paired('heuristic'):.2f}x heuristic ({r.heuristic * 1e3:.1f} ms)"
  r.checks, r.target = [("heuristic", 1.10)], ">= 1.10x the heuristic"
  r.note = (f"{st1['searches'] - st0['searches']} kernels searched in {search_s:.1f} s (KILN_TUNE_BUDGET={budget} s each), "
            f"{st1['timed'] - st0['timed']} candidates timed, {changed} kept other options than the heuristic's; "
            f"second build from the same cache: {st2['searches'] - st1['searches']} searches, {st2['hits'] - st1['hits']} choices reused")


def run(b: Bench) -> None:
  """The model rows, in the order they print."""
  import functools
  for rows, n in ((8192, 128), (1024, 1024)): b.row(f"softmax {rows}x{n}", functools.partial(softmax, b, rows=rows, n=n), "ms")
  for n in (384, 768): b.row(f"layernorm 8192x{n}", functools.partial(layernorm, b, n=n), "ms")
  for which in ("exp", "gelu"): b.row(f"{which} 4M float32", functools.partial(unary, b, which=which), "ms")
  b.row("encoder layer (transformer)", functools.partial(encoder_layer, b), "ms")
  b.row("encoder layer tuned", functools.partial(encoder_tuned, b), "ms")
