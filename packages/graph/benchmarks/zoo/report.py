"""The zoo's report, in markdown: one row per model (each export's status, then the error and timings of its first
matching export), totals per export kind and per model, the refusals ranked by how many models each blocks (kiln's
messages grouped by operator with node names and numbers taken out), then the crashes, timeouts and wrong results."""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from typing import Any

from zoo.check import FAR

VARIANTS = ("dynamo/fixed", "dynamo/dynamic", "script/fixed", "script/dynamic", "file")
STATUSES = ("OK", "REFUSED", "TIES", "WRONG", "CRASH", "TIMEOUT", "NO-REF", "EXPORT-FAIL")
SHORT = {"OK": "ok", "REFUSED": "refused", "TIES": "ties", "WRONG": "**WRONG**", "CRASH": "**CRASH**", "TIMEOUT": "**TIMEOUT**", "NO-REF": "no-ref",
         "EXPORT-FAIL": "export-fail"}
TIMING_ORDER = ("dynamo/fixed", "script/fixed", "file", "dynamo/dynamic", "script/dynamic")
NODE = re.compile(r"^(?P<when>at run: )?node (?P<node>.*?) \((?P<op>[A-Za-z0-9_.]+)(?:, opset \d+)?\): (?P<rest>.*)$", re.S)


def normalize(msg: str) -> str:
  """A message with what varies from model to model taken out: value names, numbers, shapes."""
  msg = re.sub(r"'[^']*[/:0-9][^']*'", "'…'", msg)  # quoted names with digits, slashes, colons: value names
  msg = re.sub(r"(?<![A-Za-z0-9])\d+(\.\d+)?(e[-+]?\d+)?", "N", msg)  # not inside a name: Col2Im, int64 stay
  msg = re.sub(r"\((?:[\w*-]+, )*[\w*-]+,?\)|\[(?:[\w*-]+, )*[\w*-]+\]", lambda m: m[0] if "," not in m[0] else "(…)", msg)  # shapes
  return msg[:220]


def group(msg: str) -> tuple[str, str]:
  """(operator or '(model)', normalized message) of a refusal."""
  m = NODE.match(msg)
  if m: return m["op"], ("at run: " if m["when"] else "") + normalize(m["rest"])
  return "(model)", normalize(msg)


def groups(msg: str) -> set[tuple[str, str]]:
  """The groups of one refusal: kiln lists every node it cannot take, one a line after a header; each counts."""
  lines = [x.strip() for x in msg.splitlines() if x.strip()]
  nodes = [x for x in lines if NODE.match(x)]
  return {group(x) for x in nodes} if nodes else {group(lines[0] if lines else "")}


def short(msg: str) -> str:
  """A refusal in one line: its first line, and the first node it lists when it lists several."""
  lines = [x.strip() for x in msg.splitlines() if x.strip()]
  return " ".join(lines[:2])


def status_of(rec: dict[str, Any], v: str) -> str | None:
  r = rec["results"].get(v) or (rec["results"].get("build") if v != "file" and "file" not in rec["results"] else None)
  return r["status"] if r else None


def fmt(x: float | None, spec: str) -> str: return "" if x is None else format(x, spec)


def model_row(rec: dict[str, Any], cols: tuple[str, ...]) -> str:
  cells = [f"`{rec['name']}`"] + [SHORT.get(status_of(rec, v) or "", "") for v in cols]
  oks = [rec["results"][v] for v in TIMING_ORDER if rec["results"].get(v, {}).get("status") == "OK"]
  t = timing(rec)
  err = max((r.get("rel_err", 0.0) for r in oks), default=None)
  ratio = t["kiln_ms"] / t["ort_ms"] if t and t.get("ort_ms") else None
  ov = t["kiln_ms"] / t["ov_ms"] if t and t.get("ov_ms") else None
  far = f" ({t['far_rounds']} far)" if t.get("far_rounds") else ""  # rounds timed on cores placed far apart (check.Cores)
  cells += [fmt(err, ".1e"), fmt(t.get("load_s"), ".1f"), fmt(t.get("kiln_ms"), ".2f") + far, fmt(t.get("ort_ms"), ".2f"), fmt(ratio, ".2f"),
            fmt(t.get("ov_ms"), ".2f"), fmt(ov, ".2f")]
  first = next((r for v in (*VARIANTS, "build") if (r := rec["results"].get(v)) and r["status"] != "OK"), None)
  cells.append("" if first is None else f"{first['variant']}: {short(first['message'])[:140]}".replace("|", "/"))
  return "| " + " | ".join(cells) + " |"


DYNAMIC_ORDER = ("dynamo/dynamic", "script/dynamic")


def timing(rec: dict[str, Any], order: tuple[str, ...] = TIMING_ORDER, timed: bool = False) -> dict[str, Any]:
  """The result of a model's first matching export in `order` (with timed: the first that was timed too), {} where none."""
  return next((r for v in order if (r := rec["results"].get(v, {})).get("status") == "OK" and (not timed or r.get("kiln_ms"))), {})


def _geomean(xs: list[float]) -> float: return math.exp(sum(math.log(x) for x in xs) / len(xs))


def speed(recs: list[dict[str, Any]]) -> list[str]:
  """kiln's time over each peer's (lower is faster): geometric mean, median, how many models kiln is faster on, per family
  and in all, then the models furthest behind onnxruntime."""
  out = ["kiln ms / peer ms over the models timed (below 1: kiln is faster).", "",
         "| family | peer | models | geomean | median | kiln faster on |", "|---|---|---|---|---|---|"]
  for fam in [*sorted({r["family"] for r in recs}), "all"]:
    rows = [timing(r) for r in recs if fam in ("all", r["family"])]
    for peer, key in (("onnxruntime", "ort_ms"), ("OpenVINO f32", "ov_ms")):
      xs = [t["kiln_ms"] / t[key] for t in rows if t.get(key)]
      if xs: out.append(f"| {fam} | {peer} | {len(xs)} | {_geomean(xs):.2f} | {statistics.median(xs):.2f} | {sum(x < 1 for x in xs)} |")
  slow = sorted(((t["kiln_ms"] / t["ort_ms"], r["name"]) for r in recs if (t := timing(r)).get("ort_ms")), reverse=True)[:12]
  out += ["", "Furthest behind onnxruntime: " + ", ".join(f"{n} {x:.2f}" for x, n in slow)]
  dyn = [(d["kiln_ms"] / d["ort_ms"], r["name"]) for r in recs if (d := timing(r, DYNAMIC_ORDER, timed=True)).get("ort_ms")]
  if dyn:
    worst = ", ".join(f"{n} {x:.2f}" for x, n in sorted(dyn, reverse=True)[:8])
    out += ["", f"Dynamic exports (a symbolic batch, and sequence for text; the first that matched of {', '.join(DYNAMIC_ORDER)}): "
            f"kiln/onnxruntime geomean {_geomean([x for x, _ in dyn]):.2f} over {len(dyn)} models; furthest behind: {worst}"]
  firsts = [(t["kiln_first_ms"] / t["ort_first_ms"], r["name"]) for r in recs if (t := timing(r)).get("ort_first_ms")]
  if firsts:
    worst = ", ".join(f"{n} {x:.2f}" for x, n in sorted(firsts, reverse=True)[:8])
    out += ["", f"A call after an idle spell (each block's first run, after the process went quiet): kiln/onnxruntime geomean "
            f"{_geomean([x for x, _ in firsts]):.2f} over {len(firsts)} models; furthest behind: {worst}"]
  trips = [t for r in recs if (t := timing(r)).get("core_trip_ns")]
  if trips:
    far = [t for t in trips if t.get("far_rounds")]
    out += ["", f"Cores: a cache line's round trip between two of them took {statistics.median(t['core_trip_ns'] for t in trips):.0f} ns "
            f"(median over the models' timed rounds). Rounds whose trip was over {FAR:g}x off the usual one (the vCPUs placed apart, "
            f"or on one core's two hardware threads) were waited out; {len(far)} model(s) still had some (marked 'far'), "
            f"{sum(t.get('far_wait_s', 0.0) for t in trips):.0f} s were spent waiting."]
  return out


def totals(recs: list[dict[str, Any]], cols: tuple[str, ...]) -> list[str]:
  out = ["| export | " + " | ".join(STATUSES) + " | loaded | matching |", "|---" * (len(STATUSES) + 3) + "|"]
  for v in cols:
    c = Counter(s for r in recs if (s := status_of(r, v)))
    if not c: continue
    out.append(f"| {v} | " + " | ".join(str(c[s]) for s in STATUSES) + f" | {c['OK'] + c['TIES'] + c['WRONG']} | {c['OK']} |")
  per: Counter[str] = Counter()
  for r in recs:
    got = [s for v in cols if (s := status_of(r, v))]
    per["models"] += 1
    per["loaded and matching in at least one export"] += "OK" in got
    per["matching in every export that exported"] += bool(got) and all(s in ("OK", "EXPORT-FAIL", "NO-REF") for s in got) and "OK" in got
    per["WRONG in some export"] += "WRONG" in got
    per["TIES (a detection tie broken the other way) in some export"] += "TIES" in got
    per["CRASH or TIMEOUT in some export"] += "CRASH" in got or "TIMEOUT" in got
    per["REFUSED in every export kiln was given"] += bool(got) and all(s in ("REFUSED", "EXPORT-FAIL", "NO-REF") for s in got) and "REFUSED" in got
    per["not exported at all"] += bool(got) and all(s == "EXPORT-FAIL" for s in got)
  return out + ["", *[f"- {k}: **{n}**" for k, n in per.items()]]


def refusals(recs: list[dict[str, Any]]) -> list[str]:
  blocked: dict[tuple[str, str], set[str]] = defaultdict(set)
  exports: Counter[tuple[str, str]] = Counter()
  for rec in recs:
    for r in rec["results"].values():
      if r["status"] != "REFUSED": continue
      for k in groups(r["message"]):
        blocked[k].add(rec["name"])
        exports[k] += 1
  if not blocked: return ["No refusals."]
  by_op: dict[str, set[str]] = defaultdict(set)
  for (op, _), names in blocked.items(): by_op[op] |= names
  out = ["By operator (models with at least one export refused there):", "",
         ", ".join(f"{op} **{len(n)}**" for op, n in sorted(by_op.items(), key=lambda kv: (-len(kv[1]), kv[0]))), "",
         "| models | exports | operator | message (normalized) | models blocked (first 6) |", "|---|---|---|---|---|"]
  for k, names in sorted(blocked.items(), key=lambda kv: (-len(kv[1]), -exports[kv[0]], kv[0])):
    shown = ", ".join(sorted(names)[:6]) + (", …" if len(names) > 6 else "")
    out.append(f"| {len(names)} | {exports[k]} | {k[0]} | {k[1].replace('|', '/')} | {shown} |")
  return out


def problems(recs: list[dict[str, Any]]) -> list[str]:
  out = []
  for rec in recs:
    for v, r in sorted(rec["results"].items()):
      if r["status"] in ("WRONG", "TIES", "CRASH", "TIMEOUT", "NO-REF"):
        out.append(f"- `{rec['name']}` {v}: **{r['status']}** {short(r['message'])[:400]}")
  return out or ["None."]


def export_failures(recs: list[dict[str, Any]]) -> list[str]:
  c: dict[str, set[str]] = defaultdict(set)
  for rec in recs:
    for v, r in rec["results"].items():
      if r["status"] == "EXPORT-FAIL":  # the innermost cause, where the exporter wrapped it ("TorchExportError: ... <- cause")
        c[f"{v.split('/')[0]}: {normalize(r['message'].split(' <- ')[-1])[:160]}"].add(rec["name"])
  ranked = sorted(c.items(), key=lambda kv: -len(kv[1]))
  return [f"- {len(n)}: {k} ({', '.join(sorted(n)[:5])}{', …' if len(n) > 5 else ''})" for k, n in ranked] or ["None."]


def markdown(recs: list[dict[str, Any]], header: str) -> str:
  recs = sorted(recs, key=lambda r: (r["family"], r["name"]))
  cols = tuple(v for v in VARIANTS if any(status_of(r, v) for r in recs))
  lines = [f"# kiln ONNX model zoo\n\n{header}\n", "## Totals\n", *totals(recs, cols), "", "## Refusals, ranked by models blocked\n", *refusals(recs),
           "", "## Speed\n", *speed(recs),
           "", "## Wrong results, crashes, timeouts, no reference\n", *problems(recs), "", "## Export failures (torch's exporter, not kiln)\n",
           *export_failures(recs), "", "## Per model\n",
           "rel err: the largest |kiln - onnxruntime| over the matching exports, relative to each output's largest magnitude; load s, kiln ms, "
           "ort ms, ov ms (OpenVINO, INFERENCE_PRECISION_HINT f32): the first matching export among " + ", ".join(TIMING_ORDER) + " (median of "
           "interleaved runs, same thread count); first failure: the first export that is not OK, and why.\n"]
  for fam in sorted({r["family"] for r in recs}):
    rows = [r for r in recs if r["family"] == fam]
    fcols = tuple(v for v in cols if any(status_of(r, v) for r in rows))
    head = "| model | " + " | ".join(fcols) + " | rel err | load s | kiln ms | ort ms | kiln/ort | ov ms | kiln/ov | first failure |"
    lines += [f"### {fam}\n", head, "|---" * (len(fcols) + 9) + "|", *[model_row(r, fcols) for r in rows], ""]
  return "\n".join(lines)
