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
