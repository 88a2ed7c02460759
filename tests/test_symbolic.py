import pytest
import sympy as sp

from tree_attention_edu.theory import symbolic


@pytest.mark.parametrize("name", sorted(symbolic.ALL))
def test_identity_holds(name):
    for ident in symbolic.ALL[name]():
        assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name


def test_a_false_identity_is_caught():
    """The check can fail: a wrong Hessian (second moment without the mean term) is rejected."""
    s, v, zeta = symbolic.symbols(3, 1)
    F = symbolic.energy_expr(s, v, zeta)
    second = sum(sp.exp(s[a]) * v[a][0] ** 2 for a in range(3)) / sum(sp.exp(x) for x in s)
    wrong = symbolic.Identity("wrong", sp.diff(F, zeta[0], 2).subs(zeta[0], 0), second)
    assert not wrong.holds()


def test_verify_all():
    results = symbolic.verify_all()
    assert len(results) >= 15 and all(results.values())


def test_value_shift_is_not_c_times_zeta():
    """Adding c to every value shifts the source term by c·Σ_j ζ_j, not by c·ζ_j: with two value
    dimensions the second claim is rejected."""
    s, v, zeta = symbolic.symbols(3, 2)
    c = sp.Symbol("c", real=True)
    shifted = symbolic.energy_expr(s, [[x + c for x in row] for row in v], zeta)
    unshifted = symbolic.energy_expr(s, v, zeta)
    assert symbolic.Identity("right", shifted, unshifted + c * sum(zeta)).holds()
    assert not symbolic.Identity("wrong", shifted, unshifted + c * zeta[0]).holds()


def test_third_cumulant_is_not_the_raw_moment():
    """The third derivative is the central moment: the raw moment E[v³] is rejected."""
    s, v, zeta = symbolic.symbols(3, 1)
    F = symbolic.energy_expr(s, v, zeta)
    raw = sum(sp.exp(s[a]) * v[a][0] ** 3 for a in range(3)) / sum(sp.exp(x) for x in s)
    wrong = symbolic.Identity("wrong", sp.diff(F, zeta[0], 3).subs(zeta[0], 0), raw)
    assert not wrong.holds()


@pytest.mark.parametrize("make", [symbolic.third_cumulant, symbolic.value_shift])
def test_exercise_identities_hold(make):
    """Derivations behind notebook 1's exercises (kept out of `ALL`, whose count the CLI demo
    prints)."""
    idents = make()
    assert idents and all(sp.simplify(i.lhs - i.rhs) == 0 for i in idents)


@pytest.mark.parametrize("name", sorted(symbolic.ANY_N))
def test_identity_holds_for_any_n(name):
    """Proved with a symbolic number of keys n (sympy Sum over IndexedBase), not an instance."""
    idents = symbolic.ANY_N[name]()
    assert idents and all(i.holds() for i in idents)
    n = sp.Symbol("n", integer=True, positive=True)
    assert any(n in i.lhs.free_symbols | i.rhs.free_symbols for i in idents)  # every n


def test_any_n_checks_can_fail():
    """Wrong claims with symbolic n are rejected: the Hessian is not the raw second moment, the
    third derivative not the raw third moment, the fourth not the fourth central moment, and
    overlapping chunks do not give the lse of the union."""
    n, a, s, w, t = symbolic.symbols_any_n()
    F = symbolic.directional_energy_any_n()
    mean = symbolic.expectation_any_n(w[a], n, a, s)
    wrong = [
        (2, symbolic.expectation_any_n(w[a] ** 2, n, a, s)),
        (3, symbolic.expectation_any_n(w[a] ** 3, n, a, s)),
        (4, symbolic.expectation_any_n((w[a] - mean) ** 4, n, a, s)),
    ]
    for order, rhs in wrong:
        assert not symbolic.Identity("wrong", sp.diff(F, t, order).subs(t, 0), rhs).holds()
    m = sp.Symbol("m", integer=True, positive=True)
    whole = sp.log(sp.Sum(sp.exp(s[a]), (a, 1, n)))
    overlap = symbolic.lse(
        [sp.log(sp.Sum(sp.exp(s[a]), (a, 1, m))), sp.log(sp.Sum(sp.exp(s[a]), (a, m, n)))]
    )
    assert not symbolic.Identity("overlapping chunks", whole, overlap).holds()


def test_combine_of_overlapping_chunks_is_not_the_union():
    """The chunk-split step can fail: sums over 1..m and m..n (key m twice) are rejected."""
    n, a, s, _, _ = symbolic.symbols_any_n()
    m = sp.Symbol("m", integer=True, positive=True)
    twice = sp.Sum(sp.exp(s[a]), (a, 1, m)) + sp.Sum(sp.exp(s[a]), (a, m, n))
    assert not symbolic.Identity("overlap", twice, sp.Sum(sp.exp(s[a]), (a, 1, n))).holds()
