"""Streaming (non-temporal) stores to outputs past the caches, wherever the output starts: a vector-aligned base takes
whole-vector stores, a 16-byte-aligned one (numpy's and malloc's usual) the vector's 16-byte pieces, an element-aligned
one ordinary stores. Every case is bit-identical to numpy and writes nothing outside the output; the machine code for
AVX2 and AVX-512 shows which stores each case gets."""
from __future__ import annotations

import platform
import re

import llvmlite.binding as llvm
import numpy as np
import pytest

from kiln.codegen.choose import Target
from kiln.codegen.registry import get_runtime
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.ir import dtypes, kernels
from kiln.runtime.cpu.compiler import LLVMCompiler
from kiln.runtime.cpu.machine import is_x86

RT = get_runtime("CPU")
F32 = dtypes.float32
X86 = is_x86(platform.machine())
GUARD = 0xA5  # every byte around the output starts as this, and must stay so


def add(n: int, dt=F32):
  return kernels.elementwise(lambda a, b: a + b, dt, ((n,), dt), ((n,), dt), name="stream_add")


def inputs(n: int, dt) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(n)
  if dt.is_int: return tuple(rng.integers(-128, 128, n).astype(dt.np) for _ in range(2))  # type: ignore[return-value]
  a, b = (rng.standard_normal(n).astype(dt.np) for _ in range(2))
  a[:6], b[:6] = [-0.0, 0.0, np.inf, -np.inf, 1e-40, -1e-40], [-0.0, -0.0, 1.0, -1.0, 1e-40, 2e-40]  # signed zeros, infinities, subnormals
  return a, b


def run_at(offset: int, n: int, dt=F32) -> None:
  """c = a + b into an output starting `offset` bytes past a 64-byte boundary: bit for bit numpy's, nothing around it written."""
  spec = RT.renderer.render(add(n, dt))
  if RT.target.stream_store_bytes:  # x86: both streaming tiers are there, picked at run time by the base's alignment
    assert "!nontemporal" in spec.src and "align 16, !nontemporal" in spec.src
  prog = RT.load(RT.compiler.compile(spec))
  a, b = inputs(n, dt)
  nbytes = n * dt.itemsize
  raw = np.full(nbytes + 128, GUARD, np.uint8)
  start = -raw.ctypes.data % 64 + offset
  out = raw[start:start + nbytes].view(dt.np)
  assert out.ctypes.data % 64 == offset
  prog([out.ctypes.data, a.ctypes.data, b.ctypes.data])
  with np.errstate(over="ignore"): want = a + b
  np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))  # bit for bit
  assert (raw[:start] == GUARD).all() and (raw[start + nbytes:] == GUARD).all()


STREAM_BYTES = RT.target.stream_store_bytes or 8 << 20  # off x86 (no streaming) the same sizes run the ordinary stores


@pytest.mark.parametrize("n_extra", [0, 4])  # 4: the last 8-lane tile overlaps the one before, still 16-byte aligned
@pytest.mark.parametrize("offset", [0, 4, 8, 16, 32, 48])  # bytes past a 64-byte boundary
def test_streamed_float32_output_is_exact_and_stays_in_bounds(offset: int, n_extra: int) -> None:
  run_at(offset, STREAM_BYTES // 4 + n_extra)


@pytest.mark.parametrize("dt", [dtypes.float64, dtypes.float16, dtypes.int8], ids=str)
@pytest.mark.parametrize("offset", [16, 48, 8])
def test_streamed_output_of_other_types(dt, offset: int) -> None:
  run_at(offset, STREAM_BYTES // dt.itemsize, dt)


def machine_code(src: str, cpu: str) -> str:
  """Assembly of src for `cpu` through the runtime compiler's own passes; the host need not run that CPU's code (the
  runtime refuses to target such a CPU, so its target machine is swapped in here)."""
  comp = LLVMCompiler()
  comp.tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features="", opt=3, reloc="pic", codemodel="default")
  return comp.assembly(src)


def loops(asm: str) -> list[str]:
  """The basic blocks that jump back to themselves (the unswitched copies of the kernel's loop)."""
  blocks = re.split(r"^(\.LBB\S+):.*$", asm, flags=re.M)
  # (not the entry's loop that claims chunks: an atomic add and a call)
  return [body for label, body in zip(blocks[1::2], blocks[2::2]) if re.search(rf"\bj\w+\s+{re.escape(label)}\b", body) and "lock" not in body]


@pytest.mark.skipif(not X86, reason="x86 machine code")
@pytest.mark.parametrize("cpu,vector_bytes,reg,pieces", [("x86-64-v3", 32, "ymm", 2), ("x86-64-v4", 64, "zmm", 4)])
def test_machine_code_streams_whole_vectors_or_16_byte_pieces(cpu: str, vector_bytes: int, reg: str, pieces: int) -> None:
  t = Target(device="CPU", vector_bytes=vector_bytes, threads=2, min_work_per_thread=1 << 12, stream_store_bytes=1 << 20)
  asm = machine_code(LLVMRenderer(t).render(add(1 << 20)).src, cpu)
  body = loops(asm)
  nt = lambda b, r: len(re.findall(rf"\bvmovntps\s+%{r}\d+, ", b))
  # three copies of the loop, unswitched on the flags computed on entry: vector-aligned, 16-byte-aligned, neither
  assert len(body) == 3, body
  assert sorted((nt(b, reg), nt(b, "xmm")) for b in body) == [(0, 0), (0, pieces), (1, 0)], body
  assert all(len(re.findall(rf"\bvmovups\s+%{reg}\d+, \(", b)) == 1 for b in body if not nt(b, reg) and not nt(b, "xmm"))
  assert "sfence" in asm  # streaming stores are weakly ordered: fenced before the kernel returns
