"""DISK buffers feeding kernels: a .npy file's data mapped with no copy, copied into a CPU buffer bit for bit, and a kernel over
the CPU copy giving the reference's result."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.registry import get_runtime
from kiln.ir import DeviceError, KilnBufferError, dtypes, kernels, reference
from kiln.ir.dtype import DType, f32_to_bf16_bits
from kiln.runtime.cpu.allocator import CPUAllocator
from kiln.runtime.cpu.buffer import RawBuffer
from kiln.runtime.cpu.disk import load_npy, open_npy

RT = get_runtime("CPU")
SHAPE = (37, 101)  # odd sizes: no accidental alignment with vector widths


def sample(dt: DType) -> np.ndarray:
  """Values in dt's storage form, edge values included (NaN, inf, -0.0, min/max)."""
  rng = np.random.default_rng(dt.itemsize)
  n = SHAPE[0] * SHAPE[1]
  if dt.is_float:
    x = rng.standard_normal(n) * 10
    x[:6] = [np.nan, np.inf, -np.inf, -0.0, 1e-40, 65504.0]
    return (f32_to_bf16_bits(x.astype(np.float32)) if dt == dtypes.bfloat16 else x.astype(dt.np)).reshape(SHAPE)
  x = rng.integers(int(dt.min), int(dt.max), n, dtype=dt.np, endpoint=True)
  x[:2] = [dt.min, dt.max]
  return x.reshape(SHAPE)


@pytest.fixture(params=[dtypes.float32, dtypes.bfloat16, dtypes.int8, dtypes.float64, dtypes.uint16], ids=str)
def npy(request, tmp_path):
  dt = request.param
  a = sample(dt)
  p = tmp_path / f"w_{dt}.npy"
  np.save(p, a)
  return p, a, dt


def test_disk_buffer_reads_npy_with_no_copy(npy) -> None:
  p, a, dt = npy
  buf, npdt, shape = open_npy(p)
  assert isinstance(buf, RawBuffer.Mmap) and buf.readonly and (npdt, shape) == (a.dtype, a.shape) and buf.size == a.nbytes
  v = buf.as_numpy(npdt).reshape(shape)
  assert v.tobytes() == a.tobytes() and v.ctypes.data == buf.ptr and not v.flags.writeable
  # no copy: a change to the file shows through the existing map
  with open(p, "r+b") as f:
    f.seek(buf.offset)
    f.write(b"\x5a" * a.itemsize)
  assert v.reshape(-1)[:1].tobytes() == b"\x5a" * a.itemsize
  arr = load_npy(p)
  assert arr.reshape(-1)[:1].tobytes() == b"\x5a" * a.itemsize and not arr.flags.writeable and arr.shape == a.shape


def test_disk_runtime_maps_and_refuses_writes_and_kernels(npy) -> None:
  p, a, dt = npy
  disk = get_runtime(f"DISK:{p}")
  off = open_npy(p)[0].offset
  buf = disk.allocator.alloc(a.nbytes, {"offset": off})
  assert disk.allocator.as_numpy(buf, a.dtype, a.size).tobytes() == a.tobytes()
  with pytest.raises(KilnBufferError, match="read-only"): disk.allocator.copyin(buf, memoryview(a.tobytes()))
  with pytest.raises(KilnBufferError, match="read-only"): buf.copyin(a)
  with pytest.raises(KilnBufferError, match="larger than the file"): disk.allocator.alloc(a.nbytes + 1, {"offset": off})
  with pytest.raises(DeviceError, match="data only"): disk.renderer  # noqa: B018


def test_copy_to_cpu_then_kernel_matches_reference(npy) -> None:
  p, a, dt = npy
  disk_buf, npdt, shape = open_npy(p)
  alloc = CPUAllocator()
  cpu_buf = alloc.alloc(disk_buf.size)
  alloc.copyin(cpu_buf, disk_buf.memoryview())
  host = alloc.as_numpy(cpu_buf, npdt, a.size)
  assert host.tobytes() == a.tobytes() and alloc.ptr(cpu_buf) % 64 == 0 and alloc.ptr(cpu_buf) != disk_buf.ptr
  # a row reduction and an elementwise op over the CPU copy
  if dt.is_float: ast = kernels.reduce_max(shape, dt, axes=1)
  else: ast = kernels.reduce_sum(shape, dt, axes=1, acc_dtype=dtypes.int64 if not dt.is_unsigned else dtypes.uint64)
  out_dt = ast.src[0].src[0].src[0].dtype.base
  out = alloc.alloc(shape[0] * out_dt.itemsize)
  prog = RT.load(RT.compiler.compile(RT.renderer.render(ast)))
  prog([alloc.ptr(out), alloc.ptr(cpu_buf)])
  want = reference.run(ast, np.zeros(shape[0], out_dt.np), a)[0]
  got = alloc.as_numpy(out, out_dt, shape[0])
  assert got.tobytes() == want.tobytes() or (dt.is_float and np.array_equal(got, want, equal_nan=True))
  ew = kernels.elementwise(lambda x: x * 2 if not dt.is_float else x * 2.0, dt, (shape, dt))
  out2 = alloc.alloc(a.nbytes)
  RT.load(RT.compiler.compile(RT.renderer.render(ew)))([alloc.ptr(out2), alloc.ptr(cpu_buf)])
  want2 = reference.run(ew, np.zeros(a.size, a.dtype), a)[0]
  got2 = alloc.as_numpy(out2, npdt, a.size)
  same = got2.view(f"u{a.itemsize}") == want2.view(f"u{a.itemsize}")
  if dt.is_float and dt != dtypes.bfloat16: same |= np.isnan(got2) & np.isnan(want2)
  assert same.all(), np.nonzero(~same)[0][:5]


def test_kernel_can_read_the_disk_map_directly(npy) -> None:
  # a read-only input needs no copy at all: the kernel reads the mapped pages
  p, a, dt = npy
  disk_buf, npdt, shape = open_npy(p)
  ew = kernels.elementwise(lambda x: x, dt, (shape, dt), name="copy_out")
  out = np.zeros(a.size, a.dtype)
  RT.load(RT.compiler.compile(RT.renderer.render(ew)))([out.ctypes.data, disk_buf.ptr])
  assert out.tobytes() == a.tobytes()
