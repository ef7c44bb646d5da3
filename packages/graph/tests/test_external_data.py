"""ONNX initializers stored as external data: mapped (numpy.memmap of the data file, the plan's buffers wrap those pages),
never read in; the data file is untrusted, so locations, offsets and lengths are checked against it (ONNXError)."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.graph import ONNXError  # noqa: E402
from kiln.graph import onnx as konnx  # noqa: E402

RNG = np.random.default_rng(7)
W1, B1 = RNG.standard_normal((16, 32)).astype(np.float32), RNG.standard_normal(32).astype(np.float32)
W2 = RNG.standard_normal((32, 8)).astype(np.float32)
X = RNG.standard_normal((4, 16)).astype(np.float32)


def mlp() -> onnx.ModelProto:
  g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
                         helper.make_node("Relu", ["h1"], ["h2"]), helper.make_node("MatMul", ["h2", "w2"], ["y"])],
                        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                        [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(B1, "b1"), numpy_helper.from_array(W2, "w2")])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  return m


def save_external(tmp_path, name: str = "m.onnx") -> str:
  p = str(tmp_path / name)
  onnx.save_model(mlp(), p, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
  assert os.path.getsize(tmp_path / "weights.bin") >= W1.nbytes + B1.nbytes + W2.nbytes
  return p


def _mapped(a: object) -> bool:
  """Whether an array's memory is (a view of) a file mapping."""
  while a is not None:
    if isinstance(a, (np.memmap, mmap.mmap)): return True
    a = getattr(a, "base", None) if not isinstance(a, memoryview) else a.obj
  return False


def test_external_data_is_mapped_and_correct(tmp_path) -> None:
  p = save_external(tmp_path)
  want = ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
  km = konnx.load(p)
  np.testing.assert_allclose(km.run({"x": X})["y"], want, rtol=1e-5, atol=1e-5)
  # the weights' plan buffers wrap the mapped file: no copy into memory
  ext = [b._storage.external for b in km.plan.buffers if getattr(b._storage, "external", None) is not None]
  sizes = sorted(e.nbytes for e in ext if _mapped(e))
  assert sizes == sorted([W1.nbytes, B1.nbytes, W2.nbytes]), (sizes, [type(e) for e in ext])


def test_external_data_mapped_by_kiln_run(tmp_path, capsys) -> None:
  from kiln.graph import cli
  p = save_external(tmp_path)
  np.save(tmp_path / "x.npy", X)
  assert cli.main([p, "-i", f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "out")]) == 0
  np.testing.assert_allclose(np.load(tmp_path / "out" / "y.npy"), np.maximum(X @ W1 + B1, 0) @ W2, rtol=1e-4, atol=1e-4)


def test_truncated_data_file(tmp_path) -> None:
  p = save_external(tmp_path)
  data = tmp_path / "weights.bin"
  with open(data, "r+b") as f: f.truncate(os.path.getsize(data) - 4)
  with pytest.raises(ONNXError, match=r"initializer 'w2' \(external data\).*truncated"): konnx.load(p)
  data.write_bytes(b"")
  with pytest.raises(ONNXError, match="truncated"): konnx.load(p)


def _edit(tmp_path, name: str, **kv: str) -> str:
  """The external model with initializer w1's external_data entries changed (a value of '' removes the key)."""
  p = save_external(tmp_path)
  m = onnx.load(p, load_external_data=False)
  init = next(i for i in m.graph.initializer if i.name == "w1")
  entries = {e.key: e.value for e in init.external_data}
  entries.update(kv)
  del init.external_data[:]
  for k, v in entries.items():
    if v != "": init.external_data.add(key=k, value=v)
  out = str(tmp_path / name)
  with open(out, "wb") as f: f.write(m.SerializeToString())
  return out


@pytest.mark.parametrize("kv,match", [
  ({"offset": str(1 << 40)}, "truncated or a bad offset"), ({"offset": "-4"}, "is not a non-negative integer"),
  ({"offset": "12abc"}, "is not a non-negative integer"),
  ({"offset": " 3"}, "is not a non-negative integer"), ({"offset": "+3"}, "is not a non-negative integer"),
  ({"offset": "\u0663"}, "is not a non-negative integer"),  # an Arabic-Indic 3: Python's int() reads it, onnxruntime does not
  ({"length": "8"}, r"length 8 bytes, but dims \[16, 32\]"), ({"location": "../weights.bin"}, "inside the model's directory"),
  ({"location": "/etc/passwd"}, "inside the model's directory"), ({"location": "nope.bin"}, "does not exist"),
  ({"location": ""}, "inside the model's directory"),
])
def test_bad_external_entries(tmp_path, kv: dict, match: str) -> None:
  with pytest.raises(ONNXError, match=match): konnx.load(_edit(tmp_path, "bad.onnx", **kv))


def test_symlink_out_of_the_directory_is_refused(tmp_path) -> None:
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "secret.bin").write_bytes(b"\0" * 4096)
  inner = tmp_path / "model"
  inner.mkdir()
  p = save_external(inner)
  os.symlink(outside / "secret.bin", inner / "link.bin")
  m = onnx.load(p, load_external_data=False)
  for init in m.graph.initializer:
    for e in init.external_data:
      if e.key == "location": e.value = "link.bin"
  with open(inner / "ln.onnx", "wb") as f: f.write(m.SerializeToString())
  with pytest.raises(ONNXError, match="leaves the model's directory"): konnx.load(str(inner / "ln.onnx"))


def test_external_data_needs_a_path(tmp_path) -> None:
  p = save_external(tmp_path)
  with pytest.raises(ONNXError, match="needs the model's path"): konnx.load(onnx.load(p, load_external_data=False))
  with pytest.raises(ONNXError, match="needs the model's path"): konnx.load(open(p, "rb").read())
