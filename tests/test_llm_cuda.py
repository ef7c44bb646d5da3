"""kiln.llm on CUDA (issue 40): a GGUF checkpoint loaded with device="CUDA" runs its prefill and decode plans on the emulated
GPU of cuda_emu.py (the CUDA runtime's own code over the stand-in for pycuda.driver, every kernel's CUDA C run on the CPU),
checked step by step against the same file on the CPU. The packed weights are uploaded as they are stored and dequantised
in the kernels; the KV cache lives in device memory and each plan writes its new rows there itself, so a decode step
copies its token and position in and its logits out, nothing else, and its kernels are one stretch of launches (one CUDA
graph on a GPU). Nothing here ran on a GPU."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "llm", "tests"))
from checkpoint_files import hf_weights, tiny_config, write_gguf  # noqa: E402
from cuda_emu import emulated_gpu  # noqa: E402

from kiln.llm import load  # noqa: E402
from kiln.runtime.cuda.driver import CUDARuntime  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no host C++ compiler to emulate CUDA")

PROMPT = [1, 5, 7, 3, 9, 2, 11, 4, 6, 8, 10]  # 11 tokens: chunks of 8 and 4 (padded) with long=8, or 4, 4 and 4 (padded)
STEPS = 3


def _gguf(tmp_path: Path, arch: str, fmt: str, **over: int) -> Path:
  cj = tiny_config(arch, **over)
  path = tmp_path / f"{arch}-{fmt}.gguf"
  write_gguf(path, cj, hf_weights(cj, seed=5, scale=0.2), fmt=lambda n: fmt if n.endswith(("proj.weight", "c_attn.weight", "c_fc.weight")) else "F32")
  return path


def _steps(m) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
  """The prompt's last logits, then STEPS greedy decode steps' logits, through the runner (prefill, long and decode plans)."""
  r = m.runner
  r.reset()
  out = [r.feed(PROMPT)]
  for _ in range(STEPS): out.append(r.feed([int(out[-1].argmax())]))
  return out


@pytest.mark.parametrize(("arch", "fmt", "long", "over"), [("llama", "Q4_K", 4, {"hidden_size": 256, "intermediate_size": 256}),
                                                           ("llama", "Q8_0", 8, {}), ("gpt2", "F16", 4, {})])
def test_prefill_and_decode_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, fmt: str, long: int, over: dict[str, int]) -> None:
  """long=8: the prompt takes the long plan (8 rows) and the prefill plan (4 rows, padded); long=4: prefill plans only.
  Q8_0: the plans are kept in the plan cache, and the model loaded again rebuilds them from there."""
  monkeypatch.setenv("KILN_COMPILE_THREADS", "4")
  monkeypatch.setenv("KILN_LLM_INT8", "0")  # the CPU's float products, as the CUDA plans take: the int8 ones differ by q8_0's error
  path = _gguf(tmp_path, arch, fmt, **over)
  want = _steps(load(path, context=24, chunk=4, long=long))
  stretches: list[int] = []
  real = CUDARuntime.graph_calls
  def graph_calls(self, calls):  # type: ignore[no-untyped-def]
    stretches.append(len(calls))
    return real(self, calls)
  monkeypatch.setattr(CUDARuntime, "graph_calls", graph_calls)
  with emulated_gpu(monkeypatch, tmp_path) as (g, _):
    if fmt == "Q8_0":  # kept in the plan cache, and loaded again from it below
      monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
      monkeypatch.setenv("KILN_CACHE", "1")  # the stand-in turns the disk cache off
      monkeypatch.setenv("KILN_PLAN_CACHE", "1")  # the run turns it off (conftest.py)
    m = load(path, context=24, chunk=4, long=long, device="CUDA")
    got = _steps(m)
    for i, (a, b) in enumerate(zip(got, want)):
      assert np.abs(a - b).max() <= 2e-5 * np.abs(b).max(), f"step {i}: {np.abs(a - b).max()} of {np.abs(b).max()}"
    assert all(b.device == "CUDA:0" for b in (*m.runner.cache.k, *m.runner.cache.v))
    k0, v0 = m.runner.cache.layer(0)
    assert k0.shape[0] == len(PROMPT) + STEPS and np.abs(v0).max() > 0  # the plans wrote every position's rows
    # a decode step: the token and its position in, and the past length as one span of the kernels' variables in device
    # memory (their arguments, and so a graph of them, never change: kiln.codegen.render.cuda_vars); the logits (and the
    # embedding's index check) out; the cache stays
    dec = m.runner.plans["decode"]
    in_memory = [p.kernel for p in dec.plan.prepared_ops if hasattr(p, "kernel") and p.kernel.var_names]
    assert in_memory and all(k.program.spec.vars_in_memory for k in in_memory), [k.name for k in in_memory]
    before = dict(g.stats)
    m.runner.feed([3])
    moved = {k: g.stats[k] - before[k] for k in g.stats}
    assert moved["htod"] == 3 and moved["htod_bytes"] == 8 + 4 * len(in_memory), moved
    assert moved["dtoh_bytes"] <= 4 * m.config.vocab_size + 4 * len(dec.checks), moved
    assert moved["launches"] == dec.kernel_count
    if fmt == "Q8_0": _loads_again_from_the_plan_cache(path, got, long)
  assert dec.kernel_count in stretches  # the decode plan's kernels were offered as one graph (the stand-in declines it)



def _loads_again_from_the_plan_cache(path: Path, want: list[np.ndarray], long: int) -> None:
  """The CUDA model loaded again rebuilds its plans from the plan cache (kiln.graph.compile_cache): its packed weights
  uploaded from the graph's constants, its KV cache bound in device memory; the same logits, nothing compiled."""
  from kiln.executor import cache_stats
  hits, compiles = cache_stats()["plan_hits"], cache_stats()["compiles"]
  m = load(path, context=24, chunk=4, long=long, device="CUDA")
  got = _steps(m)
  assert cache_stats()["plan_hits"] - hits == 3 and cache_stats()["compiles"] == compiles  # long, prefill, decode
  for a, b in zip(got, want): np.testing.assert_array_equal(a, b)
  assert all(b.device == "CUDA:0" for b in (*m.runner.cache.k, *m.runner.cache.v))
  assert m.runner.cache.layer(0)[0].shape[0] == len(PROMPT) + STEPS
