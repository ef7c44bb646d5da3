import gc
import os

import numpy as np
import pytest

from kiln.codegen.protocols import Allocator
from kiln.codegen.spec import DeviceSpec
from kiln.ir import KilnBufferError
from kiln.runtime.cpu.allocator import CPUAllocator
from kiln.runtime.cpu.buffer import RawBuffer
from kiln.runtime.cpu.disk import DiskAllocator, DiskOptions, load_npy, npy_region, open_disk, open_npy


@pytest.fixture
def npy(tmp_path):
  a = np.arange(3000, dtype=np.float32).reshape(30, 100)
  p = tmp_path / "a.npy"
  np.save(p, a)
  return p, a


def test_npy_region_from_header(npy):
  p, a = npy
  off, nbytes, dtype, shape = npy_region(p)
  assert (nbytes, dtype, shape) == (a.nbytes, np.dtype(np.float32), (30, 100))
  assert off == os.path.getsize(p) - a.nbytes and off % 64 == 0  # numpy pads the header to 64 bytes
  with open(p, "rb") as f:
    f.seek(off)
    assert np.frombuffer(f.read(), np.float32).tolist() == a.ravel().tolist()


def test_npy_data_is_mapped_zero_copy(npy):
  p, a = npy
  buf, dtype, shape = open_npy(p)
  assert isinstance(buf, RawBuffer.Mmap) and buf.cpu_accessible and buf.readonly and buf.size == a.nbytes
  assert buf.device == f"DISK:{p}"
  v = buf.as_numpy(dtype, a.size).reshape(shape)
  assert (v == a).all() and not v.flags.writeable
  assert v.ctypes.data == buf.ptr and np.shares_memory(v, buf.as_numpy())
  # the view is the file's page cache itself: a write to the file shows through it with no reload
  off = npy_region(p)[0]
  with open(p, "r+b") as f:
    f.seek(off + 4 * 7)
    f.write(np.float32(-1.5).tobytes())
  assert v[0, 7] == -1.5


def test_load_npy_and_copy_into_cpu(npy):
  p, a = npy
  v = load_npy(p)
  assert v.shape == a.shape and v.dtype == a.dtype and (v == a).all() and not v.flags.writeable
  gc.collect()
  assert (v == a).all()  # the array keeps its map alive
  buf, _, _ = open_npy(p)
  cpu = CPUAllocator()
  c = cpu.alloc(buf.size)
  cpu.copyin(c, buf.memoryview())
  out = cpu.as_numpy(c, np.float32, a.size)
  assert (out == a.ravel()).all() and not np.shares_memory(out, buf.as_numpy())


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_header_versions(tmp_path, version):
  a = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
  p = tmp_path / "v.npy"
  with open(p, "wb") as f: np.lib.format.write_array(f, a, version=version)
  assert (load_npy(p) == a).all() and npy_region(p)[3] == (2, 3, 4)


def test_npy_rejects_fortran_object_truncated_and_garbage(tmp_path):
  p = tmp_path / "f.npy"
  np.save(p, np.asfortranarray(np.ones((3, 4), np.float32)))
  with pytest.raises(KilnBufferError, match="Fortran-order"): npy_region(p)
  np.save(p, np.array([1, "x", None], dtype=object), allow_pickle=True)
  with pytest.raises(KilnBufferError, match="Python objects"): npy_region(p)
  np.save(p, np.arange(100, dtype=np.int64))
  with open(p, "r+b") as f: f.truncate(os.path.getsize(p) - 8)
  with pytest.raises(KilnBufferError, match="truncated: header says 800 data bytes"): npy_region(p)
  p.write_bytes(b"not an npy file at all")
  with pytest.raises(KilnBufferError, match="not a readable .npy file"): npy_region(p)
  with pytest.raises(KilnBufferError, match=".npy file does not exist .*missing.npy"): npy_region(tmp_path / "missing.npy")
  np.save(p, np.zeros((0, 3), np.float32))
  with pytest.raises(KilnBufferError, match="no data to map"): open_npy(p)


def test_too_large_request_names_file_offset_size_and_length(tmp_path):
  p = tmp_path / "d.bin"
  p.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
  with pytest.raises(KilnBufferError) as e: open_disk(p, offset=100, size=10200)
  msg = str(e.value)
  assert str(p) in msg and "offset=100" in msg and "size=10200" in msg and "length 10240" in msg and "larger than the file" in msg
  with pytest.raises(KilnBufferError, match="nothing to map at offset 10240"): open_disk(p, offset=10240)
  with pytest.raises(KilnBufferError, match="offset must be a non-negative int"): open_disk(p, offset=-1)
  with pytest.raises(KilnBufferError, match="region size must be positive"): open_disk(p, size=0)
  with pytest.raises(KilnBufferError, match="the file to map does not exist"): open_disk(tmp_path / "nope")


def test_writes_are_rejected_as_read_only(tmp_path):
  p = tmp_path / "d.bin"
  p.write_bytes(bytes(64))
  buf = open_disk(p)
  with pytest.raises(KilnBufferError, match="the DISK device is read-only"): buf.copyin(memoryview(bytes(64)))
  with pytest.raises(KilnBufferError, match="the DISK device is read-only"): DiskAllocator(p).copyin(buf, memoryview(bytes(64)))
  with pytest.raises(ValueError, match="read-only"): buf.as_numpy()[0] = 1
  assert buf.memoryview().readonly and p.read_bytes() == bytes(64)


def test_unaligned_offsets_and_device_strings(tmp_path):
  data = np.random.default_rng(1).integers(0, 256, 20000, dtype=np.uint8)
  p = tmp_path / "d.bin"
  p.write_bytes(data.tobytes())
  for off, size in [(0, 1), (1, 100), (4095, 2), (4096, 4096), (5000, 15000)]:
    b = open_disk(f"DISK:{p}", off, size)
    assert (b.as_numpy() == data[off:off + size]).all() and b.offset == off and b.file_length == 20000
  assert open_disk(DeviceSpec.parse(f"DISK:{p}"), 7, 3).as_numpy().tolist() == data[7:10].tolist()
  assert open_disk(p, 19000).size == 1000  # size None maps to the end


def test_disk_allocator(tmp_path):
  data = np.arange(1000, dtype=np.int32)
  p = tmp_path / "d.bin"
  p.write_bytes(data.tobytes())
  d = DiskAllocator(f"DISK:{p}")
  assert isinstance(d, Allocator)
  b = d.alloc(400, DiskOptions(offset=400))
  assert (d.as_numpy(b, np.int32, 100) == data[100:200]).all() and d.ptr(b) == b.ptr
  out = np.zeros(100, np.int32)
  d.copyout(memoryview(out), b)
  assert (out == data[100:200]).all()
  with pytest.raises(KilnBufferError, match="copyout size mismatch"): d.copyout(memoryview(np.zeros(99, np.int32)), b)
  assert (d.as_numpy(d.alloc(8, 8), np.int32, 2) == [2, 3]).all()
  assert (d.as_numpy(d.alloc(8, {"offset": 12}), np.int32, 2) == [3, 4]).all()
  with pytest.raises(KilnBufferError, match="larger than the file"): d.alloc(4000, DiskOptions(offset=4))
  d.free(b, 400)
  assert b.freed
  with pytest.raises(KilnBufferError, match="no file"): DiskAllocator().alloc(8)


def test_free_with_live_view_keeps_view_valid(npy):
  p, a = npy
  buf, dtype, _ = open_npy(p)
  v = buf.as_numpy(dtype)
  buf.free()
  assert buf.freed and (v == a.ravel()).all()
  with pytest.raises(KilnBufferError, match="freed"): _ = buf.ptr


def test_disk_refuses_what_is_not_a_regular_file(tmp_path) -> None:
  """A FIFO would block open() forever, a directory maps nothing: both are refused by name at once."""
  import os
  os.mkfifo(tmp_path / "fifo")
  for p, kind in ((tmp_path / "fifo", "a FIFO"), (tmp_path, "a directory")):
    with pytest.raises(KilnBufferError, match=f"is {kind}, not a regular file"): open_disk(p)
    with pytest.raises(KilnBufferError, match=f"is {kind}, not a regular file"): npy_region(p)
  with pytest.raises(KilnBufferError, match="holds a NUL byte"): open_disk("a\0b")
