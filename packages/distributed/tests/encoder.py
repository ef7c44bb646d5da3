"""A BERT-style encoder built with kiln.graph for the distributed tests: token and position embeddings, per layer a
fused QKV projection split into heads, scaled and masked attention, output projection + residual + layernorm, a GELU FFN +
residual + layernorm; masked mean pooling. The batch is symbolic, so one plan serves every batch size up to `max_batch`."""
from __future__ import annotations

import numpy as np

from kiln.graph.tensor import Tensor, compile


def encoder(layers: int = 6, hid: int = 64, heads: int = 4, ffn: int = 256, seq: int = 16, vocab: int = 100, max_batch: int = 8,
            seed: int = 18):  # noqa: ANN201  (a kiln.graph Compiled)
  rng = np.random.default_rng(seed)
  def w(*s: int, scale: float = 0.1) -> Tensor: return Tensor((rng.standard_normal(s) * scale).astype(np.float32))
  dims = {"batch": (1, max_batch)}
  ids = Tensor.input("ids", ("batch", seq), np.int32, dims=dims)
  mask = Tensor.input("mask", ("batch", seq), np.float32, dims=dims)
  dh = hid // heads
  h = w(vocab, hid, scale=0.5).embedding(ids) + w(seq, hid)
  h = h.layernorm(w(hid) + 1, w(hid))
  add_mask = ((1.0 - mask) * -10000.0).reshape(-1, 1, 1, seq)
  for _ in range(layers):
    qkv = h.linear(w(3 * hid, hid), w(3 * hid))
    q, k, v = (qkv[:, :, i * hid:(i + 1) * hid].reshape(-1, seq, heads, dh).permute(0, 2, 1, 3) for i in range(3))
    att = (q @ k.transpose(-1, -2) * (1 / np.sqrt(dh)) + add_mask).softmax(-1)
    ctx = (att @ v).permute(0, 2, 1, 3).reshape(-1, seq, hid)
    h = (ctx.linear(w(hid, hid), w(hid)) + h).layernorm(w(hid) + 1, w(hid))
    h = (h.linear(w(ffn, hid), w(ffn)).gelu().linear(w(hid, ffn), w(hid)) + h).layernorm(w(hid) + 1, w(hid))
  m = mask.reshape(-1, seq, 1)
  pooled = (h * m).sum(1) / m.sum(1)
  return compile([pooled, h])


def feeds(batch: int, seq: int = 16, vocab: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  lengths = seq - rng.integers(0, seq // 2, batch)  # padded tails of random lengths
  mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
  return {"ids": rng.integers(0, vocab, (batch, seq)).astype(np.int32), "mask": mask}
