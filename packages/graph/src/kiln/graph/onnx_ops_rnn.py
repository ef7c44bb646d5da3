"""The ONNX recurrent operators (LSTM, GRU, RNN), unrolled over a sequence of fixed length into kiln.graph Tensor ops and
registered in onnx_ops.OPS (onnx.py imports this module for that).

The input projection X @ W^T (+ the biases that sit outside the recurrence) is one matmul over every time step, before
the loop; each step then does only H_{t-1} @ R^T and the gate maths. The directions of a bidirectional node run side by
side as a leading axis of size 2 (the reverse one reads the projection backwards), so one batched matmul per step serves
both. Each step's state is realized (Tensor.contiguous): the next step's matmul reads it whole, and an inlined state would
recompute every earlier step. The sequence length must be fixed (a symbolic one is refused, naming the node); the batch may
be symbolic. sequence_lens is accepted only as a constant equal to the full length for every batch entry: kiln has no
data-dependent loop counts."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.graph.onnx_ops import OnnxNode, _op
from kiln.graph.onnx_ops_act import _hard_sigmoid, _softplus
from kiln.graph.onnx_ops_shape import _static
from kiln.graph.tensor import Tensor
from kiln.ir.kernels import Dim

# ---- the activation functions: name (matched without case, as onnxruntime does) -> (f(x, alpha, beta), how many
# alphas and betas it consumes from activation_alpha/activation_beta, their defaults). The spec's defaults are those of
# the ONNX operator of that name; where onnxruntime uses 0 instead (ThresholdedRelu) or no operator is left to say
# (Affine, ScaledTanh), the default is None: the value must be given, so kiln never silently differs from either.
_Fn = Callable[[Tensor, float, float], Tensor]
_ACTS: dict[str, tuple[str, _Fn, int, int, float | None, float | None]] = {
  "relu": ("Relu", lambda x, a, b: x.relu(), 0, 0, 0.0, 0.0),
  "tanh": ("Tanh", lambda x, a, b: x.tanh(), 0, 0, 0.0, 0.0),
  "sigmoid": ("Sigmoid", lambda x, a, b: x.sigmoid(), 0, 0, 0.0, 0.0),
  "affine": ("Affine", lambda x, a, b: x * a + b, 1, 1, None, None),
  "leakyrelu": ("LeakyRelu", lambda x, a, b: (x < 0).where(x * a, x), 1, 0, 0.01, 0.0),
  "thresholdedrelu": ("ThresholdedRelu", lambda x, a, b: (x > a).where(x, 0.0), 1, 0, None, 0.0),
  "scaledtanh": ("ScaledTanh", lambda x, a, b: (x * b).tanh() * a, 1, 1, None, None),
  "hardsigmoid": ("HardSigmoid", _hard_sigmoid, 1, 1, 0.2, 0.5),
  "elu": ("Elu", lambda x, a, b: (x < 0).where((x.exp() - 1.0) * a, x), 1, 0, 1.0, 0.0),
  "softsign": ("Softsign", lambda x, a, b: x / (x.abs() + 1.0), 0, 0, 0.0, 0.0),
  "softplus": ("Softplus", lambda x, a, b: _softplus(x), 0, 0, 0.0, 0.0),  # the Softplus operator's own (no overflow, tail kept)
}
Act = tuple[str, float, float]  # (key of _ACTS, alpha, beta): comparable, so equal directions apply one function


def _activations(n: OnnxNode, defaults: list[str], dirs: int) -> list[list[Act]]:
  """The node's activation functions per direction (all of them named, as the spec and onnxruntime want), each with its
  alpha and beta: activation_alpha/beta are consumed in order by the functions that take them (the spec's rule)."""
  names = n.strs("activations") or defaults * dirs
  if len(names) != len(defaults) * dirs:
    raise n.error(f"attribute activations has {len(names)} names, {n.op} takes {len(defaults)} per direction ({len(defaults) * dirs} here)")
  alphas, betas = [float(a) for a in n.attr("activation_alpha") or []], [float(b) for b in n.attr("activation_beta") or []]
  out: list[Act] = []
  for name in names:
    key = name.lower()
    if key not in _ACTS:
      raise n.error(f"activation {name!r} is not supported ({', '.join(v[0] for v in _ACTS.values())})")
    _, _, na, nb, da, db = _ACTS[key]
    a = alphas.pop(0) if na and alphas else da
    b = betas.pop(0) if nb and betas else db
    if a is None or b is None:
      raise n.error(f"activation {name!r} needs its {'alpha' if a is None else 'beta'} in activation_{'alpha' if a is None else 'beta'}: "
                    "the spec's default and onnxruntime's (0) differ, or there is none")
    out.append((key, a, b))
  k = len(defaults)
  return [out[d * k:(d + 1) * k] for d in range(dirs)]


def _act(fs: list[Act], x: Tensor) -> Tensor:
  """Apply each direction's function to its slice of x (directions on axis 0); one application when they agree."""
  if all(f == fs[0] for f in fs):
    key, a, b = fs[0]
    return _ACTS[key][1](x, a, b)
  return Tensor.cat([_ACTS[k][1](x[d:d + 1], a, b) for d, (k, a, b) in enumerate(fs)], 0)


def _clip(x: Tensor, c: float | None) -> Tensor:
  return x if c is None else x.maximum(-c).minimum(c)


# ---- what every recurrent op shares: shapes, directions, the input projection, the outputs ----
@dataclass
class _Seq:
  x: Tensor  # time-major (T, batch, input)
  steps: int  # T
  hidden: int
  rev: list[bool]  # per direction: does it step backwards?
  layout: int
  clip: float | None

  @property
  def dirs(self) -> int: return len(self.rev)


def _setup(n: OnnxNode, gates: int) -> _Seq:
  direction = n.attr("direction", "forward")
  if direction not in ("forward", "reverse", "bidirectional"):
    raise n.error(f"attribute direction={direction!r} is not supported (forward, reverse, bidirectional)")
  rev = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
  layout = int(n.attr("layout", 0))
  if layout not in (0, 1): raise n.error(f"attribute layout={layout} is not supported (0, 1)")
  x = n.t(0)
  if x.ndim != 3 or not x.dtype.is_float: raise n.error(f"input X {x.shape} {x.dtype.name} must be a float tensor of rank 3")
  x = x.permute(1, 0, 2) if layout else x  # layout 1 is batch-major: made time-major, the steps walk axis 0
  (steps,) = _static(n, x, [0], "the sequence length (the recurrence is unrolled step by step)")
  if steps < 1: raise n.error(f"input X {x.shape} has an empty sequence (not supported)")
  n.budget.unroll(f"node {n.name} ({n.op})", steps * len(rev))  # before a step is built: each is a few kernels
  w, r = n.t(1), n.t(2)
  hidden = r.shape[-1]
  if not isinstance(hidden, int) or r.shape != (len(rev), gates * hidden, hidden) or w.shape != (len(rev), gates * hidden, x.shape[2]):
    raise n.error(f"W {w.shape} and R {r.shape} do not fit {len(rev)} direction(s) of {gates} gates over input {x.shape[2]}")
  if n.attr("hidden_size", hidden) != hidden: raise n.error(f"attribute hidden_size={n.attr('hidden_size')} differs from R's {hidden}")
  clip = n.attr("clip")
  if clip is not None and not (math.isfinite(clip) and clip > 0): raise n.error(f"attribute clip={clip} must be a positive number")
  _check_lengths(n, steps, x.shape[1])
  return _Seq(x, steps, hidden, rev, layout, None if clip is None else float(clip))


def _check_lengths(n: OnnxNode, steps: int, batch: Dim) -> None:
  """sequence_lens (input 4) may only say what kiln does anyway: every batch entry runs all the steps."""
  v = n.ins[4] if len(n.ins) > 4 else None
  if v is None: return
  name = n.proto.input[4]
  if isinstance(v, Tensor):
    raise n.error(f"input 4 sequence_lens ({name!r}) is computed at run time: kiln unrolls a fixed {steps} steps for every batch "
                  "entry and has no data-dependent lengths (give it as a constant of the full length, or leave it out)")
  if v.ndim != 1 or np.any(v != steps) or (isinstance(batch, int) and v.size != batch):
    raise n.error(f"input 4 sequence_lens ({name!r}) = {v.tolist()} is not the full length {steps} for each of the batch's "
                  "entries: kiln has no data-dependent lengths")


def _opt(n: OnnxNode, i: int) -> Tensor | None:
  return n.t(i) if i < len(n.ins) and n.ins[i] is not None else None


def _initial(n: OnnxNode, i: int, s: _Seq) -> Tensor | None:
  """initial_h / initial_c as (directions, batch, hidden); None where omitted or all zeros (step 0 then skips its
  matmul: torch exports zeros, and a broadcast constant would otherwise feed a reduction as a kernel of its own)."""
  shape = (s.dirs, s.x.shape[1], s.hidden)
  v = _opt(n, i)
  if v is None or _zero(v): return None
  v = v.permute(1, 0, 2) if s.layout and v.ndim == 3 else v
  if v.shape != shape: raise n.error(f"input {i} ({n.proto.input[i]!r}) has shape {v.shape}, expected {shape} (layout {s.layout} aside)")
  return v.contiguous()  # a buffer the first step's matmul reads plainly


def _zero(v: Tensor) -> bool:
  """Is v a constant zero (a zero CONST or constant buffer, seen through reshapes, expands, permutes and slices)?"""
  node = v.node
  while node.op == "VIEW" and node.arg[0] != "pad": node = node.src[0]
  if node.op == "CONST": return isinstance(node.arg, int | float) and node.arg == 0
  return node.data is not None and not np.any(node.data)


def _project(n: OnnxNode, s: _Seq, bias: Tensor | None) -> Tensor:
  """X @ W^T (+ bias) for every step at once, (directions, T, batch, gates*hidden) in step order (a reverse direction's
  time reversed): one matmul, realized. Step t reads p[:, t], the same place for every direction, so the steps' kernels
  read one window each (windows.py) and are one kernel to the kernel cache."""
  wt = _transposed(n.t(1)).unsqueeze(1)  # (D, 1, input, G*H)
  xs = [s.x[::-1] if r else s.x for r in s.rev]
  p = (xs[0].unsqueeze(0) if len(xs) == 1 else Tensor.stack(xs, 0)) @ wt
  if bias is not None: p = p + bias.reshape(s.dirs, 1, 1, -1)
  return p.contiguous()


def _bias(n: OnnxNode, s: _Seq, gates: int) -> tuple[Tensor, Tensor] | None:
  """B split into its input-side (Wb) and recurrent-side (Rb) halves, each (directions, gates*hidden)."""
  b = _opt(n, 3)
  if b is None: return None
  gh = gates * s.hidden
  if b.shape != (s.dirs, 2 * gh): raise n.error(f"input B has shape {b.shape}, expected {(s.dirs, 2 * gh)}")
  return b[:, :gh], b[:, gh:]


def _step_input(p: Tensor, t: int) -> Tensor:
  """Step t's projection, (directions, batch, G*H) (the projection is in step order: _project)."""
  return p[:, t]


def _outputs(s: _Seq, hs: list[Tensor], finals: list[Tensor]) -> list[Tensor]:
  """Y (T, D, batch, H) in time order per direction (layout 1: (batch, T, D, H)), then the final states (D, batch, H)
  (layout 1: (batch, D, H))."""
  ys = _stack_tree(hs)  # step order
  if any(s.rev):  # (realized first: the reversal's two pieces would each repeat the stack's selects)
    ys = ys.contiguous()
    ys = Tensor.cat([ys[::-1, d:d + 1] if r else ys[:, d:d + 1] for d, r in enumerate(s.rev)], 1)
  if s.layout: return [ys.permute(2, 0, 1, 3)] + [f.permute(1, 0, 2) for f in finals]
  return [ys] + finals


STACK_GROUP = 16  # states per stacking kernel (a concatenation evaluates one select per piece for every element)


def _stack_tree(hs: list[Tensor]) -> Tensor:
  """Tensor.stack(hs, 0) as a tree of stacks of at most STACK_GROUP pieces, each level realized: one stack of every step
  selects among T pieces per element (a 200-step bidirectional LSTM's Y, 200x2x8x128: 5.4 ms, against 3.5 ms for all of
  onnxruntime's run). A group of 16 single steps is a stack axis the optimiser unrolls whole (opt._selected_axes: no
  select left), the level above selects among at most T / 16 groups. Groups of one size are one kernel to the cache.
  (A stack longer than the unroll's 64 copies is what still needs the tree: the general fix is a kernel writing into its
  window of the consumer's buffer.)"""
  parts = [h.unsqueeze(0) for h in hs]
  while len(parts) > STACK_GROUP:
    parts = [Tensor.cat(parts[i:i + STACK_GROUP], 0).contiguous() for i in range(0, len(parts), STACK_GROUP)]
  return Tensor.cat(parts, 0)


def _gate(g: Tensor, k: int, h: int) -> Tensor: return g[..., k * h:(k + 1) * h]


def _transposed(w: Tensor) -> Tensor:
  """W^T over the last two axes in a buffer of its own: read through the transposed view, a product loads its vector of
  columns with a stride of a row (a weight array is transposed in numpy at load, any other weight once a run)."""
  if (data := w.node.data) is not None: return Tensor(np.ascontiguousarray(np.swapaxes(data, -1, -2)))
  return w.transpose(-1, -2).contiguous()


def _recurrent_t(n: OnnxNode) -> Tensor: return _transposed(n.t(2))  # R^T: (D, hidden, G*H), for h @ R^T


def _plus(a: Tensor, b: Tensor | None) -> Tensor: return a if b is None else a + b


def _gates(x: Tensor, h: Tensor | None, rt: Tensor) -> Tensor:
  """x + h @ R^T, realized: the gate maths reads it at several offsets. A zero h (the first step from a zero state) adds
  nothing, and x, a slice of the realized projection, is read as it is."""
  return x if h is None else (x + h @ rt).contiguous()


# ---- LSTM: gates i, o, f, c ----
def _lstm(n: OnnxNode) -> list[Tensor]:
  s = _setup(n, 4)
  fs = _activations(n, ["Sigmoid", "Tanh", "Tanh"], s.dirs)
  f_, g_, h_ = ([d[k] for d in fs] for k in range(3))
  coupled = bool(n.attr("input_forget", 0))
  wb_rb = _bias(n, s, 4)
  p = _project(n, s, None if wb_rb is None else wb_rb[0] + wb_rb[1])
  peep = _peepholes(n, s)
  rt, hid = _recurrent_t(n), s.hidden
  h, c = _initial(n, 5, s), _initial(n, 6, s)
  hs = []
  for t in range(s.steps):
    g = _gates(_step_input(p, t), h, rt)
    gi, go, gf, gc = (_gate(g, k, hid) for k in range(4))
    if peep is not None and c is not None: gi, gf = gi + peep[0] * c, gf + peep[2] * c
    i = _act(f_, _clip(gi, s.clip))
    f = 1.0 - i if coupled else _act(f_, _clip(gf, s.clip))  # input_forget: the forget gate is 1 - the input gate
    c_new = _plus(i * _act(g_, _clip(gc, s.clip)), None if c is None else f * c)
    if peep is not None: go = go + peep[1] * c_new
    h_new = _act(f_, _clip(go, s.clip)) * _act(h_, c_new)
    state = Tensor.stack([c_new, h_new], 0).contiguous()  # one kernel for both (h recomputes c's few flops inline)
    c, h = state[0], state[1]
    hs.append(h)
  assert h is not None and c is not None  # steps >= 1
  return _outputs(s, hs, [h, c])

def _peepholes(n: OnnxNode, s: _Seq) -> list[Tensor] | None:
  """P's i, o, f parts, each (directions, 1, hidden) to broadcast over the batch."""
  pp = _opt(n, 7)
  if pp is None: return None
  if pp.shape != (s.dirs, 3 * s.hidden): raise n.error(f"input P has shape {pp.shape}, expected {(s.dirs, 3 * s.hidden)}")
  return [_gate(pp, k, s.hidden).unsqueeze(1) for k in range(3)]


# ---- GRU: gates z, r, h ----
def _gru(n: OnnxNode) -> list[Tensor]:
  s = _setup(n, 3)
  fs = _activations(n, ["Sigmoid", "Tanh"], s.dirs)
  f_, g_ = [d[0] for d in fs], [d[1] for d in fs]
  lbr = int(n.attr("linear_before_reset", 0))
  if lbr not in (0, 1): raise n.error(f"attribute linear_before_reset={lbr} is not supported (0, 1)")
  wb_rb = _bias(n, s, 3)
  # Rb_h sits inside r * (...) with linear_before_reset=1, so then only Wb joins the projection
  p = _project(n, s, None if wb_rb is None else wb_rb[0] if lbr else wb_rb[0] + wb_rb[1])
  rb = None if wb_rb is None or not lbr else wb_rb[1].unsqueeze(1)
  rt, h = _recurrent_t(n), _initial(n, 5, s)
  hs = []
  for t in range(s.steps):
    step = _gru_step_lbr if lbr else _gru_step
    h = step(s, _step_input(p, t), h, rt, rb, f_, g_)
    hs.append(h)
  assert h is not None  # steps >= 1
  return _outputs(s, hs, [h])


def _gru_step(s: _Seq, x: Tensor, h: Tensor | None, rt: Tensor, rb: Tensor | None, f_: list[Act], g_: list[Act]) -> Tensor:
  """linear_before_reset=0: the candidate's matmul reads r * H_{t-1}, so it waits for the z, r matmul."""
  hid = s.hidden
  zr = _gates(_gate(x, 0, 2 * hid), h, rt[..., :2 * hid])
  z, r = _act(f_, _clip(_gate(zr, 0, hid), s.clip)), _act(f_, _clip(_gate(zr, 1, hid), s.clip))
  rh = None if h is None else (r * h).contiguous()  # it feeds a matmul: computed once, not per step of the reduction
  cand = _act(g_, _clip(_plus(_gate(x, 2, hid), None if rh is None else rh @ rt[..., 2 * hid:]), s.clip))
  return _plus((1.0 - z) * cand, None if h is None else z * h).contiguous()


def _gru_step_lbr(s: _Seq, x: Tensor, h: Tensor | None, rt: Tensor, rb: Tensor | None, f_: list[Act], g_: list[Act]) -> Tensor:
  """linear_before_reset=1: one matmul for all three gates, the reset applied to H_{t-1} @ R_h^T + Rb_h."""
  hid = s.hidden
  g = rb if h is None else _plus(h @ rt, rb).contiguous()
  part = (lambda k: None) if g is None else (lambda k: _gate(g, k, hid))  # noqa: E731
  z = _act(f_, _clip(_plus(_gate(x, 0, hid), part(0)), s.clip))
  r = _act(f_, _clip(_plus(_gate(x, 1, hid), part(1)), s.clip))
  rg = part(2)
  cand = _act(g_, _clip(_plus(_gate(x, 2, hid), None if rg is None else r * rg), s.clip))
  return _plus((1.0 - z) * cand, None if h is None else z * h).contiguous()


# ---- RNN: one gate ----
def _rnn(n: OnnxNode) -> list[Tensor]:
  s = _setup(n, 1)
  f_ = [d[0] for d in _activations(n, ["Tanh"], s.dirs)]
  wb_rb = _bias(n, s, 1)
  p = _project(n, s, None if wb_rb is None else wb_rb[0] + wb_rb[1])
  rt, h = _recurrent_t(n), _initial(n, 5, s)
  hs = []
  for t in range(s.steps):
    x = _step_input(p, t)
    h = _act(f_, _clip(_plus(x, None if h is None else h @ rt), s.clip)).contiguous()
    hs.append(h)
  assert h is not None  # steps >= 1
  return _outputs(s, hs, [h])


_COMMON = "activation_alpha activation_beta activations clip direction hidden_size layout"
_op("LSTM", _lstm, _COMMON + " input_forget")
_op("GRU", _gru, _COMMON + " linear_before_reset")
_op("RNN", _rnn, _COMMON)
