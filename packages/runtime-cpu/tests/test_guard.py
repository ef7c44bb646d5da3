"""KILN_GUARD: buffers between inaccessible pages. A deliberately unverified out-of-bounds kernel faults (in a child process);
kiln's own kernels, scratch included, run clean and right under it."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.codegen.registry import get_runtime
from kiln.ir import UOp, dtypes, kernels
from kiln.runtime.cpu.allocator import CPUAllocator
from kiln.runtime.cpu.guard import PAGE, GuardedBuffer, guarded_array, guarded_copy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages: mmap/mprotect as on Linux")
RT = get_runtime("CPU")
F32 = dtypes.float32

# one float stored at p[i], compiled by llvmlite straight from IR: no kiln verifier stands between it and memory
_CHILD = textwrap.dedent("""
  import ctypes, sys
  import llvmlite.binding as llvm
  import numpy as np
  from kiln.runtime.cpu.guard import guarded_array
  llvm.initialize_native_target(); llvm.initialize_native_asmprinter()
  ir = '''define void @poke(ptr %p, i64 %i) {
    %q = getelementptr float, ptr %p, i64 %i
    store volatile float 1.0, ptr %q
    ret void
  }'''
  tm = llvm.Target.from_default_triple().create_target_machine()
  engine = llvm.create_mcjit_compiler(llvm.parse_assembly(ir), tm)
  engine.finalize_object()
  poke = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(engine.get_function_address("poke"))
  n, where = int(sys.argv[1]), int(sys.argv[2])
  a = guarded_array(n, np.float32)
  poke(a.ctypes.data, where)
  print("survived", float(a[where]) if 0 <= where < n else "outside")
""")


def _poke(n: int, where: int) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", _CHILD, str(n), str(where)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("n", [1, 7, 1024, PAGE // 4])
def test_one_element_past_the_end_faults(n: int) -> None:
  inside = _poke(n, n - 1)
  assert inside.returncode == 0 and "survived 1.0" in inside.stdout, inside.stderr
  past = _poke(n, n)
  assert past.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (past.returncode, past.stdout, past.stderr)


def test_underflow_past_the_page_faults() -> None:
  r = _poke(PAGE // 4, -1)  # a page of data starts exactly after the guard page: one element before it faults
  assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (r.returncode, r.stdout, r.stderr)


def test_guarded_buffer_layout() -> None:
  for size in (1, 4, 100, PAGE, PAGE + 4, 3 * PAGE - 64):
    b = GuardedBuffer(size)
    assert (b.ptr + size) % PAGE == 0 and b.as_numpy(np.uint8).sum() == 0
  assert guarded_array(16, np.float32).ctypes.data % 64 == 0  # a multiple of 64 bytes starts on a 64-byte boundary
  assert guarded_array(0, np.float64).ctypes.data % PAGE == 0  # empty: it points at the guard page itself
  x = np.arange(12, dtype=np.int16).reshape(3, 4)
  assert np.array_equal(guarded_copy(x), x)


def test_allocator_guards_under_kiln_guard(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("KILN_GUARD", "1")
  a = CPUAllocator()
  b = a.alloc(40)
  assert isinstance(b, GuardedBuffer) and (b.ptr + 40) % PAGE == 0
  a.free(b)
  assert a.alloc(40) is b  # the LRU still serves it, guards and all
  monkeypatch.setenv("KILN_GUARD", "0")
  assert not isinstance(CPUAllocator().alloc(40), GuardedBuffer)


def _run(ast: UOp, arrays: list[np.ndarray], opts: list[Opt] | None = None) -> list[str]:
  prog = RT.load(RT.compiler.compile(RT.renderer.render(ast, opts=opts)))
  prog([a.ctypes.data for a in arrays], global_size=prog.spec.global_size or (1, 1, 1))
  return list(prog.spec.applied_opts)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_stay_inside_guarded_buffers(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
  """Odd sizes (peeled and overlapped tiles), a packed matmul, a kept softmax row and a threaded full reduction (their
  scratch is guarded too): each runs clean and equals numpy. A stray access would kill the test process."""
  monkeypatch.setenv("KILN_GUARD", "1")
  rng = np.random.default_rng(threads)
  n = 1001
  x, y = (guarded_copy(rng.standard_normal(n).astype(np.float32)) for _ in range(2))
  out = guarded_array(n, np.float32)
  _run(kernels.elementwise(lambda a, b: a * b + 1.0, F32, ((n,), F32), ((n,), F32)), [out, x, y])
  np.testing.assert_allclose(out, x * y + 1, rtol=1e-6)
  for m, k, c in ((37, 29, 75), (37, 29, 43)):  # odd column counts: tiled and packed, the last vector overlapped
    a, b = guarded_copy(rng.standard_normal(m * k).astype(np.float32)), guarded_copy(rng.standard_normal(k * c).astype(np.float32))
    mm = guarded_array(m * c, np.float32)
    applied = _run(kernels.matmul(m, c, k), [mm, a, b])
    assert any(o.startswith("PACK") for o in applied), applied
    np.testing.assert_allclose(mm.reshape(m, c), a.reshape(m, k).astype(np.float64) @ b.reshape(k, c), rtol=1e-4, atol=1e-4)
  rows, width = 33, 127
  s = guarded_copy(rng.standard_normal(rows * width).astype(np.float32))
  p = guarded_array(rows * width, np.float32)
  sm = kernels.softmax((rows, width), F32)
  red = [u for u in sm.toposort() if u.op.name == "REDUCE" and u.arg.name == "ADD"][0].src[1].arg[0]
  applied = _run(sm, [p, s], [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.UPCAST, red, 16), Opt(OptOps.KEEP, red, 1)]
                 + ([Opt(OptOps.THREAD, 0, threads)] if threads > 1 else []))
  assert any(o.startswith("KEEP") for o in applied), applied
  e = np.exp(s.reshape(rows, width).astype(np.float64) - s.reshape(rows, width).max(1, keepdims=True))
  np.testing.assert_allclose(p.reshape(rows, width), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-9)
  big = 1 << 17
  v = guarded_copy(rng.standard_normal(big).astype(np.float32))
  tot = guarded_array(1, np.float32)
  _run(kernels.reduce_sum((big,), F32), [tot, v], [Opt(OptOps.UPCAST, 0, 32)] + ([Opt(OptOps.THREAD, 0, threads)] if threads > 1 else []))
  np.testing.assert_allclose(tot[0], v.astype(np.float64).sum(), rtol=1e-4)
