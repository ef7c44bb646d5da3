"""Matrices kept in their stored format (qweight.py) against the numpy oracle: the planes dequantise to what
Checkpoint.tensor gives bit for bit, and a model whose matrices stay packed gives the float32 path's logits to float32
accumulation order. These are the float products (KILN_LLM_INT8=0); test_int8_products.py has the int8 ones."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from checkpoint_files import hf_weights, tiny_config, write_gguf, write_hf

from kiln.graph import Tensor
from kiln.llm import load
from kiln.llm.checkpoint_open import open_checkpoint
from kiln.llm.qrepack import REPACK
from kiln.llm.qweight import BYTES, PACKED, QuantWeight, pack
from kiln.llm.runtime import Runner
from kiln.llm.settings import INT8

IDS = [1, 5, 7, 3, 9, 2]


@pytest.fixture(autouse=True)
def float_products() -> Iterator[None]:
  with INT8.temporarily("0"): yield


@pytest.mark.parametrize("fmt", PACKED)
def test_planes_dequantise_as_the_oracle(tmp_path: Path, fmt: str) -> None:
  """Each matrix of a llama (Q and K rows permuted in the file) as planes: no more bytes than the file's (a repacked format:
  at most twice the file's, under 1.3 bytes a value), the dequantised matrix equal to Checkpoint.tensor's bit for bit, and
  an embedding lookup its rows. Rows of 256 values: whole K-quant superblocks."""
  cj = tiny_config("llama", num_hidden_layers=1, hidden_size=256, intermediate_size=256)
  write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=3, scale=0.2), fmt=lambda n: fmt)
  ck = open_checkpoint(tmp_path / "m.gguf")
  for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
    qt = ck.quant(name)
    qw = pack(qt)
    assert isinstance(qw, QuantWeight) and qw.format == fmt and qw.shape == qt.shape, name
    if fmt in REPACK: assert qw.nbytes <= 2 * qt.data.nbytes and qw.nbytes < 1.3 * np.prod(qt.shape), name
    else: assert qw.nbytes <= qt.data.nbytes, name
    want = ck.tensor(name)
    np.testing.assert_array_equal(qw.matrix().numpy().T.view(np.uint32), want.view(np.uint32), err_msg=name)
    x = np.random.default_rng(0).standard_normal((1, qt.shape[1])).astype(np.float32)
    ref = x.astype(np.float64) @ want.T.astype(np.float64)
    for rows in (x, np.repeat(x, 3, 0)):  # one row takes the block-by-block product, several the dequantised matrix
      got = qw.linear(Tensor(rows)).numpy()
      assert got.shape == (len(rows), qt.shape[0]) and np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), name
  emb = pack(ck.quant("model.embed_tokens.weight"))
  assert emb is not None
  np.testing.assert_array_equal(emb.embedding(Tensor(np.array([3, 0, 3], np.int32))).numpy(), ck.tensor("model.embed_tokens.weight")[[3, 0, 3]])


def test_vectors_left_to_float32(tmp_path: Path) -> None:
  """The vectors come back as None (load() takes them as float32), and so does a 1-d weight in a packed format."""
  cj = tiny_config("llama", num_hidden_layers=1)
  write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=3), fmt=lambda n: "Q5_0")
  ck = open_checkpoint(tmp_path / "m.gguf")
  assert pack(ck.quant("model.norm.weight")) is None
  assert isinstance(pack(ck.quant("model.layers.0.mlp.up_proj.weight")), QuantWeight)


@pytest.mark.parametrize(("arch", "fmt"), [("llama", "Q4_0"), ("qwen2", "Q4_1"), ("phi3", "BF16"), ("gpt2", "Q8_0"), ("llama", "Q4_K"),
                                           ("qwen2", "Q6_K"), ("llama", "Q5_0")])
def test_packed_model_logits_match_the_float32_path(tmp_path: Path, arch: str, fmt: str) -> None:
  """load() keeps every matrix packed (none is a float32 array) and its logits, prefill and decode, are the float32
  path's (each weight dequantised by numpy at load) to 1e-4 of the largest logit. A K-quant's rows are whole superblocks."""
  cj = tiny_config(arch, num_hidden_layers=1, **({"hidden_size": 256, "intermediate_size": 256} if fmt.endswith("_K") else {}))
  write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=5, scale=0.2), fmt=lambda n: fmt)
  llm = load(tmp_path / "m.gguf", context=16, chunk=4)
  got = llm.logits(IDS)
  mats = [n for n in llm.checkpoint.names() if len(llm.checkpoint.shape(n)) == 2]
  assert mats and all(isinstance(llm.runner.get(n), QuantWeight) for n in mats)
  ref = Runner(llm.config, llm.checkpoint.tensor, ctx=16, chunk=4)
  want = ref.feed(IDS, last_only=False)
  tol = 1e-4 * np.abs(want).max()
  assert np.abs(got - want).max() <= tol
  if arch == "llama":  # the decode plan (one row: its products fuse the dequantisation)
    llm.runner.reset(3)
    ref.reset(3)
    assert np.abs(llm.runner.feed([IDS[3]]) - ref.feed([IDS[3]])).max() <= tol


@pytest.mark.parametrize(("arch", "fmt"), [("qwen2", "Q8_0"), ("llama", "F16")])
def test_projections_of_one_input_stack_into_one_product(tmp_path: Path, arch: str, fmt: str) -> None:
  """Where q, k and v (and gate and up) are packed in one format with whole tiles of outputs, load() stacks them into one
  matrix (Weights.stack: the parts' planes kept only there) and each layer runs one product for them; the logits, prefill
  and decode (qwen2: with its q, k and v biases), are the float32 path's."""
  cj = tiny_config(arch, num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
  write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj, seed=5, scale=0.2), fmt=lambda n: fmt)
  llm = load(tmp_path / "m.gguf", context=16, chunk=4)
  got = llm.logits(IDS)
  p = "model.layers.0."
  stacked = {k for k in llm.runner.get.arrays if "+" in k}
  assert stacked == {p + "self_attn.q_proj.weight+" + p + "self_attn.k_proj.weight+" + p + "self_attn.v_proj.weight",
                     p + "mlp.gate_proj.weight+" + p + "mlp.up_proj.weight"}
  assert not {p + "self_attn.q_proj.weight", p + "mlp.up_proj.weight"} & set(llm.runner.get.arrays)  # the parts are kept only stacked
  ref = Runner(llm.config, llm.checkpoint.tensor, ctx=16, chunk=4)
  want = ref.feed(IDS, last_only=False)
  tol = 1e-4 * np.abs(want).max()
  assert np.abs(got - want).max() <= tol
  llm.runner.reset(3)
  ref.reset(3)
  assert np.abs(llm.runner.feed([IDS[3]]) - ref.feed([IDS[3]])).max() <= tol


def test_hf_float16_folder_conv1d(tmp_path: Path) -> None:
  """A Hugging Face gpt2 folder in float16: its Conv1D weights, stored (in, out), are packed as they are (no transpose)
  and the logits are the float32 path's."""
  cj = tiny_config("gpt2", n_layer=1)
  write_hf(tmp_path, cj, {k: v.astype(np.float16) for k, v in hf_weights(cj, seed=5, scale=0.2).items()})
  llm = load(tmp_path, context=16, chunk=4)
  assert llm.checkpoint.quant("transformer.h.0.attn.c_attn.weight").transposed
  assert isinstance(llm.runner.get("transformer.h.0.attn.c_attn.weight"), QuantWeight)
  got = llm.logits(IDS)
  want = Runner(llm.config, llm.checkpoint.tensor, ctx=16, chunk=4).feed(IDS, last_only=False)
  assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("fmt", PACKED)
def test_many_rows_read_the_matrix_realized(fmt: str) -> None:
  """A product of many rows runs as two kernels, the float32 tiles realized and the product reading them, in every
  format: left inline, an F16 or BF16 cast made the product one kernel with no register tile. Random planes, 64 x 64."""
  from kiln.graph import compile
  rng = np.random.default_rng(4)
  def f16(*shape: int) -> np.ndarray: return rng.uniform(0.01, 0.1, shape).astype(np.float16)
  if fmt == "F16": qw = QuantWeight.of(fmt, (64, 64), f16(64, 64))
  elif fmt == "BF16": qw = QuantWeight.of(fmt, (64, 64), (rng.standard_normal((64, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
  elif fmt in BYTES:  # int8 codes, a scale per block (and a min where the format has one)
    block = 16 if fmt == "Q6_K" else 32
    scales = (f16(64 // block, 64),) * (2 if fmt in ("Q5_1", "Q5_K") else 1)
    qw = QuantWeight.of(fmt, (64, 64), rng.integers(-128, 128, (64, 64)).astype(np.int8), scales, block)
  else: qw = QuantWeight.of(fmt, (64, 64), rng.integers(0, 256, (32, 64)).astype(np.uint8), (f16(2, 64),) * (1 if fmt == "Q4_0" else 2))
  x = rng.standard_normal((8, 64)).astype(np.float32)
  plan = compile([qw.linear(Tensor(x))])
  assert plan.kernel_count == 2
  want = x.astype(np.float64) @ qw.matrix().numpy().astype(np.float64)
  np.testing.assert_allclose(plan.run()[0], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_one_row_block_sums_unroll_their_blocks_by_two() -> None:
  """A decode step's product runs each block's dot product on the codes: a reduce over the 32 values of a block, with the
  row's blocks (18 for 576 inputs) an output axis the heuristic unrolls to interleave independent sums. By 3 (which also
  divides 18) rather than 2 those kernels ran 1.5x slower; 3 is for axes 2 does not divide."""
  from kiln.codegen.choose import OptOps, Target, heuristic_opts
  from kiln.codegen.lowering.prepare import prepare
  from kiln.graph import compile
  from kiln.ir.ops import Ops
  rng = np.random.default_rng(0)
  qw = QuantWeight.of("Q8_0", (64, 576), rng.integers(-128, 128, (576, 64)).astype(np.int8), (rng.uniform(0.01, 0.1, (18, 64)).astype(np.float16),))
  x = rng.standard_normal((1, 576)).astype(np.float32)
  plan = compile([qw.linear(Tensor(x))])
  unrolls = []
  for k in plan.kernels:
    ast = prepare(k.ast)[0]
    out = {u.arg[0]: u for u in ast.toposort() if u.op is Ops.RANGE and u.arg[1].name != "REDUCE"}
    unrolls += [(int(out[o.axis].src[0].arg), o.amount) for o in heuristic_opts(ast, Target(vector_bytes=64, threads=2))
                if o.op is OptOps.UNROLL and o.axis in out]
  assert (18, 2) in unrolls and (18, 3) not in unrolls, unrolls
  want = x.astype(np.float64) @ qw.matrix().numpy().astype(np.float64)
  np.testing.assert_allclose(plan.run()[0], want, rtol=0, atol=1e-5 * np.abs(want).max())
