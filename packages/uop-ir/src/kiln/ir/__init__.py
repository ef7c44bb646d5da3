"""kiln.ir: dtypes, hash-consed UOps, symbolic simplifier, pattern matcher, verifier, JSON form, reference evaluator."""
from kiln.ir.dtype import DType, PtrDType, dtypes, least_upper_dtype, parse_dtype
from kiln.ir.errors import (
                            CacheError,
                            CodegenError,
                            CompileError,
                            DeviceError,
                            EvalError,
                            IRError,
                            IRTypeError,
                            IRVerifyError,
                            KilnBufferError,
                            KilnError,
                            PlanError,
                            PlanPoisoned,
                            RewriteError,
                            RuntimeLaunchError,
                            SerializeError,
                            SettingError,
                            VariableBoundsError,
)
from kiln.ir.ops import AxisType, GroupOp, Ops
from kiln.ir.rewrite import PatternMatcher, UPat, graph_rewrite, substitute
from kiln.ir.uop import UOp
from kiln.ir.version import __version__

__all__ = ["DType", "PtrDType", "dtypes", "least_upper_dtype", "parse_dtype", "Ops", "AxisType", "GroupOp", "UOp", "UPat",
           "PatternMatcher", "graph_rewrite", "substitute", "KilnError", "IRError", "IRTypeError", "IRVerifyError", "RewriteError",
           "SerializeError", "EvalError", "CodegenError", "CompileError", "DeviceError", "RuntimeLaunchError", "KilnBufferError",
           "PlanError", "PlanPoisoned", "VariableBoundsError", "CacheError", "SettingError", "__version__"]
