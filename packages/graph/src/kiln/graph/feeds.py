"""What a loaded ONNX model (kiln.graph.onnx.Model) takes and gives, and the strict checks of `Model.run`'s arguments.

`TensorInfo` describes one input or output: its name, its shape (an int for a fixed dim, the name of a symbolic one,
None where kiln learns it only at run time) and its numpy dtype. Feeds are checked before anything runs, and every
problem of one kind is named at once: a name the model does not take (with the closest one it does), an input not fed,
a dtype that differs from the input's. A differing dtype is cast only when the caller asks (cast=True), and then only
when every value survives: an integer narrowed must fit its new type, a float made an integer must be whole and fit,
a float made a narrower float must not overflow to infinity (rounding is what such a cast means). Then each array's
shape against the compiled input's (check_shapes: rank, fixed dims, a symbolic dim within the bounds load gave it and
equal in every input that names it). Selected outputs (`outputs=`) and preallocated ones (`out=`) are checked the same
way. Every refusal is a FeedError, an ONNXError.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from kiln.graph.dims import bind_dims, fmt
from kiln.graph.errors import ONNXError


class FeedError(ONNXError):
  """Model.run's arguments do not fit the model: a name it does not take, an input not fed, a dtype or shape that differs;
  the message names the input or output and what it takes."""


class TensorInfo(NamedTuple):
  """A model input or output. `shape`: an int per fixed dim, a symbolic dim by its name ('batch', or 'batch*128' for one
  kiln computed), None for a dim (or, as a whole, a shape) known only at run time. `dtype`: the numpy dtype run() takes
  (an input) or returns (an output; a bfloat16 output comes back as its uint16 bits, kiln's numpy form of bfloat16).
  A NamedTuple, so `name, shape, dtype = info` works as well as `info.name`."""
  name: str
  shape: tuple[int | str | None, ...] | None
  dtype: np.dtype | None  # None: an output of a model compiled at run time that declares no element type

  def __str__(self) -> str:
    dims = "unknown" if self.shape is None else \
      "(" + ", ".join("?" if d is None else str(d) for d in self.shape) + ("," if len(self.shape) == 1 else "") + ")"
    return f"{self.name} {dims} {self.dtype}"


def _numeric(dt: np.dtype) -> bool: return dt.kind in "biuf" or dt.name == "bfloat16"  # ml_dtypes' bfloat16 is of kind 'V'


def did_you_mean(name: object, known: Iterable[str]) -> str:
  """' (did you mean 'src'?)' for the known name closest to a misspelt one, '' where none is close."""
  by_lower = {k.lower(): k for k in reversed(list(known))}  # compared without case: 'Y' is closest to 'y' ('srC' to 'src')
  near = difflib.get_close_matches(str(name).lower(), list(by_lower), 1)
  return f" (did you mean {by_lower[near[0]]!r}?)" if near else ""


def _unknown(what: str, names: Sequence[object], known: Sequence[str]) -> FeedError:
  listed = ", ".join(f"{k!r}{did_you_mean(k, known)}" for k in names)
  return FeedError(f"the model has no {what} {listed}; its {what}s: {', '.join(known) or 'none'}")


def output_info(name: str, value: Any, declared: TensorInfo | None) -> TensorInfo:
  """An output's TensorInfo: what kiln computes (a Tensor's shape and dtype, a constant's), else (an output a program
  computes at run time) what the model declares."""
  if isinstance(value, np.ndarray): return TensorInfo(name, tuple(int(d) for d in value.shape), value.dtype)
  if value is not None:  # a Tensor
    return TensorInfo(name, tuple(d if isinstance(d, int) else fmt(d) for d in value.shape), np.dtype(value.dtype.np))
  return declared if declared is not None else TensorInfo(name, None, None)


def check_dims(dims: Mapping[str, object] | None, used: Iterable[str]) -> None:
  """load(dims=...) names only symbolic dims of the model's inputs: a name that is none of them (a typo, another model's
  dim) would otherwise be ignored."""
  known = sorted(set(used))
  if extra := [k for k in (dims or {}) if k not in known]:
    listed = ", ".join(f"{k!r}{did_you_mean(k, known)}" for k in extra)
    raise FeedError(f"dims names {listed}, which is no symbolic dim of the model's inputs; they have "
                    + (", ".join(repr(k) for k in known) if known else "no symbolic dims"))


def check_feeds(inputs: Sequence[TensorInfo], defaults: Mapping[str, np.ndarray], feeds: Any, cast: bool) -> dict[str, np.ndarray]:
  """The feeds as arrays of the inputs' dtypes: every input fed, no other name, each dtype the input's (or cast, with
  cast=True, where every value survives). An input an initializer gives a value may be fed only that value (onnx.py)."""
  if not isinstance(feeds, Mapping): raise FeedError(f"run takes a mapping of input name -> array, got {type(feeds).__name__}")
  names = [i.name for i in inputs] + list(defaults)
  if unknown := [k for k in feeds if k not in names]: raise _unknown("input", unknown, names)
  if missing := [i for i in inputs if i.name not in feeds]:
    listed = ", ".join(f"{i.name!r} ({str(i)[len(i.name) + 1:]})" for i in missing)  # str(i) is 'name shape dtype': the name once
    raise FeedError(f"model input {listed} {'was' if len(missing) == 1 else 'were'} not fed")
  arrays = {i.name: fit_dtype(i.name, np.asarray(feeds[i.name]), i.dtype, cast) for i in inputs}
  for name, value in defaults.items():
    if name in feeds and not np.array_equal(np.asarray(feeds[name]), value):
      raise FeedError(f"model input {name!r} has a value in the model (an initializer of the same name), which kiln folds in at load "
                      "time: it cannot be fed another value (remove the initializer, or the input, from the model)")
  return arrays


def check_shapes(inputs: Iterable[tuple[str, Sequence[Any]]], arrays: Mapping[str, np.ndarray]) -> None:
  """Each fed array's shape against its compiled input's, before anything runs, so a wrong shape is a FeedError naming it
  (dims.bind_dims: the rank, each fixed dim, each symbolic dim within its bounds and the same in every input)."""
  bind_dims(inputs, {name: a.shape for name, a in arrays.items()}, "the model", FeedError)


def fit_dtype(name: str, a: np.ndarray, want: np.dtype | None, cast: bool) -> np.ndarray:
  """a as the input `name` of dtype `want` takes it: as it is when the dtypes agree (a bfloat16 input also takes uint16, its
  bits), cast when cast=True and every value survives, else a FeedError naming both dtypes."""
  if want is None or a.dtype == want or (want.name == "bfloat16" and a.dtype == np.uint16): return a
  if not cast:
    raise FeedError(f"input {name!r} has dtype {a.dtype}, the model takes {want}: give it as {want} (in Python, Model.run(..., cast=True) "
                    "casts where every value survives)")
  if not (_numeric(a.dtype) and _numeric(want)):
    raise FeedError(f"input {name!r} has dtype {a.dtype}, the model takes {want}: cast=True casts only between numbers and bools")
  if want.kind in "biu" and a.size: _check_integral(name, a, want)
  with np.errstate(over="ignore", invalid="ignore"): b = a.astype(want)
  if want.kind not in "biu" and a.size:  # a float: rounding is the cast's meaning, overflow to infinity is not
    finite = np.isfinite(a.astype(np.float64)) if a.dtype.kind not in "f" else np.isfinite(a)
    if (finite & ~np.isfinite(b)).any():
      raise FeedError(f"input {name!r}: cast=True would make finite {a.dtype} values infinite in {want} (they are beyond its range)")
  return b


def _check_integral(name: str, a: np.ndarray, want: np.dtype) -> None:
  """Every value of a kept by a cast to the integer (or bool) dtype want: whole, and within its range."""
  if a.dtype.kind not in "biu":  # a float (bfloat16 too)
    a = a.astype(np.float64)
    if not np.isfinite(a).all() or not np.array_equal(a, np.trunc(a)):
      raise FeedError(f"input {name!r}: cast=True would change values: the array holds fractions, infinities or NaN, the model takes {want}")
  lo, hi = (0, 1) if want.kind == "b" else (int(np.iinfo(want).min), int(np.iinfo(want).max))
  amin, amax = a.min(), a.max()
  # compared as Python numbers: a float's bound is exclusive one past the top (float(2**63 - 1) rounds to 2**63)
  low_ok = (float(amin) >= lo) if a.dtype.kind == "f" else int(amin) >= lo
  high_ok = (float(amax) < float(hi) + 1) if a.dtype.kind == "f" else int(amax) <= hi
  if not (low_ok and high_ok):
    raise FeedError(f"input {name!r}: cast=True would change values: they run from {amin} to {amax}, {want} holds {lo} to {hi}")


def chosen_outputs(names: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
  """The outputs run() returns: `wanted` (in its order; each a model output, none twice), or every output."""
  if wanted is None: return list(names)
  if isinstance(wanted, str): raise FeedError(f"outputs is a list of output names, got the string {wanted!r} (write outputs=[{wanted!r}])")
  wanted = list(wanted)
  if unknown := [k for k in wanted if k not in names]: raise _unknown("output", unknown, list(names))
  if twice := sorted({k for k in wanted if wanted.count(k) > 1}): raise FeedError(f"outputs names {', '.join(map(repr, twice))} twice")
  return wanted


def check_out(out: Mapping[str, Any] | None, infos: Mapping[str, TensorInfo], chosen: Sequence[str]) -> dict[str, np.ndarray]:
  """out= before the run: each key an output run() returns, each value a writeable ndarray of that output's dtype (and
  shape, where the shape is known before the run)."""
  if out is None: return {}
  if not isinstance(out, Mapping): raise FeedError(f"out is a mapping of output name -> array, got {type(out).__name__}")
  if unknown := [k for k in out if k not in infos]: raise _unknown("output", unknown, list(infos))
  if skipped := [k for k in out if k not in chosen]: raise FeedError(f"out names {', '.join(map(repr, skipped))}, which outputs= does not select")
  for k, a in out.items():
    info = infos[k]
    if not isinstance(a, np.ndarray): raise FeedError(f"out[{k!r}] is a {type(a).__name__}, not a numpy array")
    if not a.flags.writeable: raise FeedError(f"out[{k!r}] is read-only")
    if info.dtype is not None and a.dtype != info.dtype: raise FeedError(f"out[{k!r}] has dtype {a.dtype}, output {k!r} is {info.dtype}")
    if info.shape is not None and all(isinstance(d, int) for d in info.shape) and a.shape != info.shape:
      raise FeedError(f"out[{k!r}] has shape {a.shape}, output {k!r} is {info.shape}")
  return dict(out)


def check_out_shapes(dst: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
  """out='s arrays against this run's output shapes (a symbolic dim decides them), before any is written."""
  for n, a in dst.items():
    if n in shapes and a.shape != tuple(shapes[n]): raise FeedError(f"out[{n!r}] has shape {a.shape}, this run's output {n!r} is {tuple(shapes[n])}")


def write_out(got: np.ndarray, dst: np.ndarray) -> np.ndarray:
  """An output written into the caller's array dst (shape and dtype checked already)."""
  np.copyto(dst, got, casting="no")
  return dst
