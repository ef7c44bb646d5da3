"""The boundary models: validation naming the field, validation on assignment, JSON round trips (UOps as graphs)."""
import base64
import json

import pytest
from pydantic import ValidationError

from kiln.codegen.spec import BufferSpec, CompiledSpec, DeviceSpec, KernelArg, ProgramSpec, Variable, sym_eval
from kiln.ir import UOp, dtypes
from kiln.ir.errors import VariableBoundsError
from kiln.ir.serialize import to_graph

N = UOp.variable("n", 1, 4096)


def _ast() -> UOp:
  out, inp = UOp.define_global(0, dtypes.float32.ptr(64)), UOp.define_global(1, dtypes.float32.ptr(64))
  i = UOp.range(64, 0)
  return UOp.sink(out.index(i).store(inp.index(i).load() * 2.0), name="double")


def _spec(**kw) -> ProgramSpec:
  base = dict(name="double", src="// src", device="CUDA", ast=_ast(), global_size=((N + 31) // 32, 1, 1), local_size=(32, 1, 1),
              vars=[Variable(name="n", min=1, max=4096)], var_names=["n"], globals=[0, 1], outs=[0], ins=[1], buf_count=2,
              args=[KernelArg(slot=0, dtype="float32", size=64), KernelArg(slot=1, dtype="float32", size=64)])
  return ProgramSpec(**{**base, **kw})


def _field_error(e: ValidationError, field: str) -> None:
  """The error names the field: in its location, or (model-level checks) in its message."""
  assert any(field in map(str, err["loc"]) or field in err["msg"] for err in e.errors()), e.errors()


# ---- invalid fields ----
@pytest.mark.parametrize("field,value", [
  ("name", ""), ("global_size", (0, 1, 1)), ("global_size", (4, -1, 1)), ("local_size", (1, 1, 0)), ("global_size", (1.5, 1, 1)),
  ("global_size", (UOp.const(dtypes.float32, 2.0) * UOp.variable("x", 0, 1).cast(dtypes.float32), 1, 1)), ("buf_count", -1),
  ("device", "TPU:0"), ("ast", "not a uop"), ("var_names", ["n", "n"]), ("outs", [0, 7]), ("ins", [9]), ("globals", [0, 0]),
  ("buf_count", 3), ("vars", [Variable(name="m", min=0, max=1)]), ("threads", 0), ("flops", -1),
])
def test_program_spec_invalid_field(field, value):
  with pytest.raises(ValidationError) as ei: _spec(**{field: value})
  _field_error(ei.value, field)


def test_variable_validation():
  with pytest.raises(ValidationError) as ei: Variable(name="n", min=5, max=1)
  _field_error(ei.value, "min")
  with pytest.raises(ValidationError) as ei: Variable(name="1bad", min=0, max=1)
  _field_error(ei.value, "name")
  v = Variable(name="n", min=0, max=1)
  with pytest.raises(ValidationError): v.min = 2  # validated on assignment
  assert v.min == 0  # and left unchanged


@pytest.mark.parametrize("kw,field", [
  (dict(dtype="float32", size=0), "size"), (dict(dtype="float32", size=-3), "size"), (dict(dtype="floaty", size=4), "dtype"),
  (dict(dtype="void", size=4), "dtype"), (dict(dtype="float32x4", size=4), "dtype"), (dict(dtype="float32*4", size=4), "dtype"),
  (dict(dtype="int8", size=4, device="NOPE"), "device"),
])
def test_buffer_spec_invalid(kw, field):
  with pytest.raises(ValidationError) as ei: BufferSpec(**kw)
  _field_error(ei.value, field)


def test_buffer_spec_ok():
  b = BufferSpec(dtype="bfloat16", size=10, device="GPU:1")  # type: ignore[arg-type]
  assert b.nbytes == 20 and str(b.device) == "CUDA:1"
  assert BufferSpec.model_validate_json(b.model_dump_json()) == b
  with pytest.raises(ValidationError): b.size = 0
  assert b.size == 10


@pytest.mark.parametrize("kw,field", [(dict(slot=-1, dtype="int32", size=1), "slot"), (dict(slot=0, dtype="int32", size=0), "size"),
                                      (dict(slot=0, dtype="bogus", size=4), "dtype")])
def test_kernel_arg_invalid(kw, field):
  with pytest.raises(ValidationError) as ei: KernelArg(**kw)
  _field_error(ei.value, field)
  assert KernelArg(slot=0, dtype="int32", size=-1).size == -1  # -1: unknown size


def test_extra_fields_rejected():
  with pytest.raises(ValidationError) as ei: _spec(colour="red")
  _field_error(ei.value, "colour")


# ---- validation on assignment ----
def test_assignment_is_validated_and_rejected_assignment_leaves_spec_unchanged():
  p = _spec()
  before = p.model_dump_json()
  for field, value in [("outs", [5]), ("var_names", ["n", "n"]), ("global_size", (0, 1, 1)), ("buf_count", 7), ("name", "")]:
    with pytest.raises(ValidationError) as ei: setattr(p, field, value)
    _field_error(ei.value, field)
    assert p.model_dump_json() == before
  p.name = "renamed"
  assert p.name == "renamed"


def test_set_buffer_metadata():
  p = _spec()
  before = p.model_dump_json()
  for g, o, i, field in [([0, 1], [2], [1], "outs"), ([0, 1], [0], [3], "ins"), ([0, 0], [0], [0], "globals")]:
    with pytest.raises(ValidationError) as ei: p.set_buffer_metadata(g, o, i)
    _field_error(ei.value, field)
    assert p.model_dump_json() == before  # unchanged on error
  p.set_buffer_metadata([0], [0], [])
  assert p.buf_count == 1 and [a.slot for a in p.args] == [0]  # args kept for the globals that remain
  p.set_buffer_metadata([0, 1, 2], [0, 2], [1])
  assert (p.globals, p.outs, p.ins, p.buf_count, p.args) == ([0, 1, 2], [0, 2], [1], 3, [])  # args no longer cover globals


def test_new_and_builders():
  p = ProgramSpec.new("k", "src", "GPU", _ast())
  assert p.device == DeviceSpec.parse("CUDA:0") and p.globals == [] and p.global_size is None
  p.add_var(Variable(name="n", min=1, max=8))
  p.add_var(Variable(name="a", min=0, max=3))
  assert p.var_names == ["n", "a"] and [v.name for v in p.vars] == ["n", "a"]
  with pytest.raises(ValueError): p.add_var(Variable(name="n", min=1, max=8))
  p.set_var_names(["a", "n"])
  assert p.var_names == ["a", "n"]
  with pytest.raises(ValidationError): p.set_var_names(["a"])  # n is in vars: must stay in var_names
  assert p.var_names == ["a", "n"]
  p.set_work_sizes((N * 2, 1, 1), (64, 1, 1))
  assert p.global_size is not None and p.global_size[0] is N * 2 and p.local_size == (64, 1, 1)
  with pytest.raises(ValidationError): p.set_work_sizes((0, 1, 1), None)
  assert p.local_size == (64, 1, 1)
  p.set_work_sizes((UOp.const(dtypes.int32, 5), 1, 1), None)
  assert p.global_size == (5, 1, 1)  # a constant UOp becomes an int


# ---- JSON ----
def test_program_spec_json_round_trip():
  p = _spec()
  j = p.model_dump_json()
  q = ProgramSpec.model_validate_json(j)
  assert q == p and q.ast is p.ast and q.ast.key == p.ast.key
  assert q.global_size is not None and q.global_size[0] is p.global_size[0]  # type: ignore[index]
  d = json.loads(j)
  assert d["ast"] == to_graph(p.ast).model_dump(mode="json") and d["device"] == "CUDA:0"
  assert d["global_size"][1:] == [1, 1] and "nodes" in d["global_size"][0]
  assert sym_eval(q.global_size[0], {"n": 100}) == 4  # type: ignore[index]


def test_program_spec_json_from_another_process_keeps_key():
  import subprocess
  import sys
  p = _spec()
  code = ("import sys; from kiln.codegen.spec import ProgramSpec; p = ProgramSpec.model_validate_json(sys.stdin.read()); "
          "print(p.ast.key); print(p.model_dump_json())")
  out = subprocess.run([sys.executable, "-c", code], input=p.model_dump_json(), capture_output=True, text=True, check=True).stdout.split("\n")
  assert out[0] == p.ast.key and ProgramSpec.model_validate_json(out[1]) == p


def test_compiled_spec_round_trips():
  ast = _ast()
  blob = bytes(range(256)) * 3
  c = CompiledSpec.from_bytes("double", blob, ast)
  assert c.src is None and c.bytes == blob
  j = c.model_dump_json()
  assert json.loads(j)["bytes"] == base64.b64encode(blob).decode()
  assert CompiledSpec.model_validate_json(j) == c

  s = CompiledSpec.from_source("double", "define void @double()", ast, 2)
  assert s.bytes == b"" and s.buf_count == 2 and s.globals == [0, 1]
  assert CompiledSpec.model_validate_json(s.model_dump_json()) == s

  w = CompiledSpec.from_source_with_sizes("double", "src", ast, (N * 4, 2, 1), (8, 1, 1), 2)
  w2 = CompiledSpec.model_validate_json(w.model_dump_json())
  assert w2 == w and w2.global_size is not None and w2.global_size[0] is N * 4 and w2.local_size == (8, 1, 1)

  f = CompiledSpec.from_program(_spec(), data=b"\x7fELF", compiler="nvcc 13.0 sm_90")
  assert (f.globals, f.outs, f.ins, f.var_names, f.buf_count, str(f.device)) == ([0, 1], [0], [1], ["n"], 2, "CUDA:0")
  assert CompiledSpec.model_validate_json(f.model_dump_json()) == f


@pytest.mark.parametrize("kw,field", [
  (dict(name="k"), "src"), (dict(name="", src="x"), "name"), (dict(name="k", bytes="***notbase64"), "bytes"),
  (dict(name="k", src="x", var_names=["a", "a"]), "var_names"), (dict(name="k", src="x", global_size=(1, 0, 1)), "global_size"),
  (dict(name="k", src="x", globals=[0], outs=[1], buf_count=1), "outs"),
])
def test_compiled_spec_invalid(kw, field):
  with pytest.raises(ValidationError) as ei: CompiledSpec(ast=_ast(), **kw)
  _field_error(ei.value, field)


def test_bad_uop_graph_is_a_validation_error():
  d = json.loads(_spec().model_dump_json())
  d["ast"]["nodes"][0]["op"] = "NOT_AN_OP"
  with pytest.raises(ValidationError) as ei: ProgramSpec.model_validate(d)
  _field_error(ei.value, "ast")


def test_sym_eval():
  a = UOp.variable("a", -100, 100)
  assert sym_eval(7, {}) == 7
  assert sym_eval((N + 255) // 256, {"n": 1000}) == 4
  assert sym_eval(a // 4, {"a": -7}) == -1 and sym_eval(a % 4, {"a": -7}) == -3  # C truncation
  assert sym_eval(N.bind(5) * 3, {}) == 15
  with pytest.raises(VariableBoundsError, match="variable n"): sym_eval(N * 2, {})
