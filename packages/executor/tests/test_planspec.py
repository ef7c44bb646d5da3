"""Portable plans (kiln issue 18): kiln.executor.planspec's export and builder_from_spec, PortablePlan."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kiln.codegen.choose import Opt, OptOps
from kiln.executor import Buffer, ExecutionPlanBuilder, PlanSpec, PortablePlan, cache
from kiln.executor.planspec import export
from kiln.ir import kernels
from kiln.ir.dtype import dtypes
from kiln.ir.errors import PlanSpecError

RNG = np.random.default_rng(18)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  d = tmp_path / "cache"
  monkeypatch.setenv("KILN_CACHE_DIR", str(d))
  monkeypatch.delenv("KILN_CACHE", raising=False)
  monkeypatch.delenv("KILN_CACHE_KEY", raising=False)
  return d


def _mlp(w1: np.ndarray, w2: np.ndarray, opts: list[Opt] | None = None):
  """x[64,32] @ w1[32,48] -> relu (a second kernel) -> @ w2[48,16]: weights wrapped zero-copy, x fed per run."""
  b = ExecutionPlanBuilder("CPU")
  x = b.add_buffer(Buffer("CPU", 64 * 32, dtypes.float32))
  bw1, bw2 = b.add_buffer(Buffer.from_numpy(w1)), b.add_buffer(Buffer.from_numpy(w2))
  h, r, y = (b.add_buffer(Buffer("CPU", n, dtypes.float32)) for n in (64 * 48, 64 * 48, 64 * 16))
  b.add_kernel(kernels.matmul(64, 48, 32), [h, x, bw1], opts=opts)
  b.add_kernel(kernels.elementwise(lambda v: v.maximum(0.0), dtypes.float32, ((64 * 48,), dtypes.float32), name="relu"), [r, h])
  b.add_kernel(kernels.matmul(64, 16, 48), [y, r, bw2])
  b.set_outputs([y])
  return b.build(), x, y


def _aligned(a: np.ndarray, past: int = 0) -> np.ndarray:
  """A read-only copy of a's bytes starting `past` bytes after a 64-byte boundary."""
  raw = np.empty(a.nbytes + 64 + past, np.uint8)
  off = -raw.ctypes.data % 64 + past
  out = raw[off:off + a.nbytes]
  out[:] = a.reshape(-1).view(np.uint8)
  out.flags.writeable = False
  return out


def _weights() -> tuple[np.ndarray, np.ndarray]:
  return RNG.standard_normal((32, 48)).astype(np.float32), RNG.standard_normal((48, 16)).astype(np.float32)


def _run_plan(plan, xb: int, yb: int, x: np.ndarray) -> np.ndarray:
  plan.buffers[xb].copyin(x)
  plan.execute()
  return plan.buffers[yb].numpy().copy()


def test_round_trip_runs_bit_identical(cache_dir) -> None:
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  spec, arrays = export(plan, {"x": xb}, {"y": yb}, {"x": [64, 32], "y": [64, 16]})
  assert spec.kernel_count() == 3 and len(arrays) == 2  # the two weights travel beside the spec, not in it
  assert all(e.weight is None or e.weight.kind == "object" for e in spec.storages)
  assert all(e.readonly == (e.weight is not None) for e in spec.storages)  # no kernel writes the weights: shareable
  text = spec.to_json()
  assert len(text) < 2_000_000 and w1.tobytes().hex()[:64] not in text
  back = PlanSpec.from_json(text)
  assert back == spec
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  want = _run_plan(plan, xb, yb, x)
  aligned = {k: _aligned(v) for k, v in arrays.items()}  # as Ray's object store hands them out
  rebuilt = PortablePlan(back, aligned)
  ptrs = {b.storage.external.ctypes.data for b in rebuilt.plan.buffers if b.storage.external is not None}
  assert ptrs == {a.ctypes.data for a in aligned.values()}  # read-only weights handed in 64-byte aligned are wrapped, not copied
  for past, wrapped in ((4, True), (2, False)):  # float32 weights: wrapped where each element is aligned (as kernels load them)
    odd = {k: _aligned(v, past) for k, v in arrays.items()}
    ptrs = {b.storage.external.ctypes.data for b in PortablePlan(back, odd).plan.buffers if b.storage.external is not None}
    assert (ptrs == {a.ctypes.data for a in odd.values()}) == wrapped and (wrapped or not ptrs)
  got = rebuilt.run({"x": x})
  assert got["y"].shape == (64, 16)
  np.testing.assert_array_equal(got["y"], want.reshape(64, 16))
  np.testing.assert_allclose(want.reshape(64, 16), np.maximum(x @ w1, 0) @ w2, rtol=1e-4, atol=1e-4)


def test_bound_inputs_use_the_callers_buffers(cache_dir) -> None:
  """builder_from_spec(bound=): a spec input read and written in the caller's Buffer (a KV cache), which must be the
  spec's buffer (dtype, size, byte offset in a storage of the spec's size); anything else is a typed refusal."""
  from kiln.executor.planspec import builder_from_spec
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  spec, arrays = export(plan, {"x": xb}, {"y": yb})
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  mine = Buffer.from_numpy(x.copy())
  rebuilt = builder_from_spec(spec, arrays, bound={"x": mine}).build()
  rebuilt.execute()
  assert rebuilt.buffers[xb].storage is mine.storage  # read in place: nothing was copied in
  np.testing.assert_array_equal(rebuilt.buffers[yb].numpy(), _run_plan(plan, xb, yb, x))
  bigger = Buffer.from_numpy(np.zeros(64 * 32 + 16, np.float32))
  for bad, msg in (({"nope": mine}, "no input named 'nope'"), ({"x": x}, "takes a kiln.executor Buffer"),
                   ({"x": Buffer.from_numpy(np.zeros(64 * 32, np.int32))}, "the buffer given is 2048 x int32"),
                   ({"x": bigger.view(0, 64 * 32)}, "of 8256 bytes")):
    with pytest.raises(PlanSpecError, match=msg): builder_from_spec(spec, arrays, bound=bad)
  doc = json.loads(spec.to_json())
  doc["buffers"][xb]["size"] -= 1
  doc["buffers"][xb]["offset"] += 2
  with pytest.raises(PlanSpecError, match="starts at byte 2, not on a 4-byte element boundary"): PlanSpec.from_json(json.dumps(doc))


def test_repeated_kernels_share_one_text(cache_dir) -> None:
  """Entries of one kernel (the same AST on other buffers: a model's repeated layers) carry the same text object and
  seal, so a pickled spec (what Ray ships) holds the object code once; the JSON and a rebuild are unchanged."""
  import pickle
  b = ExecutionPlanBuilder("CPU")
  bufs = [b.add_buffer(Buffer("CPU", 64 * 64, dtypes.float32)) for _ in range(5)]
  w = b.add_buffer(Buffer.from_numpy(RNG.standard_normal((64, 64)).astype(np.float32)))
  for i in range(4): b.add_kernel(kernels.matmul(64, 64, 64), [bufs[i + 1], bufs[i], w])
  b.set_outputs([bufs[4]])
  spec = export(b.build())[0]
  texts = [op.compiled for op in spec.ops if op.kind == "kernel"]
  assert len(texts) == 4 and all(t is texts[0] for t in texts) and len({op.seal for op in spec.ops if op.kind == "kernel"}) == 1
  one = len(pickle.dumps(texts[0]))
  assert len(pickle.dumps(spec)) < one * 2, (len(pickle.dumps(spec)), one)  # four entries, one copy of the code
  assert PlanSpec.from_json(spec.to_json()) == spec


def test_explicit_opts_travel_and_are_kept(cache_dir) -> None:
  w1, w2 = _weights()
  opts = [Opt(OptOps.UPCAST, 1, 8)]
  plan, xb, yb = _mlp(w1, w2, opts)
  spec, arrays = export(plan, {"x": xb}, {"y": yb})
  k0 = spec.ops[0]
  assert k0.kind == "kernel" and k0.opts is not None and [o.opt() for o in k0.opts] == opts
  assert spec.ops[1].opts is None  # the heuristic's: a rebuild elsewhere runs that host's heuristic
  rebuilt = PortablePlan(spec, arrays, code="compile")
  assert rebuilt.plan.kernels[0].opts == opts


def test_weights_are_checked(cache_dir) -> None:
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  spec, arrays = export(plan, {"x": xb}, {"y": yb})
  key = next(iter(arrays))
  with pytest.raises(PlanSpecError, match="was not handed in"): PortablePlan(spec, {k: v for k, v in arrays.items() if k != key})
  bad = dict(arrays)
  bad[key] = arrays[key].copy()
  bad[key][0] ^= 1
  with pytest.raises(PlanSpecError, match="sha256"): PortablePlan(spec, bad)
  PortablePlan(spec, bad, verify=False)  # the caller may skip the check
  short = dict(arrays)
  short[key] = arrays[key][:-4]
  with pytest.raises(PlanSpecError, match="bytes, the spec says"): PortablePlan(spec, short)


def test_bad_feeds_and_specs_give_typed_errors(cache_dir) -> None:
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  spec, arrays = export(plan, {"x": xb}, {"y": yb}, {"x": [64, 32]})
  p = PortablePlan(spec, arrays)
  with pytest.raises(PlanSpecError, match="was not fed"): p.run({})
  with pytest.raises(PlanSpecError, match="dim 1"): p.run({"x": np.zeros((64, 31), np.float32)})
  with pytest.raises(PlanSpecError, match="not inputs"): p.run({"x": np.zeros((64, 32), np.float32), "z": np.zeros(1)})
  with pytest.raises(PlanSpecError, match="dtype"): p.run({"x": np.zeros((64, 32), np.complex64)})
  doc = json.loads(spec.to_json())
  doc["ops"][0]["buffers"][0] = 99
  with pytest.raises(PlanSpecError, match="names buffers"): PlanSpec.from_json(json.dumps(doc))
  doc = json.loads(spec.to_json())
  doc["buffers"][0]["size"] = 1 << 40
  with pytest.raises(PlanSpecError, match="runs past the end"): PlanSpec.from_json(json.dumps(doc))
  doc = json.loads(spec.to_json())
  doc["ops"][0]["compiled"] = "{not json"
  with pytest.raises(PlanSpecError, match="does not validate"): PortablePlan(PlanSpec.from_json(json.dumps(doc)), arrays)
  with pytest.raises(PlanSpecError, match="invalid"): PlanSpec.from_json(b"[1, 2]")
  with pytest.raises(PlanSpecError, match="no name"): export(plan, {"x": xb}, {})


def test_host_functions_are_not_portable(cache_dir) -> None:
  b = ExecutionPlanBuilder("CPU")
  a = b.add_buffer(Buffer("CPU", 16, dtypes.float32))
  b.add_custom(lambda buf: None, [a])
  b.set_outputs([a])
  with pytest.raises(PlanSpecError, match="host function"): export(b.build())[0]


def test_file_weights_travel_as_paths(cache_dir, tmp_path) -> None:
  """A DISK map is written as a file reference with its digest; the rebuild maps the file, and a changed file is refused."""
  w = RNG.standard_normal((32, 48)).astype(np.float32)
  path = tmp_path / "w.npy"
  np.save(path, w)
  b = ExecutionPlanBuilder("CPU")
  disk = b.add_buffer(Buffer.from_npy(path))
  wb = b.add_buffer(Buffer("CPU", w.size, dtypes.float32))
  x, y = b.add_buffer(Buffer("CPU", 8 * 32, dtypes.float32)), b.add_buffer(Buffer("CPU", 8 * 48, dtypes.float32))
  b.add_copy(wb, disk)
  b.add_kernel(kernels.matmul(8, 48, 32), [y, x, wb])
  b.set_outputs([y])
  spec, arrays = export(b.build(), {"x": x}, {"y": y}, {"x": [8, 32], "y": [8, 48]})
  assert arrays == {}
  refs = [e.weight for e in spec.storages if e.weight is not None]
  assert len(refs) == 1 and refs[0].kind == "file" and refs[0].path == str(path) and refs[0].offset > 0
  xa = RNG.standard_normal((8, 32)).astype(np.float32)
  np.testing.assert_allclose(PortablePlan(spec).run({"x": xa})["y"], xa @ w, rtol=1e-4, atol=1e-4)
  np.save(path, w + 1)
  with pytest.raises(PlanSpecError, match="sha256"): PortablePlan(spec)
  os.remove(path)
  with pytest.raises(PlanSpecError, match="cannot be mapped"): PortablePlan(spec)


_CHILD = textwrap.dedent("""
  import sys, json, numpy as np
  from kiln.executor import PlanSpec, PortablePlan, cache
  spec = PlanSpec.from_json(open(sys.argv[1]).read())
  arrays = {k: v for k, v in np.load(sys.argv[2]).items()}
  x = np.load(sys.argv[3])
  out = PortablePlan(spec, arrays, code=sys.argv[4]).run({"x": x})["y"]
  np.save(sys.argv[5], out)
  print(json.dumps(cache.cache_stats()))
""")


def _child(tmp_path, spec: PlanSpec, arrays, x, code: str, **env: str) -> tuple[np.ndarray, dict]:
  (tmp_path / "spec.json").write_text(spec.to_json())
  np.savez(tmp_path / "w.npz", **arrays)
  np.save(tmp_path / "x.npy", x)
  e = {**os.environ, **env}
  out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "spec.json"), str(tmp_path / "w.npz"), str(tmp_path / "x.npy"), code,
                        str(tmp_path / "y.npy")], env=e, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return np.load(tmp_path / "y.npy"), json.loads(out.stdout.strip().splitlines()[-1])


def test_new_process_compiles_nothing_on_the_same_target(cache_dir, tmp_path) -> None:
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  spec, arrays = export(plan, {"x": xb}, {"y": yb}, {"x": [64, 32], "y": [64, 16]})
  assert all(k.seal is not None for k in spec.ops)
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  want = _run_plan(plan, xb, yb, x).reshape(64, 16)
  fresh = str(tmp_path / "fresh-cache")  # no disk entries: only the spec's code can spare the compiles
  key = {"KILN_CACHE_KEY": "00" * 32}
  # the same key on both sides: sealed code is used
  spec2, arrays2 = _export_with_key(plan, xb, yb, key)
  got, stats = _child(tmp_path, spec2, arrays2, x, "sealed", KILN_CACHE_DIR=fresh, **key)
  np.testing.assert_array_equal(got, want)
  assert stats["compiles"] == 0 and stats["spec_loads"] == 3
  # another key: the seals do not verify, so every kernel is compiled from its AST (same target: same bits)
  got, stats = _child(tmp_path, spec2, arrays2, x, "sealed", KILN_CACHE_DIR=str(tmp_path / "other"), KILN_CACHE_KEY="11" * 32)
  np.testing.assert_array_equal(got, want)
  assert stats["compiles"] == 3 and stats["spec_loads"] == 0
  # the caller vouches for the spec: no seal needed
  got, stats = _child(tmp_path, spec2, arrays2, x, "trusted", KILN_CACHE="0")
  assert stats["compiles"] == 0 and stats["spec_loads"] == 3
  got, stats = _child(tmp_path, spec2, arrays2, x, "compile", KILN_CACHE="0")
  assert stats["compiles"] == 3 and stats["spec_loads"] == 0
  np.testing.assert_array_equal(got, want)


def _export_with_key(plan, xb, yb, env):
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try: return export(plan, {"x": xb}, {"y": yb}, {"x": [64, 32], "y": [64, 16]})
  finally:
    for k, v in old.items():
      if v is None: os.environ.pop(k, None)
      else: os.environ[k] = v


def test_tampered_code_is_not_run(cache_dir, tmp_path) -> None:
  """Code changed after sealing (here: its scratch size, which decides what memory it may touch) fails the seal, and
  the kernel is compiled from the AST instead."""
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  key = {"KILN_CACHE_KEY": "22" * 32}
  spec, arrays = _export_with_key(plan, xb, yb, key)
  doc = json.loads(spec.to_json())
  compiled = json.loads(doc["ops"][0]["compiled"])
  compiled["scratch_bytes"] = compiled.get("scratch_bytes", 0) + 64
  doc["ops"][0]["compiled"] = json.dumps(compiled)
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  got, stats = _child(tmp_path, PlanSpec.from_json(json.dumps(doc)), arrays, x, "sealed", KILN_CACHE_DIR=str(tmp_path / "c2"), **key)
  assert stats["compiles"] == 1 and stats["spec_loads"] == 2
  np.testing.assert_array_equal(got, _run_plan(plan, xb, yb, x).reshape(64, 16))


def test_another_target_compiles_for_itself(cache_dir, tmp_path) -> None:
  """A spec written for this host's CPU, rebuilt for AVX2 (KILN_CPU): the target key differs, so each kernel is
  compiled again with that target's heuristic."""
  if cache.target_key("CPU", __import__("kiln.codegen.registry", fromlist=["get_runtime"]).get_runtime("CPU")).find("x86-64-v3") >= 0:
    pytest.skip("this host already compiles for x86-64-v3")
  import platform
  if platform.machine() != "x86_64": pytest.skip("KILN_CPU=x86-64-v3 needs an x86-64 host")
  flags = open("/proc/cpuinfo").read()
  if " avx2 " not in flags or " fma " not in flags: pytest.skip("the host cannot run AVX2 code")
  w1, w2 = _weights()
  plan, xb, yb = _mlp(w1, w2)
  spec, arrays = export(plan, {"x": xb}, {"y": yb}, {"x": [64, 32], "y": [64, 16]})
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  got, stats = _child(tmp_path, spec, arrays, x, "trusted", KILN_CACHE="0", KILN_CPU="x86-64-v3")
  assert stats["compiles"] == 3 and stats["spec_loads"] == 0
  np.testing.assert_allclose(got, np.maximum(x @ w1, 0) @ w2, rtol=1e-4, atol=1e-4)
