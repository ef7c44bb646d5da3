import numpy as np
import pytest

from kiln.executor import Buffer, copy_buffer
from kiln.ir.dtype import dtypes
from kiln.ir.errors import KilnBufferError


def test_lazy_allocation(rt):
  b = Buffer("CPU", 16, dtypes.float32)
  assert not b.is_allocated and rt.STATS["allocs"] == 0
  assert b.nbytes == 64 and len(b) == 16 and b.dtype == dtypes.float32
  b.ensure_allocated()
  assert b.is_allocated and rt.STATS["allocs"] == 1 and b.ptr % 64 == 0


def test_view_shares_storage(rt):
  b = Buffer("CPU", 16, "float32").copyin(np.arange(16, dtype=np.float32))
  v = b.view(8, 4)
  assert v.id != b.id and v.storage_id == b.storage_id and v.base is b
  np.testing.assert_array_equal(v.numpy(), [2, 3, 4, 5])
  v.copyin(np.zeros(4, np.float32))
  assert b.numpy()[2:6].sum() == 0
  vv = v.view(4, 2)  # a view of a view points at the root storage
  assert vv.offset == 12 and vv.base is b
  assert v.ptr == b.ptr + 8
  with pytest.raises(KilnBufferError, match="past the end"): b.view(60, 2)
  with pytest.raises(KilnBufferError, match="past the end"): b.view(0, 17)
  u = b.view(0, 16, dtypes.int32)  # reinterpreting bytes
  assert u.dtype == dtypes.int32 and u.storage_id == b.storage_id


def test_copy_exact_size(rt):
  b = Buffer("CPU", 4, dtypes.float32)
  with pytest.raises(KilnBufferError, match="12 bytes into buffer .* of 16 bytes"): b.copyin(np.zeros(3, np.float32))
  with pytest.raises(KilnBufferError, match="into 20 bytes"): b.copyout(np.zeros(5, np.float32))
  b.copyin(np.arange(4, dtype=np.float32))
  out = b.copyout(np.empty(4, np.float32))
  np.testing.assert_array_equal(out, [0, 1, 2, 3])
  with pytest.raises(KilnBufferError, match="different sizes"): copy_buffer(Buffer("CPU", 5, dtypes.float32), b)
  c = Buffer("CPU", 4, dtypes.int32)  # same byte size, different dtype: a byte copy
  copy_buffer(c, b)
  assert c.numpy().view(np.float32)[3] == 3


def test_numpy_zero_copy(rt):
  a = np.arange(10, dtype=np.float32)
  b = Buffer.from_numpy(a)
  assert np.shares_memory(b.numpy(), a) and b.ptr == a.ctypes.data
  a[0] = 42
  assert b.numpy()[0] == 42
  c = Buffer("CPU", 10, dtypes.int64).ensure_allocated()
  n1, n2 = c.numpy(), c.numpy()
  assert np.shares_memory(n1, n2) and n1.dtype == np.int64
  n1[3] = 7
  assert c.copyout(np.empty(10, np.int64))[3] == 7
  del c  # the numpy view keeps the storage alive
  assert n1[3] == 7
  nc = Buffer.from_numpy(np.arange(12, dtype=np.int32).reshape(3, 4).T)  # not contiguous: copied
  np.testing.assert_array_equal(nc.numpy(), np.arange(12).reshape(3, 4).T.ravel())


def test_readonly_numpy(rt):
  a = np.arange(4, dtype=np.float32)
  a.setflags(write=False)
  b = Buffer.from_numpy(a)
  assert b.readonly
  with pytest.raises(KilnBufferError, match="read-only"): b.copyin(np.zeros(4, np.float32))


def test_dlpack_numpy(rt):
  b = Buffer.from_numpy(np.arange(6, dtype=np.float32))
  x = np.from_dlpack(b)
  assert np.shares_memory(x, b.numpy())
  assert b.__dlpack_device__() == (1, 0)
  c = Buffer.from_dlpack(x)
  assert c.ptr == b.ptr


def test_dlpack_torch(rt):
  torch = pytest.importorskip("torch")
  t = torch.arange(8, dtype=torch.float32)
  b = Buffer.from_dlpack(t)
  assert b.ptr == t.data_ptr()
  t2 = torch.from_dlpack(b)
  assert t2.data_ptr() == b.ptr


def test_errors(rt):
  with pytest.raises(KilnBufferError): Buffer("CPU", 0, dtypes.float32)
  with pytest.raises(KilnBufferError): Buffer("CPU", 4, dtypes.float32.vec(4))


def test_from_npy_is_a_lazy_readonly_disk_buffer(rt, tmp_path):
  a = np.arange(10, dtype=np.float32)
  np.save(tmp_path / "w.npy", a)
  b = Buffer.from_npy(tmp_path / "w.npy")
  assert b.device.startswith("DISK:") and b.size == 10 and b.dtype == dtypes.float32 and b.readonly and not b.is_allocated
  assert b.storage.options["offset"] == (tmp_path / "w.npy").stat().st_size - a.nbytes
