"""The forward graph of a decoder-only language model, per architecture, on kiln.graph's lazy Tensor.

One graph serves every position: a chunk of `seq` new tokens (ids and their positions fed; seq is fixed when the graph
is built), after `past` tokens (a runtime variable, 0..ctx) whose keys and values each layer reads from its cache
inputs `k{i}`/`v{i}` of shape (past, kv_heads, head_dim), position-major so that the filled part of a cache is its front
(the runtime binds them to buffers sized for the context; kv.py). Attention reads the cache and the new rows (past + seq
keys), with the causal mask from the positions (_attention). The output is the logits (every row, or the row `last`
names); each layer's new keys (after RoPE) and values are written into its cache at row `past` by the plan itself
(`writes`: Tensor.write_rows into the inputs `k{i}_rows`/`v{i}_rows`, the cache's whole buffers of `rows` rows), and the
attention reads them back from there. seq is a fixed size, not a variable: the code generator tiles and threads no
symbolic loop, so a chunk's matrix products over a symbolic seq ran about 3x slower than over a fixed one; the runtime
pads a shorter chunk (padded rows come after every real one, so the causal mask keeps them out of the real rows'
attention).

Weights come from `get(name)` in Hugging Face naming and layout: float32 numpy arrays (checkpoint.py's Checkpoint.tensor), or
for a matrix (a linear layer's weight, an embedding table) a QuantWeight (qweight.py: the stored format's codes and
scales, dequantised inside the kernels that read them); every choice between families is a field of ModelConfig
(config.py). Architectures: the Llama family (llama, mistral,
qwen2: RMSNorm, RoPE in HF's rotate_half layout with ModelConfig's frequency scaling, grouped-query attention, SwiGLU,
tied or untied embeddings, optional biases, a sliding window in the mask), gemma (embeddings scaled, RMSNorm as 1 + w,
GeGLU), phi3 (fused qkv and gate_up projections, partial rotary) and gpt2 (LayerNorm, learned positions, fused Conv1D
attention, tanh GELU).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.graph import Tensor
from kiln.ir.dtype import dtypes
from kiln.llm.config import SUPPORTED, ModelConfig
from kiln.llm.errors import LLMError, UnsupportedArchitecture
from kiln.llm.qweight import QuantWeight

Matrix = np.ndarray | QuantWeight
Get = Callable[[str], Matrix]


class ModelError(LLMError):
  """The model's configuration and weights do not fit the graph (a weight of the wrong shape)."""


def rope_tables(cfg: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin of position x frequency, (positions, rotary_dim / 2) float32, times longrope's attention factor; HF's
  table repeats them twice over the head. The frequencies are ModelConfig.rope_inv_freq's for a sequence of `positions`
  (dynamic and longrope scaling choose by it: one table for the whole context, where HF chooses per call)."""
  inv = cfg.rope_inv_freq(positions).astype(np.float64)
  ang = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
  f = cfg.rope_attention_factor()
  return (np.cos(ang) * f).astype(np.float32), (np.sin(ang) * f).astype(np.float32)


def _rope(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
  """HF's rotate_half RoPE on x (seq, heads, head_dim) over its first `rot` dims; cos/sin are (seq, 1, rot / 2)."""
  h = rot // 2
  x1, x2 = x[:, :, :h], x[:, :, h:rot]
  out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
  if rot < x.shape[2]: out.append(x[:, :, rot:])
  return Tensor.cat(out, 2)


def _act(x: Tensor, kind: str) -> Tensor:
  if kind == "silu": return x.silu()
  if kind == "gelu": return x.gelu()
  return 0.5 * x * (1.0 + ((x + 0.044715 * x * x * x) * math.sqrt(2.0 / math.pi)).tanh())  # gelu_tanh (HF's gelu_new)


@dataclass
class Forward:
  """The graph: `logits` (seq or 1 rows, vocab), and `writes`, the effects that store each layer's new keys and values
  (seq, kv_heads, head_dim) into its cache at row `past` (compile(..., writes=))."""
  logits: Tensor
  writes: list[Tensor]


class _W:
  """Weights by HF name as graph constants, each checked against the shape the graph needs."""
  def __init__(self, get: Get, arch: str):
    self.get, self.arch = get, arch

  def arr(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    g = self.get(name)
    if isinstance(g, QuantWeight): raise ModelError(f"{self.arch}: weight {name!r} is a packed {g.format} matrix; the graph needs it as float32")
    a = np.asarray(g, dtype=np.float32)
    if a.shape != shape: raise ModelError(f"{self.arch}: weight {name!r} has shape {a.shape}, the config needs {shape}")
    return a

  def mat(self, name: str, out: int, inn: int) -> Matrix:
    """A matrix (out, in): a QuantWeight as it comes, else float32."""
    g = self.get(name)
    if not isinstance(g, QuantWeight): return self.arr(name, (out, inn))
    if g.shape != (out, inn): raise ModelError(f"{self.arch}: weight {name!r} has shape {g.shape}, the config needs {(out, inn)}")
    return g

  def stacked(self, fused: str, names: tuple[str, ...], outs: tuple[int, ...], inn: int) -> Matrix | None:
    """The matrix `fused` where the architecture stores one (phi3), else `names` stacked as one where get can
    (Weights.stack), else None."""
    if self.arch == "phi3": return self.mat(fused, sum(outs), inn)
    stack = getattr(self.get, "stack", None)
    return None if stack is None else stack(names, outs, inn)

  def __call__(self, name: str, *shape: int) -> Tensor: return Tensor(self.arr(name, shape))

  def opt(self, on: bool, name: str, *shape: int) -> Tensor | None: return self(name, *shape) if on else None


def _linear(x: Tensor, w: Matrix, bias: Tensor | None = None) -> Tensor:
  return w.linear(x, bias) if isinstance(w, QuantWeight) else x.linear(Tensor(w), bias)


def _embedding(w: Matrix, ids: Tensor) -> Tensor:
  return w.embedding(ids) if isinstance(w, QuantWeight) else Tensor(w).embedding(ids)


def _split(y: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
  """The columns of y (rows, sum(sizes)) in consecutive groups of `sizes`."""
  ends = np.cumsum((0, *sizes)).tolist()
  return [y[:, a:b] for a, b in zip(ends[:-1], ends[1:])]


def _projections(w: _W, x: Tensor, d: int, fused: str, names: tuple[str, ...], sizes: tuple[int, ...], bias: bool) -> list[Tensor]:
  """x times each of the weights `names` (outputs `sizes`, each with its bias where `bias`), as one product where the
  checkpoint stores them as one (`fused`: phi3's qkv_proj, gate_up_proj) or they stack (Weights.stack: packed planes of
  one format), else one product each. x is (rows, d)."""
  if (m := w.stacked(fused, names, sizes, d)) is not None:
    b = Tensor(np.concatenate([w.arr(n.replace(".weight", ".bias"), (o,)) for n, o in zip(names, sizes)])) if bias else None
    return _split(_linear(x, m, b), sizes)
  return [_linear(x, w.mat(n, o, d), w.opt(bias, n.replace(".weight", ".bias"), o)) for n, o in zip(names, sizes)]


def _attention(q: Tensor, cache: tuple[Tensor, Tensor], new: tuple[Tensor, Tensor], mask: Tensor, cfg: ModelConfig) -> Tensor:
  """Grouped-query attention of q (seq, heads, hd) over the cached keys and values (past, kv_heads, hd) and the chunk's
  new ones (seq, kv_heads, hd); mask (seq, _keys(seq, past)) -> (seq, heads * hd).

  One query (a decode step) reads the cache and its own key apart, the softmax's max and sum taken over both (its mask
  covers the cache: the query at position past always reads its own key). On the
  cache joined to the new row (Tensor.cat), every step copied each layer's whole cache (a kernel per key and value
  cache, their time growing with the context) before reading it.

  A chunk of several queries takes its scores keys-major, (kvh, g, total, seq): total (past + seq) is symbolic, and
  the code generator vectorises and tiles only fixed-size axes, so with the keys innermost the scores were a scalar
  loop; with the queries innermost they are a register-tiled product over head_dim. The probabilities are realized
  before they meet v: inlined, the softmax's max and sum ran again for every output column."""
  seq, kvh, hd = q.shape[0], cfg.num_kv_heads, cfg.head_dim
  g = cfg.num_heads // kvh
  (kc, vc), (k, v) = cache, new
  if seq == 1:
    qg = q.reshape(kvh, g, hd) * (1.0 / math.sqrt(hd))  # (kvh, g, hd)
    s_c = mask.where(qg @ kc.permute(1, 2, 0), -math.inf)  # (kvh, g, past)
    s_n = (qg * k.reshape(kvh, 1, hd)).sum(-1, keepdims=True)  # (kvh, g, 1)
    m = s_c.max(-1, keepdims=True).maximum(s_n)  # past may be 0: the max over no keys is -inf
    e_c, e_n = (s_c - m).exp(), (s_n - m).exp()
    o = (e_c @ vc.permute(1, 0, 2) + e_n * v.reshape(kvh, 1, hd)) / (e_c.sum(-1, keepdims=True) + e_n)  # (kvh, g, hd)
    return o.reshape(1, cfg.num_heads * hd)
  kk, vv = Tensor.cat([kc, k], 0), Tensor.cat([vc, v], 0)
  qt = q.reshape(seq, kvh, g, hd).permute(1, 2, 3, 0) * (1.0 / math.sqrt(hd))  # (kvh, g, hd, seq)
  scores = mask.T.where(kk.permute(1, 0, 2).unsqueeze(1) @ qt, -math.inf)  # (kvh, g, total, seq)
  probs = scores.softmax(-2).contiguous()
  o = probs.permute(0, 1, 3, 2) @ vv.permute(1, 0, 2).unsqueeze(1)  # (kvh, g, seq, hd)
  return o.permute(2, 0, 1, 3).reshape(seq, cfg.num_heads * hd)


def _keys(seq: int, past: Any) -> Any:
  """The keys _attention's mask covers: the cache and the chunk's own (past + seq), or for one query the cache only."""
  return past if seq == 1 else past + seq


def _mask(cfg: ModelConfig, pos: Tensor, total: Any) -> Tensor:
  """(seq, total): key j is read by the query at position p where j <= p (and p - j < sliding_window where there is one)."""
  j, p = Tensor.arange(total, dtypes.int32).unsqueeze(0), pos.unsqueeze(1)
  m = j <= p
  return m if not cfg.sliding_window else m & (j > p - cfg.sliding_window)


@dataclass
class _Inputs:
  ids: Tensor
  pos: Tensor
  caches: list[tuple[Tensor, Tensor]]
  stores: list[tuple[Tensor, Tensor]]  # each layer's whole key and value buffers, where the chunk's rows are written
  last: Tensor | None  # the row whose logits to give (last-row graphs of seq > 1)

  def pick(self, x: Tensor) -> Tensor: return x if self.last is None else x.gather(self.last, 0)

  def write(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Layer i's new keys and values stored at row past of its cache: the values as written (read back from there)."""
    past = self.caches[i][0].shape[0]
    return self.stores[i][0].write_rows(k, past), self.stores[i][1].write_rows(v, past)


def _inputs(cfg: ModelConfig, ctx: int, seq: int, last_only: bool, rows: int | None) -> _Inputs:
  if rows is None: rows = ctx + seq
  if rows < ctx + seq: raise ModelError(f"a cache of {rows} rows cannot take {seq} rows after {ctx} cached ones")
  dims = {"past": (0, ctx)}
  ids = Tensor.input("ids", (seq,), dtypes.int32)
  pos = Tensor.input("pos", (seq,), dtypes.int32)
  row, whole = ("past", cfg.num_kv_heads, cfg.head_dim), (rows, cfg.num_kv_heads, cfg.head_dim)
  caches = [(Tensor.input(f"k{i}", row, dims=dims), Tensor.input(f"v{i}", row, dims=dims)) for i in range(cfg.num_layers)]
  stores = [(Tensor.input(f"k{i}_rows", whole), Tensor.input(f"v{i}_rows", whole)) for i in range(cfg.num_layers)]
  return _Inputs(ids, pos, caches, stores, Tensor.input("last", (1,), dtypes.int32) if last_only and seq > 1 else None)


def _norm(cfg: ModelConfig, w: _W, x: Tensor, name: str) -> Tensor:
  d = cfg.hidden_size
  if cfg.norm == "layer": return x.layernorm(w(name + ".weight", d), w(name + ".bias", d), eps=cfg.norm_eps)
  g = w.arr(name + ".weight", (d,))
  return x.rms_norm(Tensor(g + np.float32(1.0)) if cfg.norm_add_one else Tensor(g), eps=cfg.norm_eps)


def llama_like(cfg: ModelConfig, get: Get, ctx: int, seq: int, last_only: bool, rows: int | None = None) -> Forward:
  """The Llama family, Gemma and Phi-3: pre-norm blocks of RMSNorm, RoPE attention with GQA, gated MLP."""
  w = _W(get, cfg.arch)
  inp = _inputs(cfg, ctx, seq, last_only, rows)
  ids, pos, caches = inp.ids, inp.pos, inp.caches
  d, inter, hd, qd, kd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.q_size, cfg.kv_size
  embed = w.mat("model.embed_tokens.weight", cfg.vocab_size, d)
  x = _embedding(embed, ids)
  if cfg.embed_scale != 1.0: x = x * float(np.float32(cfg.embed_scale))  # HF rounds the normaliser to the weights' dtype
  cos_t, sin_t = rope_tables(cfg, ctx)
  cos, sin = Tensor(cos_t).embedding(pos).unsqueeze(1), Tensor(sin_t).embedding(pos).unsqueeze(1)  # (seq, 1, rot / 2)
  writes: list[Tensor] = []
  mask: Tensor | None = None
  for i, (kc, vc) in enumerate(caches):
    p = f"model.layers.{i}."
    h = _norm(cfg, w, x, p + "input_layernorm")
    q, k, v = _projections(w, h, d, p + "self_attn.qkv_proj.weight", tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv"), (qd, kd, kd),
                           cfg.attention_bias)
    q = _rope(q.reshape(seq, cfg.num_heads, hd), cos, sin, cfg.rotary_dim)
    k = _rope(k.reshape(seq, cfg.num_kv_heads, hd), cos, sin, cfg.rotary_dim)
    k, v = inp.write(i, k, v.reshape(seq, cfg.num_kv_heads, hd))
    writes += [k, v]
    if mask is None: mask = _mask(cfg, pos, _keys(seq, kc.shape[0]))
    a = _attention(q, (kc, vc), (k, v), mask, cfg)
    x = x + _linear(a, w.mat(p + "self_attn.o_proj.weight", d, qd), w.opt(cfg.attention_out_bias, p + "self_attn.o_proj.bias", d))
    h = _norm(cfg, w, x, p + "post_attention_layernorm")
    gate, up = _projections(w, h, d, p + "mlp.gate_up_proj.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (inter, inter),
                            cfg.mlp_bias)
    gate, up = gate.contiguous(), up.contiguous()  # each its own product: left to the scheduler, both ran in one kernel 3-8x slower
    x = x + _linear(_act(gate, cfg.act) * up, w.mat(p + "mlp.down_proj.weight", d, inter), w.opt(cfg.mlp_bias, p + "mlp.down_proj.bias", d))
  if last_only: x = inp.pick(x)  # (1, hidden): the head runs on one row
  x = _norm(cfg, w, x, "model.norm")
  head = embed if cfg.tie_word_embeddings else w.mat("lm_head.weight", cfg.vocab_size, d)
  return Forward(_linear(x, head), writes)


def gpt2(cfg: ModelConfig, get: Get, ctx: int, seq: int, last_only: bool, rows: int | None = None) -> Forward:
  """GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v projection, tied head. Its Conv1D weights come (out, in)
  like every linear's (the checkpoint transposes HF's (in, out))."""
  w = _W(get, cfg.arch)
  inp = _inputs(cfg, ctx, seq, last_only, rows)
  ids, pos, caches = inp.ids, inp.pos, inp.caches
  hd, d, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
  if ctx > cfg.max_position: raise ModelError(f"gpt2: a context of {ctx} is past its {cfg.max_position} learned positions")
  wte = w.mat("transformer.wte.weight", cfg.vocab_size, d)
  x = _embedding(wte, ids) + _embedding(w.mat("transformer.wpe.weight", cfg.max_position, d), pos)
  writes: list[Tensor] = []
  mask: Tensor | None = None
  for i, (kc, vc) in enumerate(caches):
    p = f"transformer.h.{i}."
    def lin(x: Tensor, name: str, out: int, inn: int) -> Tensor: return _linear(x, w.mat(p + name + ".weight", out, inn), w(p + name + ".bias", out))  # noqa: B023
    qkv = lin(_norm(cfg, w, x, p + "ln_1"), "attn.c_attn", 3 * d, d)
    q, k, v = (qkv[:, j * d:(j + 1) * d].reshape(seq, cfg.num_heads, hd) for j in range(3))
    k, v = inp.write(i, k, v)
    writes += [k, v]
    if mask is None: mask = _mask(cfg, pos, _keys(seq, kc.shape[0]))
    x = x + lin(_attention(q, (kc, vc), (k, v), mask, cfg), "attn.c_proj", d, d)
    x = x + lin(_act(lin(_norm(cfg, w, x, p + "ln_2"), "mlp.c_fc", inter, d), cfg.act), "mlp.c_proj", d, inter)
  if last_only: x = inp.pick(x)  # (1, hidden): the head runs on one row
  x = _norm(cfg, w, x, "transformer.ln_f")
  return Forward(_linear(x, wte), writes)


def forward(cfg: ModelConfig, get: Get, ctx: int, seq: int, last_only: bool = False, rows: int | None = None) -> Forward:
  """The graph for `cfg`: chunks of `seq` tokens after 0..ctx cached ones (the runtime keeps the real rows within ctx),
  over caches of `rows` rows (at least ctx + seq, the default: a padded chunk's rows are written past the context)."""
  if cfg.arch not in SUPPORTED: raise UnsupportedArchitecture(f"architecture {cfg.arch!r} is not supported (kiln.llm runs {', '.join(SUPPORTED)})")
  build = gpt2 if cfg.positions == "learned" else llama_like
  return build(cfg, get, ctx, seq, last_only, rows)
