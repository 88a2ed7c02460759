"""Symbolic derivations (sympy) shared by the notebooks and the tests.

Each function returns a list of `Identity(name, lhs, rhs)`. An identity holds when
`sympy.simplify(lhs - rhs) == 0`; `Identity.holds()` checks exactly that, and the tests and
notebooks assert it. Sizes are kept small (a few keys, a couple of value dimensions)
because the identities are structural: nothing in them depends on the size.

Notation: scores `s_a = scale·q·k_a`, values `v_{a,j}`, source `ζ_j`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp

from ..core import validate


@dataclass(frozen=True)
class Identity:
    """A claimed equality `lhs == rhs` between sympy expressions."""

    name: str
    lhs: sp.Expr
    rhs: sp.Expr

    def difference(self) -> sp.Expr:
        """`simplify(lhs - rhs)`: zero exactly when the identity holds."""
        return sp.simplify(self.lhs - self.rhs)

    def holds(self) -> bool:
        return self.difference() == 0


def _count(value: Any, name: str, what: str) -> int:
    """A positive int: how many keys (`n`) or value dimensions (`d`) an identity is built on."""
    return validate.check_int(value, name, example=f"`{name}=2` ({what})")


def _scores(s: Any, name: str = "s") -> list:
    """A non-empty sequence of scores (sympy expressions): sums over no keys are undefined."""
    if isinstance(s, str) or not hasattr(s, "__iter__"):
        raise TypeError(
            f"`{name}` must be a sequence of sympy scores, e.g. "
            f"`symbols(3, 2)[0]`, got {validate.describe(s)}."
        )
    items = list(s)
    if not items:
        raise ValueError(
            f"`{name}` is empty; the softmax and the lse need at least one "
            f"term (the lse of none is -inf, which sympy's log(0) gives as "
            f"`zoo`), e.g. `symbols(3, 2)[0]`."
        )
    return items


def _values(s: list, v: Any, d: int | None = None) -> int:
    """`v[a][j]`: one row per score, rows of equal length (`d` if given); returns it."""
    if not isinstance(v, list | tuple) or any(not isinstance(row, list | tuple) for row in v):
        raise TypeError(
            f"`v` must be a list of rows of sympy values, `v[a][j]`, e.g. "
            f"`symbols(3, 2)[1]`, got {validate.describe(v)}."
        )
    rows = [list(row) for row in v]
    width = len(rows[0]) if rows else 0
    if (
        len(rows) != len(s)
        or any(len(row) != width for row in rows)
        or (d is not None and width != d)
    ):
        want = f"{len(s)} rows of {d if d is not None else 'equal length'}"
        raise ValueError(
            f"`v` must hold {want} (one row per score in `s`, one entry per "
            f"value dimension), got rows of lengths {[len(r) for r in rows]}."
        )
    return width


def symbols(n: int, d: int):
    """Scores `s_0..s_{n-1}`, values `v[a][j]` (n × d) and sources `ζ_0..ζ_{d-1}`, all real;
    `n, d >= 1`."""
    _count(n, "n", "keys")
    _count(d, "d", "value dimensions")
    s = sp.symbols(f"s0:{n}", real=True)
    v = [[sp.Symbol(f"v{a}_{j}", real=True) for j in range(d)] for a in range(n)]
    zeta = sp.symbols(f"zeta0:{d}", real=True)
    return s, v, zeta


def energy_expr(s, v, zeta) -> sp.Expr:
    """F(ζ) = log Σ_a exp(s_a + Σ_j ζ_j v_{a,j}), over at least one score."""
    s = _scores(s)
    zeta = list(zeta) if isinstance(zeta, list | tuple) else _scores(zeta, "zeta")
    _values(s, v, len(zeta))
    return sp.log(
        sum(sp.exp(s[a] + sum(z * v[a][j] for j, z in enumerate(zeta))) for a in range(len(s)))
    )


def softmax_mean(s, v, j: int) -> sp.Expr:
    """E[v_j] under the weights softmax(s); `j` indexes the value dimensions, `[0, d)`."""
    s = _scores(s)
    d = _values(s, v)
    validate.check_int(j, "j", minimum=0, example="`j=0`")
    if j >= d:
        raise ValueError(
            f"`j` = {j} is out of range: `v` has {d} value dimension"
            f"{'s' if d != 1 else ''}, so j must be in [0, {d})."
        )
    den = sum(sp.exp(x) for x in s)
    return sum(sp.exp(s[a]) * v[a][j] for a in range(len(s))) / den


def _at_zero(expr: sp.Expr, zeta) -> sp.Expr:
    return expr.subs({z: 0 for z in zeta})


def gradient_is_attention(n: int = 3, d: int = 2) -> list[Identity]:
    """∂F/∂ζ_j at ζ = 0 equals the softmax-weighted value Σ_a softmax(s)_a v_{a,j}."""
    s, v, zeta = symbols(n, d)
    F = energy_expr(s, v, zeta)
    return [
        Identity(f"dF/dzeta_{j}", _at_zero(sp.diff(F, zeta[j]), zeta), softmax_mean(s, v, j))
        for j in range(d)
    ]


def hessian_is_covariance(n: int = 3, d: int = 2) -> list[Identity]:
    """∂²F/∂ζ_i∂ζ_j at ζ = 0 equals Cov(v_i, v_j) = E[v_i v_j] − E[v_i] E[v_j]."""
    s, v, zeta = symbols(n, d)
    F = energy_expr(s, v, zeta)
    den = sum(sp.exp(x) for x in s)
    out = []
    for i in range(d):
        for j in range(i, d):
            second = sum(sp.exp(s[a]) * v[a][i] * v[a][j] for a in range(n)) / den
            cov = second - softmax_mean(s, v, i) * softmax_mean(s, v, j)
            lhs = _at_zero(sp.diff(F, zeta[i], zeta[j]), zeta)
            out.append(Identity(f"d2F/dzeta_{i}dzeta_{j}", lhs, cov))
    return out


def third_cumulant(n: int = 3) -> list[Identity]:
    """d³F/dζ³ at ζ = 0 (one value dimension) equals the third central moment E[(v − E v)³].

    F is a cumulant-generating function: its first three derivatives at 0 are the mean, the
    variance and the third central moment of v under the attention weights.
    """
    s, v, zeta = symbols(n, 1)
    F = energy_expr(s, v, zeta)
    mean = softmax_mean(s, v, 0)
    den = sum(sp.exp(x) for x in s)
    third = sum(sp.exp(s[a]) * (v[a][0] - mean) ** 3 for a in range(n)) / den
    return [Identity("d3F/dzeta^3", _at_zero(sp.diff(F, zeta[0], 3), zeta), third)]


def value_shift(n: int = 3, d: int = 2) -> list[Identity]:
    """Adding a constant c to every component of every value.

    The source term becomes Σ_j ζ_j (v_{a,j} + c) = ζ·v_a + c Σ_j ζ_j, the same for every key
    `a`, so it leaves the log: F_{v+c}(ζ) = F_v(ζ) + c Σ_j ζ_j, and every component of the
    gradient at 0 (attention) shifts by exactly c.
    """
    s, v, zeta = symbols(n, d)
    c = sp.Symbol("c", real=True)
    shifted = [[x + c for x in row] for row in v]
    F, F_c = energy_expr(s, v, zeta), energy_expr(s, shifted, zeta)
    out = [Identity("F(v + c) = F(v) + c sum_j zeta_j", F_c, F + c * sum(zeta))]
    out += [
        Identity(
            f"dF(v + c)/dzeta_{j} = attention_{j} + c",
            _at_zero(sp.diff(F_c, zeta[j]), zeta),
            softmax_mean(s, v, j) + c,
        )
        for j in range(d)
    ]
    return out


def shift_invariance(n: int = 3) -> list[Identity]:
    """log Σ exp(s_a) = c + log Σ exp(s_a − c) for any c: the safe-max trick (c = max s)."""
    _count(n, "n", "keys")
    s = sp.symbols(f"s0:{n}", real=True)
    c = sp.Symbol("c", real=True)
    lhs = sp.log(sum(sp.exp(x) for x in s))
    rhs = c + sp.log(sum(sp.exp(x - c) for x in s))
    # simplify alone does not merge the logs; expanding exp(x - c) = exp(x)/exp(c) does.
    return [Identity("lse shift by c", lhs, sp.expand_log(sp.expand(rhs), force=True))]


def lse(xs) -> sp.Expr:
    """log Σ exp(x) over a non-empty sequence of sympy expressions.

    The lse of no terms is -inf (the empty state's), but sympy's `log(0)` is `zoo`
    (complex infinity), which no identity can use: an empty `xs` is refused."""
    return sp.log(sum(sp.exp(x) for x in _scores(xs, "xs")))


def _chunk_sizes(sizes: Any, name: str = "sizes", count: int | None = None) -> list[int]:
    """A non-empty sequence of positive ints (of length `count`, if given): chunk sizes."""
    eg = "(2, 2)" if count == 2 else "(2, 3)"
    items = validate.check_sizes_list(sizes, name, eg)
    if count is not None and len(items) != count:
        raise ValueError(f"`{name}` must give {count} chunk sizes, e.g. {eg}, got {len(items)}.")
    return items


def lse_of_union(sizes: tuple[int, ...] = (2, 3)) -> list[Identity]:
    """logsumexp over a union of chunks = logsumexp of the chunks' logsumexps; each chunk
    holds at least one score."""
    sizes = tuple(_chunk_sizes(sizes))
    n = sum(sizes)
    s = sp.symbols(f"s0:{n}", real=True)
    chunks, start = [], 0
    for size in sizes:
        chunks.append(s[start : start + size])
        start += size
    return [Identity(f"lse over chunks {sizes}", lse(s), lse([lse(c) for c in chunks]))]


def combine_expr(a, b):
    """`states.combine` on symbols: a state is `(out, lse)`."""
    (oa, la), (ob, lb) = a, b
    den = sp.exp(la) + sp.exp(lb)
    return ((sp.exp(la) * oa + sp.exp(lb) * ob) / den, sp.log(den))


def combine_associative() -> list[Identity]:
    """combine(combine(a, b), c) == combine(a, combine(b, c)), componentwise."""
    o = sp.symbols("o_a o_b o_c", real=True)
    l = sp.symbols("l_a l_b l_c", real=True)
    a, b, c = zip(o, l, strict=True)
    left = combine_expr(combine_expr(a, b), c)
    right = combine_expr(a, combine_expr(b, c))
    return [
        Identity("combine associative: out", left[0], right[0]),
        Identity("combine associative: lse", left[1], right[1]),
    ]


def combine_commutative() -> list[Identity]:
    """combine(a, b) == combine(b, a)."""
    a = sp.symbols("o_a l_a", real=True)
    b = sp.symbols("o_b l_b", real=True)
    left, right = combine_expr(a, b), combine_expr(b, a)
    return [
        Identity("combine commutative: out", left[0], right[0]),
        Identity("combine commutative: lse", left[1], right[1]),
    ]


def combine_matches_chunks(sizes: tuple[int, int] = (2, 2)) -> list[Identity]:
    """Combining the two chunks' (out, lse) gives full softmax attention over their union;
    `sizes` is two positive ints."""
    sizes = tuple(_chunk_sizes(sizes, count=2))  # type: ignore[assignment]
    n = sum(sizes)
    s, v, _ = symbols(n, 1)
    vals = [row[0] for row in v]

    def state(idx):
        w = [sp.exp(s[a]) for a in idx]
        num = sum(wi * vals[a] for wi, a in zip(w, idx, strict=True))
        return num / sum(w), lse([s[a] for a in idx])

    first, second = range(sizes[0]), range(sizes[0], n)
    out, l = combine_expr(state(first), state(second))
    full = [[x] for x in vals]
    return [
        Identity("combined out = attention", out, softmax_mean(s, full, 0)),
        Identity("combined lse = lse", l, lse(s)),
    ]


def stationary_point(n: int = 3, d: int = 2) -> list[Identity]:
    """Γ(ζ, z) = z·ζ − F(ζ) is stationary at ζ* = 0, z* = ∂F/∂ζ(0) = attention.

    Solves ∂Γ/∂z = 0 for ζ with sympy, substitutes, and solves ∂Γ/∂ζ = 0 for z.
    """
    s, v, zeta = symbols(n, d)
    z = sp.symbols(f"z0:{d}", real=True)
    gamma = sum(zi * zj for zi, zj in zip(z, zeta, strict=True)) - energy_expr(s, v, zeta)
    zeta_sol = sp.solve([sp.diff(gamma, zj) for zj in z], zeta, dict=True)
    assert len(zeta_sol) == 1, zeta_sol
    at_zeta = {zj: zeta_sol[0][zj] for zj in zeta}
    z_sol = sp.solve([sp.diff(gamma, zj).subs(at_zeta) for zj in zeta], z, dict=True)
    assert len(z_sol) == 1, z_sol
    out = [Identity(f"zeta*_{j}", at_zeta[zeta[j]], sp.Integer(0)) for j in range(d)]
    out += [Identity(f"z*_{j}", z_sol[0][z[j]], softmax_mean(s, v, j)) for j in range(d)]
    return out


def symbols_any_n():
    """Symbols for sums over any number of keys: `n` (a positive-integer symbol), the index
    `a`, scores `s[a]` and directional values `w[a]` (sympy `IndexedBase`), and a step `t`.

    Every sum uses the same bound index `a`: sympy's `simplify` combines sums only when their
    indices match, and a bound index means the same in each sum.
    """
    n = sp.Symbol("n", integer=True, positive=True)
    a = sp.Symbol("a", integer=True)
    return (
        n,
        a,
        sp.IndexedBase("s", real=True),
        sp.IndexedBase("w", real=True),
        sp.Symbol("t", real=True),
    )


def expectation_any_n(f: sp.Expr, n, a, s) -> sp.Expr:
    """E_p[f] = Σ_{a=1}^n e^{s_a} f_a / Σ_{a=1}^n e^{s_a}, with `n` a symbol."""
    return sp.Sum(sp.exp(s[a]) * f, (a, 1, n)) / sp.Sum(sp.exp(s[a]), (a, 1, n))


def directional_energy_any_n() -> sp.Expr:
    """F(t·u) = log Σ_{a=1}^n exp(s_a + t·w_a) for any number of keys `n`.

    `u` is any direction of the source ζ and `w_a = u·v_a` the value of key `a` along it, so
    this is the energy of notebook 1 restricted to the line ζ = t·u.
    """
    n, a, s, w, t = symbols_any_n()
    return sp.log(sp.Sum(sp.exp(s[a] + t * w[a]), (a, 1, n)))


def cumulants_any_n() -> list[Identity]:
    """The first three derivatives of t ↦ F(t·u) at t = 0, for any number of keys `n`.

    They are the mean `E[w]`, the variance `E[w²] − E[w]²` and the third central moment
    `E[(w − E w)³]` of `w_a = u·v_a` under the attention weights `softmax(s)`. Since `u` is
    any direction: the gradient of F at 0 is attention (`u·∇F(0) = u·E[v]` for every `u`),
    and the Hessian is the covariance (`uᵀ∇²F(0)u = uᵀ Cov(v) u` for every `u`, and a
    symmetric matrix is fixed by its quadratic form). Proved for symbolic `n`, unlike
    `gradient_is_attention(n, d)`, which checks one instance.
    """
    n, a, s, w, t = symbols_any_n()
    F = directional_energy_any_n()
    mean = expectation_any_n(w[a], n, a, s)
    rhs = [
        mean,
        expectation_any_n(w[a] ** 2, n, a, s) - mean**2,
        expectation_any_n((w[a] - mean) ** 3, n, a, s),
    ]
    names = [
        "dF(tu)/dt = E[u.v] (gradient = attention)",
        "d2F(tu)/dt2 = Var(u.v) (Hessian = covariance)",
        "d3F(tu)/dt3 = E[(u.v - E u.v)^3] (third cumulant)",
    ]
    return [
        Identity(name, sp.diff(F, t, order).subs(t, 0), r)
        for order, (name, r) in enumerate(zip(names, rhs, strict=True), start=1)
    ]


def shift_invariance_any_n() -> list[Identity]:
    """log Σ_{a=1}^n e^{s_a} = c + log Σ_{a=1}^n e^{s_a − c} for any `n` and any `c`."""
    n, a, s, _, _ = symbols_any_n()
    c = sp.Symbol("c", real=True)
    lhs = sp.log(sp.Sum(sp.exp(s[a]), (a, 1, n)))
    return [Identity("lse shift by c, any n", lhs, c + sp.log(sp.Sum(sp.exp(s[a] - c), (a, 1, n))))]


def lse_of_union_any_n() -> list[Identity]:
    """lse over keys 1..n = lse of the two chunks' lse's, keys 1..m and m+1..n, for any
    sizes (`m`, `n` symbols). By induction on the number of chunks this covers any
    chunking."""
    n, a, s, _, _ = symbols_any_n()
    m = sp.Symbol("m", integer=True, positive=True)
    whole = sp.log(sp.Sum(sp.exp(s[a]), (a, 1, n)))
    first, second = (sp.log(sp.Sum(sp.exp(s[a]), (a, lo, hi))) for lo, hi in ((1, m), (m + 1, n)))
    return [Identity("lse over chunks 1..m and m+1..n", whole, lse([first, second]))]


def combine_matches_chunks_any_n() -> list[Identity]:
    """Combining two chunks' states gives the state of their union, for any chunk sizes.

    Two steps, each an identity: (1) for any positive sums `X` (of e^{s_a}) and `Y` (of
    e^{s_a} w_a), `combine((Y1/X1, log X1), (Y2/X2, log X2)) = ((Y1+Y2)/(X1+X2),
    log(X1+X2))`; (2) the sums over keys 1..m and m+1..n add up to the sums over 1..n, for
    symbolic `m` and `n`. So the combined state is (attention, lse) of the union.
    """
    n, a, s, w, _ = symbols_any_n()
    m = sp.Symbol("m", integer=True, positive=True)
    x1, x2, y1, y2 = sp.symbols("X1 X2 Y1 Y2", positive=True)
    out, l = combine_expr((y1 / x1, sp.log(x1)), (y2 / x2, sp.log(x2)))

    def split(f):
        return (sp.Sum(f, (a, 1, m)) + sp.Sum(f, (a, m + 1, n)), sp.Sum(f, (a, 1, n)))

    return [
        Identity("combine out = (Y1 + Y2)/(X1 + X2)", out, (y1 + y2) / (x1 + x2)),
        Identity("combine lse = log(X1 + X2)", l, sp.log(x1 + x2)),
        Identity("sum of e^s over 1..m and m+1..n = over 1..n", *split(sp.exp(s[a]))),
        Identity("sum of e^s w over 1..m and m+1..n = over 1..n", *split(sp.exp(s[a]) * w[a])),
    ]


ANY_N = {
    "cumulants_any_n": cumulants_any_n,
    "shift_invariance_any_n": shift_invariance_any_n,
    "lse_of_union_any_n": lse_of_union_any_n,
    "combine_matches_chunks_any_n": combine_matches_chunks_any_n,
}
"""Identities proved for a symbolic number of keys (kept out of `ALL`, whose count the CLI
demo prints)."""


ALL = {
    "gradient_is_attention": gradient_is_attention,
    "hessian_is_covariance": hessian_is_covariance,
    "shift_invariance": shift_invariance,
    "lse_of_union": lse_of_union,
    "combine_associative": combine_associative,
    "combine_commutative": combine_commutative,
    "combine_matches_chunks": combine_matches_chunks,
    "stationary_point": stationary_point,
}


def verify_all() -> dict[str, bool]:
    """Run every derivation; `{identity name: holds}`."""
    return {ident.name: ident.holds() for make in ALL.values() for ident in make()}  # type: ignore[operator]
