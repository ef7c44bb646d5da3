"""Layouts chosen for the device a graph is built for (kiln.graph.build_target): the channels-last products, relayouts
and Winograd transforms conv.py chooses for the CPU's vectors stay off a graph built for CUDA, whose tiled implicit GEMM
wants the NCHW product whole (on an H200, ResNet-50's 1x1 convs over 14x14 and 7x7 maps computed channels-last in
blocks of 32 columns ran the SIMT tile at 3-4 TFLOP/s in float16). Computed here on the CPU: the layout is the graph's."""
from __future__ import annotations

import numpy as np
import pytest
from test_conv import conv_ref, rand

from kiln.graph import Tensor, compile
from kiln.graph.build_target import building_for
from kiln.graph.schedule import Compiled
from kiln.ir.ops import Ops


def _products(c: Compiled) -> list[str]:
  return [k.ast.arg for k in c.kernels if any(u.op is Ops.REDUCE for u in k.ast.toposort())]


def _net(x: Tensor, w1: np.ndarray, w2: np.ndarray) -> list[Tensor]:
  """A 1x1 conv over a 14x14 map (channels-last on the CPU: 196 positions are no whole number of vectors) and a 3x3 conv
  with 64 channels each way (Winograd on the CPU)."""
  return [x.conv2d(Tensor(w1)).relu(), x.conv2d(Tensor(w2), padding=1)]


@pytest.mark.parametrize("device", ["CPU", "CUDA", "CUDA:1"])
def test_conv_layouts_follow_the_device_the_graph_is_built_for(device: str) -> None:
  x, w1, w2 = rand(2, 64, 14, 14), rand(256, 64, 1, 1) * 0.1, rand(64, 64, 3, 3) * 0.1
  with building_for(device): ys = _net(Tensor.input("x", x.shape), w1, w2)
  c = compile(ys)
  products = _products(c)
  if device == "CPU": assert products == ["reduce_1x8x392x32", "reduce_36x64x1x32"], products  # channels-last; Winograd
  else: assert products == ["reduce_2x1x256x1x196", "reduce_2x1x64x1x196"], products  # the NCHW products
  got = c.run({"x": x})
  np.testing.assert_allclose(got[0], np.maximum(conv_ref(x, w1, None, [1, 1], [(0, 0)] * 2, [1, 1], 1), 0), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got[1], conv_ref(x, w2, None, [1, 1], [(1, 1)] * 2, [1, 1], 1), rtol=1e-4, atol=1e-4)
