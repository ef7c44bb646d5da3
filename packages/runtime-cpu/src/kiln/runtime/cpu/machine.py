"""The machine model the CPU code is built for: which CPU LLVM targets (the host, or KILN_CPU), its vector width and
register count, and the cache sizes (from sysfs, with documented defaults where it cannot be read)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kiln.ir.errors import DeviceError

SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"
# used where sysfs is missing or unreadable (macOS, containers that hide it): a current desktop/server core (32 KiB L1d,
# 1 MiB L2, 32 MiB of L3 shared); they only steer tiling and streaming-store thresholds, never correctness
DEFAULT_CACHES = {1: 32 << 10, 2: 1 << 20, 3: 32 << 20}

# ISA level: (vector bytes, vector registers, host features it needs to run). AVX without AVX2 still has 32-byte float vectors
_LEVELS: dict[str, tuple[int, int, tuple[str, ...]]] = {
  "sse2": (16, 16, ("sse2",)), "v2": (16, 16, ("sse4.2", "popcnt")), "avx": (32, 16, ("avx",)),
  "v3": (32, 16, ("avx2", "fma", "bmi2")), "v4": (64, 32, ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
  "neon": (16, 32, ())}
# levels whose every CPU has a fused multiply-add: x86-64-v3 requires FMA3, every AVX-512 CPU has it, AArch64 has it in its base ISA.
# AVX alone (Sandy Bridge, Bulldozer's FMA4 aside) has none
FMA_LEVELS = frozenset({"v3", "v4", "neon"})
ROUND_LEVELS = frozenset({"v2", "avx", "v3", "v4", "neon"})  # SSE4.1 (roundps) and up; every AArch64 (frintn)
_ROUND_FEATURES = frozenset({"+sse4.1", "+sse4.2", "+avx", "+avx2", "+avx512f"})  # an x86 feature string with any of these has roundps
# named CPUs with a byte dot product (vpdpbusd), by the extension that has it: AVX512-VNNI on 64-byte vectors, AVX-VNNI
# (VEX-encoded, a CPUID bit of its own) on 32; the ISA levels promise none
DOT_CPUS: dict[str, str] = {**dict.fromkeys(("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                                              "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5"), "avx512vnni"),
                            **dict.fromkeys(("alderlake", "raptorlake", "meteorlake", "arrowlake"), "avxvnni")}
# the LLVM cpu names KILN_CPU accepts, per host architecture (tests/test_machine.py checks LLVM knows every one)
X86_CPUS: dict[str, str] = {
  "x86-64": "sse2", "core2": "sse2", "x86-64-v2": "v2", "nehalem": "v2", "westmere": "v2", "sandybridge": "avx", "ivybridge": "avx",
  "btver2": "avx", "bdver4": "avx",
  "x86-64-v3": "v3", "haswell": "v3", "broadwell": "v3", "skylake": "v3", "alderlake": "v3", "raptorlake": "v3", "meteorlake": "v3",
  "arrowlake": "v3", "znver1": "v3", "znver2": "v3", "znver3": "v3",
  "x86-64-v4": "v4", "skylake-avx512": "v4", "cascadelake": "v4", "cooperlake": "v4", "cannonlake": "v4", "icelake-client": "v4",
  "icelake-server": "v4", "tigerlake": "v4", "rocketlake": "v4", "sapphirerapids": "v4", "emeraldrapids": "v4", "graniterapids": "v4",
  "znver4": "v4", "znver5": "v4"}
ARM_CPUS: dict[str, str] = {n: "neon" for n in ("generic", "cortex-a72", "cortex-a76", "neoverse-n1", "neoverse-n2", "neoverse-v1",
                                                "neoverse-v2", "apple-m1", "apple-m2")}


def is_x86(arch: str) -> bool: return arch.lower() in ("x86_64", "amd64", "i686", "i386", "x86")
def is_arm64(arch: str) -> bool: return arch.lower() in ("aarch64", "arm64")


def has_fma(features: str, arch: str) -> bool:
  """Whether an LLVM feature string's CPU has a fused multiply-add (x86: +fma, FMA3; AArch64: always)."""
  return is_arm64(arch) or (is_x86(arch) and "+fma" in features.split(","))


def has_round(features: str, arch: str) -> bool:
  """Whether an LLVM feature string's CPU rounds to nearest even in one instruction (x86: SSE4.1's roundps, which every
  later level has too; AArch64: always, frintn)."""
  return is_arm64(arch) or (is_x86(arch) and bool(_ROUND_FEATURES & set(features.split(","))))


def dot_bytes_of(features: str, arch: str) -> int:
  """The widest vector an LLVM feature string's CPU computes unsigned x signed byte dot products on, exactly (vpdpbusd:
  Ops.DOT4 in one instruction): 64 with AVX512-VNNI, 32 with AVX-VNNI or AVX512-VNNI held to 32-byte vectors; 0 none."""
  feats = set(features.split(","))
  if not is_x86(arch): return 0
  if "+avx512vnni" in feats and "+avx512f" in feats: return 64
  return 32 if "+avxvnni" in feats or ("+avx512vnni" in feats and "+avx512vl" in feats) else 0


def isa_of(features: str, arch: str) -> tuple[int, int]:
  """(vector bytes, vector registers) an LLVM feature string (+avx2,-avx512f,...) gives."""
  feats = set(features.split(","))
  if not is_x86(arch): return (16, 32) if is_arm64(arch) else (16, 16)
  if "+avx512f" in feats: return 64, 32
  if "+avx" in feats or "+avx2" in feats: return 32, 16
  return 16, 16


@dataclass(frozen=True)
class CPUChoice:
  """The CPU LLVM compiles for. features "" with a named cpu: that CPU's own feature set, as LLVM defines it."""
  cpu: str
  features: str
  from_env: bool  # True: KILN_CPU named it
  vector_bytes: int
  vector_registers: int
  fma: bool = False  # a fused multiply-add the vector maths may use (llvm_math): its results differ in the last bit from mul+add
  round: bool = False  # a one-instruction round to nearest even the vector maths may use (llvm_math): the same bits either way
  dot_bytes: int = 0  # the widest vector of an exact byte dot product instruction (dot_bytes_of): the renderer's DOT4


def cpu_names(arch: str) -> dict[str, str]:
  """The CPU names KILN_CPU accepts on a host of architecture `arch`, with their ISA level."""
  return X86_CPUS if is_x86(arch) else ARM_CPUS if is_arm64(arch) else {}


def choose_cpu(host: tuple[str, str], arch: str, env: str | None, runnable: bool = True) -> CPUChoice:
  """The host CPU, or the one `env` (KILN_CPU) names. An unknown name is a DeviceError (LLVM itself aborts the process
  on one), as is a CPU whose vector ISA this host cannot run: kiln runs the code it compiles in this process. With
  runnable=False (code only read, as assembly, never loaded) any CPU of the table is accepted."""
  if not env:
    return CPUChoice(host[0], host[1], False, *isa_of(host[1], arch), has_fma(host[1], arch), has_round(host[1], arch), dot_bytes_of(host[1], arch))
  name = env.strip().lower()
  table = cpu_names(arch)
  if name not in table:
    raise DeviceError(f"KILN_CPU={env!r} is not a CPU kiln can target on {arch}; accepted: {', '.join(sorted(table)) or 'none (unset KILN_CPU)'}")
  vb, regs, needs = _LEVELS[table[name]]
  host_feats = set(host[1].split(","))
  if runnable and (missing := [f for f in needs if f"+{f}" not in host_feats]):
    raise DeviceError(f"KILN_CPU={env!r} needs {', '.join(missing)}, which this CPU ({host[0]}) lacks: its code could not run here")
  dot = DOT_CPUS.get(name)  # kept only where this host runs it too: its code would stop on an unknown instruction
  dot_bytes = 0 if dot is None or (runnable and f"+{dot}" not in host_feats) else 64 if dot == "avx512vnni" else 32
  return CPUChoice(name, "", True, vb, regs, table[name] in FMA_LEVELS, table[name] in ROUND_LEVELS, dot_bytes)


def _size(text: str) -> int:
  """A sysfs cache size: "48K", "1024K", "32M", or plain bytes."""
  t = text.strip().upper()
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
  return int(t[:-1] if mult > 1 else t) * mult


def read_caches(root: str | os.PathLike[str] = SYSFS_CACHE) -> dict[int, int]:
  """{level: bytes} of the data (or unified) caches cpu0 sees; levels sysfs does not give take DEFAULT_CACHES."""
  found: dict[int, int] = {}
  try: entries = sorted(Path(root).glob("index*"))
  except OSError: entries = []
  for d in entries:
    try:
      level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
      if kind in ("Data", "Unified"): found[int(level)] = _size(size)
    except (OSError, ValueError): continue  # an entry without a readable level/type/size says nothing
  return {lv: found.get(lv) or DEFAULT_CACHES[lv] for lv in DEFAULT_CACHES}


def stream_store_bytes(caches: dict[int, int]) -> int:
  """The output size from which x86 vector stores bypass the caches: a quarter of the last-level cache (an output that
  large, with its inputs beside it, pushes out most of what the L3 held, and is itself gone before anyone re-reads it),
  and at least two L2s. 8 MiB on a 32 MiB-L3 core, where it was measured (16M float32 add: 7.8 -> 5.2 ms); also with
  the DEFAULT_CACHES."""
  return max(caches[3] // 4, 2 * caches[2])
