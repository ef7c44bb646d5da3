"""The disk cache against someone who can write files (issue 17): forged, foreign, re-keyed, linked and oversized entries are
never loaded; unsafe directories are not used at all; concurrent writers and a full disk cost nothing but a rebuild.

Every test keeps the key and the cache under tmp_path (XDG_CONFIG_HOME, KILN_CACHE_DIR), never in the real home. Most use
the numpy test runtime (its "object code" is the AST it evaluates); the forged-object-code test uses the real CPU runtime."""
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import stat
import warnings

import numpy as np
import pytest
from kiln_executor_testrt import requires_cpu_runtime

from kiln.codegen import diskcache
from kiln.codegen.diskcache import CacheKeyError, DiskCache, KilnCacheWarning
from kiln.codegen.registry import get_runtime
from kiln.executor import Buffer, ExecutionPlanBuilder, cache, debug
from kiln.ir import kernels
from kiln.ir.dtype import dtypes

N = 64
KEY_A, KEY_B = "a1" * 32, "b2" * 32
FOREIGN_UID = 54321


@pytest.fixture
def cfg(tmp_path, monkeypatch):
  """Key and cache under tmp_path; KILN_CACHE on; no KILN_CACHE_KEY; a fresh memory cache."""
  monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
  for k in ("KILN_CACHE", "KILN_CACHE_KEY"): monkeypatch.delenv(k, raising=False)
  cache.clear_memory_cache()
  yield tmp_path
  cache.clear_memory_cache()


@pytest.fixture
def trt(rt, cfg):
  """The numpy test runtime as "CPU" (the conftest's rt) with cfg's key and cache."""
  return rt


def _run(ast, x):
  """A fresh memory cache, then one plan running ast on x: (output, where the kernel came from)."""
  cache.clear_memory_cache()
  b = ExecutionPlanBuilder("CPU")
  xb = Buffer("CPU", x.size, dtypes.float32)
  xb.copyin(x)
  out, inp = b.add_buffer(Buffer("CPU", x.size, dtypes.float32)), b.add_buffer(xb)
  k = b.add_kernel(ast, [out, inp])
  b.set_outputs([out])
  plan = b.build()
  plan.execute()
  return plan.output_buffer(0).numpy().copy(), plan.prepared_ops[k].origin


def _add1(rt, name="sec"): return rt.elementwise(name, 0, [1], N)  # out = x + 1


def _x(): return np.arange(N, dtype=np.float32)


def _entry(ast):
  dkey = cache.disk_key(ast.key, "CPU", get_runtime("CPU"), "")
  return cache.cache_dir() / "kernels" / cache._entry_name(dkey), dkey


def _check_add1(ast, want_origin):
  got, origin = _run(ast, _x())
  np.testing.assert_array_equal(got, _x() + 1)
  assert origin == want_origin
  return origin


def _files(d): return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# ---- forged and re-keyed entries ----
@requires_cpu_runtime()
def test_forged_object_code_is_not_loaded(cfg, capsys):
  """The issue's attack: x*2's entry gets x*3's object code under x*2's entry point, and the old sha256 recomputed."""
  from kiln.executor import compile_kernel_with_origin
  times2 = kernels.elementwise(lambda x: x * 2.0, dtypes.float32, ((N,), dtypes.float32), name="scale")
  times3 = kernels.elementwise(lambda x: x * 3.0, dtypes.float32, ((N,), dtypes.float32), name="scale")
  assert compile_kernel_with_origin(times2)[1] == "compiled" and compile_kernel_with_origin(times3)[1] == "compiled"
  (p2, _), (p3, _) = _entry(times2), _entry(times3)
  env2, env3 = json.loads(p2.read_text()), json.loads(p3.read_text())  # entries stay JSON: {"mac": ..., "format", "key", "spec"}
  spec2, spec3 = json.loads(env2["spec"]), json.loads(env3["spec"])
  assert spec2["bytes"] != spec3["bytes"]
  spec2.update(bytes=spec3["bytes"], src=spec3["src"], entry_point=spec3["entry_point"])
  env2["spec"] = json.dumps(spec2)
  env2["sha256"] = hashlib.sha256(env2["spec"].encode()).hexdigest()
  p2.write_text(json.dumps(env2))
  debug.set_level(1)
  try:
    got, origin = _run(times2, _x())
  finally: debug.set_level(0)
  assert origin == "compiled" and "MAC does not verify" in capsys.readouterr().err
  np.testing.assert_array_equal(got, _x() * 2)
  assert _run(times2, _x())[1] == "disk"  # the forged entry was overwritten by a good one
  # the same forgery sealed with the user's key (an attacker who has it) does load: the MAC is what stood in the way
  env2.pop("mac")
  DiskCache("kernels", "kernel cache").store_json(p2.name, env2)
  got, origin = _run(times2, _x())
  assert origin == "disk"
  np.testing.assert_array_equal(got, _x() * 3)


def test_entry_of_an_older_kiln_is_a_miss(trt, capsys):
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  p, dkey = _entry(ast)
  spec = json.loads(p.read_text())["spec"]
  p.write_text(json.dumps({"format": 1, "key": dkey, "sha256": hashlib.sha256(spec.encode()).hexdigest(), "spec": spec}))
  debug.set_level(1)
  _check_add1(ast, "compiled")
  assert "carries no MAC" in capsys.readouterr().err
  assert json.loads(p.read_text())["format"] == 3 and _check_add1(ast, "disk")  # overwritten


def test_entries_hold_no_ast_and_one_that_does_is_refused(trt, capsys):
  """An entry stores the spec without its AST (the key names it; the caller's is used, not one rebuilt from JSON). A
  format-2 entry (the AST as JSON) is a miss, and so is a format-3 entry whose spec carries an AST of its own, even sealed
  with the user's key: the AST a kernel runs under is always the caller's."""
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  p, dkey = _entry(ast)
  env = json.loads(p.read_text())
  spec = json.loads(env["spec"])
  assert env["format"] == 3 and "ast" not in spec and spec["name"]
  other = _add1(trt, "sec_other")
  for fmt, extra in ((2, {}), (3, {"ast": json.loads(get_runtime("CPU").renderer.render(other).model_dump_json())["ast"]})):
    env2 = {"format": fmt, "key": dkey, "spec": json.dumps({**spec, **extra})}
    DiskCache("kernels", "kernel cache").store_json(p.name, env2)
    debug.set_level(1)
    try: _check_add1(ast, "compiled")
    finally: debug.set_level(0)
    assert "not used" in capsys.readouterr().err
  assert _check_add1(ast, "disk") == "disk"  # the refused entries were overwritten by good ones
  with pytest.raises(ValueError, match="must start with its AST's key"):
    cache.disk_store(cache.disk_key(other.key, "CPU", get_runtime("CPU"), ""), cache.compile_kernel(ast).compiled)


def test_entry_written_with_another_key_file(trt, tmp_path, monkeypatch):
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  assert _check_add1(ast, "disk")
  monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config-of-another"))  # a second user's key file, same cache dir
  _check_add1(ast, "compiled")
  monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
  _check_add1(ast, "compiled")  # the other key's entry is a miss for the first as well
  assert (tmp_path / "config" / "kiln" / "cache.key").read_bytes() != (tmp_path / "config-of-another" / "kiln" / "cache.key").read_bytes()


def test_cache_key_env_shares_a_cache_between_users(trt, tmp_path, monkeypatch):
  """Two "users" (two key files) share entries only through the same KILN_CACHE_KEY; two values never share."""
  ast = _add1(trt)
  monkeypatch.setenv("KILN_CACHE_KEY", KEY_A)
  monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "alice"))
  _check_add1(ast, "compiled")
  monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "bob"))
  _check_add1(ast, "disk")  # bob, same KILN_CACHE_KEY: alice's entry
  monkeypatch.setenv("KILN_CACHE_KEY", KEY_B)
  _check_add1(ast, "compiled")  # another team's key: a miss, overwritten
  monkeypatch.setenv("KILN_CACHE_KEY", KEY_A)
  _check_add1(ast, "compiled")
  monkeypatch.delenv("KILN_CACHE_KEY")
  _check_add1(ast, "compiled")  # bob's own key file: neither team's
  assert not (tmp_path / "alice").exists()  # with KILN_CACHE_KEY no key file is made


@pytest.mark.parametrize("value, match", [("abc", "64 hex digits"), ("zz" * 32, "hex digits"), ("a1" * 33, "holds 66 characters")])
def test_bad_cache_key_env_is_a_typed_error(trt, monkeypatch, value, match):
  monkeypatch.setenv("KILN_CACHE_KEY", value)
  with pytest.raises(CacheKeyError, match="KILN_CACHE_KEY") as ei: _run(_add1(trt, f"badkey{len(value)}"), _x())
  assert match in str(ei.value) and value not in str(ei.value)  # never echoes the secret
  monkeypatch.setenv("KILN_CACHE_KEY", "  ")  # empty: unset, the key file is used
  _check_add1(_add1(trt, f"badkey{len(value)}"), "compiled")


def test_key_file_is_made_private_once(trt, tmp_path):
  _check_add1(_add1(trt), "compiled")
  key = tmp_path / "config" / "kiln" / "cache.key"
  assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
  assert len(key.read_bytes()) == 32 and diskcache.cache_key() == key.read_bytes()
  assert not any(p.name.startswith(".cache.key") for p in key.parent.iterdir())  # no temporary file left
  assert not list((tmp_path / "cache").rglob("*.key"))  # the key is not in the cache


def test_key_file_open_to_others_disables_the_disk_cache(trt, tmp_path):
  d = tmp_path / "config" / "kiln"
  d.mkdir(parents=True, mode=0o700)
  (d / "cache.key").write_bytes(os.urandom(32))
  os.chmod(d / "cache.key", 0o644)
  with pytest.warns(KilnCacheWarning, match="open to other users"): _check_add1(_add1(trt), "compiled")
  _check_add1(_add1(trt), "compiled")
  assert _files(tmp_path / "cache" / "kernels") == []


# ---- directories and owners ----
def _make_foreign(path, monkeypatch):
  """As root: chown to another uid. Otherwise: patch the uid the checks compare with (kiln.codegen.diskcache.current_uid),
  which makes everything this user owns foreign, the directory included."""
  if os.geteuid() == 0: os.chown(path, FOREIGN_UID, -1)
  else: monkeypatch.setattr(diskcache, "current_uid", lambda: os.geteuid() + 1)


def test_foreign_owned_cache_dir_is_not_used(trt, tmp_path, monkeypatch):
  ast = _add1(trt)
  _check_add1(ast, "compiled")  # a good entry, and the key, exist
  _make_foreign(tmp_path / "cache", monkeypatch)
  with pytest.warns(KilnCacheWarning, match="owned by uid"): _check_add1(ast, "compiled")  # the entry there is not read
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    _check_add1(_add1(trt, "sec2"), "compiled")
  assert not [x for x in w if issubclass(x.category, KilnCacheWarning)]  # warned once
  assert len(_files(tmp_path / "cache" / "kernels")) == 1  # nothing written either


@pytest.mark.skipif(os.geteuid() != 0, reason="a foreign-owned entry in one's own directory needs os.chown, i.e. root")
def test_foreign_owned_entry_is_not_loaded(trt, capsys):
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  p, _ = _entry(ast)
  os.chown(p, FOREIGN_UID, -1)
  debug.set_level(1)
  _check_add1(ast, "compiled")
  assert "owned by uid" in capsys.readouterr().err
  assert p.stat().st_uid == os.geteuid() and _check_add1(ast, "disk")  # replaced by this user's


@pytest.mark.parametrize("which", ["cache", "cache/kernels"])
@pytest.mark.parametrize("mode, who", [(0o777, "group and others"), (0o757, "others"), (0o775, "group")])
def test_writable_dir_is_not_used(trt, tmp_path, which, mode, who):
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  before = _files(tmp_path / "cache" / "kernels")
  os.chmod(tmp_path / which, mode)
  with pytest.warns(KilnCacheWarning, match=f"writable by {who} "): _check_add1(ast, "compiled")
  _check_add1(_add1(trt, "sec2"), "compiled")
  assert _files(tmp_path / "cache" / "kernels") == before


def test_new_dirs_are_private(trt, tmp_path):
  _check_add1(_add1(trt), "compiled")
  for d in ("cache", "cache/kernels"): assert stat.S_IMODE((tmp_path / d).stat().st_mode) == 0o700, d


def test_symlinked_entry_is_not_followed(trt, tmp_path, capsys):
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  p, _ = _entry(ast)
  elsewhere = tmp_path / "elsewhere.json"
  shutil.move(p, elsewhere)  # a good entry, reached only through a link
  p.symlink_to(elsewhere)
  kept = elsewhere.read_bytes()
  debug.set_level(1)
  _check_add1(ast, "compiled")
  assert "symbolic link" in capsys.readouterr().err
  assert not p.is_symlink() and elsewhere.read_bytes() == kept  # the link was replaced, its target not written through
  assert _check_add1(ast, "disk")


def test_symlinked_subdir_is_not_followed(trt, tmp_path):
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  shutil.move(tmp_path / "cache" / "kernels", tmp_path / "kernels-elsewhere")
  (tmp_path / "cache" / "kernels").symlink_to(tmp_path / "kernels-elsewhere")
  before = _files(tmp_path / "kernels-elsewhere")
  with pytest.warns(KilnCacheWarning, match="symbolic link"): _check_add1(ast, "compiled")
  _check_add1(_add1(trt, "sec2"), "compiled")
  assert _files(tmp_path / "kernels-elsewhere") == before


def test_cache_root_may_be_a_link_of_the_users(trt, tmp_path, monkeypatch):
  (tmp_path / "big-disk").mkdir(mode=0o700)
  (tmp_path / "link").symlink_to(tmp_path / "big-disk")
  monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "link"))
  ast = _add1(trt)
  _check_add1(ast, "compiled")
  assert _check_add1(ast, "disk") and len(_files(tmp_path / "big-disk" / "kernels")) == 1


def test_oversized_entry_is_rejected_unread(trt, monkeypatch, capsys):
  ast = _add1(trt)
  p, _ = _entry(ast)
  p.parent.mkdir(parents=True, mode=0o700)
  with open(p, "wb") as f: f.truncate(diskcache.MAX_ENTRY_BYTES + 1)  # sparse: costs no disk
  reads = []
  real = diskcache._read_at_most
  monkeypatch.setattr(diskcache, "_read_at_most", lambda fd, n: reads.append(n) or real(fd, n))
  debug.set_level(1)
  _check_add1(ast, "compiled")
  assert "over the bound" in capsys.readouterr().err and diskcache.MAX_ENTRY_BYTES + 1 not in reads  # never read
  assert p.stat().st_size < 1 << 20 and _check_add1(ast, "disk")


def test_fifo_entry_does_not_hang(trt):
  ast = _add1(trt)
  p, _ = _entry(ast)
  p.parent.mkdir(parents=True, mode=0o700)
  os.mkfifo(p)
  _check_add1(ast, "compiled")
  assert stat.S_ISREG(p.stat().st_mode)


# ---- writers ----
def _writer(barrier, asts, rounds):
  cache.clear_memory_cache()
  errors = cache.cache_stats()["disk_errors"]  # the parent's count, inherited
  barrier.wait()
  for _ in range(rounds):
    for ast in asts:
      cache.clear_memory_cache()
      ck, _ = cache.compile_kernel_with_origin(ast)  # loads the entry or compiles and writes it
      cache.disk_store(_entry(ast)[1], ck.compiled)  # and writes it again, against the other writers
  os._exit(1 if cache.cache_stats()["disk_errors"] != errors else 0)  # a torn or unverifiable entry seen while others wrote


def test_eight_processes_write_the_same_entries(trt, tmp_path):
  asts = [_add1(trt, f"conc{i}") for i in range(3)]
  diskcache.cache_key()  # the key file exists before the writers start (its creation race has a test of its own below)
  ctx = multiprocessing.get_context("fork")
  barrier = ctx.Barrier(8)
  procs = [ctx.Process(target=_writer, args=(barrier, asts, 4)) for _ in range(8)]
  for p in procs: p.start()
  for p in procs: p.join(120)
  assert [p.exitcode for p in procs] == [0] * 8
  names = _files(tmp_path / "cache" / "kernels")
  assert names == sorted(_entry(a)[0].name for a in asts)  # no temporary file left
  for a in asts:
    assert DiskCache("kernels", "kernel cache").load_json(_entry(a)[0].name) is not None
    _check_add1(a, "disk")


def _make_key(barrier, q):
  barrier.wait()
  q.put(diskcache.cache_key())


def test_concurrent_first_use_makes_one_key(cfg):
  ctx = multiprocessing.get_context("fork")
  barrier, q = ctx.Barrier(4), ctx.Queue()
  procs = [ctx.Process(target=_make_key, args=(barrier, q)) for _ in range(4)]
  for p in procs: p.start()
  keys = {q.get(timeout=60) for _ in procs}
  for p in procs: p.join(60)
  assert keys == {(cfg / "config" / "kiln" / "cache.key").read_bytes()}


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_failed_write_is_one_warning(trt, tmp_path, monkeypatch, err):
  diskcache.cache_key()  # the key file is written before the disk "fills"

  def full(fd, data): raise OSError(err, os.strerror(err))
  monkeypatch.setattr(diskcache, "_write_all", full)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    _check_add1(_add1(trt), "compiled")
    _check_add1(_add1(trt, "sec2"), "compiled")
  msgs = [str(x.message) for x in w if issubclass(x.category, KilnCacheWarning)]
  assert len(msgs) == 1 and os.strerror(err) in msgs[0]
  assert _files(tmp_path / "cache" / "kernels") == []  # no entry and no temporary file


# ---- the CUDA emulator's cache of host libraries ----
_EMU = """extern "C" __global__ void __launch_bounds__(32) scale(float* __restrict__ data0, const float* __restrict__ data1) {{
  int i = blockIdx.x * 32 + threadIdx.x;
  data0[i] = data1[i] * {k}.0f;
}}"""


def test_emulator_library_entries_are_authenticated(cfg, capsys, monkeypatch):
  emu = pytest.importorskip("kiln.runtime.cuda.emulate")
  if not shutil.which("g++") and not shutil.which("c++"): pytest.skip("no host C++ compiler")
  monkeypatch.setenv("KILN_DEBUG", "1")

  def run(k):
    x, out = np.arange(32, dtype=np.float32), np.zeros(32, np.float32)
    emu.emulate(_EMU.format(k=k), "scale", [out, x], [], (1, 1, 1), (32, 1, 1))
    return out
  d = cfg / "cache" / "cuda-emu"
  np.testing.assert_array_equal(run(2), np.arange(32) * 2)
  (e2,) = [p for p in d.iterdir() if p.is_file()]
  np.testing.assert_array_equal(run(3), np.arange(32) * 3)
  (e3,) = [p for p in d.iterdir() if p.is_file() and p != e2]
  area = DiskCache("cuda-emu", "CUDA emulator cache")
  lib2, lib3 = area.load(e2.name), area.load(e3.name)
  assert lib2 and lib3 and lib2.startswith(b"\x7fELF") and lib2 != lib3
  sealed3 = e3.read_bytes()
  e2.write_bytes(sealed3)  # x*3's good entry moved to x*2's name: its MAC binds the name
  e3.write_bytes(lib2)  # a bare library (an older kiln's entry, or an attacker's) at the other kernel's name
  emu._loaded.clear()
  np.testing.assert_array_equal(run(2), np.arange(32) * 2)  # rebuilt, not the x*3 library
  np.testing.assert_array_equal(run(3), np.arange(32) * 3)
  err = capsys.readouterr().err
  assert err.count("carries no MAC") == 1 and err.count("does not verify") == 1
  emu._loaded.clear()
  np.testing.assert_array_equal(run(2), np.arange(32) * 2)  # now from the rewritten, sealed entries
  assert "not used" not in capsys.readouterr().err
