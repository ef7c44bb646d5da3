"""kiln.ir.npy.read_header: the one .npy header reader (the DISK device's and kiln.graph's load_npy)."""
import io
import struct

import numpy as np
import numpy.lib.format as npformat
import pytest

from kiln.ir.npy import MAX_HEADER, read_header


def _npy(a: np.ndarray, version: tuple[int, int]) -> io.BytesIO:
  f = io.BytesIO()
  npformat.write_array(f, a, version=version)
  f.seek(0)
  return f


def _v3(header: bytes) -> io.BytesIO:
  return io.BytesIO(npformat.magic(3, 0) + struct.pack("<I", len(header)) + header + b"\0" * 8)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_reads_every_format_and_stops_at_the_data(version):
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  f = _npy(a, version)
  assert read_header(f) == ((2, 3), False, np.dtype(np.float32))
  assert np.array_equal(np.frombuffer(f.read(), np.float32).reshape(2, 3), a)


def test_refuses_what_is_not_a_small_well_formed_header():
  with pytest.raises(ValueError, match="over the 65536 byte limit"): read_header(_v3(b" " * (MAX_HEADER + 1)))
  with pytest.raises(ValueError, match="bad header"): read_header(_v3(repr({"descr": "<f4", "fortran_order": False, "shape": (2,), "x": 1}).encode()))
  with pytest.raises(ValueError): read_header(_v3(b"{'descr': "))  # not a literal
  with pytest.raises(ValueError, match="unknown .npy format version 4.0"): read_header(io.BytesIO(npformat.magic(4, 0) + b"\0" * 16))
  with pytest.raises(ValueError): read_header(io.BytesIO(b"PK\x03\x04 not an npy file"))
  big = io.BytesIO(npformat.magic(2, 0) + struct.pack("<I", MAX_HEADER + 16) + b" " * (MAX_HEADER + 16))
  with pytest.raises(ValueError, match="Header info length"): read_header(big)  # numpy's 2.0 reader, held to the same limit
