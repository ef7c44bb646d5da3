"""Issue 41: what a hostile or careless ONNX model could do at load and run time, each case a typed ONNXError (or the
right answer), never a read outside the model's directory, unbounded work, a hang or a raw Python error."""
from __future__ import annotations

import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
  m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", opset)])
  m.ir_version = 8
  return m


def _external_tensor(name: str, dims: list[int], location: str, offset: int = 0, length: int | None = None) -> TensorProto:
  t = TensorProto()
  t.name, t.data_type = name, TensorProto.FLOAT
  t.dims.extend(dims)
  t.data_location = TensorProto.EXTERNAL
  t.external_data.add(key="location", value=location)
  t.external_data.add(key="offset", value=str(offset))
  if length is not None: t.external_data.add(key="length", value=str(length))
  return t


def _constant_model(op: str, t: TensorProto) -> onnx.ModelProto:
  if op == "Constant":
    return _model([helper.make_node("Constant", [], ["y"], value=t)], [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
  shape = numpy_helper.from_array(np.array([3], np.int64), "shape")
  return _model([helper.make_node("ConstantOfShape", ["shape"], ["y"], value=t)], [],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])], [shape])


# ---- item 1: a tensor attribute's external data is resolved against the model's directory, never the working one ----
@pytest.mark.parametrize("op", ["Constant", "ConstantOfShape"])
def test_attribute_external_data_never_reads_the_working_directory(tmp_path, monkeypatch, op: str) -> None:
  secret = np.arange(4, dtype=np.float32)
  (tmp_path / "secret.bin").write_bytes(secret.tobytes())  # in the working directory, not beside the model
  (tmp_path / "sub").mkdir()
  p = str(tmp_path / "sub" / "m.onnx")
  onnx.save(_constant_model(op, _external_tensor("v", [4] if op == "Constant" else [1], "secret.bin")), p)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ONNXError, match=rf"\({op}\): attribute 'value' \(external data\): data file 'secret.bin' does not exist"):
    konnx.load(p)
  onnx.save(_constant_model(op, _external_tensor("v", [1], "../secret.bin")), p)
  with pytest.raises(ONNXError, match="must be a relative path inside the model's directory"): konnx.load(p)
  os.symlink(tmp_path / "secret.bin", tmp_path / "sub" / "link.bin")
  onnx.save(_constant_model(op, _external_tensor("v", [1], "link.bin")), p)
  with pytest.raises(ONNXError, match="leaves the model's directory"): konnx.load(p)


@pytest.mark.parametrize("op", ["Constant", "ConstantOfShape"])
def test_attribute_external_data_inside_the_model_directory_loads(tmp_path, op: str) -> None:
  data = np.array([2.5, -1.0, 7.0, 3.0], np.float32)
  (tmp_path / "d.bin").write_bytes(b"\0" * 8 + data.tobytes())
  p = str(tmp_path / "m.onnx")
  dims = [4] if op == "Constant" else [1]
  onnx.save(_constant_model(op, _external_tensor("v", dims, "d.bin", offset=8)), p)
  want = data if op == "Constant" else np.full(3, data[0], np.float32)
  np.testing.assert_array_equal(konnx.load(p).run({})["y"], want)


def test_attribute_external_data_is_checked_before_any_read(tmp_path) -> None:
  """dims, length and offset are checked against the file's size first: a file far bigger than the tensor is never read
  (a sparse file here: reading it whole would take its full size in memory)."""
  p = str(tmp_path / "m.onnx")
  with open(tmp_path / "big.bin", "wb") as f: f.truncate(1 << 34)  # 16 GiB, sparse
  onnx.save(_constant_model("Constant", _external_tensor("v", [4], "big.bin", length=1 << 34)), p)
  with pytest.raises(ONNXError, match=r"length 17179869184 bytes, but dims \[4\] of float32 take 16"): konnx.load(p)
  onnx.save(_constant_model("Constant", _external_tensor("v", [4], "big.bin", offset=(1 << 34) - 8)), p)
  with pytest.raises(ONNXError, match="truncated or a bad offset"): konnx.load(p)
  onnx.save(_constant_model("Constant", _external_tensor("v", [4], "big.bin", offset=1 << 20)), p)
  np.testing.assert_array_equal(konnx.load(p).run({})["y"], np.zeros(4, np.float32))


def test_a_model_from_bytes_may_not_name_external_files(tmp_path) -> None:
  m = _constant_model("Constant", _external_tensor("v", [4], "d.bin"))
  with pytest.raises(ONNXError, match="external data needs the model's path"): konnx.load(m.SerializeToString())
