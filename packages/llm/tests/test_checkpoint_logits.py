"""A GGUF file runs as the Hugging Face checkpoint it was converted from: load() of each gives the same logits. The GGUF
is written as llama.cpp's converter writes it (Q/K rows permuted, quantized blocks, GPT-2's Conv1D transposed); the HF
folder holds what the GGUF's weights dequantise to, so any difference is a layout or naming error of the GGUF reader."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoint_files import hf_weights, tiny_config, write_gguf, write_hf

from kiln.llm import load


@pytest.mark.parametrize(("arch", "fmt"), [("llama", "Q8_0"), ("gpt2", "F16")])
def test_gguf_runs_as_its_hf_checkpoint(tmp_path: Path, arch: str, fmt: str) -> None:
  cj = tiny_config(arch)
  w = hf_weights(cj, seed=5, scale=0.2)
  want = write_gguf(tmp_path / "m.gguf", cj, w, fmt=lambda n: fmt)
  if arch == "gpt2":  # the HF folder stores Conv1D weights (in, out), as HF does
    want = {n: (a.T.copy() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else a) for n, a in want.items()}
  write_hf(tmp_path / "hf", cj, want)
  ids = [1, 5, 7, 3, 9, 2]
  a = load(tmp_path / "hf", context=16).logits(ids)
  b = load(tmp_path / "m.gguf", context=16).logits(ids)
  assert a.shape == b.shape == (len(ids), cj["vocab_size"])
  assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()
