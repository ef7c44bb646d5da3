"""The .npy header, read here for every layer that maps a .npy file (the CPU runtime's DISK device, kiln.graph's load_npy).

Formats 1.0, 2.0 and 3.0 (2.0 with a utf-8 header, which numpy has no public reader for). The header is a Python literal
that is parsed, so one over MAX_HEADER bytes is refused; a 3.0 header must hold exactly descr, fortran_order and shape.
What the caller checks beyond the header (the dtype, the shape, the file's length) is the caller's.
"""
from __future__ import annotations

import ast
import struct
from typing import BinaryIO

import numpy as np
import numpy.lib.format as npformat

MAX_HEADER = 1 << 16


def read_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
  """(shape, fortran_order, numpy dtype) of the .npy file f is at the start of, f left at its data. A malformed header is
  a ValueError saying what is wrong (an OSError from reading f is the caller's)."""
  try:
    version = npformat.read_magic(f)
    if version == (1, 0): return npformat.read_array_header_1_0(f, max_header_size=MAX_HEADER)
    if version == (2, 0): return npformat.read_array_header_2_0(f, max_header_size=MAX_HEADER)
    if version != (3, 0): raise ValueError(f"unknown .npy format version {version[0]}.{version[1]}")
    (hlen,) = struct.unpack("<I", f.read(4))
    if hlen > MAX_HEADER: raise ValueError(f"header of {hlen} bytes is over the {MAX_HEADER} byte limit")
    d = ast.literal_eval(f.read(hlen).decode("utf-8"))
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"} or not isinstance(d["shape"], tuple):
      raise ValueError(f"bad header {d!r}")
    return d["shape"], bool(d["fortran_order"]), npformat.descr_to_dtype(d["descr"])
  except (SyntaxError, KeyError, TypeError, struct.error, UnicodeDecodeError, MemoryError, RecursionError) as e:
    raise ValueError(str(e) or type(e).__name__) from None
