"""The index-arithmetic simplifier: tinygrad-style rule tables over UPat, exact under C semantics.

Integers wrap (two's complement) and `//`, `%` truncate toward zero. Ring identities (+, -, *, reassociation,
combining terms) hold modulo 2**bits, so they are exact with wraparound. Everything else (division, modulo,
comparisons, max) is rewritten only when vmin/vmax prove the operands never wrap and the identity holds under
truncation. When a rule cannot prove that, it does not fire.
"""
from __future__ import annotations

import math

from kiln.ir.dtype import DType, dtypes
from kiln.ir.fold import fold_alu
from kiln.ir.ops import GroupOp, Ops
from kiln.ir.rewrite import PatternMatcher, UPat, graph_rewrite
from kiln.ir.uop import UOp

# ---- predicates and helpers ----

def _sint(u: UOp) -> bool: return u.dtype.count == 1 and u.dtype.kind == "i"
def _int(u: UOp) -> bool: return u.dtype.count == 1 and u.dtype.kind in "iu"
def _intb(u: UOp) -> bool: return u.dtype.count == 1 and u.dtype.kind in "iub"
def _fits(dt: DType, lo: int, hi: int) -> bool: return dt.min <= lo and hi <= dt.max

MAX_TERMS = 32  # flattening stops here, so long chains cost O(n), not O(n^2)


def _terms(u: UOp) -> tuple[list[tuple[UOp, int]], int] | None:
  """u as sum(coef * base) + const over Z (the value mod 2**bits), merging like bases in first-seen order; None if too long.

  Descends through ADD, SUB, NEG and MUL by a constant, so a base is never one of those (nor a constant).
  """
  coefs: dict[UOp, int] = {}
  const, seen, stack = 0, 0, [(u, 1)]
  while stack:
    x, k = stack.pop()
    if (seen := seen + 1) > MAX_TERMS: return None
    if x.op is Ops.ADD: stack += [(x.src[1], k), (x.src[0], k)]
    elif x.op is Ops.SUB: stack += [(x.src[1], -k), (x.src[0], k)]
    elif x.op is Ops.NEG: stack.append((x.src[0], -k))
    elif x.op is Ops.MUL and x.src[1].op is Ops.CONST: stack.append((x.src[0], k * x.src[1].arg))
    elif x.op is Ops.MUL and x.src[0].op is Ops.CONST: stack.append((x.src[1], k * x.src[0].arg))
    elif x.op is Ops.CONST: const += k * x.arg
    else: coefs[x] = coefs.get(x, 0) + k
  return list(coefs.items()), const


def _wrap(dt: DType, v: int) -> int:
  m = v & ((1 << dt.bits) - 1)
  return m - (1 << dt.bits) if dt.kind == "i" and m >= 1 << (dt.bits - 1) else m


def _build(dt: DType, terms: list[tuple[UOp, int]], const: int) -> UOp:
  """Canonical sum: terms in order (coefficients wrapped into dt, zeros dropped), the constant last.

  Nodes are made directly, not through the operators: every base is a non-constant dt node and every coefficient and the
  constant are non-zero, so no construction fold could apply (and this runs on every integer ADD the simplifier meets)."""
  out: UOp | None = None
  for b, k in terms:
    if (k := _wrap(dt, k)) == 0: continue
    t = b if k == 1 else UOp(Ops.MUL, dt, (b, UOp(Ops.CONST, dt, (), k)))
    out = t if out is None else UOp(Ops.ADD, dt, (out, t))
  const = _wrap(dt, const)
  if out is None: return UOp.const(dt, const)
  return UOp(Ops.ADD, dt, (out, UOp(Ops.CONST, dt, (), const))) if const else out


def _term_range(b: UOp, k: int) -> tuple[int, int]:
  lo, hi = int(b.vmin) * k, int(b.vmax) * k
  return min(lo, hi), max(lo, hi)


def _sum_range(terms: list[tuple[UOp, int]], const: int) -> tuple[int, int]:
  """The range of the sum over Z (no wrap), from each base's bounds."""
  rs = [_term_range(b, k) for b, k in terms]
  return sum(r[0] for r in rs) + const, sum(r[1] for r in rs) + const


# ---- rule functions ----

def fold_node(x: UOp) -> UOp | None:
  """Construction-time folding, for nodes built raw (UOp(...), JSON) or rebuilt by a rewrite."""
  if x.op is Ops.CAST: return x.src[0].cast(x.dtype) if x.src[0].op is Ops.CONST else None
  # every fold needs a constant operand or a repeated one: skip the rest cheaply
  if x.op is not Ops.WHERE and not any(s.op is Ops.CONST for s in x.src) and len(set(x.src)) == len(x.src): return None
  return fold_alu(x.op, x.dtype, x.src)


def fold_bounds(x: UOp) -> UOp | None:
  """An integer or bool node whose vmin == vmax is that constant (vmin/vmax are sound, so that is its only value)."""
  if not _intb(x): return None
  lo, hi = x.vmin, x.vmax
  return UOp.const(x.dtype, lo) if lo == hi else None


def combine_terms(x: UOp) -> UOp | None:
  """Canonicalise a signed-int ADD chain: like terms merged (constant factors distributed), one constant, last.

  Ring arithmetic, so exact with wraparound. The canonical form rebuilds to itself, so this reaches a fixed point.
  """
  if not _sint(x) or (t := _terms(x)) is None: return None
  terms, const = t
  if any(b.op in (Ops.IDIV, Ops.MOD) for b, _ in terms):
    if (r := _recombine(terms)) is not None or (r := _hermite(x.dtype, terms)) is not None: return _build(x.dtype, r[0], const + r[1])
  return _build(x.dtype, terms, const)


def _recombine(terms: list[tuple[UOp, int]]) -> tuple[list[tuple[UOp, int]], int] | None:
  """k*(y % c) + k*c*(y // c) -> k*y: C's y == (y/c)*c + y%c for c != 0, so exact mod 2**bits (found in a whole chain, and
  after a common factor was cancelled: (16b+2)%18 + ((16b+2)//18)*18 -> 2*((8b+1)%9) + 18*((8b+1)//9) -> 16b + 2).
  k*(y % a) + k*a*((y // a) % b) -> k*(y % (a*b)) for a, b > 0: truncating division nests (y/a/b == y/(ab)), so both are
  y - (y/(ab))*ab, of any sign; a reshape's digits so add up again ((k//9)*9 + ((k//3)%3)*3 + k%3 -> k)."""
  coef = dict(terms)
  for b, k in terms:
    if (b.op is Ops.MOD and (q := b.src[0]).op is Ops.IDIV and (a := q.src[1]).op is Ops.CONST and (c := b.src[1]).op is Ops.CONST
        and a.arg > 0 and c.arg > 0 and a.arg * c.arg <= b.dtype.max and coef.get(lo := UOp(Ops.MOD, b.dtype, (q.src[0], a))) is not None
        and coef[lo] * a.arg == k):
      merged = UOp(Ops.MOD, b.dtype, (q.src[0], UOp(Ops.CONST, b.dtype, (), a.arg * c.arg)))
      return [(u, v) for u, v in terms if u is not b and u is not lo] + [(merged, coef[lo])], 0
  for b, k in terms:
    if b.op is Ops.MOD and (c := b.src[1]).op is Ops.CONST and c.arg != 0 and coef.get(q := UOp(Ops.IDIV, b.dtype, b.src)) == k * c.arg:
      ys, yc = _terms(b.src[0]) or ([(b.src[0], 1)], 0)
      return [(u, v) for u, v in terms if u is not b and u is not q] + [(y, k * v) for y, v in ys], k * yc
  return None


def _hermite(dt: DType, terms: list[tuple[UOp, int]]) -> tuple[list[tuple[UOp, int]], int] | None:
  """k*((y+r)//n + (y+r+1)//n + ... + (y+r+n-1)//n) -> k*(y+r) (Hermite's identity, for floor: every numerator >= 0), or
  k*(y+r+n-1) (the same for ceil: every numerator <= 0), as unrolling a loop by n makes them."""
  groups: dict[tuple, dict[int, UOp]] = {}
  for b, k in terms:
    if b.op is not Ops.IDIV or (n := b.src[1]).op is not Ops.CONST or n.arg < 2 or (t := _terms(b.src[0])) is None: continue
    if not _fits(dt, *_sum_range(*t)) or (sign := (b.src[0].vmin >= 0) - (b.src[0].vmax <= 0)) == 0: continue
    groups.setdefault((tuple(t[0]), n.arg, k, sign), {})[t[1]] = b
  for (sterms, n, k, sign), by_r in groups.items():
    for r in sorted(by_r):
      if all(r + j in by_r for j in range(n)):
        used = {by_r[r + j] for j in range(n)}
        return [(u, v) for u, v in terms if u not in used] + [(b, k * c) for b, c in sterms], k * (r if sign > 0 else r + n - 1)
  return None


def _same_sign(xlo: int, xhi: int, rlo: int, rhi: int) -> bool:
  """trunc((c*S + R) / c) == S + trunc(R / c) at every point when R is 0 or R has the sign of the whole numerator."""
  return (rlo == rhi == 0) or (xlo >= 0 and rlo >= 0) or (xhi <= 0 and rhi <= 0)


def _tdiv(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def _tmod(a: int, b: int) -> int: return a - b * _tdiv(a, b)


def _floor_fold(terms: list[tuple[UOp, int]], const: int, m: int, mod: bool) -> tuple[list[tuple[UOp, int]], int] | None:
  """For N = sum + const >= 0 everywhere (so // is floor): N // m or N % m as a linear form, when N == m*Q + R with R's floor
  over m one value k everywhere (then N // m == Q + k, N % m == R - k*m). Coefficients are cut to residues, the small ones
  (|r| <= m/2) tried first, then those in [0, m)."""
  r0 = const % m
  for sym in (True, False):
    rem = [(b, k % m - m if sym and k % m > m // 2 else k % m) for b, k in terms]
    lo, hi = _sum_range(rem, r0)
    if (k := lo // m) != hi // m: continue
    if mod: return rem, r0 - k * m
    return [(b, (c - r) // m) for (b, c), (_, r) in zip(terms, rem)], (const - r0) // m + k
  return None


def _linear_fold(terms: list[tuple[UOp, int]], const: int, m: int, mod: bool, xlo: int, xhi: int) -> tuple[list[tuple[UOp, int]], int] | None:
  """N // m or N % m (m > 1, N = sum + const never wraps) with no division left, or None."""
  if len(terms) == 1 and (b := terms[0][0]).vmax - b.vmin == 1:  # one base with two values: the line through both results
    k, lo = terms[0][1], int(b.vmin)
    y0, y1 = (_tmod(k * v + const, m) if mod else _tdiv(k * v + const, m) for v in (lo, lo + 1))
    return [(b, y1 - y0)], y0 - (y1 - y0) * lo
  if xlo >= 0: return _floor_fold(terms, const, m, mod)
  if xhi <= 0 and (r := _floor_fold([(b, -k) for b, k in terms], -const, m, mod)) is not None:  # N//m == -((-N)//m), same for %
    return [(b, -k) for b, k in r[0]], -r[1]
  return None


def _const_split(dt: DType, terms: list[tuple[UOp, int]], const: int, m: int, mod: bool, xlo: int, xhi: int) -> UOp | None:
  """(S + d) // m -> (S + r) // m + q with the smallest |r| that keeps the identity, and (S + d) % m -> (S + r) % m.

  // truncates, so it is floor where the numerator is >= 0 and ceil where it is <= 0. Two numerators congruent mod m agree
  (up to the multiple q) when both are >= 0 or both <= 0; and a numerator N >= 0 may move to the ceil side as N - (m-1),
  one <= 0 to the floor side as N + (m-1) (floor(N/m) == ceil((N-m+1)/m)). % only takes the first kind.
  """
  slo, shi = _sum_range(terms, 0)
  classes: list[tuple[int, bool]] = []  # (what the new numerator's constant is congruent to, whether it must stay >= 0)
  if xlo >= 0: classes += [(const, True)] + ([] if mod else [(const - m + 1, False)])
  if xhi <= 0: classes += [(const, False)] + ([] if mod else [(const + m - 1, True)])
  cands = [(abs(r), -r, r, e) for e, ge in classes for r in (e % m, e % m - m)
           if (slo + r >= 0 if ge else shi + r <= 0) and _fits(dt, slo + r, shi + r)]
  if not cands or (best := min(cands))[2] == const: return None
  _, _, r, e = best
  s = _build(dt, terms, r)
  return s % m if mod else s // m + (e - r) // m


def _below_factor(dt: DType, terms: list[tuple[UOp, int]], const: int, m: int, mod: bool) -> UOp | None:
  """(S + d) % m -> S % m + d and (S + d) // m -> S // m, where S >= 0 is a sum of multiples of g = gcd(m, its
  coefficients) > 1 and 0 < d < g: S % m is a multiple of g of at most m - g, so adding d never carries into the next
  multiple of m. A vector's lanes over a row of channels, (16i + lane) % 48: each lane is then the base plus its lane,
  one contiguous load, where each was a remainder and a scalar load of its own."""
  g = math.gcd(m, *(k for _, k in terms))
  if g <= 1 or not 0 < const < g or _sum_range(terms, 0)[0] < 0: return None
  s = _build(dt, terms, 0)
  return s % m + const if mod else s // m


def divmod_fold(x: UOp, c: UOp, mod: bool) -> UOp | None:
  """x // c and x % c for a constant c > 1 and a numerator that cannot wrap, first rule that applies:
  a common factor cancelled; no division left (two-valued base, or congruence: the remainder's quotient is one value);
  a constant below the terms' common factor with c split off; multiples of c split off; the constant brought to its
  smallest residue; x // c as (x // f) // (c / f) when x // f folds."""
  if not _sint(x) or (cv := c.arg) <= 1 or (t := _terms(x)) is None: return None
  terms, const = t
  dt: DType = x.dtype
  xlo, xhi = _sum_range(terms, const)
  if not _fits(dt, xlo, xhi): return None  # the built numerator may wrap: its value is not the sum over Z
  # gcd: (g*y) // (g*d) == y // d and (g*y) % (g*d) == g*(y % d) exactly, for truncation too
  if (g := math.gcd(cv, const, *(k for _, k in terms))) > 1:
    y = _build(dt, [(b, k // g) for b, k in terms], const // g)
    return (y % (cv // g)) * g if mod else y // (cv // g)
  if (lin := _linear_fold(terms, const, cv, mod, xlo, xhi)) is not None: return _build(dt, *lin)
  if (low := _below_factor(dt, terms, const, cv, mod)) is not None: return low
  quot = [(b, k // cv) for b, k in terms if k % cv == 0]
  rem = [(b, k) for b, k in terms if k % cv != 0]
  qconst, rconst = (const // cv, 0) if const % cv == 0 else (0, const)
  if (quot or qconst) and _same_sign(xlo, xhi, *_sum_range(rem, rconst)):
    r = _build(dt, rem, rconst)
    return r % c if mod else _build(dt, quot, qconst) + r // c
  if (split := _const_split(dt, terms, const, cv, mod, xlo, xhi)) is not None: return split
  # trunc(trunc(x/f)/(c/f)) == trunc(x/c) for f, c/f > 0: worth it when x // f has no division left
  for f in [] if mod else sorted({abs(k) for _, k in terms if 1 < abs(k) < cv and cv % abs(k) == 0}):
    if (lin := _linear_fold(terms, const, f, False, xlo, xhi)) is not None: return _build(dt, *lin) // (cv // f)
  return None


def neg_divmod(d: UOp) -> UOp | None:
  """(y // c) * -1 -> (-y) // c and (y % c) * -1 -> (-y) % c (truncation is odd: -(y//c) == (-y)//c), when -y cannot wrap
  and has fewer negative terms than y, so an index reads as (i + 3) // 4, not ((-i - 3) // 4) * -1."""
  if not _sint(d) or (t := _terms(d.src[0])) is None: return None
  terms, const = t
  lo, hi = _sum_range(terms, const)
  if not (_fits(d.dtype, lo, hi) and _fits(d.dtype, -hi, -lo)) or 2 * sum(k < 0 for _, k in terms) <= len(terms): return None
  return _build(d.dtype, [(b, -k) for b, k in terms], -const).alu(d.op, d.src[1])


def mod_self(x: UOp, y: UOp) -> UOp | None:
  """x % y -> x when |x| < |y| everywhere (truncating mod keeps the dividend then)."""
  if not _int(x): return None
  xm = max(abs(int(x.vmin)), abs(int(x.vmax)))
  if int(y.vmin) > 0 and xm < int(y.vmin): return x
  if int(y.vmax) < 0 and xm < -int(y.vmax): return x
  return None


def cmp_add(x: UOp, c1: UOp, c2: UOp) -> UOp | None:
  """x + c1 < c2 -> x < c2 - c1, when x + c1 cannot wrap and c2 - c1 fits."""
  if not _int(x): return None
  dt: DType = x.dtype
  if not _fits(dt, int(x.vmin) + c1.arg, int(x.vmax) + c1.arg) or not _fits(dt, c2.arg - c1.arg, c2.arg - c1.arg): return None
  return x < UOp.const(dt, c2.arg - c1.arg)


def cmp_mul(x: UOp, c1: UOp, c2: UOp) -> UOp | None:
  """x * c1 < c2 -> x < ceil(c2 / c1) for c1 > 0, when x * c1 cannot wrap."""
  if not _int(x) or c1.arg <= 0: return None
  dt: DType = x.dtype
  if not _fits(dt, int(x.vmin) * c1.arg, int(x.vmax) * c1.arg): return None
  return x < UOp.const(dt, -((-c2.arg) // c1.arg))


def below(x: UOp, y: UOp) -> bool:
  """0 <= x < y at every point, proven from bounds and terms: y - x > 0 with each RANGE x counts up taken at its end - 1, so a
  loop index is below its own end (r // n -> 0 and r % n -> r for r in range(n)). Both sides must not wrap."""
  if not _int(x) or x.vmin < 0 or (tx := _terms(x)) is None or (ty := _terms(y)) is None: return False
  if not (_fits(x.dtype, *_sum_range(*tx)) and _fits(x.dtype, *_sum_range(*ty))): return False
  diff: dict[UOp, int] = {}
  for b, k in ty[0] + [(b, -k) for b, k in tx[0]]: diff[b] = diff.get(b, 0) + k
  const = ty[1] - tx[1]
  for b, k in list(diff.items()):  # -k*r >= -k*(end - 1) for k > 0, r a loop index counting from >= 0
    if k < 0 and b.op is Ops.RANGE and int(b.src[0].vmin if len(b.src) == 2 else 0) >= 0 and (te := _terms(b.src[-1])) is not None:
      del diff[b]
      for e, c in te[0]: diff[e] = diff.get(e, 0) + k * c
      const += k * te[1] - k
  return _sum_range(list(diff.items()), const)[0] > 0


def _lt_reduce(terms: list[tuple[UOp, int]], k: int) -> tuple[list[tuple[UOp, int]], int]:
  """sum(terms) < k as sum(A) < k': the terms whose coefficients share a factor d > 1 divided by it, when the others (R) cannot
  decide: with no multiple of d in [k - max R, k - min R - 1], d*A + R < k iff d*A + min R < k iff A < ceil((k - min R) / d)."""
  if (big := [abs(c) for _, c in terms if abs(c) > 1]) and (d := math.gcd(*big)) > 1:
    rlo, rhi = _sum_range([(b, c) for b, c in terms if c % d], 0)
    if -((rhi - k) // d) * d > k - rlo - 1: return [(b, c // d) for b, c in terms if c % d == 0], -((rlo - k) // d)
  return terms, k


def _lt_out(dt: DType, a: list[tuple[UOp, int]], k: int, const_left: bool) -> UOp | None:
  """sum(a) < k, built with positive coefficients where it can: all negative turns round (-P < k <=> -k < P); mixed keeps the
  side the constant was on. None when a constant or a sum would not fit dt."""
  flip = all(c < 0 for _, c in a) or (const_left and not all(c > 0 for _, c in a))
  lo, hi = _sum_range(a, 0)
  if not (_fits(dt, -k, -k) and _fits(dt, -hi, -lo)) if flip else not (_fits(dt, k, k) and _fits(dt, lo, hi)): return None
  return UOp.const(dt, -k) < _build(dt, [(b, -c) for b, c in a], 0) if flip else _build(dt, a, 0) < UOp.const(dt, k)


def lt_const(x: UOp, c: UOp) -> UOp | None:
  """x < c for a linear x that cannot wrap: the constant moved right, a common factor divided out ((4i + f) < 512 -> i < 128
  for f in [0, 3]), an all-negative sum turned round."""
  if not _sint(x) or (t := _terms(x)) is None or not t[0] or not _fits(x.dtype, *_sum_range(*t)): return None
  return _lt_out(x.dtype, *_lt_reduce(t[0], c.arg - t[1]), False)


def const_lt(c: UOp, x: UOp) -> UOp | None:
  """c < x as -x < -c, reduced as lt_const, kept with the constant on the left."""
  if not _sint(x) or (t := _terms(x)) is None or not t[0] or not _fits(x.dtype, *_sum_range(*t)): return None
  return _lt_out(x.dtype, *_lt_reduce([(b, -k) for b, k in t[0]], t[1] - c.arg), True)


def neg_lt(x: UOp, y: UOp) -> UOp | None:
  """-a < -b -> b < a: x < y iff -y < -x, when both sides are sums of negative terms only and their negations cannot wrap."""
  if not _sint(x) or (tx := _terms(x)) is None or (ty := _terms(y)) is None or not tx[0] or not ty[0]: return None
  if any(k > 0 for _, k in tx[0] + ty[0]) or not all(_fits(x.dtype, *_sum_range(*t)) for t in (tx, ty)): return None
  negs = [([(b, -k) for b, k in t[0]], -t[1]) for t in (tx, ty)]
  if not all(_fits(x.dtype, *_sum_range(*t)) for t in negs): return None
  return _build(x.dtype, *negs[1]) < _build(x.dtype, *negs[0])


def _div_lt(k: int, c: int) -> int:
  """trunc(x / c) < k iff x < _div_lt(k, c), for c > 0: k*c when k >= 1 (the quotient reaches k at x = k*c), else (k-1)*c + 1
  (a quotient <= k-1 <= -1 needs x <= (k-1)*c)."""
  return k * c if k >= 1 else (k - 1) * c + 1


def div_lt(x: UOp, c: UOp, k: UOp) -> UOp | None:
  """x // c < k -> x < k*c (so i//4 < 3 -> i < 12), c > 0."""
  if not _sint(x) or c.arg <= 0 or not _fits(x.dtype, b := _div_lt(k.arg, c.arg), b): return None
  return x < UOp.const(x.dtype, b)


def lt_div(k: UOp, x: UOp, c: UOp) -> UOp | None:
  """k < x // c iff not (x // c < k + 1) iff x >= _div_lt(k + 1, c), c > 0."""
  if not _sint(x) or c.arg <= 0 or not _fits(x.dtype, b := _div_lt(k.arg + 1, c.arg) - 1, b): return None
  return UOp.const(x.dtype, b) < x


def cast_cast(o: UOp, i: UOp, x: UOp) -> UOp | None:
  """cast(cast(x, A), B) -> cast(x, B) when the inner cast keeps every value of x exactly."""
  sd, ad = x.dtype, i.dtype
  if "p" in (sd.kind, ad.kind) or sd.count != 1: return None
  keeps = (sd.is_bool and not ad.is_bool) or (sd.is_int and ad.is_int and _fits(ad, int(x.vmin), int(x.vmax))) or \
    (sd.is_float and ad.is_float and ad.itemsize > sd.itemsize)  # f16/bf16 -> f32/f64, f32 -> f64
  return x.cast(o.dtype) if keeps else None


def narrow_sum(o: UOp, x: UOp) -> UOp | None:
  """cast(sum, narrower int) -> the sum of the cast terms, built in the narrow dtype: keeping the low bits is a ring map
  (mod 2**n of a sum or product is the sum or product mod 2**n), so exact with wraparound; fires when a term was widened
  from that dtype, whose cast then drops (cast(cast(i, int64)*4 + 3, int32) -> i*4 + 3)."""
  dt, sd = o.dtype, x.dtype
  if not (_int(o) and _sint(x) and dt.bits <= sd.bits) or (t := _terms(x)) is None: return None
  if not any(b.op is Ops.CAST and b.src[0].dtype == dt for b, _ in t[0]): return None
  return _build(dt, [(b.cast(dt), k) for b, k in t[0]], t[1])


def _uses(x: UOp) -> bool: return x.op is not Ops.CONST


# ---- the tables ----

C = UPat.cvar
V = UPat.var

# ring identities: exact for signed ints with wraparound
ring = PatternMatcher([
  # constants to the right of commutative ops
  (UPat(GroupOp.Commutative, src=(UPat(Ops.CONST, name="c"), UPat(name="x", custom=_uses)), name="n"),
   lambda n, c, x: x.alu(n.op, c) if _intb(n) or n.op in GroupOp.Comparison else None),
  # x - y -> x + y*-1, -x -> x*-1: one canonical form, so like terms meet
  (UPat(Ops.SUB, name="n", src=(V("x"), V("y"))), lambda n, x, y: x + y * -1 if _sint(n) else None),
  (UPat(Ops.NEG, name="n", src=(V("x"),)), lambda n, x: x * -1 if _sint(n) else None),
  # x + x, x*c1 + x*c2, x*c + x
  (V("x") + V("x"), lambda x: x * 2 if _sint(x) else None),
  (V("x") * C("c1") + V("x") * C("c2"), lambda x, c1, c2: x * (c1.arg + c2.arg) if _sint(x) else None),
  (V("x") * C("c") + V("x"), lambda x, c: x * (c.arg + 1) if _sint(x) else None),
  # (x op c1) op c2 -> x op (c1 op c2) for associative, commutative ops (ints: ring and bitwise; bools: logic)
  (UPat((Ops.ADD, Ops.MUL, Ops.AND, Ops.OR, Ops.XOR, Ops.MAX), name="n", src=(UPat(name="i", src=(V("x"), C("c1"))), C("c2"))),
   lambda n, i, x, c1, c2: x.alu(n.op, c1.alu(n.op, c2)) if i.op is n.op and _intb(n) else None),
  # (x + c) + y -> (x + y) + c: constants bubble out of ADD chains
  (UPat(Ops.ADD, src=(V("x") + C("c"), UPat(name="y", custom=_uses))), lambda x, c, y: (x + y) + c if _int(x) else None),
  # all the above across a whole chain: like terms merged, one constant last
  (UPat(Ops.ADD, name="x"), combine_terms),
  # x << c -> x * 2**c (the same bits mod 2**n)
  (UPat(Ops.SHL, src=(V("x"), C("c"))), lambda x, c: x * (1 << c.arg) if _int(x) and 0 <= c.arg < x.dtype.bits - 1 else None),
])

# rules that need bounds
bounded = PatternMatcher([
  # x // c and x % c by splitting off the multiples of c; x // y -> 0 and x % y -> x when |x| < |y|
  (UPat(Ops.IDIV, src=(V("x"), C("c"))), lambda x, c: divmod_fold(x, c, False)),
  (UPat(Ops.MOD, src=(V("x"), C("c"))), lambda x, c: divmod_fold(x, c, True)),
  # by a negative constant: trunc(x / -c) == -trunc(x / c) and x % -c == x % c (C's remainder takes the dividend's sign)
  (UPat(Ops.IDIV, src=(V("x"), C("c"))), lambda x, c: (x // -c.arg) * -1 if _sint(x) and x.dtype.min < c.arg < 0 else None),
  (UPat(Ops.MOD, src=(V("x"), C("c"))), lambda x, c: x % -c.arg if _sint(x) and x.dtype.min < c.arg < 0 else None),
  ((UPat((Ops.IDIV, Ops.MOD), name="d", src=(V(), C())) * UPat.const(None, -1)), neg_divmod),
  (UPat(Ops.MOD, src=(V("x"), V("y"))), mod_self),
  # a divisor proven above a non-negative dividend (a loop index over its own end): x // y -> 0, x % y -> x
  (UPat(Ops.IDIV, src=(V("x"), V("y"))), lambda x, y: x.const_like(0) if y.op is not Ops.CONST and below(x, y) else None),
  (UPat(Ops.MOD, src=(V("x"), V("y"))), lambda x, y: x if y.op is not Ops.CONST and below(x, y) else None),
  # (x // c1) // c2 -> x // (c1*c2), (x % c1) % c2 -> x % c2 when c2 divides c1 (c1, c2 > 0)
  (UPat(Ops.IDIV, src=(UPat(Ops.IDIV, src=(V("x"), C("c1"))), C("c2"))),
   lambda x, c1, c2: x // (c1.arg * c2.arg) if c1.arg > 0 and c2.arg > 0 and c1.arg * c2.arg <= x.dtype.max else None),
  (UPat(Ops.MOD, src=(UPat(Ops.MOD, src=(V("x"), C("c1"))), C("c2"))),
   lambda x, c1, c2: x % c2 if c1.arg > 0 and c2.arg > 0 and c1.arg % c2.arg == 0 else None),
  # (x // c) * c + x % c -> x (C's a == a/b*b + a%b, b != 0, holds with wraparound too)
  ((V("x") // C("c")) * C("c") + V("x") % C("c"), lambda x, c: x if _int(x) and c.arg != 0 else None),
  # x >> c -> x // 2**c when x >= 0 (the shift floors, truncation agrees on non-negatives)
  (UPat(Ops.SHR, src=(V("x"), C("c"))), lambda x, c: x // (1 << c.arg) if _int(x) and x.vmin >= 0 and 0 <= c.arg < x.dtype.bits - 1 else None),
  # max decided by bounds
  (UPat(Ops.MAX, src=(V("x"), V("y"))),
   lambda x, y: (x if x.vmin >= y.vmax else y if y.vmin >= x.vmax else None) if _int(x) else None),
  # comparisons: x < x
  (V("x") < V("x"), lambda x: UOp.const(dtypes.bool, False) if _intb(x) else None),
  # signed: through sums (constants right, common factors out, signs positive) and through a division by a constant
  ((V("x") // C("c")) < C("k"), div_lt),
  (C("k") < (V("x") // C("c")), lt_div),
  (V("x") < C("c"), lt_const),
  (C("c") < V("x"), const_lt),
  (V("x") < V("y"), neg_lt),
  # unsigned too: x + c1 < c2, x * c1 < c2
  ((V("x") + C("c1")) < C("c2"), cmp_add),
  ((V("x") * C("c1")) < C("c2"), cmp_mul),
])

logic = PatternMatcher([
  # where: bool branches, negated condition, repeated condition
  (UPat(Ops.WHERE, src=(V("c"), UPat.const(dtypes.bool, True), UPat.const(dtypes.bool, False))), lambda c: c),
  (UPat(Ops.WHERE, src=(V("c"), UPat.const(dtypes.bool, False), UPat.const(dtypes.bool, True))), lambda c: c.logical_not()),
  (UPat(Ops.WHERE, src=(UPat(Ops.XOR, src=(V("c"), UPat.const(dtypes.bool, True))), V("a"), V("b"))), lambda c, a, b: c.alu(Ops.WHERE, b, a)),
  (UPat(Ops.WHERE, src=(V("c"), UPat(Ops.WHERE, src=(V("c"), V("a"), UPat())), V("b"))), lambda c, a, b: c.alu(Ops.WHERE, a, b)),
  (UPat(Ops.WHERE, src=(V("c"), V("a"), UPat(Ops.WHERE, src=(V("c"), UPat(), V("b"))))), lambda c, a, b: c.alu(Ops.WHERE, a, b)),
  # a shared condition out of two selects: c ? a : b  op  c ? d : e == c ? (a op d) : (b op e), lane by lane, any dtype
  (UPat((Ops.ADD, Ops.MAX, Ops.MUL), name="n", src=[UPat(Ops.WHERE, src=(V("c"), V("a"), V("b"))), UPat(Ops.WHERE, src=(V("c"), V("d"), V("e")))]),
   lambda n, c, a, b, d, e: c.alu(Ops.WHERE, a.alu(n.op, d), b.alu(n.op, e))),
  # casts: drop an inner cast that keeps every value
  (UPat(Ops.CAST, name="o", src=(UPat(Ops.CAST, name="i", src=(V("x"),)),)), cast_cast),
  # a narrowing cast of a sum goes to its terms
  (UPat(Ops.CAST, name="o", src=(UPat((Ops.ADD, Ops.MUL), name="x"),)), narrow_sum),
])

class _FloatsApart(PatternMatcher):
  """A table whose float-valued nodes try only `floats`, the rules that can fire on them: every other rule is for integers
  and bools, and matching each of them against every node of a float chain only to refuse it is most of the cost there."""

  def __init__(self, rules: list, floats: PatternMatcher):
    super().__init__(rules)
    self.floats = floats

  def rewrite(self, u: UOp, ctx: object = None) -> UOp | None:
    return self.floats.rewrite(u, ctx) if u.dtype.kind == "f" else super().rewrite(u, ctx)


folding = PatternMatcher([(UPat(GroupOp.ALU | {Ops.CAST}, name="x"), fold_node)])
symbolic = _FloatsApart((folding + PatternMatcher([(UPat(GroupOp.ALU | {Ops.CAST}, name="x"), fold_bounds)]) + ring + bounded + logic).rules,
                        folding + logic)


_SIMPLIFIED: dict[UOp, UOp] = {}  # every node's fixed point under `symbolic` (graph_rewrite's memo), bounded below
_SIMPLIFIED_MAX = 1 << 16  # entries; past it a new dict (never cleared in place: a call in another thread keeps its own)


def simplify(u: UOp) -> UOp:
  """u rewritten by the `symbolic` table to a fixed point; the value is unchanged at every point within the variables' bounds.
  Results are shared between calls: lowering simplifies one index at each of 16 lanes, most of its nodes the same
  (a Winograd input transform's 36 window loads: ~1,100 calls)."""
  global _SIMPLIFIED
  if len(_SIMPLIFIED) > _SIMPLIFIED_MAX: _SIMPLIFIED = {}
  return graph_rewrite(u, symbolic, memo=_SIMPLIFIED)


def is_multiple(u: UOp, k: int) -> bool:
  """True when the integer expression u is provably a multiple of the power of two k for every value of its variables:
  every term's coefficient and the constant are (2**bits is a multiple of k, so wraparound keeps it). False when unsure."""
  if k < 1 or k & (k - 1): return False
  if not _int(u) or (terms := _terms(u)) is None: return False
  lin, const = terms
  return const % k == 0 and all(c % k == 0 for _, c in lin)


__all__ = ["symbolic", "simplify", "is_multiple", "ring", "bounded", "logic"]
