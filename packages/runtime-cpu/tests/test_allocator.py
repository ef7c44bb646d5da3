import random
import sys
import threading

import numpy as np
import pytest

from kiln.codegen.protocols import Allocator
from kiln.ir import KilnBufferError
from kiln.runtime.cpu.allocator import BufferOptions, CPUAllocator
from kiln.runtime.cpu.buffer import OutOfMemoryError, RawBuffer


def test_is_an_allocator_and_hands_out_aligned_zeroed_cpu_buffers():
  a = CPUAllocator()
  assert isinstance(a, Allocator)
  bufs = [a.alloc(s) for s in (1, 7, 64, 1000, 12345)]
  for b in bufs:
    assert isinstance(b, RawBuffer.Cpu) and a.ptr(b) % 64 == 0 and not a.as_numpy(b, np.uint8, b.size).any()


def test_as_numpy_shares_memory_with_ptr():
  a = CPUAllocator()
  b = a.alloc(400)
  v = a.as_numpy(b, np.float32, 100)
  assert v.ctypes.data == a.ptr(b)
  v2 = a.as_numpy(b, np.float32, 10, offset=40)
  assert v2.ctypes.data == a.ptr(b) + 40 and np.shares_memory(v, v2)
  v[10] = 3.5
  assert v2[0] == 3.5


def test_copyin_copyout_exact_size():
  a = CPUAllocator()
  b = a.alloc(32)
  a.copyin(b, memoryview(np.arange(8, dtype=np.float32)))
  out = np.empty(8, np.float32)
  a.copyout(memoryview(out), b)
  assert out.tolist() == list(range(8))
  with pytest.raises(KilnBufferError, match="source has 28 bytes"): a.copyin(b, memoryview(np.zeros(7, np.float32)))
  with pytest.raises(KilnBufferError, match="destination has 36 bytes"): a.copyout(memoryview(np.zeros(9, np.float32)), b)
  with pytest.raises(KilnBufferError, match="expected a RawBuffer"): a.copyin(bytearray(32), memoryview(bytes(32)))


def test_lru_reuses_the_freed_buffer_and_rezeroes_it():
  a = CPUAllocator()
  b = a.alloc(1000)
  p = a.ptr(b)
  a.as_numpy(b, np.uint8, 1000)[:] = 9
  a.free(b, 1000)
  assert a.cached(1000) == 1 and a.cached_bytes == 1000
  c = a.alloc(1000)
  assert c is b and a.ptr(c) == p and a.hits == 1 and a.cached() == 0
  assert not a.as_numpy(c, np.uint8, 1000).any()


def test_zero_false_keeps_old_contents():
  a = CPUAllocator()
  b = a.alloc(64)
  a.as_numpy(b, np.uint8, 64)[:] = 5
  a.free(b, 64)
  c = a.alloc(64, BufferOptions(zero=False))
  assert c is b and (a.as_numpy(c, np.uint8, 64) == 5).all()


def test_lru_keyed_by_size():
  a = CPUAllocator()
  b = a.alloc(100)
  a.free(b, 100)
  c = a.alloc(101)
  assert c is not b and a.cached(100) == 1 and a.misses == 2


def test_nolru_bypasses_the_cache():
  a = CPUAllocator()
  b = a.alloc(256)
  a.free(b, 256)
  c = a.alloc(256, BufferOptions(nolru=True))
  assert c is not b and a.cached(256) == 1 and a.hits == 0  # the cached one was not taken
  a.free(c, 256, BufferOptions(nolru=True))
  assert c.freed and a.cached(256) == 1  # and a nolru free releases instead of caching
  d = a.alloc(256, {"nolru": True})
  assert d is not b


def test_lru_bound_per_key():
  a = CPUAllocator(lru_per_key=3)
  bufs = [a.alloc(128) for _ in range(10)]
  for b in bufs: a.free(b, 128)
  assert a.cached(128) == 3 and a.cached_bytes == 3 * 128
  assert all(b.freed for b in bufs[:7]) and not any(b.freed for b in bufs[7:])  # oldest evicted and released
  assert {id(a.alloc(128)) for _ in range(3)} == {id(b) for b in bufs[7:]}


def test_lru_bound_total_bytes():
  a = CPUAllocator(lru_per_key=100, lru_max_bytes=10_000)
  bufs = [a.alloc(3000) for _ in range(5)] + [a.alloc(2000)]
  for b in bufs: a.free(b)
  # 3 x 3000 fit; each later free evicts the least recently freed until the total is back under 10_000
  assert a.cached_bytes == 3000 + 3000 + 2000 and a.cached(3000) == 2 and a.cached(2000) == 1
  assert [b.freed for b in bufs] == [True, True, True, False, False, False]
  big = a.alloc(20_000)
  a.free(big)
  assert big.freed and a.cached_bytes <= 10_000  # larger than the whole cache: released at once


def test_lru_total_evicts_least_recently_freed_across_keys():
  a = CPUAllocator(lru_max_bytes=1000)
  x, y, z = a.alloc(400), a.alloc(500), a.alloc(300)
  a.free(x); a.free(y); a.free(z)
  assert x.freed and not y.freed and not z.freed and a.cached_bytes == 800


def test_allocation_failure_flushes_and_retries_once(monkeypatch):
  a = CPUAllocator()
  for b in [a.alloc(512) for _ in range(4)]: a.free(b)
  cached = [b for _, b in a._order.values()]
  assert a.cached_bytes == 2048
  real, calls = a._alloc_raw, []
  def flaky(size, opts):
    calls.append(size)
    if len(calls) == 1: raise MemoryError("simulated")
    return real(size, opts)
  monkeypatch.setattr(a, "_alloc_raw", flaky)
  b = a.alloc(1 << 20)
  assert calls == [1 << 20, 1 << 20] and b.size == 1 << 20
  assert a.cached_bytes == 0 and a.cached() == 0 and a.flushes == 1 and all(c.freed for c in cached)


def test_allocation_failure_twice_is_a_clear_error(monkeypatch):
  a = CPUAllocator()
  calls = []
  def broke(size, opts): calls.append(size); raise MemoryError("simulated")
  monkeypatch.setattr(a, "_alloc_raw", broke)
  with pytest.raises(OutOfMemoryError, match="4096 bytes.*retrying once") as e: a.alloc(4096)
  assert len(calls) == 2 and isinstance(e.value, MemoryError) and isinstance(e.value, KilnBufferError)


def test_real_out_of_memory_is_caught():
  with pytest.raises(OutOfMemoryError, match=str(1 << 62)): CPUAllocator().alloc(1 << 62)


@pytest.mark.parametrize("size", [0, -1, 2.0, "8", False])
def test_bad_sizes(size):
  with pytest.raises(KilnBufferError, match="buffer size must be"): CPUAllocator().alloc(size)


def test_bad_options_and_frees():
  a = CPUAllocator()
  with pytest.raises(KilnBufferError, match="unknown buffer options"): a.alloc(8, {"nolr": True})
  with pytest.raises(KilnBufferError, match="must be a bool"): BufferOptions(zero=1)  # type: ignore[arg-type]
  with pytest.raises(KilnBufferError, match="buffer options must be"): a.alloc(8, 3)
  b = a.alloc(8)
  with pytest.raises(KilnBufferError, match="with size 9: the buffer has 8 bytes"): a.free(b, 9)
  a.free(b, 8)
  with pytest.raises(KilnBufferError, match="double free"): a.free(b, 8)
  c = a.alloc(8, BufferOptions(nolru=True))
  a.free(c, options=BufferOptions(nolru=True))
  with pytest.raises(KilnBufferError, match="double free"): a.free(c)


def test_thread_safety_16_threads():
  old = sys.getswitchinterval()  # switch threads as often as possible so races in the cache bookkeeping show
  sys.setswitchinterval(1e-6)
  try:
    for _ in range(3): _hammer()  # each round catches an unlocked cache about half the time
  finally: sys.setswitchinterval(old)


def _hammer():
  a = CPUAllocator(lru_per_key=4, lru_max_bytes=64 << 10)
  live: set[int] = set()
  live_lock, errors = threading.Lock(), []
  def work(tid: int):
    rng = random.Random(tid)
    try:
      for _ in range(600):
        size = rng.choice([64, 256, 4096])
        b = a.alloc(size, BufferOptions(zero=rng.random() < 0.5, nolru=rng.random() < 0.1))
        with live_lock:
          assert b.ptr not in live, "the same buffer was handed to two owners"
          live.add(b.ptr)
        v = a.as_numpy(b, np.uint8, size)
        v[:] = tid
        assert (v == tid).all()
        with live_lock: live.discard(b.ptr)
        del v
        a.free(b, size)
    except Exception as e: errors.append(e)
  ts = [threading.Thread(target=work, args=(i,)) for i in range(16)]
  for t in ts: t.start()
  for t in ts: t.join()
  assert not errors, errors
  assert a.cached_bytes == sum(b.size for _, b in a._order.values()) <= 64 << 10
  assert all(len(v) <= 4 for v in a._cache.values()) and a.hits > 0
