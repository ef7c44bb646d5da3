"""Read windows (windows.py): a kernel reading part of a realized buffer reads a view of that part, its indices rebased,
so kernels that differ only in where they read have one AST; what a window must leave alone (reads from the start,
gated reads under a pad); results against numpy."""
from __future__ import annotations

import numpy as np

from kiln.graph import Tensor, compile
from kiln.graph.windows import read_windows

RNG = np.random.default_rng(21)


def test_slices_of_one_buffer_share_an_ast() -> None:
  x = Tensor.input("x", (16, 8))
  base = (x * 2.0).contiguous()  # realized: the slices below read its buffer
  outs = [(base[i:i + 3] + 1.0).exp() for i in (1, 5, 9)]
  c = compile(outs)
  xn = RNG.standard_normal((16, 8)).astype(np.float32)
  for got, i in zip(c.run({"x": xn}), (1, 5, 9)):
    np.testing.assert_allclose(got, np.exp(xn[i:i + 3] * 2 + 1), rtol=1e-6)
  slices = [k for k in c.kernels if k.node is not base.node]
  rebased = [read_windows(k.ast) for k in slices]
  assert [w for _, w in rebased] == [{1: (i * 8, 24)} for i in (1, 5, 9)]  # slot 1 (base) from row i, 3 rows of 8
  assert len({a.key for a, _ in rebased}) == 1 and len({k.ast.key for k in slices}) == 3


def test_what_stays_in_place() -> None:
  x = Tensor.input("x", (16, 8))
  base = (x * 2.0).contiguous()
  first = base[0:3] + 1.0  # read from element 0: no window
  padded = base.pad(((2, 0), (0, 0)))[1:4] - 1.0  # a zero row, then rows 0..1 of base: a gated index, from before 0
  # rows 14..15 of base and a zero row: gated, from past the end (a fuzz find: the window ran past the buffer)
  tail = base.pad(((0, 1), (0, 0)))[14:17] * 3.0
  c = compile([first, padded, tail])
  for k in c.kernels:
    if k.node is base.node: continue
    ast, wins = read_windows(k.ast)
    assert wins == {} and ast is k.ast, (k.ast.arg, wins)
  xn = RNG.standard_normal((16, 8)).astype(np.float32)
  got = c.run({"x": xn})
  np.testing.assert_allclose(got[0], xn[0:3] * 2 + 1, rtol=1e-6)
  np.testing.assert_allclose(got[1], np.concatenate([np.zeros((1, 8), np.float32), xn[0:2] * 2]) - 1, rtol=1e-6)
  np.testing.assert_allclose(got[2], np.concatenate([xn[14:16] * 2, np.zeros((1, 8), np.float32)]) * 3, rtol=1e-6)


def test_a_window_under_a_symbolic_dim() -> None:
  """The bounds hold for every value of a runtime variable: a slice past a symbolic batch reads a window sized for the
  batch's upper bound."""
  x = Tensor.input("x", ("b", 8), dims={"b": (1, 6)})
  base = (x + 1.0).contiguous()
  y = base[:, 4:8] * 3.0
  c = compile([y])
  for n in (1, 6):
    xn = RNG.standard_normal((n, 8)).astype(np.float32)
    np.testing.assert_allclose(c.run({"x": xn})[0], (xn[:, 4:8] + 1) * 3, rtol=1e-6)
