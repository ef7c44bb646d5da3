"""What a user who exports a PyTorch model to ONNX can run on kiln today: common torch modules (vision, attention,
activations, reductions, padding, recurrent) exported with torch.onnx.export (the TorchScript exporter, opset 17), loaded
with kiln.graph.onnx and run against onnxruntime on the same file. Needs torch and onnxruntime: run it in the bench
environment (`scripts/export-check`), never in the dev or test one. Each model is exported twice: with fixed sizes, and with
a dynamic batch (and sequence, where it has one) loaded with bounds and run at two sizes. Prints one line per export: OK with the largest
difference from onnxruntime and the kernel count, REFUSED with kiln's error (an operator or attribute kiln does not
support), or WRONG. Exits 1 when any result is WRONG or kiln fails with anything but its own typed error."""
from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

TOL = 1e-4  # absolute, on outputs of magnitude ~1-10


def models(torch: Any) -> dict[str, Callable[[], tuple[Any, tuple[Any, ...], tuple[str, ...]]]]:
  nn, F = torch.nn, torch.nn.functional

  class ResBlock(nn.Module):
    def __init__(s, c: int):
      super().__init__()
      s.c1, s.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
      s.c2, s.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
    def forward(s, x: Any) -> Any: return F.relu(x + s.b2(s.c2(F.relu(s.b1(s.c1(x))))))

  class ResNetish(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.stem = nn.Sequential(nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
      s.l1, s.down, s.l2, s.fc = ResBlock(16), nn.Conv2d(16, 32, 3, stride=2, padding=1), ResBlock(32), nn.Linear(32, 10)
    def forward(s, x: Any) -> Any: return s.fc(torch.flatten(F.adaptive_avg_pool2d(s.l2(s.down(s.l1(s.stem(x)))), 1), 1))

  class MobileBlock(nn.Module):  # MobileNetV3's: depthwise, relu6, hardswish, squeeze-excite with hardsigmoid
    def __init__(s, c: int = 16):
      super().__init__()
      s.dw, s.pw = nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, 2 * c, 1)
      s.se1, s.se2 = nn.Linear(2 * c, c // 2), nn.Linear(c // 2, 2 * c)
    def forward(s, x: Any) -> Any:
      y = F.hardswish(s.pw(F.relu6(s.dw(x))))
      return y * F.hardsigmoid(s.se2(F.relu(s.se1(y.mean((2, 3))))))[:, :, None, None]

  class UNetish(nn.Module):  # GroupNorm, leaky relu, nearest upsampling, skip concat
    def __init__(s) -> None:
      super().__init__()
      s.e, s.g, s.d = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(16, 4, 3, padding=1)
    def forward(s, x: Any) -> Any:
      a = F.leaky_relu(s.g(s.e(x)), 0.1)
      return s.d(torch.cat([a, F.interpolate(F.max_pool2d(a, 2), scale_factor=2, mode="nearest")], 1))

  class GPTBlock(nn.Module):  # pre-LN causal self-attention (tril mask, masked_fill -inf), GELU tanh MLP
    def __init__(s, d: int = 64, h: int = 4):
      super().__init__()
      s.h, s.ln1, s.qkv, s.o = h, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
      s.ln2, s.f1, s.f2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(s, x: Any) -> Any:
      B, T, C = x.shape
      q, k, v = (t.view(B, T, s.h, C // s.h).transpose(1, 2) for t in s.qkv(s.ln1(x)).split(C, 2))
      att = ((q @ k.transpose(-2, -1)) / (C // s.h) ** 0.5).masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf")).softmax(-1)
      x = x + s.o((att @ v).transpose(1, 2).reshape(B, T, C))
      return x + s.f2(F.gelu(s.f1(s.ln2(x)), approximate="tanh"))

  class SDPA(nn.Module):
    def forward(s, q: Any, k: Any, v: Any) -> Any: return F.scaled_dot_product_attention(q, k, v, is_causal=True)

  class EinsumCumsum(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.w = nn.Parameter(torch.randn(4, 8, 8))
    def forward(s, x: Any) -> Any: return torch.einsum("bhi,hij->bhj", x, s.w).cumsum(-1)

  class Activations(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.p = nn.PReLU(6)
    def forward(s, x: Any) -> Any:
      return torch.cat([F.elu(x), F.selu(x), F.softplus(x), F.mish(x), s.p(x), F.silu(x), torch.clamp(x, -0.5, 0.7), F.softsign(x),
                        x.floor(), x.ceil(), x.round(), torch.sign(x), torch.cos(x), torch.sin(x), x.abs()], 1)

  class Reductions(nn.Module):
    def forward(s, x: Any) -> Any: return torch.stack([x.argmax(-1).float(), x.logsumexp(-1), x.norm(dim=-1), x.amax(-1), x.std(-1)], -1)

  class PadRepeat(nn.Module):
    def forward(s, x: Any) -> Any:
      return torch.cat([F.pad(x, (1, 2, 0, 1), mode="reflect"), F.pad(x, (1, 2, 0, 1), mode="replicate")], 1).repeat(1, 2, 1, 1)

  class EmbedPositions(nn.Module):  # position ids from an attention mask's cumsum, as HF models compute them
    def __init__(s) -> None:
      super().__init__()
      s.e, s.pos = nn.Embedding(100, 32), nn.Embedding(16, 32)
    def forward(s, ids: Any, mask: Any) -> Any:
      return F.layer_norm(s.e(ids) + s.pos((mask.cumsum(-1) * mask - 1).clamp(min=0)), (32,)) * mask[..., None]

  class LSTM(nn.Module):
    def __init__(s) -> None:
      super().__init__()
      s.l = nn.LSTM(8, 16, batch_first=True)
    def forward(s, x: Any) -> Any: return s.l(x)[0]

  r = torch.randn
  mask = torch.cat([torch.ones(2, 12, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)], 1)
  seq = ("batch", "seq")  # inputs whose axis 1 is a sequence: exported dynamic too
  return {
    "ResNet-style CNN (conv, batch norm, relu, max pool, adaptive average pool, linear)": lambda: (ResNetish(), (r(2, 3, 64, 64),), ()),
    "MobileNetV3 block (depthwise conv, relu6, hardswish, hardsigmoid squeeze-excite)": lambda: (MobileBlock(), (r(2, 16, 16, 16),), ()),
    "UNet-style block (GroupNorm, leaky relu, nearest interpolate, concat)": lambda: (UNetish(), (r(2, 3, 32, 32),), ()),
    "GPT block (causal tril mask, masked_fill -inf, softmax, GELU tanh)": lambda: (GPTBlock(), (r(2, 16, 64),), seq),
    "scaled_dot_product_attention, is_causal": lambda: (SDPA(), (r(2, 4, 16, 8), r(2, 4, 16, 8), r(2, 4, 16, 8)), ()),
    "einsum and cumsum": lambda: (EinsumCumsum(), (r(3, 4, 8),), ()),
    "activations (elu, selu, softplus, mish, prelu, silu, clamp, softsign, floor, ceil, round, sign, cos, sin)":
      lambda: (Activations(), (r(2, 6, 5) * 3,), ()),
    "reductions (argmax, logsumexp, norm, amax, std)": lambda: (Reductions(), (r(3, 4, 7),), ()),
    "reflect and replicate padding, repeat": lambda: (PadRepeat(), (r(2, 3, 5, 6),), ()),
    "embedding with position ids from a mask's cumsum": lambda: (EmbedPositions(), (torch.randint(0, 100, (2, 16)), mask), seq),
    "LSTM": lambda: (LSTM(), (r(2, 5, 8),), ()),
  }


def resized(a: np.ndarray, dyn: tuple[str, ...]) -> np.ndarray:
  """Another size for a dynamic export's second run: one more batch row (the first again), three fewer sequence steps."""
  out = np.concatenate([a, a[:1]], 0)
  return out[:, :-3] if "seq" in dyn else out


def main() -> int:
  import onnx
  import onnxruntime as ort
  import torch

  from kiln.graph import ONNXError
  from kiln.graph import onnx as konnx
  torch.manual_seed(0)
  bad = 0
  for name, make in models(torch).items():
    m, args, seqdims = make()
    m.eval()
    names = [f"in{i}" for i in range(len(args))]
    for dynamic in (False, True):
      dyn = tuple(seqdims) or ("batch",)
      axes = {k: {i: d for i, d in enumerate(dyn)} for k in names} if dynamic else None
      buf = io.BytesIO()
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
          with torch.no_grad(): torch.onnx.export(m, args, buf, dynamo=False, opset_version=17, input_names=names, dynamic_axes=axes)
        except Exception as e:
          print(f"EXPORT FAILED  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
          break
      data = buf.getvalue()
      ops = " ".join(sorted({n.op_type for n in onnx.load_from_string(data).graph.node}))
      feeds = [{k: a.numpy() for k, a in zip(names, args)}]
      if dynamic: feeds.append({k: resized(v, dyn) for k, v in feeds[0].items()})
      label = f"{name}{' (dynamic ' + ', '.join(dyn) + ')' if dynamic else ''}"
      try:
        km = konnx.load(data, dims={k: b for k, b in {"batch": (1, 8), "seq": (1, 16)}.items() if k in dyn} if dynamic else None)  # names it has
        errs, shapes_ok = [], True
        for f in feeds:
          want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, f)
          got = list(km.run(f).values())
          errs += [float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) for g, w in zip(got, want)]
          shapes_ok &= all(g.shape == w.shape for g, w in zip(got, want))
      except ONNXError as e:
        print(f"REFUSED  {label}: {str(e).splitlines()[0][:160]}\n         ops: {ops}")
        continue
      except Exception as e:  # anything but kiln's own typed error is a bug
        bad += 1
        print(f"FAILED   {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}\n         ops: {ops}")
        continue
      ok = max(errs) <= TOL and shapes_ok
      bad += not ok
      kernels = len(km.plan.kernels) if km.plan else 0
      sizes = f", at {len(feeds)} sizes" if dynamic else ""
      print(f"{'OK' if ok else 'WRONG':8} {label}: max |kiln - onnxruntime| {max(errs):.1e}, {kernels} kernels{sizes}\n         ops: {ops}")
  return 1 if bad else 0


if __name__ == "__main__": sys.exit(main())
