"""The device a graph is being built for, where a graph-level layout depends on it.

Some layouts kiln-graph chooses while it builds a graph serve the CPU's register tiles and vector lanes: a weight array
stored in blocks of 32 output columns (few_rows.py). On CUDA the same blocks split a matrix product's N into a batch of
32-column products, and the tiled kernel's 64- or 128-column tiles then compute mostly padding. A loader that knows its
device (kiln.graph.onnx.load, kiln.llm) builds under `building_for(device)`; a graph built outside it takes the CPU's
layouts, as before, and still runs everywhere (only slower on another device)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_DEVICE: ContextVar[str] = ContextVar("kiln_graph_build_device", default="CPU")


@contextmanager
def building_for(device: str) -> Iterator[None]:
  """Graphs built inside take the layouts that pay on `device` ("CPU", "CUDA", "CUDA:1", ...)."""
  token = _DEVICE.set(device)
  try: yield
  finally: _DEVICE.reset(token)


def build_device() -> str:
  """The device the graph being built is for ("CPU" outside building_for)."""
  return _DEVICE.get()


def cpu_layouts() -> bool:
  """Whether the graph being built is for the CPU (its blocked weight layouts pay there only)."""
  return _DEVICE.get().split(":")[0].upper() in ("CPU", "DISK")
