"""A Llama-architecture model's decode on kiln's CUDA runtime against torch with its KV cache on the same GPU (issue 40;
scripts/gpu-models runs it there, section llm). Needs torch and gguf: never in kiln's own environments.

  python gpu_llm.py [--shape smol135m|llama1b|tiny] [--types Q8_0,F16] [--prompt 32] [--decode 64] [--warmup 4] [--check 4]
                    [--context 512] [--budget SECONDS] [--torch-compile] [--compile-mode reduce-overhead] [--hbm-gbps GB/s]
                    [--kiln-device CUDA] [--torch-device cuda] [--work DIR] [--emulate]

The model: random weights (no download) in a Llama's shapes, HF's initialisation (matrices N(0, 0.2), as
llamacpp_compare.py's initializer_range, so greedy picks are the model's and not rounding's; norms 1), written per type
as a GGUF by the tests' converter-style writer (packages/llm/tests/checkpoint_files.py: llama.cpp's names and Q/K
permutation; F16 and Q8_0 through the gguf package's quantizer, no llama.cpp) with vocabulary "no_vocab" (token ids are
fed). smol135m: SmolLM-135M's shapes (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab 49152, tied);
llama1b: Llama-3.2-1B's (hidden 2048, 16 layers, 32 / 8 heads, intermediate 8192, vocab 128256, tied; plain RoPE of
theta 500000, no llama3 frequency scaling: it changes no byte a step reads), 1.2 billion weights: the tests' writer
quantizes and writes them on one core, 30-45 s for Q8_0 (give it --types Q8_0 and scripts/gpu-models --llm-limit 200);
tiny: two small layers for --emulate.

kiln: load(path, context=C, device="CUDA") and its prefill and decode plans built (the load row: open, compile, upload);
a P-token prompt's prefill (median of 3, each from an empty cache), then W warm-up and D timed greedy decode steps, each
runner.feed([token]) (its id and position in, its logits out: what generate() does a token); tokens/s, ms/token
(median step), the weight bytes kiln keeps (what a step reads: every matrix once, the tied embedding as the output
matrix) x tokens/s in GB/s against the device's HBM peak (memory clock x bus width, else the card's data sheet by
name, else --hbm-gbps) and a torch device-to-device copy's rate (read + write); the decode plan's execute() alone, 20 a
round between device syncs (torch.cuda.synchronize: kiln's runtime and torch share the device's primary context), so the
host's part of a step shows as the difference; then one decode step kernel by kernel (each timed alone), the longest
summed by name, the whole table to $OUT/profile-llm-<type>.txt.

torch: the same model in plain torch (RMSNorm, RoPE as HF's rotate_half, grouped-query attention, SwiGLU, a preallocated
(static) KV cache) from the same weights as the GGUF holds them (its round trip: what kiln reads). float16 weights,
eager, timed the same way (each step's next token read back: a sync a step, as kiln's logits copy is), after the first
type's kiln rows; torch.compile (mode --compile-mode, a full-context masked step with the position a tensor, so one graph
serves every step) behind --torch-compile, next, where --compile-reserve seconds are left (the other types then run in
what is left). Correctness: kiln's logits for the prompt's last token and --check greedy
steps against the float32 torch model (TF32 off) fed kiln's tokens: the largest difference over the largest logit
(at most --tol) and every greedy token equal. torch float16's own greedy tokens are compared and reported, not checked.

Every step is guarded: a failure prints FAIL with its traceback and the next step runs; steps that would start past
--budget seconds are skipped and say so. Rows go to $OUT/gpu_llm.json when OUT is set. --emulate: kiln's CUDA on the
CPU emulation (the checkout's tests/cuda_emu.py; a dry run without a GPU, torch on the CPU; use --shape tiny)."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
ROWS: list[dict[str, Any]] = []
FAILS: list[str] = []
T0 = time.perf_counter()
STD = 0.2  # HF's initializer_range, as llamacpp_compare.py's model
_BASE: dict[str, Any] = {"model_type": "llama", "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None}
SHAPES: dict[str, dict[str, Any]] = {
  "tiny": {**_BASE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0},
  "smol135m": {**_BASE, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "max_position_embeddings": 2048, "rope_theta": 10000.0},
  "llama1b": {**_BASE, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 4096, "rope_theta": 500000.0},
}
FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7}  # general.file_type (llama.cpp's LLAMA_FTYPE_*)
HBM_BY_NAME = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
               ("A100 80GB PCIe", 1935.0), ("A100", 1555.0))  # data sheets, GB/s: only where the clocks cannot be read


def step(name: str, fn: Callable[[], Any]) -> Any:
  """fn(), or None after printing FAIL and its traceback (the script goes on)."""
  t = time.perf_counter()
  try:
    out = fn()
    print(f"ok    {name} ({time.perf_counter() - t:.1f} s)", flush=True)
    return out
  except BaseException as e:  # a step's failure is reported, the others still run
    if isinstance(e, KeyboardInterrupt): raise
    FAILS.append(name)
    print(f"FAIL  {name} ({time.perf_counter() - t:.1f} s): {type(e).__name__}: {str(e)[:1500]}\n{traceback.format_exc(limit=8)}", flush=True)
    return None


def left(budget: float) -> float: return budget - (time.perf_counter() - T0)


def dump() -> None:
  if (out := os.environ.get("OUT")):
    with open(os.path.join(out, "gpu_llm.json"), "w") as f: json.dump(ROWS, f, indent=1)


# ---- the model's weights and its GGUF files ----

def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
  """HF-named float32 weights of the Llama `cfg`: matrices N(0, STD), norms 1; each drawn from its own seeded stream, on
  every core (numpy's generators release the GIL: the 1B shape's 1.2 billion draws take seconds, not a minute)."""
  h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  hd = h // cfg["num_attention_heads"]
  q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
  mats: dict[str, tuple[int, int]] = {"model.embed_tokens.weight": (v, h)}
  out: dict[str, np.ndarray] = {"model.norm.weight": np.ones(h, np.float32)}
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = np.ones(h, np.float32)
    out[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    mats.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                 p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                 p + "mlp.down_proj.weight": (h, f)})
  seeds = np.random.SeedSequence(seed).spawn(len(mats))

  def draw(job: tuple[str, tuple[int, int], np.random.SeedSequence]) -> tuple[str, np.ndarray]:
    name, shape, ss = job
    a = np.random.default_rng(ss).standard_normal(shape, dtype=np.float32)
    a *= np.float32(STD)
    return name, a
  with ThreadPoolExecutor(os.cpu_count() or 1) as ex: out.update(ex.map(draw, [(n, s, ss) for (n, s), ss in zip(mats.items(), seeds)]))
  return out


def write_model(path: str, cfg: dict[str, Any], weights: dict[str, np.ndarray], ftype: str) -> dict[str, np.ndarray]:
  """The GGUF at path, every matrix in ftype (vectors F32, as the converter keeps them); returns the weights as the file
  holds them, HF layout (the round trip: what kiln reads)."""
  sys.path.insert(0, os.path.join(HERE, "..", "tests"))
  from checkpoint_files import write_gguf  # the tests' converter-style writer (no llama.cpp needed)
  meta = {"tokenizer.ggml.model": "no_vocab", "llama.vocab_size": cfg["vocab_size"], "general.file_type": FILE_TYPE[ftype]}
  return write_gguf(path, cfg, weights, fmt=lambda n: ftype, meta=meta)


def gguf_matrix_bytes(path: str) -> int:
  """The bytes of the file's matrices (2-d tensors): what a decode step reads of it, the tied embedding once as the output."""
  import gguf
  return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) >= 2)


# ---- the torch reference ----

def torch_llama(torch: Any, cfg: dict[str, Any], w: dict[str, np.ndarray], dev: str, dtype: Any, ctx: int) -> Any:
  """A plain-torch Llama over a preallocated KV cache (layers, kv_heads, ctx, head_dim) of `dtype`, the weights `w` (HF
  layout) on `dev` in `dtype` (norms float32, as HF's RMSNorm computes in float32)."""
  nn, F = torch.nn, torch.nn.functional
  H, KVH, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
  hd, L, eps = d // H, cfg["num_hidden_layers"], cfg["rms_norm_eps"]
  g = H // KVH

  class Llama(nn.Module):  # type: ignore[name-defined,misc]
    def __init__(self) -> None:
      super().__init__()
      def buf(name: str, a: np.ndarray, dt: Any) -> None:
        self.register_buffer(name.replace(".", "_"), torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt))
      for n, a in w.items(): buf(n, a, torch.float32 if a.ndim == 1 else dtype)
      inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
      ang = np.arange(ctx, dtype=np.float64)[:, None] * inv[None, :]
      ang = np.concatenate([ang, ang], 1)  # HF's table: the frequencies twice over the head
      buf("cos", np.cos(ang).astype(np.float32), dtype); buf("sin", np.sin(ang).astype(np.float32), dtype)  # noqa: E702
      self.register_buffer("kc", torch.zeros(L, KVH, ctx, hd, dtype=dtype, device=dev))
      self.register_buffer("vc", torch.zeros(L, KVH, ctx, hd, dtype=dtype, device=dev))
      self.register_buffer("keys", torch.arange(ctx, device=dev))

    def p(self, name: str) -> Any: return getattr(self, name.replace(".", "_"))

    def rms(self, x: Any, name: str) -> Any:
      xf = x.float()
      return (self.p(name) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)

    @staticmethod
    def rope(x: Any, cos: Any, sin: Any) -> Any:  # HF's rotate_half
      x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
      return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, ids: Any, start: Any, last_only: bool = True) -> Any:
      """Logits (float32) of tokens `ids` at positions start.. (the last row's only where last_only), their keys and values
      written into the cache. start: an int (eager: attention over the filled rows) or a 1-element tensor (one token, the
      whole cache read under a mask: one shape for every step, for torch.compile)."""
      n = ids.shape[0]
      static = not isinstance(start, int)
      pos = start if static else torch.arange(start, start + n, device=dev)
      cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (n, 1, hd)
      x = self.p("model.embed_tokens.weight")[ids]
      keys = self.keys[None, :] <= pos[:, None]  # (n, ctx): key j is read by the query at position p where j <= p
      if not static: keys = keys[:, :start + n]
      for i in range(L):
        pre = f"model.layers.{i}."
        h = self.rms(x, pre + "input_layernorm.weight")
        q = self.rope((h @ self.p(pre + "self_attn.q_proj.weight").T).view(n, H, hd), cos, sin)
        k = self.rope((h @ self.p(pre + "self_attn.k_proj.weight").T).view(n, KVH, hd), cos, sin)
        v = (h @ self.p(pre + "self_attn.v_proj.weight").T).view(n, KVH, hd)
        if static:
          self.kc[i].index_copy_(1, pos, k.transpose(0, 1)); self.vc[i].index_copy_(1, pos, v.transpose(0, 1))  # noqa: E702
          kk, vv = self.kc[i], self.vc[i]
        else:
          self.kc[i, :, start:start + n] = k.transpose(0, 1); self.vc[i, :, start:start + n] = v.transpose(0, 1)  # noqa: E702
          kk, vv = self.kc[i, :, :start + n], self.vc[i, :, :start + n]
        qg = q.view(n, KVH, g, hd).permute(1, 2, 0, 3)  # (kvh, g, n, hd): head h reads kv head h // g, as HF's repeat_kv
        s = (qg @ kk.transpose(-1, -2)[:, None]) * (1.0 / math.sqrt(hd))  # (kvh, g, n, keys)
        prob = F.softmax(s.float().masked_fill(~keys, -math.inf), -1).to(dtype)  # HF's softmax: float32
        o = (prob @ vv[:, None]).permute(2, 0, 1, 3).reshape(n, H * hd)
        x = x + o @ self.p(pre + "self_attn.o_proj.weight").T
        h = self.rms(x, pre + "post_attention_layernorm.weight")
        act = F.silu(h @ self.p(pre + "mlp.gate_proj.weight").T) * (h @ self.p(pre + "mlp.up_proj.weight").T)
        x = x + act @ self.p(pre + "mlp.down_proj.weight").T
      if last_only: x = x[-1:]
      head = self.p("lm_head.weight") if "lm_head.weight" in w else self.p("model.embed_tokens.weight")
      return (self.rms(x, "model.norm.weight") @ head.T).float()

  return Llama().eval()


def matrix_bytes(w: dict[str, Any]) -> int:
  """The bytes of a weight dict's matrices (each once): kiln's Weights.arrays (QuantWeight or ndarray), or a torch model's buffers."""
  return sum(int(a.nbytes) if hasattr(a, "nbytes") else int(a.numel() * a.element_size())
             for a in w.values() if len(getattr(a, "shape", (0, 0))) >= 2)


# ---- the device ----

class Sync:
  def __init__(self, torch: Any, dev: str): self.torch, self.dev = torch, dev
  def __call__(self) -> None:
    if self.dev.startswith("cuda"): self.torch.cuda.synchronize()


def hbm_peak(torch: Any, dev: str, flag: float) -> tuple[float, str]:
  """(GB/s, where it came from): --hbm-gbps; else 2 x memory clock x bus width (pycuda's device attributes, then torch's
  device properties); else the data sheet of the card by name; (0, why not) where none."""
  if flag: return flag, "--hbm-gbps"
  why = []
  try:
    import pycuda.driver as drv
    drv.init()
    d = drv.Device(torch.cuda.current_device() if dev.startswith("cuda") else 0)
    a = drv.device_attribute
    khz, bits = d.get_attribute(a.MEMORY_CLOCK_RATE), d.get_attribute(a.GLOBAL_MEMORY_BUS_WIDTH)
    if khz and bits: return 2 * khz * 1e3 * bits / 8 / 1e9, f"2 x {khz / 1e3:.0f} MHz x {bits} bits (pycuda)"
    why.append(f"pycuda reads {khz} kHz x {bits} bits")
  except Exception as e:  # no pycuda, an older one or a driver without the attributes: the next way
    why.append(f"pycuda: {type(e).__name__}: {e}")
  if dev.startswith("cuda"):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    khz, bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if khz and bits: return 2 * khz * 1e3 * bits / 8 / 1e9, f"2 x {khz / 1e3:.0f} MHz x {bits} bits (torch)"
    name = torch.cuda.get_device_name()
    for key, gbps in HBM_BY_NAME:
      if key in name: return gbps, f"data sheet of {key} ({'; '.join(why)})"
    why.append(f"no data sheet for {name}")
  return 0.0, "; ".join(why) + ": pass --hbm-gbps"


def copy_gbps(torch: Any, dev: str, sync: Sync, mb: int = 1024) -> float:
  """A device-to-device copy of `mb` MB: (read + write) bytes / s, best of 5 after one untimed (a practical bound of the
  memory's rate)."""
  a = torch.empty(mb * 2**20, dtype=torch.uint8, device=dev)
  b = torch.empty_like(a)
  b.copy_(a)
  best = 0.0
  for _ in range(5):
    sync(); t = time.perf_counter(); b.copy_(a); sync()  # noqa: E702
    best = max(best, 2 * a.numel() / (time.perf_counter() - t) / 1e9)
  return best


# ---- the runs ----

def greedy_kiln(m: Any, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
  """The prompt's last logits and `steps` greedy decode steps' logits from an empty cache, and the tokens picked."""
  r = m.runner
  r.reset()
  out, toks = [np.asarray(r.feed(prompt), np.float32)], []
  for _ in range(steps):
    toks.append(int(out[-1].argmax()))
    out.append(np.asarray(r.feed([toks[-1]]), np.float32))
  return out, toks


def check(torch: Any, ref: Any, dev: str, prompt: list[int], logits: list[np.ndarray], toks: list[int], tol: float, r: dict[str, Any]) -> str:
  """kiln's logits (greedy_kiln) against the float32 torch model fed the same tokens; AssertionError past tol."""
  with torch.no_grad():
    want = [ref(torch.tensor(prompt, device=dev), 0)[0].cpu().numpy()]
    for i, t in enumerate(toks): want.append(ref(torch.tensor([t], device=dev), len(prompt) + i)[0].cpu().numpy())
  errs = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, want)]
  same = sum(int(a.argmax() == b.argmax()) for a, b in zip(logits, want))
  r.update(max_rel_err=max(errs), greedy_equal=f"{same}/{len(want)}", logit_scale=float(np.abs(want[0]).max()))
  msg = (f"kiln vs torch float32: max |diff| / max |logit| {max(errs):.1e} over the prompt's last token and {len(toks)} steps "
         f"({', '.join(f'{e:.0e}' for e in errs)}); greedy {same}/{len(want)} equal; max |logit| {r['logit_scale']:.0f}")
  if max(errs) > tol or same != len(want): raise AssertionError(msg)
  return msg


def time_decode(feed: Callable[[int], int], first: int, warm: int, n: int) -> tuple[float, float, list[int]]:
  """(tokens/s, median ms a step) over n greedy steps after `warm` untimed ones, and every token (first, warm-up ones,
  timed ones); feed(token) -> the next token."""
  toks, times = [first], []
  for i in range(warm + n):
    t = time.perf_counter()
    toks.append(feed(toks[-1]))
    if i >= warm: times.append(time.perf_counter() - t)
  return n / sum(times), 1e3 * statistics.median(times), toks


def kiln_rows(torch: Any, args: argparse.Namespace, cfg: dict[str, Any], weights: dict[str, np.ndarray], ftype: str, peak: float,
              refs: dict[str, Any]) -> None:
  """Write the GGUF of ftype, then kiln's load, check, prefill, decode and profile rows (refs: the torch models made so far)."""
  from kiln.llm import load
  path = os.path.join(args.work, f"{args.shape}-random-{ftype}.gguf")
  r: dict[str, Any] = {"engine": "kiln", "shape": args.shape, "type": ftype, "device": args.kiln_device, "prompt": args.prompt, "decode": args.decode}
  ROWS.append(r)
  t = time.perf_counter()
  held = step(f"{ftype}: write the GGUF", lambda: write_model(path, cfg, weights, ftype))
  if held is None: return
  r["write_s"], r["file_matrix_bytes"] = time.perf_counter() - t, gguf_matrix_bytes(path)
  if "torch" not in refs: refs["held"] = held
  t = time.perf_counter()
  def build() -> Any:
    m = load(path, context=args.context, device=args.kiln_device)
    r["open_s"] = time.perf_counter() - t
    m.runner.plan("prefill"); m.runner.plan("decode")  # noqa: E702
    return m
  m = step(f"{ftype}: kiln load (open, compile the prefill and decode plans, upload)", build)
  if m is None: return
  r["load_s"] = time.perf_counter() - t
  dec = m.runner.plans["decode"]
  r["decode_kernels"], r["prefill_kernels"] = dec.kernel_count, m.runner.plans["prefill"].kernel_count
  r["weight_bytes"] = matrix_bytes(m.runner.get.arrays)
  r["kv_cache_bytes"] = m.runner.cache.nbytes
  print(f"      load {r['load_s']:.1f} s (open {r['open_s']:.1f} s); decode plan {r['decode_kernels']} kernels, prefill plan "
        f"{r['prefill_kernels']}; matrices kept {r['weight_bytes'] / 1e6:.1f} MB (the file's {r['file_matrix_bytes'] / 1e6:.1f} MB), "
        f"KV cache {r['kv_cache_bytes'] / 1e6:.1f} MB", flush=True)
  rng = np.random.default_rng(args.seed + 1)
  prompt = [int(i) for i in rng.integers(0, cfg["vocab_size"], args.prompt)]
  got = step(f"{ftype}: kiln prompt and {args.check} greedy steps", lambda: greedy_kiln(m, prompt, args.check))
  if got is not None and left(args.budget) > 5:
    def ref32() -> Any:
      torch.backends.cuda.matmul.allow_tf32 = False
      return torch_llama(torch, cfg, held, args.torch_device, torch.float32, args.context)
    ref = step(f"{ftype}: torch float32 reference model", ref32)
    def against() -> str: return check(torch, ref, args.torch_device, prompt, got[0], got[1], args.tol, r)
    if ref is not None and (msg := step(f"{ftype}: kiln vs torch float32", against)): print(f"      {msg}", flush=True)
    del ref
    if args.torch_device.startswith("cuda"): torch.cuda.empty_cache()
  def prefill() -> str:
    times = []
    for _ in range(3):
      m.runner.reset()
      t = time.perf_counter(); m.runner.feed(prompt); times.append(time.perf_counter() - t)  # noqa: E702
    r["prefill_tok_s"] = args.prompt / statistics.median(times)
    return f"kiln prefill of {args.prompt} tokens: {1e3 * statistics.median(times):.2f} ms ({r['prefill_tok_s']:.0f} tokens/s)"
  if (msg := step(f"{ftype}: kiln prefill", prefill)): print(f"      {msg}", flush=True)
  def decode() -> str:
    m.runner.reset()
    first = int(np.asarray(m.runner.feed(prompt)).argmax())
    tps, ms, toks = time_decode(lambda tok: int(np.asarray(m.runner.feed([tok])).argmax()), first, args.warmup, args.decode)
    r["decode_tok_s"], r["ms_per_token"] = tps, ms
    refs.setdefault("kiln_toks", toks)
    return bandwidth_line("kiln", ftype, r, peak)
  if (msg := step(f"{ftype}: kiln decode", decode)): print(f"      {msg}", flush=True)
  def execute_only() -> str:
    """The last decode step's plan run again and again (the same cache rows written), the device synced around each round
    only: the step without the host's part of a feed (its inputs, variables, the logits' copy)."""
    sync, rounds = Sync(torch, args.torch_device), []
    for _ in range(5):
      sync(); t = time.perf_counter()  # noqa: E702
      for _ in range(20): dec.plan.execute()
      sync(); rounds.append((time.perf_counter() - t) / 20)  # noqa: E702
    r["execute_ms"] = 1e3 * statistics.median(rounds)
    gbps = r["weight_bytes"] / statistics.median(rounds) / 1e9
    return (f"kiln {ftype} decode step, plan.execute() alone: {r['execute_ms']:.3f} ms = {gbps:.1f} GB/s of matrices"
            f"{f' ({gbps / peak:.1%} of the peak)' if peak else ''}")
  if (msg := step(f"{ftype}: kiln decode step, execute only", execute_only)): print(f"      {msg}", flush=True)
  if (top := step(f"{ftype}: kiln decode step kernel by kernel", lambda: profile(dec, ftype))): print(top, flush=True)
  dump()


def bandwidth_line(engine: str, ftype: str, r: dict[str, Any], peak: float) -> str:
  r["weight_gbps"] = r["weight_bytes"] * r["decode_tok_s"] / 1e9
  if peak: r["hbm_gbps"], r["hbm_fraction"] = peak, r["weight_gbps"] / peak
  frac = f" = {r['hbm_fraction']:.1%} of {peak:.0f} GB/s (target 60%)" if peak else ""
  return (f"{engine} {ftype} decode: {r['decode_tok_s']:.1f} tokens/s, {r['ms_per_token']:.3f} ms/token (median step); "
          f"{r['weight_bytes'] / 1e6:.1f} MB of matrices a token x tokens/s = {r['weight_gbps']:.1f} GB/s{frac}")


def profile(dec: Any, ftype: str, top: int = 8) -> str:
  """The last decode step again (the plan keeps its inputs and variables: it writes the same cache rows), kernel by
  kernel, each timed alone: the longest summed by name; the whole table to $OUT/profile-llm-<type>.txt."""
  prof = dec.plan.execute_profiled()
  by: dict[str, list[float]] = {}
  for rec in prof:
    s = by.setdefault(rec.name, [0.0, 0, 0.0])
    s[0] += rec.time; s[1] += 1; s[2] += rec.bytes  # noqa: E702
  if (out := os.environ.get("OUT")):
    with open(os.path.join(out, f"profile-llm-{ftype}.txt"), "w") as f: f.write(prof.table())
  total = max(prof.total_time, 1e-12)
  lines = [f"      decode step kernels one by one: {total * 1e3:.3f} ms in all ({len(prof)} kernels); the longest:"]
  for k, (t, n, b) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
    lines.append(f"        {t * 1e3:8.3f} ms {t / total:6.1%}  x{n:<4d} {b / max(t, 1e-12) / 1e9:8.1f} GB/s  {k}")
  return "\n".join(lines)


def torch_rows(torch: Any, args: argparse.Namespace, cfg: dict[str, Any], held: dict[str, np.ndarray], peak: float, sync: Sync,
               kiln_toks: list[int] | None) -> dict[str, Any]:
  """torch float16 eager: prefill and decode timed as kiln's. Returns what torch_compile_row needs (the model, its row,
  the prompt, eager's greedy tokens)."""
  dev, dt = args.torch_device, torch.float16
  r: dict[str, Any] = {"engine": "torch eager", "shape": args.shape, "type": "F16", "device": dev, "prompt": args.prompt, "decode": args.decode}
  ROWS.append(r)
  st: dict[str, Any] = {"row": r}
  model = st["model"] = step("torch float16 model", lambda: torch_llama(torch, cfg, held, dev, dt, args.context))
  if model is None: return st
  r["weight_bytes"] = matrix_bytes(dict(model.named_buffers()))  # the cos/sin tables and the cache are 2-d too: taken out below
  r["weight_bytes"] -= sum(int(b.numel() * b.element_size()) for n, b in model.named_buffers() if n in ("cos", "sin", "kc", "vc"))
  prompt = [int(i) for i in np.random.default_rng(args.seed + 1).integers(0, cfg["vocab_size"], args.prompt)]
  ids = st["ids"] = torch.tensor(prompt, device=dev)

  def prefill() -> str:
    times = []
    with torch.no_grad():
      for _ in range(4):
        sync(); t = time.perf_counter(); model(ids, 0); sync(); times.append(time.perf_counter() - t)  # noqa: E702
    r["prefill_tok_s"] = args.prompt / statistics.median(times[1:])
    return f"torch eager prefill of {args.prompt} tokens: {1e3 * statistics.median(times[1:]):.2f} ms ({r['prefill_tok_s']:.0f} tokens/s)"
  if (msg := step("torch eager prefill", prefill)): print(f"      {msg}", flush=True)

  def decode() -> str:
    with torch.no_grad():
      first = int(model(ids, 0)[0].argmax())
      pos = [args.prompt]
      tps, ms, toks = time_decode(lambda tok: _one(torch, model, tok, pos, dev, False), first, args.warmup, args.decode)
    r["decode_tok_s"], r["ms_per_token"] = tps, ms
    st["toks"] = toks
    line = bandwidth_line("torch eager", "F16", r, peak)
    if kiln_toks is not None:
      same = _same(toks, kiln_toks)
      r["greedy_equal_kiln"] = f"{same}/{len(kiln_toks)}"
      line += f"\n      torch float16's own greedy tokens: the first {same} of {len(kiln_toks)} equal kiln's (its rounding: reported, not checked)"
    return line
  if (msg := step("torch eager decode", decode)): print(f"      {msg}", flush=True)
  dump()
  return st


def _one(torch: Any, fwd: Callable[[Any, Any], Any], tok: int, pos: list[int], dev: str, as_tensor: bool) -> int:
  """One greedy decode step of the torch model at position pos[0] (then advanced): the next token, read back (a sync a
  step, as kiln's logits copy). as_tensor: the position as a 1-element tensor (the static step torch.compile takes)."""
  p = torch.tensor([pos[0]], device=dev) if as_tensor else pos[0]
  pos[0] += 1
  return int(fwd(torch.tensor([tok], device=dev), p)[0].argmax())


def _same(a: Sequence[int], b: Sequence[int]) -> int:
  """How many tokens a and b agree on from the start."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def torch_compile_row(torch: Any, args: argparse.Namespace, st: dict[str, Any], peak: float) -> None:
  """torch.compile's decode step (args.compile_mode; its first call compiles), timed as eager's, its greedy tokens against eager's."""
  model, ids, dev = st["model"], st["ids"], args.torch_device
  rc: dict[str, Any] = {k: v for k, v in st["row"].items() if k in ("shape", "type", "device", "prompt", "decode", "weight_bytes")}
  rc["engine"] = f"torch.compile {args.compile_mode}"
  ROWS.append(rc)
  fwd = torch.compile(model, mode=args.compile_mode, dynamic=False)
  with torch.no_grad():
    first = int(model(ids, 0)[0].argmax())
    t = time.perf_counter()
    _one(torch, fwd, first, [args.prompt], dev, True)  # the compile; the step is run again below (the same cache rows)
    rc["compile_s"] = time.perf_counter() - t
    pos = [args.prompt]
    tps, ms, toks = time_decode(lambda tok: _one(torch, fwd, tok, pos, dev, True), first, args.warmup, args.decode)
  rc["decode_tok_s"], rc["ms_per_token"] = tps, ms
  line = f"{bandwidth_line(rc['engine'], 'F16', rc, peak)} (first call {rc['compile_s']:.0f} s)"
  if (eager := st.get("toks")) is not None:
    rc["greedy_equal_eager"] = f"{_same(toks, eager)}/{len(eager)}"
    line += f"; greedy tokens equal eager's: {rc['greedy_equal_eager']}"
  print(f"      {line}", flush=True)
  dump()


def _emulate(folder: str, tiny: bool) -> None:
  """kiln's CUDA on the CPU emulation (tests/cuda_emu.py of this checkout): a dry run of the CUDA path without a GPU; kiln's
  disk cache in `folder` (this run's own). tiny: the kernels are built unoptimised (the host compiler's time is what counts)."""
  import pytest
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from cuda_emu import driver_tests, emulating

  from kiln.codegen import registry
  from kiln.runtime.cuda import emulate
  mp = pytest.MonkeyPatch()
  drv = (mod := driver_tests()).make_fake_driver([], cc=(9, 0))
  emulating(drv, mp)
  if tiny: mp.setattr(emulate, "CXXFLAGS", tuple("-O0" if f == "-O2" else f for f in emulate.CXXFLAGS))
  mod.install_standin(mp, __import__("pathlib").Path(folder), drv)
  mp.setenv("KILN_CACHE", "1")
  registry.unregister_runtime("CUDA")


def main(argv: Sequence[str]) -> int:
  ap = argparse.ArgumentParser(prog="gpu_llm.py")
  ap.add_argument("--shape", choices=sorted(SHAPES), default="smol135m")
  ap.add_argument("--types", default="Q8_0,F16", help="the GGUF's matrix types, in order (F16, Q8_0, F32)")
  ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (random ids)")
  ap.add_argument("--decode", type=int, default=64, help="timed greedy decode steps")
  ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps before them")
  ap.add_argument("--check", type=int, default=4, help="greedy steps checked against the float32 torch model")
  ap.add_argument("--tol", type=float, default=1e-3, help="largest |kiln - torch float32| / max |logit| allowed")
  ap.add_argument("--context", type=int, default=512)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--budget", type=float, default=100.0, help="seconds from the start: later steps are skipped")
  ap.add_argument("--torch-compile", action="store_true", help="also time torch.compile's decode step")
  ap.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile's mode (reduce-overhead: CUDA graphs)")
  ap.add_argument("--compile-reserve", type=float, default=45.0, help="seconds torch.compile needs left to start")
  ap.add_argument("--hbm-gbps", type=float, default=0.0, help="the device's memory bandwidth, where it cannot be read (H100 SXM 3350, H200 4800)")
  ap.add_argument("--kiln-device", default="CUDA")
  ap.add_argument("--torch-device", default="cuda")
  ap.add_argument("--emulate", action="store_true")
  ap.add_argument("--work", default="", help="where the GGUF files go (default: a temporary folder, removed)")
  args = ap.parse_args(list(argv))
  if args.prompt + args.warmup + max(args.decode, args.check) + 1 > args.context:
    ap.error(f"--prompt + --warmup + --decode ({args.prompt + args.warmup + args.decode}) must fit the --context {args.context}")
  tmp = tempfile.mkdtemp(prefix="gpu_llm-")  # the GGUF files (unless --work) and, emulated, kiln's disk cache
  if not args.work: args.work = tmp
  if args.emulate:
    _emulate(tmp, args.shape == "tiny")
    if args.torch_device == "cuda": args.torch_device = "cpu"
  import torch
  torch.set_grad_enabled(False)
  torch.backends.cuda.matmul.allow_tf32 = False
  sync = Sync(torch, args.torch_device)
  cfg = SHAPES[args.shape]
  where = torch.cuda.get_device_name() if args.torch_device.startswith("cuda") else "the CPU"
  print(f"== llm decode on {where}: torch {torch.__version__}, kiln device {args.kiln_device}{' (emulated)' if args.emulate else ''}, "
        f"shape {args.shape} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}), types {args.types}, "
        f"prompt {args.prompt}, decode {args.decode}, context {args.context}, budget {args.budget:.0f} s", flush=True)
  peak, how = hbm_peak(torch, args.torch_device, args.hbm_gbps)
  msg = f"HBM peak {peak:.0f} GB/s ({how})" if peak else f"HBM peak not known ({how})"
  if (cp := step(f"torch copy on {args.torch_device}", lambda: copy_gbps(torch, args.torch_device, sync))):
    msg += f"; a torch copy moves {cp:.0f} GB/s (read + write)"
  print(f"      {msg}", flush=True)
  t = time.perf_counter()
  weights = step(f"random weights of {args.shape}", lambda: random_weights(cfg, args.seed))
  if weights is None:
    shutil.rmtree(tmp, ignore_errors=True)
    return 1
  print(f"      {sum(a.size for a in weights.values()) / 1e6:.1f}M weights in {time.perf_counter() - t:.1f} s", flush=True)
  refs: dict[str, Any] = {}  # "held": the first type's weights as its file holds them (torch's rows), "kiln_toks": kiln's greedy tokens
  for ftype in [s for s in args.types.split(",") if s]:
    if left(args.budget) < 15:
      print(f"skip  {ftype}: {left(args.budget):.0f} s of the budget left", flush=True)
      continue
    step(f"{ftype}", lambda ftype=ftype: kiln_rows(torch, args, cfg, weights, ftype, peak, refs))  # type: ignore[misc]
    if refs.get("held") is not None and "torch" not in refs:  # torch's rows once, after the first type's
      refs["torch"] = True
      if left(args.budget) < 10: print(f"skip  torch: {left(args.budget):.0f} s of the budget left", flush=True)
      else: refs["torch"] = step("torch", lambda: torch_rows(torch, args, cfg, refs["held"], peak, sync, refs.get("kiln_toks")))
      refs["held"] = None
      st = refs["torch"]
      if args.torch_compile and isinstance(st, dict) and st.get("model") is not None:  # before the other types: the baseline first
        if left(args.budget) < args.compile_reserve:
          print(f"skip  torch.compile: {left(args.budget):.0f} s of the budget left (it needs {args.compile_reserve:.0f})", flush=True)
        else: step(f"torch.compile ({args.compile_mode}) decode", lambda st=st: torch_compile_row(torch, args, st, peak))  # type: ignore[misc]
  dump()
  shutil.rmtree(tmp, ignore_errors=True)
  if args.emulate:  # the runtime dropped while the stand-in driver is still there (at exit its module is gone)
    import gc

    from kiln.codegen import registry
    from kiln.executor import cache
    gc.collect()
    cache.clear_memory_cache()  # its kernels hold the stand-in's modules
    registry.unregister_runtime("CUDA")
  print(f"== llm done in {time.perf_counter() - T0:.0f} s; {len(FAILS)} failed steps{': ' + ', '.join(FAILS) if FAILS else ''}", flush=True)
  return 1 if FAILS else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
