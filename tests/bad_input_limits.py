"""The bad-input catalogue's document-limit and resource-exhaustion entries (imported by test_bad_input.py, whose CASES they
extend): JSON graphs, specs and ONNX models over kiln's limits, buffers larger than memory, a symbolic size bound to its
maximum, variable values at the edges of int32/int64. Same shape: (id, exception type, regex naming the culprit, thunk)."""
import contextlib
import json
import os

import numpy as np
from pydantic import ValidationError

from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import MAX_SPEC_BYTES, BufferSpec, CompiledSpec, DeviceSpec, KernelArg, ProgramSpec, Variable
from kiln.executor.buffer import Buffer
from kiln.executor.plan import ExecutionPlanBuilder
from kiln.ir import UOp, dtypes
from kiln.ir.errors import DeviceError, IRError, IRVerifyError, KilnBufferError, PlanError, SerializeError, VariableBoundsError
from kiln.ir.serialize import MAX_DOCUMENT_BYTES, MAX_NODES, DocumentLimitError, from_json
from kiln.ir.verify import verify

F32, I32, I64 = dtypes.float32, dtypes.int32, dtypes.int64
RT = get_runtime("CPU")


def g(slot: int, n: int = 8, dt=F32) -> UOp: return UOp.define_global(slot, dt.ptr(n))


def scale() -> UOp:
  i = UOp.range(8, 0)
  return UOp.sink(g(0).index(i).store(g(1).index(i).load() * 2.0), name="scale")


def doc(*nodes: dict) -> str: return json.dumps({"nodes": list(nodes)})


def chain(n: int) -> str:
  """A CONST and n NEGs, each reading the one before: depth n + 1."""
  return json.dumps({"nodes": [{"op": "CONST", "dtype": "float32", "arg": {"float": "0x1p0"}}] +
                              [{"op": "NEG", "dtype": "float32", "src": [i]} for i in range(n)]})


def spec(**kw) -> ProgramSpec: return ProgramSpec(**{"name": "k", "src": "", "device": "CPU", "ast": scale(), **kw})


def compiled_json(**changes) -> str:
  d = json.loads(RT.compiler.compile(RT.renderer.render(scale())).model_dump_json())
  return json.dumps({**d, **changes})


@contextlib.contextmanager
def guarded():
  old = os.environ.get("KILN_GUARD")
  os.environ["KILN_GUARD"] = "1"
  try: yield
  finally:
    if old is None: del os.environ["KILN_GUARD"]
    else: os.environ["KILN_GUARD"] = old


def guarded_buffer(n: int) -> None:
  with guarded(): Buffer("CPU", n, "float32").numpy()


def run_plan(ast: UOp, bufs: list[Buffer], var_vals: dict) -> None:
  b = ExecutionPlanBuilder("CPU")
  idx = [b.add_buffer(x) for x in bufs]
  b.add_kernel(ast, idx)
  b.set_outputs([0])
  b.build().execute_with_vars(var_vals)


def max_size_kernel() -> UOp:
  """A size bound to the largest int32: n in [1, 2**31 - 1] over buffers declared that large."""
  n = UOp.variable("n", 1, 2**31 - 1)
  i = UOp.range(n, 0)
  return UOp.sink(g(0, 2**31 - 1).index(i).store(g(1, 2**31 - 1).index(i).load() + 1.0), name="maxsize")


def int32_edge_kernel() -> UOp:
  v = UOp.variable("v", -(2**31), 2**31 - 1)
  return UOp.sink(g(0, 1, I32).index(0).store(v), name="edge")


def overflowing_index() -> None:
  """i * n + j with n up to 2**31 - 1: the product leaves int32, so no bound holds and the index is refused."""
  n = UOp.variable("n", 1, 2**31 - 1)
  i, j = UOp.range(n, 0), UOp.range(n, 1)
  verify(UOp.sink(g(0, 2**31 - 1).index(i * n + j).store(1.0)))


CASES = [
  # JSON graphs over the document limits (kiln.ir.serialize)
  ("json-document-too-large", DocumentLimitError, rf"size in bytes is {MAX_DOCUMENT_BYTES + 1}, over MAX_DOCUMENT_BYTES",
   lambda: from_json(" " * (MAX_DOCUMENT_BYTES + 1))),
  ("json-too-many-nodes", DocumentLimitError, rf"number of nodes is {MAX_NODES + 1}, over MAX_NODES",
   lambda: from_json(doc(*[{"op": "CONST", "dtype": "int32", "arg": 1}] * (MAX_NODES + 1)))),
  ("json-100000-deep-chain", DocumentLimitError, r"node 50000 \(NEG\): the graph's depth is 50001, over MAX_DEPTH = 50000",
   lambda: from_json(chain(100_000))),
  ("json-too-many-sources", DocumentLimitError, r"node 1 \(SINK\): the number of sources is 5000, over MAX_SOURCES = 4096",
   lambda: from_json(doc({"op": "CONST", "dtype": "int32", "arg": 1}, {"op": "SINK", "dtype": "void", "src": [0] * 5000}))),
  ("json-nested-too-deep", SerializeError, r"nested too deeply", lambda: from_json("[" * 100_000 + "]" * 100_000)),
  ("json-duplicate-keys", SerializeError, r"duplicate keys \['op'\]",
   lambda: from_json('{"nodes": [{"op": "CONST", "op": "NEG", "dtype": "int32", "arg": 1}]}')),
  ("json-nan-token", SerializeError, r"NaN is not JSON", lambda: from_json('{"nodes": [{"op": "CONST", "dtype": "float32", "arg": NaN}]}')),
  ("json-not-utf8", SerializeError, r"invalid UOp JSON graph: invalid JSON", lambda: from_json(b'{"nodes": "\xff\xfe"}')),
  ("json-5000-digit-int", SerializeError, r"invalid JSON.*digits",
   lambda: from_json('{"nodes": [{"op": "CONST", "dtype": "int32", "arg": ' + "7" * 5000 + "}]}")),
  ("json-src-not-ints", SerializeError, r"src\.0\s+Input should be a valid integer",
   lambda: from_json(doc({"op": "CONST", "dtype": "int32", "arg": 1}, {"op": "NEG", "dtype": "int32", "src": ["0"]}))),
  ("json-cycle", SerializeError, r"node 0 \(NEG\).*not an earlier node: \[1\]",
   lambda: from_json(doc({"op": "NEG", "dtype": "int32", "src": [1]}, {"op": "NEG", "dtype": "int32", "src": [0]}))),
  ("json-long-name", DocumentLimitError, r"string arg's length is 2000, over MAX_STRING_CHARS = 1024",
   lambda: from_json(doc({"op": "SINK", "dtype": "void", "arg": "k" * 2000}))),
  ("json-long-dtype", DocumentLimitError, r"dtype name's length is 2008, over MAX_STRING_CHARS",
   lambda: from_json(doc({"op": "DEFINE_GLOBAL", "dtype": "float32*" + "9" * 2000, "arg": 0}))),
  ("json-buffer-2**62-elements", DocumentLimitError, r"float32 buffer's size in bytes is 18446744073709551616, over MAX_BUFFER_BYTES",
   lambda: from_json(doc({"op": "DEFINE_GLOBAL", "dtype": f"float32*{2**62}", "arg": 0}))),
  ("json-vector-too-wide", DocumentLimitError, r"vector width of float32x100000 is 100000, over MAX_VECTOR_WIDTH",
   lambda: from_json(doc({"op": "DEFINE_GLOBAL", "dtype": "float32*4", "arg": 0}, {"op": "LOAD", "dtype": "float32x100000", "src": [0]}))),
  ("json-slot-too-large", DocumentLimitError, r"DEFINE_GLOBAL slot is 5001, over MAX_SLOTS = 4096",
   lambda: from_json(doc({"op": "DEFINE_GLOBAL", "dtype": "float32*4", "arg": 5000}))),
  ("json-slot-negative", SerializeError, r"DEFINE_GLOBAL slot is an int >= 0, got -1",
   lambda: from_json(doc({"op": "DEFINE_GLOBAL", "dtype": "float32*4", "arg": -1}))),
  ("json-int-beyond-uint64", SerializeError, r"int arg 18446744073709551616 fits neither int64 nor uint64",
   lambda: from_json(doc({"op": "RANGE", "dtype": "int32", "arg": {"tuple": [2**64, {"axis": "LOOP"}]}}))),
  ("json-const-int64-edge", SerializeError, r"CONST of dtype int64 cannot hold 9223372036854775808",
   lambda: from_json(doc({"op": "CONST", "dtype": "int64", "arg": 2**63}))),
  ("json-const-int32-edge", SerializeError, r"CONST of dtype int32 cannot hold -2147483649",
   lambda: from_json(doc({"op": "CONST", "dtype": "int32", "arg": -(2**31) - 1}))),
  ("json-variable-bounds-outside-dtype", SerializeError, r"variable 'n' bounds \[0, 2147483648\] are not ints that fit int32",
   lambda: from_json(doc({"op": "DEFINE_VAR", "dtype": "int32", "arg": {"tuple": ["n", 0, 2**31]}}))),
  ("json-arg-too-many-values", DocumentLimitError, r"arg's number of values is 65, over MAX_ARG_ITEMS",
   lambda: from_json(doc({"op": "SINK", "dtype": "void", "arg": {"tuple": list(range(100))}}))),
  ("json-arg-nested-too-deep", DocumentLimitError, r"arg's nesting depth is 9, over MAX_ARG_DEPTH = 8",
   lambda: from_json(doc({"op": "SINK", "dtype": "void", "arg": json.loads('{"tuple": [' * 5 + "1" + "]}" * 5)}))),
  # specs over their limits (kiln.codegen.spec)
  ("spec-json-too-large", DocumentLimitError, rf"CompiledSpec JSON: the document's size in bytes is {MAX_SPEC_BYTES + 1}, over MAX_SPEC_BYTES",
   lambda: CompiledSpec.model_validate_json(" " * (MAX_SPEC_BYTES + 1))),
  ("spec-json-duplicate-keys", SerializeError, r"CompiledSpec JSON: duplicate keys \['name'\]",
   lambda: CompiledSpec.model_validate_json(compiled_json()[:-1] + ', "name": "evil"}')),
  ("spec-bytes-not-text", ValidationError, r"bytes are base64 text, got int",
   lambda: CompiledSpec.model_validate_json(compiled_json(bytes=12345))),  # b64decode raised a bare TypeError
  ("spec-name-too-long", ValidationError, r"name's length is 5000, over MAX_NAME_CHARS = 1024", lambda: spec(name="k" * 5000)),
  ("spec-source-too-long", ValidationError, r"source text's length is 33554433, over MAX_SOURCE_CHARS", lambda: spec(src=" " * ((32 << 20) + 1))),
  ("spec-threads", ValidationError, r"threads is 1000000, over MAX_THREADS = 4096", lambda: spec(threads=10**6)),
  ("spec-scratch-2**62", ValidationError, r"scratch_bytes is 4611686018427387904, over MAX_BUFFER_BYTES", lambda: spec(scratch_bytes=2**62)),
  ("spec-work-size-over-int32", ValidationError, r"work size is 2147483648, over MAX_WORK_SIZE = 2147483647",
   lambda: spec(global_size=(2**31, 1, 1))),
  ("spec-too-many-globals", ValidationError, r"number of globals is 5000, over MAX_BUFFERS = 4096",
   lambda: spec(globals=list(range(5000)))),
  ("spec-flops-beyond-int64", ValidationError, r"flops 18446744073709551616 does not fit int64", lambda: spec(flops=2**64)),
  ("spec-ast-too-deep", ValidationError, r"the graph's depth is 50001, over MAX_DEPTH", lambda: spec(ast=json.loads(chain(60_000)))),
  ("spec-variable-beyond-int64", ValidationError, r"variable n: bound 9223372036854775808 does not fit int64",
   lambda: Variable(name="n", min=0, max=2**63)),
  ("bufferspec-2**62-elements", ValidationError, r"buffer's size in bytes is 18446744073709551616, over MAX_BUFFER_BYTES",
   lambda: BufferSpec(dtype="float32", size=2**62)),
  ("kernelarg-slot-too-large", ValidationError, r"argument's slot is 1000001, over MAX_BUFFERS",
   lambda: KernelArg(slot=10**6, dtype="float32", size=4)),
  ("device-path-too-long", DeviceError, r"DISK path's length is 5001, over MAX_PATH_CHARS = 4096", lambda: DeviceSpec.parse("DISK:/" + "a" * 5000)),
  # resource exhaustion: memory, symbolic sizes at their maximum, variable values at the int32/int64 edges
  ("buffer-larger-than-memory", KilnBufferError, r"cannot allocate a CPU buffer of 70368744177664 bytes: out of memory",
   lambda: Buffer("CPU", 2**44, "float32").numpy()),
  ("buffer-larger-than-address-space", KilnBufferError, r"CPU buffer of 9223372036854775808 bytes: larger than the address space",
   lambda: Buffer("CPU", 2**61, "float32").numpy()),  # was numpy's ValueError
  ("guarded-buffer-larger-than-memory", KilnBufferError, r"cannot allocate a CPU buffer of 17592186044416 bytes: out of memory",
   lambda: guarded_buffer(2**42)),  # KILN_GUARD's mmap raised OSError ENOMEM
  ("plan-symbolic-size-at-max", PlanError, r"slot 0 reads/writes 2147483647 x float32, buffer 0 has only 8",
   lambda: run_plan(max_size_kernel(), [Buffer("CPU", 8, "float32"), Buffer("CPU", 8, "float32")], {"n": 2**31 - 1})),
  ("index-product-leaves-int32", IRVerifyError, r"index into slot 0 is proven only in \[-2147483648, 2147483647\]", overflowing_index),
  ("var-value-past-int32", VariableBoundsError, r"variable v=2147483648 is outside bounds \[-2147483648, 2147483647\]",
   lambda: run_plan(int32_edge_kernel(), [Buffer("CPU", 1, "int32")], {"v": 2**31})),
  ("var-value-below-int32", VariableBoundsError, r"variable v=-2147483649 is outside bounds",
   lambda: run_plan(int32_edge_kernel(), [Buffer("CPU", 1, "int32")], {"v": -(2**31) - 1})),
  ("var-bounds-past-int64", IRError, r"variable w bounds \[0, 9223372036854775808\] do not fit int64", lambda: UOp.variable("w", 0, 2**63, I64)),
]



# ---- ONNX models over kiln.graph.onnx_limits (when the onnx package is installed) ----
try:
  import onnx
  from onnx import TensorProto, helper, numpy_helper

  from kiln.graph import ONNXError
  from kiln.graph.onnx import load as onnx_load
except ImportError: onnx = None


def vi(name: str, shape: list, t: int = 1) -> object: return helper.make_tensor_value_info(name, t, shape)  # 1: FLOAT


def model(nodes: list, inputs: list, outputs: list, inits: tuple = ()) -> object:
  return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)), opset_imports=[helper.make_opsetid("", 17)])


def relu_chain(n: int) -> bytes:
  nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(n)]
  return model(nodes, [vi("v0", [4])], [vi(f"v{n}", [4])]).SerializeToString()


def too_many_nodes() -> None:
  m = model([], [vi("x", [4])], [vi("x", [4])])
  m.graph.node.extend([helper.make_node("Relu", ["x"], ["y"])] * 100_001)
  onnx_load(m.SerializeToString())


def folded(op: str, arrays: dict, out_shape: list, **attrs) -> None:
  inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in arrays.items()]
  onnx_load(model([helper.make_node(op, list(arrays), ["y"], **attrs)], [], [vi("y", out_shape)], inits).SerializeToString())


def on_x(node: object, x_shape: list, inits: tuple = (), out_shape: list | None = None) -> None:
  onnx_load(model([node], [vi("x", x_shape)], [vi("y", out_shape or [4])], inits).SerializeToString())


def fifo(tmp_path) -> None:
  os.mkfifo(tmp_path / "m.onnx")
  onnx_load(str(tmp_path / "m.onnx"))


def sparse_3gib(tmp_path) -> None:
  with open(tmp_path / "m.onnx", "wb") as f: f.truncate(3 << 30)  # no blocks written
  onnx_load(str(tmp_path / "m.onnx"))


def external_overflow(tmp_path) -> None:
  t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**32, 2**32], data_location=TensorProto.EXTERNAL)
  t.external_data.add(key="location", value="w.bin")
  (tmp_path / "w.bin").write_bytes(b"\0" * 64)
  onnx.save(model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", [4])], [vi("y", [4])], (t,)), str(tmp_path / "m.onnx"))
  onnx_load(str(tmp_path / "m.onnx"))


ONNX_CASES = [
  ("onnx-fifo", ONNXError, r"is a FIFO, not a regular file .*m\.onnx", fifo),  # onnx.load would block on it, or read /dev/zero forever
  ("onnx-file-over-2gib", ONNXError, r"model file's size in bytes is 3221225472, over MAX_MODEL_BYTES = 2147483647", sparse_3gib),
  ("onnx-too-many-nodes", ONNXError, r"number of nodes is 100001, over MAX_NODES = 100000", too_many_nodes),
  ("onnx-too-deep", ONNXError, r"node <Relu> \(Relu\): the graph's depth is 10001, over MAX_DEPTH = 10000", lambda: onnx_load(relu_chain(10_001))),
  ("onnx-negative-input-dim", ONNXError, r"value 'x': negative dim -3", lambda: on_x(helper.make_node("Relu", ["x"], ["y"]), [-3])),
  ("onnx-input-dims-overflow", ONNXError, r"input 'x': the size in bytes of dims \[1099511627776, 1099511627776\] is \d+, over MAX_TENSOR_BYTES",
   lambda: on_x(helper.make_node("Relu", ["x"], ["y"]), [2**40, 2**40], out_shape=[2**40, 2**40])),
  ("onnx-rank-33", ONNXError, r"value 'x': the rank is 33, over MAX_RANK = 32", lambda: on_x(helper.make_node("Relu", ["x"], ["y"]), [1] * 33)),
  ("onnx-raw-data-short", ONNXError, r"initializer 'w': raw_data holds 4 bytes, dims \[1099511627776\] take 4398046511104",
   lambda: on_x(helper.make_node("Add", ["x", "w"], ["y"]), [4], (TensorProto(name="w", data_type=1, dims=[2**40], raw_data=b"\0" * 4),))),
  ("onnx-typed-data-short", ONNXError, r"initializer 'w': float_data holds 3 values, dims \[4\] take 4",
   lambda: on_x(helper.make_node("Add", ["x", "w"], ["y"]), [4], (TensorProto(name="w", data_type=1, dims=[4], float_data=[1, 2, 3]),))),
  ("onnx-external-dims-overflow", ONNXError, r"initializer 'w': the size in bytes of dims \[4294967296, 4294967296\] is \d+, over MAX_TENSOR_BYTES",
   external_overflow),
  ("onnx-constant-of-shape-2**40", ONNXError, r"\(ConstantOfShape\): a load-time fold's element count is 1099511627776, over MAX_FOLDED_ELEMENTS",
   lambda: folded("ConstantOfShape", {"shape": np.array([2**40], np.int64)}, [2**40])),  # was numpy's MemoryError
  ("onnx-range-zero-delta", ONNXError, r"\(Range\): Range needs finite bounds and a non-zero delta, got 0.0, 10.0, 0.0",
   lambda: folded("Range", {"s": np.array(0, np.int64), "l": np.array(10, np.int64), "d": np.array(0, np.int64)}, [10])),  # was ZeroDivisionError
  ("onnx-broadcast-fold", ONNXError, r"\(Add\): a load-time fold's element count is 10000000000, over MAX_FOLDED_ELEMENTS",
   lambda: folded("Add", {"a": np.zeros((100_000, 1), np.float32), "b": np.zeros((1, 100_000), np.float32)}, [100_000, 100_000])),
  ("onnx-attribute-too-many-ints", ONNXError, r"attribute 'perm''s number of ints is 1048577, over MAX_ATTRIBUTE_ITEMS",
   lambda: on_x(helper.make_node("Transpose", ["x"], ["y"], perm=[0] * (2**20 + 1)), [4])),
  ("onnx-name-too-long", ONNXError, r"length in bytes of the name 'yyyy.*is 5000, over MAX_NAME_BYTES = 4096",
   lambda: on_x(helper.make_node("Relu", ["x"], ["y" * 5000]), [4])),
  ("onnx-expand-to-2**124", ONNXError, r"\(Expand\): output: the size in bytes of dims \[4611686018427387904, 4611686018427387904\]",
   lambda: on_x(helper.make_node("Expand", ["x", "s"], ["y"]), [1], (numpy_helper.from_array(np.array([2**62, 2**62], np.int64), "s"),))),
]
if onnx is not None: CASES += ONNX_CASES
