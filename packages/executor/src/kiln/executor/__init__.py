"""kiln.executor: buffers, the kernel cache, execution plans, runtime variables, profiling."""
from kiln.executor.buffer import Buffer, copy_buffer
from kiln.executor.builder import ExecutionPlanBuilder
from kiln.executor.cache import CachedKernel, cache_stats, compile_kernel, compile_kernel_with_origin, get_or_compile_kernel
from kiln.executor.checks import PlanCheckError
from kiln.executor.compile_pool import precompile_kernels
from kiln.executor.execution import ExecutionPlan
from kiln.executor.planspec import PlanSpec
from kiln.executor.portable import PortablePlan
from kiln.executor.prepared import PreparedBufferView, PreparedCopy, PreparedCustomFunction, PreparedKernel, RuntimeVar
from kiln.executor.profile import Profile, ProfileRecord, write_chrome_trace
from kiln.executor.version import __version__

__all__ = ["Buffer", "copy_buffer", "CachedKernel", "cache_stats", "compile_kernel", "compile_kernel_with_origin", "get_or_compile_kernel",
           "precompile_kernels", "ExecutionPlan", "ExecutionPlanBuilder", "PreparedBufferView", "PreparedCopy", "PreparedCustomFunction",
           "PreparedKernel", "RuntimeVar", "PlanSpec", "PortablePlan", "PlanCheckError", "Profile", "ProfileRecord", "write_chrome_trace",
           "__version__"]
