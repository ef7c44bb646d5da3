"""The ONNX project's own operator test cases (`onnx.backend.test.case.node`, shipped in the onnx wheel) run on kiln.graph.onnx:
how much of each operator kiln lists it gets right. Not in any wheel; runs in the dev environment (it needs onnx only).

A case is in scope when every operator its model uses (in subgraphs too) is one kiln lists. Each in-scope case is loaded with
kiln and run on the case's inputs, and its outputs compared with the case's own tolerances (as onnx's backend runner does):

  PASS     every output matches in dtype, shape and value
  REFUSED  kiln raised its own typed error (KilnError) at load or run: the message says why (a dtype kiln lacks, an attribute)
  WRONG    kiln ran and an output differs: the worst outcome, never acceptable
  ORT      kiln's outputs differ from the case's but match onnxruntime's, which differ from the case's too (onnxruntime is
           kiln's reference where the spec's own expected values disagree with it): listed by name, not counted as a pass
  ULP      onnxruntime cannot run the case (16-bit floats), and kiln's 16-bit outputs are within one unit in the last place of
           the exact result (the same graph run in float64 by onnxruntime) while the case's expected values, rounded in
           16 bits at every op, are further off than its tolerance: listed by name, not counted as a pass
  NODTYPE  an input or output has a dtype kiln does not have (float8, int4, string, ...): out of scope, not counted in pass %
  CRASH    anything else: an untyped exception, a dead worker process, or no answer within --timeout seconds

Cases run in a worker process, so a crash or hang costs one case and is reported, not the whole run.

  python packages/graph/benchmarks/node_tests.py [--only REGEX] [--timeout S] [--markdown FILE] [--show-refused]

Exit status 1 when any case is WRONG or CRASH.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import re
import sys
import warnings
from collections import Counter, defaultdict
from typing import Any

import numpy as np


def _ops_of(graph: Any) -> set[str]:
  ops: set[str] = set()
  for node in graph.node:
    ops.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}")
    for a in node.attribute:
      if a.HasField("g"): ops |= _ops_of(a.g)
      for g in a.graphs: ops |= _ops_of(g)
  return ops


# case-name prefixes that do not spell their operator's name
ALIASES = {"batchnorm": "BatchNormalization", "training_dropout": "Dropout", "mvn": "MeanVarianceNormalization", "layer_norm": "LayerNormalization",
           "logsoftmax": "LogSoftmax", "reduce_log_sum_exp": "ReduceLogSumExp", "reduce_log_sum": "ReduceLogSum",
           "reduce_sum_square": "ReduceSumSquare", "reduce_l1": "ReduceL1", "reduce_l2": "ReduceL2"}


def _op_of(name: str, listed: set[str]) -> str:
  """The operator a case tests: the longest listed operator whose lower-case name starts the case's name."""
  base = name.removeprefix("test_").removesuffix("_expanded")
  if base.startswith("ai_onnx_ml_"): base = "ai.onnx.ml." + base.removeprefix("ai_onnx_ml_")
  for prefix, op in ALIASES.items():
    if base.startswith(prefix): return op
  flat = base.replace("_", "")
  best = max((op for op in listed if flat.startswith(op.lower())), key=len, default="")
  return best or base.split("_")[0]


def cases(only: str | None) -> list[Any]:
  with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
    warnings.simplefilter("ignore")
    from onnx.backend.test.case.node import collect_testcases
    found = collect_testcases(None)
  return [c for c in found if only is None or re.search(only, c.name)]


KILN_DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64"}


def _run_case(c: Any) -> tuple[str, str]:
  from onnx import TensorProto, numpy_helper

  from kiln.graph import onnx as konnx
  from kiln.ir.errors import KilnError
  inputs, want = ([numpy_helper.to_array(a) if isinstance(a, TensorProto) else np.asarray(a) if isinstance(a, np.generic) else a for a in vals]
                  for vals in c.data_sets[0])
  if not all(isinstance(a, np.ndarray) for a in [*inputs, *want]): return "REFUSED", "sequence or optional values (kiln has tensors only)"
  if lacking := sorted({str(a.dtype) for a in [*inputs, *want]} - KILN_DTYPES): return "NODTYPE", f"kiln has no {', '.join(lacking)}"
  try:
    m = konnx.load(c.model)
    names = [vi.name for vi in c.model.graph.input if vi.name not in {i.name for i in c.model.graph.initializer}]
    got = m.run(dict(zip(names, inputs)))
  except KilnError as e: return "REFUSED", f"{type(e).__name__}: {str(e).splitlines()[0]}"
  outs = [o.name for o in c.model.graph.output]
  wrong = _differs(c, [got.get(name) for name in outs], want, outs)
  if wrong is None: return "PASS", ""
  try: ort = _onnxruntime(c.model, dict(zip(names, inputs)))
  except Exception:  # onnxruntime cannot run it: kiln's answer stands alone
    try: exact = _onnxruntime(_in_float64(c.model), {k: _f64(v) for k, v in zip(names, inputs)})
    except Exception: return "WRONG", wrong
    return ("ULP" if _within_an_ulp([got.get(name) for name in outs], want, exact) else "WRONG"), wrong
  if _differs(c, ort, want, outs) is not None and _differs(c, [got.get(name) for name in outs], ort, outs) is None:
    return "ORT", wrong
  return "WRONG", wrong


def _differs(c: Any, got: list[Any], want: list[np.ndarray], outs: list[str]) -> str | None:
  """Why the outputs `got` differ from `want` under the case's tolerances, or None when they match."""
  for name, g, w in zip(outs, got, want):
    if g is None: return f"output {name!r} missing"
    g = np.asarray(g)
    if w.dtype.name == "bfloat16" and g.dtype == np.uint16:  # kiln hands bfloat16 out as its bits, in uint16: compare as float32
      g, w = g.view(w.dtype).astype(np.float32), w.astype(np.float32)
    if g.dtype != w.dtype or g.shape != w.shape: return f"output {name!r}: {g.dtype}{list(g.shape)} for {w.dtype}{list(w.shape)}"
    try:
      if w.dtype.kind in "fc": np.testing.assert_allclose(g, w, rtol=c.rtol, atol=c.atol)
      else: np.testing.assert_array_equal(g, w)
    except AssertionError as e:
      return f"output {name!r}: " + " ".join(ln.strip() for ln in str(e).splitlines() if "Max" in ln)[:200]
  return None


def _f64(a: np.ndarray) -> np.ndarray: return a.astype(np.float64) if a.dtype.name in ("bfloat16", "float16") else a


def _in_float64(model: Any) -> Any:
  """The model with every 16-bit float (inputs, outputs, values, initializers, Cast/CastLike targets) made float64."""
  from onnx import TensorProto, numpy_helper
  m = type(model)()
  m.CopyFrom(model)
  half = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
  for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
    if vi.type.tensor_type.elem_type in half: vi.type.tensor_type.elem_type = TensorProto.DOUBLE
  for i, t in enumerate(m.graph.initializer):
    if t.data_type in half: m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
  for node in m.graph.node:
    for a in node.attribute:
      if a.name == "to" and a.i in half: a.i = TensorProto.DOUBLE
  return m


def _within_an_ulp(got: list[Any], want: list[np.ndarray], exact: list[np.ndarray]) -> bool:
  """Every 16-bit float output within one unit in the last place of the exact value (every other output equal to it)."""
  for g, w, e in zip(got, want, exact):
    if g is None: return False
    g = np.asarray(g)
    if w.dtype.name not in ("bfloat16", "float16"): return bool(g.shape == w.shape and np.array_equal(g, w))
    if w.dtype.name == "bfloat16" and g.dtype == np.uint16: g = g.view(w.dtype)
    gf, ef = g.astype(np.float64), np.asarray(e, np.float64)
    bits = 8 if w.dtype.name == "bfloat16" else 11  # significand bits
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ef), np.finfo(np.float32).tiny))) - (bits - 1))
    if g.shape != ef.shape or not np.all((np.abs(gf - ef) <= ulp) | (np.isnan(gf) & np.isnan(ef))): return False
  return True


def _onnxruntime(model: Any, feeds: dict[str, np.ndarray]) -> list[Any]:
  import onnxruntime as ort
  so = ort.SessionOptions()
  so.log_severity_level = 3
  sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
  return list(sess.run(None, feeds))


def _worker(names: list[str], conn: Any) -> None:
  by_name = {c.name: c for c in cases(None)}
  warnings.simplefilter("ignore")
  for name in names:
    conn.send(("start", name, ""))
    try: status, why = _run_case(by_name[name])
    except Exception as e: status, why = "CRASH", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    conn.send((status, name, why))
  conn.send(("done", "", ""))


def run_all(names: list[str], timeout: float) -> dict[str, tuple[str, str]]:
  """Each case's (status, why), in worker processes that are replaced when one dies or hangs."""
  results: dict[str, tuple[str, str]] = {}
  todo = list(names)
  ctx = mp.get_context("spawn")
  while todo:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(todo, child), daemon=True)
    proc.start()
    current = None
    while True:
      if not parent.poll(timeout if current else 120):
        if current: results[current] = ("CRASH", f"no answer within {timeout:.0f} s (hang)")
        break
      try: kind, name, why = parent.recv()
      except EOFError:
        if current: results[current] = ("CRASH", f"the worker process died (exit {proc.exitcode})")
        break
      if kind == "start": current = name
      elif kind == "done": current = None; break
      else: results[name] = (kind, why); current = None
    proc.kill(); proc.join()
    todo = [n for n in todo if n not in results]
    if current is None and todo: todo = []  # the worker finished without reporting them: nothing more to learn
  return results


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", help="regex over case names")
  ap.add_argument("--timeout", type=float, default=60.0)
  ap.add_argument("--markdown", help="write the per-operator table here too")
  ap.add_argument("--show-refused", action="store_true", help="list every refused case with kiln's reason")
  a = ap.parse_args()
  import kiln.graph.onnx  # noqa: F401  (its operator modules register themselves in OPS)
  from kiln.graph.onnx_ops import OPS
  from kiln.graph.onnx_ops_ml import ML_DOMAIN, ML_OPS
  listed = {f"{ML_DOMAIN}.{op}" if op in ML_OPS else op for op in OPS}  # _ops_of names a domain's operators with it
  scope = [c for c in cases(a.only) if _ops_of(c.model.graph) <= listed]
  results = run_all([c.name for c in scope], a.timeout)
  by_op: dict[str, Counter[str]] = defaultdict(Counter)
  for c in scope: by_op[_op_of(c.name, listed)][results.get(c.name, ("CRASH", "not run"))[0]] += 1
  lines = ["| operator | cases | pass | refused | = ort | ulp | wrong | crash | pass % | no dtype |", "|---|---|---|---|---|---|---|---|---|---|"]
  total: Counter[str] = Counter()
  for op in sorted(by_op):
    k = by_op[op]; n = sum(k.values()) - k["NODTYPE"]; total += k
    lines.append(f"| {op} | {n} | {k['PASS']} | {k['REFUSED']} | {k['ORT']} | {k['ULP']} | {k['WRONG']} | {k['CRASH']} | "
                 f"{100 * k['PASS'] / max(n, 1):.0f} | {k['NODTYPE']} |")
  n, t = sum(total.values()) - total["NODTYPE"], total
  lines.append(f"| **all** | {n} | {t['PASS']} | {t['REFUSED']} | {t['ORT']} | {t['ULP']} | {t['WRONG']} | {t['CRASH']} | "
               f"{100 * t['PASS'] / max(n, 1):.1f} | {t['NODTYPE']} |")
  report = "\n".join(lines)
  print(report)
  bad = sorted((s, name, why) for name, (s, why) in results.items() if s in ("WRONG", "CRASH"))
  for s, name, why in bad: print(f"{s:8} {name}: {why}")
  for name, (s, why) in sorted(results.items()):
    if s == "ORT": print(f"ORT      {name}: kiln matches onnxruntime; both differ from the case's expected output: {why}")
    if s == "ULP": print(f"ULP      {name}: within an ulp of the exact (float64) result, the case's expected values further off: {why}")
  if a.show_refused:
    for name, (s, why) in sorted(results.items()):
      if s == "REFUSED": print(f"REFUSED  {name}: {why}")
  reasons = Counter(re.sub(r"node \S+ \(", "(", why)[:110] for s, why in results.values() if s == "REFUSED")
  print("\nrefusals, most common first:")
  for why, k in reasons.most_common(25): print(f"  {k:4}  {why}")
  if a.markdown:
    with open(a.markdown, "w") as f: f.write(report + "\n")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
