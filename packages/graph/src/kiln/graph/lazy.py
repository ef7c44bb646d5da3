"""The recorded graph: `Node`s, each one op over source nodes with a shape and dtype, and the errors of this layer.

A shape's dims are kiln.ir's Dim: ints, or symbolic dims (runtime variables with compile-time bounds, see dims.py).

A node is one of a few kinds (the scheduler renders each as UOps, see kernelize.py):

| op      | srcs              | arg                                   | meaning                                                     |
|---------|-------------------|---------------------------------------|-------------------------------------------------------------|
| BUFFER  | -                 | `Source` (numpy data or an input name) | data that lives in a plan buffer                            |
| CONST   | -                 | Python number, or a symbolic dim (UOp) | a scalar of shape (), broadcast by VIEW expand              |
| IOTA    | -                 | -                                      | 0, 1, ..., n-1 along its one axis (n may be symbolic)       |
| ALU     | 1-3 of one shape  | `Ops` (CAST: the target in dtype)      | elementwise                                                 |
| REDUCE  | 1                 | (Ops.ADD/MUL/MAX, axes)                | reduced axes kept as size 1 (keepdims)                       |
| VIEW    | 1                 | (kind, params)                         | movement as index arithmetic: reshape, permute, expand, shrink, pad |
| GATHER  | table, indices    | (axis, label)                          | table[..., indices, ...]: data-dependent index (index_check.py) |
| CAT     | 1+                | axis                                   | pieces side by side along axis                               |
| WRITE   | target, value     | the first row written (a Dim)          | value stored into a bound input's rows (Tensor.write_rows)   |

Any node may carry `realize=True` (Tensor.contiguous): the scheduler gives it a buffer of its own whatever its consumers.
conv2d marks its padded input (so its matmul reads plain loads, not a bounds test per element) and its product (so the
product's kernel loops over the matmul's own axes, not the NCHW view its consumers read).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.graph.errors import GraphError, IndexOutOfRangeError, ONNXError  # noqa: F401  (where the layer's errors were first defined)
from kiln.graph.provenance import Origin, current
from kiln.ir.dtype import DType
from kiln.ir.kernels import Dim

_ids = itertools.count()


@dataclass(eq=False)
class Source:
  """Where a BUFFER node's data comes from: a numpy array (a constant or weight) or a named input fed at run time."""
  data: np.ndarray | None = None
  name: str | None = None


@dataclass(eq=False)
class Node:
  op: str
  src: tuple[Node, ...]
  arg: Any
  shape: tuple[Dim, ...]
  dtype: DType
  realize: bool = False  # always gets its own buffer and kernel (the fusion rules never inline it)
  id: int = field(default_factory=lambda: next(_ids))
  origin: Origin | None = field(default_factory=current)  # the ONNX node whose conversion made it (provenance.py)

  def __hash__(self) -> int: return self.id
  def __repr__(self) -> str: return f"Node({self.op} {self.arg if self.op != 'BUFFER' else ''} {self.shape} {self.dtype.name} #{self.id})"

  @property
  def data(self) -> np.ndarray | None:
    """The array a constant BUFFER holds (a weight), else None (an input, or anything computed)."""
    return self.arg.data if self.op == "BUFFER" else None

  @property
  def numel(self) -> int: return prod(self.shape)  # static shapes only (a GraphError names a symbolic dim)

  @property
  def max_numel(self) -> int:
    """Elements at the symbolic dims' upper bounds: the size of the node's buffer."""
    from kiln.graph.dims import max_numel
    return max_numel(self.shape)

  def toposort(self, stop: set[Node] | None = None) -> list[Node]:
    return toposort([self], stop)


def prod(xs: Any) -> int:
  out = 1
  for x in xs:
    if not isinstance(x, int | np.integer): raise GraphError(f"a static size was needed, got the symbolic dim {x!r}")
    out *= int(x)
  return out


def consumers(nodes: Sequence[Node]) -> dict[Node, list[Node]]:
  """Each node's readers among nodes, each once, in nodes' order (the scheduler's epilogue lift and epilogue.py's moves)."""
  out: dict[Node, list[Node]] = {n: [] for n in nodes}
  for n in nodes:
    for s in dict.fromkeys(n.src): out.setdefault(s, []).append(n)
  return out


def toposort(roots: list[Node], stop: set[Node] | None = None) -> list[Node]:
  """Every node reachable from roots, sources first; nodes in stop are listed but not entered. Not recursive."""
  out: list[Node] = []
  seen: set[Node] = set()
  stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
  while stack:
    n, done = stack.pop()
    if done:
      out.append(n)
      continue
    if n in seen: continue
    seen.add(n)
    stack.append((n, True))
    if stop is None or n not in stop:
      for s in reversed(n.src):
        if s not in seen: stack.append((s, False))
  return out
