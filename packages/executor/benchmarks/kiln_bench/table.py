"""A benchmark row, its verdict and the table the rows print as.

A ratio between two contenders (`Row.paired`) is the median over rounds of their quotient in each round, and the target is
judged on it; when the rounds alone would give different verdicts, `Row.judge` says so in the note ("kiln/numpy 0.94-1.07x
over 5 rounds") and the table marks the status with `~`, so a reader sees noise rather than a flipped verdict."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kiln_bench.harness import GB, MB

SLACK = 0.2  # a target missed by more than this fails the run


@dataclass
class Row:
  work: str
  unit: str  # how kiln/numpy/numba/tinygrad print: "ms", "us", "MB"
  kiln: float | None = None  # seconds (bytes for "MB")
  numpy: float | None = None
  numba: float | None = None
  tinygrad: float | None = None
  torch: float | None = None
  onnxruntime: float | None = None
  heuristic: float | None = None  # the tuned row: the same plan with the heuristic's options (a check's "peer")
  ratio: float | None = None  # kiln's throughput over numpy's (numpy time / kiln time)
  achieved: str = ""
  limit: str = ""
  target: str = ""
  target_kind: str = ""  # "ratio" (ratio >= target_value), "max" (kiln <= target_value), "" (report only)
  target_value: float = 0.0
  # targets that all must hold (the model rows): (peer, x) wants the peer's time >= x * kiln's, ("limit", f) wants frac >= f;
  # one whose number is missing (peer not installed) is not judged
  checks: list[tuple[str, float]] = field(default_factory=list)
  frac: float | None = None  # achieved / limit, for ("limit", f)
  status: str = ""  # PASS, NEAR (missed by <= 20%), MISS, WRONG, ERROR or "-" (report only)
  note: str = ""
  # each contender's median per round (seconds), the contenders timed in the same interleaved rounds (Bench.time_row)
  rounds: dict[str, list[float]] = field(default_factory=dict)
  spread: str = ""  # set by judge when the rounds, judged one by one, disagree on the verdict: the judged ratios' ranges

  def per_round(self, who: str) -> list[float] | None:
    """who's time over kiln's in each round (kiln's throughput over who's), or None without both in the same rounds."""
    k, o = self.rounds.get("kiln"), self.rounds.get(who)
    return [ov / kv for ov, kv in zip(o, k)] if k and o and len(k) == len(o) else None

  def paired(self, who: str) -> float | None:
    """who's time over kiln's: the median over rounds of each round's quotient (both timed in the same rounds, so a
    drift between rounds cancels); without rounds, the quotient of the two columns."""
    q = self.per_round(who)
    if q: return statistics.median(q)
    other = getattr(self, who, None)
    return other / self.kiln if other is not None and self.kiln else None

  def judge(self) -> None:
    if self.status in ("WRONG", "ERROR"): return
    self.status = self._verdict(None)
    n = len(self.rounds.get("kiln", []))
    if n < 2 or self.status not in ("PASS", "NEAR", "MISS"): return
    each = [self._verdict(i) for i in range(n)]
    if len(set(each)) < 2: return
    counts = ", ".join(f"{s} {each.count(s)}" for s in ("PASS", "NEAR", "MISS") if s in each)
    ranges = [f"{j.label} {_span(j.fmt, min(j.rounds), max(j.rounds))} (median {j.fmt(j.value)})"
              for j in self._judged() if j.rounds and j.value is not None]
    self.spread = f"{'; '.join(ranges)} over {n} rounds, which one by one would judge {counts}; judged on the median"
    self.note = (self.note + "; " if self.note else "") + "rounds disagree: " + self.spread

  def _judged(self) -> list[Judged]:
    """What the target is judged on, in the order of checks (or the one target)."""
    k = self.rounds.get("kiln")
    if self.checks:
      out = []
      for kind, want in self.checks:
        if kind == "limit":
          each = [self.frac * self.kiln / kv for kv in k] if k and self.frac is not None and self.kiln else None
          out.append(Judged("limit", want, self.frac, each, _pct))
        else: out.append(Judged(f"vs {kind}", want, self.paired(kind), self.per_round(kind), _times))
      return out
    if self.target_kind == "ratio": return [Judged("kiln/numpy", self.target_value, self.ratio, self.per_round("numpy"), _times)]
    if self.target_kind == "max":
      return [Judged("kiln", self.target_value, self.kiln, k, lambda v: _fmt(v, self.unit), lower=True)]
    return []

  def _verdict(self, i: int | None) -> str:
    """The row's verdict on its own values (i None), or on round i's alone; the worst of its targets."""
    if self.kiln is None: return "-"
    got = []
    for j in self._judged():
      v = j.value if i is None else (j.rounds[i] if j.rounds else None)
      if v is None: continue  # a peer not installed (or failed), a ratio not measured: not judged
      ok, near = (v <= j.want, v <= j.want * (1 + SLACK)) if j.lower else (v >= j.want, v >= j.want * (1 - SLACK))
      got.append("PASS" if ok else "NEAR" if near else "MISS")
    return max(got, key=("PASS", "NEAR", "MISS").index) if got else "-"


class Judged(NamedTuple):
  """One quantity a row's target is judged on: the row's value and each round's (None without rounds)."""
  label: str
  want: float
  value: float | None
  rounds: list[float] | None
  fmt: Callable[[float], str]
  lower: bool = False  # the value must be at most `want` (a time), else at least (a ratio, a fraction of a limit)


def _times(v: float) -> str: return f"{v:.2f}x"
def _pct(v: float) -> str: return f"{v:.0%}"


def _span(fmt: Callable[[float], str], lo: float, hi: float) -> str:
  """lo-hi with the unit once: "0.94-1.07x", "65-72%", "0.38-0.73 ms"."""
  a, b = fmt(lo), fmt(hi)
  unit = b[len(b.rstrip(" %xmunsMB")):]
  return f"{a.removesuffix(unit) if unit and a.endswith(unit) else a}-{b}"


def _fmt(v: float | None, unit: str) -> str:
  if v is None: return "-"
  if unit == "MB": return f"{v / MB:.2f} MB"
  s = v * (1e3 if unit == "ms" else 1e6)
  return f"{s:.3g} {unit}" if s < 100 else f"{s:.0f} {unit}"


COLUMNS = ("kiln", "numpy", "numba", "tinygrad", "torch", "onnxruntime", "heuristic")  # contenders with a Row field


def rate(x: float, unit: str, limit: float | None) -> str:
  pct = f" ({x / limit:.0%})" if limit else ""
  return f"{x / GB:.1f} {unit}{pct}"


COLS = ("work", "kiln", "numpy", "numba", "tinygrad", "torch", "onnxruntime", "kiln/numpy", "achieved", "limit", "target", "status")


def table(rows: list[Row]) -> str:
  cells = [list(COLS)]
  for r in rows:
    cells.append([r.work, _fmt(r.kiln, r.unit), _fmt(r.numpy, r.unit), _fmt(r.numba, r.unit), _fmt(r.tinygrad, r.unit),
                  _fmt(r.torch, r.unit), _fmt(r.onnxruntime, r.unit),
                  f"{r.ratio:.2f}x" if r.ratio is not None else "-", r.achieved or "-", r.limit or "-", r.target or "-",
                  r.status + ("~" if r.spread else "")])
  w = [max(len(c[i]) for c in cells) for i in range(len(COLS))]
  lines = ["  ".join(c[i].ljust(w[i]) if i in (0, 9, 10) else c[i].rjust(w[i]) for i in range(len(COLS))) for c in cells]
  lines.insert(1, "  ".join("-" * x for x in w))
  return "\n".join(lines)
