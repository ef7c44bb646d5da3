"""Execution plans: many kernels over many buffers, prepared once (compiled, allocated, bound) and executed many times.

The import path for the whole plan API; each part lives in its own module: the builder and build() in builder.py, the
built plan in execution.py, the prepared ops in prepared.py, the thread pool that overlaps independent kernels in overlap.py.
"""
from kiln.executor.builder import DeviceMismatchError, ExecutionPlanBuilder
from kiln.executor.execution import ExecutionPlan
from kiln.executor.overlap import PARALLEL_MIN_COST
from kiln.executor.prepared import PreparedBufferView, PreparedCopy, PreparedCustomFunction, PreparedKernel, PreparedOp, RuntimeVar

__all__ = ["ExecutionPlanBuilder", "DeviceMismatchError", "ExecutionPlan",
           "PreparedKernel", "PreparedCopy", "PreparedBufferView", "PreparedCustomFunction",
           "PreparedOp", "RuntimeVar", "PARALLEL_MIN_COST"]
