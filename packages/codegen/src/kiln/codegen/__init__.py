"""kiln.codegen: lowering, optimiser, renderers, boundary models and device protocols."""
from kiln.codegen.choose import Opt, OptOps, Target
from kiln.codegen.protocols import Allocator, BoundCall, Compiler, Program, Renderer, Runtime
from kiln.codegen.registry import available_devices, get_runtime, register_runtime, target_of, unregister_runtime
from kiln.codegen.spec import BufferSpec, CompiledSpec, DeviceSpec, KernelArg, ProgramSpec, Variable, sym_eval
from kiln.codegen.version import __version__

__all__ = ["DeviceSpec", "available_devices", "get_runtime", "register_runtime", "unregister_runtime", "target_of", "Opt", "OptOps", "Target",
           "Allocator", "BoundCall", "Compiler", "Program", "Renderer", "Runtime", "BufferSpec", "CompiledSpec", "KernelArg",
           "ProgramSpec", "Variable", "sym_eval", "__version__"]
