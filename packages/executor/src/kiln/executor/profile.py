"""Per-kernel profile records, a text table, and Chrome trace JSON (chrome://tracing, ui.perfetto.dev)."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProfileRecord:
  """One kernel run: time in seconds, bytes moved and flops (the renderer's estimates), and the rates they give."""
  op_id: int
  name: str
  device: str
  time: float
  bytes: int
  flops: int
  start: float = 0.0  # seconds since the start of the profiled execute
  level: int = 0
  thread: int = 0

  @property
  def gbs(self) -> float: return self.bytes / self.time * 1e-9 if self.time > 0 else 0.0
  @property
  def gflops(self) -> float: return self.flops / self.time * 1e-9 if self.time > 0 else 0.0

  def as_dict(self) -> dict: return {**asdict(self), "gbs": self.gbs, "gflops": self.gflops}


class Profile(list[ProfileRecord]):
  """The records of one profiled execute, in execution order."""

  @property
  def total_time(self) -> float: return sum(r.time for r in self)

  def table(self) -> str: return format_table(self)
  def write_chrome_trace(self, path: str | os.PathLike) -> Path: return write_chrome_trace(self, path)


def format_table(records: Sequence[ProfileRecord]) -> str:
  w = max([len(r.name) for r in records] + [6])
  lines = [f"{'op':>4}  {'kernel':<{w}}  {'device':<6}  {'time (us)':>10}  {'GFLOP/s':>9}  {'GB/s':>8}  {'MFLOP':>9}  {'MB':>9}"]
  for r in records:
    lines.append(f"{r.op_id:>4}  {r.name:<{w}}  {r.device:<6}  {r.time * 1e6:>10.2f}  {r.gflops:>9.2f}  {r.gbs:>8.2f}  "
                 f"{r.flops / 1e6:>9.3f}  {r.bytes / 1e6:>9.3f}")
  lines.append(f"{'':>4}  {'total':<{w}}  {'':<6}  {sum(r.time for r in records) * 1e6:>10.2f}")
  return "\n".join(lines)


def chrome_trace(records: Sequence[ProfileRecord]) -> dict:
  events = [{"name": r.name, "cat": "kernel", "ph": "X", "ts": r.start * 1e6, "dur": r.time * 1e6, "pid": r.device, "tid": r.thread,
             "args": {"op": r.op_id, "level": r.level, "bytes": r.bytes, "flops": r.flops, "GB/s": round(r.gbs, 3),
                      "GFLOP/s": round(r.gflops, 3)}} for r in records]
  return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_chrome_trace(records: Sequence[ProfileRecord], path: str | os.PathLike) -> Path:
  p = Path(path)
  p.write_text(json.dumps(chrome_trace(records)))
  return p
