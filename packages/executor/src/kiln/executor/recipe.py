"""What a plan was built from: the builder's buffers as they were before views and memory reuse rebound them, and its op
records. build() keeps one on every ExecutionPlan; kiln.executor.planspec.export(plan) reads it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.executor.buffer import Storage
from kiln.ir.dtype import DType


@dataclass(frozen=True)
class BufferRecipe:
  storage: Storage  # the storage the buffer had when the plan was built (fresh, a wrapped host array, a DISK map, ...)
  offset: int  # bytes into it
  size: int
  dtype: DType


@dataclass(frozen=True)
class PlanRecipe:
  device: str
  parallel: bool | None
  reuse_memory: bool
  buffers: list[BufferRecipe]
  ops: list[Any]  # the builder's op records (_KernelOp, _CopyOp, _ViewOp, _CustomOp), in id order
  outputs: list[int]
