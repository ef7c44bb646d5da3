"""Corrupt and hostile GGUF files: each is a CheckpointError naming the file and what was wrong; none crashes, hangs or
reads past the file (truncations at every header offset, absurd counts and lengths, tensors past the end, misaligned or
overlapping tensors, unknown types, byte flips)."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_files import hf_weights, tiny_config, write_gguf

from kiln.llm import limits
from kiln.llm.checkpoint_open import open_checkpoint
from kiln.llm.errors import CheckpointError
from kiln.llm.gguf_file import GGUFFile


def _small(path: Path) -> bytes:
  """A small valid GGUF: two metadata fields (a string and an array of strings) and two F32 tensors."""
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_string("general.name", "tiny")
  w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
  w.add_tensor("a", np.arange(8, dtype=np.float32).reshape(2, 4))
  w.add_tensor("b", np.ones(4, np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return path.read_bytes()


def _open(path: Path, data: bytes) -> GGUFFile:
  path.write_bytes(data)
  return GGUFFile(path)


def test_valid_small(tmp_path: Path) -> None:
  f = _open(tmp_path / "x.gguf", _small(tmp_path / "x.gguf"))
  assert f.metadata["tokenizer.ggml.tokens"] == ["a", "bb", "ccc"] and f.tensors["a"].shape == (2, 4)
  np.testing.assert_array_equal(f.raw("a").view(np.float32), np.arange(8, dtype=np.float32).reshape(2, 4))


def test_every_truncation(tmp_path: Path) -> None:
  data = _small(tmp_path / "x.gguf")
  f = GGUFFile(tmp_path / "x.gguf")
  end = max(t.offset + t.nbytes for t in f.tensors.values())
  for n in range(end):  # every prefix of the file short of the last tensor's last byte
    with pytest.raises(CheckpointError, match=str(tmp_path / "t.gguf") if n >= 24 else "too short"):
      _open(tmp_path / "t.gguf", data[:n])


def _header(data: bytes, **fields: int) -> bytes:
  b = bytearray(data)
  for name, at, code in (("version", 4, "<I"), ("n_tensors", 8, "<Q"), ("n_kv", 16, "<Q")):
    if name in fields: struct.pack_into(code, b, at, fields[name])
  return bytes(b)


@pytest.mark.parametrize(("fields", "match"), [
  ({"n_tensors": 2 ** 62}, "over MAX_GGUF_TENSORS"), ({"n_kv": 2 ** 62}, "over MAX_GGUF_KV"),
  ({"n_tensors": 1000}, "past the end|dims|name"), ({"n_kv": 1000}, "past the end|type|key"),
  ({"version": 1}, "version 1 is not supported"), ({"version": 3 << 24}, "big-endian"),
])
def test_absurd_counts(tmp_path: Path, fields: dict[str, int], match: str) -> None:
  data = _small(tmp_path / "x.gguf")
  with pytest.raises(CheckpointError, match=match): _open(tmp_path / "t.gguf", _header(data, **fields))


def _patch_after(data: bytes, marker: bytes, skip: int, code: str, value: int) -> bytes:
  """data with the value after the first `marker` (and `skip` more bytes) replaced."""
  at = data.index(marker) + len(marker) + skip
  b = bytearray(data)
  struct.pack_into(code, b, at, value)
  return bytes(b)


def _nested(depth: int) -> bytes:
  """A GGUF with one metadata value: `depth` arrays each holding the next (the innermost an empty u32 array)."""
  out = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
  out += struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)
  return out


def test_hostile_fields(tmp_path: Path) -> None:
  data = _small(tmp_path / "x.gguf")
  p = tmp_path / "t.gguf"
  cases = [
    (_patch_after(data, b"general.name", 4, "<Q", 2 ** 40), "over the"),  # a string's length
    (_patch_after(data, b"tokenizer.ggml.tokens", 8, "<Q", 2 ** 40), "over MAX_GGUF_ARRAY_ITEMS"),  # an array's count
    (_nested(3), "nested over MAX_GGUF_ARRAY_DEPTH"),  # arrays of arrays of ...: a depth limit
    (_patch_after(data, b"general.name", 0, "<I", 77), "unknown value type 77"),
  ]
  info_a = data.rindex(b"\x01\x00\x00\x00\x00\x00\x00\x00a") + 9  # after tensor a's name (not the token): n_dims, 2 dims, type, offset
  b = bytearray(data); struct.pack_into("<I", b, info_a, 99); cases.append((bytes(b), "99 dims"))
  b = bytearray(data); struct.pack_into("<I", b, info_a + 20, 10); cases.append((bytes(b), "Q2_K, which kiln does not read"))
  b = bytearray(data); struct.pack_into("<I", b, info_a + 20, 8); cases.append((bytes(b), "rows of 4 values are not whole Q8_0 blocks"))
  b = bytearray(data); struct.pack_into("<Q", b, info_a + 24, 2 ** 50); cases.append((bytes(b), "past the end of the file"))
  b = bytearray(data); struct.pack_into("<Q", b, info_a + 24, 4); cases.append((bytes(b), "not a multiple of the alignment"))
  b = bytearray(data); struct.pack_into("<Q", b, info_a + 4, 0); cases.append((bytes(b), "zero"))
  b = bytearray(data); struct.pack_into("<Q", b, info_a + 4, 2 ** 62); cases.append((bytes(b), "past the end of the file"))
  info_b = data.rindex(b"\x01\x00\x00\x00\x00\x00\x00\x00b") + 9  # n_dims, 1 dim, type, offset
  b = bytearray(data); struct.pack_into("<Q", b, info_b + 16, 0); cases.append((bytes(b), "overlap"))  # b on top of a
  b = bytearray(data); b[:4] = b"GGUG"; cases.append((bytes(b), "not a GGUF file"))
  at = data.index(b"bb")
  b = bytearray(data); b[at:at + 2] = b"\xff\xfe"; cases.append((bytes(b), r"tokenizer.ggml.tokens'\[1\]: a string that is not UTF-8"))
  b = bytearray(data); struct.pack_into("<Q", b, at - 8, 2 ** 30); cases.append((bytes(b), r"tokens'\[1\]: a string of 1073741824 bytes is over"))
  for bad, match in cases:
    with pytest.raises(CheckpointError, match=match): _open(p, bad)
  assert len(_open(p, _nested(2)).metadata["k"][0]) == 0  # an array of one empty array: within the limit


def test_byte_flips(tmp_path: Path) -> None:
  """Random bytes of the header replaced: the file opens or is a CheckpointError, nothing else."""
  data = _small(tmp_path / "x.gguf")
  head = GGUFFile(tmp_path / "x.gguf").data_offset
  rng = np.random.default_rng(7)
  for _ in range(300):
    b = bytearray(data)
    for at in rng.integers(0, head, rng.integers(1, 4)): b[at] = int(rng.integers(0, 256))
    try: _open(tmp_path / "t.gguf", bytes(b))
    except CheckpointError: pass


def test_not_files(tmp_path: Path) -> None:
  with pytest.raises(CheckpointError, match="does not exist"): open_checkpoint(tmp_path / "nope.gguf")
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  with pytest.raises(CheckpointError, match="FIFO"): open_checkpoint(fifo)
  with pytest.raises(CheckpointError, match="config.json"): open_checkpoint(tmp_path)  # a folder without config.json


def test_bad_metadata_values(tmp_path: Path) -> None:
  """Well-formed files whose metadata is wrong for a model: typed errors naming the key."""
  cj = tiny_config("llama")
  write_gguf(tmp_path / "m.gguf", cj, hf_weights(cj), meta={"llama.attention.head_count": 3})
  with pytest.raises(CheckpointError, match="num_heads 3 is not a multiple"): open_checkpoint(tmp_path / "m.gguf")
  w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "llama")
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(CheckpointError, match="llama.embedding_length is missing"): open_checkpoint(tmp_path / "n.gguf")
  w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
  w.add_uint32("general.alignment", 24)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(CheckpointError, match="general.alignment 24"): GGUFFile(tmp_path / "a.gguf")


def test_limits_are_named() -> None:
  assert limits.MAX_GGUF_DIMS == 4 and limits.MAX_GGUF_ARRAY_ITEMS < 2 ** 22
