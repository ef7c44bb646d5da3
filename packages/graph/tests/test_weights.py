"""Weights mapped from .npy and safetensors files (kiln.graph.weights): every dtype round trips and computes, an MLP
whose weights come from a safetensors file equals numpy, each hostile file is a WeightsError naming the file and the
tensor, and the mapped data is not copied: the tensor's array and the plan's buffer are the file's mapped pages, and a
plan built and run over a 128 MB file faults in only what its kernel reads."""
from __future__ import annotations

import gc
import json
import os
import struct

import numpy as np
import numpy.lib.format as npformat
import pytest

from kiln.graph import GraphError, Tensor, compile
from kiln.graph.weights import MAX_HEADER_BYTES, WeightsError, file_maps, load_npy, load_safetensors, safetensors_metadata, save_safetensors
from kiln.ir.dtype import bf16_bits_to_f32, f32_to_bf16_bits

RNG = np.random.default_rng(15)
LINUX_MAPS = file_maps(__file__) is not None


def data(dt: str, shape: tuple[int, ...] = (3, 5)) -> np.ndarray:
  if dt == "bool": return RNG.random(shape) < 0.5
  if np.dtype(dt).kind == "f": return RNG.standard_normal(shape).astype(dt)
  info = np.iinfo(dt)
  return RNG.integers(max(info.min, -100), min(info.max, 100), shape, endpoint=True).astype(dt)


def raw_file(path, header: object, payload: bytes = b"", pad: bool = True, hlen: int | None = None) -> str:
  """A safetensors file written byte by byte: header a dict (JSON-encoded) or raw bytes; hlen overrides the length field."""
  head = header if isinstance(header, bytes) else json.dumps(header).encode()
  if pad: head += b" " * (-len(head) % 8)
  path.write_bytes(struct.pack("<Q", len(head) if hlen is None else hlen) + head + payload)
  return str(path)


def rss_anon() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


# ---- round trips ----
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@pytest.mark.parametrize("dt", ["float32", "float64", "float16", "bool", *INT_DTYPES])
def test_safetensors_round_trip_and_compute(tmp_path, dt):
  a, s = data(dt), data(dt, ())
  p = str(tmp_path / "w.safetensors")
  save_safetensors(p, {"a": a, "scalar": s})
  t = load_safetensors(p)
  assert set(t) == {"a", "scalar"} and t["a"].shape == a.shape and t["scalar"].shape == () and t["a"].dtype.name == dt
  assert (t["a"].numpy() == a).all() and t["scalar"].numpy().reshape(()) == s
  got = compile([t["a"] ^ True if dt == "bool" else t["a"] + t["scalar"]]).run()[0]
  want = a ^ True if dt == "bool" else (a + s).astype(dt)
  assert got.dtype == want.dtype
  if want.dtype.kind == "f": np.testing.assert_allclose(got, want, rtol=1e-3 if dt == "float16" else 1e-6)
  else: np.testing.assert_array_equal(got, want)


def test_safetensors_bf16_holds_bits_and_computes(tmp_path):
  f = RNG.standard_normal((4, 6)).astype(np.float32)
  bits = f32_to_bf16_bits(f)
  p = str(tmp_path / "bf.safetensors")
  save_safetensors(p, {"h": (bits, "BF16")})
  raw = open(p, "rb").read()
  assert json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["h"] == {"dtype": "BF16", "shape": [4, 6], "data_offsets": [0, 48]}
  t = load_safetensors(p)["h"]
  assert t.dtype.name == "bfloat16" and (t.numpy() == bits).all()
  assert np.array_equal(compile([t.cast("float32") * 2.0]).run()[0], bf16_bits_to_f32(bits) * 2)


def test_safetensors_metadata_and_names(tmp_path):
  p = str(tmp_path / "m.safetensors")
  save_safetensors(p, {"a": data("float32"), "b": data("int64")}, {"format": "pt", "note": "x"})
  assert safetensors_metadata(p) == {"format": "pt", "note": "x"}
  assert list(load_safetensors(p, names=["b"])) == ["b"]
  with pytest.raises(WeightsError, match=r"m\.safetensors: no tensor named 'c'"): load_safetensors(p, names=["c"])


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("dt", ["float32", "float16", "int64", "uint8", "bool"])
def test_npy_round_trip_through_a_disk_buffer(tmp_path, version, dt):
  a = data(dt, (4, 3, 2))
  p = tmp_path / "a.npy"
  with open(p, "wb") as f: npformat.write_array(f, a, version=version)
  t = load_npy(p)
  assert t.shape == a.shape and t.dtype.name == dt and (t.numpy() == a).all()
  assert not t.node.arg.data.flags.writeable  # the read-only DISK map, not a copy
  if LINUX_MAPS: assert len(file_maps(p)) == 1


def test_npy_fortran_vector_is_accepted(tmp_path):
  np.save(tmp_path / "v.npy", np.asfortranarray(np.arange(6, dtype=np.float32)))
  assert (load_npy(tmp_path / "v.npy").numpy() == np.arange(6)).all()


# ---- a model from a safetensors file ----
def test_mlp_from_safetensors_equals_numpy(tmp_path):
  w1, b1 = RNG.standard_normal((64, 32)).astype(np.float32), RNG.standard_normal(64).astype(np.float32)
  w2, b2 = RNG.standard_normal((10, 64)).astype(np.float32), RNG.standard_normal(10).astype(np.float32)
  p = str(tmp_path / "mlp.safetensors")
  save_safetensors(p, {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2})
  w = load_safetensors(p)
  x = Tensor.input("x", (8, 32))
  c = compile([x.linear(w["fc1.weight"], w["fc1.bias"]).relu().linear(w["fc2.weight"], w["fc2.bias"]).softmax(-1)])
  xs = RNG.standard_normal((8, 32)).astype(np.float32)
  # the reference in float64: a float32 numpy reference rounds about as much as rtol 1e-5 allows (one CI run missed it
  # by 1.4e-5 of a value; kiln's result is within 1e-5 of the float64 one)
  h = np.maximum(xs.astype(np.float64) @ w1.T + b1, 0) @ w2.T + b2
  want = np.exp(h - h.max(-1, keepdims=True))
  np.testing.assert_allclose(c.run({"x": xs})[0], want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


# ---- hostile files ----
F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
HOSTILE = [  # (name, header, payload, match)
  ("bad_json", b'{"a": {"dtype": ', bytes(16), "not valid JSON"),
  ("not_utf8", b'{"\xff": 1}', b"", "not valid JSON"),
  ("nan", b'{"__metadata__": {"x": NaN}}', b"", "not valid JSON"),
  ("top_list", b"[1, 2]", b"", "must be a JSON object"),
  ("duplicate", b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
   bytes(8), "duplicate key 'a'"),
  ("metadata", {"__metadata__": {"k": 3}}, b"", "__metadata__ must map strings to strings"),
  ("unknown_dtype", {"a": {**F32, "dtype": "F8_E4M3"}}, bytes(16), "tensor 'a': dtype 'F8_E4M3' is not supported"),
  ("dtype_not_str", {"a": {**F32, "dtype": 4}}, bytes(16), "tensor 'a': dtype 4 is not supported"),
  ("negative_dim", {"a": {**F32, "shape": [-2, -2]}}, bytes(16), r"tensor 'a': shape \[-2, -2\] is not a list"),
  ("float_dim", {"a": {**F32, "shape": [2.0, 2]}}, bytes(16), "tensor 'a': shape .* is not a list"),
  ("bool_dim", {"a": {**F32, "shape": [True, 4]}}, bytes(16), "tensor 'a': shape .* is not a list"),
  ("too_many_dims", {"a": {**F32, "shape": [1] * 40 + [4]}}, bytes(16), "tensor 'a': shape .* at most 32"),
  ("shape_str", {"a": {**F32, "shape": "2x2"}}, bytes(16), "tensor 'a': shape '2x2'"),
  ("offsets_short", {"a": {**F32, "data_offsets": [0]}}, bytes(16), "tensor 'a': data_offsets .* two ints"),
  ("offsets_float", {"a": {**F32, "data_offsets": [0, 16.0]}}, bytes(16), "tensor 'a': data_offsets .* two ints"),
  ("past_end", {"a": {**F32, "data_offsets": [8, 24]}}, bytes(16), r"tensor 'a': data_offsets \[8, 24\] are outside the data section \(0..16"),
  ("negative_offset", {"a": {**F32, "data_offsets": [-4, 12]}}, bytes(16), "tensor 'a': .* outside the data section"),
  ("reversed", {"a": {**F32, "data_offsets": [16, 0]}}, bytes(16), "tensor 'a': .* outside the data section"),
  ("size_mismatch", {"a": {**F32, "data_offsets": [0, 12]}}, bytes(16), "tensor 'a': data_offsets .* span 12 bytes, shape .* takes 16"),
  ("huge_shape", {"a": {**F32, "shape": [2 ** 40, 2 ** 40]}}, bytes(16), "tensor 'a': .* takes"),
  ("overlap", {"a": {**F32, "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16),
   "tensors 'a' and 'b' overlap"),
  ("long_name", {"n" * 2000: F32}, bytes(16), "tensor name 'nnnn.* is over 1024 bytes"),
  ("empty_name", {"": F32}, bytes(16), "a tensor name must be a non-empty string"),
  ("extra_key", {"a": {**F32, "offset": 3}}, bytes(16), "tensor 'a': entry must have exactly dtype, shape and data_offsets"),
  ("entry_not_dict", {"a": [1, 2]}, bytes(16), "tensor 'a': entry must have exactly"),
  ("empty_tensor", {"a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}, b"", r"tensor 'a' of shape \[0, 3\] is empty"),
  ("bool_bytes", {"m": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]}}, bytes([0, 1, 2, 1]), "tensor 'm': BOOL data holds bytes"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_safetensors_is_a_weights_error(tmp_path, case):
  name, header, payload, match = case
  p = raw_file(tmp_path / f"{name}.safetensors", header, payload)
  with pytest.raises(WeightsError, match=match) as e: load_safetensors(p)
  assert p in str(e.value) and isinstance(e.value, GraphError)


def test_hostile_header_lengths(tmp_path):
  short = tmp_path / "short.safetensors"
  short.write_bytes(b"\x01\x00")
  with pytest.raises(WeightsError, match="2 bytes is too short"): load_safetensors(short)
  big = raw_file(tmp_path / "big.safetensors", {}, hlen=MAX_HEADER_BYTES + 1)
  with pytest.raises(WeightsError, match=f"big.safetensors: header length {MAX_HEADER_BYTES + 1} is over"): load_safetensors(big)
  with pytest.raises(WeightsError, match="big.safetensors: no safetensors header length"): safetensors_metadata(big)
  trunc = raw_file(tmp_path / "trunc.safetensors", {"a": F32}, hlen=4096)
  with pytest.raises(WeightsError, match="trunc.safetensors is truncated: header length 4096"): load_safetensors(trunc)
  with pytest.raises(WeightsError, match="safetensors file does not exist .*missing"): load_safetensors(tmp_path / "missing.safetensors")
  cut = raw_file(tmp_path / "cut.safetensors", {"a": F32}, bytes(12))  # data section 4 bytes short
  with pytest.raises(WeightsError, match="cut.safetensors: tensor 'a': data_offsets .* outside the data section"): load_safetensors(cut)


def test_hostile_npy_is_a_weights_error(tmp_path):
  np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((3, 4), np.float32)))
  np.save(tmp_path / "o.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
  np.save(tmp_path / "be.npy", np.arange(4, dtype=">f4"))
  np.save(tmp_path / "c.npy", np.ones(3, np.complex64))
  np.save(tmp_path / "e.npy", np.ones((0, 3), np.float32))
  np.save(tmp_path / "t.npy", np.ones(100, np.float64))
  with open(tmp_path / "t.npy", "r+b") as f: f.truncate(os.path.getsize(tmp_path / "t.npy") - 8)
  (tmp_path / "junk.npy").write_bytes(b"not an npy file at all")
  neg = b"{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }".ljust(117) + b"\n"
  (tmp_path / "neg.npy").write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(neg)) + neg)
  for name, match in [("f", "Fortran-order"), ("o", "Python objects"), ("be", "not in this machine's byte order"),
                      ("c", "complex64 has no kiln dtype"), ("e", r"shape \(0, 3\) is empty"),
                      ("t", "t.npy is truncated: header says 800 data bytes"), ("junk", "junk.npy is not a readable .npy file"),
                      ("neg", r"shape \(-2, 3\) is not a tuple"), ("missing", ".npy file does not exist .*missing.npy")]:
    with pytest.raises(WeightsError, match=match) as e: load_npy(tmp_path / f"{name}.npy")
    assert f"{name}.npy" in str(e.value)


def test_save_refuses_what_safetensors_cannot_hold(tmp_path):
  for bad in (np.ones(3, ">f4"), np.ones(2, np.complex64), (np.ones(2, np.float32), "BF16"), (np.ones(2, np.uint16), "F8_E4M3")):
    with pytest.raises(WeightsError, match="cannot store"): save_safetensors(tmp_path / "x.safetensors", {"x": bad})


# ---- mapped, not copied ----
@pytest.mark.skipif(not LINUX_MAPS, reason="needs /proc/self/smaps")
def test_tensor_and_plan_buffer_are_the_files_mapped_pages(tmp_path):
  w = RNG.standard_normal((32, 16)).astype(np.float32)
  p = str(tmp_path / "w.safetensors")
  save_safetensors(p, {"w": w, "b": np.ones(32, np.float32)})
  t = load_safetensors(p)
  (m,) = file_maps(p)
  arr = t["w"].node.arg.data
  assert m.start <= arr.ctypes.data < arr.ctypes.data + arr.nbytes <= m.end and not arr.flags.writeable
  c = compile([Tensor.input("x", (4, 16)).linear(t["w"], t["b"])])
  assert arr.ctypes.data in [b.ptr for b in c.plan.buffers]  # the plan's weight buffer wraps the mapped pages
  xs = RNG.standard_normal((4, 16)).astype(np.float32)
  np.testing.assert_allclose(c.run({"x": xs})[0], xs @ w.T + 1, rtol=1e-5, atol=1e-5)
  del t, arr, c
  gc.collect()
  assert file_maps(p) == []  # the map goes with the last tensor or plan that uses it


@pytest.mark.skipif(not LINUX_MAPS, reason="needs /proc/self/smaps")
def test_misaligned_tensor_is_copied_by_the_plan_and_still_right(tmp_path):
  w = RNG.standard_normal((4, 4)).astype(np.float32)
  head = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
  head += b" " * ((3 - len(head)) % 8)  # 8 + len(head) is 3 past an 8-byte boundary: every float32 starts misaligned
  p = raw_file(tmp_path / "odd.safetensors", head, w.tobytes(), pad=False)
  t = load_safetensors(p)["w"]
  arr = t.node.arg.data
  assert arr.ctypes.data % 4 == 3 and (t.numpy() == w).all()
  c = compile([t * 2.0])
  assert arr.ctypes.data not in [b.ptr for b in c.plan.buffers]  # Buffer.from_numpy copied it into aligned memory
  assert np.array_equal(c.run()[0], w * 2)


@pytest.mark.skipif(not LINUX_MAPS, reason="needs /proc/self/smaps and /proc/self/status")
def test_plan_over_a_large_file_faults_in_only_what_its_kernel_reads(tmp_path):
  rows, cols = 1024, 8192  # 4 tensors of 32 MB: 128 MB mapped
  p = str(tmp_path / "big.safetensors")
  save_safetensors(p, {f"w{i}": np.full((rows, cols), i + 1, np.float32) for i in range(4)})
  gc.collect()
  anon0 = rss_anon()
  w = load_safetensors(p)
  x = Tensor.input("x", (2, cols))
  c = compile([x.linear(w["w2"][:8])])  # reads rows 0..7 of one tensor: 256 KB
  (m,) = file_maps(p)
  assert m.end - m.start >= 4 * rows * cols * 4 and m.rss < 1 << 20, m  # mapped whole, nothing read to build the plan
  xs = np.ones((2, cols), np.float32)
  assert np.array_equal(c.run({"x": xs})[0], np.full((2, 8), 3.0 * cols, np.float32))
  (m,) = file_maps(p)
  assert m.rss < 4 << 20, m  # the kernel's 256 KB (and the kernel's read-ahead), not 128 MB
  assert rss_anon() - anon0 < 32 << 20  # no copy of any 32 MB tensor in anonymous memory
