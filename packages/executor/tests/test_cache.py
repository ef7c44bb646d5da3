import json
import os
import subprocess
import sys
import threading
import time

import pytest

from kiln.executor import cache
from kiln.executor.cache import CachedKernel, compile_kernel, compile_kernel_with_origin, get_or_compile_kernel


def _run_threads(n, fn):
  barrier, out, errs = threading.Barrier(n), [None] * n, []

  def work(i):
    barrier.wait()
    try: out[i] = fn()
    except Exception as e: errs.append(e)
  ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
  for t in ts: t.start()
  for t in ts: t.join()
  return out, errs


def test_16_threads_one_compile(rt):
  ast = rt.elementwise("k16", 0, [1], 32)
  rt.BEHAVIOR["k16"] = {"compile_sleep": 0.05}
  out, errs = _run_threads(16, lambda: compile_kernel(ast, "CPU"))
  assert not errs and rt.STATS["compiles"] == 1 and rt.STATS["loads"] == 1
  assert all(k is out[0] for k in out) and isinstance(out[0], CachedKernel)
  assert out[0].entry_point == "k16" and out[0].globals == [0, 1] and out[0].outs == [0] and out[0].ins == [1]


def test_get_or_compile_kernel_raw(rt):
  calls = []
  sentinel = compile_kernel(rt.elementwise("raw", 0, [], 4), "CPU")

  def fn():
    calls.append(1); time.sleep(0.05)
    return sentinel
  out, errs = _run_threads(16, lambda: get_or_compile_kernel("some-key", "CPU", fn))
  assert not errs and len(calls) == 1 and all(k is sentinel for k in out)


def test_failed_compile_not_cached(rt):
  ast = rt.elementwise("kfail", 0, [], 8)
  rt.BEHAVIOR["kfail"] = {"compile_fail": 1, "compile_sleep": 0.05}
  out, errs = _run_threads(4, lambda: compile_kernel(ast, "CPU"))
  assert len(errs) == 4 and all("injected compile failure" in str(e) for e in errs)  # waiters see the one failure
  assert rt.STATS["compiles"] == 1
  k = compile_kernel(ast, "CPU")  # the next call retries
  assert rt.STATS["compiles"] == 2 and compile_kernel(ast, "CPU") is k


def test_memory_hit_is_fast(rt):
  ast = rt.elementwise("fast", 0, [1], 8)
  k, origin = compile_kernel_with_origin(ast)
  assert origin == "compiled"
  n = 2000
  t0 = time.perf_counter()
  for _ in range(n): compile_kernel_with_origin(ast, "CPU")
  per = (time.perf_counter() - t0) / n
  assert compile_kernel_with_origin(ast, "CPU") == (k, "memory")
  assert per < 50e-6, per  # target 20 us; loose here so a loaded CI box does not flake


_CHILD = r"""
import os, sys, json
sys.path.insert(0, {tests!r})
import kiln_executor_testrt as rt
rt.install()
from kiln.executor.cache import compile_kernel_with_origin
k, origin = compile_kernel_with_origin(rt.elementwise("disk_k", 0, [1], 64))
print(json.dumps({{"origin": origin, "compiles": rt.STATS["compiles"], "name": k.entry_point, "outs": k.outs}}))
"""


def _child(env):
  code = _CHILD.format(tests=os.path.dirname(__file__))
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_disk_cache_new_process_and_corruption(tmp_path):
  env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "c"), "KILN_CACHE": "1"}
  first = _child(env)
  assert first == {"origin": "compiled", "compiles": 1, "name": "disk_k", "outs": [0]}
  files = list((tmp_path / "c" / "kernels").glob("*.json"))
  assert len(files) == 1 and not list((tmp_path / "c" / "kernels").glob(".tmp-*"))
  assert _child(env)["origin"] == "disk" and _child(env)["compiles"] == 0
  # truncated entry: recompiled, never fatal, and rewritten
  data = files[0].read_bytes()
  files[0].write_bytes(data[: len(data) // 2])
  assert _child(env) == first
  assert _child(env)["origin"] == "disk"
  # valid JSON with a flipped byte inside the spec: the checksum catches it
  env_json = json.loads(files[0].read_text())
  env_json["spec"] = env_json["spec"].replace('"disk_k"', '"disk_X"', 1)
  files[0].write_text(json.dumps(env_json))
  assert _child(env) == first
  files[0].write_bytes(b"\x00\xff garbage")
  assert _child(env) == first
  # KILN_CACHE=0: no disk cache at all
  env0 = {**env, "KILN_CACHE": "0", "KILN_CACHE_DIR": str(tmp_path / "off")}
  assert _child(env0)["origin"] == "compiled" and _child(env0)["origin"] == "compiled"
  assert not (tmp_path / "off").exists()


def test_disk_key_parts(rt):
  from kiln.codegen.registry import get_runtime
  k = cache.disk_key("abc", "CPU", get_runtime("CPU"))
  assert "abc" in k and "testcc-1" in k and "kiln-executor=" in k and cache.cpu_fingerprint() in k


def test_kernel_keys_keep_their_values(rt):
  """The memory and disk keys are written in one place now; their values must stay what existing disk caches hold."""
  from kiln.codegen.registry import get_runtime
  ast, crt = rt.elementwise("kkeys", 0, [1], 32), get_runtime("CPU")
  variant = str(getattr(crt, "cache_variant", ""))
  assert cache.kernel_key(ast, "CPU", None) == ast.key + variant == compile_kernel(ast, "CPU").key
  assert cache.kernel_key(ast, "CPU", ["o1", "o2"]) == ast.key + "opts:['o1', 'o2']" + variant
  assert cache.kernel_disk_key(ast, "CPU", crt, None) == f"{ast.key}|{cache.target_key('CPU', crt)}|"
  assert cache.kernel_disk_key(ast, "CPU", crt, []) == f"{ast.key}|{cache.target_key('CPU', crt)}|opts:[]"


def test_unwritable_cache_dir_is_not_fatal(rt, tmp_path, monkeypatch):
  f = tmp_path / "file"
  f.write_text("x")
  monkeypatch.setenv("KILN_CACHE_DIR", str(f))  # a file, not a directory
  from kiln.codegen.diskcache import KilnCacheWarning
  with pytest.warns(KilnCacheWarning, match="could not write to the kernel cache"):  # one warning, never an error of the call
    k, origin = compile_kernel_with_origin(rt.elementwise("nowrite", 0, [], 4))
  assert origin == "compiled" and k.entry_point == "nowrite"


@pytest.mark.parametrize("level", [2, 3, 4])
def test_debug_levels_on_compile(rt, capsys, level):
  from kiln.executor import debug
  debug.set_level(level)
  compile_kernel(rt.elementwise(f"dbg{level}", 0, [1], 4))
  err = capsys.readouterr().err
  assert f"dbg{level}" in err and "opts:" in err
  assert ("; test kernel" in err) == (level >= 3)
  assert ("DEFINE_GLOBAL" in err) == (level >= 4)


def test_source_stamp_follows_edits(tmp_path):
  (tmp_path / "sub").mkdir()
  f = tmp_path / "sub" / "mod.py"
  f.write_text("x = 1\n")
  (tmp_path / "notes.txt").write_text("not code")
  before = cache._source_stamp(tmp_path)
  (tmp_path / "notes.txt").write_text("still not code, longer")
  assert cache._source_stamp(tmp_path) == before  # only .py files count
  f.write_text("x = 22\n")
  assert cache._source_stamp(tmp_path) != before


def test_versions_stamp_the_code_shaping_layers():
  v = dict(part.split("=", 1) for part in cache.kiln_versions("kiln.runtime.cpu.device").split(","))
  assert {"kiln-uop-ir", "kiln-codegen", "kiln-executor", "kiln-runtime-cpu"} <= v.keys()
  stamped = {d for d, ver in v.items() if "+" in ver}
  assert stamped == {"kiln-uop-ir", "kiln-codegen", "kiln-runtime-cpu"}  # the executor and CUDA do not shape CPU code


def test_cpu_disk_key_uses_llvm_host_fingerprint():
  from kiln.codegen.registry import get_runtime
  rt = get_runtime("CPU")
  assert rt.compiler.fingerprint in cache.disk_key("abc", "CPU", rt)
