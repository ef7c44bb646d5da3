"""The bad-input catalogue: malformed inputs across every layer, each checked for the error's type (a KilnError subclass, or
pydantic's ValidationError for the boundary models) and for a message that names the culprit. None may crash the process,
and a failed write must leave its destination as it was."""
import json
import os
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import BufferSpec, CompiledSpec, DeviceSpec, ProgramSpec, Variable
from kiln.executor import cache
from kiln.executor.buffer import Buffer, copy_buffer
from kiln.executor.plan import ExecutionPlanBuilder
from kiln.ir import Ops, UOp, dtypes, kernels
from kiln.ir.errors import (
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
  RuntimeLaunchError,
  SerializeError,
  VariableBoundsError,
)
from kiln.ir.ops import AxisType
from kiln.ir.reference import evaluate
from kiln.ir.serialize import from_json, to_json
from kiln.ir.verify import verify

sys.path.insert(0, os.path.dirname(__file__))
from bad_input_limits import CASES as LIMIT_CASES  # noqa: E402
from bad_input_planspec import CASES as PLANSPEC_CASES  # noqa: E402

RT = get_runtime("CPU")
F32, I32 = dtypes.float32, dtypes.int32


def g(slot: int, n: int = 8, dt=F32) -> UOp: return UOp.define_global(slot, dt.ptr(n))


def scale(n: int = 8, name: str = "scale") -> UOp:
  """out[i] = a[i] * 2 over n elements (slots 0 out, 1 in)."""
  i = UOp.range(n, 0)
  return UOp.sink(g(0, n).index(i).store(g(1, n).index(i).load() * 2.0), name=name)


def sym_kernel() -> UOp:
  n = UOp.variable("n", 1, 8)
  i = UOp.range(n, 0)
  return UOp.sink(g(0).index(i).store(g(1).index(i).load() + 1.0), name="sym")


def sym_sum() -> UOp:
  r = UOp.range(UOp.variable("n", 1, 8), 0, AxisType.REDUCE)
  return UOp.sink(g(0).index(UOp.const(dtypes.int32, 0)).store(g(1).index(r).load().reduce(Ops.ADD, r)), name="sym_sum")


def raw(op: Ops, dt, *src: UOp, arg=None) -> UOp: return UOp(op, dt, tuple(src), arg)


def graph_json(ast: UOp) -> dict: return json.loads(to_json(ast))


def plan_with(ast: UOp, bufs: list[Buffer], slots: list[int] | None = None, outputs=(0,)) -> ExecutionPlanBuilder:
  b = ExecutionPlanBuilder("CPU")
  idx = [b.add_buffer(x) for x in bufs]
  b.add_kernel(ast, list(slots) if slots is not None else idx)  # slots: raw plan buffer indices (may be bad on purpose)
  b.set_outputs(list(outputs))
  return b


def cpu_prog(ast: UOp):
  return RT.load(RT.compiler.compile(RT.renderer.render(ast)))


def disk_file(tmp_path, nbytes: int = 16) -> str:
  p = tmp_path / "data.bin"
  p.write_bytes(bytes(range(nbytes)))
  return str(p)


def cb(n: int, dt: str = "float32") -> Buffer: return Buffer("CPU", n, dt)


# ---- the table: (id, exception type, regex the message must match, thunk); thunks taking tmp_path get it ----
CASES = [
  # IR: wrong dtypes into ops
  ("add-pointer", IRTypeError, r"pointer", lambda: g(0) + 1),
  ("mixed-dtypes-raw", IRVerifyError, r"ADD .*operands must share one dtype.*int32.*float32",
   lambda: verify(UOp.sink(g(0, 1, I32).index(0).store(raw(Ops.ADD, I32, UOp.const(I32, 1).cast(I32) + UOp.variable("k", 0, 3),
                                                              g(1, 1).index(0).load()))))),
  ("sqrt-of-int", IRTypeError, r"sqrt needs a float, got int32", lambda: UOp.variable("k", 0, 3).sqrt()),
  ("idiv-of-floats-raw", IRVerifyError, r"IDIV takes integers only, got float32",
   lambda: verify(UOp.sink(g(0, 1).index(0).store(raw(Ops.IDIV, F32, g(1, 1).index(0).load(), UOp.const(F32, 2.0)))))),
  ("true-div-of-ints", IRTypeError, r"true division.*int32", lambda: UOp.variable("k", 0, 3) / 2),
  ("where-int-cond", IRTypeError, r"condition must be bool, got int32", lambda: UOp.variable("k", 0, 3).where(1, 2)),
  ("store-wrong-dtype", IRTypeError, r"store of float32 into a int32 buffer \(slot 0\)", lambda: g(0, 4, I32).index(0).store(UOp.const(F32, 1.0))),
  ("gate-not-bool", IRTypeError, r"gate must be bool, got int32", lambda: g(0).index(0, UOp.variable("k", 0, 3))),
  ("bitcast-size", IRTypeError, r"bitcast needs dtypes of equal size.*float32.*int64", lambda: g(0).index(0).load().bitcast(dtypes.int64)),
  ("reduce-not-range", IRError, r"reduce\(\) closes RANGEs", lambda: UOp.const(F32, 1.0).reduce(Ops.ADD, UOp.variable("k", 0, 3))),
  ("reduce-bad-op", IRError, r"reduce op must be ADD, MUL or MAX.*SUB", lambda: UOp.const(F32, 1.0).reduce(Ops.SUB, UOp.range(4, 0))),
  ("load-not-index", IRError, r"load\(\) needs an INDEX", lambda: g(0).load()),
  # IR: unbound and out-of-bounds variables, sizes, names
  ("unbound-variable", VariableBoundsError, r"variable n has no value", lambda: evaluate(sym_kernel(), [np.zeros(8, np.float32)] * 2, {})),
  ("variable-out-of-bounds", VariableBoundsError, r"variable n=9 is outside bounds \[1, 8\]",
   lambda: evaluate(sym_kernel(), [np.zeros(8, np.float32)] * 2, {"n": 9})),
  ("bind-out-of-bounds", IRError, r"variable n=0 is outside bounds \[1, 8\]", lambda: UOp.variable("n", 1, 8).bind(0)),
  ("variable-min-gt-max", IRError, r"variable m needs int bounds with min <= max, got \[5, 2\]", lambda: UOp.variable("m", 5, 2)),
  ("variable-bad-name", IRError, r"variable name must be an identifier, got '2x'", lambda: UOp.variable("2x", 0, 1)),
  ("pointer-size-zero", IRTypeError, r"pointer size must be a positive int or -1.*got 0", lambda: F32.ptr(0)),
  ("pointer-size-negative", IRTypeError, r"pointer size must be a positive int or -1.*got -5", lambda: F32.ptr(-5)),
  ("slot-negative", IRError, r"slot must be an int >= 0, got -1", lambda: UOp.define_global(-1, F32.ptr(4))),
  ("index-may-run-out-of-bounds", IRVerifyError, r"index into slot 1 is proven only in \[0, 9\] but the buffer has 8 elements",
   lambda: verify(UOp.sink(g(0, 10).index(i := UOp.range(10, 0)).store(g(1, 8).index(i).load())))),
  ("symbolic-index-may-run-out", IRVerifyError, r"slot 0 .* \[0, 15\] but the buffer has 8 elements",
   lambda: verify(UOp.sink(g(0, 8).index(UOp.range(UOp.variable("n", 1, 16), 0)).store(1.0)))),
  ("duplicate-variable-names", IRVerifyError, r"variable n is also defined as \[1, 8\]",
   lambda: verify(UOp.sink(g(0).index(UOp.range(UOp.variable("n", 1, 8), 0)).store(1.0),
                           g(1).index(UOp.range(UOp.variable("n", 1, 4), 1)).store(2.0)))),
  ("duplicate-slot", IRVerifyError, r"slot 0 is also defined as int32",
   lambda: verify(UOp.sink(g(0, 4, I32).index(0).store(1), g(0, 4).index(1).store(1.0)))),
  ("duplicate-axis-id", IRVerifyError, r"axis id 0 is also used by a RANGE",
   lambda: verify(UOp.sink(g(0).index(UOp.range(4, 0)).store(1.0), g(1).index(UOp.range(8, 0)).store(1.0)))),
  ("sink-of-non-store", IRVerifyError, r"a SINK holds STOREs only; src\[0\] is LOAD", lambda: verify(UOp.sink(g(0).index(0).load()))),
  # reference evaluator: buffers that do not fit
  ("reference-missing-buffer", EvalError, r"no buffer for slot 1", lambda: evaluate(scale(), [np.zeros(8, np.float32)])),
  ("reference-wrong-numpy-dtype", EvalError, r"buffer for slot 1 has numpy dtype float64, the kernel wants float32",
   lambda: evaluate(scale(), [np.zeros(8, np.float32), np.zeros(8, np.float64)])),
  ("reference-buffer-too-small", EvalError, r"index 7 is out of bounds for slot 1 .*4 elements given",
   lambda: evaluate(scale(), [np.zeros(8, np.float32), np.zeros(4, np.float32)])),
  ("reference-2d-buffer", EvalError, r"slot 0 must be a flat 1-D array, got shape \(2, 4\)",
   lambda: evaluate(scale(), [np.zeros((2, 4), np.float32), np.zeros(8, np.float32)])),
  # JSON graph form
  ("json-invalid", SerializeError, r"invalid UOp JSON graph", lambda: from_json("{not json")),
  ("json-truncated", SerializeError, r"invalid UOp JSON graph", lambda: from_json(to_json(scale())[:-40])),
  ("json-unknown-op", SerializeError, r"node 0 .*unknown op 'FROBNICATE'",
   lambda: from_json(json.dumps({"nodes": [{"op": "FROBNICATE", "dtype": "float32"}]}))),
  ("json-forward-source", SerializeError, r"node 0 .*not an earlier node: \[3\]",
   lambda: from_json(json.dumps({"nodes": [{"op": "NEG", "dtype": "float32", "src": [3]}]}))),
  ("json-const-wrong-type", SerializeError, r"CONST of dtype int32 cannot hold 'seven'",
   lambda: from_json(json.dumps({"nodes": [{"op": "CONST", "dtype": "int32", "arg": "seven"}]}))),
  ("json-unknown-dtype", SerializeError, r"unknown dtype 'float33'",
   lambda: from_json(json.dumps({"nodes": [{"op": "CONST", "dtype": "float33", "arg": 1}]}))),
  ("json-extra-field", SerializeError, r"evil", lambda: from_json(json.dumps({"nodes": [{"op": "CONST", "dtype": "int32", "arg": 1, "evil": 1}]}))),
  # codegen: options and boundary models
  ("opt-amount-zero", CodegenError, r"UPCAST amount must be a positive int, got 0", lambda: Opt(OptOps.UPCAST, 0, 0)),
  # an output axis ends with an overlapped or peeled tile instead; a reduce axis must be divided
  ("opt-not-dividing", CodegenError, r"UNROLL\(axis=2, 3\): the amount must divide the axis size \(8\)",
   lambda: RT.renderer.render(kernels.matmul(4, 4, 8), [Opt(OptOps.UNROLL, 2, 3)])),
  ("opt-unknown-axis", CodegenError, r"names axis 5, but the kernel's axes are \[0\]",
   lambda: RT.renderer.render(scale(), [Opt(OptOps.UNROLL, 5, 2)])),
  # an output axis of symbolic size is split into whole units and a tail; a symbolic reduce axis only by an UPCAST
  ("opt-symbolic-reduce-unroll", CodegenError, r"must divide the axis size \(symbolic\)",
   lambda: RT.renderer.render(sym_sum(), [Opt(OptOps.UNROLL, 0, 2)])),
  ("opt-gpu-on-cpu", CodegenError, r"LOCAL is a GPU option", lambda: RT.renderer.render(scale(), [Opt(OptOps.LOCAL, 0, 4)])),
  ("opt-pack-the-upcast-reduce", CodegenError, r"PACK packs panels across the vectorised output axis",  # was a "linearizer bug"
   lambda: RT.renderer.render(kernels.matmul(8, 8, 32), [Opt(OptOps.UPCAST, 2, 16), Opt(OptOps.PACK, 2, 1)])),
  ("render-not-a-sink", CodegenError, r"a kernel is a SINK of STOREs, got Ops.STORE", lambda: RT.renderer.render(scale().src[0])),
  ("spec-duplicate-var-names", ValidationError, r"var_names must be unique, duplicated: \['n'\]",
   lambda: ProgramSpec(name="k", src="", device="CPU", ast=scale(), var_names=["n", "n"])),
  ("spec-outs-not-in-globals", ValidationError, r"outs \[3\] are not in globals \[0, 1\]",
   lambda: ProgramSpec(name="k", src="", device="CPU", ast=scale(), globals=[0, 1], outs=[3], buf_count=2)),
  ("spec-negative-size", ValidationError, r"sizes must be positive, got -4",
   lambda: ProgramSpec(name="k", src="", device="CPU", ast=scale(), global_size=(-4, 1, 1))),
  ("spec-zero-size", ValidationError, r"sizes must be positive, got 0",
   lambda: ProgramSpec(name="k", src="", device="CPU", ast=scale(), local_size=(0, 1, 1))),
  ("variable-model-min-gt-max", ValidationError, r"variable n: min 9 > max 1", lambda: Variable(name="n", min=9, max=1)),
  ("bufferspec-size-zero", ValidationError, r"size\n.*greater than 0", lambda: BufferSpec(dtype="float32", size=0)),
  ("bufferspec-bad-dtype", ValidationError, r"unknown dtype 'floaty'", lambda: BufferSpec(dtype="floaty", size=4)),
  ("compiledspec-invalid-json", SerializeError, r"CompiledSpec JSON: invalid JSON", lambda: CompiledSpec.model_validate_json('{"name": "k", ')),
  ("compiledspec-bad-base64", ValidationError, r"bytes",
   lambda: CompiledSpec.model_validate({**json.loads(cpu_compiled().model_dump_json()), "bytes": "@@@"})),
  # devices
  ("device-unknown", DeviceError, r"invalid device 'TPU:0'.*unknown device kind 'TPU'", lambda: DeviceSpec.parse("TPU:0")),
  ("device-bad-index", DeviceError, r"invalid device 'CUDA:x'.*index must be a non-negative integer, got 'x'", lambda: DeviceSpec.parse("CUDA:x")),
  ("device-disk-no-path", DeviceError, r"DISK device needs a path", lambda: get_runtime("DISK")),
  ("device-cpu-index", DeviceError, r"CPU has a single device", lambda: Buffer("CPU:3", 4, "float32")),
  ("disk-runs-no-kernels", DeviceError, r"holds data only", lambda: get_runtime("DISK:/tmp/x").renderer),
  # CPU programs: buffer counts, values, pointers, broken IR
  ("program-buffer-count", RuntimeLaunchError, r"takes 2 buffers \(slots \[0, 1\]\), got 1",
   lambda: cpu_prog(scale())([np.zeros(8, np.float32).ctypes.data])),
  ("program-null-pointer", RuntimeLaunchError, r"buffer for slot 1 is not a valid address \(0\)",
   lambda: cpu_prog(scale())([np.zeros(8, np.float32).ctypes.data, 0])),
  ("program-value-count", RuntimeLaunchError, r"takes 1 variable values \['n'\], got 0",
   lambda: cpu_prog(sym_kernel())([np.zeros(8, np.float32).ctypes.data] * 2, [])),
  ("program-value-out-of-bounds", VariableBoundsError, r"variable n=100 is outside bounds \[1, 8\]",
   lambda: cpu_prog(sym_kernel())([np.zeros(8, np.float32).ctypes.data] * 2, [100])),
  ("llvm-rejects-ir", CompileError, r"LLVM rejected the generated IR(.|\n)*nonsense",
   lambda: RT.compiler.compile_module("define void @k() {\n  nonsense\n}")),
  # buffers: sizes, dtypes, shapes, devices
  ("buffer-size-zero", KilnBufferError, r"buffer size must be a positive int, got 0", lambda: cb(0)),
  ("buffer-size-negative", KilnBufferError, r"buffer size must be a positive int, got -3", lambda: Buffer("CPU", -3, "float32")),
  ("buffer-unknown-device", DeviceError, r"unknown device kind 'TPU'", lambda: Buffer("TPU", 4, "float32")),
  ("buffer-unknown-dtype", IRTypeError, r"unknown dtype 'float33'", lambda: Buffer("CPU", 4, "float33")),
  ("from-numpy-complex", IRTypeError, r"numpy dtype complex64 has no kiln dtype", lambda: Buffer.from_numpy(np.zeros(4, np.complex64))),
  ("from-numpy-object", IRTypeError, r"numpy dtype object has no kiln dtype", lambda: Buffer.from_numpy(np.array([1, None]))),
  ("from-numpy-dtype-size", KilnBufferError, r"numpy dtype float32 does not store kiln dtype int64",
   lambda: Buffer.from_numpy(np.zeros(4, np.float32), dtype="int64")),
  ("from-numpy-empty", KilnBufferError, r"empty array", lambda: Buffer.from_numpy(np.zeros((0, 3), np.float32))),
  ("copyin-wrong-size", KilnBufferError, r"copyin of 28 bytes into buffer \d+ of 32 bytes \(8 x float32\)",
   lambda: cb(8).copyin(np.ones(7, np.float32))),
  ("copyin-wrong-dtype", KilnBufferError, r"copyin of a numpy float64 array into a float32 buffer", lambda: cb(8).copyin(np.ones(4, np.float64))),
  ("copyin-not-bytes", KilnBufferError, r"copyin needs a numpy array or a bytes-like object, got list", lambda: cb(2).copyin([1.0, 2.0])),
  ("copyout-wrong-size", KilnBufferError, r"copyout of buffer \d+ \(32 bytes", lambda: cb(8).copyout(np.zeros(4, np.float32))),
  ("view-past-end", KilnBufferError, r"runs past the end of buffer", lambda: cb(8).view(16, 8)),
  ("copy-size-mismatch", KilnBufferError, r"copy between buffers of different sizes", lambda: copy_buffer(cb(8), cb(4))),
  # DISK: short files, writes
  ("disk-file-shorter-than-asked", KilnBufferError, r"data\.bin", lambda tmp_path: Buffer(f"DISK:{disk_file(tmp_path, 16)}", 8, "float32").numpy()),
  ("disk-offset-past-end", KilnBufferError, r"data.bin: region offset=64 .*larger than the file \(length 16 bytes\)",
   lambda tmp_path: Buffer(f"DISK:{disk_file(tmp_path, 16)}", 2, "float32", options={"offset": 64}).numpy()),
  ("disk-missing-file", KilnBufferError, r"file to map does not exist", lambda tmp_path: Buffer(f"DISK:{tmp_path}/nope.bin", 2, "float32").numpy()),
  ("disk-write", KilnBufferError, r"read-only", lambda tmp_path: Buffer(f"DISK:{disk_file(tmp_path)}", 4, "float32").copyin(np.zeros(4, np.float32))),
  ("disk-copy-into", KilnBufferError, r"read-only",
   lambda tmp_path: copy_buffer(Buffer(f"DISK:{disk_file(tmp_path)}", 4, "float32"), Buffer.from_numpy(np.zeros(4, np.float32)))),
  ("npy-truncated", KilnBufferError, r"truncated", lambda tmp_path: _truncated_npy(tmp_path)),
  # execution plans: counts, sizes, dtypes, dependencies, devices, variables
  ("plan-buffer-count", PlanError, r"kernel 0 'scale' takes 2 buffers \(DEFINE_GLOBAL slots 0..1\), got 1",
   lambda: plan_with(scale(), [cb(8)]).build()),
  ("plan-buffer-too-small", PlanError, r"slot 1 reads/writes 8 x float32, buffer 1 has only 4",
   lambda: plan_with(scale(), [cb(8), cb(4)]).build()),
  ("plan-kernel-aliases-its-output", PlanError, r"slot 0 \(buffer 0\) is written and overlaps slot 1 \(buffer 0\)",
   lambda: plan_with(scale(), [cb(8)], slots=[0, 0]).build()),
  ("plan-buffer-wrong-dtype", PlanError, r"slot 1 wants float32, buffer 1 is int32",
   lambda: plan_with(scale(), [cb(8), cb(8, "int32")]).build()),
  ("plan-buffer-index-out-of-range", PlanError, r"buffer index 7 is out of range \(the plan has 2 buffers\)",
   lambda: plan_with(scale(), [cb(8)] * 1 + [cb(8)], slots=[0, 7]).build()),
  ("plan-no-outputs", PlanError, r"the plan has no outputs", lambda: plan_with(scale(), [cb(8), cb(8)], outputs=()).build()),
  ("plan-unknown-dependency", PlanError, r"kernel 0 'scale' depends on unknown op 42", lambda: _plan_deps([[42]])),
  ("plan-cyclic-dependency", PlanError, r"cycle(.|\n)*(kernel 0|kernel 1)", lambda: _plan_deps([[1], [0]])),
  ("plan-wrong-device", PlanError, r"buffer 1 is on DISK:.*add_copy it first",
   lambda tmp_path: plan_with(scale(), [cb(8), Buffer(f"DISK:{disk_file(tmp_path, 64)}", 8, "float32")]).build()),
  ("plan-writes-read-only", PlanError, r"writes buffer 0, which is read-only",
   lambda: plan_with(scale(), [Buffer.from_numpy(_readonly(8)), cb(8)]).build()),
  ("plan-var-out-of-bounds", VariableBoundsError, r"variable n=99 is outside bounds \[1, 8\]",
   lambda: plan_with(sym_kernel(), [cb(8), cb(8)]).build().execute_with_vars({"n": 99})),
  ("plan-var-unbound", VariableBoundsError, r"variables \['n'\] are unbound",
   lambda: plan_with(sym_kernel(), [cb(8), cb(8)]).build().execute()),
  ("plan-fixedvar-out-of-bounds", VariableBoundsError, r"fixed variable n=0 is outside bounds \[1, 8\]", lambda: _plan_fixed({"n": 0})),
  ("plan-not-a-buffer", PlanError, r"add_buffer takes a kiln Buffer, got ndarray", lambda: ExecutionPlanBuilder("CPU").add_buffer(np.zeros(4))),
  ("plan-not-an-ast", PlanError, r"add_kernel takes a kernel AST \(UOp\), got str",
   lambda: ExecutionPlanBuilder("CPU").add_kernel("out = a * 2", [0])),
]


CASES += LIMIT_CASES  # document limits and resource exhaustion: bad_input_limits.py
CASES += PLANSPEC_CASES  # portable plans: bad_input_planspec.py


def _readonly(n: int) -> np.ndarray:
  a = np.zeros(n, np.float32)
  a.setflags(write=False)
  return a


def _truncated_npy(tmp_path) -> None:
  from kiln.runtime.cpu.disk import open_npy
  p = tmp_path / "a.npy"
  np.save(p, np.arange(100, dtype=np.float32))
  p.write_bytes(p.read_bytes()[:-40])
  open_npy(str(p))


def _plan_deps(deps: list[list[int]]) -> None:
  b = ExecutionPlanBuilder("CPU")
  x, y = b.add_buffer(cb(8)), b.add_buffer(cb(8))
  for i, d in enumerate(deps): b.add_kernel(scale(name=f"k{i}") if i else scale(), [y if i else x, x if i else y], deps=d)
  b.set_outputs([x])
  b.build()


def _plan_fixed(fixed: dict) -> None:
  b = ExecutionPlanBuilder("CPU")
  bi = [b.add_buffer(cb(8)) for _ in range(2)]
  b.add_kernel(sym_kernel(), bi, fixedvars=fixed)
  b.set_outputs([0])
  b.build()


def cpu_compiled() -> CompiledSpec: return RT.compiler.compile(RT.renderer.render(scale()))


@pytest.mark.parametrize("name,exc,match,fn", CASES, ids=[c[0] for c in CASES])
def test_catalogue(name, exc, match, fn, tmp_path):
  with pytest.raises(exc) as ei:
    fn(tmp_path) if fn.__code__.co_argcount else fn()
  assert isinstance(ei.value, KilnError | ValidationError), f"{name}: {type(ei.value).__name__} is not a KilnError"
  import re
  assert re.search(match, str(ei.value)), f"{name}: message does not name the culprit ({match!r}):\n{ei.value}"


# ---- behaviours beyond one raise ----
def test_failed_copyin_leaves_the_destination_unchanged():
  b = cb(8).copyin(np.arange(8, dtype=np.float32))
  for bad in (np.ones(7, np.float32), np.ones(9, np.float32), np.ones(4, np.float64), [1.0] * 8, "x" * 32):
    with pytest.raises(KilnBufferError): b.copyin(bad)
    assert b.numpy().tolist() == list(range(8)), f"copyin of {type(bad).__name__} touched the buffer"
  v = b.view(8, 4)  # a view: the failed write must not reach the base either
  with pytest.raises(KilnBufferError): v.copyin(np.ones(5, np.float32))
  assert b.numpy().tolist() == list(range(8))


def test_from_numpy_misaligned_array_is_copied_aligned():
  raw = np.zeros(4 * 8 + 1, np.uint8)
  mis = raw[1:].view(np.float32)
  mis[:] = np.arange(8)
  assert mis.ctypes.data % 4 != 0
  b = Buffer.from_numpy(mis)
  assert b.ptr % 4 == 0 and b.numpy().tolist() == list(range(8))
  out = cb(8)
  bld = ExecutionPlanBuilder("CPU")
  bld.add_kernel(scale(), [bld.add_buffer(out), bld.add_buffer(b)])
  bld.set_outputs([0])
  bld.build().execute()
  assert out.numpy().tolist() == [2.0 * i for i in range(8)]


def test_from_numpy_shape_and_strides():
  """A 2-D array is its flat C-order contents; a strided one is copied (never wrapped with the wrong layout)."""
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  assert Buffer.from_numpy(a).numpy().tolist() == list(range(12))
  s = np.arange(16, dtype=np.float32)[::2]
  b = Buffer.from_numpy(s)
  assert b.size == 8 and b.numpy().tolist() == s.tolist()
  s[0] = 99
  assert b.numpy()[0] == 0


def _mk_entry(tmp_path, monkeypatch, ast: UOp):
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  cache.clear_memory_cache()
  _, origin = cache.compile_kernel_with_origin(ast, "CPU")
  assert origin == "compiled"
  files = list((tmp_path / "cache" / "kernels").glob("*.json"))
  assert len(files) == 1
  cache.clear_memory_cache()
  return files[0]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "bad-checksum", "bad-base64"])
def test_corrupt_cache_entry_is_recompiled(tmp_path, monkeypatch, damage):
  ast = scale(name=f"cache_{damage.replace('-', '_')}")
  f = _mk_entry(tmp_path, monkeypatch, ast)
  text = f.read_text()
  env = json.loads(text)
  if damage == "truncated": f.write_text(text[: len(text) // 2])
  elif damage == "garbage": f.write_bytes(os.urandom(200))
  elif damage == "empty": f.write_text("")
  elif damage == "bad-checksum": f.write_text(json.dumps({**env, "sha256": "0" * 64}))
  else:
    spec = json.loads(env["spec"])
    spec["bytes"] = "!!!not base64!!!"
    s = json.dumps(spec)
    import hashlib
    f.write_text(json.dumps({**env, "spec": s, "sha256": hashlib.sha256(s.encode()).hexdigest()}))
  try:
    k, origin = cache.compile_kernel_with_origin(ast, "CPU")
    assert origin == "compiled", f"a {damage} entry was used"
    a, out = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    k.program([out.ctypes.data, a.ctypes.data], [])
    assert out.tolist() == [2.0 * i for i in range(8)]
    cache.clear_memory_cache()
    assert cache.compile_kernel_with_origin(ast, "CPU")[1] == "disk"  # rewritten whole
  finally: cache.clear_memory_cache()


def _deep(depth: int) -> UOp:
  a, out = g(1, 4), g(0, 4)
  i = UOp.range(4, 0)
  x = a.index(i).load()
  for k in range(depth): x = (x + 1.0) if k % 2 else (x * 1.0001)
  return UOp.sink(out.index(i).store(x), name=f"deep{depth}")


def test_ten_thousand_nested_ops_in_the_ir():
  """A 10,000-deep chain: verify, the JSON form and the reference are iterative (no RecursionError)."""
  ast = _deep(10_000)
  verify(ast)
  assert from_json(to_json(ast)) is ast
  bufs = [np.zeros(4, np.float32), np.arange(4, dtype=np.float32)]
  evaluate(ast, bufs)
  assert np.isfinite(bufs[0]).all() and bufs[0][0] > 5000


_DEEP_CPU = """
import sys, numpy as np
sys.setrecursionlimit(1000)
from kiln.codegen.registry import get_runtime
from kiln.ir.reference import evaluate
sys.path.insert(0, {here!r})
from test_bad_input import _deep
ast, rt = _deep(10_000), get_runtime("CPU")
prog = rt.load(rt.compiler.compile(rt.renderer.render(ast)))
got, want = [np.zeros(4, np.float32), np.arange(4, dtype=np.float32)], [np.zeros(4, np.float32), np.arange(4, dtype=np.float32)]
prog([got[0].ctypes.data, got[1].ctypes.data]); evaluate(ast, want)
assert (got[0] == want[0]).all(), (got, want)
print("ok")
"""


def test_ten_thousand_nested_ops_compile_and_run_on_the_cpu():
  """The same chain compiled and run on the CPU in a fresh process (a low recursion limit, a 20 s budget), equal to the reference.
  Rendering was quadratic in the chain (free_ranges() per node in lower.py's flop estimate): ~140 s for 10,000 ops."""
  import subprocess
  try:
    r = subprocess.run([sys.executable, "-c", _DEEP_CPU.format(here=os.path.dirname(__file__))], capture_output=True, text=True, timeout=20)
  except subprocess.TimeoutExpired: pytest.fail("a 10,000-op kernel did not compile and run within 20 s")
  assert r.returncode == 0 and "RecursionError" not in r.stderr, r.stderr[-2000:]
  assert r.stdout.strip() == "ok"


def test_plan_error_during_execute_poisons_and_names_it():
  from kiln.ir.errors import PlanPoisoned
  def boom(*bufs): raise KilnBufferError("custom op failed on purpose")
  b = ExecutionPlanBuilder("CPU")
  x, y = b.add_buffer(cb(8)), b.add_buffer(cb(8))
  b.add_kernel(scale(), [x, y])
  b.add_custom(boom, [x])
  b.set_outputs([x])
  plan = b.build()
  with pytest.raises(KilnBufferError, match="on purpose"): plan.execute()
  with pytest.raises(PlanPoisoned, match="custom op failed on purpose"): plan.execute()


def test_plan_bad_vars_do_not_poison():
  plan = plan_with(sym_kernel(), [cb(8), Buffer.from_numpy(np.arange(8, dtype=np.float32))]).build()
  with pytest.raises(VariableBoundsError): plan.execute_with_vars({"n": 0})
  with pytest.raises(VariableBoundsError, match="must be an int"): plan.execute_with_vars({"n": 2.5})
  plan.execute_with_vars({"n": 3})
  assert plan.output_buffer(0).numpy()[:4].tolist() == [1.0, 2.0, 3.0, 0.0]


def test_plan_of_100_000_kernels():
  """100,000 kernels in one plan build and run correctly: x and y take turns adding 1 to the other, so x ends at N.
  Hazard dependencies were quadratic (every kernel waited on every earlier one): 10,000 kernels took 64 s and 3.6 GB to
  build; now 100,000 take ~11 s and ~460 MB on a 2-core Zen 3 (kiln.executor.hazards.hazard_deps)."""
  n = 100_000
  i = UOp.range(8, 0)
  inc = UOp.sink(g(0).index(i).store(g(1).index(i).load() + 1.0), name="inc")
  b = ExecutionPlanBuilder("CPU")
  x, y = b.add_buffer(Buffer.from_numpy(np.zeros(8, np.float32))), b.add_buffer(cb(8))
  for k in range(n): b.add_kernel(inc, [y, x] if k % 2 == 0 else [x, y])
  b.set_outputs([x])
  plan = b.build()
  assert len(plan.kernels) == n
  plan.execute()
  assert plan.output_buffer(0).numpy().tolist() == [float(n)] * 8
