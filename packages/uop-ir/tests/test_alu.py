"""kiln.ir.alu: the C semantics and kiln's defined edges, checked case by case."""
import math
import struct

import numpy as np
import pytest

from kiln.ir import IRTypeError, Ops, UOp, dtypes
from kiln.ir.alu import bitcast, cast, exec_alu, from_storage, round_to, to_storage


def a(*v, dt=np.int32): return np.array(v, dtype=dt)


def test_idiv_mod_truncate_toward_zero():
  x, y = a(7, -7, 7, -7, 1, -1), a(2, 2, -2, -2, 3, 3)
  assert exec_alu(Ops.IDIV, dtypes.int32, x, y).tolist() == [3, -3, -3, 3, 0, 0]
  assert exec_alu(Ops.MOD, dtypes.int32, x, y).tolist() == [1, -1, 1, -1, 1, -1]


def test_defined_edges_of_division():
  mn = np.iinfo(np.int32).min
  assert exec_alu(Ops.IDIV, dtypes.int32, a(5, -5, 0), a(0, 0, 0)).tolist() == [5, -5, 0]  # x // 0 == x
  assert exec_alu(Ops.MOD, dtypes.int32, a(5, -5, 0), a(0, 0, 0)).tolist() == [0, 0, 0]  # x % 0 == 0
  assert exec_alu(Ops.IDIV, dtypes.int32, a(mn), a(-1)).tolist() == [mn]  # MIN // -1 wraps
  assert exec_alu(Ops.MOD, dtypes.int32, a(mn), a(-1)).tolist() == [0]
  assert exec_alu(Ops.IDIV, dtypes.uint8, a(200, 7, dt=np.uint8), a(0, 2, dt=np.uint8)).tolist() == [200, 3]


def test_wraparound_and_shifts():
  assert exec_alu(Ops.ADD, dtypes.int8, a(127, dt=np.int8), a(1, dt=np.int8)).tolist() == [-128]
  assert exec_alu(Ops.MUL, dtypes.uint16, a(300, dt=np.uint16), a(300, dt=np.uint16)).tolist() == [(300 * 300) % 65536]
  assert exec_alu(Ops.NEG, dtypes.int64, a(np.iinfo(np.int64).min, dt=np.int64)).tolist() == [np.iinfo(np.int64).min]
  assert exec_alu(Ops.SHL, dtypes.int32, a(1, 1, 1), a(31, 32, 33)).tolist() == [-2**31, 1, 2]  # amount modulo 32
  assert exec_alu(Ops.SHR, dtypes.int32, a(-8, -8), a(1, 33)).tolist() == [-4, -4]  # arithmetic for signed
  assert exec_alu(Ops.SHR, dtypes.uint8, a(0x80, dt=np.uint8), a(9, dt=np.uint8)).tolist() == [0x40]  # logical for unsigned, 9 % 8


def test_bool_ops_are_c_bool():
  t, f = np.array([True, True, False, False]), np.array([True, False, True, False])
  assert exec_alu(Ops.ADD, dtypes.bool, t, f).tolist() == [True, True, True, False]  # (bool)(1 + 1) is true
  assert exec_alu(Ops.SUB, dtypes.bool, t, f).tolist() == [False, True, True, False]
  assert exec_alu(Ops.MUL, dtypes.bool, t, f).tolist() == [True, False, False, False]
  assert exec_alu(Ops.MAX, dtypes.bool, t, f).tolist() == [True, True, True, False]


def test_float_max_is_ieee_maximum():
  x, y = a(math.nan, 1.0, -0.0, 0.0, -0.0, dt=np.float32), a(1.0, math.nan, 0.0, -0.0, -0.0, dt=np.float32)
  r = exec_alu(Ops.MAX, dtypes.float32, x, y)
  assert np.isnan(r[0]) and np.isnan(r[1])
  assert [bool(np.signbit(v)) for v in r[2:]] == [False, False, True]


def test_float_to_int_saturates_nan_to_zero():
  x = a(math.nan, math.inf, -math.inf, 1e10, -1e10, 2.9, -2.9, 127.5, -128.9, dt=np.float64)
  assert cast(x, dtypes.float64, dtypes.int8).tolist() == [0, 127, -128, 127, -128, 2, -2, 127, -128]
  assert cast(x, dtypes.float64, dtypes.uint8).tolist() == [0, 255, 0, 255, 0, 2, 0, 127, 0]
  big = a(2.0**63, 2.0**64, -2.0**63, dt=np.float64)
  assert cast(big, dtypes.float64, dtypes.int64).tolist() == [2**63 - 1, 2**63 - 1, -2**63]
  assert cast(big, dtypes.float64, dtypes.uint64).tolist() == [2**63, 2**64 - 1, 0]
  assert cast(a(math.nan, -0.0, 0.5, dt=np.float32), dtypes.float32, dtypes.bool).tolist() == [True, False, True]


def test_int_casts_wrap():
  assert cast(a(300, -1, 128), dtypes.int32, dtypes.int8).tolist() == [44, -1, -128]
  assert cast(a(-1), dtypes.int32, dtypes.uint32).tolist() == [2**32 - 1]
  assert cast(a(2**32 - 1, dt=np.uint32), dtypes.uint32, dtypes.int64).tolist() == [2**32 - 1]


def bf16(x: float) -> int: return struct.unpack("<I", struct.pack("<f", x))[0] >> 16


def test_bfloat16_rounding_is_single():
  # 1 + 2^-8 + 2^-30 is just above the tie between bf16 1.0 and 1.0078125; via float32 it would become the tie and round to 1.0
  x = 1 + 2**-8 + 2**-30
  assert to_storage(dtypes.bfloat16, cast(a(x, dt=np.float64), dtypes.float64, dtypes.bfloat16)).tolist() == [bf16(1.0078125)]
  assert cast(a(1 + 2**-8, dt=np.float64), dtypes.float64, dtypes.bfloat16).tolist() == [1.0]  # a true tie: to even
  v = 2**40 + 2**32 + 1  # int64 just above a bf16 tie; float32 alone would round it onto the tie
  assert cast(a(v, dt=np.int64), dtypes.int64, dtypes.bfloat16).tolist() == [float(2**40 + 2**33)]
  assert cast(a(2**24 + 2**16 + 1, dt=np.int32), dtypes.int32, dtypes.bfloat16).tolist() == [float(2**24 + 2**17)]
  r = round_to(dtypes.bfloat16, a(3.0e38, math.nan, -math.inf, dt=np.float32))
  assert np.isfinite(r[0]) and abs(r[0] - 3.0e38) <= 3.0e38 * 2**-8
  assert np.isnan(r[1]) and r[2] == -np.inf
  assert from_storage(dtypes.bfloat16, a(0x3F80, 0x7F80, dt=np.uint16)).tolist() == [1.0, math.inf]
  assert exec_alu(Ops.ADD, dtypes.bfloat16, a(256.0, dt=np.float32), a(1.0, dt=np.float32)).tolist() == [256.0]


def test_half_arithmetic_rounds_once():
  h = np.float16
  assert exec_alu(Ops.ADD, dtypes.float16, a(2048, dt=h), a(1, dt=h)).tolist() == [2048.0]
  assert exec_alu(Ops.MUL, dtypes.float16, a(300, dt=h), a(300, dt=h)).tolist() == [math.inf]
  # MULACC is unfused: (1+2^-10)^2 rounds to 1+2^-9 before the add, so the 2^-20 a fused add would keep is gone
  x = 1 + 2**-10
  assert exec_alu(Ops.MULACC, dtypes.float16, a(x, dt=h), a(x, dt=h), a(-(1 + 2**-9), dt=h)).tolist() == [0.0]


def test_bitcast():
  assert bitcast(a(1.0, -0.0, dt=np.float32), dtypes.float32, dtypes.uint32).tolist() == [0x3F800000, 0x80000000]
  assert bitcast(a(0x3F80, dt=np.uint16), dtypes.uint16, dtypes.bfloat16).tolist() == [1.0]
  assert bitcast(a(0, 1, 2, dt=np.uint8), dtypes.uint8, dtypes.bool).tolist() == [False, True, True]
  with pytest.raises(IRTypeError, match="equal sizes"): bitcast(a(1), dtypes.int32, dtypes.int16)


def test_folding_uses_the_same_semantics():
  assert (UOp.const(dtypes.int32, -7) // 2).arg == -3
  assert (UOp.const(dtypes.int32, -7) % 2).arg == -1
  assert (UOp.const(dtypes.int8, 127) + 1).arg == -128
  assert UOp.const(dtypes.float32, math.nan).cast(dtypes.int32).arg == 0
  assert (UOp.const(dtypes.bool, True) + UOp.const(dtypes.bool, True)).arg is True
  assert UOp.const(dtypes.float64, 1 + 2**-8 + 2**-30).cast(dtypes.bfloat16).arg == 1.0078125



def _dot4_brute(x: int, y: int, c: int) -> int:
  """DOT4 by its definition, a byte at a time in Python integers, wrapped to int32."""
  xb, yb = (x & 0xFFFFFFFF).to_bytes(4, "little"), (y & 0xFFFFFFFF).to_bytes(4, "little")
  s = c + sum(u * (v - 256 if v >= 128 else v) for u, v in zip(xb, yb))
  return (s + 2**31) % 2**32 - 2**31


def test_dot4_is_unsigned_bytes_times_signed_bytes_wrapping():
  i32 = lambda v: np.array(v, np.int64).astype(np.int32)
  edge = [0, 1, -1, 0x7F7F7F7F, -0x7F7F7F80, 0x01FF80FE, -(2**31), 2**31 - 1, 0x00FF00FF, -0x00FF0100]
  rand = np.random.default_rng(1).integers(-(2**31), 2**31, 300).tolist()
  xs = [e for e in edge for _ in edge] + rand
  ys = edge * len(edge) + rand[::-1]
  cs = [2**31 - 1 if i % 3 == 0 else rand[i % len(rand)] for i in range(len(xs))]  # sums past int32 wrap
  got = exec_alu(Ops.DOT4, dtypes.int32, i32(xs), i32(ys), i32(cs))
  assert got.dtype == np.int32
  assert got.tolist() == [_dot4_brute(x, y, c) for x, y, c in zip(xs, ys, cs)]
  # bytes 0xFF: 255 unsigned, -1 signed; 0x80: 128 unsigned, -128 signed
  assert exec_alu(Ops.DOT4, dtypes.int32, a(-1), a(-1), a(0)).tolist() == [-1020]
  assert exec_alu(Ops.DOT4, dtypes.int32, a(0x80), a(0x80), a(0)).tolist() == [-16384]


def test_dot4_takes_int32_words_only():
  for dt in (dtypes.int64, dtypes.uint32, dtypes.float32):
    with pytest.raises(IRTypeError, match="DOT4"):
      UOp.const(dt, 1).alu(Ops.DOT4, UOp.const(dt, 1), UOp.const(dt, 1))
