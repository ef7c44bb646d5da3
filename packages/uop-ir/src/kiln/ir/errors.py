"""The KilnError family: every error kiln raises on bad input derives from KilnError and names the culprit."""
from __future__ import annotations


class KilnError(Exception):
  """Base of every error kiln raises on purpose."""


class IRError(KilnError):
  """A UOp graph is malformed (wrong dtypes, wrong sources, bad arguments)."""


class IRTypeError(IRError, TypeError):
  """An op was given operands of dtypes it cannot take."""


class IRVerifyError(IRError):
  """The verifier rejected a kernel; the message names the offending node."""


class RewriteError(KilnError):
  """A graph rewrite did not reach a fixed point (an endless rewrite)."""


class SerializeError(KilnError, ValueError):
  """A JSON graph could not be read back into UOps."""


class EvalError(KilnError):
  """The reference evaluator was handed inputs that do not fit the kernel."""


class SettingError(KilnError, ValueError):
  """A KILN_* environment variable holds a value it does not take; the message names the variable and what it takes."""


class CodegenError(KilnError):
  """Lowering, optimising or rendering failed."""


class CompileError(KilnError):
  """A compiler rejected generated source; carries the compiler's log and the offending lines."""

  def __init__(self, message: str, log: str = "", source_lines: str = ""):
    self.log, self.source_lines = log, source_lines
    parts = [message] + ([f"compiler log:\n{log}"] if log else []) + ([f"source:\n{source_lines}"] if source_lines else [])
    super().__init__("\n".join(parts))


class DeviceError(KilnError):
  """An unknown device string, a missing runtime, or a device that cannot do what was asked."""


class RuntimeLaunchError(KilnError):
  """A program could not be launched with the given buffers and values."""


class KilnBufferError(KilnError):
  """A buffer was used wrongly: wrong size, wrong dtype, read-only, out of range."""


class PlanError(KilnError):
  """An execution plan could not be built: unknown or cyclic dependencies, bad indices, no outputs."""


class PlanSpecError(PlanError):
  """A plan could not be written as a PlanSpec (a host function in it, a weight with no reference), or a PlanSpec could not
  be rebuilt (malformed, a weight missing or not matching its digest)."""


class PlanPoisoned(PlanError):
  """An earlier execute failed; the plan refuses to run until rebuilt."""


class VariableBoundsError(KilnError, ValueError):
  """A runtime variable's value lies outside its DEFINE_VAR bounds, or a variable was left unbound."""


class CacheError(KilnError):
  """The kernel cache was misused (the disk cache itself never raises on a bad entry: it recompiles)."""


class MappedFileError(KilnBufferError):
  """A file a plan reads through a memory map shrank after it was mapped: reading the lost pages would kill the process
  (SIGBUS), so the plan refuses to run. The message names the file's size then and now."""
