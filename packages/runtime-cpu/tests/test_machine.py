"""The machine model: sysfs cache sizes (a fake tree), the KILN_CPU choice and its errors, the Target the runtime builds."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.ir import DeviceError, SettingError
from kiln.runtime.cpu.compiler import LLVMCompiler, host_cpu
from kiln.runtime.cpu.device import CPURuntime, cpu_target
from kiln.runtime.cpu.machine import (
  ARM_CPUS,
  DEFAULT_CACHES,
  X86_CPUS,
  choose_cpu,
  dot_bytes_of,
  has_fma,
  has_round,
  is_x86,
  isa_of,
  read_caches,
  stream_store_bytes,
)

X86 = is_x86(platform.machine())
AVX2_HOST = ("x86_64", "+avx2,+fma,+bmi2,+avx,+sse4.2,+popcnt,+sse2,-avx512f")
AVX512_HOST = ("znver4", "+avx2,+fma,+bmi2,+avx,+sse4.2,+popcnt,+sse2,+avx512f,+avx512bw,+avx512dq,+avx512vl")


def fake_sysfs(root: Path, entries: list[tuple[str, str, str]]) -> Path:
  for i, (level, kind, size) in enumerate(entries):
    d = root / f"index{i}"
    d.mkdir(parents=True)
    for name, text in (("level", level), ("type", kind), ("size", size)): (d / name).write_text(text + "\n")
  return root


def test_read_caches_from_a_fake_sysfs_tree(tmp_path: Path) -> None:
  root = fake_sysfs(tmp_path, [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "1024K"), ("3", "Unified", "32M")])
  assert read_caches(root) == {1: 48 << 10, 2: 1 << 20, 3: 32 << 20}  # the instruction cache is not the L1d


def test_read_caches_falls_back_per_level(tmp_path: Path) -> None:
  assert read_caches(tmp_path / "missing") == DEFAULT_CACHES
  root = fake_sysfs(tmp_path / "partial", [("1", "Data", "64K"), ("2", "Unified", "lots"), ("3", "Instruction", "1M")])
  assert read_caches(root) == {1: 64 << 10, 2: DEFAULT_CACHES[2], 3: DEFAULT_CACHES[3]}


def test_host_choice_follows_llvm_features() -> None:
  c = choose_cpu(AVX512_HOST, "x86_64", None)
  assert (c.cpu, c.features, c.from_env, c.vector_bytes, c.vector_registers) == ("znver4", AVX512_HOST[1], False, 64, 32)
  assert (choose_cpu(AVX2_HOST, "x86_64", "").vector_bytes, choose_cpu(AVX2_HOST, "x86_64", "").vector_registers) == (32, 16)
  assert isa_of("+neon,+fp-armv8", "aarch64") == (16, 32) and isa_of("+sse2", "x86_64") == (16, 16)


@pytest.mark.parametrize("name,isa", [("x86-64-v3", (32, 16)), ("haswell", (32, 16)), ("znver3", (32, 16)), ("x86-64-v4", (64, 32)),
                                      ("skylake-avx512", (64, 32)), ("znver4", (64, 32)), ("x86-64-v2", (16, 16)), ("Haswell", (32, 16))])
def test_kiln_cpu_names_set_the_isa(name: str, isa: tuple[int, int]) -> None:
  c = choose_cpu(AVX512_HOST, "x86_64", name)
  assert c.from_env and c.cpu == name.lower() and c.features == "" and (c.vector_bytes, c.vector_registers) == isa


@pytest.mark.parametrize("name,fma", [("x86-64-v3", True), ("haswell", True), ("znver3", True), ("x86-64-v4", True), ("znver4", True),
                                      ("sandybridge", False), ("x86-64-v2", False), ("x86-64", False)])
def test_fma_follows_the_cpu(name: str, fma: bool) -> None:
  """The vector maths fuses its polynomials only for a CPU with FMA: from the host's LLVM features, or the level KILN_CPU names."""
  assert choose_cpu(AVX512_HOST, "x86_64", name).fma is fma
  assert choose_cpu(AVX512_HOST, "x86_64", None).fma and choose_cpu(AVX2_HOST, "x86_64", None).fma
  assert not choose_cpu(("corei7", "+sse4.2,+popcnt,+sse2,-fma"), "x86_64", None).fma
  assert has_fma("+neon", "aarch64") and not has_fma("+avx2,-fma", "x86_64")


@pytest.mark.parametrize("name,rounds", [("x86-64", False), ("core2", False), ("x86-64-v2", True), ("nehalem", True), ("sandybridge", True),
                                         ("x86-64-v3", True), ("znver4", True)])
def test_one_instruction_round_follows_the_cpu(name: str, rounds: bool) -> None:
  """The vector maths rounds with llvm.roundeven only where it is one instruction (SSE4.1's roundps, AArch64's frintn): from the
  host's LLVM features, or the level KILN_CPU names; SSE2 alone keeps the MAGIC add."""
  assert choose_cpu(AVX512_HOST, "x86_64", name).round is rounds
  assert choose_cpu(AVX2_HOST, "x86_64", None).round and not choose_cpu(("core2", "+sse2,+ssse3,-sse4.1"), "x86_64", None).round
  assert has_round("+neon", "aarch64") and has_round("+sse4.1,+sse2", "x86_64") and not has_round("+sse2,-sse4.1", "x86_64")


@pytest.mark.parametrize("name,dot", [("znver4", 64), ("icelake-server", 64), ("cascadelake", 64), ("skylake-avx512", 0),
                                      ("x86-64-v4", 0), ("znver3", 0), ("haswell", 0), ("alderlake", 32)])
def test_byte_dot_product_follows_the_cpu(name: str, dot: int) -> None:
  """DOT4 takes vpdpbusd only on a CPU with VNNI, and only one this host runs: AVX512-VNNI is not AVX-VNNI (Zen 4 has the
  first, Alder Lake the second), and the ISA levels promise neither."""
  vnni512 = (AVX512_HOST[0], AVX512_HOST[1] + ",+avx512vnni")
  vnni256 = ("alderlake", AVX2_HOST[1] + ",+avxvnni")
  host = vnni256 if dot == 32 else vnni512
  assert choose_cpu(host, "x86_64", name, runnable=False).dot_bytes == dot
  assert choose_cpu(AVX512_HOST, "x86_64", "znver4").dot_bytes == 0  # the host lacks VNNI: its code could not run
  assert choose_cpu(vnni512, "x86_64", "alderlake").dot_bytes == 0  # AVX-VNNI's VEX encoding is not AVX512-VNNI's
  assert choose_cpu(vnni512, "x86_64", None).dot_bytes == 64 and choose_cpu(AVX2_HOST, "x86_64", None).dot_bytes == 0
  assert dot_bytes_of("+avx2,+avxvnni", "x86_64") == 32 and dot_bytes_of("+avx512f,+avx512vl,+avx512vnni", "x86_64") == 64
  assert dot_bytes_of("+neon,+dotprod", "aarch64") == 0


def test_target_and_cache_key_carry_fma(monkeypatch: pytest.MonkeyPatch) -> None:
  """Code with and without fused maths differs in the last bit: the Target says which, and the disk cache key tells them apart."""
  if not X86: pytest.skip("x86 CPU names")
  keys = {}
  for name in ("x86-64-v2", "x86-64-v3"):
    monkeypatch.setenv("KILN_CPU", name)
    rt = CPURuntime()
    assert rt.target.fma is (name == "x86-64-v3")
    keys[name] = rt.compiler.cache_key
  assert "|fma0|" in keys["x86-64-v2"] and "|fma1|" in keys["x86-64-v3"]
  monkeypatch.setenv("KILN_CPU", "x86-64")
  assert not CPURuntime().target.round and CPURuntime().compiler.cache_key.endswith("|round0") and keys["x86-64-v2"].endswith("|round1")


def test_kiln_cpu_errors_name_the_value_and_what_is_accepted() -> None:
  with pytest.raises(DeviceError, match=r"KILN_CPU='pentium9' is not a CPU .* accepted: .*haswell.*x86-64-v3"):
    choose_cpu(AVX512_HOST, "x86_64", "pentium9")
  with pytest.raises(DeviceError, match=r"KILN_CPU='haswell' .*accepted: .*neoverse-n1"): choose_cpu(("neoverse-n1", "+neon"), "aarch64", "haswell")
  # code for a wider ISA than the host's would die on an illegal instruction: refused up front
  with pytest.raises(DeviceError, match=r"KILN_CPU='x86-64-v4' needs avx512f.*lacks"): choose_cpu(AVX2_HOST, "x86_64", "x86-64-v4")
  # code only read (assembly of the other ISA), never loaded: any CPU of the table
  assert choose_cpu(AVX2_HOST, "x86_64", "x86-64-v4", runnable=False).vector_bytes == 64


def test_llvm_knows_every_accepted_cpu_name() -> None:
  # LLVM aborts the whole process on a processor it does not know: every table name must build a target machine and
  # compile a function without its "not a recognized processor" warning
  names, triple = (X86_CPUS, "x86_64-unknown-linux-gnu") if X86 else (ARM_CPUS, "aarch64-unknown-linux-gnu")
  code = ("import sys, llvmlite.binding as llvm\nllvm.initialize_all_targets(); llvm.initialize_all_asmprinters()\n"
          f"t = llvm.Target.from_triple({triple!r})\n"
          "for n in sys.argv[1:]:\n  m = llvm.parse_assembly('define void @f() {\\n  ret void\\n}\\n'); m.triple = t.triple\n"
          "  t.create_target_machine(cpu=n, features='', opt=3).emit_assembly(m)\nprint('ok', len(sys.argv) - 1)")
  r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.strip() == f"ok {len(names)}" and "not a recognized processor" not in r.stderr, r.stderr[-2000:]


def test_bad_kiln_cpu_is_a_typed_error_not_an_llvm_abort(monkeypatch: pytest.MonkeyPatch) -> None:
  with pytest.raises(DeviceError, match="KILN_CPU='bogus'"): LLVMCompiler(cpu="bogus")
  monkeypatch.setenv("KILN_CPU", "bogus")
  with pytest.raises(SettingError, match="KILN_CPU must be an LLVM CPU name kiln can target on this machine, got 'bogus'"): CPURuntime()


@pytest.mark.skipif(not (X86 and "+avx2" in host_cpu()[1].split(",")), reason="needs an x86 host with AVX2")
def test_kiln_cpu_keys_the_caches_apart(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv("KILN_CPU", raising=False)  # "the host" even when the suite itself runs under KILN_CPU
  host = LLVMCompiler()
  v3 = LLVMCompiler(cpu="x86-64-v3")
  assert not host.choice.from_env and v3.choice.from_env and v3.cpu == "x86-64-v3" and v3.features == ""
  assert host.cache_key != v3.cache_key and host.fingerprint != v3.fingerprint and "KILN_CPU=x86-64-v3" in v3.fingerprint
  monkeypatch.setenv("KILN_CPU", "x86-64-v3")
  rt = CPURuntime()
  assert rt.compiler.fingerprint == v3.fingerprint and (rt.target.vector_bytes, rt.target.vector_registers) == (32, 16)
  assert "|vec32|regs16|" in rt.compiler.cache_key


def test_runtime_target_is_the_machine_model() -> None:
  t, c = cpu_target(), LLVMCompiler().choice
  assert (t.vector_bytes, t.vector_registers) == (c.vector_bytes, c.vector_registers)
  caches = read_caches()
  assert (t.l1d_bytes, t.l2_bytes, t.l3_bytes) == (caches[1], caches[2], caches[3]) and t.cores >= 1
  assert t.stream_store_bytes in (0, stream_store_bytes(caches))  # 0 off x86


@pytest.mark.parametrize("l2,l3,want", [(1 << 20, 32 << 20, 8 << 20), (2 << 20, 32 << 20, 8 << 20), (1 << 20, 96 << 20, 24 << 20),
                                        (2 << 20, 4 << 20, 4 << 20), (512 << 10, 0, 1 << 20)])
def test_streaming_threshold_from_the_caches(l2: int, l3: int, want: int) -> None:
  assert stream_store_bytes({1: 32 << 10, 2: l2, 3: l3}) == want
  assert stream_store_bytes(DEFAULT_CACHES) == 8 << 20  # a machine without sysfs keeps the threshold measured on a 32 MiB L3
