"""The JSON graph form: round trips keep `key` (and identity); malformed input raises SerializeError."""
import json
import math
import struct

import pytest

from kiln.ir import AxisType, Ops, SerializeError, UOp, dtypes
from kiln.ir import kernels as K
from kiln.ir.serialize import UOpGraph, from_json, to_graph, to_json


def roundtrip(u: UOp) -> UOp:
  v = from_json(to_json(u))
  assert v.key == u.key and v is u
  return v


def test_roundtrip_kernels():
  for k in (K.matmul(4, 5, 6), K.softmax((UOp.variable("n", 1, 8), 3), dtypes.float32),
            K.elementwise(lambda x: x.bitcast(dtypes.int16), dtypes.int16, ((3,), dtypes.bfloat16))):
    roundtrip(k)


def test_roundtrip_special_constants():
  for dt, v in [(dtypes.float32, math.nan), (dtypes.float32, -0.0), (dtypes.float64, math.inf), (dtypes.float64, -math.inf),
                (dtypes.float64, 5e-324), (dtypes.uint64, 2**64 - 1), (dtypes.int64, -2**63), (dtypes.bool, True)]:
    roundtrip(UOp.const(dt, v))
  assert from_json(to_json(UOp.const(dtypes.float32, -0.0))) is not UOp.const(dtypes.float32, 0.0)
  roundtrip(UOp.range(UOp.variable("n", 1, 9).bind(3), 2, AxisType.REDUCE))
  roundtrip(UOp.sink(name=None))


def _bits(x: float) -> int: return struct.unpack("<Q", struct.pack("<d", x))[0]


@pytest.mark.parametrize("bits", [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000020000000, 0xFFFC000000000000])
def test_nan_constants_keep_their_bits(bits):
  """x86's arithmetic NaN is negative (0*inf folds to 0xFFF8...): the JSON form keeps sign and payload, so a fuzz find
  written by the shrinker replays as it failed (fuzz-66c69a0ab5c3)."""
  v = struct.unpack("<d", struct.pack("<Q", bits))[0]
  back = from_json(to_json(UOp.const(dtypes.float64, v)))
  assert _bits(back.arg) == bits


@pytest.mark.parametrize("text", ["nan:", "nan:7ff0000000000000", "nan:3ff0000000000000", "nan:zz", "nan:1fff8000000000000", "nanx"])
def test_malformed_nan_text_is_a_serialize_error(text):
  doc = to_json(UOp.const(dtypes.float32, 1.0)).replace(float.hex(1.0), text)
  with pytest.raises(SerializeError): from_json(doc)


def test_roundtrip_deep_chain():
  v = UOp.variable("x", 0, 10)
  for _ in range(20_000): v = v + 1 if v.op is not Ops.ADD else v * 3
  roundtrip(v)


def test_graph_is_flat_and_pydantic():
  g = to_graph(K.matmul(2, 2, 2))
  assert isinstance(g, UOpGraph) and g.nodes[-1].op == "SINK"
  assert all(s < i for i, n in enumerate(g.nodes) for s in n.src)


def mk(*nodes) -> str: return json.dumps({"nodes": list(nodes)})


@pytest.mark.parametrize("bad", [
  "", "[1", "{}", '{"nodes": []}', '{"nodes": [{"op": "CONST"}]}',
  mk({"op": "NOPE", "dtype": "float32"}),
  mk({"op": "CONST", "dtype": "float99", "arg": 1}),
  mk({"op": "CONST", "dtype": "float32", "arg": {"float": "zz"}}),
  mk({"op": "CONST", "dtype": "float32", "arg": {"float": 5}}),
  mk({"op": "CONST", "dtype": "float32", "arg": 1}),
  mk({"op": "CONST", "dtype": "float32", "arg": 1.5}),
  mk({"op": "CONST", "dtype": "int8", "arg": 300}),
  mk({"op": "CONST", "dtype": "float32*4", "arg": 1}),
  mk({"op": "RANGE", "dtype": "int32", "arg": {"tuple": 5}}),
  mk({"op": "RANGE", "dtype": "int32", "arg": {"axis": "NOPE"}}),
  mk({"op": "REDUCE", "dtype": "int32", "arg": {"op": "NOPE"}}),
  mk({"op": "SINK", "dtype": "void", "arg": [1, 2]}),
  mk({"op": "SINK", "dtype": "void", "arg": {"float": "0x1p0", "op": "ADD"}}),
  mk({"op": "ADD", "dtype": "float32", "src": [0]}),
  mk({"op": "CONST", "dtype": "int32", "arg": 1}, {"op": "ADD", "dtype": "int32", "src": [0, 2]}),
  mk({"op": "CONST", "dtype": "int32", "arg": 1, "extra": 1}),
])
def test_malformed_raises_serialize_error(bad):
  with pytest.raises(SerializeError): from_json(bad)


def test_serialize_error_names_the_node():
  with pytest.raises(SerializeError, match=r"node 1 \(ADD\)"):
    from_json(mk({"op": "CONST", "dtype": "int32", "arg": 1}, {"op": "ADD", "dtype": "int32", "src": [0, 5]}))
