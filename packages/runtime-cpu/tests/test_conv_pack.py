"""A conv as the matmul kiln-graph hands the codegen, its input read two ways: through the padding's bounds test (a gated
load under WHERE, the packed panel copied as masked loads of contiguous lanes) and from a padded copy (plain loads, the
panel copied as runs of contiguous lanes). Both run on this host and as AVX2 code (KILN_CPU=x86-64-v3), match numpy, and
give the same bits: the product's loop nest and accumulation order do not depend on how its panel was copied."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import AxisType, Ops, UOp, dtypes
from kiln.runtime.cpu.compiler import host_cpu
from kiln.runtime.cpu.machine import is_x86

F32 = dtypes.float32
needs_avx2 = pytest.mark.skipif(not (is_x86(platform.machine()) and "+avx2" in host_cpu()[1].split(",")), reason="needs an x86 host with AVX2")


def conv_ast(n: int, c: int, hw: tuple[int, int], o: int, ks: tuple[int, int], st: int, dl: int, pad: int, gated: bool) -> UOp:
  """out[b, f, p] = sum_k W[f, k] * X[b, ci, y, x], k = (ci, ky, kx), p = (oy, ox), y = oy*st + ky*dl - pad (x alike).
  gated: X is the unpadded input, read under the bounds test; else X is the padded input, read plainly."""
  h, w = hw
  kh, kw = ks
  oh, ow = (h + 2 * pad - (kh - 1) * dl - 1) // st + 1, (w + 2 * pad - (kw - 1) * dl - 1) // st + 1
  hx, wx = (h, w) if gated else (h + 2 * pad, w + 2 * pad)
  kk, pp = c * kh * kw, oh * ow
  out, wt, x = UOp.define_global(0, F32.ptr(n * o * pp)), UOp.define_global(1, F32.ptr(o * kk)), UOp.define_global(2, F32.ptr(n * c * hx * wx))
  b, f, p, k = UOp.range(n, 0), UOp.range(o, 1), UOp.range(pp, 2), UOp.range(kk, 3, AxisType.REDUCE)
  ci, ky, kx = k // (kh * kw), (k // kw) % kh, k % kw
  y, xx = (p // ow) * st + ky * dl, (p % ow) * st + kx * dl
  if gated:
    y, xx = y - pad, xx - pad
    valid = (y >= 0) & (y < h) & (xx >= 0) & (xx < w)
    v = valid.where(x.index(b * (c * h * w) + ci * (h * w) + y * w + xx, valid).load(), 0.0)
  else: v = x.index(b * (c * hx * wx) + ci * (hx * wx) + y * wx + xx).load()
  red = (wt.index(f * kk + k).load() * v).reduce(Ops.ADD, k)
  return UOp.sink(out.index(b * (o * pp) + f * pp + p).store(red), name=f"conv_{'gated' if gated else 'padded'}")


# (n, c, (h, w), o, (kh, kw), stride, dilation, pad): the bench CNN's second conv, 8x8 images, odd sizes, 32-wide rows,
# stride 2 and dilation 2 (their lanes gather), a valid conv (runs of 8 lanes in a 32-lane panel row), a 5x5 with pad 2
CASES = [(4, 32, (16, 16), 64, (3, 3), 1, 1, 1), (2, 16, (8, 8), 32, (3, 3), 1, 1, 1), (2, 6, (7, 33), 16, (3, 3), 1, 1, 1),
         (2, 3, (32, 32), 32, (3, 3), 1, 1, 1), (2, 4, (11, 9), 16, (3, 3), 2, 1, 1), (2, 4, (12, 12), 16, (3, 3), 1, 2, 2),
         (2, 8, (10, 10), 16, (3, 3), 1, 1, 0), (1, 5, (13, 9), 16, (5, 5), 1, 1, 2)]

RUNS = {CASES[0]: 16, CASES[1]: 8, CASES[6]: 8}


def conv_ref(xp: np.ndarray, wt: np.ndarray, o: int, ks: tuple[int, int], st: int, dl: int) -> np.ndarray:
  n, c, hp, wp = xp.shape
  kh, kw = ks
  oh, ow = (hp - (kh - 1) * dl - 1) // st + 1, (wp - (kw - 1) * dl - 1) // st + 1
  w4 = wt.reshape(o, c, kh, kw).astype(np.float64)
  y = np.zeros((n, o, oh, ow))
  for ky in range(kh):
    for kx in range(kw):
      xs = xp[:, :, ky * dl:ky * dl + (oh - 1) * st + 1:st, kx * dl:kx * dl + (ow - 1) * st + 1:st].astype(np.float64)
      y += np.einsum("nchw,oc->nohw", xs, w4[:, :, ky, kx])
  return y.reshape(n, o, oh * ow)


def run_both(case: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
  """(gated result, padded result, numpy's, the gated kernel's applied options); asserts the product is register-tiled."""
  n, c, hw, o, ks, st, dl, pad = case
  rt = get_runtime("CPU")
  rng = np.random.default_rng(hash(case) % (1 << 32))
  x = rng.standard_normal((n, c, *hw)).astype(np.float32)
  xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
  wt = rng.standard_normal((o, c * ks[0] * ks[1])).astype(np.float32)
  want = conv_ref(xp, wt, o, ks, st, dl)
  outs, opts = [], []
  for gated, xin in ((True, x), (False, xp)):
    spec = rt.renderer.render(conv_ast(n, c, hw, o, ks, st, dl, pad, gated))
    assert any(s.startswith("PACK") for s in spec.applied_opts) and any(s.startswith("UNROLL(axis=1") for s in spec.applied_opts), spec.applied_opts
    out = np.zeros(want.shape, np.float32)
    rt.load(rt.compiler.compile(spec))([out.ctypes.data, wt.ctypes.data, np.ascontiguousarray(xin).ctypes.data], [], wait=True)
    outs.append(out)
    opts.append(spec.src)
  return outs[0], outs[1], want, opts


@pytest.mark.parametrize("case", CASES)
def test_gated_conv_panel_matches_the_padded_copy_bit_for_bit(case: tuple) -> None:
  gated, padded, want, srcs = run_both(case)
  np.testing.assert_allclose(gated, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(gated, padded)
  n, c, hw, o, ks, st, dl, pad = case
  if st == 1 and dl == 1 and pad:  # contiguous lanes under the bounds test: the pack is masked loads, not a gather
    assert "@llvm.masked.load" in srcs[0]
  if case in RUNS:  # a 32-lane panel row over output rows of 16 or 8: copied as runs of one output row, one vector load each
    assert f"load <{RUNS[case]} x float>" in srcs[1]


AVX2_RUN = r'''
import sys
sys.path.insert(0, {here!r})
import numpy as np
from test_conv_pack import CASES, run_both
from kiln.codegen.registry import get_runtime
rt = get_runtime("CPU")
assert rt.target.vector_bytes == 32, rt.target
for case in CASES:
  gated, padded, want, srcs = run_both(case)
  np.testing.assert_allclose(gated, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(gated, padded)
  asm = rt.compiler.assembly(srcs[0])
  assert "zmm" not in asm  # AVX2 code (a stride-2 case of 30 columns is scalar there)
  if case[5] == 1 and case[6] == 1 and case[7]: assert "vmaskmovps" in asm, case  # AVX2's masked load
print("ok")
'''


@needs_avx2
def test_gated_conv_panel_on_avx2() -> None:
  env = {**os.environ, "KILN_CPU": "x86-64-v3", "KILN_CACHE": "0"}
  code = AVX2_RUN.replace("{here!r}", repr(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
