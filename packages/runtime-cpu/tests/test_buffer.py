import gc
import sys
import weakref

import numpy as np
import pytest

from kiln.ir import KilnBufferError, dtypes
from kiln.runtime.cpu.buffer import ALIGN, CpuBuffer, MmapBuffer, RawBuffer


def test_variants_are_rawbuffers():
  assert RawBuffer.Cpu is CpuBuffer and RawBuffer.Mmap is MmapBuffer
  b = RawBuffer.Cpu(10)
  assert isinstance(b, RawBuffer) and b.size == 10 and b.cpu_accessible and b.device == "CPU" and not b.readonly


def test_alignment_and_zeroing_of_many_allocations():
  rng = np.random.default_rng(0)
  bufs = [RawBuffer.Cpu(int(s)) for s in [1, 2, 3, 63, 64, 65, 4095, 4096, 4097, 1 << 20, *rng.integers(1, 100_000, 300)]]
  for b in bufs:
    assert b.ptr % ALIGN == 0, b
    v = b.as_numpy()
    assert v.size == b.size and not v.any()
  assert len({b.ptr for b in bufs}) == len(bufs)  # live buffers never overlap at their start


def test_address_is_stable_and_views_share_memory():
  b = RawBuffer.Cpu(1024)
  p = b.ptr
  f = b.as_numpy(np.float32, 16, 64)
  assert f.ctypes.data == p + 64 and f.flags.writeable
  f[:] = np.arange(16)
  u = b.as_numpy(np.uint8)
  assert np.shares_memory(f, u) and u.ctypes.data == p
  assert b.as_numpy("float32", 16, 64).tolist() == list(range(16))
  assert b.ptr == p


def test_views_of_kiln_and_numpy_dtypes():
  b = RawBuffer.Cpu(64)
  assert b.as_numpy(dtypes.float16).dtype == np.float16 and b.as_numpy(dtypes.float16).size == 32
  assert b.as_numpy(dtypes.bfloat16).dtype == np.uint16  # bfloat16 lives as its bit pattern
  assert b.as_numpy("int64").size == 8 and b.as_numpy(np.dtype("u4"), 3, 4).size == 3
  with pytest.raises(KilnBufferError, match="cannot view a buffer as dtype"): b.as_numpy(object())


@pytest.mark.parametrize("count,offset", [(17, 0), (16, 4), (1, 64), (-1, 0)])
def test_view_out_of_range(count, offset):
  b = RawBuffer.Cpu(64)
  with pytest.raises(KilnBufferError, match=r"overruns|outside|non-negative"): b.as_numpy(np.float32, count, offset)


@pytest.mark.parametrize("size", [0, -5, 1.5, "64", True, None])
def test_bad_sizes(size):
  with pytest.raises(KilnBufferError, match="buffer size must be"): RawBuffer.Cpu(size)


def test_copyin_copyout_exact_size():
  b = RawBuffer.Cpu(16)
  b.copyin(memoryview(np.arange(4, dtype=np.int32)))
  out = np.zeros(4, np.int32)
  b.copyout(memoryview(out))
  assert out.tolist() == [0, 1, 2, 3]
  with pytest.raises(KilnBufferError, match="copyin size mismatch: source has 12 bytes.*has 16"): b.copyin(memoryview(np.zeros(3, np.int32)))
  with pytest.raises(KilnBufferError, match="copyout size mismatch: destination has 20 bytes"): b.copyout(memoryview(np.zeros(5, np.int32)))
  with pytest.raises(KilnBufferError, match="C-contiguous"): b.copyin(memoryview(np.zeros(8, np.int32)[::2]))
  with pytest.raises(KilnBufferError, match="read-only"): b.copyout(memoryview(bytes(16)))


def test_buffer_released_when_garbage_collected():
  b = RawBuffer.Cpu(4096)
  base = b.mem.base
  assert base is not None
  r = weakref.ref(base)
  del b, base
  gc.collect()
  assert r() is None


def test_free_releases_but_live_views_keep_memory_safe():
  b = RawBuffer.Cpu(4096)
  r = weakref.ref(b.mem.base)
  v = b.as_numpy(np.int32)
  v[:] = 7
  b.free()
  assert b.freed and r() is not None and v.sum() == 7 * 1024  # the view still owns valid memory
  with pytest.raises(KilnBufferError, match="freed"): _ = b.ptr
  with pytest.raises(KilnBufferError, match="freed"): b.as_numpy()
  del v
  gc.collect()
  assert r() is None


def _rss() -> int:
  with open("/proc/self/statm") as f: return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_rss_returns_after_free():
  n = 256 << 20
  before = _rss()
  b = RawBuffer.Cpu(n)
  b.as_numpy()[:] = 1  # touch every page
  assert _rss() - before > n * 3 // 4
  b.free()
  gc.collect()
  assert _rss() - before < n // 4
