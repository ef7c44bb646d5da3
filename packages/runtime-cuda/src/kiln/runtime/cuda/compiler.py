"""CUDA C to PTX and a loadable binary: nvcc (one process per kernel) where it is installed, NVRTC (ctypes) where only its
library is.

nvcc's binary is a fatbin holding SASS for the target sm_XX and the PTX (compute_XX), so the driver runs the SASS on that
architecture and JIT-compiles the PTX on a newer one instead of failing with CUDA_ERROR_NO_BINARY_FOR_GPU. NVRTC's is a cubin
(NVRTC cannot make a fatbin): it runs only on the architecture it was built for (the runtime compiles for its own GPU's).
Failures are CompileErrors carrying the compiler's log and the offending source lines.

NOTE: no binary made here has been loaded on a real GPU yet (no GPU where this was written); the fatbin's entries are checked by
parsing it (tests/test_compiler.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from kiln.codegen.spec import CompiledSpec, ProgramSpec
from kiln.ir.errors import CompileError
from kiln.runtime.cuda import settings

DEFAULT_ARCH = "sm_90"
_ARCH_RE = re.compile(r"^sm_\d{2,3}[af]?$")
# nvcc: "kernel.cu(12): error: ..."; NVRTC: "kernel.cu(12): error: ..." too; ptxas: "ptxas ... line 12; error"
_ERR_RE = re.compile(r"\((\d+)\):\s*(?:error|catastrophic error)")


def cuda_home() -> str | None:
  for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
    if p and os.path.isdir(p): return p
  return None


def find_nvcc() -> str | None:
  if (p := shutil.which("nvcc")) is not None: return p
  if (h := cuda_home()) is not None and os.access(os.path.join(h, "bin", "nvcc"), os.X_OK): return os.path.join(h, "bin", "nvcc")
  return None


@functools.cache
def nvcc_version(nvcc: str) -> str:
  out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
  m = re.search(r"release [\d.]+, (V[\d.]+)", out)
  return m.group(1) if m else "unknown"


def source_excerpt(src: str, log: str, context: int = 1, pattern: re.Pattern[str] = _ERR_RE) -> str:
  """The source lines a compiler log points at (with `context` lines around), numbered, the culprit marked with '>'."""
  lines = src.splitlines()
  bad = sorted({n for m in pattern.finditer(log) if 1 <= (n := int(m.group(1))) <= len(lines)})
  if not bad: return ""
  show = sorted({n for b in bad for n in range(max(1, b - context), min(len(lines), b + context) + 1)})
  out, prev = [], 0
  for n in show:
    if prev and n != prev + 1: out.append("   ...")
    out.append(f"{'>' if n in bad else ' '}{n:4d} | {lines[n - 1]}")
    prev = n
  return "\n".join(out)


NVRTC_INSTALL_HINT = "`pip install nvidia-cuda-nvrtc` (CUDA 13; `nvidia-cuda-nvrtc-cu12` for CUDA 12)"


def pip_nvidia_dirs(sub: str) -> list[str]:
  """Where NVIDIA's pip wheels put their files, newest CUDA first: site-packages/nvidia/cu13/<sub> (CUDA 13 wheels),
  nvidia/cu12/<sub>, nvidia/cuda_nvrtc/<sub> (CUDA 12 wheels), for each directory on sys.path."""
  out: list[str] = []
  for base in sys.path:
    for d in ("cu13", "cu12", "cuda_nvrtc"):
      p = os.path.join(base or ".", "nvidia", d, sub)
      if os.path.isdir(p) and p not in out: out.append(p)
  return out


class NVRTC:
  """The NVRTC C API through ctypes: CUDA C to PTX (and cubin for a real sm_XX arch) without nvcc."""

  def __init__(self, path: str | None = None):
    path = path or self.find()
    if path is None: raise CompileError("NVRTC was not found (no libnvrtc.so in CUDA_HOME/lib64, /usr/local/cuda/lib64, "
                                        "site-packages/nvidia/cu13/lib or nvidia/cuda_nvrtc/lib, or the loader path); "
                                        f"install the CUDA toolkit or {NVRTC_INSTALL_HINT}")
    self.path, self.lib = path, ctypes.CDLL(path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    self.version = f"{major.value}.{minor.value}"

  @staticmethod
  def find() -> str | None:
    dirs = [os.path.join(h, d) for h in filter(None, [cuda_home()]) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    for d in [*dirs, *pip_nvidia_dirs("lib")]:
      if hits := sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), key=len): return hits[0]
    return ctypes.util.find_library("nvrtc")

  def _check(self, status: int, what: str) -> None:
    if status != 0:
      self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
      raise CompileError(f"NVRTC {what} failed: {self.lib.nvrtcGetErrorString(status).decode()}")

  def _get(self, prog: ctypes.c_void_p, size_fn: str, get_fn: str) -> bytes:
    n = ctypes.c_size_t()
    self._check(getattr(self.lib, size_fn)(prog, ctypes.byref(n)), size_fn)
    buf = ctypes.create_string_buffer(n.value)
    self._check(getattr(self.lib, get_fn)(prog, buf), get_fn)
    return buf.raw[:n.value]

  def compile(self, src: str, name: str, opts: list[str], cubin: bool) -> tuple[str, bytes]:
    """(ptx, cubin bytes or b'' when not asked for)."""
    prog = ctypes.c_void_p()
    self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None), "nvrtcCreateProgram")
    try:
      copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
      status = self.lib.nvrtcCompileProgram(prog, len(opts), copts)
      log = self._get(prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog").rstrip(b"\0").decode(errors="replace")
      if status != 0: raise CompileError(f"NVRTC failed to compile kernel {name}", log, source_excerpt(src, log))
      ptx = self._get(prog, "nvrtcGetPTXSize", "nvrtcGetPTX").rstrip(b"\0").decode()
      return ptx, self._get(prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN") if cubin else b""
    finally: self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


class CUDACompiler:
  """CUDA C source to a loadable binary (CompiledSpec.bytes: a fatbin of sm_XX SASS and PTX from nvcc, a cubin from NVRTC)
  for one architecture; PTX through `compile_ptx`.

  arch: "sm_90" by default, or KILN_CUDA_ARCH. backend: "nvcc", "nvrtc" or None (nvcc where installed, else NVRTC)."""

  def __init__(self, arch: str | None = None, backend: str | None = None, extra_flags: tuple[str, ...] = ()):
    self.arch = arch or settings.ARCH.get() or DEFAULT_ARCH
    if not _ARCH_RE.match(self.arch): raise CompileError(f"invalid CUDA architecture {self.arch!r}: expected sm_<NN> such as sm_90 or sm_90a")
    if backend not in (None, "nvcc", "nvrtc"): raise CompileError(f"unknown CUDA compiler backend {backend!r}: expected 'nvcc' or 'nvrtc'")
    self.backend, self.extra_flags = backend, tuple(extra_flags)
    self._nvrtc: NVRTC | None = None
    self._cache: dict[str, tuple[str, bytes]] = {}  # source hash -> (ptx, cubin): a compile runs once per process
    self._lock = threading.Lock()

  def _pick(self) -> str:
    if self.backend is not None: return self.backend
    if find_nvcc() is not None: return "nvcc"
    if NVRTC.find() is not None: return "nvrtc"
    raise CompileError("no CUDA compiler found: neither nvcc (CUDA toolkit; set CUDA_HOME or put nvcc on PATH) nor libnvrtc.so is installed")

  @property
  def cache_key(self) -> str:
    """Names the compiler, its version and the target (part of disk-cache keys)."""
    if self._pick() == "nvcc": return f"nvcc-{nvcc_version(find_nvcc() or 'nvcc')}-{self.arch}"
    return f"nvrtc-{self._get_nvrtc().version}-{self.arch}"

  def _get_nvrtc(self) -> NVRTC:
    if self._nvrtc is None: self._nvrtc = NVRTC()
    return self._nvrtc

  def compile(self, spec: ProgramSpec) -> CompiledSpec:
    _, cubin = self.compile_src(spec.src, spec.name)
    return CompiledSpec.from_program(spec, src=spec.src, data=cubin, compiler=self.cache_key)

  def compile_ptx(self, src: str | ProgramSpec, name: str = "kernel") -> str:
    if isinstance(src, ProgramSpec): return self.compile_src(src.src, src.name)[0]
    return self.compile_src(src, name)[0]

  def compile_src(self, src: str, name: str = "kernel") -> tuple[str, bytes]:
    """(PTX text, binary) for CUDA C source: the binary is a fatbin (SASS for the arch plus the PTX) from nvcc, a cubin from
    NVRTC; either is what pycuda's module_from_buffer loads."""
    backend = self._pick()
    key = hashlib.sha256(f"{backend}|{self.arch}|{self.extra_flags}|{src}".encode()).hexdigest()
    with self._lock:
      if (hit := self._cache.get(key)) is not None: return hit
    out = self._nvcc(src, name) if backend == "nvcc" else self._get_nvrtc().compile(src, name, self._nvrtc_opts(), cubin=True)
    with self._lock: self._cache[key] = out
    return out

  def _nvrtc_opts(self) -> list[str]:
    inc = [f"--include-path={d}" for d in [*(os.path.join(h, 'include') for h in filter(None, [cuda_home()])), *pip_nvidia_dirs("include")]]
    return [f"--gpu-architecture={self.arch}", "--std=c++17", *inc, *self.extra_flags]

  def _nvcc(self, src: str, name: str) -> tuple[str, bytes]:
    nvcc = find_nvcc()
    if nvcc is None: raise CompileError("nvcc was not found: install the CUDA toolkit, set CUDA_HOME, or use backend='nvrtc'")
    fname = re.sub(r"[^A-Za-z0-9_]", "_", name) or "kernel"
    compute = self.arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory(prefix="kiln-nvcc-") as d:
      cu, fatbin = (os.path.join(d, f"{fname}.{ext}") for ext in ("cu", "fatbin"))
      with open(cu, "w") as f: f.write(src)
      # one nvcc process: the front end once, ptxas for the SASS, the PTX kept (--keep) for compile_ptx and packed beside it
      cmd = [nvcc, f"-gencode=arch={compute},code=[{self.arch},{compute}]", "-std=c++17", *self.extra_flags, "--fatbin", "--keep",
             "--keep-dir", d, "-o", fatbin, cu]
      r = subprocess.run(cmd, capture_output=True, text=True, cwd=d, check=False)
      if r.returncode != 0:
        log = (r.stderr + r.stdout).replace(d + os.sep, "").strip()
        raise CompileError(f"nvcc ({self.arch}) failed to compile kernel {name}", log, source_excerpt(src, log))
      ptx = os.path.join(d, f"{fname}.ptx")
      if not os.path.exists(ptx): raise CompileError(f"nvcc ({self.arch}) kept no PTX for kernel {name} (looked for {fname}.ptx)")
      with open(ptx) as f: ptx_text = f.read()
      with open(fatbin, "rb") as fb: return ptx_text, fb.read()
