"""The benchmark's kiln-graph rows (issue 15): whole ONNX models loaded through kiln.graph.onnx.load and timed beside torch
(the same weights as an nn.Module, inference_mode) and onnxruntime (the same ONNX file), all three in the same interleaved
rounds (Bench.time_row). Models are built with onnx.helper
from numpy weights, so the rows also run where torch is absent; every result (kiln's and each peer's) is checked against a
float64 numpy forward pass before anything is timed.

It imports kiln.graph (and onnx) inside the rows only, so a checkout without them prints the rows as skipped.
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import numpy as np

from kiln_bench.bench import Bench, Peer
from kiln_bench.harness import BENCH_ROOT, GB, MB, check
from kiln_bench.peers import ort_session
from kiln_bench.table import Row

LN_EPS, MASK_NEG = 1e-12, -10000.0
TOL = {"rtol": 2e-4, "atol": 2e-4}


# ---- numpy references (float64) ----
def np_erf(x: np.ndarray) -> np.ndarray:
  """erf in float64, element by element through math.erf (numpy has none)."""
  return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)


def np_ln(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
  mu = x.mean(-1, keepdims=True)
  d = x - mu
  return d / np.sqrt((d * d).mean(-1, keepdims=True) + LN_EPS) * g + b


def np_bert(w: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray, layers: int, heads: int) -> np.ndarray:
  w = {k: v.astype(np.float64) for k, v in w.items()}
  bs, s = ids.shape
  hid = w["emb"].shape[1]
  dh = hid // heads
  x = np_ln(w["emb"][ids] + w["pos"], w["ln0_g"], w["ln0_b"])
  add = (1.0 - mask.astype(np.float64))[:, None, None, :] * MASK_NEG
  for i in range(layers):
    p = f"L{i}_"
    qkv = (x @ w[p + "qkv_w"] + w[p + "qkv_b"]).reshape(bs, s, 3, heads, dh).transpose(2, 0, 3, 1, 4)
    sc = qkv[0] @ qkv[1].transpose(0, 1, 3, 2) / math.sqrt(dh) + add
    e = np.exp(sc - sc.max(-1, keepdims=True))
    ctx = (e / e.sum(-1, keepdims=True) @ qkv[2]).transpose(0, 2, 1, 3).reshape(bs, s, hid)
    x = np_ln(ctx @ w[p + "out_w"] + w[p + "out_b"] + x, w[p + "ln1_g"], w[p + "ln1_b"])
    f = x @ w[p + "up_w"] + w[p + "up_b"]
    f = 0.5 * f * (1 + np_erf(f / math.sqrt(2)))
    x = np_ln(f @ w[p + "down_w"] + w[p + "down_b"] + x, w[p + "ln2_g"], w[p + "ln2_b"])
  return x


def np_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, pad: int) -> np.ndarray:
  x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
  win = np.lib.stride_tricks.sliding_window_view(x, w.shape[2:], axis=(2, 3))  # (n, c, oh, ow, kh, kw)
  return np.einsum("ncyxij,ocij->noyx", win, w, optimize=True) + b[None, :, None, None]


def np_cnn(w: dict[str, np.ndarray], x: np.ndarray, chans: list[int]) -> np.ndarray:
  w = {k: v.astype(np.float64) for k, v in w.items()}
  h = x.astype(np.float64)
  for i in range(len(chans) - 1):
    h = np_conv(h, w[f"c{i}_w"], np.zeros(chans[i + 1]), 1)
    a = w[f"bn{i}_s"] / np.sqrt(w[f"bn{i}_v"] + 1e-5)
    h = np.maximum(h * a[None, :, None, None] + (w[f"bn{i}_b"] - w[f"bn{i}_m"] * a)[None, :, None, None], 0)
    if i < len(chans) - 2:
      n, c, hh, ww = h.shape
      h = h.reshape(n, c, hh // 2, 2, ww // 2, 2).max((3, 5))
  return h.mean((2, 3)) @ w["fc_w"].T + w["fc_b"]


# ---- the models, as onnx.helper graphs ----
def bert_weights(rng: np.random.Generator, layers: int, hid: int, ffn: int, vocab: int, s: int) -> dict[str, np.ndarray]:
  def m(a: int, c: int) -> np.ndarray: return (rng.standard_normal((a, c)) / math.sqrt(a)).astype(np.float32)
  def v(c: int, sd: float = 0.02, mu: float = 0.0) -> np.ndarray: return (rng.standard_normal(c) * sd + mu).astype(np.float32)
  w = {"emb": (rng.standard_normal((vocab, hid)) * 0.5).astype(np.float32), "pos": (rng.standard_normal((s, hid)) * 0.1).astype(np.float32),
       "ln0_g": v(hid, 0.1, 1.0), "ln0_b": v(hid)}
  for i in range(layers):
    p = f"L{i}_"
    w.update({p + "qkv_w": m(hid, 3 * hid), p + "qkv_b": v(3 * hid), p + "out_w": m(hid, hid), p + "out_b": v(hid),
              p + "ln1_g": v(hid, 0.1, 1.0), p + "ln1_b": v(hid), p + "up_w": m(hid, ffn), p + "up_b": v(ffn),
              p + "down_w": m(ffn, hid), p + "down_b": v(hid), p + "ln2_g": v(hid, 0.1, 1.0), p + "ln2_b": v(hid)})
  return w


def _model(onnx: Any, nodes: list, inputs: list, outputs: list, w: dict[str, np.ndarray], consts: dict[str, np.ndarray]) -> Any:
  h, nh = onnx.helper, onnx.numpy_helper
  g = h.make_graph(nodes, "bench", inputs, outputs, [nh.from_array(v, k) for k, v in {**w, **consts}.items()])
  m = h.make_model(g, opset_imports=[h.make_opsetid("", 20)])
  m.ir_version = 9
  onnx.checker.check_model(m)
  return m


def bert_onnx(onnx: Any, w: dict[str, np.ndarray], layers: int, bs: int, s: int, heads: int) -> Any:
  """A post-LN BERT encoder as torch's exporter writes one: embedding gather + positions + layernorm; per layer a fused qkv
  MatMul split into heads, scaled scores plus the additive mask from the int64 attention mask, softmax, context, output
  projection + residual + layernorm, exact-GELU FFN + residual + layernorm. Output: the last hidden state."""
  N, TP = onnx.helper.make_node, onnx.TensorProto
  hid = w["emb"].shape[1]
  dh = hid // heads
  i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
  consts = {"heads_shape": i64(bs, s, heads, dh), "ctx_shape": i64(bs, s, hid), "scale": np.array(1 / math.sqrt(dh), np.float32),
            "one": np.array(1.0, np.float32), "neg": np.array(MASK_NEG, np.float32), "ax12": i64(1, 2), "split3": i64(hid, hid, hid)}
  ln = lambda x, name: N("LayerNormalization", [x, name + "_g", name + "_b"], [name], axis=-1, epsilon=LN_EPS)  # noqa: E731
  def linear(x: str, name: str) -> list:
    return [N("MatMul", [x, name + "_w"], [name + "_mm"]), N("Add", [name + "_mm", name + "_b"], [name])]
  nodes = [N("Gather", ["emb", "ids"], ["e0"]), N("Add", ["e0", "pos"], ["e1"]), ln("e1", "ln0"),
           N("Cast", ["mask"], ["mf"], to=TP.FLOAT), N("Unsqueeze", ["mf", "ax12"], ["m4"]), N("Sub", ["one", "m4"], ["m5"]),
           N("Mul", ["m5", "neg"], ["addmask"])]
  h = "ln0"
  for i in range(layers):
    p = f"L{i}_"
    nodes += linear(h, p + "qkv") + [N("Split", [p + "qkv", "split3"], [p + "q", p + "k", p + "v"], axis=-1)]
    for t, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
      nodes += [N("Reshape", [p + t, "heads_shape"], [p + t + "r"]), N("Transpose", [p + t + "r"], [p + t + "t"], perm=perm)]
    nodes += [N("MatMul", [p + "qt", p + "kt"], [p + "s0"]), N("Mul", [p + "s0", "scale"], [p + "s1"]),
              N("Add", [p + "s1", "addmask"], [p + "s2"]), N("Softmax", [p + "s2"], [p + "pr"], axis=-1),
              N("MatMul", [p + "pr", p + "vt"], [p + "c0"]), N("Transpose", [p + "c0"], [p + "c1"], perm=[0, 2, 1, 3]),
              N("Reshape", [p + "c1", "ctx_shape"], [p + "c2"])]
    nodes += linear(p + "c2", p + "out") + [N("Add", [p + "out", h], [p + "r1"]), ln(p + "r1", p + "ln1")]
    nodes += linear(p + "ln1", p + "up") + [N("Gelu", [p + "up"], [p + "g"])] + linear(p + "g", p + "down")
    nodes += [N("Add", [p + "down", p + "ln1"], [p + "r2"]), ln(p + "r2", p + "ln2")]
    h = p + "ln2"
  nodes.append(N("Identity", [h], ["hidden"]))
  vi = onnx.helper.make_tensor_value_info
  return _model(onnx, nodes, [vi("ids", TP.INT64, [bs, s]), vi("mask", TP.INT64, [bs, s])], [vi("hidden", TP.FLOAT, [bs, s, hid])], w, consts)


def cnn_weights(rng: np.random.Generator, chans: list[int], classes: int) -> dict[str, np.ndarray]:
  w: dict[str, np.ndarray] = {}
  for i, (a, c) in enumerate(zip(chans, chans[1:])):
    w[f"c{i}_w"] = (rng.standard_normal((c, a, 3, 3)) / math.sqrt(9 * a)).astype(np.float32)
    w[f"bn{i}_s"], w[f"bn{i}_b"] = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.uniform(-0.2, 0.2, c).astype(np.float32)
    w[f"bn{i}_m"], w[f"bn{i}_v"] = rng.uniform(-0.2, 0.2, c).astype(np.float32), rng.uniform(0.5, 2.0, c).astype(np.float32)
  w["fc_w"], w["fc_b"] = (rng.standard_normal((classes, chans[-1])) / math.sqrt(chans[-1])).astype(np.float32), np.zeros(classes, np.float32)
  return w


def cnn_onnx(onnx: Any, w: dict[str, np.ndarray], chans: list[int], n: int, size: int, classes: int) -> Any:
  """(conv 3x3 pad 1 + batch norm + relu, max pool 2) per stage, the last stage unpooled, global average pool, flatten, Gemm."""
  N, TP, vi = onnx.helper.make_node, onnx.TensorProto, onnx.helper.make_tensor_value_info
  nodes, h = [], "x"
  for i in range(len(chans) - 1):
    nodes += [N("Conv", [h, f"c{i}_w"], [f"c{i}"], pads=[1, 1, 1, 1]),
              N("BatchNormalization", [f"c{i}", f"bn{i}_s", f"bn{i}_b", f"bn{i}_m", f"bn{i}_v"], [f"b{i}"]), N("Relu", [f"b{i}"], [f"r{i}"])]
    h = f"r{i}"
    if i < len(chans) - 2:
      nodes.append(N("MaxPool", [h], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2]))
      h = f"p{i}"
  nodes += [N("GlobalAveragePool", [h], ["gp"]), N("Flatten", ["gp"], ["fl"]), N("Gemm", ["fl", "fc_w", "fc_b"], ["y"], transB=1)]
  return _model(onnx, nodes, [vi("x", TP.FLOAT, [n, chans[0], size, size])], [vi("y", TP.FLOAT, [n, classes])], w, {})


# ---- the torch modules, from the same weights ----
def torch_bert(torch: Any, w: dict[str, np.ndarray], layers: int, heads: int) -> Any:
  """Embedding + positions + LayerNorm, then stock nn.TransformerEncoderLayer (post-LN, exact GELU; torch's fused
  inference path) per layer, the attention mask as src_key_padding_mask."""
  nn = torch.nn
  t = {k: torch.from_numpy(v) for k, v in w.items()}
  vocab, hid = w["emb"].shape
  ffn = w["L0_up_w"].shape[1]

  class Bert(nn.Module):  # type: ignore[name-defined,misc]
    def __init__(self) -> None:
      super().__init__()
      self.emb, self.ln0 = nn.Embedding(vocab, hid), nn.LayerNorm(hid, eps=LN_EPS)
      self.layers = nn.ModuleList([nn.TransformerEncoderLayer(hid, heads, ffn, dropout=0.0, activation="gelu", batch_first=True, norm_first=False,
                                                              layer_norm_eps=LN_EPS) for _ in range(layers)])
      self.register_buffer("pos", t["pos"].clone())

    def forward(self, ids: Any, mask: Any) -> Any:
      x = self.ln0(self.emb(ids) + self.pos)
      pad = mask == 0
      for layer in self.layers: x = layer(x, src_key_padding_mask=pad)
      return x

  m = Bert().eval()
  with torch.no_grad():
    m.emb.weight.copy_(t["emb"])
    m.ln0.weight.copy_(t["ln0_g"]); m.ln0.bias.copy_(t["ln0_b"])
    for i, layer in enumerate(m.layers):
      p = f"L{i}_"
      layer.self_attn.in_proj_weight.copy_(t[p + "qkv_w"].T); layer.self_attn.in_proj_bias.copy_(t[p + "qkv_b"])
      layer.self_attn.out_proj.weight.copy_(t[p + "out_w"].T); layer.self_attn.out_proj.bias.copy_(t[p + "out_b"])
      for mod, name in ((layer.linear1, "up"), (layer.linear2, "down")):
        mod.weight.copy_(t[p + name + "_w"].T); mod.bias.copy_(t[p + name + "_b"])
      for mod, name in ((layer.norm1, "ln1"), (layer.norm2, "ln2")):
        mod.weight.copy_(t[p + name + "_g"]); mod.bias.copy_(t[p + name + "_b"])
  return m


def torch_cnn(torch: Any, w: dict[str, np.ndarray], chans: list[int]) -> Any:
  nn = torch.nn
  mods: list[Any] = []
  for i, (a, c) in enumerate(zip(chans, chans[1:])):
    conv, bn = nn.Conv2d(a, c, 3, padding=1, bias=False), nn.BatchNorm2d(c, eps=1e-5)
    with torch.no_grad():
      conv.weight.copy_(torch.from_numpy(w[f"c{i}_w"]))
      for attr, k in (("weight", "s"), ("bias", "b"), ("running_mean", "m"), ("running_var", "v")):
        getattr(bn, attr).copy_(torch.from_numpy(w[f"bn{i}_{k}"]))
    mods += [conv, bn, nn.ReLU()] + ([nn.MaxPool2d(2)] if i < len(chans) - 2 else [])
  fc = nn.Linear(chans[-1], w["fc_w"].shape[0])
  with torch.no_grad(): fc.weight.copy_(torch.from_numpy(w["fc_w"])); fc.bias.copy_(torch.from_numpy(w["fc_b"]))
  return nn.Sequential(*mods, nn.AdaptiveAvgPool2d(1), nn.Flatten(), fc).eval()


# ---- measuring ----
def _load_timed(konnx: Any, path: str, cache_dir: str) -> tuple[Any, float, float]:
  """Load the model twice with the kernel cache in a fresh directory: cold (nothing cached anywhere), then with the disk
  cache warm (the in-memory cache cleared, as in a new process). Returns (model, cold s, warm s)."""
  from kiln.executor.cache import clear_memory_cache
  old = {k: os.environ.get(k) for k in ("KILN_CACHE_DIR", "KILN_CACHE")}
  os.environ.update(KILN_CACHE_DIR=cache_dir, KILN_CACHE="1")
  try:
    clear_memory_cache()
    st = time.perf_counter()
    konnx.load(path)
    cold = time.perf_counter() - st
    clear_memory_cache()
    st = time.perf_counter()
    km = konnx.load(path)
    warm = time.perf_counter() - st
  finally:
    for k, v in old.items():
      if v is None: os.environ.pop(k, None)
      else: os.environ[k] = v
  return km, cold, warm


_RSS_CHILD = textwrap.dedent("""
  import json, os, sys
  import numpy as np
  which, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
  feeds = {k: v for k, v in np.load(sys.argv[4]).items()}
  if which == "ort":
    import onnxruntime as ort
    so = ort.SessionOptions(); so.intra_op_num_threads = int(sys.argv[5]); so.inter_op_num_threads = 1
  else:
    os.environ["KILN_CACHE_DIR"] = cache
    from kiln.graph import onnx as konnx
    from kiln.codegen.registry import get_runtime
    get_runtime("CPU")
  def hwm():
    for line in open("/proc/self/status"):
      if line.startswith("VmHWM:"): return int(line.split()[1])
  with open("/proc/self/clear_refs", "w") as f: f.write("5")  # resets the peak (VmHWM) to the current RSS
  base = hwm()
  if which == "ort": ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)
  else: konnx.load(path).run(feeds)
  print(json.dumps({"peak_kb": hwm() - base}))
""")


def _rss_growth(which: str, path: str, cache: str, feeds: dict[str, np.ndarray], threads: int) -> tuple[float | None, str]:
  """Peak resident memory a fresh process gains loading the model and running it once, after its imports (bytes; Linux:
  VmHWM reset through /proc/self/clear_refs), or None and why not. The same measure for kiln (disk cache warm) and onnxruntime."""
  import json
  fpath = os.path.join(os.path.dirname(path), "feeds.npz")
  np.savez(fpath, **feeds)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([BENCH_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
  try:
    cmd = [sys.executable, "-c", _RSS_CHILD, which, path, cache, fpath, str(threads)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0: return None, (p.stderr.strip().splitlines() or ["?"])[-1][:120]
    return json.loads(p.stdout.strip().splitlines()[-1])["peak_kb"] * 1024.0, ""
  except Exception as e: return None, f"{type(e).__name__}: {e}"[:120]


def _graph_imports() -> tuple[Any, Any]:
  import onnx

  from kiln.graph import onnx as konnx
  return onnx, konnx


def bert(b: Bench, r: Row, mem: Row, comp: Row) -> None:
  tiny = b.scale < 0.1
  layers, bs, s, hid, heads, ffn, vocab = (2, 2, 16, 64, 4, 256, 100) if tiny else (6, 8, 128, 384, 12, 1536, 1000)
  r.work = f"BERT encoder {layers}L h{hid} x{heads} ffn{ffn} s{s} b{bs} (ONNX)"
  onnx, konnx = _graph_imports()
  rng = np.random.default_rng(15)
  w = bert_weights(rng, layers, hid, ffn, vocab, s)
  ids = rng.integers(0, vocab, (bs, s)).astype(np.int64)
  mask = np.ones((bs, s), np.int64)
  mask[-1, s * 3 // 4:] = 0  # one padded sequence: the mask matters
  feeds = {"ids": ids, "mask": mask}
  ort_why = ""
  want = np_bert(w, ids, mask, layers, heads)
  with tempfile.TemporaryDirectory(prefix="kiln-bench-graph-") as d:
    path = os.path.join(d, "bert.onnx")
    onnx.save(bert_onnx(onnx, w, layers, bs, s, heads), path)
    km, cold, warm = _load_timed(konnx, path, os.path.join(d, "cache"))
    run = lambda: km.run(feeds)["hidden"]  # noqa: E731
    check("kiln.graph BERT", run(), want, **TOL)
    torch = b.peers.torch
    peers: dict[str, Peer] = {}
    if torch is not None:
      tm = torch_bert(torch, w, layers, heads)
      tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
      def run_torch() -> Any:
        with torch.inference_mode(): return tm(tids, tmask)
      peers["torch"] = (run_torch, lambda o: check("torch BERT", o.numpy(), want, **TOL))
    if b.peers.onnxruntime is not None:
      sess = ort_session(b.peers, path)
      peers["onnxruntime"] = (lambda: sess.run(None, feeds)[0], lambda o: check("onnxruntime BERT", o, want, **TOL))
    b.time_row(r, {"kiln": run}, peers)
    if b.peers.onnxruntime is not None: mem.onnxruntime, ort_why = _rss_growth("ort", path, "", feeds, b.peers.threads)
    kiln_rss, kiln_why = _rss_growth("kiln", path, os.path.join(d, "cache"), feeds, b.peers.threads)
  dh = hid // heads
  m = bs * s
  flops = layers * (2 * m * hid * (3 * hid + hid + 2 * ffn) + 4 * bs * heads * s * s * dh)
  r.achieved, r.limit = _rate(flops / r.kiln, b.peak), f"{b.peak / GB:.0f} GFLOP/s FMA" if b.peak else "-"
  r.checks, r.target = [("torch", 1.25), ("onnxruntime", 1.0)], ">= 1.25x torch and >= onnxruntime"
  plan = km.plan
  r.note = (f"kiln.graph.onnx.load: {len(plan.kernels)} kernels (9 per layer + embedding LN + mask); post-LN, exact GELU, attention mask; "
            "torch: nn.TransformerEncoderLayer x{0} (fused inference path), inference_mode; onnxruntime: the same .onnx file").format(layers)
  if torch is None: r.note += "; torch not installed: only onnxruntime is judged"
  comp.work, comp.kiln, comp.unit = f"BERT {layers}L load+compile: cold / disk cache warm", cold, "ms"
  comp.achieved, comp.limit, comp.target, comp.status = f"warm {warm * 1e3:.0f} ms", "-", "(report)", "-"
  comp.note = "kiln.graph.onnx.load of the BERT row's file, KILN_CACHE_DIR a new empty directory; warm: memory cache cleared, disk cache kept"
  mem.work, mem.kiln, mem.unit = f"BERT {layers}L peak memory", float(plan.memory_bytes), "MB"
  mem.achieved, mem.limit, mem.target, mem.status = f"{plan.memory_bytes_without_reuse / MB:.1f} MB w/o reuse", "-", "(report)", "-"
  wbytes = sum(v.nbytes for v in w.values())
  mem.note = (f"kiln column: the plan's buffer bytes (weights {wbytes / MB:.1f} MB included); onnxruntime column: peak RSS a fresh process "
              f"gains creating the session and running once (weights, arena, intermediates)"
              + (f"; kiln the same way (load + run, disk cache warm): {kiln_rss / MB:.1f} MB" if kiln_rss
                 else f"; kiln's RSS not measured ({kiln_why})"))
  if mem.onnxruntime is None and b.peers.onnxruntime is not None: mem.note += f"; onnxruntime's RSS not measured ({ort_why})"


def cnn(b: Bench, r: Row) -> None:
  tiny = b.scale < 0.1
  chans, n, size, classes = ([3, 8, 16], 4, 16, 10) if tiny else ([3, 32, 64, 128], 32, 32, 10)
  r.work = f"small CNN {'-'.join(map(str, chans[1:]))} {size}x{size} b{n} (ONNX)"
  onnx, konnx = _graph_imports()
  rng = np.random.default_rng(16)
  w = cnn_weights(rng, chans, classes)
  x = rng.standard_normal((n, chans[0], size, size)).astype(np.float32)
  want = np_cnn(w, x, chans)
  with tempfile.TemporaryDirectory(prefix="kiln-bench-graph-") as d:
    path = os.path.join(d, "cnn.onnx")
    onnx.save(cnn_onnx(onnx, w, chans, n, size, classes), path)
    km = konnx.load(path)
    run = lambda: km.run({"x": x})["y"]  # noqa: E731
    check("kiln.graph CNN", run(), want, **TOL)
    peers: dict[str, Peer] = {}
    if b.peers.onnxruntime is not None:
      sess = ort_session(b.peers, path)
      peers["onnxruntime"] = (lambda: sess.run(None, {"x": x})[0], lambda o: check("onnxruntime CNN", o, want, **TOL))
    torch = b.peers.torch
    if torch is not None:
      tm, tx = torch_cnn(torch, w, chans), torch.from_numpy(x)
      def run_torch() -> Any:
        with torch.inference_mode(): return tm(tx)
      peers["torch"] = (run_torch, lambda o: check("torch CNN", o.numpy(), want, **TOL))
    b.time_row(r, {"kiln": run}, peers)
  flops, hw = 0, size
  for i, (a, c) in enumerate(zip(chans, chans[1:])):
    flops += 2 * n * hw * hw * c * a * 9
    if i < len(chans) - 2: hw //= 2
  r.achieved, r.limit = _rate(flops / r.kiln, b.peak), f"{b.peak / GB:.0f} GFLOP/s FMA" if b.peak else "-"
  r.checks, r.target = [("onnxruntime", 1.0)], ">= onnxruntime"
  r.note = (f"{len(km.plan.kernels)} kernels (the 3-channel conv a product tiled as a matmul, its window panels packed, the padding "
            "read in place by masked loads, bias and relu in its epilogue; the others Winograd F(4x4, 3x3): input transform, 36 batched "
            "products, output transform, a copy back to NCHW with bias and relu; plain max pools; global mean pool; linear); batch "
            "norm folded into the conv's weights and bias at load; 'achieved' counts the direct convolution's multiply-adds (Winograd "
            "does fewer, so it can pass the FMA limit); torch column: nn.Sequential, inference_mode (report only)")


def _rate(flops_s: float, peak: float) -> str:
  return f"{flops_s / GB:.1f} GFLOP/s" + (f" ({flops_s / peak:.0%})" if peak else "")


def run(b: Bench) -> None:
  """The kiln-graph rows, after the model rows: the BERT encoder (with its compile and memory rows) and the small CNN."""
  try: _graph_imports()
  except ImportError as e:  # a checkout without kiln-graph or onnx: the rows say so, they do not fail the run
    for work in ("BERT encoder (kiln.graph, ONNX)", "small CNN (kiln.graph, ONNX)"):
      if b.wanted(work): b.rows.append(Row(work, "ms", status="-", note=f"skipped: {e} (pip install 'kiln-graph[onnx]')"))
    return
  if b.wanted("BERT encoder"):
    mem, comp = Row("BERT peak memory", "MB"), Row("BERT load+compile", "ms")
    b.row("BERT encoder (kiln.graph, ONNX)", functools.partial(bert, b, mem=mem, comp=comp), "ms")
    for extra in (comp, mem):
      if extra.kiln is None: extra.status, extra.note = "ERROR", "the BERT row did not finish"
      b.rows.append(extra)
  b.row("small CNN (kiln.graph, ONNX)", functools.partial(cnn, b), "ms")

