"""kiln.codegen.choose's entries: choose_opts (a given list, else the heuristic's), reassociated_for (kiln.graph's question, asked
with a device) and registry.target_of, the machine model a layer above gets for a device."""
from __future__ import annotations

import pytest

from kiln.codegen import registry
from kiln.codegen.choose import Opt, OptOps, Target, choose_opts, heuristic_opts, reassociated_for
from kiln.codegen.lowering.prepare import prepare
from kiln.codegen.registry import register_runtime, target_of, unregister_runtime
from kiln.ir import Ops, dtypes, kernels
from kiln.ir.errors import DeviceError

CPU = Target(vector_bytes=64, threads=2, cores=2)
GPU = Target(device="CUDA", vector_bytes=0, threads=1)


class _Renderer:
  def __init__(self, target: object): self.target = target


class _Runtime:
  """A runtime whose renderer chooses options for `made`'s target (None: no renderer at all, as DISK)."""
  made: object = None

  def __init__(self, spec: object):
    if _Runtime.made is not None: self.renderer = _Renderer(_Runtime.made)


@pytest.fixture
def device(monkeypatch):
  monkeypatch.setattr(registry, "_entry_point_factories", lambda: {})

  def use(target: object) -> str:
    _Runtime.made = target
    register_runtime("CUDA", _Runtime)  # a name DeviceSpec parses; registering again drops the cached instance
    return "CUDA:0"
  yield use
  unregister_runtime("CUDA")


def test_target_of_reads_the_renderers_machine_model(device) -> None:
  assert target_of(device(CPU)) is CPU
  assert target_of(device(None)) is None  # renders nothing
  assert target_of(device(lambda: CPU)) is None  # not a Target (CUDARuntime.target is a method)
  unregister_runtime("CUDA")
  with pytest.raises(DeviceError): target_of("CUDA:0")


def test_choose_opts_takes_a_given_list_else_the_heuristics() -> None:
  ast = prepare(kernels.matmul(64, 64, 64))[0]
  assert choose_opts(ast, CPU) == heuristic_opts(ast, CPU) != []
  assert choose_opts(ast, CPU, []) == []  # an empty list is a choice: no options
  given = [Opt(OptOps.UPCAST, 1, 8)]
  assert choose_opts(ast, CPU, given) == given and choose_opts(ast, CPU, given) is not given


def test_reassociated_for_asks_the_devices_target(device) -> None:
  rows, cols = kernels.reduce(Ops.ADD, (256, 64), dtypes.float32, axes=1), kernels.reduce(Ops.ADD, (64, 256), dtypes.float32, axes=0)
  got = reassociated_for(rows, device(CPU))
  assert got is not None and got == heuristic_opts(prepare(rows)[0], CPU, reassociate=True)
  assert reassociated_for(cols, device(CPU)) is None  # contiguous along its output: the same either way
  assert reassociated_for(kernels.matmul(64, 64, 64), device(CPU)) is None
  assert reassociated_for(rows, device(GPU)) is None and reassociated_for(rows, device(None)) is None


def _scores(keys: object) -> object:
  """Attention scores of one query per head over `keys` cached keys: out[h, j] = sum_d q[h, d] k[j, d], 64 values a row."""
  from kiln.ir import UOp
  from kiln.ir.ops import AxisType
  f32 = dtypes.float32
  o, q, k = UOp.define_global(0, f32.ptr(8 * 512)), UOp.define_global(1, f32.ptr(8 * 64)), UOp.define_global(2, f32.ptr(512 * 64))
  h, j, d = UOp.range(8, 0), UOp.range(keys, 1), UOp.range(64, 2, AxisType.REDUCE)
  s = (q.index(h * 64 + d).load() * k.index(j * 64 + d).load()).reduce(Ops.ADD, d)
  return UOp.sink(o.index(h * 512 + j).store(s), name="scores")


def test_symbolic_columns_vectorise_their_dot_products_along_the_reduce(device) -> None:
  """A decode step's attention scores have a symbolic column axis (the cached keys), on which no vector runs: as a caller
  that takes sums in another order, kiln.graph gets whole-row vectors on the reduce axis (a dot product was a scalar
  chain of multiply-adds). The same product over a fixed number of keys keeps its register tile."""
  from kiln.ir import UOp
  got = reassociated_for(_scores(UOp.variable("past", 0, 512)), device(CPU))
  assert got is not None and [(o.op, o.amount) for o in got if o.op is OptOps.UPCAST] == [(OptOps.UPCAST, 64)]
  assert reassociated_for(_scores(512), device(CPU)) is None


def test_a_product_with_symbolic_columns_takes_its_lanes_on_another_axis() -> None:
  """x @ W per head written transposed, (h, d, j) with the tokens j symbolic (a dynamic export's keys, laid out for the
  scores): no register tile runs on a symbolic axis, so the lanes go to d, along which W is read contiguously and x is
  the same for every lane (by default too: no sum changes order). They were one scalar loop per output. Over a fixed
  number of tokens it stays a register-tiled product."""
  from kiln.ir import UOp
  from kiln.ir.ops import AxisType
  f32 = dtypes.float32
  def product(n: object) -> UOp:
    o, x, w = UOp.define_global(0, f32.ptr(4 * 16 * 64)), UOp.define_global(1, f32.ptr(64 * 64)), UOp.define_global(2, f32.ptr(64 * 64))
    h, d, j, k = UOp.range(4, 0), UOp.range(16, 1), UOp.range(n, 2), UOp.range(64, 3, AxisType.REDUCE)
    s = (x.index(j * 64 + k).load() * w.index(k * 64 + h * 16 + d).load()).reduce(Ops.ADD, k)
    return UOp.sink(o.index((h * 16 + d) * n + j).store(s), name="kt")
  sym = heuristic_opts(prepare(product(UOp.variable("seq", 1, 64)))[0], CPU)
  assert [(o.op, o.amount) for o in sym if o.op in (OptOps.UPCAST, OptOps.UNROLL)] == [(OptOps.UPCAST, 16)], sym
  assert any(o.op is OptOps.OUTER for o in heuristic_opts(prepare(product(64))[0], CPU))  # the register tile
