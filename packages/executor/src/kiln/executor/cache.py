"""The kernel cache: in memory (each kernel compiled exactly once per process, shared by every caller) and on disk
(CompiledSpec JSON in KILN_CACHE_DIR, so a new process loads object code without rendering or compiling). Disk entries
are authenticated with a secret key and kept under ssh-like directory rules: kiln.codegen.diskcache."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kiln.codegen import diskcache
from kiln.codegen.protocols import Program, Runtime
from kiln.codegen.registry import get_runtime
from kiln.codegen.spec import CompiledSpec, DeviceSpec, KernelArg, Variable
from kiln.codegen.threads import CORE_ID
from kiln.executor import debug
from kiln.ir.errors import CacheError
from kiln.ir.uop import UOp

Origin = Literal["memory", "disk", "compiled", "spec"]  # "spec": object code a PlanSpec carried (kiln.executor.planspec)


@dataclass(eq=False)
class CachedKernel:
  """A loaded program with everything needed to dispatch it. Shared (never copied) by every plan that uses it."""
  program: Program
  device: str
  code: str  # generated source, for debugging and profiles
  entry_point: str
  var_names: list[str]  # positional order of vals (core_id excluded: the runtime supplies it)
  globals: list[int]  # buffer slots in argument order
  outs: list[int]
  ins: list[int]
  host_parallel_safe: bool
  global_size: tuple[int | UOp, int | UOp, int | UOp] | None
  local_size: tuple[int | UOp, int | UOp, int | UOp] | None
  vars: list[Variable] = field(default_factory=list)
  args: list[KernelArg] = field(default_factory=list)
  flops: int = 0
  mem_bytes: int = 0
  threads: int = 1
  applied_opts: list[str] = field(default_factory=list)
  ast: UOp | None = None
  compiled: CompiledSpec | None = None
  key: str = ""
  origin: Origin = "compiled"  # how this process got it: compiled here, or loaded from the disk cache

  @property
  def name(self) -> str: return self.entry_point

  @classmethod
  def from_compiled(cls, compiled: CompiledSpec, program: Program, runtime: Runtime, key: str = "", origin: Origin = "compiled") -> CachedKernel:
    threaded = compiled.threads > 1 or CORE_ID in compiled.var_names
    return cls(program=program, device=str(compiled.device), code=compiled.src or "", entry_point=compiled.name,
               var_names=[v for v in compiled.var_names if v != CORE_ID], globals=list(compiled.globals), outs=list(compiled.outs),
               ins=list(compiled.ins), host_parallel_safe=bool(runtime.host_parallel_safe) and not threaded,
               global_size=compiled.global_size, local_size=compiled.local_size, vars=[v for v in compiled.vars if v.name != CORE_ID],
               args=list(compiled.args), flops=compiled.flops, mem_bytes=compiled.mem_bytes, threads=compiled.threads,
               applied_opts=list(compiled.applied_opts), ast=compiled.ast, compiled=compiled, key=key, origin=origin)


# ---- memory cache: exactly one compile per (key, device) under any concurrency ----
_kernels: dict[tuple[str, str], CachedKernel] = {}
_inflight: dict[tuple[str, str], Future[CachedKernel]] = {}
_lock = threading.Lock()
_stats = {"memory_hits": 0, "disk_hits": 0, "compiles": 0, "disk_errors": 0, "spec_loads": 0, "plan_hits": 0, "plan_stores": 0}


@functools.lru_cache(maxsize=256)
def _dev(device: str) -> str: return str(DeviceSpec.parse(device))


def get_or_compile_kernel(key: str, device: str | DeviceSpec, compile_fn: Callable[[], CachedKernel]) -> CachedKernel:
  """The CachedKernel for (key, device), running compile_fn at most once at a time; every caller gets the same object.
  A compile that raises is not cached: its waiters see the error, the next call compiles again."""
  k = (key, _dev(device) if isinstance(device, str) else str(device))
  if (hit := _kernels.get(k)) is not None: return hit  # lock-free fast path (dict reads are atomic)
  with _lock:
    if (hit := _kernels.get(k)) is not None: return hit
    fut = _inflight.get(k)
    owner = fut is None
    if fut is None: fut = _inflight[k] = Future()
  if not owner: return fut.result()
  try:
    ck = compile_fn()
    if not isinstance(ck, CachedKernel): raise CacheError(f"compile_fn for kernel {key[:16]} returned {type(ck).__name__}, not a CachedKernel")
  except BaseException as e:
    with _lock: del _inflight[k]
    fut.set_exception(e)
    raise
  with _lock:
    _kernels[k] = ck
    del _inflight[k]
  fut.set_result(ck)
  return ck


def clear_memory_cache() -> None:
  with _lock: _kernels.clear()


def cache_stats() -> dict[str, int]: return dict(_stats)


# ---- disk cache ----
def disk_cache_enabled() -> bool: return diskcache.enabled()


def cache_dir() -> Path: return diskcache.cache_root()


def disk_cache_info() -> tuple[Path, int, int]:
  """(directory, number of kernel entries, total bytes)."""
  d = cache_dir() / _AREA
  sizes = []
  with contextlib.suppress(OSError):
    for f in (d.glob("*.json") if d.is_dir() and not d.is_symlink() else ()):
      with contextlib.suppress(OSError): sizes.append(f.lstat().st_size)
  return cache_dir(), len(sizes), sum(sizes)


_LAYERS = (("kiln-uop-ir", "kiln.ir"), ("kiln-codegen", "kiln.codegen"), ("kiln-executor", "kiln.executor"),
           ("kiln-runtime-cpu", "kiln.runtime.cpu"), ("kiln-runtime-cuda", "kiln.runtime.cuda"))
_CODE_SHAPING = ("kiln.ir", "kiln.codegen")  # layers whose source decides the generated code, with the device's runtime


@functools.lru_cache(maxsize=8)
def kiln_versions(runtime_module: str = "") -> str:
  """The installed kiln layers' versions, read from their version.py without importing them (importlib.metadata costs
  ~10 ms, a runtime's __init__ can be slow). The layers that shape object code (IR, codegen and the runtime named by
  `runtime_module`, e.g. "kiln.runtime.cpu.device") also carry a source stamp."""
  import importlib.util
  out = []
  for dist, mod in _LAYERS:
    try:
      spec = importlib.util.find_spec(mod)
      for loc in (spec.submodule_search_locations or []) if spec else []:
        if (ver := _read_version(Path(loc) / "version.py")) is None: continue
        stamped = mod in _CODE_SHAPING or runtime_module == mod or runtime_module.startswith(mod + ".")
        out.append(f"{dist}={ver}" + (f"+{_source_stamp(Path(loc))}" if stamped else ""))
        break
    except (ImportError, OSError, ValueError): pass
  return ",".join(out)


def _read_version(path: Path) -> str | None:
  with open(path) as f:
    for line in f:
      name, eq, value = line.partition("=")
      if eq and name.strip() == "__version__": return value.strip().strip("\"'")
  return None


def _source_stamp(root: Path) -> str:
  """A hash of a layer's .py files, each by its path below the layer's directory and its bytes: a changed codegen (an
  editable install between versions) must not load object code an older codegen made, and the same code installed
  editable or from a wheel (other directories, other mtimes) has the same stamp, so the two share the disk cache's
  entries (issue 39). Read once per process (kiln_versions caches it): about 1 MB a few ms."""
  files: list[tuple[str, str]] = []
  stack = [str(root)]
  while stack:
    with os.scandir(stack.pop()) as it:
      for e in it:
        if e.is_dir(follow_symlinks=False) and e.name != "__pycache__": stack.append(e.path)
        elif e.name.endswith(".py"): files.append((os.path.relpath(e.path, root).replace(os.sep, "/"), e.path))
  h = hashlib.sha256()
  for rel, path in sorted(files):
    with open(path, "rb") as f: data = f.read()
    h.update(b"%s\0%d\0" % (rel.encode(), len(data)))
    h.update(data)
  return h.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
  """CPU model and feature flags (object code compiled for this CPU must not load on a CPU missing its features)."""
  try:
    model, flags = "", ""
    with open("/proc/cpuinfo") as f:
      for line in f:
        k, _, v = line.partition(":")
        if k.strip() == "model name" and not model: model = v.strip()
        elif k.strip() in ("flags", "Features") and not flags: flags = " ".join(sorted(v.split()))
        if model and flags: break
    if model or flags: return f"{model}|{flags}"
  except OSError: pass
  return f"{platform.machine()}|{platform.processor()}"


def cpu_name() -> str:
  fp = cpu_fingerprint().split("|")[0]
  return fp or platform.processor() or platform.machine()


def target_key(device: str, rt: Runtime) -> str:
  """What object code compiled here depends on besides its kernel: the device, the compiler's target (CPU name and
  features, KILN_CPU), the kiln versions with their source stamps and the machine's fingerprint. Two processes whose
  target keys are equal can run each other's object code (the disk cache and portable plans rely on it)."""
  fp = getattr(rt, "fingerprint", None) or getattr(rt.compiler, "fingerprint", None) or cpu_fingerprint()
  return "|".join((device, str(getattr(rt.compiler, "cache_key", "")), kiln_versions(type(rt).__module__), str(fp)))


def disk_key(ast_key: str, device: str, rt: Runtime, opts: str = "") -> str: return "|".join((ast_key, target_key(device, rt), opts))


_AREA = "kernels"
# of the envelope: the spec without its AST (the key names it, the caller holds it); 1 (a sha256, no MAC) and 2 (the AST as
# JSON) are a miss
_ENTRY_FORMAT = 3


def _entry_name(dkey: str) -> str: return hashlib.sha256(dkey.encode()).hexdigest() + ".json"


def _kernel_area() -> diskcache.DiskCache: return diskcache.DiskCache(_AREA, "kernel cache", cache_dir())


def disk_load(dkey: str, ast: UOp) -> CompiledSpec | None:
  """The cached CompiledSpec of `ast` (whose key starts dkey), or None. An entry that is missing, another key's, fails its
  MAC or does not validate is never used (one debug line): the caller compiles and overwrites it. Only a malformed
  KILN_CACHE_KEY raises. The entry holds no AST: the spec gets the caller's (a new process rebuilding it from JSON spent
  about 0.4 ms of a disk hit's 3 on it)."""
  name = _entry_name(dkey)
  try:
    env = _kernel_area().load_json(name)
    if env is None: return None
    if env.get("format") != _ENTRY_FORMAT or env.get("key") != dkey: raise diskcache.BadEntry("it holds another kernel's key")
    return CompiledSpec.model_validate_json_with(env["spec"], ast=ast)
  except diskcache.CacheKeyError: raise
  except Exception as e:  # BadEntry, or a verified entry that no longer validates (a kiln bug, never an attacker's)
    _stats["disk_errors"] += 1
    if debug.DEBUG >= 1: debug.emit(f"kiln: kernel cache entry {name} not used ({type(e).__name__}: {str(e)[:120]}); recompiling")
    return None


def disk_store(dkey: str, compiled: CompiledSpec) -> None:
  """Store compiled under dkey, which must start with its AST's key (disk_load gives the spec back the caller's AST)."""
  if not dkey.startswith(compiled.ast.key + "|"): raise ValueError(f"a kernel cache key must start with its AST's key, got {dkey[:80]!r}")
  _kernel_area().store_json(_entry_name(dkey), {"format": _ENTRY_FORMAT, "key": dkey, "spec": compiled.model_dump_json(exclude={"ast"})})


# ---- a kernel's keys, and building one ----
def opts_key(opts: Sequence[Any] | None) -> str: return "" if opts is None else "opts:" + repr(list(opts))


def variant_key(dev: str) -> str:
  """What a runtime renders differently for within one process (CUDA: KILN_CUDA_TF32), part of the memory cache's keys as the
  target key is of the disk cache's; empty for most."""
  return str(getattr(get_runtime(dev), "cache_variant", ""))


def kernel_key(ast: UOp, dev: str, opts: Sequence[Any] | None) -> str:
  """The memory cache's key of `ast` compiled with `opts` (None: the heuristic's) on `dev` (a canonical device name). Every
  way into the cache (a compile, a disk hit, the tuner's winner, a PlanSpec's object code) keys by this."""
  return ast.key + opts_key(opts) + variant_key(dev)


def kernel_disk_key(ast: UOp, dev: str, rt: Runtime, opts: Sequence[Any] | None) -> str:
  """The disk cache's key of the same kernel: the target key stands for what the variant says within a process."""
  return disk_key(ast.key, dev, rt, opts_key(opts))


def build_kernel(rt: Runtime, ast: UOp, opts: Sequence[Any] | None, key: str) -> CachedKernel:
  """Render, compile and load `ast` on `rt`, outside any cache (the caller decides where the kernel goes)."""
  spec = rt.renderer.render(ast) if opts is None else rt.renderer.render(ast, opts)
  compiled = rt.compiler.compile(spec)
  return CachedKernel.from_compiled(compiled, rt.load(compiled), rt, key, "compiled")


# ---- the high-level entry point ----

def compile_kernel_with_origin(ast: UOp, device: str | DeviceSpec = "CPU", opts: Sequence[Any] | None = None) -> tuple[CachedKernel, Origin]:
  """Memory cache -> disk cache -> render + compile. Returns the kernel and where it came from."""
  dev = _dev(device) if isinstance(device, str) else str(device)
  key = kernel_key(ast, dev, opts)
  if (hit := _kernels.get((key, dev))) is not None:
    _stats["memory_hits"] += 1
    return hit, "memory"

  def build() -> CachedKernel:
    rt = get_runtime(dev)
    if (ck := _from_disk(rt, ast, dev, opts, key)) is not None: return ck
    ck = build_kernel(rt, ast, opts, key)
    _stats["compiles"] += 1
    if disk_cache_enabled() and ck.compiled is not None: disk_store(kernel_disk_key(ast, dev, rt, opts), ck.compiled)
    debug.on_compiled(ck, "compiled")
    return ck

  ck = get_or_compile_kernel(key, dev, build)
  return ck, ck.origin


def _from_disk(rt: Runtime, ast: UOp, dev: str, opts: Sequence[Any] | None, key: str) -> CachedKernel | None:
  """The kernel loaded from the disk cache (None: off, a miss, or bytes that no longer load, e.g. a different LLVM)."""
  if not disk_cache_enabled() or (compiled := disk_load(kernel_disk_key(ast, dev, rt, opts), ast)) is None: return None
  try:
    ck = CachedKernel.from_compiled(compiled, rt.load(compiled), rt, key, "disk")
  except Exception as e:
    _stats["disk_errors"] += 1
    if debug.DEBUG >= 1: debug.emit(f"kiln: cached kernel {compiled.name} failed to load ({e}); recompiling")
    return None
  _stats["disk_hits"] += 1
  debug.on_compiled(ck, "disk cache")
  return ck


def cached_kernel(ast: UOp, device: str | DeviceSpec = "CPU", opts: Sequence[Any] | None = None) -> CachedKernel | None:
  """The kernel from the memory cache, else from the disk cache (then kept in memory too); None where it would have to be
  compiled."""
  dev = _dev(device) if isinstance(device, str) else str(device)
  key = kernel_key(ast, dev, opts)
  if (hit := _kernels.get((key, dev))) is not None: return hit
  if (ck := _from_disk(get_runtime(dev), ast, dev, opts, key)) is None: return None
  return get_or_compile_kernel(key, dev, lambda: ck)


def adopt_kernel(ast: UOp, device: str | DeviceSpec, opts: Sequence[Any] | None, ck: CachedKernel) -> CachedKernel:
  """Put a kernel compiled outside the cache (the tuner's winner) in it under (ast, opts): in memory, and on disk unless
  KILN_CACHE=0, so compile_kernel(ast, device, opts) finds it. An entry already there wins (every caller shares one)."""
  dev = _dev(device) if isinstance(device, str) else str(device)
  ck.key = kernel_key(ast, dev, opts)
  got = get_or_compile_kernel(ck.key, dev, lambda: ck)
  if got is ck and disk_cache_enabled() and ck.compiled is not None: disk_store(kernel_disk_key(ast, dev, get_runtime(dev), opts), ck.compiled)
  return got


def compile_kernel(ast: UOp, device: str | DeviceSpec = "CPU", opts: Sequence[Any] | None = None) -> CachedKernel:
  """The shared CachedKernel for a kernel AST on a device (memory cache, then disk cache, then render + compile)."""
  return compile_kernel_with_origin(ast, device, opts)[0]
