"""DeviceSpec parsing and canonical strings, and the runtime registry."""
import pytest
from pydantic import BaseModel, ValidationError

from kiln.codegen import registry as devmod
from kiln.codegen.registry import available_devices, get_runtime, register_runtime, unregister_runtime
from kiln.codegen.spec import DeviceSpec
from kiln.ir.errors import DeviceError, KilnError


@pytest.mark.parametrize("s,kind,index,path,canon", [
  ("CPU", "CPU", 0, None, "CPU"), ("cpu", "CPU", 0, None, "CPU"), ("CPU:0", "CPU", 0, None, "CPU"), (" CPU ", "CPU", 0, None, "CPU"),
  ("CUDA", "CUDA", 0, None, "CUDA:0"), ("cuda:0", "CUDA", 0, None, "CUDA:0"), ("CUDA:1", "CUDA", 1, None, "CUDA:1"),
  ("GPU", "CUDA", 0, None, "CUDA:0"), ("gpu:3", "CUDA", 3, None, "CUDA:3"),
  ("DISK:/Some/Path", "DISK", 0, "/Some/Path", "DISK:/Some/Path"), ("disk:/tmp/A:b.bin", "DISK", 0, "/tmp/A:b.bin", "DISK:/tmp/A:b.bin"),
])
def test_parse(s, kind, index, path, canon):
  d = DeviceSpec.parse(s)
  assert (d.kind, d.index, d.path, str(d)) == (kind, index, path, canon)
  assert DeviceSpec.parse(str(d)) == d  # canonical strings parse back to the same device
  assert DeviceSpec.parse(d) is d


@pytest.mark.parametrize("s", ["", "TPU", "CUDA:x", "CUDA:-1", "CPU:1", "DISK", "DISK:", "CUDA:1:2", "GPU:", "12", ":0"])
def test_bad_strings_name_the_input(s):
  with pytest.raises(DeviceError) as ei: DeviceSpec.parse(s)
  assert repr(s) in str(ei.value)
  assert isinstance(ei.value, KilnError)


def test_frozen_hashable_and_json():
  d = DeviceSpec.parse("GPU:2")
  with pytest.raises(ValidationError): d.index = 3  # type: ignore[misc]
  assert {d, DeviceSpec.parse("CUDA:2")} == {d}
  assert d.model_dump() == "CUDA:2" and d.model_dump_json() == '"CUDA:2"'
  assert DeviceSpec.model_validate_json(d.model_dump_json()) == d

  class M(BaseModel):
    dev: DeviceSpec
  m = M(dev="DISK:/Data/X")  # type: ignore[arg-type]
  assert M.model_validate_json(m.model_dump_json()) == m and m.dev.path == "/Data/X"


class _FakeRuntime:
  def __init__(self, spec: DeviceSpec): self.spec, self.device = spec, str(spec)


def test_register_get_unregister(monkeypatch):
  monkeypatch.setattr(devmod, "_entry_point_factories", lambda: {})
  made = []
  register_runtime("cuda", lambda spec: made.append(spec) or _FakeRuntime(spec))
  try:
    assert "CUDA" in available_devices()
    r0, r1 = get_runtime("GPU"), get_runtime("CUDA:1")
    assert r0.device == "CUDA:0" and r1.device == "CUDA:1"
    assert get_runtime("CUDA:0") is r0 and len(made) == 2  # one instance per device, cached
  finally: unregister_runtime("CUDA")
  assert "CUDA" not in available_devices()
  with pytest.raises(DeviceError) as ei: get_runtime("CUDA:1")
  assert "kiln-runtime-cuda" in str(ei.value) and "install" in str(ei.value) and "CUDA:1" in str(ei.value)


def test_reregister_drops_cached_instances(monkeypatch):
  monkeypatch.setattr(devmod, "_entry_point_factories", lambda: {})
  register_runtime("CPU", _FakeRuntime)
  try:
    a = get_runtime("CPU")
    register_runtime("CPU", _FakeRuntime)
    assert get_runtime("CPU") is not a
  finally: unregister_runtime("CPU")


def test_unknown_device_says_what_to_install(monkeypatch):
  monkeypatch.setattr(devmod, "_entry_point_factories", lambda: {})
  monkeypatch.setattr(devmod, "_instances", {})  # a CPU runtime another test of this process made is cached there
  with pytest.raises(DeviceError, match="install kiln-runtime-cpu"): get_runtime("CPU")
  with pytest.raises(DeviceError, match="invalid device 'NPU'"): get_runtime("NPU")


def test_broken_entry_point_is_a_device_error(monkeypatch):
  class EP:
    def load(self): raise ImportError("no module named kiln.runtime.cuda.device")
  monkeypatch.setattr(devmod, "_entry_point_factories", lambda: {"CUDA": EP()})
  with pytest.raises(DeviceError, match="failed to load"): get_runtime("CUDA:0")
