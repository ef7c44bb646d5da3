"""A product of few rows by a weight array runs over the weight stored in blocks of columns (few_rows.py): against numpy,
the kernel it schedules, and where it does not apply."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import Tensor, compile

RNG = np.random.default_rng(37)


def rand(*shape: int) -> np.ndarray: return RNG.uniform(-1, 1, shape).astype(np.float32)


def products(c) -> list[str]: return [k.ast.arg for k in c.kernels if k.ast.arg.startswith("reduce")]


# (input shape, weight (K, N), the product kernel: (rows, N / block, block)): blocks of 32, of 8 (40 columns), 33 columns
# padded to two blocks of 32, two rows as a batch of one-row matrices, and more rows than a register tile (tokens of a
# batch: 2 x 18 and 2 x 7, rows no tile divides) over whole blocks
CASES = [((1, 48), (48, 64), "reduce_1x2x32"), ((2, 24), (24, 40), "reduce_2x5x8"), ((3, 16), (16, 33), "reduce_3x2x32"),
         ((2, 1, 20), (20, 96), "reduce_2x3x32"), ((2, 18, 40), (40, 64), "reduce_36x2x32"), ((2, 7, 24), (24, 96), "reduce_14x3x32")]


@pytest.mark.parametrize("xs,ws,kernel", CASES)
@pytest.mark.parametrize("stored", ["(K, N)", "(N, K) read transposed"])
def test_few_rows_product_matches_numpy(xs, ws, kernel, stored) -> None:
  x, w, b = rand(*xs), rand(*ws), rand(ws[1])
  wt = Tensor(w) if stored == "(K, N)" else Tensor(np.ascontiguousarray(w.T)).T
  c = compile([((Tensor.input("x", xs) @ wt) + Tensor(b)).relu() * 2])
  assert products(c) == [kernel], c.plan.describe()
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(x @ w + b, 0) * 2, rtol=1e-5, atol=1e-5)


def test_a_linear_layer_at_batch_one_takes_its_bias_and_activation_in_the_product() -> None:
  """The product is realized as (rows, N/block, block), (rows, N) as stored: the bias and relu after it are its epilogue."""
  x, w, b = rand(1, 32), rand(64, 32), rand(64)
  c = compile([Tensor.input("x", x.shape).linear(Tensor(w), Tensor(b)).relu().sum()])
  assert products(c)[0] == "reduce_1x2x32" and len(c.kernels) == 2, c.plan.describe()
  np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(x @ w.T + b, 0).sum(), rtol=1e-5, atol=1e-5)


def test_symbolic_rows_take_their_bias_and_activation_in_the_product() -> None:
  """Under symbolic rows (a dynamic export's tokens) the product's epilogue moves into it as under static ones
  (epilogue.SYMBOLIC_PRODUCTS): a second product reads the bias and relu's result, with no kernel of their own between."""
  w, b, w2 = rand(256, 1024), rand(256), rand(64, 256)
  c = compile([Tensor.input("x", ("n", 3, 1024), dims={"n": (1, 8)}).linear(Tensor(w), Tensor(b)).relu().linear(Tensor(w2))])
  assert len(products(c)) == 2 and len(c.kernels) == 2, c.plan.describe()
  for n in (1, 5):
    x = rand(n, 3, 1024)
    np.testing.assert_allclose(c.run({"x": x})[0], np.maximum(x @ w.T + b, 0) @ w2.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("case", ["more rows than a register tile, columns in no whole blocks", "one block of columns", "a computed weight",
                                  "symbolic rows over a weight that stays in cache"])
def test_few_rows_product_does_not_apply(case: str) -> None:
  rows, n = (9, 48) if case.startswith("more rows") else (2, 32 if case == "one block of columns" else 64)
  x, w = rand(rows, 16), rand(16, n)
  if case.startswith("symbolic rows"): xt = Tensor.input("x", ("n", 16), dims={"n": (1, 4)})
  else: xt = Tensor.input("x", x.shape)
  wt = Tensor.input("w", w.shape) if case == "a computed weight" else Tensor(w)
  c = compile([xt @ wt])
  assert len(products(c)) == 1 and products(c)[0].endswith(f"x{n}"), c.plan.describe()  # (rows, N), not (rows, N/B, B)
  np.testing.assert_allclose(c.run({"x": x, "w": w} if case == "a computed weight" else {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,blocked", [(1024, True), (16, False)])
def test_symbolic_rows_in_whole_tiles(k: int, blocked: bool) -> None:
  """Symbolic rows ((n, 3) tokens of k features) by a weight of k x 256: a weight past SYMBOLIC_MIN_BYTES in blocks of
  columns, its n * 3 rows one symbolic axis the codegen takes in whole register tiles of 8, the last shifted back or
  repeating the last row (prepare.peel); a small one as stored, n an outer loop around a tile of the 3 static rows.
  Every row count in the bounds matches numpy: under one tile (3, 6), whole tiles (24, 48), tiles and a shifted one."""
  w = rand(k, 256)
  c = compile([Tensor.input("x", ("n", 3, k), dims={"n": (1, 22)}) @ Tensor(w)])
  assert products(c)[0].endswith("x8x32" if blocked else "x256"), c.plan.describe()
  for n in range(1, 23):
    x = rand(n, 3, k)
    np.testing.assert_allclose(c.run({"x": x})[0], x @ w, rtol=1e-4, atol=1e-4, err_msg=f"rows {3 * n}")


@pytest.mark.parametrize("device", ["CUDA", "CUDA:1"])
def test_a_graph_built_for_another_device_keeps_the_weight_as_stored(device: str) -> None:
  """The blocks serve the CPU's register tiles: a graph built for CUDA (kiln.graph.onnx.load(..., device="CUDA") builds
  under building_for) keeps (rows, N), which the GPU's tiled product covers whole; the same product built after it, outside,
  is blocked again. Computed here on the CPU: the layout is the graph's, not the device's."""
  from kiln.graph.build_target import building_for
  x, w = rand(2, 48), rand(48, 64)
  with building_for(device): inside = Tensor.input("x", x.shape) @ Tensor(w)
  outside = Tensor.input("x", x.shape) @ Tensor(w)
  c_in, c_out = compile([inside]), compile([outside])
  assert products(c_in) == ["reduce_2x64"] and products(c_out) == ["reduce_2x2x32"], (products(c_in), products(c_out))
  for c in (c_in, c_out): np.testing.assert_allclose(c.run({"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)
