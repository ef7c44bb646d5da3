"""kiln.graph on CUDA (issue 40): ONNX models and tensor graphs compiled with device="CUDA" run on the emulated GPU of
cuda_emu.py (the CUDA runtime's own code over the stand-in for pycuda.driver, every kernel's CUDA C run on the CPU),
checked against onnxruntime. The plan uploads its weights once, at load; each run copies each input in and each output
out once. Nothing here ran on a GPU: packages/graph/benchmarks/gpu_models.py does that."""
from __future__ import annotations

import os
import shutil
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "graph", "tests"))
from cuda_emu import emulated_gpu  # noqa: E402
from onnx_case import N, f32, model, ort  # noqa: E402

from kiln.executor import cache  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402
from kiln.graph.lazy import IndexOutOfRangeError  # noqa: E402
from kiln.graph.tensor import Tensor, compile  # noqa: E402
from kiln.runtime.cuda.compiler import CUDACompiler  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no host C++ compiler to emulate CUDA")


@pytest.fixture
def gpu(monkeypatch, tmp_path):
  monkeypatch.setenv("KILN_COMPILE_THREADS", "4")
  with emulated_gpu(monkeypatch, tmp_path) as (g, _): yield g


def _ort(m, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
  return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _tiled(plan) -> int:  # type: ignore[no-untyped-def]
  """How many of the plan's kernels are tiled matmuls (render/cuda_matmul.py)."""
  return sum(1 for p in plan.prepared_ops if hasattr(p, "kernel") and str(p.kernel.applied_opts[:1]).startswith("['TILED_MATMUL"))


def _convnet() -> tuple:
  """Conv (3x3, padded) + BatchNorm + Relu, a bottleneck of two 1x1 convs with the residual Add, max pool, global pool, Gemm."""
  x = f32(2, 4, 8, 8)
  inits = {"w1": f32(16, 4, 3, 3, lo=-.5, hi=.5), "s": f32(16, lo=.5, hi=1.5), "b": f32(16), "mu": f32(16), "var": f32(16, lo=.5, hi=2),
           "w2": f32(32, 16, 1, 1, lo=-.3, hi=.3), "b2": f32(32), "w3": f32(16, 32, 1, 1, lo=-.3, hi=.3), "b3": f32(16),
           "fw": f32(16, 16, lo=-.3, hi=.3), "fb": f32(16)}
  nodes = [N("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), N("BatchNormalization", ["c1", "s", "b", "mu", "var"], ["n1"]),
           N("Relu", ["n1"], ["r1"]), N("Conv", ["r1", "w2", "b2"], ["c2"]), N("Relu", ["c2"], ["r2"]), N("Conv", ["r2", "w3", "b3"], ["c3"]),
           N("Add", ["c3", "r1"], ["a"]), N("Relu", ["a"], ["r3"]), N("MaxPool", ["r3"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
           N("GlobalAveragePool", ["p"], ["g"]), N("Flatten", ["g"], ["f"]), N("Gemm", ["f", "fw", "fb"], ["y"], transB=1)]
  m = model(nodes, {"x": x}, {"y": np.float32}, inits)
  return m, x


def test_convnet(gpu, monkeypatch) -> None:
  """Conv (3x3, padded) + BatchNorm + Relu, a bottleneck of two 1x1 convs with the residual Add, max pool, global pool,
  Gemm. The convs are tiled matmuls: the 1x1 ones' pixels index as a reshape's (p // w) * w + p % w, which the matcher
  sees as p once simplified; the 3x3 one reads its padded input's windows element by element (implicit GEMM). The plan's
  distinct kernels compile once each, on the runtime's compile_threads (KILN_COMPILE_THREADS), before it is built. Two
  runs with other inputs: the weights stay on the device."""
  seen: set[str] = set()
  real = CUDACompiler.compile
  def compile_(self, spec):  # type: ignore[no-untyped-def]
    seen.add(threading.current_thread().name)
    return real(self, spec)
  monkeypatch.setattr(CUDACompiler, "compile", compile_)
  m, x = _convnet()
  before = cache.cache_stats()["compiles"]
  km = konnx.load(m, device="CUDA")
  assert _tiled(km.plan) == 3, km.summary()  # the two 1x1 convs, and the padded 3x3 one as an implicit GEMM
  assert cache.cache_stats()["compiles"] - before == len({p.kernel.key for p in km.plan.prepared_ops if hasattr(p, "kernel")})
  assert len(seen) > 1 and threading.current_thread().name not in seen, seen
  at_load = dict(gpu.stats)
  assert at_load["launches"] == 0 and at_load["dtoh"] == 0
  for xv in (x, f32(2, 4, 8, 8)):
    np.testing.assert_allclose(km.run({"x": xv})["y"], _ort(m, {"x": xv})[0], rtol=1e-4, atol=1e-4)
  st = gpu.stats
  assert st["htod"] - at_load["htod"] == 2 and st["dtoh"] == 2, st  # one input in, one output out, per run
  assert st["launches"] == 2 * len(km.plan.kernels)


def _encoder(seq: int = 16, d: int = 32, heads: int = 2, vocab: int = 40) -> tuple:
  """A BERT-style post-LN encoder layer over token ids, as torch.onnx.export writes one: Gather embeddings, LayerNormalization,
  one QKV MatMul split into heads (Reshape, Transpose), scaled scores, Softmax, MatMul, output projection with residual,
  LayerNormalization, an exact-GELU (Erf) MLP. The batch dim is named ("batch")."""
  hd = d // heads
  inits = {"emb": f32(vocab, d), "pos": f32(seq, d), "g1": f32(d, lo=.5, hi=1.5), "b1": f32(d), "wqkv": f32(d, 3 * d, lo=-.3, hi=.3),
           "bqkv": f32(3 * d), "wo": f32(d, d, lo=-.3, hi=.3), "bo": f32(d), "g2": f32(d, lo=.5, hi=1.5), "b2": f32(d),
           "w1": f32(d, 2 * d, lo=-.3, hi=.3), "bm1": f32(2 * d), "w2": f32(2 * d, d, lo=-.3, hi=.3), "bm2": f32(d), "g3": f32(d, lo=.5, hi=1.5),
           "b3": f32(d), "shape_h": np.array([0, seq, 3, heads, hd], np.int64), "shape_o": np.array([0, seq, d], np.int64),
           "scale": np.array(1 / np.sqrt(hd), np.float32), "half": np.array(.5, np.float32), "one": np.array(1, np.float32),
           "rsqrt2": np.array(1 / np.sqrt(2), np.float32)}
  nodes = [N("Gather", ["emb", "ids"], ["e"]), N("Add", ["e", "pos"], ["ep"]),
           N("LayerNormalization", ["ep", "g1", "b1"], ["h"], axis=-1, epsilon=1e-5),
           N("MatMul", ["h", "wqkv"], ["qkv0"]), N("Add", ["qkv0", "bqkv"], ["qkv1"]), N("Reshape", ["qkv1", "shape_h"], ["qkv2"]),
           N("Transpose", ["qkv2"], ["qkv"], perm=[2, 0, 3, 1, 4]), N("Split", ["qkv"], ["q0", "k0", "v0"], axis=0, num_outputs=3),
           N("Squeeze", ["q0", "zero"], ["q"]), N("Squeeze", ["k0", "zero"], ["k"]), N("Squeeze", ["v0", "zero"], ["v"]),
           N("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N("MatMul", ["q", "kt"], ["s0"]), N("Mul", ["s0", "scale"], ["s"]),
           N("Softmax", ["s"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["o0"]), N("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
           N("Reshape", ["o1", "shape_o"], ["o2"]), N("MatMul", ["o2", "wo"], ["o3"]), N("Add", ["o3", "bo"], ["o4"]),
           N("Add", ["o4", "h"], ["r1"]), N("LayerNormalization", ["r1", "g2", "b2"], ["h2"], axis=-1, epsilon=1e-5),
           N("MatMul", ["h2", "w1"], ["f0"]), N("Add", ["f0", "bm1"], ["f1"]), N("Mul", ["f1", "rsqrt2"], ["f2"]), N("Erf", ["f2"], ["f3"]),
           N("Add", ["f3", "one"], ["f4"]), N("Mul", ["f1", "f4"], ["f5"]), N("Mul", ["f5", "half"], ["f6"]),
           N("MatMul", ["f6", "w2"], ["f7"]), N("Add", ["f7", "bm2"], ["f8"]), N("Add", ["f8", "h2"], ["r2"]),
           N("LayerNormalization", ["r2", "g3", "b3"], ["y"], axis=-1, epsilon=1e-5)]
  inits["zero"] = np.array([0], np.int64)
  ids = np.random.default_rng(5).integers(0, vocab, (2, seq)).astype(np.int64)
  m = model(nodes, {"ids": ids}, {"y": np.float32}, inits, opset=18)
  m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
  return m, ids, vocab


def test_encoder_and_checked_indices(gpu) -> None:
  """The encoder at a batch of 2, every matmul tiled: QKV, the scores (q and k both read from the QKV output: A and B one
  buffer), probabilities x V, the output projection and the MLP (bias, residual and GELU in the epilogue), each weight
  as stored, not in the CPU's blocks of 32 columns (few_rows.py: a batch of 32-column products, mostly padding in a
  128-column tile). A token id out of range is the IndexOutOfRangeError the CPU gives (the index check read back from
  the device), and the plan runs good ids afterwards."""
  m, ids, vocab = _encoder()
  km = konnx.load(m, device="CUDA", dims={"batch": 2})
  tiled = [p.kernel for p in km.plan.prepared_ops if hasattr(p, "kernel") and str(p.kernel.applied_opts[:1]).startswith("['TILED_MATMUL")]
  assert len(tiled) == 6, km.summary()
  names = {k.name for k in tiled}  # the QKV and MLP products over whole rows of 96 and 64 columns, not (rows, N/32, 32)
  assert {"reduce_2x16x96", "reduce_2x16x64"} <= names, names
  np.testing.assert_allclose(km.run({"ids": ids})["y"], _ort(m, {"ids": ids})[0], rtol=1e-4, atol=1e-4)
  bad = ids.copy()
  bad[1, 3] = vocab
  with pytest.raises(IndexOutOfRangeError, match=str(vocab)): km.run({"ids": bad})
  np.testing.assert_allclose(km.run({"ids": ids[::-1].copy()})["y"], _ort(m, {"ids": ids[::-1].copy()})[0], rtol=1e-4, atol=1e-4)


def test_a_dynamic_batch_keeps_the_tiled_products(gpu) -> None:
  """The encoder loaded for batches of 1 to 4, and the convnet for 1 to 5: the products over a symbolic batch are tiled
  too, the batch being the outermost batch axis (the grid's z follows it; the kernel's body never reads it:
  contraction.py), and one plan gives onnxruntime's answer at every batch in its bounds."""
  m, ids, vocab = _encoder()
  km = konnx.load(m, device="CUDA", dims={"batch": (1, 4)})
  tiled = [p.kernel for p in km.plan.prepared_ops if hasattr(p, "kernel") and str(p.kernel.applied_opts[:1]).startswith("['TILED_MATMUL")]
  assert len(tiled) >= 4 and all(k.var_names for k in tiled), km.summary()
  for n in (4, 1, 3):
    x = np.random.default_rng(n).integers(0, vocab, (n, ids.shape[1])).astype(np.int64)
    np.testing.assert_allclose(km.run({"ids": x})["y"], _ort(m, {"ids": x})[0], rtol=1e-4, atol=1e-4)
  m, _ = _convnet()  # the convolutions' images are the batch: implicit GEMMs over a symbolic batch
  m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
  km = konnx.load(m, device="CUDA", dims={"batch": (1, 5)})
  assert _tiled(km.plan) == 3, km.summary()
  for n in (5, 2):
    xv = f32(n, 4, 8, 8)
    np.testing.assert_allclose(km.run({"x": xv})["y"], _ort(m, {"x": xv})[0], rtol=1e-4, atol=1e-4)


def test_symbolic_batch(gpu) -> None:
  """One plan for every batch in its bounds (the sizes passed to each launch): run at the top, the bottom and between."""
  wv = np.random.default_rng(2).standard_normal((16, 24)).astype(np.float32)
  x = Tensor.input("x", ("b", 16), dims={"b": (1, 8)})
  c = compile([(x @ Tensor(wv)).relu().sum(-1)], "CUDA")
  assert _tiled(c.plan) == 0  # the matrix's own rows are symbolic: the generic kernel (only an outer batch may be)
  for n in (8, 1, 3):
    xv = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32)
    np.testing.assert_allclose(c.run({"x": xv})[0], np.maximum(xv @ wv, 0).sum(-1), rtol=1e-5, atol=1e-5)


def test_a_window_read_as_a_matrix_is_aligned(gpu) -> None:
  """x[1:] of a flat buffer read as a 16x16 matrix: its view started 4 bytes into the buffer, and the tiled matmul's float4
  loads need 16 (a RuntimeLaunchError at bind before). The view starts on the 16-byte boundary below, its index moved up."""
  xv = np.random.default_rng(0).standard_normal(16 * 16 + 1).astype(np.float32)
  wv = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
  x = Tensor.input("x", (16 * 16 + 1,))
  y = (x * 2.0).contiguous()[1:].reshape(16, 16) @ Tensor(wv)
  c = compile([y], "CUDA")
  views = [p for p in c.plan.prepared_ops if type(p).__name__ == "PreparedBufferView"]
  assert views and all(v.byte_offset % 16 == 0 for v in views)
  np.testing.assert_allclose(c.run({"x": xv})[0], (xv * 2)[1:].reshape(16, 16) @ wv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", ["float16", "float32"])
def test_half_convolutions_on_tensor_cores(gpu, dt: str) -> None:
  """A float16 ONNX conv stack (3x3 padded, stride 2, 1x1) runs its convolutions as implicit GEMMs on tensor cores (mma),
  float32 on the SIMT tile; against kiln on the CPU, which computes float16 in float32 and rounds as the GPU kernels do
  (onnxruntime's CPU float16 convolution is not the reference: it has none for every shape)."""
  rng = np.random.default_rng(9)
  npdt = np.dtype(dt)
  x = rng.uniform(-1, 1, (2, 8, 10, 10)).astype(npdt)
  inits = {"w1": rng.uniform(-.3, .3, (16, 8, 3, 3)).astype(npdt), "b1": rng.uniform(-.1, .1, 16).astype(npdt),
           "w2": rng.uniform(-.3, .3, (16, 16, 3, 3)).astype(npdt), "w3": rng.uniform(-.3, .3, (8, 16, 1, 1)).astype(npdt)}
  nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["r1"]),
           N("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]), N("Relu", ["c2"], ["r2"]), N("Conv", ["r2", "w3"], ["y"])]
  m = model(nodes, {"x": x}, {"y": npdt}, inits)
  want = konnx.load(m).run({"x": x})["y"]
  km = konnx.load(m, device="CUDA")
  kinds = [str(p.kernel.applied_opts[0]) for p in km.plan.prepared_ops if hasattr(p, "kernel") and p.kernel.applied_opts
           and str(p.kernel.applied_opts[0]).startswith("TILED_MATMUL")]
  assert len(kinds) == 2 and all(k.startswith("TILED_MATMUL(" + ("mma" if dt == "float16" else "simt")) for k in kinds), kinds
  got = km.run({"x": x})["y"]
  assert got.dtype == npdt
  tol = 2e-3 if dt == "float16" else 1e-5
  np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol * np.abs(want).max())


def test_a_conv_with_few_tiles_sums_k_in_chunks_on_the_gpu(gpu) -> None:
  """conv._gpu_k_chunks: a product whose 64x64 tiles give fewer blocks than half the multiprocessors (ResNet-50 at batch
  1 over 7x7 maps: 8 blocks of K = 4608 on an H200's 132 SMs) sums K in chunks of input channels, each chunk a batch of
  the tiled kernel's grid, then the partials: both kernels tiled or summed on the device, the result the conv's."""
  import importlib

  from kiln.codegen.registry import get_runtime
  from kiln.graph.build_target import building_for
  conv_ref = importlib.import_module("test_conv").conv_ref
  get_runtime("CUDA").sms = 132  # type: ignore[attr-defined]  # an H200's; the stand-in driver cannot say
  rng = np.random.default_rng(3)
  x, w = rng.uniform(-1, 1, (1, 256, 7, 7)).astype(np.float32), rng.uniform(-.1, .1, (64, 256, 3, 3)).astype(np.float32)
  with building_for("CUDA"): y = Tensor.input("x", x.shape).conv2d(Tensor(w), padding=1).relu()
  c = compile([y], "CUDA")
  names = [k.ast.arg for k in c.kernels]
  assert "reduce_4x1x1x64x49" in names, names  # K = 2304 in 4 chunks of 64 channels' taps (each at least 512)
  assert _tiled(c.plan) >= 1
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(conv_ref(x, w, None, [1, 1], [(1, 1)] * 2, [1, 1], 1), 0), rtol=1e-4, atol=1e-4)
